#!/usr/bin/env python3
"""The loops of built kernels in SASS, counted by opcode: the main loop's evidence without a GPU.

A loop is the span from a backward branch's target to the branch; the innermost ones (no other
loop of --min-size instructions inside) are listed per kernel whose mangled name matches --kernel, the largest first, with
their instruction count and opcode histogram (predicates and modifiers dropped: FFMA.FTZ is FFMA).
--per N also divides the counts by N (e.g. the elements one iteration handles per thread).

cuobjdump prints SASS through nvdisasm: both are taken from PATH, CUDA_HOME/bin, or NVIDIA's pip
wheels in this Python (`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`: a machine with
nvcc alone has neither).

    python scripts/sass_loops.py flashinfer_cake/aot/causal_conv1d_w_fp32_b_fp32_sm_90a_*.so \\
        --kernel 'bwd_kernelINS_9BwdTraitsILi8E.*Lb1ELb0ELb0E' --per 32
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)\s*$")


@dataclass
class Loop:
    start: int  # address of the branch's target
    end: int  # address of the backward branch
    opcodes: collections.Counter

    @property
    def count(self) -> int:
        return sum(self.opcodes.values())


def find_tool(name: str) -> str:
    """name's executable: PATH, CUDA_HOME/bin, then NVIDIA's wheels (site-packages/nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [Path(os.environ["CUDA_HOME"]) / "bin"] if os.environ.get("CUDA_HOME") else []
    dirs += sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/cu*/bin"))
    for d in dirs:
        if (d / name).is_file():
            return str(d / name)
    raise SystemExit(f"{name} not found on PATH, in CUDA_HOME/bin or in NVIDIA's wheels: "
                     f"pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or put the CUDA toolkit's bin on PATH)")


def opcode(text: str) -> str:
    """The instruction's opcode without its predicate and modifiers ('@!P0 FFMA.FTZ R1, ...' -> 'FFMA')."""
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump's SASS split per function: name -> [(address, instruction text)]."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = out.setdefault(line.split("Function :", 1)[1].strip(), [])
        elif current is not None:
            m = _INSTRUCTION.search(line)
            if m:
                current.append((int(m.group(1), 16), m.group(2)))
    return out


def innermost_loops(instructions: list[tuple[int, str]], min_size: int = 0) -> list[Loop]:
    """The loops of min_size instructions or more that contain no other such loop, the largest first
    (a short inner loop, e.g. a rare event's copy loop, does not hide the loop around it)."""
    loops = []
    for address, text in instructions:
        m = _BRANCH_TARGET.search(text)
        if m and opcode(text) == "BRA" and int(m.group(1), 16) <= address:
            lo = int(m.group(1), 16)
            loops.append(Loop(lo, address, collections.Counter(opcode(t) for a, t in instructions if lo <= a <= address)))
    loops = [loop for loop in loops if loop.count >= min_size]
    inner = [s for s in loops if not any(o is not s and s.start <= o.start and o.end <= s.end for o in loops)]
    return sorted(inner, key=lambda loop: -loop.count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", type=Path, help="a built module (.so) or object file (.o)")
    parser.add_argument("--kernel", default="", help="regex on the mangled kernel names (default: every kernel)")
    parser.add_argument("--loops", type=int, default=2, help="the largest innermost loops per kernel (default 2)")
    parser.add_argument("--min-size", type=int, default=64, help="loops shorter than this are left out, and do not hide the loops around them (default 64)")
    parser.add_argument("--per", type=float, default=None, help="also each count divided by this")
    args = parser.parse_args(argv)
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(find_tool("nvdisasm")).parent), os.environ.get("PATH", "")]))
    run = subprocess.run([find_tool("cuobjdump"), "--dump-sass", str(args.module)], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise SystemExit(f"cuobjdump --dump-sass {args.module} failed ({run.returncode}): {run.stderr.strip()[:500]}")
    kernels = {n: i for n, i in functions(run.stdout).items() if re.search(args.kernel, n)}
    if not kernels:
        raise SystemExit(f"--kernel {args.kernel!r}: no kernel of {args.module} matches")
    for name, instructions in kernels.items():
        print(f"{name}: {len(instructions)} instructions")
        for loop in innermost_loops(instructions, args.min_size)[: args.loops]:
            per = f" ({loop.count / args.per:.2f} per {args.per:g})" if args.per else ""
            print(f"  loop {loop.start:#x}-{loop.end:#x}: {loop.count} instructions{per}")
            print("    " + ", ".join(f"{op} {n}" + (f" ({n / args.per:.2f})" if args.per else "")
                                   for op, n in loop.opcodes.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
