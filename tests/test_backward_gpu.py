"""GPU tests of cake_causal_conv1d_train_backward and of the autograd entry cake_causal_conv1d
(sm_90; skipped without one, see conftest.py).

Every gradient is checked against the FP64 reference backward on fresh random inputs (never
zeros), into NaN-poisoned dx / dweight / dbias where they are passed, so an element the kernels
never wrote fails the test. Tolerances (see `assert_grads_match_reference`) are derived from
the kernels' arithmetic: FP32 math, dx rounded to BF16, dweight / dbias summed in FP32 and
rounded to the parameter's dtype.
"""

from __future__ import annotations

import random
import re
import time
import warnings

import pytest
import torch

from doclengths import docs_3000, docs_16_to_64, fill, make_cu, one_doc, split
from launched import launched_route
from sanitizer import assert_sanitizer_clean, needs_sanitizer
from flashinfer_cake import (
    CakeCausalConv1dFunction,
    cake_causal_conv1d,
    cake_causal_conv1d_train_backward,
    cake_causal_conv1d_train_backward_workspace,
    cake_causal_conv1d_train_backward_workspace_bytes,
    cake_causal_conv1d_train_forward,
    cake_causal_conv1d_train_forward_workspace,
)
from flashinfer_cake.reference import (
    causal_conv1d_backward_reference,
    causal_conv1d_preactivation_reference,
)

pytestmark = pytest.mark.gpu

fwd = cake_causal_conv1d_train_forward
bwd = cake_causal_conv1d_train_backward
workspace_bytes = cake_causal_conv1d_train_backward_workspace_bytes
new_workspace = cake_causal_conv1d_train_backward_workspace
new_fwd_workspace = cake_causal_conv1d_train_forward_workspace

DEV = "cuda"
BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64
I32 = torch.int32
WEIGHT_DTYPES = [pytest.param(F32, id="w_fp32"), pytest.param(BF16, id="w_bf16")]
BIAS_DTYPES = [
    pytest.param(None, id="b_none"),
    pytest.param(F32, id="b_fp32"),
    pytest.param(BF16, id="b_bf16"),
]
POLICIES = ["bf16", "fp32"]
BOUNDARY_LENGTHS = (63, 64, 65, 127, 128, 129, 1023, 1024, 1025)


# ---------------------------------------------------------------------------------------------
# helpers


def device():
    return torch.device(DEV, torch.cuda.current_device())


def sync():
    torch.cuda.synchronize()


def empty_ends_and_middle(S, rng):
    return [0, 0] + split(S // 2, 4, rng) + [0, 0] + split(S - S // 2, 4, rng) + [0, 0, 0]


def tiny_docs(S, rng):
    """Thousands of 1-8 token documents (for large S), a few empty ones."""
    return fill(S, rng, (1, 2, 3, 4, 5, 6, 7, 8), p_empty=0.02)


def short_docs(S, rng):
    """1-3 token documents: every token is within 3 of a document start."""
    return fill(S, rng, (1, 2, 3), p_empty=0.05)


def boundary_mix(S, rng):
    return fill(S, rng, BOUNDARY_LENGTHS + (1, 2, 3), p_empty=0.02)


def make_inputs(S, C, *, seed, weight_dtype=F32, bias_dtype=F32, batch_dim=False):
    """Fresh random x, dy (BF16), weight and bias (None when bias_dtype is None) on the GPU."""
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    x = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    dy = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    if batch_dim:
        x, dy = x.unsqueeze(0), dy.unsqueeze(0)
    weight = (0.5 * torch.randn(C, 4, device=DEV, generator=g)).to(weight_dtype)
    bias = None
    if bias_dtype is not None:
        bias = (0.5 * torch.randn(C, device=DEV, generator=g)).to(bias_dtype)
    return x, weight, bias, dy


def poisoned(shape, dtype=BF16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def poisoned_grads(x, weight, bias):
    """NaN-filled dx, dweight, dbias (None without a bias) for the `dx=`/`dweight=`/`dbias=`."""
    return (poisoned(x.shape), poisoned(weight.shape, weight.dtype),
            None if bias is None else poisoned(bias.shape, bias.dtype))


def same_bits(a, b):
    """Bitwise equality (None == None) that also holds for NaN-poisoned tensors."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def backward(x, weight, cu, dy, bias=None, policy="bf16", **kw):
    """The raw backward, always as (dx, dweight, dbias or None)."""
    grads = bwd(x, weight, cu, dy, bias=bias, silu_grad_preactivation=policy, **kw)
    assert isinstance(grads, tuple) and len(grads) == (2 if bias is None else 3), len(grads)
    return grads if bias is not None else (*grads, None)


def backward_into(x, weight, cu, dy, bias=None, policy="bf16", **kw):
    """The raw backward into NaN-poisoned outputs; checks that it returns exactly them."""
    outs = poisoned_grads(x, weight, bias)
    grads = backward(x, weight, cu, dy, bias, policy, dx=outs[0], dweight=outs[1], dbias=outs[2], **kw)
    assert all(g is o for g, o in zip(grads, outs)), "the given output tensors must be returned"
    return grads


def assert_same_grads(got, want, what=""):
    for name, g, w in zip(("dx", "dweight", "dbias"), got, want):
        assert same_bits(g, w), f"{what}{name} differs bitwise"


def silu_grad(a):
    s = torch.sigmoid(a)
    return s * (1 + a * (1 - s))


def _lookahead(v, w_abs):
    """``sum_k w_abs[:, k] * v[s + 3 - k]`` over every tap, across documents too (used for
    error bounds of dx: v >= 0, so ignoring documents only makes it larger)."""
    out = v * w_abs[:, 3]
    for back in (1, 2, 3):
        if back < v.shape[0]:
            out[:-back] += v[back:] * w_abs[:, 3 - back]
    return out


def _lookback(v, x_abs):
    """``[C, 4]``: ``sum_t v[t] * x_abs[t - 3 + k]`` over every tap (bounds of dweight)."""
    S = v.shape[0]
    cols = [(v[back:] * x_abs[: max(S - back, 0)]).sum(0) for back in (3, 2, 1)]
    return torch.stack(cols + [(v * x_abs).sum(0)], dim=1)


def _g_error_bound(x, weight, cu, dy, bias, policy):
    """Per element, a bound of |g_kernel - g_ref| with g = dy * silu'(a').

    The kernel's FP32 pre-activation is within 2^-20 * (|b| + sum |w x|) of the exact one (four
    roundings of 2^-24). silu' has |silu''| <= 1/2 and is evaluated with the hardware ex2 / rcp
    (relative error ~2^-21). With the "bf16" policy, an FP32 pre-activation within that error
    of a BF16 rounding midpoint may round to the neighbouring BF16 value: silu' then differs by
    up to |silu'(neighbour) - silu'(ref)|, allowed here only where such a tie is possible.
    """
    C = x.shape[-1]
    a = causal_conv1d_preactivation_reference(x, weight, cu, bias).reshape(-1, C)
    a_mag = causal_conv1d_preactivation_reference(
        x.abs(), weight.abs(), cu, None if bias is None else bias.abs()).reshape(-1, C)
    a_err = 2.0**-20 * a_mag
    dy_abs = dy.reshape(-1, C).double().abs()
    err = dy_abs * (2.0**-19 + 0.5 * a_err)
    if policy == "bf16":
        def rounded(v):
            return v.to(BF16).double()

        at_ref = silu_grad(rounded(a))
        flip = torch.maximum((silu_grad(rounded(a - a_err)) - at_ref).abs(),
                             (silu_grad(rounded(a + a_err)) - at_ref).abs())
        err = err + dy_abs * flip
    return err


def _check_close(what, got, want, tol):
    assert torch.isfinite(got).all(), (
        f"{what}: {int((~torch.isfinite(got)).sum())} of {got.numel()} values are NaN/inf (never written?); "
        f"first at {(~torch.isfinite(got)).nonzero()[0].tolist()}"
    )
    err = (got.double() - want).abs()
    bad = err > tol
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} values out of tolerance; first at {i}: "
            f"got {got[i].item()!r}, want {want[i].item()!r}, tol {tol[i].item():.3g}; "
            f"max abs err {err.max().item():.3g}"
        )


def assert_grads_match_reference(grads, x, weight, cu, dy, bias=None, policy="bf16"):
    """dx, dweight, dbias of the right dtype / shape / device, fully written, and within the
    kernels' rounding of the FP64 reference backward.

    With G = 1.1 |dy| >= |g| (|silu'| <= 1.0999) and E the bound of |g_kernel - g_ref|:
      dx:      2^-7 |ref| (BF16 rounding) + 2^-16 sum_k |w| G (FP32 sum) + sum_k |w| E
      dweight: 2^-8 |ref| when BF16 + 1e-5 sum_t G |x| (FP32 sums of up to ~10^5 terms in a
               fixed tree) + sum_t E |x|;  dbias likewise with |x| -> 1.
    A missing tap, a leak across a document boundary or a wrong policy is far outside these.
    """
    dx, dweight, dbias = grads
    C = x.shape[-1]
    assert dx.dtype == BF16 and dx.shape == x.shape and dx.device == x.device and dx.is_contiguous()
    assert dweight.dtype == weight.dtype and dweight.shape == (C, 4) and dweight.device == x.device
    if bias is None:
        assert dbias is None
    else:
        assert dbias.dtype == bias.dtype and dbias.shape == (C,) and dbias.device == x.device

    ref_dx, ref_dw, ref_db = causal_conv1d_backward_reference(x, weight, cu, dy, bias,
                                                              silu_grad_preactivation=policy)
    x_abs = x.reshape(-1, C).double().abs()
    w_abs = weight.double().abs()
    g_mag = 1.1 * dy.reshape(-1, C).double().abs()
    g_err = _g_error_bound(x, weight, cu, dy, bias, policy)

    ref_dx = ref_dx.reshape(-1, C)
    tol_dx = 2.0**-7 * ref_dx.abs() + 2.0**-16 * _lookahead(g_mag, w_abs) + 1.01 * _lookahead(g_err, w_abs)
    _check_close("dx", dx.reshape(-1, C), ref_dx, tol_dx)
    if ref_dx.numel():
        rel_l2 = ((dx.reshape(-1, C).double() - ref_dx).norm() / ref_dx.norm().clamp_min(1e-30)).item()
        assert rel_l2 < 1e-2, f"dx relative L2 error {rel_l2:.3g}"

    def param_tol(ref, mag, slack, dtype):
        rel = 2.0**-8 if dtype == BF16 else 0.0
        return rel * ref.abs() + (1 + rel) * (1e-5 * mag + 1.01 * slack) + 1e-30

    tol_dw = param_tol(ref_dw, _lookback(g_mag, x_abs), _lookback(g_err, x_abs), weight.dtype)
    _check_close("dweight", dweight, ref_dw, tol_dw)
    if bias is not None:
        _check_close("dbias", dbias, ref_db, param_tol(ref_db, g_mag.sum(0), g_err.sum(0), bias.dtype))


# ---------------------------------------------------------------------------------------------
# correctness


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_every_variant_matches_reference(weight_dtype, bias_dtype, policy):
    S, C = 5000, 136
    seed = 2000 + 10 * (weight_dtype is BF16) + {None: 0, F32: 1, BF16: 2}[bias_dtype] + 100 * (policy == "fp32")
    rng = random.Random(seed)
    x, w, b, dy = make_inputs(S, C, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, [0] + split(S // 2, 40, rng) + [0] + short_docs(S - S // 2, rng) + [0])

    grads = backward_into(x, w, cu, dy, b, policy)
    assert_grads_match_reference(grads, x, w, cu, dy, b, policy)
    fresh = backward(x, w, cu, dy, b, policy)  # allocated outputs, default workspace: same bits
    assert fresh[0].data_ptr() not in (x.data_ptr(), dy.data_ptr())
    assert_same_grads(fresh, grads)


def test_policies_differ_and_default_is_bf16():
    """The two policies give different gradients on random data; the default is "bf16"."""
    S, C = 3000, 264
    x, w, b, dy = make_inputs(S, C, seed=41)
    cu = make_cu(S, split(S, 9, random.Random(41)))
    g_bf16, g_fp32 = backward(x, w, cu, dy, b, "bf16"), backward(x, w, cu, dy, b, "fp32")
    assert not torch.equal(g_bf16[1], g_fp32[1])
    assert_same_grads(bwd(x, w, cu, dy, bias=b), g_bf16)


DOC_CASES = [
    # S, C, document mix, weight dtype, bias dtype, policy
    pytest.param(1, 8, one_doc, F32, None, "bf16", id="S1-C8-one"),
    pytest.param(2, 24, one_doc, BF16, F32, "fp32", id="S2-C24-one"),
    pytest.param(3, 40, empty_ends_and_middle, F32, BF16, "bf16", id="S3-C40-empties"),
    pytest.param(5, 32, short_docs, BF16, None, "fp32", id="S5-C32-short"),
    pytest.param(67, 8, short_docs, F32, F32, "bf16", id="S67-C8-short"),
    pytest.param(1000, 2048, docs_16_to_64, F32, F32, "bf16", id="S1000-C2048-docs16-64"),
    pytest.param(4097, 136, empty_ends_and_middle, BF16, BF16, "fp32", id="S4097-C136-empties"),
    pytest.param(8192, 32, one_doc, F32, F32, "fp32", id="S8192-C32-one"),
    pytest.param(12345, 24, short_docs, F32, BF16, "bf16", id="S12345-C24-short"),
    pytest.param(20000, 136, docs_3000, F32, F32, "fp32", id="S20000-C136-3000docs"),
    pytest.param(3001, 2048, boundary_mix, F32, BF16, "fp32", id="S3001-C2048-boundary-mix"),
    pytest.param(33000, 136, empty_ends_and_middle, BF16, F32, "bf16", id="S33000-C136-empties"),
    pytest.param(70000, 8, tiny_docs, BF16, F32, "bf16", id="S70000-C8-tiny"),
    pytest.param(69999, 40, boundary_mix, F32, None, "fp32", id="S69999-C40-boundary-mix"),
    pytest.param(65600, 2048, docs_16_to_64, BF16, BF16, "bf16", id="S65600-C2048-docs16-64"),
    # Token groups of >= 256 tokens (the 4-strip route), the last sub-tile of a group part-filled.
    pytest.param(9000, 4096, short_docs, F32, F32, "bf16", id="S9000-C4096-short"),
    pytest.param(4100, 8192, boundary_mix, BF16, None, "fp32", id="S4100-C8192-boundary-mix"),
    # Groups under 256 tokens on a grid of at most 1024 warps: strips of 32 tokens (WideHalf,
    # MidHalf), here at the threshold (16 groups x 32 channel tiles x 2 warps) and with groups of
    # 192 tokens (a second sub-tile half walked). The short groups of larger grids: S33000-C136.
    pytest.param(2048, 4096, boundary_mix, BF16, F32, "bf16", id="S2048-C4096-boundary-mix"),
    # The plan's even-run choice: Mamba2's xBC width in 15 groups of 560 tokens (runs of 140; the last
    # group 352), 16-byte rows; and the wave choice at C = 3720 (groups of 768 tokens).
    pytest.param(8192, 4352, short_docs, F32, F32, "bf16", id="S8192-C4352-short-even-runs"),
    pytest.param(9000, 3720, boundary_mix, BF16, None, "fp32", id="S9000-C3720-boundary-mix-wave-choice"),
    pytest.param(131073, 64, short_docs, F32, F32, "fp32", id="S131073-C64-short"),
    # 16 channel lanes (32 < C <= 64) in 64-thread CTAs: groups of >= 256 tokens (320 here), two
    # lanes idle at C = 56. (S69999-C40 and the boundary lengths at C = 48 take the 32-token strips.)
    pytest.param(270000, 56, short_docs, F32, BF16, "fp32", id="S270000-C56-short"),
    pytest.param(262144, 64, docs_16_to_64, BF16, F32, "bf16", id="S262144-C64-docs16-64"),
    # C <= 16 with 512+ token groups: the 2- and 4-lane routes (32- and 64-thread CTAs of 16
    # strips); trees of 4 and 3 levels, and of 5 (4097 groups: the last group the only child of
    # its node at every level).
    pytest.param(600000, 8, tiny_docs, BF16, F32, "fp32", id="S600000-C8-tiny"),
    pytest.param(524288, 16, docs_16_to_64, F32, F32, "bf16", id="S524288-C16-docs16-64"),
    pytest.param(4194305, 8, docs_16_to_64, F32, None, "bf16", id="S4194305-C8-docs16-64"),
]


@pytest.mark.parametrize("S, C, mix, weight_dtype, bias_dtype, policy", DOC_CASES)
def test_document_mixes_match_reference(S, C, mix, weight_dtype, bias_dtype, policy):
    seed = 7919 * S + C
    x, w, b, dy = make_inputs(S, C, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, mix(S, random.Random(seed)))
    grads = backward_into(x, w, cu, dy, b, policy)
    assert_grads_match_reference(grads, x, w, cu, dy, b, policy)


@pytest.mark.parametrize("S, C, route", [
    pytest.param(1024, 4096, (4, 32, 128, 32), id="S1024-C4096-wide-half"),  # 8 groups x 32 tiles: 512 warps
    pytest.param(2048, 4096, (4, 32, 128, 32), id="S2048-C4096-wide-half"),  # 1024 warps: the threshold
    pytest.param(2049, 4096, (4, 32, 64, 64), id="S2049-C4096-wide-short"),  # 17 groups: 1088 warps
    pytest.param(8192, 4096, (8, 32, 128, 64), id="S8192-C4096-wide-vec8"),  # groups of 512 tokens, 16-byte rows
    pytest.param(131072, 256, (8, 32, 128, 64), id="S131072-C256-wide-vec8"),  # one 256-channel tile
    # 16-byte rows only where their 256-channel CTAs load the busiest SM at most 1/32 more than Wide's:
    # 9 groups of 768 tokens and 7 of 512 (bwd_last_wave_split): WideVec8's busiest SM 1.11x Wide's
    pytest.param(10240, 7168, (4, 32, 128, 64), id="S10240-C7168-wide-balance"),
    # Wide by the balance, then the last eighth in 256-token groups (21 of 1024, 12 of 256): still Wide
    pytest.param(24576, 10240, (4, 32, 128, 64), id="S24576-C10240-wide-last-eighth"),
    # the even-run choice's groups fill the 16-byte rows' waves: 15 x 560 and 31 x 544 tokens
    pytest.param(8192, 4352, (8, 32, 128, 64), id="S8192-C4352-wide-vec8-even-runs"),
    pytest.param(16384, 4352, (8, 32, 128, 64), id="S16384-C4352-wide-vec8-even-runs"),
    pytest.param(20480, 4096, (8, 32, 128, 64), id="S20480-C4096-wide-vec8"),  # the split, equal loads
    pytest.param(262144, 136, (4, 32, 128, 64), id="S262144-C136-wide"),  # C not a multiple of 256: 8-byte rows
    pytest.param(262144, 128, (4, 32, 128, 64), id="S262144-C128-wide"),
    pytest.param(65536, 64, (4, 16, 64, 32), id="S65536-C64-mid-half"),  # groups of 128 tokens
    pytest.param(262144, 64, (4, 16, 64, 64), id="S262144-C64-mid"),  # groups of 256 tokens
])
def test_route_rule(S, C, route):
    """The launcher's rule: for short token groups strips of half the length in the full CTA on a
    grid of at most 1024 warps of the half CTA (always at 32 < C <= 64), the half CTA above it; 16-byte
    rows for groups of 256 tokens or more at C a multiple of 256 (without states) where their grid balances
    the SMs about as well as Wide's (bwd_vec8_rows). The results match the
    reference either way (test_document_mixes_match_reference)."""
    x, w, b, dy = make_inputs(S, C, seed=S + C)
    cu = make_cu(S, [S])
    assert launched_route(lambda: backward(x, w, cu, dy, b)) == route


@pytest.mark.parametrize("S, C, docs, vec, stateful_vec", [
    pytest.param(8192, 4096, 1, 8, 4, id="S8192-C4096"),  # 16 groups for 1 document: Wide's item choice
    pytest.param(8192, 4352, 1, 8, 8, id="S8192-C4352"),  # 15 groups of 560 tokens: WideVec8, its per-step kernel
    pytest.param(10240, 7168, 1, 4, 4, id="S10240-C7168"),  # Wide by the SMs' balance; 16 groups: the item choice
    pytest.param(4100, 8192, 7, 8, 8, id="S4100-C8192"),  # 585 tokens per document; a last group part-filled
    pytest.param(131072, 256, 300, 8, 4, id="S131072-C256"),  # 437 tokens per document
    pytest.param(131072, 200, 40, 4, 4, id="S131072-C200"),  # C not a multiple of 256: Wide
])
def test_stateless_wide_route_is_bitwise_the_stateful_kernel(S, C, docs, vec, stateful_vec):
    """Token groups of 256 tokens or more at C a multiple of 256 run, without states, in 16-byte rows
    where their grid balances the SMs as Wide's does (10240x7168 does not: Wide)
    (WideVec8: items of 256 channels; its strips inside [0, S) walk a loop without bounds tests), with
    states in them too where documents average 512 tokens or more and the item choice does not apply,
    else on the Wide kernels of 8-byte rows (128 channels).
    They walk the same strips and add in the same order: with zero final-state gradients (no initial
    states: no tap changes) the stateful call gives the same dweight and dbias bits, and dx but the
    sign of an exact zero (d + 0)."""
    x, w, b, dy = make_inputs(S, C, seed=S + C + docs)
    cu = make_cu(S, split(S, docs, random.Random(S + docs)))
    zeros = torch.zeros(docs, 3, C, dtype=BF16, device=DEV)
    for policy in POLICIES:
        stateless = lambda: backward(x, w, cu, dy, b, policy)  # noqa: E731
        stateful = lambda: backward(x, w, cu, dy, b, policy, dfinal_states=zeros)  # noqa: E731
        assert launched_route(stateless) == (vec, 32, 128, 64)
        assert launched_route(stateful) == (stateful_vec, 32, 128, 64)
        (dx0, dw0, db0), (dx1, dw1, db1) = stateless(), stateful()
        assert same_bits(dw0, dw1) and same_bits(db0, db1), policy
        assert torch.equal(dx0, dx1) and same_bits(dx0.abs(), dx1.abs()), policy
        assert_grads_match_reference((dx0, dw0, db0), x, w, cu, dy, b, policy)


@pytest.mark.parametrize("S, C", [
    pytest.param(4100, 8192, id="S4100-C8192"),  # 16-byte rows (WideVec8)
    pytest.param(131073, 256, id="S131073-C256"),  # 16-byte rows, a last strip of 1 token
    pytest.param(4099, 8192, id="S4099-C8192"),  # 16-byte rows: the last strip's walk ends at S - 1, inside
    pytest.param(70001, 64, id="S70001-C64"),  # 32-token strips, 16 lanes (MidHalf)
    pytest.param(5003, 32, id="S5003-C32"),  # 8 lanes (Narrow8)
    pytest.param(9000, 200, id="S9000-C200"),  # 8-byte rows, a last channel tile with idle lanes (regression)
    # long walks (a strip walks one even run of its group) in a last group of 323 tokens: runs of 84,
    # the last crossing S (16 lanes, Mid, groups of 384 tokens; Wide, the even-run choice's 400)
    pytest.param(330563, 64, id="S330563-C64"),
    pytest.param(206723, 128, id="S206723-C128"),
    # 16-byte rows, groups of 384 tokens, the last of 19: runs of 8, the second ending 3 tokens before
    # S (the inside loop's gate exactly: t0 + Lw + 3 == S), the third passing S
    pytest.param(98707, 256, id="S98707-C256"),
])
def test_no_dx_row_past_S_is_written(S, C):
    """dx as the first S rows of a longer buffer: its rows after S keep their NaN. The walks that
    stay below S run, in 16-byte rows, a loop without the rows' bounds tests; the batch's last walks
    keep them. (The 8-byte-row cases guard the bounded loop.)"""
    x, w, b, dy = make_inputs(S, C, seed=3 * S + C)
    cu = make_cu(S, split(S, 5, random.Random(S)))
    rows = poisoned((S + 70, C))
    dx, dweight, dbias = backward(x, w, cu, dy, b, dx=rows[:S])
    assert dx.data_ptr() == rows.data_ptr()
    assert torch.isnan(rows[S:].float()).all(), "a dx row past S was written"
    assert_grads_match_reference((dx, dweight, dbias), x, w, cu, dy, b)


@pytest.mark.parametrize("C", [24, 48, 136])
@pytest.mark.parametrize("L", BOUNDARY_LENGTHS)
def test_tile_boundary_document_lengths(L, C):
    """Five documents of length L, then 1, 2 and 3 token ones (63/64/65/.../1023/1024/1025)."""
    S = 5 * L + 6
    policy = POLICIES[L % 2]
    x, w, b, dy = make_inputs(S, C, seed=31 * L + C)
    cu = make_cu(S, [L] * 5 + [1, 2, 3])
    grads = backward_into(x, w, cu, dy, b, policy)
    assert_grads_match_reference(grads, x, w, cu, dy, b, policy)


@pytest.mark.parametrize("C", [8, 136])
@pytest.mark.parametrize("S", [4, 17, 31, 32, 33, 65, 129, 257, 1025, 16385])
def test_sequence_lengths_one_document(S, C):
    """S around the kernel's token strips (16 / 32) and token groups (64 .. 1024), one document."""
    x, w, b, dy = make_inputs(S, C, seed=S * 11 + C, weight_dtype=BF16)
    cu = make_cu(S, [S])
    grads = backward_into(x, w, cu, dy, b, "bf16")
    assert_grads_match_reference(grads, x, w, cu, dy, b, "bf16")


@pytest.mark.parametrize("S, C", [(1, 8), (4097, 264), (3001, 2048)])
def test_batch_dim_input(S, C):
    x, w, b, dy = make_inputs(S, C, seed=S + C, batch_dim=True)
    assert x.shape == dy.shape == (1, S, C)
    cu = make_cu(S, split(S, 20, random.Random(S)))
    grads = backward_into(x, w, cu, dy, b)
    assert grads[0].shape == (1, S, C)
    assert_grads_match_reference(grads, x, w, cu, dy, b)
    assert_same_grads(backward(x[0], w, cu, dy[0], b), (grads[0][0], grads[1], grads[2]))


@pytest.mark.parametrize("shape", [(0, 64), (1, 0, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_empty_sequence(shape, weight_dtype, bias_dtype):
    """S == 0: dx is empty, dweight and dbias are zero (written over NaN)."""
    C = shape[-1]
    x = torch.empty(shape, dtype=BF16, device=DEV)
    dy = torch.empty(shape, dtype=BF16, device=DEV)
    w = torch.randn(C, 4, device=DEV).to(weight_dtype)
    b = None if bias_dtype is None else torch.randn(C, device=DEV).to(bias_dtype)
    for cu in (torch.zeros(1, dtype=I32, device=DEV), torch.zeros(4, dtype=I32, device=DEV)):
        for ws in (None, new_workspace(0, C, device())):
            for grads in (backward_into(x, w, cu, dy, b, workspace=ws), backward(x, w, cu, dy, b, workspace=ws)):
                sync()
                dx, dweight, dbias = grads
                assert dx.shape == x.shape and dx.dtype == BF16 and dx.device == x.device
                assert dweight.dtype == weight_dtype and torch.equal(dweight, torch.zeros_like(w))
                if b is None:
                    assert dbias is None
                else:
                    assert dbias.dtype == bias_dtype and torch.equal(dbias, torch.zeros_like(b))


def test_gradients_stay_in_their_document():
    """dy nonzero in one document only: dx is zero everywhere else (the tokens right before the
    document included), and the document's dx equals the backward of the document alone."""
    lengths = [700, 1, 0, 3, 2, 1000, 0, 64, 1, 129, 100]
    S, C = sum(lengths), 136
    cu = make_cu(S, lengths)
    x, w, b, dy_all = make_inputs(S, C, seed=61)
    bounds = cu.tolist()
    for d, n in enumerate(lengths):
        if n == 0:
            continue
        lo, hi = bounds[d], bounds[d + 1]
        dy = torch.zeros_like(dy_all)
        dy[lo:hi] = dy_all[lo:hi]
        for policy in POLICIES:
            dx, _, _ = backward_into(x, w, cu, dy, b, policy)
            outside = torch.cat([dx[:lo], dx[hi:]])
            assert torch.count_nonzero(outside).item() == 0, f"document {d}: gradient leaked out of [{lo}, {hi})"
            alone, _, _ = backward(x[lo:hi].clone(), w, make_cu(n, [n]), dy[lo:hi].clone(), b, policy)
            assert same_bits(dx[lo:hi], alone), f"document {d}: dx differs from the document alone"


# ---------------------------------------------------------------------------------------------
# workspace and determinism


def test_workspace_allocator():
    dev = device()
    for S, C in [(0, 8), (1, 8), (4097, 264), (20000, 1000), (65600, 2048), (1500, 16384)]:
        nbytes = workspace_bytes(S, C, dev)
        assert isinstance(nbytes, int) and nbytes >= 0
        assert (nbytes == 0) == (S == 0)
        ws = new_workspace(S, C, dev)
        assert ws.dtype == F32 and ws.dim() == 1 and ws.is_contiguous()
        assert ws.device == dev
        assert ws.numel() * 4 >= nbytes


def test_outputs_come_from_torchs_caching_allocator():
    """The binding allocates its outputs outside the dispatcher: they must still come from
    torch's CUDA caching allocator (counted by its statistics, freed to it)."""
    S, C = 3000, 264
    x, w, b, dy = make_inputs(S, C, seed=78, weight_dtype=F32, bias_dtype=BF16)
    cu = make_cu(S, split(S, 9, random.Random(78)))
    xl, wl, bl = _leaves(x, w, b)

    def requested():
        return torch.cuda.memory_stats()["requested_bytes.all.current"]

    calls = {
        "forward": lambda: (fwd(x, w, cu, bias=b),),
        "backward": lambda: backward(x, w, cu, dy, b),
        "cake_causal_conv1d": lambda: (cake_causal_conv1d(xl, wl, cu, bl),),
    }
    for name, call in calls.items():
        call()  # default workspaces made
        torch.cuda.synchronize()
        before = requested()
        outs = call()
        assert requested() - before == sum(t.numel() * t.element_size() for t in outs), name
        assert all(t.device == x.device for t in outs), name
        del outs
        assert requested() == before, name


@pytest.mark.parametrize(
    "weight_dtype, bias_dtype, policy",
    [
        pytest.param(F32, F32, "bf16", id="w_fp32-b_fp32-bf16"),
        pytest.param(BF16, BF16, "fp32", id="w_bf16-b_bf16-fp32"),
    ],
)
def test_bitwise_deterministic(weight_dtype, bias_dtype, policy):
    """Three runs, explicit workspaces of any content, and a fresh default workspace (another
    stream's) all give the same bits."""
    S, C = 20000, 1000
    x, w, b, dy = make_inputs(S, C, seed=77, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, split(S, 500, random.Random(77)))
    first = backward_into(x, w, cu, dy, b, policy)
    assert_grads_match_reference(first, x, w, cu, dy, b, policy)
    for i in range(3):
        assert_same_grads(backward_into(x, w, cu, dy, b, policy), first, f"run {i}: ")
        assert_same_grads(backward(x, w, cu, dy, b, policy), first, f"run {i}, allocated outputs: ")
    ws = new_workspace(S, C, device())
    bigger = garbage(ws.numel() * 3 + 5, seed=1)
    for i in range(2):
        for name, buf in (("workspace", ws), ("bigger workspace", bigger)):
            assert_same_grads(backward_into(x, w, cu, dy, b, policy, workspace=buf), first, f"{name}, call {i}: ")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a stream of its own: a new default workspace
        on_side = backward_into(x, w, cu, dy, b, policy)
    torch.cuda.current_stream().wait_stream(side)
    sync()
    assert_same_grads(on_side, first, "fresh default workspace: ")


def garbage(n, seed):
    """n FP32 words of every kind of leftover: NaN, infinities, random bit patterns, small
    integers, -1 (all ones), zeros."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), device=DEV, dtype=I32, generator=g)
    kinds = torch.randint(0, 6, (n,), device=DEV, generator=g)
    small = torch.randint(0, 9, (n,), device=DEV, dtype=I32, generator=g)
    special = torch.tensor([0x7FC00000, 0x7F800000, -8388608, -1], device=DEV, dtype=I32)  # NaN, inf, -inf, all ones
    bits = torch.where(kinds == 1, small, bits)
    bits = torch.where(kinds == 2, special[torch.randint(0, 4, (n,), device=DEV, generator=g)], bits)
    bits = torch.where(kinds == 3, torch.zeros_like(bits), bits)
    return bits.view(F32)


def test_default_workspace_grows_and_shrinking_calls_stay_exact():
    """Calls of growing and shrinking sizes on one stream share the default workspace (it grows
    with S and C), and one explicit workspace large enough for all of them, never cleared: its
    content never matters."""
    shapes = [(500, 264, 7), (65600, 2048, 40), (70000, 8, 3000), (5, 8, 2), (20000, 1000, 30), (131072, 8, 50)]
    shared = garbage(max(workspace_bytes(S, C, device()) for S, C, _ in shapes) // 4, seed=2)
    for i, (S, C, n_docs) in enumerate(shapes):
        x, w, b, dy = make_inputs(S, C, seed=300 + i, weight_dtype=(F32, BF16)[i % 2])
        cu = make_cu(S, split(S, n_docs, random.Random(i)))
        grads = backward(x, w, cu, dy, b, POLICIES[i % 2])
        explicit = backward_into(x, w, cu, dy, b, POLICIES[i % 2], workspace=new_workspace(S, C, device()))
        assert_same_grads(grads, explicit, f"S={S}, C={C}: ")
        assert_same_grads(backward(x, w, cu, dy, b, POLICIES[i % 2], workspace=shared), explicit,
                          f"S={S}, C={C}, shared workspace: ")
        if S * C < 50_000_000:
            assert_grads_match_reference(grads, x, w, cu, dy, b, POLICIES[i % 2])


@pytest.mark.parametrize("weight_dtype, bias_dtype", [(F32, F32), (BF16, None), (F32, BF16)],
                         ids=["w_fp32-b_fp32", "w_bf16-b_none", "w_fp32-b_bf16"])
def test_workspace_content_never_changes_a_result(weight_dtype, bias_dtype):
    """A caller's workspace is scratch: NaN, random bits, small integers or another shape's
    leftovers give bitwise the result of a fresh one, call after call on the same buffer (every row
    the reduction reads, the same call wrote first)."""
    S, C = 70000, 1000  # 92 token groups: a tree of 3 levels, two reduction passes
    x, w, b, dy = make_inputs(S, C, seed=91, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, split(S, 300, random.Random(91)))
    want = backward_into(x, w, cu, dy, b, "bf16", workspace=new_workspace(S, C, device()))
    assert_grads_match_reference(want, x, w, cu, dy, b, "bf16")
    n = workspace_bytes(S, C, device()) // 4
    ws = garbage(n, seed=3)
    for i in range(3):
        assert_same_grads(backward_into(x, w, cu, dy, b, "bf16", workspace=ws), want, f"garbage workspace, call {i}: ")
    for value in (float("nan"), float("inf"), 1.0, -1.0):
        ws.fill_(value)
        assert_same_grads(backward_into(x, w, cu, dy, b, "bf16", workspace=ws), want, f"workspace of {value}: ")
    ws.view(I32).fill_(1)  # every word the integer 1
    assert_same_grads(backward_into(x, w, cu, dy, b, "bf16", workspace=ws), want, "workspace of int32 ones: ")
    x2, w2, b2, dy2 = make_inputs(4096, 2048, seed=92, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    backward(x2, w2, make_cu(4096, [4096]), dy2, b2, "fp32", workspace=ws)  # another shape's leftovers
    assert_same_grads(backward_into(x, w, cu, dy, b, "bf16", workspace=ws), want, "another shape's leftovers: ")


def tree_fold(nodes):
    """One level of the fixed reduction tree in FP32: node k is 0 + nodes 8k .. 8k + 7, added in
    order (torch's FP32 adds are IEEE adds, as the kernel's)."""
    out = []
    for k in range(0, nodes.shape[0], 8):
        acc = torch.zeros_like(nodes[0])
        for child in nodes[k:k + 8]:
            acc = acc + child
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("weight_dtype", [F32, BF16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("S, C, passes", [(4096, 4096, 1), (200000, 1000, 2)], ids=["32_groups", "196_groups"])
def test_dweight_is_the_fixed_tree_of_the_partial_rows(S, C, passes, weight_dtype):
    """dweight / dbias are the fixed tree over the token groups' partial rows, bitwise: every node
    0 + its up to 8 children in order. The workspace holds the rows afterwards: with up to 64
    groups (one reduction pass) every group's row is intact, so the whole tree is recomputed here;
    with 65-4096 (two passes) the first pass leaves the level-2 nodes in the rows of groups 0, 64,
    ..., from which the second pass's root is recomputed (4 of them at 196 groups: their order
    shows, where 2 would add commutatively)."""
    from flashinfer_cake import _plan

    x, w, b, dy = make_inputs(S, C, seed=94, weight_dtype=weight_dtype, bias_dtype=F32)
    cu = make_cu(S, split(S, 40, random.Random(94)))
    ws = garbage(workspace_bytes(S, C, device()) // 4, seed=6)
    grads = backward_into(x, w, cu, dy, b, "bf16", workspace=ws)
    sync()
    assert_grads_match_reference(grads, x, w, cu, dy, b, "bf16")
    groups = _plan.plan_of(S, C).groups
    assert (passes == 1) == (groups <= 64) and groups <= 4096 and (passes == 1 or groups > 3 * 64), groups
    rows = ws[:groups * 5 * C].view(groups, 5, C)
    nodes = tree_fold(rows if passes == 1 else rows[::64])
    while nodes.shape[0] > 1:
        nodes = tree_fold(nodes)
    root = nodes[0]
    assert same_bits(grads[1], root[:4].t().contiguous().to(weight_dtype)), "dweight is not the tree's root"
    assert same_bits(grads[2], root[4].contiguous()), "dbias is not the tree's root"


@pytest.mark.parametrize("S, C, split", [
    pytest.param(20480, 4096, True, id="S20480-C4096-wide-vec8"),  # 16 groups of 768 tokens, 16 of 512
    pytest.param(16384, 10240, True, id="S16384-C10240-wide-vec8"),  # 13 of 1024, 6 of 512
    # the even-run choice's 29 groups of 880 tokens (runs of 220), then 29 of 256, the last of 80
    pytest.param(32768, 2304, True, id="S32768-C2304-wide-vec8-runs-220"),
    pytest.param(8768, 7432, True, id="S8768-C7432-wide"),  # 8 of 768, 6 of 512 (the last 64 tokens: runs of 16)
    pytest.param(24576, 7432, True, id="S24576-C7432-wide-last-eighth"),  # 21 of 1024, then 12 of 256 (2.7 waves)
    # the last eighth after even-run groups: 38 of 880 (runs of 220), 22 of 256 from token 33440 (32 past a
    # strip), the last of 59 tokens (runs of 16)
    pytest.param(39131, 2944, True, id="S39131-C2944-wide-last-eighth-runs-220"),
    # the last eighth of a 16-byte-row grid of 9/2+ waves (its last wave <= 7/8 full) in 512-token groups: 7 of
    # 864 (runs of 216), 4 of 512, the last of 96 (24), in 16-byte rows; 5 of 560 (140), 2 of 512, the last of
    # 16 (4), on Wide (the split grid would load WideVec8's SMs unevenly)
    pytest.param(7680, 36352, True, id="S7680-C36352-wide-vec8-last-eighth-runs-216"),
    pytest.param(3328, 54272, True, id="S3328-C54272-wide-last-eighth-runs-140"),
    # Groups that are not whole sub-tiles, each strip an even run of the group's tokens: the even-run
    # choice's 30 of 544 (runs of 136, not whole strips) and the last of 64 (16); 21 of 576 (144) and the
    # last of 192 (48), in 16-byte rows; 60 of 832 (208) and the last of 80 (20) on Wide (C not a
    # multiple of 256).
    pytest.param(16384, 4352, False, id="S16384-C4352-wide-vec8-runs-136"),
    pytest.param(12288, 3072, False, id="S12288-C3072-wide-vec8-runs-144"),
    pytest.param(50000, 1000, False, id="S50000-C1000-wide-runs-208"),
])
def test_token_groups_partial_rows(S, C, split):
    """The plan's token groups as the kernels walk them: uniform groups walked in even runs (a
    strip's share of a group that is not a whole sub-tile), or bwd_tail's splits, where the uniform
    grid runs just past a whole wave (long groups fill the waves and the rest of S runs in shorter
    groups) or on grids of many waves (the last eighth of S in 256-token groups on Wide's from 15/8
    waves, in 512-token groups on the 16-byte rows' from 9/2 where the last wave is at most 7/8 full). Each
    group's partial rows (intact in the workspace: one reduction pass) must be the sums over exactly its tokens, [start, end) as the plan places them (an FP64 reference of the
    window, the "fp32" policy so that g has no BF16 rounding cliff); dweight / dbias the tree over
    those rows; the rest as every backward."""
    from flashinfer_cake import _plan

    plan = _plan.plan_of(S, C)
    item_tokens, big, tail_tokens, groups = plan.item_tokens, plan.big_groups, plan.tail_tokens, plan.groups
    if split:
        assert 0 < big and tail_tokens < item_tokens, (item_tokens, big, tail_tokens)  # the case splits
    else:  # uniform groups that are not whole 256-token sub-tiles
        assert big == 0 and item_tokens % 256 != 0 and S % item_tokens != 0, (item_tokens, big)
    assert (item_tokens % 64 != 0) == (C in (4352, 2304, 2944, 36352, 54272)), item_tokens  # the even-run choice's groups: not whole strips
    starts = [min(S, g * item_tokens if g <= big else big * item_tokens + (g - big) * tail_tokens)
              for g in range(groups + 1)]
    assert starts[-1] == S and starts[-2] < S and groups <= 64, (starts, groups)  # every group has tokens
    x, w, b, dy = make_inputs(S, C, seed=95, weight_dtype=F32, bias_dtype=F32)
    cu = make_cu(S, one_doc(S, None))
    vec = 8 if plan.vec8_rows else 4
    assert launched_route(lambda: backward(x, w, cu, dy, b, "fp32")) == (vec, 32, 128, 64)  # the case's route
    ws = garbage(workspace_bytes(S, C, device()) // 4, seed=7)
    grads = backward_into(x, w, cu, dy, b, "fp32", workspace=ws)
    sync()
    assert_grads_match_reference(grads, x, w, cu, dy, b, "fp32")
    rows = ws[:groups * 5 * C].view(groups, 5, C).double()
    for g in range(groups):
        t0, t1 = starts[g], starts[g + 1]
        w0 = max(0, t0 - 3)  # the window: the group's tokens and the 3 their taps read before them
        dy_win = dy[w0:t1].clone()
        dy_win[:t0 - w0] = 0  # g = 0 there: the sums of the group's tokens only
        cu_win = torch.tensor([0, t1 - w0], dtype=torch.int32, device=DEV)
        _, ref_dw, ref_db = causal_conv1d_backward_reference(x[w0:t1], w, cu_win, dy_win, b, silu_grad_preactivation="fp32")
        xa, ga = x[w0:t1].double().abs(), 1.1 * dy_win.double().abs()  # |g| <= 1.1 |dy|
        n = t1 - w0
        mag = torch.stack([(ga[3 - k:] * xa[:n - 3 + k]).sum(0) for k in range(4)] + [ga.sum(0)])
        ref = torch.cat([ref_dw.t(), ref_db[None]])
        err = (rows[g] - ref).abs() - (2.0**-12 * mag + 1e-6)
        assert err.max().item() <= 0, f"group {g} (tokens {t0}..{t1}): partial rows off by {err.max().item():.3g} past the bound"
    nodes = tree_fold(ws[:groups * 5 * C].view(groups, 5, C))
    while nodes.shape[0] > 1:
        nodes = tree_fold(nodes)
    assert same_bits(grads[1], nodes[0][:4].t().contiguous()), "dweight is not the tree's root"
    assert same_bits(grads[2], nodes[0][4].contiguous()), "dbias is not the tree's root"


# ---------------------------------------------------------------------------------------------
# streams, graphs, host synchronization


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit-outputs-workspaces", "defaults"])
def test_cuda_graph_forward_backward_replay_with_new_data(explicit):
    S, C, n_docs, policy = 5000, 520, 37, "bf16"
    x, w, b, dy = make_inputs(S, C, seed=9)
    cu = make_cu(S, split(S, n_docs, random.Random(9)))
    if explicit:
        y_out = poisoned(x.shape)
        dx, dweight, dbias = poisoned_grads(x, w, b)
        kw_fwd = dict(out=y_out, workspace=new_fwd_workspace(S, C, device()))
        kw_bwd = dict(dx=dx, dweight=dweight, dbias=dbias, workspace=new_workspace(S, C, device()))
    else:
        kw_fwd, kw_bwd = {}, {}

    def step():
        y = fwd(x, w, cu, bias=b, **kw_fwd)
        return y, backward(x, w, cu, dy, b, policy, **kw_bwd)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: modules loaded, default workspaces made
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    sync()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, grads = step()
    if explicit:
        assert y is y_out and grads[0] is dx and grads[1] is dweight and grads[2] is dbias

    for seed in (10, 11, 12):
        new_x, _, _, new_dy = make_inputs(S, C, seed=seed)
        new_cu = make_cu(S, split(S, n_docs, random.Random(seed)))
        for t in (y, *grads):
            t.fill_(float("nan"))
        x.copy_(new_x)
        dy.copy_(new_dy)
        cu.copy_(new_cu)
        graph.replay()
        expected_y = fwd(new_x, w, new_cu, bias=b)
        expected = backward(new_x, w, new_cu, new_dy, b, policy)
        sync()
        assert same_bits(y, expected_y), f"replay with seed {seed}: y differs from eager"
        assert_same_grads(grads, expected, f"replay with seed {seed}: ")
    assert_grads_match_reference(grads, new_x, w, new_cu, new_dy, b, policy)


@pytest.mark.parametrize("bias_dtype", [pytest.param(None, id="b_none"), pytest.param(F32, id="b_fp32")])
def test_cuda_graph_autograd_replay_with_new_data(bias_dtype):
    """cake_causal_conv1d + y.backward(dy) captured whole (the pattern of whole-network capture),
    replayed with new x, dy and cu_seqlens: y and the .grad tensors equal eager raw calls."""
    S, C, n_docs, policy = 4096, 264, 21, "fp32"
    x, w, b, dy = make_inputs(S, C, seed=19, bias_dtype=bias_dtype)
    cu = make_cu(S, split(S, n_docs, random.Random(19)))
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]

    def step():
        for t in leaves:
            t.grad = None
        y = cake_causal_conv1d(x, w, cu, b, silu_grad_preactivation=policy)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    sync()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    grads = (x.grad, w.grad, None if b is None else b.grad)

    for seed in (20, 21):
        new_x, _, _, new_dy = make_inputs(S, C, seed=seed)
        new_cu = make_cu(S, split(S, n_docs, random.Random(seed)))
        with torch.no_grad():
            x.copy_(new_x)
        dy.copy_(new_dy)
        cu.copy_(new_cu)
        graph.replay()
        w0, b0 = w.detach(), None if b is None else b.detach()
        expected_y = fwd(new_x, w0, new_cu, bias=b0)
        expected = backward(new_x, w0, new_cu, new_dy, b0, policy)
        sync()
        assert same_bits(y.detach(), expected_y), f"replay with seed {seed}: y differs from eager"
        assert_same_grads(grads, expected, f"replay with seed {seed}: ")


def test_two_streams_at_once_default_workspaces():
    S, C, reps = 8192, 2048, 4
    xa, wa, ba, dya = make_inputs(S, C, seed=21)
    xb, wb, bb, dyb = make_inputs(S, C, seed=22, weight_dtype=BF16, bias_dtype=None)
    cua = make_cu(S, split(S, 3, random.Random(21)))
    cub = make_cu(S, tiny_docs(S, random.Random(22)))
    outs_a = [poisoned_grads(xa, wa, ba) for _ in range(reps)]
    outs_b = [poisoned_grads(xb, wb, bb) for _ in range(reps)]
    current = torch.cuda.current_stream()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    sa.wait_stream(current)
    sb.wait_stream(current)
    for i in range(reps):  # interleaved: both streams have work queued at once
        with torch.cuda.stream(sa):
            backward(xa, wa, cua, dya, ba, "bf16", dx=outs_a[i][0], dweight=outs_a[i][1], dbias=outs_a[i][2])
        with torch.cuda.stream(sb):
            backward(xb, wb, cub, dyb, bb, "fp32", dx=outs_b[i][0], dweight=outs_b[i][1])
    current.wait_stream(sa)
    current.wait_stream(sb)
    sync()
    assert_grads_match_reference(outs_a[0], xa, wa, cua, dya, ba, "bf16")
    assert_grads_match_reference(outs_b[0], xb, wb, cub, dyb, bb, "fp32")
    for i in range(1, reps):
        assert_same_grads(outs_a[i], outs_a[0], f"stream A call {i}: ")
        assert_same_grads(outs_b[i], outs_b[0], f"stream B call {i}: ")


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "outputs-and-workspace"])
def test_no_host_synchronization(explicit):
    S, C = 4096, 1024
    x, w, b, dy = make_inputs(S, C, seed=5)
    cu = make_cu(S, split(S, 50, random.Random(5)))
    ws = new_workspace(S, C, device()) if explicit else None
    backward(x, w, cu, dy, b, workspace=ws)  # warm-up: module loaded, default workspace made
    sync()
    outs = poisoned_grads(x, w, b) if explicit else (None, None, None)
    stream = torch.cuda.current_stream()

    start = time.perf_counter()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU busy-wait on the current stream
    before = time.perf_counter()
    grads = backward(x, w, cu, dy, b, workspace=ws, dx=outs[0], dweight=outs[1], dbias=outs[2])
    after = time.perf_counter()
    still_busy = not stream.query()
    sync()
    finished = time.perf_counter()

    assert finished - start > 0.2, "busy kernel too short for this test to mean anything"
    assert still_busy, "the stream was idle right after the call: the call waited for the GPU"
    assert after - before < 0.05, f"the call blocked the host for {after - before:.3f} s"
    assert_grads_match_reference(grads, x, w, cu, dy, b)


# ---------------------------------------------------------------------------------------------
# autograd and torch.compile


def _leaves(x, w, b):
    """Copies of x, weight, bias that require grad (bias None stays None)."""
    return (x.clone().requires_grad_(), w.clone().requires_grad_(),
            None if b is None else b.clone().requires_grad_())


def _grads_of(xl, wl, bl):
    return xl.grad, wl.grad, None if bl is None else bl.grad


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_autograd_matches_raw_functions(weight_dtype, bias_dtype, policy):
    S, C = 3000, 136
    seed = 900 + 10 * (weight_dtype is BF16) + {None: 0, F32: 1, BF16: 2}[bias_dtype]
    x, w, b, dy = make_inputs(S, C, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    cu = make_cu(S, [0] + split(S, 30, random.Random(seed)) + [0])
    xl, wl, bl = _leaves(x, w, b)

    y = cake_causal_conv1d(xl, wl, cu, bl, silu_grad_preactivation=policy)
    assert y.dtype == BF16 and y.shape == x.shape and y.requires_grad
    assert y.grad_fn.name() == "CakeCausalConv1dBackward"  # eager: the binding's C++ node
    assert same_bits(y.detach(), fwd(x, w, cu, bias=b))
    y.backward(dy)
    got = _grads_of(xl, wl, bl)
    assert got[1].dtype == weight_dtype and (bl is None or got[2].dtype == bias_dtype)
    assert_same_grads(got, backward(x, w, cu, dy, b, policy))
    # CakeCausalConv1dFunction (the torch.compile path), applied eagerly: the same bits
    xf, wf, bf = _leaves(x, w, b)
    yf = CakeCausalConv1dFunction.apply(xf, wf, cu, bf, None, False, policy)
    assert "CakeCausalConv1dFunction" in type(yf.grad_fn).__name__
    assert same_bits(yf.detach(), y.detach())
    yf.backward(dy)
    assert_same_grads(_grads_of(xf, wf, bf), got, "CakeCausalConv1dFunction: ")
    if policy == "bf16":  # the default policy
        xl2, wl2, bl2 = _leaves(x, w, b)
        cake_causal_conv1d(xl2, wl2, cu, bl2).backward(dy)
        assert_same_grads(_grads_of(xl2, wl2, bl2), got, "default policy: ")


def test_autograd_only_parameters_require_grad():
    """x without requires_grad (a first layer): weight and bias still get their gradients."""
    S, C = 2000, 264
    x, w, b, dy = make_inputs(S, C, seed=93, weight_dtype=BF16, bias_dtype=BF16)
    cu = make_cu(S, split(S, 12, random.Random(93)))
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    cake_causal_conv1d(x, wl, cu, bl).backward(dy)
    _, dweight, dbias = backward(x, w, cu, dy, b)
    assert same_bits(wl.grad, dweight) and same_bits(bl.grad, dbias)


def test_autograd_without_grad_records_nothing():
    S, C = 600, 136
    x, w, b, _ = make_inputs(S, C, seed=94)
    cu = make_cu(S, split(S, 5, random.Random(94)))
    xl, wl, bl = _leaves(x, w, b)
    expected = fwd(x, w, cu, bias=b)
    with torch.no_grad():
        y = cake_causal_conv1d(xl, wl, cu, bl)
    assert y.grad_fn is None and not y.requires_grad and same_bits(y, expected)
    with torch.inference_mode():
        y = cake_causal_conv1d(x, w, cu, b)
    assert y.is_inference() and same_bits(y, expected)
    y = cake_causal_conv1d(x, w, cu, b)  # no input requires grad
    assert y.grad_fn is None and same_bits(y, expected)


def test_autograd_create_graph_gives_grads_whose_backward_raises():
    """create_graph=True: first-order gradients as usual; differentiating them again raises, as
    with @once_differentiable (the backward is not itself differentiable)."""
    S, C = 1500, 136
    x, w, b, dy = make_inputs(S, C, seed=95)
    cu = make_cu(S, split(S, 8, random.Random(95)))
    xl, wl, bl = _leaves(x, w, b)
    g = dy.clone().requires_grad_()
    y = cake_causal_conv1d(xl, wl, cu, bl)
    dx, dweight, dbias = torch.autograd.grad(y, (xl, wl, bl), g, create_graph=True)
    assert_same_grads((dx.detach(), dweight.detach(), dbias.detach()), backward(x, w, cu, dy, b))
    assert dweight.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dweight.sum().backward()
    # a gradient penalty: the incoming gradient does not require grad, the gradients still carry
    # the error (torch's @once_differentiable would leave them constants)
    gx, gw = torch.autograd.grad(cake_causal_conv1d(xl, wl, cu, bl).float().sum(), (xl, wl), create_graph=True)
    assert gx.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.float().square().sum().backward()


def test_autograd_saved_x_modified_in_place_raises():
    """The saved x is checked as autograd checks every saved tensor: an in-place change between
    the forward and the backward raises instead of giving gradients of other data."""
    S, C = 800, 136
    x, w, b, dy = make_inputs(S, C, seed=96)
    cu = make_cu(S, split(S, 6, random.Random(96)))
    xl, wl, bl = _leaves(x, w, b)
    h = xl * 1  # a non-leaf, so it may be changed in place
    y = cake_causal_conv1d(h, wl, cu, bl)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_autograd_backward_on_a_side_stream():
    """Forward and backward issued on a side stream (the engine runs the node's backward on the
    forward's stream): the gradients of the default stream."""
    S, C = 3000, 264
    x, w, b, dy = make_inputs(S, C, seed=97)
    cu = make_cu(S, split(S, 11, random.Random(97)))
    expected = backward(x, w, cu, dy, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    xl, wl, bl = _leaves(x, w, b)
    with torch.cuda.stream(side):
        cake_causal_conv1d(xl, wl, cu, bl).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    assert_same_grads(_grads_of(xl, wl, bl), expected)


# The eager C++ node and the Python Function (torch.compile's path), called alike.
_AUTOGRAD_PATHS = (
    lambda x, w, cu, b, policy: cake_causal_conv1d(x, w, cu, b, silu_grad_preactivation=policy),
    lambda x, w, cu, b, policy: CakeCausalConv1dFunction.apply(x, w, cu, b, None, False, policy),
)


def test_autograd_saved_tensors_hooks_see_every_saved_tensor():
    """saved_tensors_hooks (activation offloading, checkpointing tools) pack and unpack what both
    paths save: x, weight, bias, cu_seqlens; the backward computes from what unpack returns (the
    originals are overwritten after the forward), and the gradients are the same bits."""
    S, C = 1200, 136
    x, w, b, dy = make_inputs(S, C, seed=101, weight_dtype=BF16, bias_dtype=F32)
    cu = make_cu(S, split(S, 7, random.Random(101)))
    expected = backward(x, w, cu, dy, b)
    for apply in _AUTOGRAD_PATHS:
        packed, unpacked = [], []

        def pack(t):
            packed.append(t)
            return t.clone()

        def unpack(t):
            unpacked.append(t)
            return t

        xl, wl, bl = _leaves(x, w, b)
        cu_call = cu.clone()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = apply(xl, wl, cu_call, bl, "bf16")
        assert sorted(t.data_ptr() for t in packed) == sorted(t.data_ptr() for t in (xl, wl, bl, cu_call))
        with torch.no_grad():  # the hooks' copies hold the forward's values; the originals move
            for t in (xl, wl, bl):
                t.mul_(-3)
            cu_call.zero_()
        y.backward(dy)
        assert len(unpacked) == 4
        assert_same_grads(_grads_of(xl, wl, bl), expected)


class _DropFirstGrad(torch.autograd.Function):
    """Passes z through; gives its first input no gradient (None), as a user's Function may."""

    @staticmethod
    def forward(ctx, y, z):
        return z.clone()

    @staticmethod
    def backward(ctx, g):
        return None, g


def test_autograd_undefined_incoming_grad_gives_zero_grads():
    """An undefined incoming gradient counts as zeros on both paths (as a Function's
    materialize_grads): zero dx and dweight, not an error and not a missing gradient."""
    S, C = 700, 136
    x, w, b, _ = make_inputs(S, C, seed=102)
    cu = make_cu(S, split(S, 5, random.Random(102)))
    for apply in _AUTOGRAD_PATHS:
        xl, wl, bl = _leaves(x, w, b)
        z = torch.ones(3, device=x.device, requires_grad=True)
        _DropFirstGrad.apply(apply(xl, wl, cu, bl, "bf16"), z).sum().backward()
        for g in _grads_of(xl, wl, bl):
            assert g is not None and not g.any()


def test_compiled_autograd_traces_the_eager_node():
    """Compiled autograd over an eager forward: the C++ node's backward is traced as one call of
    the custom op causal_conv1d_bwd, and gives the eager gradients' bits."""
    from torch._dynamo import compiled_autograd

    S, C = 2000, 264
    x, w, b, dy = make_inputs(S, C, seed=104, weight_dtype=BF16, bias_dtype=F32)
    cu = make_cu(S, split(S, 9, random.Random(104)))
    expected = backward(x, w, cu, dy, b)
    graphs = []

    def compiler_fn(gm):
        graphs.append(gm)
        return torch.compile(gm, backend="eager", fullgraph=True)

    torch._dynamo.reset()
    try:
        for bias in (b, None):
            xl, wl, bl = _leaves(x, w, bias)
            y = cake_causal_conv1d(xl, wl, cu, bl)
            assert y.grad_fn.name() == "CakeCausalConv1dBackward"
            with compiled_autograd._enable(compiler_fn):
                y.backward(dy)
            want = expected if bias is not None else backward(x, w, cu, dy, None)
            assert_same_grads(_grads_of(xl, wl, bl), want, f"bias {bias is not None}: ")
    finally:
        torch._dynamo.reset()
    assert graphs and all("flashinfer_cake.causal_conv1d_bwd" in gm.code for gm in graphs)


def test_autograd_forward_mode_ad_not_supported():
    """Dual tensors (forward-mode AD) raise NotImplementedError before anything is launched."""
    import torch.autograd.forward_ad as fwAD

    S, C = 256, 136
    x, w, b, _ = make_inputs(S, C, seed=103)
    cu = make_cu(S, [S])
    with fwAD.dual_level():
        xd = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            cake_causal_conv1d(xd, w, cu, b)


def test_jit_trace_replays_with_new_data():
    """torch.jit.trace records the Python autograd.Function (the binding is opaque to the
    tracer): the traced function computes y of new inputs, not the traced ones."""
    S, C = 1000, 136
    x, w, b, _ = make_inputs(S, C, seed=98)
    cu = make_cu(S, split(S, 6, random.Random(98)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values
        traced = torch.jit.trace(lambda x, w, cu, b: cake_causal_conv1d(x, w, cu, b), (x, w, cu, b),
                                 check_trace=False)
    x2, w2, b2, _ = make_inputs(S, C, seed=99)
    assert same_bits(traced(x2, w2, cu, b2), fwd(x2, w2, cu, bias=b2))


def _misaligned(t):
    """A contiguous copy of t whose data pointer is one element past an aligned address."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


INCOMING_GRADS = {
    "fp32": lambda dy: dy.float(),
    "transposed-view": lambda dy: dy.t().contiguous().t(),
    "fp32-transposed-view": lambda dy: dy.float().t().contiguous().t(),
    "row-stride-2C": lambda dy: torch.cat([dy, dy], dim=1)[:, : dy.shape[1]],
    "misaligned": _misaligned,
}


@pytest.mark.parametrize("form", list(INCOMING_GRADS))
def test_autograd_incoming_grad_of_any_dtype_and_layout(form):
    """y.backward(g) with g FP32, a strided view or misaligned: the same gradients as the BF16
    contiguous g (materialized once where the raw function rejects such a dy; a BF16 row-strided
    one is read in place, by the raw function too)."""
    S, C = 3000, 136
    x, w, b, dy = make_inputs(S, C, seed=71)
    cu = make_cu(S, split(S, 17, random.Random(71)))
    g = INCOMING_GRADS[form](dy)
    assert torch.equal(g.to(BF16), dy)
    assert g.dtype != BF16 or not g.is_contiguous() or g.data_ptr() % 16
    if form == "row-stride-2C":  # rows the backward reads as they are
        assert_same_grads(bwd(x, w, cu, g, bias=b), bwd(x, w, cu, dy, bias=b))
    elif g.dtype == BF16:  # what the raw function says about it
        with pytest.raises(ValueError, match=r"\bdy\b"):
            bwd(x, w, cu, g, bias=b)
    xl, wl, bl = _leaves(x, w, b)
    cake_causal_conv1d(xl, wl, cu, bl).backward(g)
    assert_same_grads(_grads_of(xl, wl, bl), backward(x, w, cu, dy, b))


def test_autograd_grads_from_losses():
    """Losses whose gradient reaches y as an expanded (stride 0) or transposed tensor."""
    S, C = 2500, 264
    x, w, b, _ = make_inputs(S, C, seed=72)
    cu = make_cu(S, split(S, 9, random.Random(72)))

    xl, wl, bl = _leaves(x, w, b)
    cake_causal_conv1d(xl, wl, cu, bl).sum().backward()  # dy: ones expanded, strides (0, 0)
    assert_same_grads(_grads_of(xl, wl, bl), backward(x, w, cu, torch.ones_like(x), b), "y.sum(): ")

    t = torch.randn(C, S, device=DEV).to(BF16)
    xl, wl, bl = _leaves(x, w, b)
    (cake_causal_conv1d(xl, wl, cu, bl).t() * t).sum().backward()  # dy: t.t(), strides (1, S)
    assert_same_grads(_grads_of(xl, wl, bl), backward(x, w, cu, t.t().contiguous(), b), "(y.t() * t).sum(): ")


class _ConvSiLULoss(torch.nn.Module):
    def __init__(self, weight, bias, policy):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.bias = None if bias is None else torch.nn.Parameter(bias.clone())
        self.policy = policy

    def forward(self, x, cu_seqlens):
        y = cake_causal_conv1d(x, self.weight, cu_seqlens, self.bias, silu_grad_preactivation=self.policy)
        return (y.float() ** 2).sum(), y.detach()


@pytest.mark.parametrize("bias_dtype", [pytest.param(None, id="b_none"), pytest.param(F32, id="b_fp32")])
def test_torch_compile_fullgraph_matches_eager(bias_dtype):
    """The custom ops under torch.compile(fullgraph=True): same y (the same kernel) and the same
    gradients (dy = 2 y is exact in BF16, then the same backward kernel)."""
    S, C = 3000, 264
    x, w, b, _ = make_inputs(S, C, seed=81, bias_dtype=bias_dtype)
    cu = make_cu(S, split(S, 13, random.Random(81)))

    def run(model):
        xl = x.clone().requires_grad_()
        loss, y = model(xl, cu)
        loss.backward()
        params = [model.weight] + ([] if model.bias is None else [model.bias])
        return loss.detach(), y, xl.grad, [p.grad for p in params]

    eager = run(_ConvSiLULoss(w, b, "bf16"))
    compiled_model = torch.compile(_ConvSiLULoss(w, b, "bf16"), fullgraph=True)
    for _ in range(2):  # the second call runs the cached graph
        compiled_model.weight.grad = None
        if compiled_model.bias is not None:
            compiled_model.bias.grad = None
        compiled = run(compiled_model)
        assert torch.equal(compiled[1], eager[1]), "y differs under torch.compile"
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(compiled[2], eager[2], rtol=0, atol=0)  # dx: expected bitwise
        for got, want in zip(compiled[3], eager[3]):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# rejected inputs on the GPU


def _cpu(name):
    def mutate(a):
        a[name] = a[name].cpu()

    return mutate


def _short_workspace(a):
    S, C = a["x"].shape
    a["workspace"] = torch.zeros(workspace_bytes(S, C, device()) // 4 - 1, device=DEV)


def _same_as(name, other):
    def mutate(a):
        a[name] = a[other]

    return mutate


def _dx_overlaps(other):
    """dx and x (or dy) half-overlapping views of one buffer."""
    def mutate(a):
        S, C = a["x"].shape
        buf = torch.randn(2 * S, C, device=DEV).to(BF16)
        a[other], a["dx"] = buf[:S], buf[S // 2 : S // 2 + S]

    return mutate


def _shares_bytes_with_workspace(name):
    """`name` (dx or dweight) and the workspace carved from one byte buffer, overlapping."""
    def mutate(a):
        t, ws = a[name], a["workspace"]
        t_bytes, ws_bytes = t.numel() * t.element_size(), ws.numel() * 4
        buf = torch.zeros(t_bytes + ws_bytes, dtype=torch.uint8, device=DEV)
        start = (t_bytes // 2) // 16 * 16
        a[name] = buf[:t_bytes].view(t.dtype).view(t.shape).fill_(float("nan"))
        a["workspace"] = buf[start : start + ws_bytes].view(F32)

    return mutate


def _workspace_overlaps_weight(a):
    """An FP32 workspace carved from the same buffer as the FP32 taps (the kernel writes the
    workspace while reading the taps)."""
    w, ws = a["weight"], a["workspace"]
    buf = torch.empty(w.numel() + ws.numel(), device=DEV)
    a["weight"] = buf[: w.numel()].view(w.shape).copy_(w)
    a["workspace"] = buf[w.numel() // 2 : w.numel() // 2 + ws.numel()]


def _misaligned_arg(name):
    def mutate(a):
        a[name] = _misaligned(a[name])

    return mutate


BAD_GPU_CASES = [
    pytest.param("x", _cpu("x"), id="x-cpu"),
    pytest.param("weight", _cpu("weight"), id="weight-cpu"),
    pytest.param("cu_seqlens", _cpu("cu_seqlens"), id="cu-cpu"),
    pytest.param("dy", _cpu("dy"), id="dy-cpu"),
    pytest.param("bias", _cpu("bias"), id="bias-cpu"),
    pytest.param("workspace", _cpu("workspace"), id="workspace-cpu"),
    pytest.param("dx", _cpu("dx"), id="dx-cpu"),
    pytest.param("dweight", _cpu("dweight"), id="dweight-cpu"),
    pytest.param("dbias", _cpu("dbias"), id="dbias-cpu"),
    pytest.param("workspace", _short_workspace, id="workspace-one-float-short"),
    pytest.param("dx", _same_as("dx", "x"), id="dx-is-x"),
    pytest.param("dx", _same_as("dx", "dy"), id="dx-is-dy"),
    pytest.param("dx", _dx_overlaps("x"), id="dx-overlaps-x"),
    pytest.param("dx", _dx_overlaps("dy"), id="dx-overlaps-dy"),
    pytest.param("dx", _shares_bytes_with_workspace("dx"), id="dx-overlaps-workspace"),
    pytest.param("dweight", _shares_bytes_with_workspace("dweight"), id="dweight-overlaps-workspace"),
    pytest.param("workspace", _workspace_overlaps_weight, id="workspace-overlaps-weight"),
    pytest.param("x", _misaligned_arg("x"), id="x-misaligned"),
    pytest.param("dy", _misaligned_arg("dy"), id="dy-misaligned"),
    pytest.param("dx", _misaligned_arg("dx"), id="dx-misaligned"),
]


@pytest.mark.parametrize("argname, mutate", BAD_GPU_CASES)
def test_bad_gpu_input_rejected_and_nothing_written(argname, mutate):
    S, C = 1000, 264
    x, w, b, dy = make_inputs(S, C, seed=3)
    dx, dweight, dbias = poisoned_grads(x, w, b)
    args = {
        "x": x, "weight": w, "cu_seqlens": make_cu(S, split(S, 9, random.Random(3))), "dy": dy, "bias": b,
        "workspace": torch.full((workspace_bytes(S, C, device()) // 4,), 7.0, device=DEV),
        "dx": dx, "dweight": dweight, "dbias": dbias,
    }
    mutate(args)
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(ValueError, match=rf"\b{argname}\b") as info:
        bwd(args["x"], args["weight"], args["cu_seqlens"], args["dy"], bias=args["bias"],
            workspace=args["workspace"], dx=args["dx"], dweight=args["dweight"], dbias=args["dbias"])
    assert re.match(rf"cake_causal_conv1d_train_backward: {argname}\b", str(info.value)), str(info.value)
    sync()
    for name, t in args.items():
        assert same_bits(t, before[name]), f"a rejected call wrote {name}"


def test_writes_bump_the_version_of_given_outputs():
    """dx=, dweight=, dbias= and workspace= are written as by in-place ops: their versions move."""
    S, C = 1000, 264
    x, w, b, dy = make_inputs(S, C, seed=9)
    cu = make_cu(S, split(S, 9, random.Random(9)))
    outs = poisoned_grads(x, w, b)
    ws = new_workspace(S, C, device())
    before = [t._version for t in (*outs, ws)]
    backward(x, w, cu, dy, b, workspace=ws, dx=outs[0], dweight=outs[1], dbias=outs[2])
    assert all(t._version > v for t, v in zip((*outs, ws), before))


@pytest.mark.parametrize("argname", ["weight", "bias"])
def test_misaligned_parameter_is_copied_and_correct(argname):
    """A misaligned weight / bias view (a slice of a larger parameter) works; dweight / dbias
    still come back in its dtype."""
    S, C = 1000, 264
    x, w, b, dy = make_inputs(S, C, seed=4)
    cu = make_cu(S, split(S, 9, random.Random(4)))
    args = {"weight": w, "bias": b}
    args[argname] = _misaligned(args[argname])
    assert args[argname].data_ptr() % 16
    grads = backward_into(x, args["weight"], cu, dy, args["bias"])
    assert_same_grads(grads, backward(x, w, cu, dy, b))
    assert_grads_match_reference(grads, x, w, cu, dy, b)


CORRUPT_CU = {
    "descending": lambda S: [0, S, S // 2, S // 4, 1, S],
    "negative": lambda S: [0, -5, 10, -(2**31), S],
    "beyond-S": lambda S: [0, S // 2, S + 100, 2 * S, S + 1],
    "first-nonzero": lambda S: [7, 100, S],
    "length-1-S": lambda S: [S],
    "garbage": lambda S: [r.randint(-(2**31), 2**31 - 1) for r in [random.Random(S)] for _ in range(64)],
    "sorted-out-of-range": lambda S: [-9, -1, 2, 2, 40, S - 200, S + 3, S + 3],
}
# Non-decreasing patterns have a defined result (the reference's); out-of-order ones only a
# memory-safe, deterministic one.
SORTED_CORRUPT = [name for name, make in CORRUPT_CU.items() if make(3000) == sorted(make(3000))]


@pytest.mark.parametrize("pattern", list(CORRUPT_CU))
def test_corrupt_cu_seqlens_do_not_fault(pattern):
    """Any cu_seqlens content: no fault, every dx row written, finite, deterministic."""
    S, C = 3000, 264
    x, w, b, dy = make_inputs(S, C, seed=S + C)
    bad_cu = torch.tensor(CORRUPT_CU[pattern](S), dtype=I32, device=DEV)
    grads = backward_into(x, w, bad_cu, dy, b)
    again = backward(x, w, bad_cu, dy, b)
    sync()  # raises if a kernel faulted
    for t in grads:
        assert torch.isfinite(t.float()).all()
    assert_same_grads(again, grads)
    if pattern in SORTED_CORRUPT:
        assert_grads_match_reference(grads, x, w, bad_cu, dy, b)
    cu = make_cu(S, split(S, 11, random.Random(S)))  # a valid call afterwards is still exact
    assert_grads_match_reference(backward_into(x, w, cu, dy, b), x, w, cu, dy, b)


# (2049, 4096): 17 groups of 128 tokens in 64-thread CTAs (WideShort); (1111, 4096) their WideHalf;
# (4098, 8192): groups of 576 tokens in 16-byte rows (WideVec8), S = 2 mod 64: the first strip whose walk
# would reach row S is the first kept off the loop without bounds tests; (100000, 200): groups of 448
# tokens, the second channel tile with idle lanes; (70000, 64), (5000, 32): full tiles of 16 and 8 lanes
_MEMCHECK_SHAPES = [(300, 264), (77, 8), (200, 136), (1111, 4096), (2049, 4096), (4098, 8192), (100000, 200), (300, 56),
                    (262200, 40), (70000, 64), (5000, 32)]
_MEMCHECK_SCRIPT = """
import torch
from flashinfer_cake import cake_causal_conv1d_train_backward as bwd
PATTERNS = {patterns}  # per S: each pattern made for the S it runs at (an entry just past S, one at S)
for S, C in {shapes}:
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    b = torch.randn(C, device="cuda", dtype=torch.bfloat16)
    for cu in [[0, S], [0, 1, 2, 5, S], *PATTERNS[S].values()]:
        bwd(x, w, torch.tensor(cu, dtype=torch.int32, device="cuda"), dy, bias=b)
        bwd(x, w.bfloat16(), torch.tensor(cu, dtype=torch.int32, device="cuda"), dy)
S = 524289  # 513 token groups: the warp-filled routes at C <= 16, a last group of 1 token
for C in (8, 16):  # every corrupt pattern, scaled to this S
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    for cu in [[0, S], *PATTERNS[S].values()]:
        bwd(x, w, torch.tensor(cu, dtype=torch.int32, device="cuda"), dy)
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


_RACECHECK_SCRIPT = """
import torch
from flashinfer_cake import cake_causal_conv1d_train_backward as bwd
g = torch.Generator().manual_seed(5)
for S, C in [(524289, 8), (524289, 16), (524305, 8)]:  # >= 512 token groups: the warp-filled routes
    lengths = torch.randint(1, 3000, (S,), generator=g).cumsum(0)
    cu = torch.tensor([0, *lengths[lengths < S].tolist(), S], dtype=torch.int32, device="cuda")
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    h = torch.randn(len(cu) - 1, 3, C, device="cuda", dtype=torch.bfloat16)
    bwd(x, w, cu, dy)
    bwd(x, w, cu, dy, initial_states=h, dfinal_states=h)
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_racecheck_clean(tmp_path):
    """compute-sanitizer's racecheck sees no unordered shared-memory access on the routes whose
    warps fill their strips' rings and store their dx together (C <= 16, 512 or more token groups:
    a lane writes and reads rows of other lanes' strips), stateless and with states, including a
    last token group of 1 and of 17 tokens (strips past the batch's end)."""
    assert_sanitizer_clean(_RACECHECK_SCRIPT, tmp_path, tool="racecheck")


@needs_sanitizer
def test_memcheck_clean(tmp_path):
    """compute-sanitizer's memcheck sees no out-of-bounds access, for tails of S and C and for
    every corrupt cu_seqlens pattern (also on the warp-filled routes of C <= 16)."""
    patterns = {S: {name: [min(max(v, -(2**31)), 2**31 - 1) for v in make(S)] for name, make in CORRUPT_CU.items()}
                for S in {S for S, _ in _MEMCHECK_SHAPES} | {524289}}  # concrete lists, made for the S they run at
    script = _MEMCHECK_SCRIPT.replace("{patterns}", repr(patterns)).replace("{shapes}", repr(_MEMCHECK_SHAPES))
    assert_sanitizer_clean(script, tmp_path)
