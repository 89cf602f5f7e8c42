"""The kernels as torch.library custom ops, for torch.compile (opaque to the compiler, with fake
implementations for shape propagation) and compiled autograd: ``torch.ops.flashinfer_cake.
causal_conv1d_fwd`` and ``causal_conv1d_bwd``. Eager calls skip the op dispatcher (10-20 µs of
host time): they call the public functions directly, which is what the ops run too. Registered
when the package is imported."""

from __future__ import annotations

import torch

from ._checks import check_autograd_sizes, check_cuda_device, rows_read_as_they_are, states_read_as_they_are
from .cake_causal_conv1d_train import cake_causal_conv1d_train_backward, cake_causal_conv1d_train_forward


AUTOGRAD = "cake_causal_conv1d"  # the ops are its forward and backward: their errors name it


def empty_states(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """New BF16 [num_docs, 3, C] conv states of x's batch (uninitialized: the forward writes them)."""
    return x.new_empty(cu_seqlens.shape[0] - 1, 3, x.shape[-1])


@torch.library.custom_op("flashinfer_cake::causal_conv1d_fwd", mutates_args=(), device_types="cuda")
def causal_conv1d_fwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, bias: torch.Tensor | None,
                         initial_states: torch.Tensor | None, return_final_states: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    # A custom op returns tensors only: no final states -> an empty tensor, dropped by the caller.
    final_states = empty_states(x, cu_seqlens) if return_final_states else x.new_empty(0)
    y = cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias, initial_states=initial_states,
                                         final_states_out=final_states if return_final_states else None)
    return y, final_states


@causal_conv1d_fwd_op.register_fake
def _(x, weight, cu_seqlens, bias, initial_states, return_final_states):
    # cake_causal_conv1d's size rules while torch.compile traces: dynamo quotes a failed rule's
    # message whole from here (from traced code, torch 2.11 shows it in pieces when sizes are symbolic)
    check_autograd_sizes(AUTOGRAD, x, weight, cu_seqlens, bias, initial_states)
    y = x.new_empty(x.shape)  # contiguous, whatever x's row stride
    return y, empty_states(x, cu_seqlens) if return_final_states else x.new_empty(0)


@torch.library.custom_op("flashinfer_cake::causal_conv1d_bwd", mutates_args=(), device_types="cuda")
def causal_conv1d_bwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, dy: torch.Tensor,
                         bias: torch.Tensor | None, initial_states: torch.Tensor | None,
                         dfinal_states: torch.Tensor | None, silu_grad_preactivation: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, *rest = backward_of_any_grads(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states,
                                               silu_grad_preactivation)
    # No bias / no initial states -> empty tensors, turned back into None by the caller.
    dbias = rest.pop(0) if bias is not None else x.new_empty(0)
    dinit = rest.pop(0) if initial_states is not None else x.new_empty(0)
    return dx, dweight, dbias, dinit


@causal_conv1d_bwd_op.register_fake
def _(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation):
    return (x.new_empty(x.shape), torch.empty_like(weight), x.new_empty(0) if bias is None else torch.empty_like(bias),
            x.new_empty(0) if initial_states is None else torch.empty_like(initial_states))


@causal_conv1d_fwd_op.register_kernel("cpu")
@causal_conv1d_bwd_op.register_kernel("cpu")
def _cpu_kernel(x, *_):
    # A compiled graph run on CPU tensors (tracing takes them as fakes) reaches the ops' CPU key:
    # the eager call's error, not the dispatcher's "Could not run ... with arguments from the 'CPU'
    # backend" (the ops' kernels are CUDA only).
    check_cuda_device(AUTOGRAD, x)  # raises: x is on the CPU here
    raise AssertionError(f"{AUTOGRAD}: the CPU kernel ran with x on {x.device}")


def backward_of_any_grads(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation):
    """The backward with incoming gradients of any dtype and layout: ``dy`` passed through when
    the kernel reads it as it is (BF16 rows, contiguous or row-strided, 16-byte aligned), else
    materialized once as a contiguous BF16 tensor (as the binding's autograd node does); the
    final states' gradient likewise (contiguous)."""
    # (a dy of another shape is not broadcast by a copy: it goes on to the backward's error)
    if dy.shape == x.shape and not rows_read_as_they_are(dy, x, "backward"):
        dy = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(dy)
    if dfinal_states is not None and not states_read_as_they_are(dfinal_states):
        dfinal_states = torch.empty(dfinal_states.shape, dtype=torch.bfloat16, device=dfinal_states.device
                                    ).copy_(dfinal_states)
    return cake_causal_conv1d_train_backward(x, weight, cu_seqlens, dy, bias=bias, initial_states=initial_states,
                                             dfinal_states=dfinal_states,
                                             silu_grad_preactivation=silu_grad_preactivation)
