"""GPU tests of the context-parallel conv (flashinfer_cake.cp, issue 16) on one GPU.

- The ranks of a CP group simulated in one process (every rank's phases, the all_to_alls done by
  hand): y and dx bitwise equal to the single-GPU cake_causal_conv1d of the global batch, the
  ranks' dweight/dbias summing to its gradient within FP32 summation order; every layout, explicit
  ragged fragments (0-3-token pieces, histories over several ranks, a rank's fragments in any
  order), 1-3-token documents at the cuts, every variant and both SiLU' policies.
- The autograd path through a real one-rank NCCL group: fragments of the same documents on one
  rank in shuffled order make every head and tail pass and both exchanges run; multi, the
  recompute handle under torch.utils.checkpoint, CUDA-graph capture and replay of a two-layer
  training step, bad arguments.
Multi-GPU runs: tests/test_cp_multi_gpu.py (torchrun over 2+ GPUs).
"""

from __future__ import annotations

import datetime
import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from doclengths import fill, one_doc, split, tiny_docs
import cp_by_hand
from launched import launched_route
from sanitizer import assert_sanitizer_clean, needs_sanitizer
from cp_by_hand import exchanged_by_hand, random_fragments
from flashinfer_cake import cake_causal_conv1d, cake_causal_conv1d_train_backward
from flashinfer_cake.cp import (
    CPRecomputeHandle,
    build_cp_context,
    cake_causal_conv1d_cp,
    cake_causal_conv1d_cp_multi,
    cp_partition,
)
from flashinfer_cake.cp.partition import FRAG_HEAD_MASK

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F32 = torch.bfloat16, torch.float32
VARIANTS = [pytest.param(w, b, id=f"w_{wn}-b_{bn}") for w, wn in ((F32, "fp32"), (BF16, "bf16"))
            for b, bn in ((None, "none"), (F32, "fp32"), (BF16, "bf16"))]
POLICIES = ["bf16", "fp32"]


def random_mix(S, rng):
    return split(S, rng.randint(2, 12), rng)


def short_mix(S, rng):
    """1-3-token documents among longer ones (they land on the cuts too)."""
    return fill(S, rng, (1, 2, 3, 3, 9, 40))


MIXES = {"one": one_doc, "random": random_mix, "tiny": tiny_docs, "short": short_mix}


def global_cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def make_partition(lengths, P, layout, rng):
    cu = global_cu(lengths)
    if layout == "fragments":
        return cp_partition(cu, P, fragments=random_fragments(lengths, P, rng))
    return cp_partition(cu, P, layout)


def inputs(S, C, weight_dtype, bias_dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    dy = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    w = (0.5 * torch.randn(C, 4, device=DEV, generator=g)).to(weight_dtype)
    b = None if bias_dtype is None else (0.5 * torch.randn(C, device=DEV, generator=g)).to(bias_dtype)
    return x, dy, w, b


def single_gpu(x, w, b, cu, dy, policy):
    """y, dx, dweight, dbias of the single-GPU autograd call on the global batch."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bg = None if b is None else b.clone().requires_grad_()
    y = cake_causal_conv1d(xg, wg, cu, bg, silu_grad_preactivation=policy)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad, None if b is None else bg.grad


def simulate_ranks(part, x, w, b, dy, policy):
    """Every rank's phases of cake_causal_conv1d_cp, the all_to_alls done by hand: per rank
    (global token indices, y, dx, dweight, dbias)."""
    P, C = part.world_size, x.shape[1]
    ctxs = [build_cp_context(part, None, r, DEV) for r in range(P)]
    idx = [torch.tensor(part.global_tokens(r), dtype=torch.long, device=DEV) for r in range(P)]
    xs = [x.index_select(0, i) for i in idx]
    dys = [dy.index_select(0, i) for i in idx]
    sends = [cp_by_hand.send_rows(c, (xl,), (w,), (b,))[0] for c, xl in zip(ctxs, xs)]
    received = exchanged_by_hand(ctxs, sends, "halo")
    ys, halos = [], []
    for c, xl, rows in zip(ctxs, xs, received):
        y = cp_by_hand.forward_interior(c, (xl,), (w,), (b,))
        for t in y:
            assert not t.isnan().any()
        spare = x.new_full((1, C), float("nan"))  # the received buffer's last row: never read
        h = cp_by_hand.forward_heads(c, y, (xl,), (w,), (b,), torch.cat([rows, spare]))
        unlisted = torch.ones(c.num_fragments, dtype=torch.bool, device=DEV)
        unlisted[c.head_frags.long()] = False
        h[0][unlisted] = float("nan")  # halo rows the heads pass does not write: no pass may use them
        ys.append(y[0])
        halos.append(h)
    g_sends = [cp_by_hand.grad_send(c, (xl,), (d,), (w,), (b,), h, policy)[0] for c, xl, d, h in zip(ctxs, xs, dys, halos)]
    g_received = exchanged_by_hand(ctxs, g_sends, "g")
    out = []
    for r, (c, xl, d, h) in enumerate(zip(ctxs, xs, dys, halos)):
        (dx,), (dw,), (db,) = cp_by_hand.backward_interior(c, (xl,), (d,), (w,), (b,), h, policy)
        cp_by_hand.backward_tails(c, (dx,), (xl,), (d,), (w,), (b,), h, g_received[r], policy)
        out.append((idx[r], ys[r], dx, dw, db))
    return out


def assert_partials_sum_to(partials, ref, exact_dtype, tokens):
    """The ranks' parameter gradients summed equal the single-GPU one within FP32 summation order
    (terms of magnitude ~1: 2^-18 per token, far below one missing or doubled term) and one BF16
    rounding per partial for BF16 parameters."""
    parts = torch.stack([p.double() for p in partials])
    eps = 2.0**-8 if exact_dtype == BF16 else 0.0
    tol = eps * (parts.abs().sum(0) + ref.double().abs()) + 2.0**-18 * tokens
    err = (parts.sum(0) - ref.double()).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} over tolerance"


def assert_ranks_are_the_single_gpu_run(S, C, lengths, P, layout, weight_dtype, bias_dtype, policy, seed, rng):
    """y and dx of every simulated rank bitwise the single-GPU run's rows; the ranks' dweight /
    dbias summed equal the single-GPU ones (assert_partials_sum_to)."""
    part = make_partition(lengths, P, layout, rng)
    x, dy, w, b = inputs(S, C, weight_dtype, bias_dtype, seed)
    cu = torch.tensor(global_cu(lengths), dtype=torch.int32, device=DEV)
    y_ref, dx_ref, dw_ref, db_ref = single_gpu(x, w, b, cu, dy, policy)
    ranks = simulate_ranks(part, x, w, b, dy, policy)
    for r, (idx, y, dx, dw, db) in enumerate(ranks):
        assert torch.equal(y, y_ref[idx]), f"rank {r}: y differs at {(y != y_ref[idx]).any(1).nonzero()[:5].tolist()}"
        assert torch.equal(dx, dx_ref[idx]), f"rank {r}: dx differs at {(dx != dx_ref[idx]).any(1).nonzero()[:5].tolist()}"
        assert dw.dtype == w.dtype and (db is None) == (b is None)
    assert_partials_sum_to([t[3] for t in ranks], dw_ref, w.dtype, S)
    if b is not None:
        assert_partials_sum_to([t[4] for t in ranks], db_ref, b.dtype, S)
    return part


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight_dtype,bias_dtype", VARIANTS)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "zigzag_per_document", "fragments"])
@pytest.mark.parametrize("P", [2, 3])
def test_ranks_are_bitwise_the_single_gpu_run(P, layout, mix, weight_dtype, bias_dtype, policy):
    seed = zlib.crc32(f"{P} {layout} {mix} {weight_dtype} {bias_dtype} {policy}".encode())
    rng = random.Random(seed)
    S, C = 601, 72
    assert_ranks_are_the_single_gpu_run(S, C, MIXES[mix](S, rng), P, layout, weight_dtype, bias_dtype, policy, seed, rng)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("docs", [1, 2])
def test_ranks_with_few_long_fragments_are_bitwise_the_single_gpu_run(docs, layout, policy):
    """Ranks of 8192 tokens x 136 channels hold 1-4 fragments: 64 token groups, at least 16 per
    fragment, so their main backward runs the item-choice kernel (causal_conv1d_bwd_launcher.cuh),
    whose items without a continuing fragment's first rows walk the stateless loop."""
    from flashinfer_cake import _plan

    seed = zlib.crc32(f"few {docs} {layout} {policy}".encode())
    rng = random.Random(seed)
    S, C, P = 16384, 136, 2
    lengths = [S] if docs == 1 else split(S, 2, rng)
    part = assert_ranks_are_the_single_gpu_run(S, C, lengths, P, layout, F32, F32, policy, seed, rng)
    for r in range(P):
        tokens = len(part.global_tokens(r))
        frags = build_cp_context(part, None, r, DEV).num_fragments
        assert _plan.plan_of(tokens, C).groups >= 16 * frags, (r, tokens, frags)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ranks_with_long_fragments_in_16_byte_rows_are_bitwise_the_single_gpu_run(layout, policy):
    """Ranks of 8192 tokens x 4096 channels (16 token groups of 512 tokens) holding 2+ fragments of
    512+ tokens on average: their main backward runs WideVec8's stateful per-step kernel (16-byte
    rows; causal_conv1d_bwd_launcher.cuh), continuing fragments reading their halo as initial states."""
    from flashinfer_cake import _plan

    seed = zlib.crc32(f"vec8 {layout} {policy}".encode())
    rng = random.Random(seed)
    S, C, P = 16384, 4096, 2
    part = assert_ranks_are_the_single_gpu_run(S, C, split(S, 6, rng), P, layout, F32, F32, policy, seed, rng)
    x, dy, w, b = inputs(S, C, F32, F32, seed)
    for r in range(P):
        ctx = build_cp_context(part, None, r, DEV)
        tokens, frags = len(part.global_tokens(r)), ctx.num_fragments
        plan = _plan.plan_of(tokens, C)
        assert tokens >= 512 * frags and plan.groups < 16 * frags and plan.vec8_rows, (r, tokens, frags)
        i = torch.tensor(part.global_tokens(r), dtype=torch.long, device=DEV)
        halo = torch.zeros(frags, 3, C, dtype=BF16, device=DEV)
        call = lambda: cp_by_hand.backward_interior(ctx, (x.index_select(0, i),), (dy.index_select(0, i),), (w,), (b,),  # noqa: E731
                                                    (halo,), policy)
        assert launched_route(call) == (8, 32, 128, 64), r


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight_dtype,bias_dtype", VARIANTS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "fragments"])
def test_main_backward_reads_no_halo_of_a_fragment_that_starts_its_document(layout, weight_dtype, bias_dtype, policy):
    """The main backward takes frag_info: a fragment at offset 0 (its halo would be zeros) runs as a plain
    document, so its halo rows are never read. NaN there changes nothing, and the result is the
    public stateful backward's with the same halo as initial states (dx, dweight, dbias bitwise up
    to the sign of a zero); NaN in a continuing fragment's halo must reach the results."""
    seed = zlib.crc32(f"{layout} {weight_dtype} {bias_dtype} {policy}".encode())
    rng = random.Random(seed)
    S, C = 601, 72
    part = make_partition(random_mix(S, rng), 3, layout, rng)
    x, dy, w, b = inputs(S, C, weight_dtype, bias_dtype, seed)
    for r in range(3):
        ctx = build_cp_context(part, None, r, DEV)
        i = torch.tensor(part.global_tokens(r), dtype=torch.long, device=DEV)
        xl, dl = x.index_select(0, i), dy.index_select(0, i)
        halo = 0.5 * torch.randn(ctx.num_fragments, 3, C, device=DEV).to(BF16)
        starts = (ctx.frag_info & FRAG_HEAD_MASK) == 0
        halo[starts] = 0  # what halo_exchange gives a fragment at offset 0 (the conv leaves it unwritten)
        (dx,), (dw,), (db,) = cp_by_hand.backward_interior(ctx, (xl,), (dl,), (w,), (b,), (halo,), policy)
        public = cake_causal_conv1d_train_backward(xl, w, ctx.cu_seqlens, dl, bias=b, initial_states=halo,
                                                   silu_grad_preactivation=policy)
        for want, have in zip(public, (dx, dw) if b is None else (dx, dw, db)):
            assert torch.equal(want, have), f"rank {r}: differs from the stateful backward"
        poisoned = halo.clone()
        poisoned[starts] = float("nan")
        got = cp_by_hand.backward_interior(ctx, (xl,), (dl,), (w,), (b,), (poisoned,), policy)
        for want, have in zip((dx, dw, db), got):
            assert (want is None and have[0] is None) or torch.equal(want, have[0]), \
                f"rank {r}: a fragment at offset 0 read its halo"
        read = ~starts & (ctx.cu_seqlens[1:] > ctx.cu_seqlens[:-1])  # continuing, with a token
        if read.any():  # its halo is read: NaN there shows in dweight
            poisoned = halo.clone()
            poisoned[read] = float("nan")
            _, (dw,), _ = cp_by_hand.backward_interior(ctx, (xl,), (dl,), (w,), (b,), (poisoned,), policy)
            assert dw.isnan().any(), f"rank {r}: the continuing fragments' halo was not read"


_CP_PASSES_MEMCHECK_SCRIPT = r"""
import dataclasses, random, sys
sys.path.insert(0, {tests!r})
import torch
import cp_by_hand
from flashinfer_cake.cp import build_cp_context, cp_partition

C, I32 = 72, torch.int32
lengths = [5, 50, 1, 2, 23, 9]  # 90 tokens: the cut at 45 inside the second document
cu = [0]
for n in lengths:
    cu.append(cu[-1] + n)
part = cp_partition(cu, 2, "contiguous")
w = torch.randn(C, 4, device="cuda")
b = torch.randn(C, device="cuda").to(torch.bfloat16)
ctxs = [build_cp_context(part, None, r, "cuda") for r in range(2)]
xs = [torch.randn(c.num_tokens, C, device="cuda").to(torch.bfloat16) for c in ctxs]
dys = [torch.randn_like(x) for x in xs]
sends = [cp_by_hand.send_rows(c, (x,), (w,), (b,))[0] for c, x in zip(ctxs, xs)]
received = cp_by_hand.exchanged_by_hand(ctxs, sends, "halo")
rng = random.Random(5)
lo, hi = -2**31, 2**31 - 1
for rank, (ctx, x, dy, rows) in enumerate(zip(ctxs, xs, dys, received)):
    S, F = ctx.num_tokens, ctx.num_fragments
    tables = [[S - 1, lo + 5] + [S] * (F - 1), [hi - 1, hi] + [S] * (F - 1), [-5, 3] + [S] * (F - 1),
              [0, S + 1] + [S + 1] * (F - 1), [lo] + [hi] * F]
    tables += [[rng.randint(lo, hi) for _ in range(F + 1)] for _ in range(8)]
    for table in tables:
        forged = dataclasses.replace(ctx, cu_seqlens=torch.tensor(table, dtype=I32, device="cuda"))
        y = cp_by_hand.forward_interior(forged, (x,), (w,), (b,))
        spare = rows.new_zeros(1, C)
        halos = cp_by_hand.forward_heads(forged, y, (x,), (w,), (b,), torch.cat([rows, spare]))
        g_send, g_recv = cp_by_hand.grad_send(forged, (x,), (dy,), (w,), (b,), halos, "bf16")
        (dx,), _, _ = cp_by_hand.backward_interior(forged, (x,), (dy,), (w,), (b,), halos, "bf16")
        g_in = torch.randn(g_recv.shape, device="cuda")  # any received terms
        cp_by_hand.backward_tails(forged, (dx,), (x,), (dy,), (w,), (b,), halos, g_in, "bf16")
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_cp_passes_stay_in_bounds_for_any_table_content(tmp_path):
    """The CP passes (and the main kernels with frag_info) under compute-sanitizer's memcheck with a
    context's cu_seqlens replaced by any int32 content (a fragment ending near INT32_MIN after one
    starting at S - 1, entries past S, negative, decreasing, random): no access outside the
    tensors (the passes compare 0 <= start < end <= S before taking a fragment's length)."""
    tests = str(Path(__file__).resolve().parent)
    assert_sanitizer_clean(_CP_PASSES_MEMCHECK_SCRIPT.format(tests=tests), tmp_path)


@pytest.mark.parametrize("C", [8, 1032, 2056])
def test_channel_counts_past_one_block(C):
    rng = random.Random(C)
    S = 97
    lengths = short_mix(S, rng)
    part = make_partition(lengths, 3, "fragments", rng)
    x, dy, w, b = inputs(S, C, F32, F32, C)
    cu = torch.tensor(global_cu(lengths), dtype=torch.int32, device=DEV)
    y_ref, dx_ref, _, _ = single_gpu(x, w, b, cu, dy, "bf16")
    for idx, y, dx, _, _ in simulate_ranks(part, x, w, b, dy, "bf16"):
        assert torch.equal(y, y_ref[idx]) and torch.equal(dx, dx_ref[idx])


def test_a_rank_without_tokens():
    part = cp_partition([0, 5, 5, 12], 3, fragments=[[(0, 0, 5), (2, 0, 3)], [(1, 0, 0)], [(2, 3, 4)]])
    x, dy, w, b = inputs(12, 16, BF16, None, 7)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEV)
    y_ref, dx_ref, _, _ = single_gpu(x, w, b, cu, dy, "fp32")
    for idx, y, dx, dw, _ in simulate_ranks(part, x, w, b, dy, "fp32"):
        assert torch.equal(y, y_ref[idx]) and torch.equal(dx, dx_ref[idx])
        if idx.numel() == 0:
            assert not dw.any()


# ---------------------------------------------------------------------------------------------
# the autograd path through a one-rank NCCL group


@pytest.fixture(scope="module")
def nccl_group(gpu_feature_missing):
    if not dist.is_available() or not dist.is_nccl_available():
        gpu_feature_missing("NCCL is not available")
    if dist.is_initialized():
        gpu_feature_missing("a process group is already initialized")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device(DEV, 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def one_rank_batch(seed, S=300, C=64, weight_dtype=F32, bias_dtype=BF16):
    """A batch whose documents are cut into pieces held by the one rank in shuffled order."""
    rng = random.Random(seed)
    lengths = short_mix(S, rng)
    cu_global = global_cu(lengths)
    part = cp_partition(cu_global, 1, fragments=random_fragments(lengths, 1, rng))
    x, dy, w, b = inputs(S, C, weight_dtype, bias_dtype, seed)
    idx = torch.tensor(part.global_tokens(0), dtype=torch.long, device=DEV)
    return part, torch.tensor(cu_global, dtype=torch.int32, device=DEV), x, dy, w, b, idx


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight_dtype,bias_dtype", VARIANTS)
def test_autograd_through_nccl_is_bitwise(nccl_group, weight_dtype, bias_dtype, policy):
    part, cu, x, dy, w, b, idx = one_rank_batch(11, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    y_ref, dx_ref, dw_ref, db_ref = single_gpu(x, w, b, cu, dy, policy)
    xl = x[idx].clone().requires_grad_()
    wl = w.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xl, wl, ctx, bl, silu_grad_preactivation=policy)
    y.backward(dy[idx])
    assert torch.equal(y, y_ref[idx]) and torch.equal(xl.grad, dx_ref[idx])
    assert_partials_sum_to([wl.grad], dw_ref, w.dtype, x.shape[0])
    if b is not None:
        assert_partials_sum_to([bl.grad], db_ref, b.dtype, x.shape[0])


def test_autograd_reads_no_unwritten_buffer(nccl_group):
    """Under torch.use_deterministic_algorithms torch fills new tensors with NaN; the call is still
    bitwise the single-GPU run: the halo rows the heads pass does not write and the received
    buffer's spare row are never read (the pass gives zeros for the rows before a document)."""
    part, cu, x, dy, w, b, idx = one_rank_batch(29)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    assert ctx.head_frags.numel() > 0  # fragments that continue their documents, on this one rank
    y_ref, dx_ref, _, _ = single_gpu(x, w, b, cu, dy, "bf16")
    xl = x[idx].clone().requires_grad_()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        y = cake_causal_conv1d_cp(xl, w, ctx, b)
        y.backward(dy[idx])
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(y, y_ref[idx]) and torch.equal(xl.grad, dx_ref[idx])


def test_nothing_to_exchange_runs_empty_exchanges(nccl_group):
    """Whole documents on the rank: every split is zero, both all_to_alls carry nothing (still
    called, as every rank must), and the result is the single-GPU one."""
    _, cu, x, dy, w, b, _ = one_rank_batch(14)
    part = cp_partition(cu.tolist(), 1)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    assert sum(ctx.halo_recv_splits) == sum(ctx.g_send_splits) == 0
    y_ref, dx_ref, _, _ = single_gpu(x, w, b, cu, dy, "bf16")
    xl = x.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xl, w, ctx, b)
    y.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(xl.grad, dx_ref)


def test_halo_exchange_through_nccl(nccl_group):
    """The standalone halo_exchange on the GPU (its backward sums with index_put_): states and the
    gradient equal the tables applied by hand (FP64, integer-valued: every sum exact)."""
    from flashinfer_cake.cp import halo_exchange
    part, _, x, _, _, _, idx = one_rank_batch(15)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    g = torch.Generator(device=DEV).manual_seed(6)
    xl = torch.randint(-8, 8, (idx.numel(), 24), device=DEV, generator=g).double().requires_grad_()
    dstates = torch.randint(-8, 8, (ctx.num_fragments, 3, 24), device=DEV, generator=g).double()
    states = halo_exchange(xl, ctx)
    (dx,) = torch.autograd.grad(states, xl, dstates)
    xr = xl.detach().clone().requires_grad_()
    rows = torch.cat([xr.index_select(0, ctx.export_rows.long()), xr.new_zeros(1, 24)])  # one rank: sent to itself
    ref = rows.index_select(0, ctx.import_rows.long()).view(-1, 3, 24)
    (dx_ref,) = torch.autograd.grad(ref, xr, dstates)
    assert torch.equal(states, ref) and torch.equal(dx, dx_ref)


def test_multi_is_bitwise_separate_calls(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(12)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    T = idx.numel()
    g = torch.Generator(device=DEV).manual_seed(5)
    shapes = [(64, F32, None), (32, BF16, BF16), (96, F32, F32)]
    xs = [torch.randn(T, c, device=DEV, generator=g).to(BF16) for c, _, _ in shapes]
    ws = [torch.randn(c, 4, device=DEV, generator=g).to(wd) for c, wd, _ in shapes]
    bs = [None if bd is None else torch.randn(c, device=DEV, generator=g).to(bd) for c, _, bd in shapes]
    dys = [torch.randn(T, c, device=DEV, generator=g).to(BF16) for c, _, _ in shapes]

    def run(multi):
        leaves = [t.clone().requires_grad_() for t in xs + ws] + [None if t is None else t.clone().requires_grad_()
                                                                  for t in bs]
        lx, lw, lb = leaves[:3], leaves[3:6], leaves[6:]
        ys = cake_causal_conv1d_cp_multi(lx, lw, ctx, lb) if multi else [
            cake_causal_conv1d_cp(a, c, ctx, d) for a, c, d in zip(lx, lw, lb)]
        torch.autograd.backward(ys, dys)
        return [y.detach() for y in ys] + [t.grad for t in leaves if t is not None]

    for a, c in zip(run(True), run(False)):
        assert torch.equal(a, c)


def test_recompute_handle_under_checkpoint_exchanges_nothing(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(13)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    exchanges = nccl_group._get_sequence_number_for_group  # counts the collectives on the group
    handle = CPRecomputeHandle()

    def step(checkpointed, counts):
        xl = x[idx].clone().requires_grad_()
        wl = w.clone().requires_grad_()

        def layer(t):  # the handle on the checkpointed call site only (a plain call's halo would stay kept)
            return cake_causal_conv1d_cp(t, wl, ctx, b, recompute_handle=handle if checkpointed else None) * 1.5

        start = exchanges()
        y = torch.utils.checkpoint.checkpoint(layer, xl, use_reentrant=False) if checkpointed else layer(xl)
        counts.append(exchanges() - start)
        y.backward(dy[idx])
        counts.append(exchanges() - start)
        return y.detach(), xl.grad, wl.grad

    plain_counts, ckpt_counts = [], []
    plain = step(False, plain_counts)
    ckpt = step(True, ckpt_counts)
    # one halo exchange in the forward, one gradient exchange in the backward (the plain step shows
    # that the counter sees them), none in the recomputation
    assert plain_counts == [1, 2] and ckpt_counts == [1, 2], (plain_counts, ckpt_counts)
    assert len(handle) == 0, handle
    for a, c in zip(plain, ckpt):
        assert torch.equal(a, c)


def test_recompute_handle_with_two_micro_batches_in_flight(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(18)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    handle = CPRecomputeHandle()
    layer = lambda t: cake_causal_conv1d_cp(t, w, ctx, b, recompute_handle=handle)  # noqa: E731
    xa = x[idx].clone().requires_grad_()
    xb = (2 * x[idx]).requires_grad_()
    ya = torch.utils.checkpoint.checkpoint(layer, xa, use_reentrant=False)
    yb = torch.utils.checkpoint.checkpoint(layer, xb, use_reentrant=False)  # before ya's backward
    assert len(handle) == 2
    yb.backward(dy[idx])
    ya.backward(dy[idx])
    assert len(handle) == 0
    for xl, yl in ((xa, ya), (xb, yb)):
        ref = xl.detach().clone().requires_grad_()
        y = cake_causal_conv1d_cp(ref, w, ctx, b)
        y.backward(dy[idx])
        assert torch.equal(y, yl) and torch.equal(ref.grad, xl.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_handle_with_x_made_inside_the_checkpoint(nccl_group, reentrant):
    """The usual block checkpoint: x_local is made inside the checkpointed function (freed after
    the first run, made anew by the recomputation, maybe at another micro-batch's address). Two
    micro-batches in flight, each with its own context, recomputed in either order: each takes its
    own halo, bitwise the plain step's results."""
    part, cu, x, dy, w, b, idx = one_rank_batch(19)
    ctxs = [build_cp_context(part, nccl_group, 0, DEV) for _ in range(2)]
    handle = CPRecomputeHandle()

    def block(ctx):
        return lambda t: cake_causal_conv1d_cp(t * 1, w, ctx, b, recompute_handle=handle)  # t * 1: a fresh x_local

    xs = [(k * x[idx]).requires_grad_() for k in (1, 2)]
    ys = [torch.utils.checkpoint.checkpoint(block(c), t, use_reentrant=reentrant) for c, t in zip(ctxs, xs)]
    assert len(handle) == 2
    for k in (1, 0):  # the second micro-batch's backward first
        ys[k].backward(dy[idx])
    assert len(handle) == 0
    for xl, yl in zip(xs, ys):
        ref = xl.detach().clone().requires_grad_()
        y = cake_causal_conv1d_cp(ref, w, ctxs[0], b)
        y.backward(dy[idx])
        assert torch.equal(y, yl) and torch.equal(ref.grad, xl.grad)


def test_recompute_handle_refuses_two_freed_inputs_of_one_context(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(20)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    handle = CPRecomputeHandle()
    layer = lambda t: cake_causal_conv1d_cp(t * 1, w, ctx, b, recompute_handle=handle)  # noqa: E731
    ys = [torch.utils.checkpoint.checkpoint(layer, (k * x[idx]).requires_grad_(), use_reentrant=False)
          for k in (1, 2)]
    with pytest.raises(RuntimeError, match="holds 2 halos of this context whose inputs were freed"):
        ys[0].backward(dy[idx])


def test_recompute_without_a_kept_halo_is_refused(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(14)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    xl = x[idx].clone().requires_grad_()
    handle = CPRecomputeHandle()
    y = torch.utils.checkpoint.checkpoint(lambda t: cake_causal_conv1d_cp(t, w, ctx, b, recompute_handle=handle),
                                          xl, use_reentrant=False)
    handle.clear()  # as if another call site had taken it
    with pytest.raises(RuntimeError, match="holds no halo for these inputs"):
        y.backward(dy[idx])


def test_graph_capture_and_replay_of_a_two_layer_step(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(15)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    T, C = idx.numel(), x.shape[1]
    w2 = (0.5 * torch.randn(C, 4, device=DEV)).to(F32)
    xin = torch.empty(T, C, device=DEV, dtype=BF16, requires_grad=True)
    wl, wl2 = w.clone().requires_grad_(), w2.clone().requires_grad_()
    dyin = torch.empty(T, C, device=DEV, dtype=BF16)

    def step():
        h = cake_causal_conv1d_cp(xin, wl, ctx, b)
        y = cake_causal_conv1d_cp(h, wl2, ctx)
        y.backward(dyin)
        return y

    def fresh(seed):  # new data in the static inputs
        g = torch.Generator(device=DEV).manual_seed(seed)
        with torch.no_grad():
            xin.copy_(torch.randn(T, C, device=DEV, generator=g))
            dyin.copy_(torch.randn(T, C, device=DEV, generator=g))

    params = (xin, wl, wl2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: modules loaded, allocator pools
            fresh(0)
            step()
    torch.cuda.current_stream().wait_stream(side)
    fresh(1)
    for p in params:
        p.grad = None  # the captured backward allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    static = (y_static, *(p.grad for p in params))
    for seed in (2, 3):
        fresh(seed)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in static]
        xe = xin.detach().clone().requires_grad_()
        we, we2 = wl.detach().clone().requires_grad_(), wl2.detach().clone().requires_grad_()
        h = cake_causal_conv1d_cp(xe, we, ctx, b)
        ye = cake_causal_conv1d_cp(h, we2, ctx)
        ye.backward(dyin)
        for a, c in zip(got, (ye.detach(), xe.grad, we.grad, we2.grad)):
            assert torch.equal(a, c)


def test_recompute_handle_refused_in_capture(nccl_group):
    part, cu, x, dy, w, b, idx = one_rank_batch(16)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    xl = x[idx].contiguous()
    cake_causal_conv1d_cp(xl, w, ctx, b)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            cake_causal_conv1d_cp(xl, w, ctx, b, recompute_handle=CPRecomputeHandle())


@pytest.mark.parametrize("case,error,match", [
    ("tokens", ValueError, "this rank's T"),
    ("strided", ValueError, "must be contiguous"),
    ("ctx", TypeError, "CPContext"),
    ("policy", ValueError, "silu_grad_preactivation"),
    ("weight", ValueError, "weight must have shape"),
    ("bias", ValueError, "bias must have shape"),
    ("dtype", ValueError, "x must have dtype torch.bfloat16"),
    ("misaligned", ValueError, "16-byte aligned address"),
    ("ctx_device", ValueError, r"^cake_causal_conv1d_cp: x_local must be on the context's device cpu .*got cuda:0: "
                               r"move it there \(x_local\.to\('cpu'\)\), or build the context on its device"),
])
def test_bad_arguments(nccl_group, case, error, match):
    """Each bad argument is the Python rules' error, after a valid call has registered the
    variant's module (so the binding's native check, in cp_autograd_forward, sees the call first:
    it must decline, before any exchange, for the Python rules to raise)."""
    part, cu, x, dy, w, b, idx = one_rank_batch(17)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    xl = x[idx].contiguous()
    cake_causal_conv1d_cp(xl, w, ctx, b)
    kwargs = {}
    if case == "tokens":
        xl = xl[1:]
    elif case == "strided":
        xl = torch.cat([xl, xl], 1)[:, : xl.shape[1]]
    elif case == "ctx":
        ctx = part
    elif case == "policy":
        kwargs["silu_grad_preactivation"] = "fp16"
    elif case == "weight":
        w = w[:, :3]
    elif case == "bias":
        b = b[1:]
    elif case == "dtype":
        xl = xl.float()
    elif case == "misaligned":
        xl = torch.cat([xl.new_zeros(1), xl.flatten()])[1:].view(xl.shape)
    elif case == "ctx_device":  # (was "cu_seqlens must be on x's device": the context's table)
        ctx = build_cp_context(part, nccl_group, 0, "cpu")
    with pytest.raises(error, match=match):
        cake_causal_conv1d_cp(xl, w, ctx, b, **kwargs)


def test_binding_declines_a_wrong_token_count_or_policy(nccl_group):
    """cp_autograd_forward itself declines (None, before anything is launched or exchanged) when
    only the token count, only the policy or only one table's dtype is off, with every other
    argument valid: the token count keeps the context's export_rows inside x."""
    from flashinfer_cake import _dispatch
    part, cu, x, dy, w, b, idx = one_rank_batch(23)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    xl = x[idx].contiguous()
    y_ref = cake_causal_conv1d_cp(xl, w, ctx, b)  # registers the variant's module

    tables = (ctx.cu_seqlens, ctx.export_rows, ctx.import_rows, ctx.frag_info, ctx.head_frags, ctx.tail_frags,
              ctx.g_rows, ctx.g_import)

    def call(xs, num_tokens, policy, tables=tables):
        return _dispatch.binding.cp_autograd_forward(
            xs, (w,), (b,), None, tables, num_tokens, nccl_group.group_name,
            (ctx.halo_send_splits, ctx.halo_recv_splits, ctx.g_send_splits, ctx.g_recv_splits), policy)

    (y,), _ = call((xl,), ctx.num_tokens, "bf16")
    assert torch.equal(y, y_ref)
    for tokens in (ctx.num_tokens - 1, ctx.num_tokens + 1):
        assert call((xl,), tokens, "bf16") is None
    assert call((xl[:-1].contiguous(),), ctx.num_tokens, "bf16") is None
    assert call((xl,), ctx.num_tokens, "fp16") is None
    assert call((xl,), ctx.num_tokens, 1) is None
    for i in (4, 5):  # the passes' fragment lists: int32 only
        assert call((xl,), ctx.num_tokens, "bf16", tables[:i] + (tables[i].long(),) + tables[i + 1:]) is None


def test_autograd_node_semantics(nccl_group):
    """The call's C++ autograd node does what the Python Function it replaced did: an output left
    out of the loss (multi) counts as a zero gradient; only the inputs that require grad get one;
    no node under no_grad; create_graph=True gives gradients whose own backward raises (as
    @once_differentiable); retain_graph runs the backward (and its exchange) twice, equal."""
    part, cu, x, dy, w, b, idx = one_rank_batch(19)
    ctx = build_cp_context(part, nccl_group, 0, DEV)
    xl = x[idx].contiguous()
    T = idx.numel()
    # multi, y[1] unused: its x's gradient is the one of a zero dy
    x2 = torch.randn(T, 32, device=DEV).to(BF16)
    w2 = torch.randn(32, 4, device=DEV)
    a, a2 = xl.clone().requires_grad_(), x2.clone().requires_grad_()
    ys = cake_causal_conv1d_cp_multi([a, a2], [w, w2], ctx, [b, None])
    ys[0].backward(dy[idx])
    ref = xl.clone().requires_grad_()
    cake_causal_conv1d_cp(ref, w, ctx, b).backward(dy[idx])
    ref2 = x2.clone().requires_grad_()
    cake_causal_conv1d_cp(ref2, w2, ctx).backward(torch.zeros_like(x2))
    assert torch.equal(a.grad, ref.grad) and torch.equal(a2.grad, ref2.grad)
    # only the weight requires grad
    wl = w.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xl, wl, ctx, b)
    edges = [f for f, _ in y.grad_fn.next_functions if f is not None]  # the graph reaches wl alone
    assert len(edges) == 1 and getattr(edges[0], "variable", None) is wl, y.grad_fn.next_functions
    (dw,) = torch.autograd.grad(y, wl, dy[idx])
    wr = w.clone().requires_grad_()
    cake_causal_conv1d_cp(xl.clone().requires_grad_(), wr, ctx, b).backward(dy[idx])
    assert torch.equal(dw, wr.grad)
    # no_grad: no node
    with torch.no_grad():
        assert cake_causal_conv1d_cp(xl.clone().requires_grad_(), wl, ctx, b).grad_fn is None
    # create_graph=True: the gradients' own backward raises
    xg = xl.clone().requires_grad_()
    (dx,) = torch.autograd.grad(cake_causal_conv1d_cp(xg, w, ctx, b), xg, dy[idx].clone().requires_grad_(),
                                create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.float().sum().backward()
    # retain_graph: twice, equal
    xr = xl.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xr, w, ctx, b)
    (g1,) = torch.autograd.grad(y, xr, dy[idx], retain_graph=True)
    (g2,) = torch.autograd.grad(y, xr, dy[idx])
    assert torch.equal(g1, g2) and torch.equal(g1, ref.grad)
