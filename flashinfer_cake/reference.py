"""Pure-PyTorch references of the packed causal conv1d + SiLU: the forward, its pre-activation,
the documents' final conv states and the backward (tests, benchmarks, CLI check).

Per-document conv states: ``initial_states`` ``[num_docs, 3, C]`` holds each document's history
(row 2 the token right before its first token, row 0 three before): a tap before a document's
first token reads it instead of nothing. The final state of a document is the last 3 rows of its
history after its tokens (its initial rows, or zeros without them, followed by its tokens), so a
sequence cut into chunks, each chunk's final states fed as the next chunk's initial states, gives
the y of the uncut sequence."""

from __future__ import annotations

import torch

from ._checks import check_policy

__all__ = [
    "causal_conv1d_backward_reference",
    "causal_conv1d_final_states_reference",
    "causal_conv1d_preactivation_reference",
    "causal_conv1d_reference",
]

def _documents(cu_seqlens: torch.Tensor, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc, pos) of every token (int64 ``[S]`` each): the index of the last entry of
    ``cu_seqlens`` that is ``<= t`` (-1 when there is none) and the position ``t - cu[doc]``
    (negative when there is none: then the token has no history at all)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    t = torch.arange(S, device=device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    return doc, t - cu[doc.clamp(min=0)]


def _shifted(v: torch.Tensor, back: int) -> torch.Tensor:
    """``out[t] = v[t - back]`` (zero for ``t < back``)."""
    out = torch.zeros_like(v)
    if back < v.shape[0]:
        out[back:] = v[:-back]
    return out


def _state_taps(doc: torch.Tensor, pos: torch.Tensor, num_docs: int, back: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For tap ``back`` (1-3 tokens back): which tokens read their document's initial state
    (those less than ``back`` tokens into a document 0 <= doc < num_docs; bool ``[S]``) and
    which row ``3 - back + pos`` they read (clamped where they read none)."""
    reads = (pos >= 0) & (pos < back) & (doc >= 0) & (doc < num_docs)
    return reads, (3 - back + pos).clamp(0, 2)


def _preactivation(x2, w, doc, pos, bias, init, dtype) -> torch.Tensor:
    """``sum_k w[:, k] * (what tap k reads) + bias`` in ``dtype``: x inside t's document, the
    document's initial state before its first token when ``init`` is given, else nothing."""
    zero = torch.zeros((), dtype=dtype, device=x2.device)
    acc = x2 * w[:, 3]
    for back in (1, 2, 3):
        keep = (pos >= back).unsqueeze(1)  # a tap outside the document is skipped, not multiplied by 0
        acc = acc + torch.where(keep, _shifted(x2, back) * w[:, 3 - back], zero)
        if init is not None:
            reads, row = _state_taps(doc, pos, init.shape[0], back)
            state = init[doc.clamp(0, max(init.shape[0] - 1, 0)), row] if init.shape[0] else torch.zeros_like(x2)
            acc = acc + torch.where(reads.unsqueeze(1), state * w[:, 3 - back], zero)
    if bias is not None:
        acc = acc + bias.to(device=x2.device, dtype=dtype)
    return acc


def _final_rows(cu_seqlens: torch.Tensor, S: int, device: torch.device):
    """For every document d and row r of its final state: the token it is (``end - 3 + r``) when
    the document has at least ``3 - r`` tokens, else the row ``L + r`` of its initial state (L its
    token count). Returns (from_token bool ``[num_docs, 3]``, token index, initial-state row), the
    indices clamped where unused. A document's tokens are [cu[d], cu[d + 1]) clamped to [0, S]
    (none when out of order)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long).clamp(0, S)
    start, end = cu[:-1], torch.maximum(cu[1:], cu[:-1])
    length = (end - start).unsqueeze(1)
    r = torch.arange(3, device=device)
    from_token = length + r >= 3
    return from_token, (end.unsqueeze(1) - 3 + r).clamp(0, max(S - 1, 0)), (length + r).clamp(max=2)


def _check_inputs(fn: str, x, weight=None, cu_seqlens=None, bias=None) -> None:
    """The library's layouts (those given): a reference that flattened a batch [B, S, C] or broadcast a bias [1, C]
    would compute another op, silently."""
    if not isinstance(x, torch.Tensor) or not (x.dim() == 2 or (x.dim() == 3 and x.shape[0] == 1)):
        raise ValueError(f"{fn}: x must be a [S, C] or [1, S, C] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    C = x.shape[-1]
    if weight is not None and (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (C, 4)):
        raise ValueError(f"{fn}: weight must be a [C, 4] = [{C}, 4] tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if cu_seqlens is not None and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1
                                   or not cu_seqlens.numel() or cu_seqlens.is_floating_point()
                                   or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool):
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D integer tensor [num_docs + 1], got "
                         + (f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                            else type(cu_seqlens).__name__))
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (C,)):
        raise ValueError(f"{fn}: bias must be None or a [C] = [{C}] tensor, got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")


def _check_states(fn: str, name: str, states, num_docs: int, C: int) -> None:
    if states is not None and (not isinstance(states, torch.Tensor) or tuple(states.shape) != (num_docs, 3, C)):
        raise ValueError(f"{fn}: {name} must be None or have shape [num_docs, 3, C] = [{num_docs}, 3, {C}], got "
                         f"{tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__}")


def causal_conv1d_preactivation_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_states: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The pre-activation ``a = sum_k weight[:, k] * x[t - 3 + k] + bias`` of
    :func:`causal_conv1d_reference` (the value SiLU is applied to), in ``dtype``, x's shape;
    arguments as there. A tap before the first token of the token's document reads the
    document's initial state when given, else nothing."""
    fn = "causal_conv1d_preactivation_reference"
    _check_inputs(fn, x, weight, cu_seqlens, bias)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    w = weight.to(device=x2.device, dtype=dtype)
    doc, pos = _documents(cu_seqlens, x2.shape[0], x2.device)
    _check_states(fn, "initial_states", initial_states, cu_seqlens.shape[0] - 1, x2.shape[1])
    init = None if initial_states is None else initial_states.to(device=x2.device, dtype=dtype)
    return _preactivation(x2, w, doc, pos, bias, init, dtype).reshape(x.shape)


def causal_conv1d_final_states_reference(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``[num_docs, 3, C]``: the last 3 rows of each document's history after its tokens (its
    last 3 tokens; for a shorter or empty document, the tail of its initial rows, zeros without
    them, followed by its tokens), in ``dtype``. Fed as the next chunk's ``initial_states``, the
    document continues as if uncut."""
    fn = "causal_conv1d_final_states_reference"
    _check_inputs(fn, x, cu_seqlens=cu_seqlens)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    S, C = x2.shape
    num_docs = cu_seqlens.shape[0] - 1
    _check_states(fn, "initial_states", initial_states, num_docs, C)
    from_token, token, row = _final_rows(cu_seqlens, S, x2.device)
    init = torch.zeros(num_docs, 3, C, dtype=dtype, device=x2.device) if initial_states is None else \
        initial_states.to(device=x2.device, dtype=dtype)
    tokens = x2[token] if S else torch.zeros(num_docs, 3, C, dtype=dtype, device=x2.device)
    states = init[torch.arange(num_docs, device=x2.device).unsqueeze(1), row]
    return torch.where(from_token.unsqueeze(2), tokens, states)


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``cake_causal_conv1d_train_forward`` computed in ``dtype``.

    Args:
        x: ``[S, C]`` or ``[1, S, C]`` packed activations (any float dtype).
        weight: ``[C, 4]`` taps; ``weight[c, 3]`` multiplies token ``t``, ``weight[c, 0]``
            token ``t - 3``.
        cu_seqlens: ``[num_docs + 1]`` integer prefix sums of the document lengths, on any
            device (this function may copy it to the host; it is a reference, not a kernel).
        bias: optional ``[C]`` per-channel bias added after the taps, before SiLU.
        initial_states: optional ``[num_docs, 3, C]`` history of each document (row 2 the token
            right before its first token): what a tap before the first token reads. Tokens
            before ``cu_seqlens[0]`` or from ``cu_seqlens[-1]`` on belong to no document and
            read no state.
        return_final_states: also return :func:`causal_conv1d_final_states_reference`.
        dtype: the precision of the whole computation and of the result.

    Returns:
        ``silu(sum_k weight[:, k] * x[t - 3 + k] + bias)`` in ``dtype``, x's shape, not rounded
        to BF16, with the taps before a document's first token reading its initial state (none
        without them); and the final states ``[num_docs, 3, C]`` when asked for.
    """
    fn = "causal_conv1d_reference"  # (its rules here, so that its errors name it, not the functions it calls)
    _check_inputs(fn, x, weight, cu_seqlens, bias)
    _check_states(fn, "initial_states", initial_states, cu_seqlens.shape[0] - 1, x.shape[-1])
    a = causal_conv1d_preactivation_reference(x, weight, cu_seqlens, bias, initial_states=initial_states, dtype=dtype)
    y = torch.nn.functional.silu(a)
    if not return_final_states:
        return y
    return y, causal_conv1d_final_states_reference(x, cu_seqlens, initial_states, dtype=dtype)


def causal_conv1d_backward_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dy: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_states: torch.Tensor | None = None,
    dfinal_states: torch.Tensor | None = None,
    silu_grad_preactivation: str = "bf16",
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor | None, ...]:
    """Reference of ``cake_causal_conv1d_train_backward`` computed in ``dtype`` (no autograd).

    With ``a`` the pre-activation of :func:`causal_conv1d_reference` and ``a'`` either ``a``
    rounded to BF16 (``"bf16"``: ``a.to(torch.bfloat16).to(dtype)``) or ``a`` itself
    (``"fp32"``), ``g = dy * silu'(a')`` where ``silu'(a) = s * (1 + a * (1 - s))``,
    ``s = sigmoid(a)``, and::

        dx[s]         = sum_k weight[:, k] * g[s + 3 - k]   (the taps token s + 3 - k read)
        dweight[:, k] = sum_t g[t] * (what tap k of t read)
        dbias         = sum_t g[t]
        dinitial_states[d, r] = sum of weight[:, k] * g[t] over the taps that read row r of
                                document d's initial state

    plus ``dfinal_states`` (the gradient of the final states, ``[num_docs, 3, C]``) added to the
    dx rows or initial-state rows the final states came from. A tap the forward skips carries no
    gradient, so nothing crosses a document boundary.

    Args:
        x, weight, cu_seqlens, bias, initial_states: as in :func:`causal_conv1d_reference`.
        dy: the gradient of ``y``, x's shape (any float dtype).
        dfinal_states: optional gradient of the final states.
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, where ``silu'`` is evaluated.
        dtype: the precision of the whole computation and of the results.

    Returns:
        ``(dx, dweight, dbias)`` in ``dtype``, not rounded: dx of x's shape, dweight ``[C, 4]``,
        dbias ``[C]`` or None when ``bias`` is None; then ``dinitial_states`` ``[num_docs, 3, C]``
        when ``initial_states`` is given. On x's device. (dbias keeps its slot: the kernels'
        backward leaves it out when ``bias`` is None, so its ``dinitial_states`` comes third.)
    """
    fn = "causal_conv1d_backward_reference"
    check_policy(fn, silu_grad_preactivation)
    _check_inputs(fn, x, weight, cu_seqlens, bias)
    if not isinstance(dy, torch.Tensor) or dy.shape != x.shape:
        raise ValueError(f"{fn}: dy must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(dy.shape) if isinstance(dy, torch.Tensor) else type(dy).__name__}")
    C = x.shape[-1]
    x2 = x.reshape(-1, C).to(dtype)
    dy2 = dy.reshape(-1, C).to(device=x2.device, dtype=dtype)
    w = weight.to(device=x2.device, dtype=dtype)
    S, num_docs = x2.shape[0], cu_seqlens.shape[0] - 1
    _check_states(fn, "initial_states", initial_states, num_docs, C)
    _check_states(fn, "dfinal_states", dfinal_states, num_docs, C)
    init = None if initial_states is None else initial_states.to(device=x2.device, dtype=dtype)
    doc, pos = _documents(cu_seqlens, S, x2.device)

    a = _preactivation(x2, w, doc, pos, bias, init, dtype)
    if silu_grad_preactivation == "bf16":
        a = a.to(torch.bfloat16).to(dtype)
    s = torch.sigmoid(a)
    g = dy2 * (s * (1 + a * (1 - s)))

    dx = g * w[:, 3]
    dweight = torch.zeros(C, 4, dtype=dtype, device=x2.device)
    dweight[:, 3] = (g * x2).sum(0)
    dinit = None if init is None else torch.zeros_like(init)
    zero = torch.zeros((), dtype=dtype, device=x2.device)
    for back in (1, 2, 3):
        # Token t reads x[t - back] through tap 3 - back iff its position is >= back.
        g_tap = torch.where((pos >= back).unsqueeze(1), g, zero)
        if back < S:
            dx[:-back] += g_tap[back:] * w[:, 3 - back]
        dweight[:, 3 - back] = (g_tap * _shifted(x2, back)).sum(0)
        if init is not None:  # ... and its document's initial state before its first token
            reads, row = _state_taps(doc, pos, num_docs, back)
            t = reads.nonzero().squeeze(1)
            dinit.index_put_((doc[t], row[t]), g[t] * w[:, 3 - back], accumulate=True)
            dweight[:, 3 - back] += (g[t] * init[doc[t], row[t]]).sum(0)
    if dfinal_states is not None:  # each final row came from a token or an initial-state row
        dfinal = dfinal_states.to(device=x2.device, dtype=dtype)
        from_token, token, row = _final_rows(cu_seqlens, S, x2.device)
        d, r = from_token.nonzero(as_tuple=True)
        dx.index_put_((token[d, r],), dfinal[d, r], accumulate=True)
        if dinit is not None:
            d, r = (~from_token).nonzero(as_tuple=True)
            dinit.index_put_((d, row[d, r]), dfinal[d, r], accumulate=True)
    dbias = None if bias is None else g.sum(0)
    grads = (dx.reshape(x.shape), dweight, dbias)
    return grads if dinit is None else (*grads, dinit)
