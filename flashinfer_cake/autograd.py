"""The training entry point :func:`cake_causal_conv1d` (autograd), eager and under torch.compile."""

from __future__ import annotations

import functools

import torch

from . import _checks, _dispatch, _dtensor
from ._custom_ops import AUTOGRAD as _AUTOGRAD
from ._custom_ops import backward_of_any_grads, empty_states
from .cake_causal_conv1d_train import cake_causal_conv1d_train_forward

__all__ = ["CakeCausalConv1dFunction", "cake_causal_conv1d"]

_is_compiling, _is_tracing = torch.compiler.is_compiling, torch._C._is_tracing
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _through_custom_ops(*tensors) -> bool:
    """The Function's path through the custom ops: while torch.compile traces, under a
    TorchDispatchMode (selective activation checkpointing's caching, FlopCounterMode, make_fx: the
    mode sees the ops), and for tensors of which one is without memory (_checks.without_memory:
    the ops' dispatch handles it). The binding declines the same calls."""
    return (_is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or any(isinstance(t, torch.Tensor) and _checks.without_memory(t) for t in tensors))


_DOUBLE_BACKWARD = (b"cake_causal_conv1d's backward is not itself differentiable: trying to differentiate twice "
                    b"(create_graph=True, then a backward through its gradients)")


def _not_differentiable(backward):
    """torch's @once_differentiable, but under create_graph=True (grad mode on in the backward)
    the gradients' own backward raises whatever requires grad: torch's marks them only when an
    incoming gradient requires grad, so a gradient penalty through the op would treat them as
    constants, silently. (The binding's C++ node does the same.)"""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not _is_dynamo_compiling() and any(_checks.has_tangent(g) for g in grads):
            # forward-over-reverse (a dual incoming gradient): its tangent would be dropped, silently
            raise NotImplementedError(f"{_AUTOGRAD}: {_checks.FORWARD_AD_UNSUPPORTED}")
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        error = torch._C._functions.DelayedError(_DOUBLE_BACKWARD, len(out))
        return error(*[None if t is None else t.detach().requires_grad_() for t in out])
    return wrapper


class CakeCausalConv1dFunction(torch.autograd.Function):
    """Autograd of :func:`cake_causal_conv1d` under torch.compile: saves x, weight, bias,
    cu_seqlens and the initial states only (the backward recomputes the pre-activation);
    gradients come back in the inputs' dtypes. Eager calls of :func:`cake_causal_conv1d` use the
    torch binding's C++ node, which does the same for less host time; ``CakeCausalConv1dFunction.
    apply(x, weight, cu_seqlens, bias, initial_states, return_final_states,
    silu_grad_preactivation)`` works eagerly too, with identical results."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, bias, initial_states, return_final_states, silu_grad_preactivation):
        """y, or (y, final_states), as :func:`cake_causal_conv1d` returns them."""
        # cake_causal_conv1d's rules whoever calls apply, before anything is made: on the custom ops' path
        # those that need no memory (the op's eager call checks the rest when it runs; while dynamo
        # traces, the size rules run in the op's fake implementation)
        if _through_custom_ops(x, weight, cu_seqlens, bias, initial_states):
            cu_seqlens = _dtensor.replicated_cu_seqlens(x, cu_seqlens)
            _checks.check_autograd_constants(_AUTOGRAD, x, weight, cu_seqlens, bias, initial_states,
                                             return_final_states, silu_grad_preactivation)
            if not _is_dynamo_compiling():
                _checks.check_autograd_sizes(_AUTOGRAD, x, weight, cu_seqlens, bias, initial_states)
            y, final_states = torch.ops.flashinfer_cake.causal_conv1d_fwd(x, weight, cu_seqlens, bias, initial_states,
                                                                          return_final_states)
        else:
            _checks.check_autograd_args(_AUTOGRAD, x, weight, cu_seqlens, bias, initial_states, return_final_states,
                                        silu_grad_preactivation)
            final_states = empty_states(x, cu_seqlens) if return_final_states else None
            y = cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias, initial_states=initial_states,
                                                 final_states_out=final_states)
        ctx.save_for_backward(x, weight, bias, cu_seqlens, initial_states)
        ctx.silu_grad_preactivation = silu_grad_preactivation
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros made)
        return (y, final_states) if return_final_states else y

    @staticmethod
    @_not_differentiable
    def backward(ctx, dy, dfinal_states=None):
        """The gradients of x, weight, bias and initial_states (None for the arguments without one)."""
        x, weight, bias, cu_seqlens, initial_states = ctx.saved_tensors
        policy = ctx.silu_grad_preactivation
        if dy is None:
            dy = torch.zeros_like(x, memory_format=torch.contiguous_format)
        if _through_custom_ops(x, weight, cu_seqlens, bias, initial_states):
            dx, dweight, dbias, dinit = torch.ops.flashinfer_cake.causal_conv1d_bwd(
                x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, policy)
        else:
            dx, dweight, *rest = backward_of_any_grads(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states,
                                                       policy)
            dbias = rest.pop(0) if bias is not None else None
            dinit = rest.pop(0) if initial_states is not None else None
        return (dx, dweight, None, None if bias is None else dbias, None if initial_states is None else dinit, None,
                None)


def cake_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    silu_grad_preactivation: str = "bf16",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed width-4 causal conv1d + SiLU with autograd: the training entry point.

    ``y = cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias,
    initial_states=initial_states)``; ``y.backward`` runs
    :func:`cake_causal_conv1d_train_backward` (x, weight, bias and initial_states get gradients
    in their own dtypes; cu_seqlens none). With ``return_final_states=True`` the documents' final
    states are returned too, and their gradient flows back to the x rows (or initial-state rows)
    they came from: chained chunks train as the unsplit sequence. Only x, weight, bias,
    cu_seqlens and the initial states are saved for the backward; an incoming gradient of y is
    read as it is when it is BF16 rows the backward accepts (contiguous or row-strided, 16-byte
    aligned), else copied once into a contiguous one; the backward is not itself differentiable
    (``create_graph=True`` gives gradients whose own backward raises). Eager calls record a C++
    autograd node of the torch binding; under ``torch.compile`` the call is
    :class:`CakeCausalConv1dFunction` over the custom ops
    ``torch.ops.flashinfer_cake.causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (no graph break,
    ``fullgraph=True`` works), and under ``torch.jit.trace`` that Function too: the node and the
    Function give bitwise the same results. On tensors without memory (meta tensors,
    FakeTensorMode, make_fx) the Function runs the ops' fake implementations (the outputs'
    metadata). ``torch.func`` transforms (grad, vmap, jvp) and forward-mode AD are not supported
    (NotImplementedError).

    Args:
        x, weight, cu_seqlens, bias, initial_states: as in
            :func:`cake_causal_conv1d_train_forward` (x may be a row-strided view).
        return_final_states: also return the final states ``[num_docs, 3, C]``.
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, as in
            :func:`cake_causal_conv1d_train_backward`.

    Returns:
        BF16 ``y`` of x's shape (contiguous), or ``(y, final_states)``.

    Raises:
        TypeError, ValueError, RuntimeError as the forward (but for tensors that require grad,
        which are what this function is for); and a ValueError up front when x is outside the
        backward's range (S < 2^30, S * C < 2^34). NotImplementedError: a tensor of a
        ``torch.func`` transform, or forward-mode AD (a dual input, or a dual incoming gradient in
        the backward).
    """
    # The binding is opaque to both torch.compile and torch.jit.trace. (Under dynamo the first test
    # is the constant True; _is_tracing is the C call under torch.jit.is_tracing: 0.1 us less.)
    if _is_compiling() or _is_tracing():
        return CakeCausalConv1dFunction.apply(x, weight, cu_seqlens, bias, initial_states, return_final_states,
                                              silu_grad_preactivation)
    # Eager: the binding's C++ autograd node (a Python autograd.Function costs ~6 us more per call).
    binding = _dispatch.binding
    y = None if binding is None else binding.try_autograd_forward(x, weight, cu_seqlens, bias, initial_states,
                                                                  return_final_states, silu_grad_preactivation)
    if y is None:  # a bad argument (raised here, before anything is built), a first call, or no memory
        args = (x, weight, cu_seqlens, bias, initial_states, return_final_states, silu_grad_preactivation)
        if _through_custom_ops(x, weight, cu_seqlens, bias, initial_states):  # (declined by the binding)
            named = tuple(zip(("x", "weight", "cu_seqlens", "bias", "initial_states"), args))
            _checks.check_not_transformed(_AUTOGRAD, named)  # (a meta tensor of one: torch's setup_context error)
            _checks.check_not_dual(_AUTOGRAD, named)
            return CakeCausalConv1dFunction.apply(*args)
        device = _checks.check_autograd_args(_AUTOGRAD, *args)
        y = _dispatch.binding_for(device, weight, bias).try_autograd_forward(*args)
        if y is None:
            raise _dispatch.declined_error(_AUTOGRAD)
    return y
