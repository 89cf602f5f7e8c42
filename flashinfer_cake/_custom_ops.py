"""The kernels as torch.library custom ops, for torch.compile (opaque to the compiler, with fake
implementations for shape propagation) and compiled autograd: ``torch.ops.flashinfer_cake.
causal_conv1d_fwd`` and ``causal_conv1d_bwd``. Eager calls skip the op dispatcher (10-20 µs of
host time): they call the public functions directly, which is what the ops run too. Registered
when the package is imported."""

from __future__ import annotations

import torch

from .cake_causal_conv1d_train import cake_causal_conv1d_train_backward, cake_causal_conv1d_train_forward


@torch.library.custom_op("flashinfer_cake::causal_conv1d_fwd", mutates_args=(), device_types="cuda")
def causal_conv1d_fwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    return cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)


@causal_conv1d_fwd_op.register_fake
def _(x, weight, cu_seqlens, bias):
    return torch.empty_like(x)


@torch.library.custom_op("flashinfer_cake::causal_conv1d_bwd", mutates_args=(), device_types="cuda")
def causal_conv1d_bwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, dy: torch.Tensor,
                         bias: torch.Tensor | None, silu_grad_preactivation: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, *dbias = backward_of_any_dy(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation)
    # A custom op returns tensors only: no bias -> an empty dbias, turned back into None by the caller.
    return dx, dweight, dbias[0] if dbias else x.new_empty(0)


@causal_conv1d_bwd_op.register_fake
def _(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation):
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(0) if bias is None else torch.empty_like(bias)


def backward_of_any_dy(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation):
    """The backward with an incoming gradient of any dtype and layout, materialized once as a
    BF16 contiguous 16-byte aligned tensor when it is not one (as the binding's autograd node)."""
    if dy.dtype != torch.bfloat16 or not dy.is_contiguous() or dy.is_neg() or dy.data_ptr() & 15:
        dy = torch.empty_like(x).copy_(dy)
    return cake_causal_conv1d_train_backward(x, weight, cu_seqlens, dy, bias=bias,
                                             silu_grad_preactivation=silu_grad_preactivation)
