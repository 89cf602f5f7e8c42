"""CPU test of the programmatic-dependent-launch rule (a real nvcc compiles a module to PTX).

The forward and backward kernels are launched with programmatic stream serialization
(launch_after_prerequisite), so they may start while the stream's previous kernel still runs: each
must execute griddepcontrol.wait before its first access to global memory, or it may read what that
kernel has not written yet (or write what it still reads). No GPU test can show every such race, so
this checks the instruction order in the PTX of a whole variant module: in every kernel but the
context-parallel ones (launched plainly), the wait comes before every load, store, atomic or
cp.async that is not to parameter, shared, local or constant memory.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashinfer_cake import jit
from flashinfer_cake.jit import env

# The kernels launched plainly: they need no wait.
PLAIN = ("causal_conv1d_cp_kernel",)

ENTRY = re.compile(r"^\.visible \.entry (\S+)\(", re.M)
MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ldu?|st|atom|red|prefetch|cp\.async)(?:\.[\w:]+)*)\s", re.M)
LOCAL_SPACES = (".param", ".shared", ".local", ".const")
CP_ASYNC_GROUP = ("cp.async.commit_group", "cp.async.wait_group", "cp.async.wait_all")


def kernels(ptx: str) -> dict[str, str]:
    """Each .entry's name and body (up to the next entry)."""
    starts = [(m.group(1), m.start()) for m in ENTRY.finditer(ptx)]
    return {name: ptx[at:(starts[i + 1][1] if i + 1 < len(starts) else len(ptx))]
            for i, (name, at) in enumerate(starts)}


def first_global_access(body: str) -> tuple[int, str] | None:
    """Offset and opcode of the first instruction that may touch global memory."""
    for m in MEMORY.finditer(body):
        op = m.group(1)
        if op.startswith(CP_ASYNC_GROUP) or (any(space in op for space in LOCAL_SPACES) and "global" not in op):
            continue
        return m.start(), op
    return None


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> list[str]:
    """The PTX of each translation unit of a whole variant module (its main source and every route
    unit), compiled in parallel, MAX_JOBS at a time (one unit holding every kernel took 53 s on the
    2-core CI machine). A kernel several units instantiate is checked in each."""
    d = tmp_path_factory.mktemp("ptx")
    spec = jit.variant_spec("fp32", "fp32", "sm_90a")
    sources = []
    for k, text in enumerate((spec.source, *spec.units)):
        sources.append(d / f"unit{k}.cu")
        sources[-1].write_text(text)

    def compile_ptx(cu):
        cmd = [str(env.require_nvcc()), "-ptx", "-O3", "-std=c++17", "-arch=sm_90a", f"-I{env.include_dir()}",
               str(cu), "-o", str(cu.with_suffix(".ptx"))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        return cu.with_suffix(".ptx").read_text()
    with ThreadPoolExecutor(env.max_jobs()) as pool:
        return list(pool.map(compile_ptx, sources))


def test_first_global_access_parser():
    body = ("\tld.param.u64 \t%rd1, [p];\n\tst.shared.u32 \t[%r1], %r2;\n\tcp.async.commit_group;\n"
            "\tgriddepcontrol.wait;\n\t@%p1 cp.async.cg.shared.global [%r3], [%rd2], 16;\n\tld.global.nc.u32 %r4, [%rd1];\n")
    at, op = first_global_access(body)
    assert op == "cp.async.cg.shared.global" and at > body.index("griddepcontrol.wait")
    assert first_global_access("\tld.u32 \t%r1, [%rd1];\n")[1] == "ld.u32"  # generic: may be global
    assert first_global_access("\tld.param.u32 %r1, [p];\n\tld.shared.u32 %r2, [%r3];\n") is None


def test_every_pdl_launched_kernel_waits_before_its_first_global_access(ptx):
    found = [(name, body) for unit in ptx for name, body in kernels(unit).items()]
    pdl = [(name, body) for name, body in found if not any(p in name for p in PLAIN)]
    names = {name for name, _ in found}
    assert len({name for name, _ in pdl}) >= 40 and len(names) > len({name for name, _ in pdl}), sorted(names)
    for name, body in pdl:  # every route and pass (CP kernels seen), in every unit that has it
        wait = body.find("griddepcontrol.wait;")
        assert wait >= 0, f"{name} is launched after the previous grid but never waits for it"
        first = first_global_access(body)
        assert first is not None and wait < first[0], (
            f"{name}: {first and first[1]} before griddepcontrol.wait (it may read what the previous kernel "
            "has not written yet)")
