"""GPU tests of cake_causal_conv1d_train_forward (sm_90; skipped without one, see conftest.py).

Every output is checked against the FP64 reference on fresh random inputs (never zeros), into a
NaN-poisoned `out` where one is passed, so an element the kernel never wrote fails the test.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from doclengths import empty_at_ends, docs_3000, docs_16_to_64, fill, make_cu, one_doc, split, tiny_docs
from sanitizer import assert_sanitizer_clean, needs_sanitizer
from launched import launched_kernels
from flashinfer_cake import (
    cake_causal_conv1d,
    cake_causal_conv1d_train_forward,
    cake_causal_conv1d_train_forward_workspace,
    cake_causal_conv1d_train_forward_workspace_bytes,
    is_cake_causal_conv1d_train_supported,
)
from flashinfer_cake.reference import causal_conv1d_reference

pytestmark = pytest.mark.gpu

fwd = cake_causal_conv1d_train_forward
workspace_bytes = cake_causal_conv1d_train_forward_workspace_bytes
new_workspace = cake_causal_conv1d_train_forward_workspace

DEV = "cuda"
BF16 = torch.bfloat16
F32 = torch.float32
I32 = torch.int32
WEIGHT_DTYPES = [pytest.param(F32, id="w_fp32"), pytest.param(BF16, id="w_bf16")]
BIAS_DTYPES = [
    pytest.param(None, id="b_none"),
    pytest.param(F32, id="b_fp32"),
    pytest.param(BF16, id="b_bf16"),
]
BOUNDARY_LENGTHS = (63, 64, 65, 127, 128, 129, 256, 257)


# ---------------------------------------------------------------------------------------------
# helpers


def device():
    return torch.device(DEV, torch.cuda.current_device())


def sync():
    torch.cuda.synchronize()


def boundary_mix(S, rng):
    return fill(S, rng, BOUNDARY_LENGTHS, p_empty=0.02)


def make_inputs(S, C, *, seed, weight_dtype=F32, bias_dtype=F32, batch_dim=False):
    """Fresh random x (BF16), weight and bias (None when bias_dtype is None) on the GPU."""
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    x = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    if batch_dim:
        x = x.unsqueeze(0)
    weight = (0.5 * torch.randn(C, 4, device=DEV, generator=g)).to(weight_dtype)
    bias = None
    if bias_dtype is not None:
        bias = (0.5 * torch.randn(C, device=DEV, generator=g)).to(bias_dtype)
    return x, weight, bias


def poisoned(shape, dev=DEV):
    return torch.full(shape, float("nan"), dtype=BF16, device=dev)


def same_bits(a, b):
    """Bitwise equality that also holds for NaN-poisoned tensors."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def assert_matches_reference(y, x, weight, cu_seqlens, bias=None):
    """y must be x's shape, fully written, and within half a BF16 ulp of the FP64 result.

    FP32 math then round-to-nearest-even is at most half an ulp off the exact value, plus FP32
    noise (covered by 2**-12 relative and 2e-5 absolute); a missing or misplaced tap, a leak
    across a document boundary, or a missing bias is off by O(0.1) and fails by far.
    """
    assert y.dtype == BF16 and y.shape == x.shape and y.device == x.device, (y.dtype, y.shape)
    assert y.is_contiguous()
    C = x.shape[-1]
    ref = causal_conv1d_reference(x, weight, cu_seqlens, bias).reshape(-1, C)
    got = y.reshape(-1, C).double()
    unwritten = ~torch.isfinite(got)
    if unwritten.any():
        t, c = unwritten.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(unwritten.sum())} of {got.numel()} outputs are NaN/inf (never written?); "
            f"first at (t={t}, c={c})"
        )
    err = (got - ref).abs()
    mag = ref.abs()
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)  # BF16 ulp at |ref| (0 for ref == 0)
    tol = 0.5 * ulp + 2.0**-12 * mag + 2e-5
    bad = err > tol
    if bad.any():
        t, c = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {got.numel()} outputs off by more than half a BF16 ulp; "
            f"first at (t={t}, c={c}): got {got[t, c].item()!r}, want {ref[t, c].item()!r}; "
            f"max abs err {err.max().item():.3g}"
        )
    rel_l2 = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel_l2 < 1e-2, rel_l2


# ---------------------------------------------------------------------------------------------
# correctness


def test_supported_on_this_gpu():
    assert is_cake_causal_conv1d_train_supported() is True
    assert is_cake_causal_conv1d_train_supported(torch.device(DEV)) is True
    assert is_cake_causal_conv1d_train_supported(device()) is True
    assert is_cake_causal_conv1d_train_supported(torch.device("cpu")) is False


@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_every_variant_matches_reference(weight_dtype, bias_dtype):
    S, C = 4097, 264
    seed = 1000 + 10 * (weight_dtype is BF16) + {None: 0, F32: 1, BF16: 2}[bias_dtype]
    rng = random.Random(seed)
    x, w, b = make_inputs(S, C, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, [0] + split(S, 40, rng) + [0])

    y = fwd(x, w, cu, bias=b)
    assert y.data_ptr() != x.data_ptr()
    assert_matches_reference(y, x, w, cu, b)

    out = poisoned(x.shape)
    assert fwd(x, w, cu, bias=b, out=out) is out
    assert torch.equal(out, y)


# The token-lane route (C <= 128: 1, 2, 4 or 8 lanes per token, then channel tiles of 8 lanes; a
# CTA of 2048, 1024, 512 or 256 tokens, 4 warp segments): several tiles, a last tile that ends
# inside a warp's segment or leaves whole warps without tokens, every lane count, C not a power of
# 2 (idle lanes), two channel tiles, all variants.
NARROW_CASES = [
    pytest.param(5000, 8, docs_16_to_64, F32, F32, id="S5000-C8-docs16-64"),
    pytest.param(70001, 8, docs_3000, BF16, None, id="S70001-C8-3000docs"),
    pytest.param(4099, 16, tiny_docs, BF16, None, id="S4099-C16-tiny"),
    pytest.param(3001, 24, boundary_mix, F32, BF16, id="S3001-C24-boundary-mix"),
    pytest.param(2053, 32, one_doc, BF16, BF16, id="S2053-C32-one"),
    pytest.param(1999, 40, empty_at_ends, F32, None, id="S1999-C40-empty-ends"),
    pytest.param(777, 56, tiny_docs, BF16, F32, id="S777-C56-tiny"),
    pytest.param(1029, 64, docs_16_to_64, F32, BF16, id="S1029-C64-docs16-64"),
    pytest.param(300, 64, boundary_mix, BF16, F32, id="S300-C64-boundary-mix"),
    pytest.param(2001, 72, docs_16_to_64, BF16, F32, id="S2001-C72-docs16-64"),
    pytest.param(1500, 128, tiny_docs, F32, None, id="S1500-C128-tiny"),
]


DOC_CASES = [
    # S, C, document mix, weight dtype, bias dtype
    pytest.param(1, 8, one_doc, F32, None, id="S1-C8-one"),
    pytest.param(2, 24, one_doc, BF16, F32, id="S2-C24-one"),
    pytest.param(3, 40, empty_at_ends, F32, BF16, id="S3-C40-empty-ends"),
    pytest.param(5, 136, tiny_docs, BF16, None, id="S5-C136-tiny"),
    pytest.param(1000, 1000, docs_16_to_64, F32, F32, id="S1000-C1000-docs16-64"),
    pytest.param(4097, 2056, one_doc, BF16, BF16, id="S4097-C2056-one"),
    pytest.param(4097, 264, empty_at_ends, F32, None, id="S4097-C264-empty-ends"),
    pytest.param(12345, 136, tiny_docs, F32, BF16, id="S12345-C136-tiny"),
    pytest.param(12345, 8, docs_16_to_64, BF16, F32, id="S12345-C8-docs16-64"),
    pytest.param(20000, 264, docs_3000, F32, F32, id="S20000-C264-3000docs"),
    pytest.param(8191, 1000, tiny_docs, BF16, BF16, id="S8191-C1000-tiny"),
    pytest.param(3001, 4096, boundary_mix, BF16, None, id="S3001-C4096-boundary-mix"),
    pytest.param(2049, 4096, docs_16_to_64, F32, BF16, id="S2049-C4096-docs16-64"),
    pytest.param(1500, 16384, docs_16_to_64, F32, F32, id="S1500-C16384-docs16-64"),
    pytest.param(777, 16384, empty_at_ends, BF16, F32, id="S777-C16384-empty-ends"),
    *NARROW_CASES,
]


@pytest.mark.parametrize("S, C, mix, weight_dtype, bias_dtype", DOC_CASES)
def test_document_mixes_match_reference(S, C, mix, weight_dtype, bias_dtype):
    seed = 7919 * S + C
    x, w, b = make_inputs(S, C, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, mix(S, random.Random(seed)))
    out = poisoned(x.shape)
    y = fwd(x, w, cu, bias=b, out=out)
    assert y is out
    assert_matches_reference(y, x, w, cu, b)
    assert torch.equal(fwd(x, w, cu, bias=b), y)


@pytest.mark.parametrize("C", [40, 2056])
@pytest.mark.parametrize("L", BOUNDARY_LENGTHS)
def test_tile_boundary_document_lengths(L, C):
    """Seven documents of length L then a short one (63/64/65/127/128/129/256/257)."""
    S = 7 * L + 5
    x, w, b = make_inputs(S, C, seed=31 * L + C)
    cu = make_cu(S, [L] * 7 + [5])
    y = fwd(x, w, cu, bias=b, out=poisoned(x.shape))
    assert_matches_reference(y, x, w, cu, b)


@pytest.mark.parametrize("S, C", [(1, 8), (4097, 264), (3001, 4096)])
def test_batch_dim_input(S, C):
    x, w, b = make_inputs(S, C, seed=S + C, batch_dim=True)
    assert x.shape == (1, S, C)
    cu = make_cu(S, split(S, 20, random.Random(S)))
    out = poisoned(x.shape)
    y = fwd(x, w, cu, bias=b, out=out)
    assert y is out
    assert_matches_reference(y, x, w, cu, b)
    y_new = fwd(x, w, cu, bias=b)
    assert y_new.shape == (1, S, C)
    assert torch.equal(y_new, y)
    assert torch.equal(fwd(x[0], w, cu, bias=b), y[0])


@pytest.mark.parametrize("shape", [(0, 64), (1, 0, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_empty_sequence(shape, weight_dtype):
    C = shape[-1]
    x = torch.empty(shape, dtype=BF16, device=DEV)
    w = torch.randn(C, 4, device=DEV).to(weight_dtype)
    b = torch.randn(C, device=DEV)
    for cu in (torch.zeros(1, dtype=I32, device=DEV), torch.zeros(4, dtype=I32, device=DEV)):
        y = fwd(x, w, cu, bias=b)
        assert y.shape == x.shape and y.dtype == BF16 and y.device == x.device
        out = torch.empty(shape, dtype=BF16, device=DEV)
        assert fwd(x, w, cu, out=out, workspace=new_workspace(0, C, device())) is out
    sync()


# ---------------------------------------------------------------------------------------------
# workspace and determinism


def test_workspace_allocator():
    dev = device()
    for S, C in [(0, 8), (1, 8), (4097, 264), (20000, 1000), (1500, 16384)]:
        nbytes = workspace_bytes(S, C, dev)
        assert isinstance(nbytes, int) and nbytes >= 0
        assert workspace_bytes(S + 1000, C, dev) >= nbytes
        ws = new_workspace(S, C, dev)
        assert ws.dtype == I32 and ws.dim() == 1 and ws.is_contiguous()
        assert ws.device == dev
        assert ws.numel() * 4 >= nbytes
        assert ws.count_nonzero().item() == 0


def test_workspace_left_zero_and_reused_across_shapes():
    shapes = [(4097, 264, 40), (20000, 1000, 3000), (5, 8, 2), (1500, 16384, 20), (12345, 136, 900)]
    dev = device()
    biggest = max(shapes, key=lambda s: workspace_bytes(s[0], s[1], dev))
    ws = new_workspace(biggest[0], biggest[1], dev)
    for i, (S, C, n_docs) in enumerate(shapes * 2):
        x, w, b = make_inputs(S, C, seed=500 + i, weight_dtype=(F32, BF16)[i % 2])
        cu = make_cu(S, split(S, n_docs, random.Random(i)))
        y = fwd(x, w, cu, bias=b, out=poisoned(x.shape), workspace=ws)
        sync()
        assert ws.count_nonzero().item() == 0, f"workspace not left zero after S={S}, C={C}"
        assert_matches_reference(y, x, w, cu, b)
        assert torch.equal(fwd(x, w, cu, bias=b), y)  # default workspace, same bits


def test_bitwise_deterministic():
    S, C = 20000, 1000
    x, w, b = make_inputs(S, C, seed=77, bias_dtype=BF16)
    cu = make_cu(S, split(S, 500, random.Random(77)))
    ws = new_workspace(S, C, device())
    first = fwd(x, w, cu, bias=b)
    assert_matches_reference(first, x, w, cu, b)
    for i in range(4):
        y = fwd(x, w, cu, bias=b, out=poisoned(x.shape), workspace=ws if i % 2 else None)
        assert torch.equal(y, first), f"call {i} differs from the first"


# ---------------------------------------------------------------------------------------------
# streams, graphs, host synchronization


@pytest.mark.parametrize(
    "explicit_workspace, pass_out",
    [pytest.param(True, True, id="explicit-ws-out"), pytest.param(False, False, id="default-ws")],
)
def test_cuda_graph_replay_with_new_data(explicit_workspace, pass_out):
    S, C, n_docs = 5000, 520, 37
    x, w, b = make_inputs(S, C, seed=9)
    cu = make_cu(S, split(S, n_docs, random.Random(9)))
    ws = new_workspace(S, C, device()) if explicit_workspace else None
    static_out = poisoned(x.shape) if pass_out else None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: build/load the module, default workspaces
        for _ in range(3):
            fwd(x, w, cu, bias=b, out=static_out, workspace=ws)
    torch.cuda.current_stream().wait_stream(side)
    sync()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fwd(x, w, cu, bias=b, out=static_out, workspace=ws)
    if pass_out:
        assert y is static_out

    for seed in (10, 11, 12):
        new_x, _, _ = make_inputs(S, C, seed=seed)
        new_cu = make_cu(S, split(S, n_docs, random.Random(seed)))
        y.fill_(float("nan"))
        x.copy_(new_x)
        cu.copy_(new_cu)
        graph.replay()
        expected = fwd(new_x, w, new_cu, bias=b)
        sync()
        assert torch.equal(y, expected), f"replay with seed {seed} differs from eager"
        assert_matches_reference(y, new_x, w, new_cu, b)
        if ws is not None:
            assert ws.count_nonzero().item() == 0


@pytest.mark.parametrize("C", [4096, 64], ids=["strip-kernel", "token-lane-kernel"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default-mode", "deterministic-mode"])
def test_cuda_graph_of_default_calls_holds_only_their_kernels(C, deterministic, request):
    """Forwards captured without a workspace (the raw call; cake_causal_conv1d without and with
    grad) put one kernel each in the graph: their private default workspaces are not filled while
    no route reads the counters (a zero fill was one more kernel per call in every replay: a graph
    of forwards at 1024x4096, 7.1 -> 8.3 us per call on an H200), also not by torch's fill of new
    memory under use_deterministic_algorithms."""
    was = torch.are_deterministic_algorithms_enabled()
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(was))
    torch.use_deterministic_algorithms(deterministic)
    S = 1024
    x, w, b = make_inputs(S, C, seed=31)
    cu = make_cu(S, [100, S - 100])
    x_leaf = x.clone().requires_grad_()
    calls = [lambda: fwd(x, w, cu, bias=b), lambda: cake_causal_conv1d(x, w, cu, b),
             lambda: cake_causal_conv1d(x_leaf, w, cu, b)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the module loaded
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [call() for call in calls]
    names = launched_kernels(graph.replay)
    assert len(names) == len(calls) and all("causal_conv1d_fwd" in n for n in names), names
    expected = fwd(x, w, cu, bias=b)
    sync()
    for y in ys:
        assert torch.equal(y.detach(), expected)


def test_two_streams_at_once_default_workspaces():
    S, C, reps = 8192, 2048, 6
    xa, wa, ba = make_inputs(S, C, seed=21)
    xb, wb, bb = make_inputs(S, C, seed=22, weight_dtype=BF16, bias_dtype=None)
    cua = make_cu(S, split(S, 3, random.Random(21)))
    cub = make_cu(S, tiny_docs(S, random.Random(22)))
    outs_a = [poisoned(xa.shape) for _ in range(reps)]
    outs_b = [poisoned(xb.shape) for _ in range(reps)]
    current = torch.cuda.current_stream()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    sa.wait_stream(current)
    sb.wait_stream(current)
    for i in range(reps):  # interleave the launches so both streams have work queued at once
        with torch.cuda.stream(sa):
            fwd(xa, wa, cua, bias=ba, out=outs_a[i])
        with torch.cuda.stream(sb):
            fwd(xb, wb, cub, bias=bb, out=outs_b[i])
    current.wait_stream(sa)
    current.wait_stream(sb)
    sync()
    assert_matches_reference(outs_a[0], xa, wa, cua, ba)
    assert_matches_reference(outs_b[0], xb, wb, cub, bb)
    for i in range(1, reps):
        assert torch.equal(outs_a[i], outs_a[0]), f"stream A call {i}"
        assert torch.equal(outs_b[i], outs_b[0]), f"stream B call {i}"


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "out-and-workspace"])
def test_no_host_synchronization(explicit):
    S, C = 4096, 1024
    x, w, b = make_inputs(S, C, seed=5)
    cu = make_cu(S, split(S, 50, random.Random(5)))
    ws = new_workspace(S, C, device()) if explicit else None
    fwd(x, w, cu, bias=b, workspace=ws)  # warm-up: module loaded, default workspace made
    sync()
    out = poisoned(x.shape) if explicit else None
    stream = torch.cuda.current_stream()

    start = time.perf_counter()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU busy-wait on the current stream
    before = time.perf_counter()
    y = fwd(x, w, cu, bias=b, out=out, workspace=ws)
    after = time.perf_counter()
    still_busy = not stream.query()
    sync()
    finished = time.perf_counter()

    assert finished - start > 0.2, "busy kernel too short for this test to mean anything"
    assert still_busy, "the stream was idle right after the call: the call waited for the GPU"
    assert after - before < 0.05, f"the call blocked the host for {after - before:.3f} s"
    assert_matches_reference(y, x, w, cu, b)


# ---------------------------------------------------------------------------------------------
# rejected and corrupt inputs on the GPU


def _cpu(name):
    def mutate(a):
        a[name] = a[name].cpu()

    return mutate


def _short_workspace(a):
    S, C = a["x"].shape
    need = workspace_bytes(S, C, device())
    a["workspace"] = torch.zeros(max(0, (need + 3) // 4 - 1), dtype=I32, device=DEV)


def _out_is_x(a):
    a["out"] = a["x"]


def _out_overlaps_x(a):
    S, C = a["x"].shape
    buf = torch.randn(2 * S, C, device=DEV).to(BF16)
    a["x"], a["out"] = buf[:S], buf[S // 2 : S // 2 + S]


def _out_overlaps(other):
    """out's first bytes reused as `other` (weight or cu_seqlens): the kernel would write what it reads."""
    def mutate(a):
        t = a[other]
        a[other] = a["out"].view(-1).view(t.dtype)[: t.numel()].view(t.shape).copy_(t)

    return mutate


BAD_GPU_CASES = [
    pytest.param("x", _cpu("x"), id="x-cpu"),
    pytest.param("out", _out_overlaps("weight"), id="out-overlaps-weight"),
    pytest.param("out", _out_overlaps("cu_seqlens"), id="out-overlaps-cu_seqlens"),
    pytest.param("cu_seqlens", _cpu("cu_seqlens"), id="cu-cpu"),
    pytest.param("weight", _cpu("weight"), id="weight-cpu"),
    pytest.param("bias", _cpu("bias"), id="bias-cpu"),
    pytest.param("out", _cpu("out"), id="out-cpu"),
    pytest.param("workspace", _cpu("workspace"), id="workspace-cpu"),
    pytest.param("workspace", _short_workspace, id="workspace-one-int-short"),
    pytest.param("out", _out_is_x, id="out-is-x"),
    pytest.param("out", _out_overlaps_x, id="out-overlaps-x"),
]


@pytest.mark.parametrize("argname, mutate", BAD_GPU_CASES)
def test_bad_gpu_input_rejected_and_nothing_written(argname, mutate):
    S, C = 1000, 264
    x, w, b = make_inputs(S, C, seed=3)
    args = {
        "x": x,
        "weight": w,
        "cu_seqlens": make_cu(S, split(S, 9, random.Random(3))),
        "bias": b,
        "out": poisoned(x.shape),
        "workspace": new_workspace(S, C, device()),
    }
    mutate(args)
    x_before, out_before = args["x"].clone(), args["out"].clone()
    ws_before = args["workspace"].clone()
    with pytest.raises(ValueError, match=rf"\b{argname}\b"):
        fwd(args["x"], args["weight"], args["cu_seqlens"], bias=args["bias"],
            out=args["out"], workspace=args["workspace"])
    sync()
    assert same_bits(args["out"], out_before), "a rejected call wrote out"
    assert same_bits(args["x"], x_before), "a rejected call wrote x"
    assert torch.equal(args["workspace"], ws_before), "a rejected call wrote the workspace"


def test_writes_bump_the_version_of_given_outputs():
    """out= is written as by an in-place op: its version moves, so autograd refuses a saved
    tensor the call overwrote."""
    S, C = 1000, 264
    x, w, b = make_inputs(S, C, seed=8)
    cu = make_cu(S, split(S, 9, random.Random(8)))
    out = poisoned(x.shape)
    before = out._version
    fwd(x, w, cu, bias=b, out=out)
    assert out._version > before


def _misaligned(t):
    """A contiguous copy of t whose data pointer is one element past an aligned address."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("argname", ["x", "out"])
def test_misaligned_rows_are_a_value_error_naming_them(argname):
    """x and out must start 16-byte aligned (the contract, read and written in 16-byte rows): a ValueError naming
    the argument, and nothing written."""
    S, C = 1000, 264
    x, w, b = make_inputs(S, C, seed=4)
    cu = make_cu(S, split(S, 9, random.Random(4)))
    args = {"x": x, "out": poisoned(x.shape)}
    args[argname] = _misaligned(args[argname])
    assert args[argname].data_ptr() % 16
    out_before = args["out"].clone()
    with pytest.raises(ValueError, match=rf"^cake_causal_conv1d_train_forward: {argname} must start at a 16-byte "
                                         rf"aligned address"):
        fwd(args["x"], w, cu, bias=b, out=args["out"])
    sync()
    assert same_bits(args["out"], out_before), "a rejected call wrote out"


@pytest.mark.parametrize("argname", ["weight", "bias"])
def test_misaligned_parameter_is_copied_and_correct(argname):
    """A misaligned weight / bias view (a slice of a larger parameter) is copied: the result is the aligned call's,
    bitwise, and the reference's."""
    S, C = 1000, 264
    x, w, b = make_inputs(S, C, seed=4)
    cu = make_cu(S, split(S, 9, random.Random(4)))
    args = {"weight": w, "bias": b}
    args[argname] = _misaligned(args[argname])
    assert args[argname].data_ptr() % 16
    y = fwd(x, args["weight"], cu, bias=args["bias"], out=poisoned(x.shape))
    sync()
    assert torch.equal(y, fwd(x, w, cu, bias=b))
    assert_matches_reference(y, x, w, cu, b)


CORRUPT_CU = {
    "descending": lambda S: [0, S, S // 2, S // 4, 1, S],
    "negative": lambda S: [0, -5, 10, -(2**31), S],
    "beyond-S": lambda S: [0, S // 2, S + 100, 2 * S, S + 1],
    "huge": lambda S: [0, 2**31 - 1, -(2**31), 2**31 - 1],
    "first-nonzero": lambda S: [7, 100, S],
    "last-short": lambda S: [0, 100, S - 13],
    "length-1-zero": lambda S: [0],
    "length-1-S": lambda S: [S],
    "all-equal-big": lambda S: [S + 1] * 5,
    "garbage": lambda S: [r.randint(-(2**31), 2**31 - 1) for r in [random.Random(S)] for _ in range(64)],
    "sorted-out-of-range": lambda S: [-9, -1, 2, 2, 40, S - 200, S + 3, S + 3],
}
# Non-decreasing patterns have a defined result (the reference's: the last entry <= t starts t's
# document, none when there is none); out-of-order ones only a memory-safe, deterministic one.
SORTED_CORRUPT = [name for name, make in CORRUPT_CU.items() if make(3000) == sorted(make(3000))]


@pytest.mark.parametrize("S, C", [(3000, 264), (1000, 4096), (3000, 8), (1000, 72)])
@pytest.mark.parametrize("pattern", list(CORRUPT_CU))
def test_corrupt_cu_seqlens_do_not_fault(pattern, S, C):
    x, w, b = make_inputs(S, C, seed=S + C)
    bad_cu = torch.tensor(CORRUPT_CU[pattern](S), dtype=I32, device=DEV)
    ws = new_workspace(S, C, device())
    out = poisoned(x.shape)
    assert fwd(x, w, bad_cu, bias=b, out=out, workspace=ws) is out
    y_default = fwd(x, w, bad_cu, bias=b)
    sync()  # raises if the kernel faulted
    assert y_default.shape == x.shape
    assert not out.isnan().any(), "documented: every row is written whatever cu_seqlens holds"
    assert torch.equal(out, y_default)
    assert ws.count_nonzero().item() == 0, "workspace not left zero after a corrupt cu_seqlens"
    if pattern in SORTED_CORRUPT:
        assert_matches_reference(out, x, w, bad_cu, b)

    # A valid call afterwards, with both workspaces, is still exact.
    cu = make_cu(S, split(S, 11, random.Random(S)))
    y = fwd(x, w, cu, bias=b, out=poisoned(x.shape), workspace=ws)
    sync()
    assert_matches_reference(y, x, w, cu, b)
    assert ws.count_nonzero().item() == 0
    assert torch.equal(fwd(x, w, cu, bias=b, out=poisoned(x.shape)), y)


_MEMCHECK_SCRIPT = """
import random, torch
from flashinfer_cake import cake_causal_conv1d_train_forward as fwd
PATTERNS = {patterns}  # per S
for S, C in [(300, 264), (200, 4096), (3000, 8), (1000, 40), (1000, 72)]:
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, 4, device="cuda")
    b = torch.randn(C, device="cuda")
    for name, cu in PATTERNS[S].items():
        fwd(x, w, torch.tensor(cu, dtype=torch.int32, device="cuda"), bias=b)
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_corrupt_cu_seqlens_memcheck_clean(tmp_path):
    """compute-sanitizer's memcheck sees no out-of-bounds access for any corrupt pattern."""
    patterns = {S: {name: [min(max(v, -(2**31)), 2**31 - 1) for v in make(S)] for name, make in CORRUPT_CU.items()}
                for S in (300, 200, 3000, 1000)}  # concrete lists, each pattern made for the S it runs at
    assert_sanitizer_clean(_MEMCHECK_SCRIPT.replace("{patterns}", repr(patterns)), tmp_path)


_RACECHECK_SCRIPT = """
import torch
from flashinfer_cake import cake_causal_conv1d_train_forward as fwd
g = torch.Generator().manual_seed(11)
# token lanes with 1 to 8 lanes and 2 channel tiles (with states C = 64 takes the 8-lane strip kernel)
for S, C in [(70001, 8), (20001, 16), (9001, 24), (5001, 64), (3001, 72)]:
    lengths = torch.randint(1, 300, (S,), generator=g).cumsum(0)
    cu = torch.tensor([0, *lengths[lengths < S].tolist(), S], dtype=torch.int32, device="cuda")
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, 4, device="cuda")
    h = torch.randn(len(cu) - 1, 3, C, device="cuda", dtype=torch.bfloat16)
    fwd(x, w, cu)
    fwd(x, w, cu, initial_states=h, final_states_out=torch.empty_like(h))
# the strip kernel with states (C > 128): a few documents (the scan's entries in shared memory), then 1-3-token
# ones (more entries than threads: the short scan's coarse search and its next entries by shuffle; the 16-row ring)
for S, C, longest in [(3001, 264, 1500), (2049, 136, 4)]:
    lengths = torch.randint(1, longest, (S,), generator=g).cumsum(0)
    cu = torch.tensor([0, *lengths[lengths < S].tolist(), S], dtype=torch.int32, device="cuda")
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, 4, device="cuda")
    h = torch.randn(len(cu) - 1, 3, C, device="cuda", dtype=torch.bfloat16)
    fwd(x, w, cu, initial_states=h, final_states_out=torch.empty_like(h))
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_racecheck_clean(tmp_path):
    """compute-sanitizer's racecheck sees no unordered shared-memory access on the token-lane route
    (C <= 128: a lane reads the rows other lanes copied into the warp's ring, and refills a slot
    others read the block before), stateless and with states, with a last tile that ends inside a
    warp's segment; and in the strip kernel's document scan with states (its scratch written before
    the search's barriers and read after them), with few documents and with more than a CTA's threads."""
    assert_sanitizer_clean(_RACECHECK_SCRIPT, tmp_path, tool="racecheck")

