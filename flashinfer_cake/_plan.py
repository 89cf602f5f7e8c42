"""The backward's plan (token groups, workspace size) as the Python side sees it.

include/flashinfer_cake/causal_conv1d_bwd_plan.h is the plan: the launcher and the torch binding
compile it. The Python layer needs one of its numbers before anything is built, a workspace's size
(from the bound on the token groups): :func:`groups_bound` and :func:`workspace_bytes` restate that
bound, and tests/test_contract.py fails when the two drift. Everything else (a call's groups, the
tail's split, the 16-byte rows' choice) is read from the header itself by :func:`header_plan`, a
program compiled against it, for tests and tools."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from .jit import env

# The header's constants that the bound and the tools use (tests/test_contract.py compares them).
PARTIAL_ROWS = 5  # kBwdPartialRows: the four taps' g*x sums, then the sum of g
MAX_ITEM_TOKENS = 1024  # kBwdMaxItemTokens
STRIP_LEN = 64  # kBwdPlanStripLen
RUN_GROUP_TOKENS = 16  # kBwdPlanRunGroupTokens
WIDE_MIN_C = 64  # kBwdPlanWideMinC
FULL_TILE_TOKENS = 256  # kBwdPlanFullTileTokens
WAVE_ITEMS = 4 * 132  # kBwdPlanWaveItems


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _uniform_groups_bound(S: int, C: int) -> int:
    """bwd_uniform_groups_bound: bwd_groups_for_items' first choice, or the wave choice's most."""
    for_items = min(_ceil_div(S, 128), max(_ceil_div(S, MAX_ITEM_TOKENS), _ceil_div(1024, _ceil_div(C, 128))))
    wave_choice = min(_ceil_div(S, 512), _ceil_div(14 * WAVE_ITEMS, _ceil_div(C, 128))) if C > WIDE_MIN_C else 0
    return max(for_items, wave_choice)


def groups_bound(S: int, C: int) -> int:
    """bwd_groups_bound: the most token groups, the tail's split included (sizes the workspace)."""
    uniform = _uniform_groups_bound(S, C)
    if C <= WIDE_MIN_C:
        return uniform
    return max(uniform, min(_ceil_div(S, FULL_TILE_TOKENS), uniform - 1 + _ceil_div(WAVE_ITEMS, _ceil_div(C, 128))))


def workspace_bytes(S: int, C: int) -> int:
    """bwd_workspace_bytes: the FP32 partial rows of bwd_groups_bound's token groups."""
    return groups_bound(S, C) * PARTIAL_ROWS * C * 4


class BwdPlan(NamedTuple):
    """A backward's plan as the header computes it for one (S, C)."""

    item_tokens: int  # bwd_item_tokens: tokens per group (the long groups after the tail's split)
    groups: int  # bwd_groups: token groups as launched
    groups_bound: int  # bwd_groups_bound
    workspace_bytes: int  # bwd_workspace_bytes
    big_groups: int  # bwd_tail: the first big_groups groups have item_tokens tokens, the others
    tail_tokens: int  # tail_tokens (0, item_tokens: uniform groups)
    vec8_rows: bool  # bwd_vec8_rows on those groups: a stateless call runs in 16-byte rows (WideVec8)


_PROBE = r"""
#include <cstdio>
#include <flashinfer_cake/causal_conv1d_bwd_plan.h>
using namespace flashinfer_cake;
int main() {
  long long S, C;
  while (std::scanf("%lld %lld", &S, &C) == 2) {
    const int64_t tokens = bwd_item_tokens(S, C), groups = bwd_groups(S, C);
    const BwdTail tail = bwd_tail(S, C, tokens);
    std::printf("%lld %lld %lld %lld %lld %lld %lld %lld %d\n", S, C, (long long)tokens, (long long)groups,
                (long long)bwd_groups_bound(S, C), (long long)bwd_workspace_bytes(S, C), (long long)tail.big_groups,
                (long long)tail.tail_tokens, (int)(S > 0 && bwd_vec8_rows(C, groups, tokens, tail)));
  }
}
"""


@functools.cache
def _probe(include_dir: str) -> Path:
    """The plan program compiled against include_dir's header (once per process; 0.2 s with g++ here)."""
    d = Path(tempfile.mkdtemp(prefix="cake_plan_"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    (d / "probe.cpp").write_text(_PROBE)
    r = subprocess.run([str(env.cxx_path()), "-std=c++17", "-O1", f"-I{include_dir}", str(d / "probe.cpp"), "-o",
                        str(d / "probe")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"flashinfer_cake: the plan probe did not compile against {include_dir}:\n{r.stderr}")
    return d / "probe"


def header_plan(sizes, include_dir: str | Path | None = None) -> dict[tuple[int, int], BwdPlan]:
    """The plan of each (S, C) of ``sizes`` as causal_conv1d_bwd_plan.h computes it (the package's
    templates, or those under ``include_dir``): what the launcher and the torch binding use. For
    tests and tools; it needs the C++ compiler (``CXX``, else c++ / g++)."""
    from . import _checks  # (it imports this module)

    sizes = [(int(S), int(C)) for S, C in sizes]
    for S, C in sizes:  # the backward's range, where the header's arithmetic holds: its ValueError
        _checks.check_sizes("header_plan", S, C, "backward")
    probe = _probe(str(Path(include_dir or env.include_dir()).resolve()))
    out = subprocess.run([str(probe)], input="".join(f"{S} {C}\n" for S, C in sizes), capture_output=True,
                         text=True, check=True).stdout
    plans = {}
    for line in out.splitlines():
        S, C, *fields = map(int, line.split())
        plans[S, C] = BwdPlan(*fields[:-1], bool(fields[-1]))
    if plans.keys() != set(sizes):
        raise RuntimeError(f"flashinfer_cake: the plan probe answered {len(plans)} of {len(set(sizes))} shapes")
    return plans


def plan_of(S: int, C: int) -> BwdPlan:
    """header_plan of one shape."""
    return header_plan([(S, C)])[int(S), int(C)]
