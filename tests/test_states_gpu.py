"""GPU tests of issue 15 (sm_90; skipped without one, see conftest.py): per-document conv states
(``initial_states`` / ``final_states_out`` / ``dfinal_states`` / ``dinitial_states``), chunks
chained through them under autograd, and row-strided views of x, out, dy and dx.

As in test_forward_gpu.py and test_backward_gpu.py: fresh random inputs (never zeros), NaN-poisoned
outputs, the FP64 references of flashinfer_cake.reference, and tolerances derived from the
kernels' arithmetic (FP32 math, BF16 results rounded once). Final states are copies of BF16 rows:
bitwise.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from doclengths import empty_at_ends, docs_16_to_64, fill, make_cu, one_doc, split, tiny_docs
from launched import launched_bwd_kernel, launched_kernels, launched_route
from sanitizer import assert_sanitizer_clean, needs_sanitizer
from flashinfer_cake import cake_causal_conv1d, cake_causal_conv1d_train_backward, cake_causal_conv1d_train_forward
from flashinfer_cake.reference import (
    causal_conv1d_backward_reference,
    causal_conv1d_final_states_reference,
    causal_conv1d_preactivation_reference,
    causal_conv1d_reference,
)

pytestmark = pytest.mark.gpu

fwd = cake_causal_conv1d_train_forward
bwd = cake_causal_conv1d_train_backward

DEV = "cuda"
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
WEIGHT_DTYPES = [pytest.param(F32, id="w_fp32"), pytest.param(BF16, id="w_bf16")]
BIAS_DTYPES = [pytest.param(None, id="b_none"), pytest.param(F32, id="b_fp32"), pytest.param(BF16, id="b_bf16")]
POLICIES = ["bf16", "fp32"]
# Up to 3 links of chained states, each a BF16 rounding (<= 2^-8 relative) of part of a sum.
CHAIN_SLACK = 2.0**-6


# ---------------------------------------------------------------------------------------------
# helpers


def sync():
    torch.cuda.synchronize()


def chunky_mix(S, rng):
    """Empty documents at both ends and inside, 1-3 token documents and longer ones."""
    return [0] + fill(S, rng, (1, 2, 3, 5, 17, 64, 200), p_empty=0.1) + [0, 0]


def long_docs(S, rng):
    """Documents of 600-3000 tokens with 1- and 2-token ones and empty ones among them: about 1000
    tokens per document (at C a multiple of 256 the stateful backward runs in 16-byte rows from 512 where
    its grid balances the SMs)."""
    return [0] + fill(S, rng, (1, 2, 600, 900, 1500, 3000), p_empty=0.05) + [0]


def piece_edge_docs(S, rng):
    """Documents starting 0-3 tokens after 64-token piece boundaries (inside a strip's run of pieces,
    where the window carries on from one piece to the next), 1- and 2-token documents after some of
    them, and an empty document at each end."""
    starts = {64 * k + rng.randint(0, 3) for k in rng.sample(range(1, S // 64), min(300, S // 64 - 1))}
    starts |= {c + rng.randint(1, 2) for c in sorted(starts)[::5]}
    cuts = sorted(c for c in starts if 0 < c < S)
    return [0] + [hi - lo for lo, hi in zip([0, *cuts], [*cuts, S])] + [0]


def variant_seed(base, weight_dtype, bias_dtype, policy="bf16"):
    return base + 10 * (weight_dtype is BF16) + {None: 0, F32: 1, BF16: 2}[bias_dtype] + 100 * (policy == "fp32")


def _randn(shape, g, dtype=BF16, scale=1.0):
    return (scale * torch.randn(shape, device=DEV, generator=g)).to(dtype)


def make_inputs(S, C, num_docs, *, seed, weight_dtype=F32, bias_dtype=F32):
    """Fresh random x, dy (BF16 [S, C]), weight, bias (None when bias_dtype is None), initial
    states and final states' gradient (BF16 [num_docs, 3, C]) on the GPU."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x, dy = _randn((S, C), g), _randn((S, C), g)
    w = _randn((C, 4), g, weight_dtype, 0.5)
    b = None if bias_dtype is None else _randn((C,), g, bias_dtype, 0.5)
    return x, w, b, dy, _randn((num_docs, 3, C), g), _randn((num_docs, 3, C), g)


def poisoned(shape, dtype=BF16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b):
    """Bitwise equality (None == None) that also holds for NaN-poisoned tensors and views."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def same_but_zero_sign(a, b):
    """Bitwise equal except that an exact zero may be +0 or -0 (a == b, and the bits where != 0)."""
    if a.shape != b.shape or a.dtype != b.dtype or not bool((a == b).all()):
        return False
    nz = a != 0
    return torch.equal(_bits(a.contiguous())[nz], _bits(b.contiguous())[nz])


def final_states_reference(x, cu, init):
    """The final states as BF16: copies of BF16 rows, so the FP64 reference converts exactly."""
    return causal_conv1d_final_states_reference(x, cu, init).to(BF16)


def assert_y_matches_reference(y, x, w, cu, b=None, init=None):
    """y fully written and within half a BF16 ulp (+ FP32 noise) of the FP64 result, as in
    test_forward_gpu.py, the taps before a document's first token reading its initial state."""
    assert y.dtype == BF16 and y.shape == x.shape and y.device == x.device, (y.dtype, y.shape)
    C = x.shape[-1]
    ref = causal_conv1d_reference(x, w, cu, b, initial_states=init).reshape(-1, C)
    got = y.reshape(-1, C).double()
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} outputs NaN/inf (never written?)"
    mag = ref.abs()
    tol = 0.5 * torch.exp2(torch.floor(torch.log2(mag)) - 7) + 2.0**-12 * mag + 2e-5
    _check_close("y", got, ref, tol)


def _check_close(what, got, want, tol):
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} values NaN/inf (never written?)"
    err = (got.double() - want).abs()
    bad = err > tol
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} values out of tolerance; first at {i}: got "
            f"{got[i].item()!r}, want {want[i].item()!r}, tol {tol[i].item():.3g}; max abs err {err.max().item():.3g}")


def silu_grad(a):
    s = torch.sigmoid(a)
    return s * (1 + a * (1 - s))


def _abs(t):
    return None if t is None else t.abs()


def _g_error_bound(x, w, cu, dy, b, init, policy):
    """Per element, a bound of |g_kernel - g_ref| with g = dy * silu'(a'): test_backward_gpu.py's,
    the pre-activation (and its magnitude) including the initial states' taps."""
    C = x.shape[-1]
    a = causal_conv1d_preactivation_reference(x, w, cu, b, initial_states=init).reshape(-1, C)
    a_err = 2.0**-20 * causal_conv1d_preactivation_reference(
        x.abs(), w.abs(), cu, _abs(b), initial_states=_abs(init)).reshape(-1, C)
    dy_abs = dy.reshape(-1, C).double().abs()
    err = dy_abs * (2.0**-19 + 0.5 * a_err)
    if policy == "bf16":  # an FP32 pre-activation near a BF16 rounding midpoint may round the other way
        def rounded(v):
            return v.to(BF16).double()

        at_ref = silu_grad(rounded(a))
        err = err + dy_abs * torch.maximum((silu_grad(rounded(a - a_err)) - at_ref).abs(),
                                           (silu_grad(rounded(a + a_err)) - at_ref).abs())
    return err


def _transposed(v, x, w, cu, init, dfinal=None):
    """The backward's sums with every term made non-negative, v >= 0 ([S, C]) in place of g and
    |dfinal| in place of dfinal: (dx [S, C], dweight [C, 4], dinitial [num_docs, 3, C] or None).
    Autograd of the FP64 reference forward on |x|, |w|, |initial_states|, linear in each."""
    C = x.shape[-1]
    xa = x.reshape(-1, C).double().abs().requires_grad_()
    wa = w.double().abs().requires_grad_()
    ia = None if init is None else init.double().abs().requires_grad_()
    outs, grads = [causal_conv1d_preactivation_reference(xa, wa, cu, initial_states=ia)], [v]
    if dfinal is not None:
        outs.append(causal_conv1d_final_states_reference(xa, cu, ia))
        grads.append(dfinal.double().abs())
    leaves = [xa, wa] + ([] if ia is None else [ia])
    got = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    got = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, got)]
    return got[0], got[1], (got[2] if ia is not None else None)


def _param_tol(ref, mag, slack, dtype):
    rel = 2.0**-8 if dtype == BF16 else 0.0
    return rel * ref.abs() + (1 + rel) * (1e-5 * mag + 1.01 * slack) + 1e-30


def assert_grads_match_reference(grads, x, w, cu, dy, b=None, policy="bf16", init=None, dfinal=None, *,
                                 rows=None, slack=0.0):
    """(dx, dweight, dbias, dinitial) fully written and within the kernels' rounding of the FP64
    reference backward (test_backward_gpu.py's tolerances; dinitial like dx: FP32 sums rounded
    once to BF16). ``rows`` restricts the dx check to those rows; ``slack`` adds slack * (sum of
    |terms|) to dx and dinitial (chained chunks); dweight None skips dweight and dbias."""
    dx, dweight, dbias, dinit = grads
    C = x.shape[-1]
    assert dx.dtype == BF16 and dx.shape == x.shape and dx.device == x.device
    ref = causal_conv1d_backward_reference(x, w, cu, dy, b, initial_states=init, dfinal_states=dfinal,
                                           silu_grad_preactivation=policy)
    g_mag = 1.1 * dy.reshape(-1, C).double().abs()
    g_err = _g_error_bound(x, w, cu, dy, b, init, policy)
    mg_dx, mg_dw, mg_di = _transposed(g_mag, x, w, cu, init, dfinal)
    me_dx, me_dw, me_di = _transposed(g_err, x, w, cu, init)

    ref_dx, got_dx = ref[0].reshape(-1, C), dx.reshape(-1, C)
    tol_dx = 2.0**-7 * ref_dx.abs() + (2.0**-16 + slack) * mg_dx + 1.01 * me_dx
    if rows is not None:
        ref_dx, got_dx, tol_dx = ref_dx[rows], got_dx[rows], tol_dx[rows]
    _check_close("dx", got_dx, ref_dx, tol_dx)
    if rows is None and ref_dx.numel():
        rel_l2 = ((got_dx.double() - ref_dx).norm() / ref_dx.norm().clamp_min(1e-30)).item()
        assert rel_l2 < 1e-2, f"dx relative L2 error {rel_l2:.3g}"
    if dweight is not None:
        assert dweight.dtype == w.dtype and dweight.shape == (C, 4)
        _check_close("dweight", dweight, ref[1], _param_tol(ref[1], mg_dw, me_dw, w.dtype))
        if b is None:
            assert dbias is None
        else:
            assert dbias.dtype == b.dtype and dbias.shape == (C,)
            _check_close("dbias", dbias, ref[2], _param_tol(ref[2], g_mag.sum(0), g_err.sum(0), b.dtype))
    if init is None:
        assert dinit is None
    else:
        assert dinit.dtype == BF16 and dinit.shape == init.shape and dinit.device == x.device
        tol = 2.0**-7 * ref[3].abs() + (2.0**-16 + slack) * mg_di + 1.01 * me_di
        _check_close("dinitial_states", dinit, ref[3], tol)


def backward(x, w, cu, dy, b=None, policy="bf16", init=None, dfinal=None, **kw):
    """The raw backward, always as (dx, dweight, dbias or None, dinitial_states or None)."""
    res = bwd(x, w, cu, dy, bias=b, initial_states=init, dfinal_states=dfinal, silu_grad_preactivation=policy, **kw)
    assert isinstance(res, tuple) and len(res) == 2 + (b is not None) + (init is not None), len(res)
    rest = list(res[2:])
    return res[0], res[1], rest.pop(0) if b is not None else None, rest.pop(0) if init is not None else None


def backward_into(x, w, cu, dy, b=None, policy="bf16", init=None, dfinal=None, **kw):
    """The raw backward into NaN-poisoned outputs; checks that it returns exactly them."""
    outs = (poisoned(x.shape), poisoned(w.shape, w.dtype), None if b is None else poisoned(b.shape, b.dtype),
            None if init is None else poisoned(init.shape))
    got = backward(x, w, cu, dy, b, policy, init, dfinal, dx=outs[0], dweight=outs[1], dbias=outs[2],
                   dinitial_states=outs[3], **kw)
    assert all(g is o for g, o in zip(got, outs)), "the given output tensors must be returned"
    return got


def leaves(*ts):
    return [None if t is None else t.clone().requires_grad_() for t in ts]


def grads_of(*ts):
    return [None if t is None else t.grad for t in ts]


# ---------------------------------------------------------------------------------------------
# forward with states


FWD_CASES = [
    # S, C, document mix, weight dtype, bias dtype
    pytest.param(1, 8, one_doc, F32, None, id="S1-C8-one"),
    pytest.param(2, 64, tiny_docs, BF16, F32, id="S2-C64-tiny"),
    pytest.param(3, 136, empty_at_ends, F32, BF16, id="S3-C136-empty-ends"),
    pytest.param(17, 8, tiny_docs, BF16, None, id="S17-C8-tiny"),
    pytest.param(1000, 64, docs_16_to_64, F32, F32, id="S1000-C64-docs16-64"),
    pytest.param(1023, 1024, empty_at_ends, BF16, BF16, id="S1023-C1024-empty-ends"),
    pytest.param(2049, 136, tiny_docs, F32, BF16, id="S2049-C136-tiny"),
    # short documents at C > 128: the deeper ring (the launcher's CAKE_FWD_SHORT_DOC_TOKENS), a partial channel tile
    pytest.param(4100, 1032, tiny_docs, BF16, None, id="S4100-C1032-tiny"),
    # ~23 000 documents: the short scan's coarse search takes two rounds (more than 128 * 129 entries)
    pytest.param(40000, 136, tiny_docs, F32, F32, id="S40000-C136-tiny"),
    pytest.param(3001, 4096, docs_16_to_64, BF16, F32, id="S3001-C4096-docs16-64"),
    pytest.param(4097, 8, chunky_mix, F32, None, id="S4097-C8-chunky"),
    pytest.param(777, 4096, one_doc, BF16, None, id="S777-C4096-one"),
    pytest.param(5000, 16, tiny_docs, F32, F32, id="S5000-C16-tiny"),
    pytest.param(3001, 32, docs_16_to_64, BF16, BF16, id="S3001-C32-docs16-64"),
    pytest.param(2049, 24, chunky_mix, F32, None, id="S2049-C24-chunky"),
    pytest.param(2001, 72, tiny_docs, BF16, F32, id="S2001-C72-tiny"),
    pytest.param(3001, 40, tiny_docs, F32, F32, id="S3001-C40-tiny"),
    pytest.param(2500, 48, chunky_mix, BF16, BF16, id="S2500-C48-chunky"),
    pytest.param(4099, 56, docs_16_to_64, F32, None, id="S4099-C56-docs16-64"),
    pytest.param(1500, 128, empty_at_ends, F32, BF16, id="S1500-C128-empty-ends"),
]


@pytest.mark.parametrize("states", ["initial", "final", "both"])
@pytest.mark.parametrize("S, C, mix, weight_dtype, bias_dtype", FWD_CASES)
def test_forward_with_states_matches_reference(S, C, mix, weight_dtype, bias_dtype, states):
    seed = 7919 * S + C
    cu = make_cu(S, mix(S, random.Random(seed)), device=DEV)
    D = cu.numel() - 1
    x, w, b, _, init, _ = make_inputs(S, C, D, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    init = None if states == "final" else init
    final = None if states == "initial" else poisoned((D, 3, C))
    inputs_before = [t.clone() for t in (x, w, cu) + ((init,) if init is not None else ())]
    out = poisoned(x.shape)
    assert fwd(x, w, cu, bias=b, initial_states=init, final_states_out=final, out=out) is out
    assert_y_matches_reference(out, x, w, cu, b, init)
    if final is not None:
        assert same_bits(final, final_states_reference(x, cu, init)), "final states are not exact copies"
    # the two are independent: y without final_states_out, allocated, is the same bits
    assert same_bits(fwd(x, w, cu, bias=b, initial_states=init), out)
    sync()
    assert all(same_bits(t, u) for t, u in zip((x, w, cu) + ((init,) if init is not None else ()), inputs_before))


@pytest.mark.parametrize("S, C", [(1, 8), (5, 64), (1500, 136)])
def test_zero_initial_states_are_no_history(S, C):
    """Zero initial states give y (but the sign of an exact zero) and final states of none."""
    cu = make_cu(S, tiny_docs(S, random.Random(S)), device=DEV)
    D = cu.numel() - 1
    x, w, b, _, _, _ = make_inputs(S, C, D, seed=S + C)
    zeros = torch.zeros(D, 3, C, dtype=BF16, device=DEV)
    f0, f1 = poisoned((D, 3, C)), poisoned((D, 3, C))
    y0 = fwd(x, w, cu, bias=b, initial_states=zeros, final_states_out=f0)
    y1 = fwd(x, w, cu, bias=b, final_states_out=f1)
    assert same_but_zero_sign(y0, y1) and same_but_zero_sign(y0, fwd(x, w, cu, bias=b))
    assert same_bits(f0, f1) and same_bits(f0, final_states_reference(x, cu, None))


@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
def test_empty_sequence_states_pass_through(bias_dtype):
    """S == 0 with 3 empty documents: final states are the initial ones (zeros without), the
    states' gradient passes to dinitial_states unchanged, dweight / dbias are zero."""
    C = 64
    x, w, b, dy, init, dfinal = make_inputs(0, C, 3, seed=5, bias_dtype=bias_dtype)
    cu = torch.zeros(4, dtype=I32, device=DEV)
    for given in (init, None):
        final = poisoned((3, 3, C))
        assert fwd(x, w, cu, bias=b, initial_states=given, final_states_out=final).shape == x.shape
        assert same_bits(final, init if given is not None else torch.zeros_like(init))
    dx, dweight, dbias, dinit = backward_into(x, w, cu, dy, b, "bf16", init, dfinal)
    sync()
    assert dx.shape == x.shape and same_bits(dinit, dfinal)
    assert torch.equal(dweight, torch.zeros_like(w)) and (b is None or torch.equal(dbias, torch.zeros_like(b)))


# ---------------------------------------------------------------------------------------------
# backward with states


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_backward_every_variant_with_states_matches_reference(weight_dtype, bias_dtype, policy):
    S, C = 2000, 136
    seed = variant_seed(2000, weight_dtype, bias_dtype, policy)
    rng = random.Random(seed)
    cu = make_cu(S, [0] + split(S // 2, 30, rng) + [0] + tiny_docs(S - S // 2, rng) + [0], device=DEV)
    x, w, b, dy, init, dfinal = make_inputs(S, C, cu.numel() - 1, seed=seed, weight_dtype=weight_dtype,
                                            bias_dtype=bias_dtype)
    before = [t.clone() for t in (x, dy, init, dfinal)]
    for given_init, given_dfinal in ((init, None), (None, dfinal), (init, dfinal)):
        grads = backward_into(x, w, cu, dy, b, policy, given_init, given_dfinal)
        assert_grads_match_reference(grads, x, w, cu, dy, b, policy, given_init, given_dfinal)
        fresh = backward(x, w, cu, dy, b, policy, given_init, given_dfinal)  # allocated outputs: same bits
        assert all(same_bits(g, f) for g, f in zip(grads, fresh))
    sync()
    assert all(same_bits(t, u) for t, u in zip((x, dy, init, dfinal), before)), "an input was written"


BWD_CASES = [
    # S, C, document mix, weight dtype, bias dtype, policy
    pytest.param(1, 8, one_doc, F32, None, "bf16", id="S1-C8-one"),
    pytest.param(3, 64, empty_at_ends, BF16, F32, "fp32", id="S3-C64-empty-ends"),
    pytest.param(5, 8, tiny_docs, F32, BF16, "bf16", id="S5-C8-tiny"),
    pytest.param(65, 136, one_doc, BF16, BF16, "fp32", id="S65-C136-one"),
    pytest.param(1000, 1024, docs_16_to_64, F32, F32, "bf16", id="S1000-C1024-docs16-64"),
    pytest.param(4097, 64, chunky_mix, BF16, None, "fp32", id="S4097-C64-chunky"),
    pytest.param(3001, 4096, tiny_docs, F32, BF16, "fp32", id="S3001-C4096-tiny"),
    pytest.param(2500, 8, empty_at_ends, BF16, F32, "bf16", id="S2500-C8-empty-ends"),
    pytest.param(530000, 16, chunky_mix, F32, F32, "fp32", id="S530000-C16-chunky"),  # the 4-lane route
    pytest.param(530000, 8, tiny_docs, BF16, None, "bf16", id="S530000-C8-tiny"),  # the 2-lane route
    # runs of 2 pieces per strip (groups of 448 and 320 tokens): Wide, and Mid (16 lanes)
    pytest.param(100003, 200, piece_edge_docs, F32, F32, "bf16", id="S100003-C200-piece-edges"),
    pytest.param(262147, 64, piece_edge_docs, BF16, None, "fp32", id="S262147-C64-piece-edges"),
    # The even-run choice's groups (31 of 544 tokens, runs of 136: not whole strips): the item choice
    # (1 document) and Wide's per-step kernel (~300 documents).
    pytest.param(16384, 4352, one_doc, F32, F32, "fp32", id="S16384-C4352-one-even-runs"),
    pytest.param(16384, 4352, piece_edge_docs, BF16, F32, "bf16", id="S16384-C4352-piece-edges-even-runs"),
]


@pytest.mark.parametrize("states", ["initial", "dfinal", "both"])
@pytest.mark.parametrize("S, C, mix, weight_dtype, bias_dtype, policy", BWD_CASES)
def test_backward_document_mixes_with_states(S, C, mix, weight_dtype, bias_dtype, policy, states):
    seed = 7919 * S + C
    cu = make_cu(S, mix(S, random.Random(seed)), device=DEV)
    x, w, b, dy, init, dfinal = make_inputs(S, C, cu.numel() - 1, seed=seed, weight_dtype=weight_dtype,
                                            bias_dtype=bias_dtype)
    init, dfinal = (None if states == "dfinal" else init), (None if states == "initial" else dfinal)
    grads = backward_into(x, w, cu, dy, b, policy, init, dfinal)
    assert_grads_match_reference(grads, x, w, cu, dy, b, policy, init, dfinal)


@pytest.mark.parametrize("S, C, mix, weight_dtype, bias_dtype, policy", [
    pytest.param(100003, 512, long_docs, BF16, F32, "bf16", id="S100003-C512"),  # groups of 768 tokens: runs of 192
    pytest.param(8195, 4096, long_docs, F32, None, "fp32", id="S8195-C4096"),  # groups of 528 tokens (runs of 132: not whole strips), the last part-filled
    pytest.param(65539, 1024, long_docs, F32, BF16, "bf16", id="S65539-C1024"),  # groups of 1024 tokens, the last of 3
    pytest.param(131075, 256, long_docs, BF16, BF16, "fp32", id="S131075-C256"),  # one channel tile, groups of 512 tokens, the last of 3
    # 363 documents, starting 0-3 tokens after piece boundaries (the rows a strip's window starts with)
    pytest.param(200003, 256, piece_edge_docs, F32, F32, "bf16", id="S200003-C256-piece-edges"),
    pytest.param(20480, 4096, long_docs, F32, F32, "bf16", id="S20480-C4096-split-wave"),  # 16 x 768 + 16 x 512 tokens
])
def test_backward_states_in_16_byte_rows(S, C, mix, weight_dtype, bias_dtype, policy):
    """With states, at C a multiple of 256, documents of 512 tokens or more on average and fewer than
    16 token groups per document, on a grid that balances the SMs as Wide's does, the backward runs
    WideVec8's per-step kernel (16-byte rows). It
    matches the reference, and the same batch with empty documents appended until the average falls
    below 512 tokens (Wide's per-step kernel, 8-byte rows: the same strips, added in the same order)
    gives the same bits."""
    from flashinfer_cake import _plan

    seed = variant_seed(S + C, weight_dtype, bias_dtype, policy)
    lengths = mix(S, random.Random(seed))
    D = len(lengths)
    plan = _plan.plan_of(S, C)  # as the launcher counts them
    assert S >= 512 * D and plan.groups < 16 * D and plan.item_tokens >= 256 and plan.vec8_rows, \
        "the case must take WideVec8"
    extra = S // 512 + 1 - D  # S < 512 * (D + extra)
    cu = make_cu(S, lengths, device=DEV)
    cu_more = torch.cat([cu, torch.full((extra,), S, dtype=I32, device=DEV)])
    x, w, b, dy, init, dfinal = make_inputs(S, C, D + extra, seed=seed, weight_dtype=weight_dtype,
                                            bias_dtype=bias_dtype)
    for given_init, given_dfinal in ((init, None), (None, dfinal), (init, dfinal)):
        few = [None if t is None else t[:D] for t in (given_init, given_dfinal)]
        assert launched_route(lambda: backward(x, w, cu, dy, b, policy, *few)) == (8, 32, 128, 64)
        assert launched_route(lambda: backward(x, w, cu_more, dy, b, policy, given_init, given_dfinal)) == (4, 32, 128, 64)
        grads = backward_into(x, w, cu, dy, b, policy, *few)
        wide = backward_into(x, w, cu_more, dy, b, policy, given_init, given_dfinal)
        assert all(same_bits(g, h) for g, h in zip(grads[:3], wide[:3]))
        if given_init is not None:
            assert same_bits(grads[3], wide[3][:D])
        assert_grads_match_reference(grads, x, w, cu, dy, b, policy, *few)


@pytest.mark.parametrize("docs, vec, item_choice", [(1, 4, True), (2, 8, False), (16, 8, False), (17, 4, False)])
def test_backward_states_route_rule(docs, vec, item_choice):
    """The stateful route at 8192 x 4096 (16 token groups of 512 tokens): 1 document takes Wide's
    item choice (16 groups per document), 2-16 documents WideVec8's per-step kernel (8192 tokens >=
    512 per document), 17 Wide's per-step kernel."""
    S, C = 8192, 4096
    x, w, b, dy, init, dfinal = make_inputs(S, C, docs, seed=docs)
    cu = make_cu(S, split(S, docs, random.Random(docs)), device=DEV)
    call = lambda: backward(x, w, cu, dy, b, "bf16", init, dfinal)  # noqa: E731
    assert launched_route(call) == (vec, 32, 128, 64)
    assert launched_item_choice(call) == item_choice


@pytest.mark.parametrize("S, docs, states, ring", [
    (800, 100, True, 16),  # 8 tokens per document: the short documents' ring
    (801, 100, True, 8),
    (800, 100, False, 8),  # never without states
])
def test_forward_states_ring_rule(S, docs, states, ring):
    """With states at C > 128 the strip kernel takes its 16-row ring when the documents average at most 8
    tokens (S <= 8 * num_docs, the launcher's CAKE_FWD_SHORT_DOC_TOKENS), else the 8-row one; y is the
    reference's either way."""
    C = 264
    x, w, b, _, init, _ = make_inputs(S, C, docs, seed=S)
    cu = make_cu(S, split(S, docs, random.Random(S)), device=DEV)
    kw = dict(initial_states=init, final_states_out=poisoned((docs, 3, C))) if states else {}
    out = poisoned((S, C))
    names = [n for n in launched_kernels(lambda: fwd(x, w, cu, bias=b, out=out, **kw)) if "causal_conv1d_fwd_kernel" in n]
    assert len(names) == 1, names
    m = re.search(r"FwdTraits<\s*8,\s*32,\s*128,\s*16,\s*(\d+),", names[0])
    assert m and int(m[1]) == ring, names[0]
    assert_y_matches_reference(out, x, w, cu, b, init if states else None)
    if states:
        assert same_bits(kw["final_states_out"], final_states_reference(x, cu, init))


@pytest.mark.parametrize("S, C, docs, groups, route, item_choice", [
    pytest.param(131072, 136, 32, 256, (4, 32, 128, 64), True, id="S131072-C136-wide-8-per-doc"),  # 512 tokens each
    pytest.param(131072, 136, 33, 256, (4, 32, 128, 64), False, id="S131072-C136-wide-7.8-per-doc"),
    pytest.param(33000, 136, 16, 258, (4, 32, 64, 64), True, id="S33000-C136-short-16-per-doc"),  # 128 each
    pytest.param(33000, 136, 17, 258, (4, 32, 64, 64), False, id="S33000-C136-short-15.2-per-doc"),
])
def test_backward_item_choice_threshold(S, C, docs, groups, route, item_choice):
    """Wide's grids take the item choice from 8 token groups per document, the small-grid routes (here
    WideShort: 1032 warps) from 16 (causal_conv1d_bwd_launcher.cuh); the results match the reference
    either way."""
    from flashinfer_cake import _plan

    assert _plan.plan_of(S, C).groups == groups
    x, w, b, dy, init, dfinal = make_inputs(S, C, docs, seed=docs)
    cu = make_cu(S, split(S, docs, random.Random(docs)), device=DEV)
    call = lambda: backward(x, w, cu, dy, b, "bf16", init, dfinal)  # noqa: E731
    assert launched_route(call) == route
    assert launched_item_choice(call) == item_choice
    grads = backward_into(x, w, cu, dy, b, "bf16", init, dfinal)
    assert_grads_match_reference(grads, x, w, cu, dy, b, "bf16", init, dfinal)


# The stateful backward has two kernels on the full-width routes (C > 64): with at least 16 token
# groups per document (8 on Wide's grids) the launcher takes the one whose CTAs without a state event in their item walk
# a stateless-only loop (causal_conv1d_bwd_launcher.cuh). Empty documents appended to a batch have
# no token and change no other result, so with as many of them as groups the same batch runs the
# per-step kernel (groups < num_docs): both must give the same bits and match the reference.
ITEM_CHOICE_CASES = [
    pytest.param(32768, 136, F32, F32, id="S32768-C136"),  # 256 groups of 128 tokens: 32-token strips (WideHalf)
    pytest.param(33000, 136, BF16, F32, id="S33000-C136"),  # 258 groups of 128 tokens: 64-thread CTAs (WideShort)
    pytest.param(131072, 136, BF16, None, id="S131072-C136"),  # 256 groups of 512 tokens: 128-thread CTAs
]


def _item_edge_docs(S, tokens, groups, rng):
    """Seven document lengths: boundaries 1-3 tokens before an item edge (events in the item's
    3-token lookahead and its last rows) and 0-2 tokens after one (events in the next item's first
    rows), a 1-token document inside an item, and an empty document at each end."""
    a, b, c = sorted(rng.sample(range(2, groups - 1), 3))
    cuts = sorted({tokens * a - rng.randint(1, 3), tokens * b + rng.randint(0, 2), tokens * c + tokens // 2,
                   tokens * c + tokens // 2 + 1})
    return [0] + [hi - lo for lo, hi in zip([0, *cuts], [*cuts, S])] + [0]


def launched_item_choice(call):
    """Whether the streaming kernel call() launches is the item-choice instance: kItemChoice is the
    kernel template's last argument."""
    name = launched_bwd_kernel(call)
    last = re.search(r"causal_conv1d_bwd_kernel<.*,\s*(true|false)\s*>\s*\(", name)
    assert last, name
    return last.group(1) == "true"


@pytest.mark.parametrize("mix", ["one", "item_edges"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("S, C, weight_dtype, bias_dtype", ITEM_CHOICE_CASES)
def test_backward_item_choice_is_bitwise_the_per_step_kernel(S, C, weight_dtype, bias_dtype, policy, mix):
    from flashinfer_cake import _plan

    plan = _plan.plan_of(S, C)
    groups, tokens = plan.groups, plan.item_tokens
    seed = variant_seed(S + C, weight_dtype, bias_dtype, policy) + (mix == "one")
    rng = random.Random(seed)
    lengths = [S] if mix == "one" else _item_edge_docs(S, tokens, groups, rng)
    D = len(lengths)
    assert groups >= 16 * D, "the case must take the item-choice kernel"
    cu = make_cu(S, lengths, device=DEV)
    cu_more = torch.cat([cu, torch.full((groups,), S, dtype=I32, device=DEV)])  # num_docs > groups
    x, w, b, dy, init, dfinal = make_inputs(S, C, D + groups, seed=seed, weight_dtype=weight_dtype,
                                            bias_dtype=bias_dtype)
    for given_init, given_dfinal in ((init, None), (None, dfinal), (init, dfinal)):
        few = [None if t is None else t[:D] for t in (given_init, given_dfinal)]
        grads = backward_into(x, w, cu, dy, b, policy, *few)
        per_step = backward_into(x, w, cu_more, dy, b, policy, given_init, given_dfinal)
        assert launched_item_choice(lambda: backward(x, w, cu, dy, b, policy, *few))
        assert not launched_item_choice(lambda: backward(x, w, cu_more, dy, b, policy, given_init, given_dfinal))
        assert all(same_bits(g, h) for g, h in zip(grads[:3], per_step[:3]))
        if given_init is not None:
            assert same_bits(grads[3], per_step[3][:D])
        assert_grads_match_reference(grads, x, w, cu, dy, b, policy, *few)


# ---------------------------------------------------------------------------------------------
# chunks chained through final -> initial states


def cut_points(cu_list, S, rng):
    """Cuts of every kind: inside documents, 1-3 tokens after a start, at an empty document,
    at a boundary, around 1-token and through 2-token documents, and 1-token chunks."""
    D = len(cu_list) - 1
    start = cu_list[:-1]
    length = [cu_list[d + 1] - cu_list[d] for d in range(D)]
    cuts = {rng.randint(1, S - 1) for _ in range(3)}
    for k in (1, 2, 3):
        cuts.add(start[rng.choice([d for d in range(D) if length[d] > k])] + k)
    for n, offsets in ((0, (0,)), (1, (0, 1)), (2, (1,)), (5, (0,))):
        docs = [d for d in range(D) if length[d] == n]
        if docs:
            d = rng.choice(docs)
            cuts.update(start[d] + o for o in offsets)
    c = rng.randint(1, S - 3)
    cuts.update((c, c + 1, c + 2))
    return sorted(c for c in cuts if 0 < c < S)


def chunk_plan(cu_list, S, cuts, rng):
    """[(lo, hi, first doc, last doc)] of each chunk: its documents are those with tokens in
    [lo, hi); a document cut in two is the last of one chunk and the first of the next; empty
    documents at a cut go to either side at random (so chunks start and end with empty ones)."""
    D = len(cu_list) - 1
    firsts, lasts = [0], []
    for c in cuts:
        spanning = [d for d in range(D) if cu_list[d] < c < cu_list[d + 1]]
        if spanning:
            left = right = spanning[0]
        else:  # boundaries i0..i1 all at c: documents i0..i1-1 are empty there
            at = [i for i in range(D + 1) if cu_list[i] == c]
            right = rng.randint(at[0], at[-1])
            left = right - 1
        lasts.append(left)
        firsts.append(right)
    lasts.append(D - 1)
    return list(zip([0, *cuts], [*cuts, S], firsts, lasts))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_chunks_chained_under_autograd_match_the_uncut_run(weight_dtype, bias_dtype, policy):
    """A packed batch cut at random points, run chunk by chunk through cake_causal_conv1d: a
    document continuing from the previous chunk starts from that chunk's final state row, the
    others from their initial states (random for the first chunk's documents, zeros for the
    later ones). y and the final states are the uncut run's bits; dx too, except the 3 rows
    before a cut inside a document (their gradient partly comes back through the BF16 gradient of
    the final states); dinitial_states within BF16 rounding of the FP64 reference; dweight / dbias
    (one leaf per chunk) sum to the uncut run's within FP32 summation order."""
    seed = variant_seed(3000, weight_dtype, bias_dtype, policy)
    rng = random.Random(seed)
    S, C = 1500, (64, 136)[seed % 2]
    cu = make_cu(S, chunky_mix(S, rng), device=DEV)
    cu_list, D = cu.tolist(), cu.numel() - 1
    cuts = cut_points(cu_list, S, rng)
    plan = chunk_plan(cu_list, S, cuts, rng)
    x, w, b, dy, init, _ = make_inputs(S, C, D, seed=seed, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    init[plan[0][3] + 1:] = 0  # documents starting after the first chunk: a fresh start

    xf, wf, bf, i_f = leaves(x, w, b, init)
    y_full, fin_full = cake_causal_conv1d(xf, wf, cu, bf, initial_states=i_f, return_final_states=True,
                                          silu_grad_preactivation=policy)
    y_full.backward(dy)  # the final states get no gradient
    assert_y_matches_reference(y_full.detach(), x, w, cu, b, init)
    assert same_bits(fin_full.detach(), final_states_reference(x, cu, init))
    assert_grads_match_reference(grads_of(xf, wf, bf, i_f), x, w, cu, dy, b, policy, init)

    xc, ic = leaves(x, init)
    ys, finals, params, last_seen = [], [], [], {}
    for k, (lo, hi, first, last) in enumerate(plan):
        rows = []
        for d in range(first, last + 1):
            if cu_list[d] < lo:  # continues: the previous chunk's last document
                assert d == plan[k - 1][3]
                rows.append(finals[-1][d - plan[k - 1][2]])
            else:
                rows.append(ic[d])
            last_seen[d] = (k, d - first)
        chunk_cu = torch.tensor([min(max(cu_list[d] - lo, 0), hi - lo) for d in range(first, last + 2)],
                                dtype=I32, device=DEV)
        wk, bk = leaves(w, b)
        y, fin = cake_causal_conv1d(xc[lo:hi], wk, chunk_cu, bk, initial_states=torch.stack(rows),
                                    return_final_states=True, silu_grad_preactivation=policy)
        assert fin.shape == (last - first + 1, 3, C) and fin.requires_grad
        ys.append(y)
        finals.append(fin)
        params.append((wk, bk))
    torch.cat(ys).backward(dy)

    assert sorted(last_seen) == list(range(D))
    assert same_but_zero_sign(torch.cat(ys).detach(), y_full.detach()), "chained y differs from the uncut run"
    chained_final = torch.stack([finals[k][j] for k, j in (last_seen[d] for d in range(D))]).detach()
    assert same_bits(chained_final, fin_full.detach()), "chained final states differ from the uncut run"

    near = torch.zeros(S, dtype=torch.bool, device=DEV)
    for c in cuts:
        for d in range(D):
            if cu_list[d] < c < cu_list[d + 1]:
                near[max(cu_list[d], c - 3):c] = True
    assert same_but_zero_sign(xc.grad[~near], xf.grad[~near]), "dx differs away from the cuts"
    assert_grads_match_reference((xc.grad, None, None, ic.grad), x, w, cu, dy, b, policy, init,
                                 rows=near, slack=CHAIN_SLACK)

    g_mag = 1.1 * dy.double().abs()
    g_err = _g_error_bound(x, w, cu, dy, b, init, policy)
    mg_dw, me_dw = _transposed(g_mag, x, w, cu, init)[1], _transposed(g_err, x, w, cu, init)[1]
    named = [("dweight", [p[0] for p in params], wf, mg_dw, me_dw)]
    if b is not None:
        named.append(("dbias", [p[1] for p in params], bf, g_mag.sum(0), g_err.sum(0)))
    for what, chunk_leaves, full_leaf, mag, slack in named:
        parts = torch.stack([t.grad.double() for t in chunk_leaves])
        rel = 2.0**-8 if full_leaf.dtype == BF16 else 0.0
        tol = rel * (parts.abs().sum(0) + full_leaf.grad.double().abs()) + 2 * (1e-5 * mag + 1.01 * slack) + 1e-30
        _check_close(f"chained {what}", parts.sum(0), full_leaf.grad.double(), tol)


@pytest.mark.parametrize("weight_dtype, bias_dtype", [(F32, BF16), (BF16, None)],
                         ids=["w_fp32-b_bf16", "w_bf16-b_none"])
def test_raw_forward_chunks_listing_every_document(weight_dtype, bias_dtype):
    """Every chunk lists every document (clamped: most are empty there, at both ends), each
    chunk's final_states_out the next one's initial_states: the uncut y and final states."""
    S, C = 3001, 1024
    rng = random.Random(51)
    cu = make_cu(S, chunky_mix(S, rng), device=DEV)
    D = cu.numel() - 1
    x, w, b, _, init, _ = make_inputs(S, C, D, seed=51, weight_dtype=weight_dtype, bias_dtype=bias_dtype)
    fin_full = poisoned((D, 3, C))
    y_full = fwd(x, w, cu, bias=b, initial_states=init, final_states_out=fin_full)
    cuts = cut_points(cu.tolist(), S, rng)
    states, pieces = init, []
    for lo, hi in zip([0, *cuts], [*cuts, S]):
        fin, out = poisoned((D, 3, C)), poisoned((hi - lo, C))
        fwd(x[lo:hi], w, (cu - lo).clamp(0, hi - lo), bias=b, initial_states=states, final_states_out=fin, out=out)
        pieces.append(out)
        states = fin
    assert same_but_zero_sign(torch.cat(pieces), y_full)
    assert same_bits(states, fin_full)


# ---------------------------------------------------------------------------------------------
# row-strided views


def strided_copy(t, left, right, fill=float("nan")):
    """t ([S, C] or [1, S, C]) copied into columns [left, left + C) of a wider buffer otherwise
    filled with `fill`: (the view, the buffer)."""
    C = t.shape[-1]
    buf = torch.full((*t.shape[:-1], left + C + right), fill, dtype=t.dtype, device=t.device)
    view = buf[..., left:left + C]
    view.copy_(t)
    return view, buf


STRIDE_CASES = [
    # S, C, [1, S, C]?, (left, right) columns around x, out, dy, dx
    pytest.param(1000, 136, False, [(8, 0), (0, 24), (16, 8), (64, 64)], id="S1000-C136"),
    pytest.param(4097, 8, False, [(0, 8), (8, 8), (8, 0), (0, 16)], id="S4097-C8"),
    pytest.param(333, 4096, True, [(0, 64), (128, 0), (8, 56), (64, 0)], id="S333-C4096-3d"),
    pytest.param(2, 64, True, [(8, 8), (0, 8), (16, 0), (8, 24)], id="S2-C64-3d"),
    pytest.param(1, 64, False, [(0, 3), (8, 5), (0, 1), (16, 7)], id="S1-C64-odd-strides-ignored"),
    pytest.param(3001, 32, False, [(8, 16), (0, 8), (32, 0), (8, 8)], id="S3001-C32"),
    pytest.param(3003, 16, False, [(8, 0), (0, 16), (16, 8), (8, 8)], id="S3003-C16"),
    pytest.param(2999, 128, True, [(0, 8), (64, 0), (8, 24), (0, 64)], id="S2999-C128-3d"),
    # groups of 528 tokens, S = 2 mod 64: 16-byte rows (WideVec8) without states and with them (7
    # documents, 585 tokens on average)
    pytest.param(4098, 8192, False, [(0, 256), (8, 8), (64, 0), (16, 56)], id="S4098-C8192"),
    # pitches of whole 256-byte blocks, rows 16, 128 or 240 bytes past one: the stateless backward rotates
    # its channel tiles onto the blocks (bwd_vec_shift) on each full-width route, by 8 (WideVec8's 16-byte
    # rows), 1 (WideVec8, 17 tiles), 30 (Wide; dx votes against x and dy), 16 (WideShort), 2 (WideHalf)
    pytest.param(4098, 8192, False, [(64, 64)] * 4, id="S4098-C8192-rows-128B-off"),
    pytest.param(8192, 4352, False, [(8, 120)] * 4, id="S8192-C4352-rows-16B-off"),
    pytest.param(4098, 8320, False, [(120, 8), (64, 64), (120, 8), (0, 128)], id="S4098-C8320-x-dy-240B-off"),
    pytest.param(3001, 4352, True, [(64, 64)] * 4, id="S3001-C4352-3d-rows-128B-off"),
    pytest.param(2050, 256, True, [(8, 120), (8, 120), (8, 120), (136, 120)], id="S2050-C256-3d-rows-16B-off"),
]


@pytest.mark.parametrize("with_states", [False, True], ids=["no-states", "states"])
@pytest.mark.parametrize("S, C, batch_dim, pads", STRIDE_CASES)
def test_strided_views_bitwise_equal_contiguous(S, C, batch_dim, pads, with_states):
    """x, out, dy and dx as column slices of wider buffers (four different row strides): the
    contiguous calls' bits, and nothing outside the slices written."""
    cu = make_cu(S, [0] + split(S, 5, random.Random(S)) + [0], device=DEV)
    D = cu.numel() - 1
    x, w, b, dy, init, dfinal = make_inputs(S, C, D, seed=S + C, weight_dtype=BF16)
    if batch_dim:
        x, dy = x.unsqueeze(0), dy.unsqueeze(0)
    init, dfinal = (init, dfinal) if with_states else (None, None)
    policy = ("bf16", "fp32")[with_states]
    fin_c = poisoned((D, 3, C)) if with_states else None
    y_c = fwd(x, w, cu, bias=b, initial_states=init, final_states_out=fin_c)
    g_c = backward(x, w, cu, dy, b, policy, init, dfinal)

    (xs, xb), (ys, yb) = strided_copy(x, *pads[0]), strided_copy(poisoned(x.shape), *pads[1])
    (dys, dyb), (dxs, dxb) = strided_copy(dy, *pads[2]), strided_copy(poisoned(x.shape), *pads[3])
    assert S <= 1 or not any(t.is_contiguous() for t in (xs, ys, dys, dxs))
    bufs = [(buf, buf.clone(), left) for buf, (left, _) in zip((xb, yb, dyb, dxb), pads)]
    fin_s = poisoned((D, 3, C)) if with_states else None
    assert fwd(xs, w, cu, bias=b, initial_states=init, final_states_out=fin_s, out=ys) is ys
    assert same_bits(ys, y_c) and same_bits(fin_s, fin_c)
    assert same_bits(fwd(xs, w, cu, bias=b, initial_states=init), y_c)
    got = backward(xs, w, cu, dys, b, policy, init, dfinal, dx=dxs)
    assert got[0] is dxs
    assert all(same_bits(g, want) for g, want in zip(got, g_c)), "strided backward differs"
    assert all(same_bits(g, want) for g, want in zip(backward(xs, w, cu, dys, b, policy, init, dfinal), g_c))
    sync()
    for buf, before, left in bufs:  # the columns around each slice are untouched
        assert same_bits(buf[..., :left], before[..., :left])
        assert same_bits(buf[..., left + C:], before[..., left + C:])


def test_autograd_strided_x_and_strided_incoming_grad():
    """x a column slice of a leaf, y.backward(g) with g a strided view, with states: the
    contiguous run's bits; the leaf's gradient is zero outside the slice."""
    S, C, left, width = 2000, 264, 24, 320
    cu = make_cu(S, [0] + split(S, 17, random.Random(61)) + [0], device=DEV)
    x, w, b, dy, init, dfinal = make_inputs(S, C, cu.numel() - 1, seed=61, bias_dtype=BF16)
    g_view, _ = strided_copy(dy, 8, width - C - 8)
    xbuf = strided_copy(x, left, width - C - left, fill=1.0)[1].requires_grad_()
    wl, bl, il = leaves(w, b, init)
    y, fin = cake_causal_conv1d(xbuf[:, left:left + C], wl, cu, bl, initial_states=il, return_final_states=True)
    torch.autograd.backward([y, fin], [g_view, dfinal])

    xc, wc, bc, ic = leaves(x, w, b, init)
    y2, fin2 = cake_causal_conv1d(xc, wc, cu, bc, initial_states=ic, return_final_states=True)
    torch.autograd.backward([y2, fin2], [dy, dfinal])
    assert same_bits(y.detach(), y2.detach()) and same_bits(fin.detach(), fin2.detach())
    assert same_but_zero_sign(xbuf.grad[:, left:left + C], xc.grad)
    assert not xbuf.grad[:, :left].any() and not xbuf.grad[:, left + C:].any()
    assert all(same_bits(g, h) for g, h in zip(grads_of(wl, bl, il), grads_of(wc, bc, ic)))


def test_mamba2_xbc_slice_of_zxbcdt():
    """xBC = zxbcdt[..., d_inner:d_inner + C] of a [1, S, W] projection: raw forward / backward
    bitwise equal to the contiguous copy's; under autograd with the loss through a cat, so dy
    arrives as a row-strided slice of the cat's gradient."""
    S, d_inner, ngroups, dstate, nheads = 1000, 1024, 2, 64, 16
    C, W = d_inner + 2 * ngroups * dstate, 2 * d_inner + 2 * ngroups * dstate + nheads
    assert C % 8 == 0 and W % 8 == 0
    cu = make_cu(S, chunky_mix(S, random.Random(62)), device=DEV)
    D = cu.numel() - 1
    g = torch.Generator(device=DEV).manual_seed(62)
    zxbcdt = _randn((1, S, W), g)
    _, w, b, dy, init, dfinal = make_inputs(S, C, D, seed=62, weight_dtype=BF16, bias_dtype=F32)
    dy = dy.unsqueeze(0)
    xbc = zxbcdt[..., d_inner:d_inner + C]
    assert xbc.stride() == (S * W, W, 1)
    xc = xbc.contiguous()

    fin_s, fin_c = poisoned((D, 3, C)), poisoned((D, 3, C))
    y_s = fwd(xbc, w, cu, bias=b, initial_states=init, final_states_out=fin_s)
    assert same_bits(y_s, fwd(xc, w, cu, bias=b, initial_states=init, final_states_out=fin_c))
    assert same_bits(fin_s, fin_c)
    got, want = (backward(t, w, cu, dy, b, "bf16", init, dfinal) for t in (xbc, xc))
    assert all(same_bits(u, v) for u, v in zip(got, want))

    r = torch.randn(1, S, d_inner + C, device=DEV, generator=g).to(BF16).float()  # BF16-exact: exact casts
    q = torch.randn(D, 3, C, device=DEV, generator=g).to(BF16).float()
    zl = zxbcdt.clone().requires_grad_()
    wl, bl, il = leaves(w, b, init)
    y, fin = cake_causal_conv1d(zl[..., d_inner:d_inner + C], wl, cu, bl, initial_states=il, return_final_states=True)
    h = torch.cat([zl[..., :d_inner], y], dim=-1)  # z and the conv's output, side by side
    ((h.float() * r).sum() + (fin.float() * q).sum()).backward()

    xl, wc, bc, ic = leaves(xc, w, b, init)
    y2, fin2 = cake_causal_conv1d(xl, wc, cu, bc, initial_states=ic, return_final_states=True)
    torch.autograd.backward([y2, fin2], [r[..., d_inner:].to(BF16).contiguous(), q.to(BF16)])
    assert same_bits(y.detach(), y2.detach()) and same_bits(fin.detach(), fin2.detach())
    assert same_but_zero_sign(zl.grad[..., d_inner:d_inner + C], xl.grad)
    assert not zl.grad[..., d_inner + C:].any()
    assert all(same_bits(u, v) for u, v in zip(grads_of(wl, bl, il), grads_of(wc, bc, ic)))


# ---------------------------------------------------------------------------------------------
# CUDA graphs and torch.compile


def _capture(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: modules loaded, default workspaces made
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def _graph_data(S, C, n_docs, seed):
    cu = make_cu(S, [0] + split(S, n_docs - 2, random.Random(seed)) + [0], device=DEV)
    return (cu, *make_inputs(S, C, n_docs, seed=seed))  # cu, x, w, b, dy, init, dfinal


def test_cuda_graph_raw_calls_with_states_replay_new_data():
    S, C, n_docs, policy = 3000, 264, 29, "bf16"
    cu, x, w, b, dy, init, dfinal = _graph_data(S, C, n_docs, 9)
    outs = (poisoned(x.shape), poisoned(init.shape), poisoned(x.shape), poisoned(w.shape, F32),
            poisoned(b.shape, F32), poisoned(init.shape))

    def step():
        fwd(x, w, cu, bias=b, initial_states=init, final_states_out=outs[1], out=outs[0])
        return backward(x, w, cu, dy, b, policy, init, dfinal, dx=outs[2], dweight=outs[3], dbias=outs[4],
                        dinitial_states=outs[5])

    graph, _ = _capture(step)
    for seed in (10, 11):
        new = _graph_data(S, C, n_docs, seed)
        for t in outs:
            t.fill_(float("nan"))
        for static, value in zip((cu, x, dy, init, dfinal), (new[0], new[1], new[4], new[5], new[6])):
            static.copy_(value)
        graph.replay()
        new_cu, new_x, _, _, new_dy, new_init, new_dfinal = new
        fin = poisoned(init.shape)
        want_y = fwd(new_x, w, new_cu, bias=b, initial_states=new_init, final_states_out=fin)
        want = backward(new_x, w, new_cu, new_dy, b, policy, new_init, new_dfinal)
        sync()
        assert same_bits(outs[0], want_y) and same_bits(outs[1], fin), f"replay {seed}: forward differs from eager"
        assert all(same_bits(o, g) for o, g in zip(outs[2:], want)), f"replay {seed}: backward differs from eager"
    assert_y_matches_reference(outs[0], new_x, w, new_cu, b, new_init)
    assert same_bits(outs[1], final_states_reference(new_x, new_cu, new_init))
    assert_grads_match_reference(outs[2:], new_x, w, new_cu, new_dy, b, policy, new_init, new_dfinal)


def test_cuda_graph_autograd_with_states_replay_new_data():
    """cake_causal_conv1d(initial_states=, return_final_states=True) and its backward captured
    whole, replayed with new x, initial states, gradients and cu_seqlens: eager raw calls' bits."""
    S, C, n_docs, policy = 2048, 136, 21, "fp32"
    cu, x, w, b, dy, init, dfinal = _graph_data(S, C, n_docs, 19)
    params = [t.requires_grad_() for t in (x, w, b, init)]

    def step():
        for t in params:
            t.grad = None
        y, fin = cake_causal_conv1d(x, w, cu, b, initial_states=init, return_final_states=True,
                                    silu_grad_preactivation=policy)
        torch.autograd.backward([y, fin], [dy, dfinal])
        return y, fin

    graph, (y, fin) = _capture(step)
    grads = grads_of(x, w, b, init)
    for seed in (20, 21):
        new_cu, new_x, _, _, new_dy, new_init, new_dfinal = _graph_data(S, C, n_docs, seed)
        with torch.no_grad():
            x.copy_(new_x)
            init.copy_(new_init)
        for static, value in ((dy, new_dy), (dfinal, new_dfinal), (cu, new_cu)):
            static.copy_(value)
        graph.replay()
        w0, b0 = w.detach(), b.detach()
        want_fin = poisoned(init.shape)
        want_y = fwd(new_x, w0, new_cu, bias=b0, initial_states=new_init, final_states_out=want_fin)
        want = backward(new_x, w0, new_cu, new_dy, b0, policy, new_init, new_dfinal)
        sync()
        assert same_bits(y.detach(), want_y) and same_bits(fin.detach(), want_fin), f"replay {seed}: forward"
        assert all(same_bits(g, h) for g, h in zip(grads, want)), f"replay {seed}: gradients differ from eager"


def test_torch_compile_fullgraph_with_states_matches_eager():
    """torch.compile(fullgraph=True) of a loss of y and the final states: the eager bits (dy = 2 y
    and the final states' gradient q are exact in BF16)."""
    S, C = 2000, 264
    cu = make_cu(S, chunky_mix(S, random.Random(81)), device=DEV)
    D = cu.numel() - 1
    x, w, b, _, init, q = make_inputs(S, C, D, seed=81, bias_dtype=BF16)
    q = q.float()

    def f(x, w, cu, b, init, q):
        y, fin = cake_causal_conv1d(x, w, cu, b, initial_states=init, return_final_states=True)
        return (y.float() ** 2).sum() + (fin.float() * q).sum(), y.detach(), fin.detach()

    def run(fn):
        ls = leaves(x, w, b, init)
        loss, y, fin = fn(ls[0], ls[1], cu, ls[2], ls[3], q)
        loss.backward()
        return loss.detach(), y, fin, *grads_of(*ls)

    eager = run(f)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, fullgraph=True)
        for _ in range(2):  # the second call runs the cached graph
            got = run(compiled)
            torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=0)
            what = ("y", "final_states", "dx", "dweight", "dbias", "dinitial_states")
            for name, u, v in zip(what, got[1:], eager[1:]):
                assert same_bits(u, v), f"{name} differs under torch.compile"
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# rejected inputs on the GPU


def names(*args, stride=False):
    """A regex of a message naming every argument in `args` (and saying "stride")."""
    return "(?s)" + "".join(rf"(?=.*\b{w}\b)" for w in args) + ("(?=.*stride)" if stride else "")


def _args(S=600, C=136, seed=3):
    cu = make_cu(S, [0] + split(S, 7, random.Random(seed)) + [0], device=DEV)
    D = cu.numel() - 1
    x, w, b, dy, init, dfinal = make_inputs(S, C, D, seed=seed)
    return dict(x=x, weight=w, cu_seqlens=cu, bias=b, initial_states=init, final_states_out=poisoned((D, 3, C)),
                out=poisoned((S, C)), dy=dy, dfinal_states=dfinal, dx=poisoned((S, C)), dweight=poisoned((C, 4), F32),
                dbias=poisoned((C,), F32), dinitial_states=poisoned((D, 3, C)))


def _call_fwd(a):
    return fwd(a["x"], a["weight"], a["cu_seqlens"], bias=a["bias"], initial_states=a["initial_states"],
               final_states_out=a["final_states_out"], out=a["out"])


def _call_bwd(a):
    return bwd(a["x"], a["weight"], a["cu_seqlens"], a["dy"], bias=a["bias"], initial_states=a["initial_states"],
               dfinal_states=a["dfinal_states"], dx=a["dx"], dweight=a["dweight"], dbias=a["dbias"],
               dinitial_states=a["dinitial_states"])


def _set(name, make):
    def mutate(a):
        a[name] = make(a)

    return mutate


def _states(shape=None, dtype=BF16, device=DEV):
    def make(a):
        D, C = a["cu_seqlens"].numel() - 1, a["x"].shape[-1]
        return torch.randn(shape(D, C) if shape else (D, 3, C), device=device).to(dtype)

    return make


def _noncontiguous_states(a):
    D, C = a["cu_seqlens"].numel() - 1, a["x"].shape[-1]
    return torch.randn(D, C, 3, device=DEV).to(BF16).transpose(1, 2)


def _strided(stride, col_step=1, offset=0, poison=False):
    """An [S, C] view with row stride `stride`, column step `col_step`, `offset` elements into
    its buffer (random, or NaN for an output)."""
    def make(a):
        S, C = a["x"].shape
        n = offset + (S - 1) * stride + (C - 1) * col_step + 1
        buf = torch.full((n,), float("nan"), device=DEV) if poison else torch.randn(n, device=DEV)
        return torch.as_strided(buf.to(BF16), (S, C), (stride, col_step), offset)

    return make


def _alias(name, of):
    """`name`: a [num_docs, 3, C] view of the first bytes of `of`."""
    def make(a):
        t, n = a[name], a[name].numel()
        return a[of].reshape(-1)[:n].view(t.shape)

    return make


def _interleaved(first, second):
    """`first` and `second` the two halves of the rows of one [S, 2C] buffer: disjoint elements,
    overlapping byte spans."""
    def mutate(a):
        S, C = a["x"].shape
        buf = torch.randn(S, 2 * C, device=DEV).to(BF16)
        a[first], a[second] = buf[:, :C], buf[:, C:]

    return mutate


def _bad(arg, make, id, *, named=None, stride=False):
    """A case: `arg` replaced by make(args); the ValueError names `named` (default `arg`)."""
    return pytest.param(names(named or arg, stride=stride), _set(arg, make), id=id)


_C = 136  # _args' C
INIT, FINAL, DINIT, DFINAL = "initial_states", "final_states_out", "dinitial_states", "dfinal_states"
FWD_BAD = [
    _bad(INIT, _states(lambda D, C: (D - 1, 3, C)), "init-docs"),
    _bad(INIT, _states(lambda D, C: (D, 2, C)), "init-rows"),
    _bad(INIT, _states(lambda D, C: (D, 3, C - 8)), "init-C"),
    _bad(INIT, _states(dtype=F32), "init-fp32"),
    _bad(INIT, _states(device="cpu"), "init-cpu"),
    _bad(INIT, _noncontiguous_states, "init-noncontiguous"),
    _bad(FINAL, _states(lambda D, C: (D + 1, 3, C)), "final-docs"),
    _bad(FINAL, _states(dtype=F32), "final-fp32"),
    _bad(FINAL, _states(device="cpu"), "final-cpu"),
    _bad(FINAL, _noncontiguous_states, "final-noncontiguous"),
    _bad(FINAL, _alias(FINAL, "x"), "final-overlaps-x"),
    _bad(FINAL, _alias(FINAL, "out"), "final-overlaps-out"),
    _bad(FINAL, lambda a: a[INIT], "final-is-init"),
    _bad("x", _strided(_C + 4), "x-stride-not-multiple-of-8", stride=True),
    _bad("x", _strided(_C - 8), "x-stride-below-C", stride=True),
    _bad("x", _strided(2 * _C, col_step=2), "x-column-step-2", stride=True),
    _bad("x", _strided(_C + 8, offset=4), "x-strided-misaligned"),
    _bad("out", _strided(_C + 4, poison=True), "out-stride-not-multiple-of-8", stride=True),
    _bad("out", _strided(_C - 8, poison=True), "out-stride-below-C", stride=True),
    pytest.param(names("out"), _interleaved("x", "out"), id="out-interleaved-with-x"),
]
BWD_BAD = [
    _bad(INIT, lambda a: None, "dinit-without-init", named=DINIT),
    _bad(DINIT, _states(lambda D, C: (D - 1, 3, C)), "dinit-docs"),
    _bad(DINIT, _states(dtype=F32), "dinit-fp32"),
    _bad(DINIT, _states(device="cpu"), "dinit-cpu"),
    _bad(DINIT, lambda a: a[INIT], "dinit-is-init"),
    _bad(DINIT, lambda a: a[DFINAL], "dinit-is-dfinal"),
    _bad(DINIT, _alias(DINIT, "dx"), "dinit-overlaps-dx"),
    _bad(DFINAL, _states(lambda D, C: (D, 3, C + 8)), "dfinal-C"),
    _bad(DFINAL, _states(dtype=F32), "dfinal-fp32"),
    _bad(DFINAL, _states(device="cpu"), "dfinal-cpu"),
    _bad(DFINAL, _noncontiguous_states, "dfinal-noncontiguous"),
    _bad(INIT, _states(lambda D, C: (D + 1, 3, C)), "init-docs"),
    _bad("dy", _strided(_C + 4), "dy-stride-not-multiple-of-8", stride=True),
    _bad("dy", _strided(2 * _C, col_step=2), "dy-column-step-2", stride=True),
    _bad("dx", _strided(_C + 12, poison=True), "dx-stride-not-multiple-of-8", stride=True),
    _bad("dx", _strided(_C - 8, poison=True), "dx-stride-below-C", stride=True),
    _bad("dx", _strided(_C + 8, offset=4, poison=True), "dx-strided-misaligned"),
    pytest.param(names("dx"), _interleaved("dy", "dx"), id="dx-interleaved-with-dy"),
]


def _rejected(call, mutate, pattern):
    call(_args())  # a valid call first: the variant is registered with the binding
    a = _args()
    mutate(a)
    before = {k: v.clone() for k, v in a.items() if v is not None}
    with pytest.raises(ValueError, match=pattern):
        call(a)
    sync()
    for k, v in before.items():
        assert same_bits(a[k], v), f"a rejected call wrote {k}"


@pytest.mark.parametrize("pattern, mutate", FWD_BAD)
def test_bad_forward_input_rejected_and_nothing_written(pattern, mutate):
    _rejected(_call_fwd, mutate, pattern)


@pytest.mark.parametrize("pattern, mutate", BWD_BAD)
def test_bad_backward_input_rejected_and_nothing_written(pattern, mutate):
    _rejected(_call_bwd, mutate, pattern)


def test_autograd_bad_initial_states_rejected():
    a = _args()
    with pytest.raises(ValueError, match=names("initial_states")):
        cake_causal_conv1d(a["x"], a["weight"], a["cu_seqlens"], a["bias"], initial_states=a["initial_states"][1:])



# ---------------------------------------------------------------------------------------------
# no documents, trailing padding, corrupt cu_seqlens


def test_no_documents_with_empty_views_of_states():
    """num_docs == 0 with [0, 3, C] views of a larger buffer (non-null addresses): accepted, as
    with empty new tensors; the backward returns an empty dinitial_states."""
    S, C = 300, 136
    x, w, b, dy, h, _ = make_inputs(S, C, 2, seed=901)
    cu = torch.tensor([0], dtype=I32, device=DEV)
    f = poisoned((2, 3, C))
    y = fwd(x, w, cu, bias=b, initial_states=h[:0], final_states_out=f[:0])
    assert same_bits(y, fwd(x, w, cu, bias=b))
    dx, dw, db, dh = bwd(x, w, cu, dy, bias=b, initial_states=h[:0], dfinal_states=h[1:1])
    assert dh.shape == (0, 3, C)
    assert same_bits(dx, bwd(x, w, cu, dy, bias=b)[0])
    hl = h.clone().requires_grad_()
    y, fin = cake_causal_conv1d(x, w, cu, b, initial_states=hl[:0], return_final_states=True)
    y.backward(dy)
    assert fin.shape == (0, 3, C) and hl.grad is not None and not hl.grad.any()


def test_padded_cu_seqlens_many_trailing_empty_documents():
    """cu_seqlens padded to a fixed length with S (as for CUDA graphs): every trailing empty
    document's final state is its initial state and its dinitial_states its dfinal_states."""
    S, C, pad = 2000, 264, 3000
    lengths = split(S, 9, random.Random(7))
    cu = make_cu(S, lengths + [0] * pad)
    n = cu.numel() - 1
    x, w, b, dy, h, dh = make_inputs(S, C, n, seed=902)
    f = poisoned((n, 3, C))
    y = fwd(x, w, cu, bias=b, initial_states=h, final_states_out=f)
    assert_y_matches_reference(y, x, w, cu, b, init=h)
    assert same_bits(f, final_states_reference(x, cu, h))
    assert same_bits(f[-pad:], h[-pad:])
    grads = bwd(x, w, cu, dy, bias=b, initial_states=h, dfinal_states=dh)
    assert same_bits(grads[3][-pad:], dh[-pad:])
    assert_grads_match_reference(grads, x, w, cu, dy, b, init=h, dfinal=dh)


CORRUPT_CU = {
    "descending": lambda S: [0, S, S // 2, S // 4, 1, S],
    "negative": lambda S: [0, -5, 10, -(2**31), S],
    "beyond-S": lambda S: [0, S // 2, S + 100, 2 * S, S + 1],
    "first-nonzero": lambda S: [7, 100, S],
    "start-then-far-end": lambda S: [4, S, 5],
    "garbage": lambda S: [r.randint(-(2**31), 2**31 - 1) for r in [random.Random(S)] for _ in range(64)],
    # more entries than a CTA's threads: the scans search and read them in global memory
    "garbage-300": lambda S: [r.randint(-(2**31), 2**31 - 1) for r in [random.Random(S + 1)] for _ in range(300)],
    "sorted-out-of-range": lambda S: [-9, -1, 2, 2, 40, S - 200, S + 3, S + 3],
}


@pytest.mark.parametrize("S, C", [(3000, 264), (3000, 48), (3000, 16)])  # strip kernel, 32 and 8 lanes; token lanes
@pytest.mark.parametrize("pattern", list(CORRUPT_CU))
def test_corrupt_cu_seqlens_with_states_do_not_fault_and_are_deterministic(pattern, S, C):
    """Any cu_seqlens content with states: no fault, every row of y written (into NaN), and the same
    bits on every run (each state row has at most one writer). Not checked here: which state rows such a
    table leaves unwritten (README: those of documents outside [0, S], which an out-of-order table does not
    define)."""
    cu = torch.tensor(CORRUPT_CU[pattern](S), dtype=I32, device=DEV)
    n = cu.numel() - 1
    x, w, b, dy, h, dh = make_inputs(S, C, n, seed=903)
    runs = []
    for _ in range(2):
        f, dinit = torch.zeros(n, 3, C, dtype=BF16, device=DEV), torch.zeros(n, 3, C, dtype=BF16, device=DEV)
        y = fwd(x, w, cu, bias=b, initial_states=h, final_states_out=f, out=poisoned(x.shape))
        assert torch.isfinite(y).all(), "a row of y was not written"
        grads = bwd(x, w, cu, dy, bias=b, initial_states=h, dfinal_states=dh, dinitial_states=dinit)
        sync()  # raises if a kernel faulted
        runs.append((y, f, *grads))
    for a, c in zip(*runs):
        assert same_bits(a, c)


_MEMCHECK_SCRIPT = """
import torch
from flashinfer_cake import cake_causal_conv1d_train_backward as bwd, cake_causal_conv1d_train_forward as fwd
PATTERNS = {patterns}  # per S
# (4096, 136): the backward's item choice at 1-2 documents; (2049, 4096) the 64-thread CTAs of short
# groups (WideShort), (1111, 4096) their 32-token strips (WideHalf); (8195, 4096) 16-byte rows (groups of
# 576 tokens, the last part-filled; stateful there with the 5 documents of 1600 tokens on average)
for S, C in [(300, 264), (77, 8), (5000, 24), (1111, 4096), (2049, 4096), (4096, 136), (3003, 48), (8195, 4096)]:
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    b = torch.randn(C, device="cuda", dtype=torch.bfloat16)
    for cu in [[0, S], [0, 1, 2, 5, S] + [S] * 300, [0, 2, S // 3, S // 2 + 1, S - 2, S], *PATTERNS[S].values()]:
        n = len(cu) - 1
        h = torch.randn(n, 3, C, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        fwd(x, w, cu, bias=b, initial_states=h, final_states_out=torch.empty_like(h))
        fwd(x, w, cu, final_states_out=torch.empty_like(h))
        bwd(x, w, cu, dy, bias=b, initial_states=h, dfinal_states=h)
        bwd(x, w.bfloat16(), cu, dy, dfinal_states=h)
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_states_memcheck_clean(tmp_path):
    """compute-sanitizer's memcheck sees no out-of-bounds access with states, for every corrupt
    cu_seqlens pattern, trailing empty documents and tails of S and C, in the full-width
    routes' item-choice kernel (4096 x 136: 32 token groups, which 1-2 documents leave to it) and in
    16-byte rows (8195 x 4096 with documents of 512 tokens or more on average)."""
    patterns = {S: {name: [min(max(v, -(2**31)), 2**31 - 1) for v in make(S)] for name, make in CORRUPT_CU.items()}
                for S in (300, 77, 5000, 1111, 2049, 4096, 3003, 8195)}  # each pattern made for the S it runs at
    assert_sanitizer_clean(_MEMCHECK_SCRIPT.replace("{patterns}", repr(patterns)), tmp_path)


_SYNCCHECK_SCRIPT = """
import torch
from flashinfer_cake import cake_causal_conv1d_train_backward as bwd, cake_causal_conv1d_train_forward as fwd
g = torch.Generator().manual_seed(17)
for S, C in [(4097, 64), (4099, 32), (530001, 16), (524305, 8), (3001, 8), (1111, 4096), (2049, 4096)]:
    lengths = torch.randint(1, 200, (S,), generator=g).cumsum(0)
    cu = [0] + [int(v) for v in lengths if v < S] + [S, S]
    n = len(cu) - 1
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    h = torch.randn(n, 3, C, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    fwd(x, w, cu, initial_states=h, final_states_out=torch.empty_like(h))
    bwd(x, w, cu, dy, initial_states=h, dfinal_states=h)
    bwd(x, w, cu, dy, dfinal_states=h)
    bwd(x, w, cu, dy)  # the stateless kernel (at C <= 16 with 512+ token groups: warp-filled)
# the item choice; (8192, 4096) with 3 documents: 16-byte rows with states
for S, C, cu in [(4096, 136, [0, 4096]), (4096, 136, [0, 1000, 4096]), (8192, 4096, [0, 8192]), (8192, 4096, [0, 3000, 3001, 8192])]:
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(C, 4, device="cuda")
    h = torch.randn(len(cu) - 1, 3, C, device="cuda", dtype=torch.bfloat16)
    bwd(x, w, torch.tensor(cu, dtype=torch.int32, device="cuda"), dy, initial_states=h, dfinal_states=h)
torch.cuda.synchronize()
print("sanitizer-script-done")
"""


@needs_sanitizer
def test_states_synccheck_clean(tmp_path):
    """compute-sanitizer's synccheck sees no divergent barrier or warp-synchronous intrinsic with
    states and without, on every lane route (C = 8 .. 64 put 2-16 strips in a warp, whose per-step
    vote must hold with lanes at different steps and strips of different lengths; C = 8 and 16 at
    512+ token groups are warp-filled, with a __syncwarp per step) and a wide one, for documents
    of 1-199 tokens and a trailing empty one; and the full-width routes' item-choice kernel (1-2
    long documents)."""
    assert_sanitizer_clean(_SYNCCHECK_SCRIPT, tmp_path, tool="synccheck")
