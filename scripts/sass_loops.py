#!/usr/bin/env python3
"""The loops of built kernels in SASS, counted by opcode: the main loop's evidence without a GPU.

A loop is the span from a backward branch's target to the branch (not a divergence fallback, which
returns past an EXIT). Every loop of --min-size instructions or more is listed per kernel whose
mangled name matches --kernel, in address order and indented by nesting, with its instruction count
and opcode histogram (predicates and modifiers dropped: FFMA.FTZ is FFMA; an outer loop's counts
include its inner loops'). --per N also divides the counts by N (e.g. the elements one iteration
handles per thread). A kernel built into several translation units of a module (the backward's
reduce kernels) is listed once, with its number of copies.

cuobjdump prints SASS through nvdisasm: both are taken from PATH, CUDA_HOME/bin, the directory of the
nvcc on PATH, or NVIDIA's pip wheels in this Python (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`: a machine with nvcc alone may have neither).

    python scripts/aot_build.py --arch sm_90a    # or any prebuilt module, e.g. flashinfer-cake build --out DIR
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
    depth: int = 0  # how many listed loops contain it

    @property
    def count(self) -> int:
        return sum(self.opcodes.values())


def find_tool(name: str) -> str:
    """name's executable: PATH, CUDA_HOME/bin, nvcc's directory, then NVIDIA's wheels (site-packages/nvidia/*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [Path(os.environ["CUDA_HOME"]) / "bin"] if os.environ.get("CUDA_HOME") else []
    if shutil.which("nvcc"):
        dirs.append(Path(shutil.which("nvcc")).resolve().parent)
    dirs += sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin"))
    for d in dirs:
        if (d / name).is_file():
            return str(d / name)
    raise SystemExit(f"{name} not found on PATH, in CUDA_HOME/bin, beside nvcc or in NVIDIA's wheels: "
                     f"pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or put the CUDA toolkit's bin on PATH)")


def opcode(text: str) -> str:
    """The instruction's opcode without its predicate and modifiers ('@!P0 FFMA.FTZ R1, ...' -> 'FFMA')."""
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def functions(sass: str) -> list[tuple[str, int, list[tuple[int, str]]]]:
    """cuobjdump's SASS split per function: [(name, copies, [(address, instruction text)])], identical copies
    of a function (one per translation unit that builds it) merged."""
    found: list[tuple[str, list[tuple[int, str]]]] = []
    for line in sass.splitlines():
        if "Function :" in line:
            found.append((line.split("Function :", 1)[1].strip(), []))
        elif found:
            m = _INSTRUCTION.search(line)
            if m:
                found[-1][1].append((int(m.group(1), 16), m.group(2)))
    merged: dict[tuple[str, tuple], list] = {}
    for name, instructions in found:
        entry = merged.setdefault((name, tuple(instructions)), [name, 0, instructions])
        entry[1] += 1
    return [tuple(entry) for entry in merged.values()]


def loops(instructions: list[tuple[int, str]], min_size: int = 0) -> list[Loop]:
    """The loops of min_size instructions or more, in address order, each with its nesting depth among them."""
    found = []
    for address, text in instructions:
        m = _BRANCH_TARGET.search(text)
        if not (m and opcode(text) == "BRA" and int(m.group(1), 16) < address):
            continue
        lo = int(m.group(1), 16)
        body = [t for a, t in instructions if lo <= a <= address]
        if any(opcode(t) == "EXIT" and not t.lstrip().startswith("@") for t in body):
            continue  # a divergence fallback's jump back, not a loop
        if len(body) >= min_size:
            found.append(Loop(lo, address, collections.Counter(opcode(t) for t in body)))
    found.sort(key=lambda loop: (loop.start, -loop.end))
    for loop in found:
        loop.depth = sum(o is not loop and o.start <= loop.start and loop.end <= o.end for o in found)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", type=Path, help="a built module (.so) or object file (.o)")
    parser.add_argument("--kernel", default="", help="regex on the mangled kernel names (default: every kernel)")
    parser.add_argument("--min-size", type=int, default=64, help="loops shorter than this are left out (default 64)")
    parser.add_argument("--per", type=float, default=None, help="also each count divided by this")
    args = parser.parse_args(argv)
    try:
        kernel = re.compile(args.kernel)
    except re.error as e:
        parser.error(f"--kernel {args.kernel!r}: not a regular expression ({e})")
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(find_tool("nvdisasm")).parent), os.environ.get("PATH", "")]))
    run = subprocess.run([find_tool("cuobjdump"), "--dump-sass", str(args.module)], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise SystemExit(f"cuobjdump --dump-sass {args.module} failed ({run.returncode}): {run.stderr.strip()[:500]}")
    every = functions(run.stdout)
    if not every:
        raise SystemExit(f"{args.module}: no SASS in it (a module of PTX only, or not a CUDA binary)")
    kernels = [f for f in every if kernel.search(f[0])]
    if not kernels:
        raise SystemExit(f"--kernel {args.kernel!r}: none of the {len(every)} kernels of {args.module} matches")
    for name, copies, instructions in kernels:
        print(f"{name}: {len(instructions)} instructions" + (f" ({copies} identical copies)" if copies > 1 else ""))
        for loop in loops(instructions, args.min_size):
            per = f" ({loop.count / args.per:.2f} per {args.per:g})" if args.per else ""
            indent = "  " * (loop.depth + 1)
            print(f"{indent}loop {loop.start:#x}-{loop.end:#x}: {loop.count} instructions{per}")
            print(f"{indent}  " + ", ".join(f"{op} {n}" + (f" ({n / args.per:.2f})" if args.per else "")
                                          for op, n in loop.opcodes.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
