"""Pure-PyTorch references of the packed causal conv1d + SiLU: the forward, its pre-activation
and the backward (tests, CLI check)."""

from __future__ import annotations

import torch

__all__ = [
    "causal_conv1d_backward_reference",
    "causal_conv1d_preactivation_reference",
    "causal_conv1d_reference",
]

_SILU_GRAD_POLICIES = ("bf16", "fp32")


def _positions(cu_seqlens: torch.Tensor, S: int, device: torch.device) -> torch.Tensor:
    """Position of every token inside its document (int64 ``[S]``), from the last entry of
    ``cu_seqlens`` that is ``<= t`` (negative when there is none: then no tap is valid)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    t = torch.arange(S, device=device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    start = cu[doc.clamp(min=0)]
    return t - start


def _shifted(v: torch.Tensor, back: int) -> torch.Tensor:
    """``out[t] = v[t - back]`` (zero for ``t < back``)."""
    out = torch.zeros_like(v)
    if back < v.shape[0]:
        out[back:] = v[:-back]
    return out


def _preactivation(x2: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, bias, dtype) -> torch.Tensor:
    """``sum_k w[:, k] * x2[t - 3 + k] + bias`` over the taps inside t's document, in ``dtype``."""
    zero = torch.zeros((), dtype=dtype, device=x2.device)
    acc = x2 * w[:, 3]
    for back in (1, 2, 3):
        keep = (pos >= back).unsqueeze(1)  # a tap outside the document is skipped, not multiplied by 0
        acc = acc + torch.where(keep, _shifted(x2, back) * w[:, 3 - back], zero)
    if bias is not None:
        acc = acc + bias.to(device=x2.device, dtype=dtype)
    return acc


def causal_conv1d_preactivation_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The pre-activation ``a = sum_k weight[:, k] * x[t - 3 + k] + bias`` of
    :func:`causal_conv1d_reference` (the value SiLU is applied to), in ``dtype``, x's shape;
    arguments as there. A tap before the first token of the token's document is zero."""
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    w = weight.to(device=x2.device, dtype=dtype)
    pos = _positions(cu_seqlens, x2.shape[0], x2.device)
    return _preactivation(x2, w, pos, bias, dtype).reshape(x.shape)


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of ``cake_causal_conv1d_train_forward`` computed in ``dtype``.

    Args:
        x: ``[S, C]`` or ``[1, S, C]`` packed activations (any float dtype).
        weight: ``[C, 4]`` taps; ``weight[c, 3]`` multiplies token ``t``, ``weight[c, 0]``
            token ``t - 3``.
        cu_seqlens: ``[num_docs + 1]`` integer prefix sums of the document lengths, on any
            device (this function may copy it to the host; it is a reference, not a kernel).
        bias: optional ``[C]`` per-channel bias added after the taps, before SiLU.
        dtype: the precision of the whole computation and of the result.

    Returns:
        ``silu(sum_k weight[:, k] * x[t - 3 + k] + bias)`` in ``dtype``, x's shape, not rounded
        to BF16. A tap before the first token of the token's document is zero.
    """
    a = causal_conv1d_preactivation_reference(x, weight, cu_seqlens, bias, dtype=dtype)
    return torch.nn.functional.silu(a)


def causal_conv1d_backward_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dy: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_grad_preactivation: str = "bf16",
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference of ``cake_causal_conv1d_train_backward`` computed in ``dtype`` (no autograd).

    With ``a`` the pre-activation of :func:`causal_conv1d_reference` and ``a'`` either ``a``
    rounded to BF16 (``"bf16"``: ``a.to(torch.bfloat16).to(dtype)``) or ``a`` itself
    (``"fp32"``), ``g = dy * silu'(a')`` where ``silu'(a) = s * (1 + a * (1 - s))``,
    ``s = sigmoid(a)``, and::

        dx[s]         = sum_k weight[:, k] * g[s + 3 - k]   (the taps token s + 3 - k read)
        dweight[:, k] = sum_t g[t] * x[t - 3 + k]           (the taps inside t's document)
        dbias         = sum_t g[t]

    A tap the forward skips (before the first token of the reading token's document) carries
    no gradient, so nothing crosses a document boundary.

    Args:
        x, weight, cu_seqlens, bias: as in :func:`causal_conv1d_reference`.
        dy: the gradient of ``y``, x's shape (any float dtype).
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, where ``silu'`` is evaluated.
        dtype: the precision of the whole computation and of the results.

    Returns:
        ``(dx, dweight, dbias)`` in ``dtype``, not rounded: dx of x's shape, dweight
        ``[C, 4]``, dbias ``[C]`` or None when ``bias`` is None; on x's device.
    """
    if not isinstance(silu_grad_preactivation, str) or silu_grad_preactivation not in _SILU_GRAD_POLICIES:
        raise ValueError(
            f"silu_grad_preactivation must be one of {list(_SILU_GRAD_POLICIES)}, got {silu_grad_preactivation!r}"
        )
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    C = x.shape[-1]
    x2 = x.reshape(-1, C).to(dtype)
    dy2 = dy.reshape(-1, C).to(device=x2.device, dtype=dtype)
    w = weight.to(device=x2.device, dtype=dtype)
    S = x2.shape[0]
    pos = _positions(cu_seqlens, S, x2.device)

    a = _preactivation(x2, w, pos, bias, dtype)
    if silu_grad_preactivation == "bf16":
        a = a.to(torch.bfloat16).to(dtype)
    s = torch.sigmoid(a)
    g = dy2 * (s * (1 + a * (1 - s)))

    dx = g * w[:, 3]
    dweight = torch.zeros(C, 4, dtype=dtype, device=x2.device)
    dweight[:, 3] = (g * x2).sum(0)
    zero = torch.zeros((), dtype=dtype, device=x2.device)
    for back in (1, 2, 3):
        # Token t reads x[t - back] through tap 3 - back iff its position is >= back.
        g_tap = torch.where((pos >= back).unsqueeze(1), g, zero)
        if back < S:
            dx[:-back] += g_tap[back:] * w[:, 3 - back]
        dweight[:, 3 - back] = (g_tap * _shifted(x2, back)).sum(0)
    dbias = None if bias is None else g.sum(0)
    return dx.reshape(x.shape), dweight, dbias
