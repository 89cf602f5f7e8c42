"""CPU tests of the references' per-document conv states (flashinfer_cake.reference): the
semantics the kernels' states follow (issue 15). All in FP64 on fresh random inputs."""

from __future__ import annotations

import random
import re

import pytest
import torch

from doclengths import make_cu
from flashinfer_cake.reference import (
    causal_conv1d_backward_reference,
    causal_conv1d_final_states_reference,
    causal_conv1d_preactivation_reference,
    causal_conv1d_reference,
)

F64 = torch.float64


def inputs(S, C, num_docs, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, C, generator=g, dtype=F64)
    w = torch.randn(C, 4, generator=g, dtype=F64)
    b = torch.randn(C, generator=g, dtype=F64) if bias else None
    init = torch.randn(num_docs, 3, C, generator=g, dtype=F64)
    return x, w, b, init


def mixes(S, rng):
    """Document mixes with empty, 1-3-token and long documents."""
    lengths = []
    while sum(lengths) < S:
        lengths.append(rng.choice([0, 1, 2, 3, 4, rng.randint(5, 40)]))
    lengths[-1] -= sum(lengths) - S
    return lengths


def test_first_taps_read_the_documents_initial_rows():
    """y of a document's first 3 tokens, written out by hand."""
    C = 8
    x, w, b, init = inputs(5, C, 2, seed=1)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)  # documents of 2 and 3 tokens
    y = causal_conv1d_reference(x, w, cu, b, initial_states=init)
    silu = torch.nn.functional.silu
    h0 = torch.cat([init[0], x[0:2]])  # document 0's history: 3 initial rows, then its tokens
    h1 = torch.cat([init[1], x[2:5]])
    for t, (h, i) in enumerate([(h0, 0), (h0, 1), (h1, 0), (h1, 1), (h1, 2)]):
        want = silu((h[i:i + 4] * w.t()).sum(0) + b)
        assert torch.allclose(y[t], want, rtol=0, atol=1e-12), t


def test_final_states_of_long_short_and_empty_documents():
    C = 8
    x, _, _, init = inputs(6, C, 4, seed=2)
    cu = torch.tensor([0, 4, 4, 5, 6], dtype=torch.int32)  # 4 tokens, empty, 1 token, 1 token
    final = causal_conv1d_final_states_reference(x, cu, init)
    assert torch.equal(final[0], x[1:4])
    assert torch.equal(final[1], init[1])  # empty: its initial rows pass through
    assert torch.equal(final[2], torch.cat([init[2][1:], x[4:5]]))
    without = causal_conv1d_final_states_reference(x, cu)
    assert torch.equal(without[3], torch.cat([torch.zeros(2, C, dtype=F64), x[5:6]]))


@pytest.mark.parametrize("seed", range(6))
def test_chunks_chained_through_final_states_give_the_uncut_result(seed):
    """Cut a packed batch at random points (inside documents, 1-3 tokens after a start, through
    empty and short documents); every chunk lists every document (clamped: the others are empty
    there) and starts from the previous chunk's final states: y and the final states are those of
    the uncut batch, bit for bit."""
    rng = random.Random(seed)
    S, C = 300, 16
    cu = make_cu(S, mixes(S, rng), device="cpu").long()
    num_docs = cu.numel() - 1
    x, w, b, init = inputs(S, C, num_docs, seed=seed)
    starts = [int(cu[d]) for d in range(num_docs)]
    cuts = sorted({rng.randint(1, S - 1) for _ in range(4)} | {min(S - 1, rng.choice(starts) + rng.randint(1, 3))})
    y_full, final_full = causal_conv1d_reference(x, w, cu, b, initial_states=init, return_final_states=True)
    states, pieces = init, []
    for lo, hi in zip([0, *cuts], [*cuts, S]):
        chunk_cu = (cu - lo).clamp(0, hi - lo)
        y, states = causal_conv1d_reference(x[lo:hi], w, chunk_cu, b, initial_states=states, return_final_states=True)
        pieces.append(y)
    assert torch.equal(torch.cat(pieces), y_full)
    assert torch.equal(states, final_full)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_states", [True, False])
def test_backward_with_states_is_autograd_of_the_forward(bias, with_states):
    """fp32 policy: the explicit backward equals autograd of the FP64 forward, the final states'
    gradient included."""
    rng = random.Random(7)
    S, C = 120, 8
    cu = make_cu(S, mixes(S, rng), device="cpu")
    x, w, b, init = inputs(S, C, cu.numel() - 1, seed=7, bias=bias)
    init = init if with_states else None
    leaves = [t.clone().requires_grad_() for t in (x, w, b, init) if t is not None]
    xl, wl = leaves[:2]
    bl = leaves[2] if bias else None
    il = leaves[-1] if with_states else None
    y, final = causal_conv1d_reference(xl, wl, cu, bl, initial_states=il, return_final_states=True)
    g = torch.Generator().manual_seed(8)
    dy, dfinal = torch.randn(y.shape, generator=g, dtype=F64), torch.randn(final.shape, generator=g, dtype=F64)
    want = torch.autograd.grad((y, final), leaves, (dy, dfinal))
    got = causal_conv1d_backward_reference(x, w, cu, dy, b, initial_states=init, dfinal_states=dfinal,
                                           silu_grad_preactivation="fp32")
    got = [t for t in got if t is not None]
    assert len(got) == len(want)
    for name, a, e in zip(("dx", "dweight", "dbias/dinitial", "dinitial"), got, want):
        assert torch.allclose(a, e, rtol=1e-12, atol=1e-12), name


def test_states_of_the_wrong_shape_are_refused():
    x, w, b, init = inputs(10, 8, 2, seed=3)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^causal_conv1d_reference: initial_states must be None or have shape "
                                         r"\[num_docs, 3, C\] = \[2, 3, 8\], got \(1, 3, 8\)$"):
        causal_conv1d_reference(x, w, cu, b, initial_states=init[:1])
    with pytest.raises(ValueError, match="^causal_conv1d_backward_reference: dfinal_states must be None or have shape"):
        causal_conv1d_backward_reference(x, w, cu, x, b, dfinal_states=init.transpose(1, 2))


def extended(cu, t, states):
    """Each document's rows after its 3 state rows: [states[0], t[doc 0], states[1], t[doc 1], ...]."""
    parts = []
    for d in range(cu.numel() - 1):
        parts += [states[d], t[int(cu[d]):int(cu[d + 1])]]
    return torch.cat(parts)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_states_are_the_stateless_conv_of_the_extended_sequence(seed, policy):
    """The identity a kernel may run the states on: with each document's 3 initial rows placed
    before its tokens (documents of n + 3 rows), the stateless conv of that sequence gives y at the
    token rows and the final states as each document's last 3 rows; its stateless backward with
    dy = 0 on the state rows and the final states' gradient added to those last 3 rows gives dx
    at the token rows, dinitial_states at the state rows, and dweight / dbias (empty and 1-2-token
    documents included)."""
    rng = random.Random(100 + seed)
    S, C = 200, 8
    cu = make_cu(S, mixes(S, rng), device="cpu").long()
    num_docs = cu.numel() - 1
    x, w, b, init = inputs(S, C, num_docs, seed=seed)
    g = torch.Generator().manual_seed(200 + seed)
    dy, dfinal = torch.randn(S, C, generator=g, dtype=F64), torch.randn(num_docs, 3, C, generator=g, dtype=F64)
    cu_ext = cu + 3 * torch.arange(num_docs + 1)
    tokens = extended(cu, torch.ones(S, dtype=torch.bool), torch.zeros(num_docs, 3, dtype=torch.bool))
    last3 = torch.stack([cu_ext[1:] - 3 + i for i in range(3)], 1)  # [num_docs, 3]: each document's last 3 rows

    y, final = causal_conv1d_reference(x, w, cu, b, initial_states=init, return_final_states=True)
    x_ext = extended(cu, x, init)
    assert torch.equal(causal_conv1d_reference(x_ext, w, cu_ext, b)[tokens], y)
    assert torch.equal(x_ext[last3], final)

    dx, dw, db, dinit = causal_conv1d_backward_reference(x, w, cu, dy, b, initial_states=init, dfinal_states=dfinal,
                                                         silu_grad_preactivation=policy)
    dy_ext = extended(cu, dy, torch.zeros_like(init))
    dx_ext, dw_ext, db_ext = causal_conv1d_backward_reference(x_ext, w, cu_ext, dy_ext, b,
                                                              silu_grad_preactivation=policy)
    dx_ext[last3] += dfinal
    for name, got, want in (("dx", dx_ext[tokens], dx), ("dinitial_states", dx_ext[~tokens].view(-1, 3, C), dinit),
                            ("dweight", dw_ext, dw), ("dbias", db_ext, db)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), name


_REFERENCES = {
    "causal_conv1d_reference": lambda x, w, cu, b: causal_conv1d_reference(x, w, cu, b),
    "causal_conv1d_preactivation_reference": lambda x, w, cu, b: causal_conv1d_preactivation_reference(x, w, cu, b),
    "causal_conv1d_backward_reference": lambda x, w, cu, b: causal_conv1d_backward_reference(
        x, w, cu, torch.ones_like(x) if isinstance(x, torch.Tensor) else x, b),
}


@pytest.mark.parametrize("fn", sorted(_REFERENCES))
@pytest.mark.parametrize("argname, value, says", [
    ("x", torch.zeros(2, 8, 4), "x must be a [S, C] or [1, S, C] tensor, got (2, 8, 4)"),
    ("weight", torch.zeros(4, 1, 4), "weight must be a [C, 4] = [4, 4] tensor, got (4, 1, 4)"),
    ("cu_seqlens", torch.tensor([0.0, 8.0]), "cu_seqlens must be a 1-D integer tensor [num_docs + 1], got "
                                             "torch.float32 (2,)"),
    ("cu_seqlens", [0, 8], "cu_seqlens must be a 1-D integer tensor [num_docs + 1], got list"),
    ("bias", torch.zeros(1, 4), "bias must be None or a [C] = [4] tensor, got (1, 4)"),
], ids=["batched-x", "conv1d-weight", "float-cu", "list-cu", "broadcast-bias"])
def test_the_references_refuse_what_would_compute_another_op(fn, argname, value, says):
    """A batch flattened into one sequence, a bias broadcast, float offsets: the references compute the library's
    op on its layouts only; anything else is an error naming the function, the argument and what it got."""
    args = {"x": torch.randn(8, 4), "w": torch.randn(4, 4), "cu": torch.tensor([0, 3, 8]), "b": torch.randn(4)}
    args[{"weight": "w", "cu_seqlens": "cu", "bias": "b"}.get(argname, argname)] = value
    with pytest.raises(ValueError, match=f"^{fn}: " + re.escape(says) + "$"):
        _REFERENCES[fn](args["x"], args["w"], args["cu"], args["b"])


def test_the_forward_reference_names_itself_for_bad_states():
    """causal_conv1d_reference checks its states itself: its error names it, not the functions it calls."""
    x, w, cu = torch.randn(8, 4), torch.randn(4, 4), torch.tensor([0, 3, 8])
    for states, got in ((torch.zeros(2, 4, 3), "(2, 4, 3)"), ([[0.0]], "list")):
        with pytest.raises(ValueError, match=re.escape(
                f"causal_conv1d_reference: initial_states must be None or have shape [num_docs, 3, C] = [2, 3, 4], "
                f"got {got}")):
            causal_conv1d_reference(x, w, cu, initial_states=states)
