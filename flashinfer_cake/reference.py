"""Pure-PyTorch reference of the packed causal conv1d + SiLU forward (tests, CLI check)."""

from __future__ import annotations

import torch

__all__ = ["causal_conv1d_reference"]


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
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    w = weight.to(device=x2.device, dtype=dtype)
    S = x2.shape[0]
    # Position of every token inside its document, from the document start of each token.
    cu = cu_seqlens.to(device=x2.device, dtype=torch.long)
    t = torch.arange(S, device=x2.device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    start = cu[doc.clamp(min=0)]
    pos = t - start
    acc = x2 * w[:, 3]
    for back in (1, 2, 3):
        shifted = torch.zeros_like(x2)
        if back < S:
            shifted[back:] = x2[:-back]
        keep = (pos >= back).unsqueeze(1)  # a tap outside the document is skipped, not multiplied by 0
        acc = acc + torch.where(keep, shifted * w[:, 3 - back], torch.zeros((), dtype=dtype, device=x2.device))
    if bias is not None:
        acc = acc + bias.to(device=x2.device, dtype=dtype)
    return torch.nn.functional.silu(acc).reshape(x.shape)
