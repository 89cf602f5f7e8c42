"""The training entry point :func:`cake_causal_conv1d` (autograd), eager and under torch.compile."""

from __future__ import annotations

import torch

from . import _checks, _dispatch
from ._custom_ops import backward_of_any_dy
from .cake_causal_conv1d_train import cake_causal_conv1d_train_forward

__all__ = ["CakeCausalConv1dFunction", "cake_causal_conv1d"]

_AUTOGRAD = "cake_causal_conv1d"


class CakeCausalConv1dFunction(torch.autograd.Function):
    """Autograd of :func:`cake_causal_conv1d` under torch.compile: saves x, weight, bias and
    cu_seqlens only (the backward recomputes the pre-activation); gradients come back in the
    inputs' dtypes. Eager calls of :func:`cake_causal_conv1d` use the torch binding's C++ node,
    which does the same for less host time; ``CakeCausalConv1dFunction.apply(x, weight,
    cu_seqlens, bias, silu_grad_preactivation)`` works eagerly too, with identical results."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, bias, silu_grad_preactivation):
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.silu_grad_preactivation = silu_grad_preactivation
        if torch.compiler.is_compiling():
            return torch.ops.flashinfer_cake.causal_conv1d_fwd(x, weight, cu_seqlens, bias)
        return cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is not itself differentiable
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        policy = ctx.silu_grad_preactivation
        if torch.compiler.is_compiling():
            dx, dweight, dbias = torch.ops.flashinfer_cake.causal_conv1d_bwd(x, weight, cu_seqlens, dy, bias, policy)
            dbias = None if bias is None else dbias
        else:
            dx, dweight, *rest = backward_of_any_dy(x, weight, cu_seqlens, dy, bias, policy)
            dbias = rest[0] if rest else None
        return dx, dweight, None, dbias, None


def cake_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_grad_preactivation: str = "bf16",
) -> torch.Tensor:
    """Packed width-4 causal conv1d + SiLU with autograd: the training entry point.

    ``y = cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)``; ``y.backward``
    runs :func:`cake_causal_conv1d_train_backward` (x, weight and bias get gradients in their own
    dtypes; cu_seqlens none). Only x, weight, bias and cu_seqlens are saved for the backward; an
    incoming gradient that is not BF16, contiguous and 16-byte aligned is copied once into one
    that is; the backward is not itself differentiable (``create_graph=True`` gives gradients
    whose own backward raises). Eager calls record a C++ autograd node of the torch binding;
    under ``torch.compile`` the call is :class:`CakeCausalConv1dFunction` over the custom ops
    ``torch.ops.flashinfer_cake.causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (no graph break,
    ``fullgraph=True`` works), and under ``torch.jit.trace`` that Function too. Both give bitwise
    the same results. ``torch.func`` transforms (grad, vmap) are not supported.

    Args:
        x, weight, cu_seqlens, bias: as in :func:`cake_causal_conv1d_train_forward`.
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, as in
            :func:`cake_causal_conv1d_train_backward`.

    Returns:
        BF16 ``y`` of x's shape.

    Raises:
        As the forward; and a ValueError up front when x is outside the backward's range
        (S < 2^30, S * C < 2^34).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # the binding is opaque to both
        _checks.check_autograd_early(_AUTOGRAD, x, silu_grad_preactivation)
        return CakeCausalConv1dFunction.apply(x, weight, cu_seqlens, bias, silu_grad_preactivation)
    # Eager: the binding's C++ autograd node (a Python autograd.Function costs ~6 us more per call).
    binding = _dispatch.binding
    y = None if binding is None else binding.try_autograd_forward(x, weight, cu_seqlens, bias, silu_grad_preactivation)
    if y is None:  # a bad argument (raised here, before anything is built), or a first call
        device = _checks.check_autograd_args(_AUTOGRAD, x, weight, cu_seqlens, bias, silu_grad_preactivation)
        y = _dispatch.binding_for(device, weight, bias).try_autograd_forward(x, weight, cu_seqlens, bias,
                                                                             silu_grad_preactivation)
        if y is None:
            raise _dispatch.declined_error(_AUTOGRAD)
    return y
