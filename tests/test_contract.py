"""CPU tests: the Python layer agrees with the C++ contract it restates, and the backward's plan.

The limits of include/flashinfer_cake/causal_conv1d_contract.h and the backward's plan of
causal_conv1d_bwd_plan.h are what the launchers and the torch binding compile in; the Python layer
(flashinfer_cake._checks, flashinfer_cake._plan) must apply the limits and the workspace bound
before anything is built. A small program compiled here against the headers prints theirs; any
drift fails. The plan's other rules are read from the header itself (_plan.header_plan) and tested
against the values measured for them.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from flashinfer_cake import _checks, _plan
from flashinfer_cake.cp import partition as cp_partition
from flashinfer_cake.jit import env

SIZES = [(S, C) for C in (8, 16, 24, 32, 40, 64, 72, 128, 136, 512, 1024, 2048, 4096, 4352, 6144, 8192, 65536)
         for S in (0, 1, 63, 64, 65, 127, 128, 129, 1000, 1024, 4096, 8000, 8192, 16383, 16384, 20000, 32768, 65536,
                   131072, 2**29 + 5, 2**30 - 1)
         if S * C < 2**34]
# Dense around the plan's wave choice, whose rounding near group boundaries the grid above would miss.
SIZES += [(S, C) for C in (136, 1000, 3720, 4352, 6144, 12416) for S in range(0, 40000, 37)]

PROBE = r"""
#include <cstdio>
#include <flashinfer_cake/causal_conv1d_bwd_plan.h>
#include <flashinfer_cake/causal_conv1d_contract.h>
using namespace flashinfer_cake;
int main() {
  std::printf("{\"limits\": {\"max_devices\": %lld, \"fwd_max_s\": %lld, \"fwd_max_elements\": %lld, "
              "\"bwd_max_s\": %lld, \"bwd_max_elements\": %lld, \"max_c\": %lld, \"max_cu_seqlens\": %lld, "
              "\"fwd_workspace_counters\": %lld, \"cp_max_c\": %lld},\n",
              (long long)kMaxDevices, (long long)kFwdMaxS, (long long)kFwdMaxElements, (long long)kBwdMaxS,
              (long long)kBwdMaxElements, (long long)kMaxC, (long long)kMaxCuSeqlens, (long long)kFwdWorkspaceCounters,
              (long long)kCpMaxC);
  std::printf("\"plan_constants\": [%d, %d, %d, %d, %d, %d, %d],\n", kBwdPartialRows, kBwdMaxItemTokens,
              kBwdPlanStripLen, kBwdPlanRunGroupTokens, kBwdPlanWideMinC, kBwdPlanFullTileTokens, kBwdPlanWaveItems);
  std::printf("\"cp\": [%d, %d],\n", kCpHeadMask, kCpContinues);
  std::printf("\"fwd_args\": \"%s\", \"bwd_args\": \"%s\"}\n", kFwdArgNames, kBwdArgNames);
}
"""


def _compile_and_run(source: str) -> str:
    """The standard output of a C++ program compiled against the headers."""
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text(source)
        subprocess.run([str(env.cxx_path()), "-std=c++17", f"-I{env.include_dir()}", str(src), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def header():
    """What the headers say, from a program compiled against them."""
    return json.loads(_compile_and_run(PROBE))


@pytest.fixture(scope="module")
def plans():
    """causal_conv1d_bwd_plan.h's plan of every (S, C) of SIZES."""
    return _plan.header_plan(SIZES)


def test_limits_match(header):
    assert header["limits"] == {
        "max_devices": _checks.MAX_DEVICES,
        "fwd_max_s": _checks.MAX_S["forward"],
        "fwd_max_elements": _checks.MAX_ELEMENTS["forward"],
        "bwd_max_s": _checks.MAX_S["backward"],
        "bwd_max_elements": _checks.MAX_ELEMENTS["backward"],
        "max_c": _checks.MAX_C,
        "max_cu_seqlens": _checks.MAX_CU_SEQLENS,
        "fwd_workspace_counters": _checks.FWD_WORKSPACE_COUNTERS,
        "cp_max_c": _checks.MAX_CP_C,
    }


def test_argument_structs_hold_what_the_binding_and_tools_pass(header):
    """The field names the module exports (KernelModule builds its ctypes structs from them)."""
    assert header["fwd_args"].split() == ["x", "y", "weight", "bias", "cu_seqlens", "workspace", "initial_states",
                                          "final_states", "S", "C", "x_row_stride", "y_row_stride", "num_docs",
                                          "device", "stream"]
    assert header["bwd_args"].split() == ["x", "dy", "dx", "weight", "bias", "cu_seqlens", "initial_states",
                                          "dfinal_states", "dinitial_states", "frag_info", "workspace",
                                          "workspace_bytes", "dweight", "dbias", "S", "C", "x_row_stride", "dy_row_stride", "dx_row_stride", "num_docs",
                                          "item_tokens", "round_preact", "device", "stream"]


def test_context_parallel_constants_match(header):
    """The frag_info bits of the CP tables (flashinfer_cake/cp/partition.py builds them; the passes
    read them)."""
    assert header["cp"] == [cp_partition.FRAG_HEAD_MASK, cp_partition.FRAG_CONTINUES]


def test_plan_constants_match(header):
    assert header["plan_constants"] == [_plan.PARTIAL_ROWS, _plan.MAX_ITEM_TOKENS, _plan.STRIP_LEN,
                                         _plan.RUN_GROUP_TOKENS, _plan.WIDE_MIN_C, _plan.FULL_TILE_TOKENS,
                                         _plan.WAVE_ITEMS]


def test_workspace_bound_matches(plans):
    """The one rule Python restates: the token groups' bound, which sizes the workspace."""
    for (S, C), plan in plans.items():
        assert (_plan.groups_bound(S, C), _plan.workspace_bytes(S, C)) == (plan.groups_bound, plan.workspace_bytes), (S, C)
    assert any(plan.big_groups for plan in plans.values()), "no shape of the grid splits its last wave"
    assert {plan.vec8_rows for (S, C), plan in plans.items() if C % 256 == 0 and S >= 4096} == {False, True}, \
        "the balance never moves"


@pytest.mark.parametrize("S, C, item_tokens", [
    (16384, 6144, 768), (32768, 4352, 768),  # r155's wave choice: groups of 768 where 1024 overran a wave
    # the even-run choice (r173, H200: the fastest of seven group lengths timed on each)
    (16384, 4352, 544), (8192, 4352, 560), (24576, 3584, 672), (16384, 7168, 912), (32768, 3328, 832),
    (16384, 5376, 656),
    (16384, 4096, 1024), (8192, 4096, 512), (131072, 4096, 1024), (16384, 8192, 1024),  # one wave or many: kept
    (8768, 7432, 768),  # C % 128 != 0: whole strips (the even-run model's pick, 528, read 3 % slower)
    (200000, 1000, 1024)])
def test_backward_plan_item_tokens(S, C, item_tokens):
    """Token groups of 768 where the first choice's grid ran just past a whole number of waves of
    4 x 132 128-channel items (r155, H200: 16384x6144 208.0 -> 163.9 us, 32768x4352 273.7 -> 238.5); groups
    of any multiple of 16 tokens where bwd_even_run_cost says 1/16 less (r173: 16384x4352 132.6 -> 120.0,
    8192x4352 71.6 -> 63.7, 32768x3328 198.3 -> 174.3); the first choice where it fills its waves."""
    assert _plan.plan_of(S, C).item_tokens == item_tokens


@pytest.mark.parametrize("S, C, split", [
    (20480, 4096, (768, 16, 512)),  # 32 groups: 16 fill a wave of 264 256-channel items (256), 16 after
    (16384, 10240, (1024, 13, 512)),  # the even-run choice with a split
    (8768, 7432, (768, 8, 512)),  # the last group 64 tokens
    (16384, 4096, (1024, 0, 1024)), (16384, 8192, (1024, 0, 1024)),
    # 16-byte rows from 9/2 waves on: the last eighth in 512-token groups, in 16-byte rows (131072x4096: 7.8
    # waves) or on Wide where the split grid would load WideVec8's SMs unevenly (49152x8192: 5.8 waves)
    (131072, 4096, (1024, 112, 512)), (49152, 8192, (1024, 42, 512)), (98304, 8192, (1024, 84, 512)),
    (32768, 8192, (1024, 0, 1024)), (65536, 2048, (1024, 0, 1024)),  # 3.9 and 1.94 waves: uniform
    (28672, 10240, (880, 0, 880)), (131072, 2304, (912, 0, 912)),  # the last wave full or nearly (5.0, 4.91 waves)
    (262144, 4096, (1024, 0, 1024)),  # 15.5 waves: past bwd_groups_bound
    (16384, 6144, (768, 0, 768)), (32768, 4352, (768, 0, 768)),
    (16384, 4352, (544, 0, 544)),  # the even-run choice: 2 waves of 16-byte rows (31 x 17 = 527 of 528 items)
    # Wide's grids of 15/8 waves or more: the last eighth of S in 256-token groups (1024 x 128: 1.94 waves)
    (1048576, 128, (1024, 896, 256)), (2097152, 192, (1024, 1792, 256)), (262144, 384, (768, 298, 256)),
    (24576, 10240, (1024, 21, 256)),  # C % 256 == 0 on Wide (bwd_vec8_rows: the 16-byte rows' SMs unbalanced)
    (524288, 128, (1024, 0, 1024)), (1048576, 64, (1024, 0, 1024))])  # 0.97 waves; C <= 64 (Mid)
def test_backward_plan_tail(S, C, split):
    """bwd_tail splits the last wave where the uniform grid runs just past whole waves (20480x4096:
    27 groups of 768 tokens x 16 items = 1.64 waves of 264); on Wide's 8-byte rows from 15/8 waves on
    it runs the last eighth of S in 256-token groups, on grids of 16-byte rows from 9/2 waves on whose last
    wave is at most 7/8 full in 512-token groups; the power-of-two shapes in 16-byte rows below that and those whose waves the wave
    choice or the even-run choice fills keep uniform groups."""
    plan = _plan.plan_of(S, C)
    assert (plan.item_tokens, plan.big_groups, plan.tail_tokens) == split


@pytest.mark.parametrize("S, C, balanced", [
    (24576, 10240, False), (45056, 4096, False), (41984, 4352, False),
    # the even-run choice's groups, which fill the 16-byte rows' waves (r161 measured these at the groups
    # before it: 28672x10240 and 26624x6144 on Wide, 4 : 3 at 8192x4352 and 4096x12288)
    (8192, 4352, True), (4096, 12288, True), (16384, 4352, True), (28672, 10240, True), (26624, 6144, True),
    (20480, 10240, True),  # 1.02: WideVec8 3 % faster (r161)
    (16384, 4096, True), (16384, 8192, True), (20480, 4096, True), (131072, 256, True)])  # equal loads
def test_backward_vec8_balance(S, C, balanced):
    """The launcher takes 16-byte rows (WideVec8) at C % 256 == 0 only where their busiest SM carries at
    most 1/32 more work than the 8-byte rows' (bwd_vec8_rows; the GPU tests assert the routes)."""
    assert _plan.plan_of(S, C).vec8_rows == balanced


@pytest.mark.parametrize("C", sorted({C for _, C in SIZES}))
def test_backward_plan_properties(C, plans):
    previous = 0
    for S in sorted(S for S, c in SIZES if c == C):
        plan = plans[S, C]
        item_tokens, groups, big, tail_tokens = plan.item_tokens, plan.groups, plan.big_groups, plan.tail_tokens
        assert 64 <= item_tokens <= 1024, (S, C, item_tokens)
        # whole strips, or a multiple of 16 on the full-width routes (C > 64, 256+ tokens) at C % 128 == 0
        assert item_tokens % 64 == 0 or (C > 64 and C % 128 == 0 and item_tokens >= 256 and item_tokens % 16 == 0), (S, C)
        if big:  # long groups, then shorter ones of whole 256-token sub-tiles; the last has tokens
            assert 256 <= tail_tokens < item_tokens and tail_tokens % 256 == 0 and 0 < big < groups, (S, C)
            assert big * item_tokens + (groups - big - 1) * tail_tokens < S <= big * item_tokens + (groups - big) * tail_tokens
        else:
            assert tail_tokens == item_tokens and groups == -(-S // item_tokens), (S, C)
        assert groups <= plan.groups_bound, (S, C)
        assert plan.workspace_bytes >= groups * 5 * C * 4, (S, C)  # a partial row set per group
        # A buffer for the largest S serves every smaller one.
        assert plan.workspace_bytes >= previous, (S, C)
        previous = plan.workspace_bytes


@pytest.mark.parametrize("S, C, words", [(-1, 8, "S must be"), (2**30, 8, "S must be"), (1, 0, "C must be"),
                                         (1, 2**28, "C must be"), (2**27, 128, "S must be")])
def test_header_plan_rejects_shapes_past_the_backwards_range(S, C, words):
    """The workspace functions' rule and message (_checks.check_sizes), before anything is compiled."""
    with pytest.raises(ValueError, match=words):
        _plan.header_plan([(S, C)])


# (x, dy, dx) as (address mod 256 or any address, row pitch in bytes) -> the offset the rotated tiles start at
ROW_BLOCK_CASES = [
    ([(128, 2304), (128, 2304), (128, 2304)], 128),  # bench_states' slices: column 64 of [S, C + 128]
    ([(128 + 4096, 2304), (0, 2048), (128, 2304)], 128),  # two of three
    ([(128, 2304), (0, 2048), (128, 2050)], 0),  # dx's rows differ in offset: a tie with 0
    ([(128, 2304), (64, 2304), (0, 2048)], 0),  # three offsets: 0 among them
    ([(128, 2304), (64, 2304), (16, 2064)], 128),  # no 0: x's
    ([(240, 2050), (64, 2304), (16, 2064)], 64),  # x's pitch is no whole block: dy's
    ([(240, 2304), (240, 8960), (0, 8960)], 240),
    ([(16, 2304), (16, 2304), (16, 2304)], 16),
    ([(16, 4160), (48, 8512), (80, 16)], 0),  # no stream has one offset in every row
    ([(0, 2048), (0, 2048), (0, 2048)], 0),  # contiguous
]


def test_backward_row_block_offset():
    """bwd_row_block_offset, the vote the backward's launcher rotates its channel tiles by (compiled here)."""
    calls = "\n".join("  std::printf(\"%lld\\n\", (long long)bwd_row_block_offset({" +
                      ", ".join(f"{{{a}, {b}}}" for a, b in streams) + "}));" for streams, _ in ROW_BLOCK_CASES)
    program = ("#include <cstdio>\n#include <flashinfer_cake/causal_conv1d_bwd_plan.h>\nusing namespace flashinfer_cake;\n"
               f"int main() {{\n{calls}\n}}\n")
    got = [int(v) for v in _compile_and_run(program).split()]
    assert got == [want for _, want in ROW_BLOCK_CASES]
