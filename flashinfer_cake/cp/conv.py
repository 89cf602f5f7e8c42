"""The conv over a sequence-sharded packed batch: :func:`cake_causal_conv1d_cp` and
:func:`cake_causal_conv1d_cp_multi`, bitwise the single-GPU :func:`cake_causal_conv1d` of the
global batch restricted to this rank's tokens.

Forward, per call: the rows other ranks' fragments need as halo leave in one ``all_to_all``
(asynchronous; each rank receives what its fragments need, sizes fixed by the partition) while
the main kernel computes every local token as if each fragment were a document; then a small
pass recomputes the <= 3 head rows of each fragment that continues its document, with the
received halo. Backward: a small pass computes the FP32 pre-activation gradients g of the head
tokens other ranks need and sends them in one ``all_to_all`` while the main backward kernel runs
(with the halo as the fragments' initial states, so dweight/dbias take every tap of this rank's
tokens); then a small pass rewrites dx of the <= 3 tail rows of each fragment whose document goes
on, summing the received terms in the single-GPU order. Each rank's dweight/dbias is the
fixed-order partial sum of its own tokens' terms; summed over the ranks (the data-parallel
all-reduce does it) it equals the single-GPU gradient within FP32 summation order.

No host synchronization; the collectives are the same on every rank whatever the data; CUDA-graph
capturable (build the context before capturing)."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _checks, jit
from ..cake_causal_conv1d_train import cake_causal_conv1d_train_backward, cake_causal_conv1d_train_forward
from .exchange import exchange_halo, exchange_head_grads, halo_send, halos_of
from .partition import CPContext, capturing, check_call, check_context

__all__ = ["CPRecomputeHandle", "cake_causal_conv1d_cp", "cake_causal_conv1d_cp_multi"]

_FN, _FN_MULTI = "cake_causal_conv1d_cp", "cake_causal_conv1d_cp_multi"
FWD_HEADS, BWD_HEADS, BWD_TAILS = 0, 1, 2  # the passes of causal_conv1d_cp.cuh (causal_conv1d_contract.h)


class CPRecomputeHandle:
    """Lets an activation-checkpointed CP conv recompute its forward without communicating.

    Pass one handle to one checkpointed call site (one layer): a forward outside a backward pass
    exchanges the halo and keeps it in the handle, under the identity of its inputs (their
    addresses and versions) and context; a forward run inside a backward pass (the recomputation
    of ``torch.utils.checkpoint``) takes the halo kept for the same inputs and exchanges nothing,
    so ranks that recompute their layers in different orders cannot deadlock. Several micro-batches
    in flight (pipeline schedules) each find their own. At most ``max_kept`` halos are kept (the
    oldest dropped): use the handle only on checkpointed calls. A recomputation takes its halo
    once: a second backward through the same checkpoint (``retain_graph=True``) raises. Refused
    inside CUDA graph capture (the handle is host state)."""

    def __init__(self, max_kept: int = 64):
        if not isinstance(max_kept, int) or isinstance(max_kept, bool) or max_kept < 1:
            raise ValueError(f"CPRecomputeHandle: max_kept must be an int >= 1, got {max_kept!r}")
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._max_kept = max_kept

    @staticmethod
    def _key(cp, xs) -> tuple:
        return (id(cp), *((x.data_ptr(), x._version, tuple(x.shape)) for x in xs))

    def _keep(self, cp, xs, halos) -> None:
        key = self._key(cp, xs)
        self._kept.pop(key, None)
        self._kept[key] = tuple(halos)
        while len(self._kept) > self._max_kept:
            self._kept.popitem(last=False)

    def _take(self, cp, xs):
        return self._kept.pop(self._key(cp, xs), None)

    def __len__(self) -> int:
        return len(self._kept)

    def __repr__(self) -> str:
        return f"CPRecomputeHandle(holding {len(self._kept)} halo{'s' if len(self._kept) != 1 else ''})"


_modules: dict = {}


def _module(weight: torch.Tensor, bias: torch.Tensor | None, device: int):
    """The kernel module of the call's variant (loaded, building it if needed, on first use)."""
    key = (weight.dtype, None if bias is None else bias.dtype, device)
    module = _modules.get(key)
    if module is None:
        bias_name = "none" if bias is None else _checks.PARAM_DTYPES[bias.dtype]
        module = jit.load(jit.variant_spec(_checks.PARAM_DTYPES[weight.dtype], bias_name, _checks.arch_of(device)))
        _modules[key] = module
    return module


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read taps and bias 16 bytes at a time: a misaligned view is copied (a few KB)."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()


def _run_pass(pass_: int, cp: CPContext, x, weight, bias, halo, *, dy=None, out=None, g_out=0, g_in=0, g_ld=0,
              g_in_rows=0, round_preact=1) -> None:
    """One pass of causal_conv1d_cp.cuh on the current stream (the FP32 exchange rows as
    addresses: column slices of the buffers the tensors of a multi call share)."""
    device = x.device.index
    C = x.shape[-1]
    if (halo.shape != (cp.num_fragments, 3, C) or halo.dtype != torch.bfloat16 or not halo.is_contiguous()
            or halo.device != x.device):  # the passes read num_fragments * 3 rows of C
        raise RuntimeError(f"{_FN}: internal error: a halo of shape {tuple(halo.shape)}, {halo.dtype} on {halo.device} "
                           f"for {cp.num_fragments} fragments of {C} channels on {x.device}")
    module = _module(weight, bias, device)
    weight, bias = _aligned(weight), _aligned(bias)
    fields = {"pass": pass_, "x": x.data_ptr(), "dy": 0 if dy is None else dy.data_ptr(),
              "out": 0 if out is None else out.data_ptr(), "weight": weight.data_ptr(),
              "bias": 0 if bias is None else bias.data_ptr(), "cu_seqlens": cp.cu_seqlens.data_ptr(),
              "halo": halo.data_ptr(), "frag_info": cp.frag_info.data_ptr(), "g_rows": cp.g_rows.data_ptr(),
              "g_out": g_out, "g_in": g_in, "g_import": cp.g_import.data_ptr(), "g_ld": g_ld,
              "g_in_rows": g_in_rows, "S": x.shape[-2], "C": C, "num_frags": cp.num_fragments,
              "num_items": cp.g_rows.numel(), "round_preact": round_preact, "device": device,
              "stream": torch._C._cuda_getCurrentRawStream(device)}  # private (inductor uses it): 0.15 us
    rc = module.causal_conv1d_cp(**fields)
    if rc != 0:
        raise RuntimeError(f"{_FN}: {module.last_error_message()} (CUDA error {rc})")


# The phases of one call, each on the current stream; the collectives go between them (the halo's
# send rows and received buffer: exchange.py). Tests run the phases of several ranks in one
# process, with the exchanged rows built by hand.

def forward_interior(cp: CPContext, xs, weights, biases) -> list[torch.Tensor]:
    """y of every local token, each fragment read as a document (head rows of continuing
    fragments still to fix)."""
    return [cake_causal_conv1d_train_forward(x, w, cp.cu_seqlens, bias=b) for x, w, b in zip(xs, weights, biases)]


def forward_heads(cp: CPContext, ys, xs, weights, biases, halos) -> None:
    """Rewrites y of the head rows of the fragments that continue their documents."""
    if cp.num_tokens == 0:
        return
    for y, x, w, b, h in zip(ys, xs, weights, biases, halos):
        _run_pass(FWD_HEADS, cp, x, w, b, h, out=y)


def grad_send(cp: CPContext, xs, dys, weights, biases, halos, round_preact: int) -> torch.Tensor:
    """The FP32 g of the head tokens this rank sends each rank, every tensor side by side:
    ``[sum(g_send_splits), sum C]``."""
    total = sum(x.shape[-1] for x in xs)
    send = torch.empty(cp.g_rows.numel(), total, dtype=torch.float32, device=xs[0].device)
    if send.shape[0] == 0:  # nothing to send (the pass takes no empty buffer)
        return send
    at = 0
    for x, dy, w, b, h in zip(xs, dys, weights, biases, halos):
        _run_pass(BWD_HEADS, cp, x, w, b, h, dy=dy, g_out=send.data_ptr() + 4 * at, g_ld=total,
                  round_preact=round_preact)
        at += x.shape[-1]
    return send


def backward_interior(cp: CPContext, xs, dys, weights, biases, halos, policy: str):
    """dx (tail rows of continuing fragments still to fix), dweight and dbias of every tensor."""
    grads = []
    for x, dy, w, b, h in zip(xs, dys, weights, biases, halos):
        dx, dw, *rest = cake_causal_conv1d_train_backward(x, w, cp.cu_seqlens, dy, bias=b, initial_states=h,
                                                          silu_grad_preactivation=policy)
        grads.append((dx, dw, rest[0] if b is not None else None))
    return grads


def backward_tails(cp: CPContext, dxs, xs, dys, weights, biases, halos, received_g: torch.Tensor,
                   round_preact: int) -> None:
    """Rewrites dx of the tail rows of the fragments whose documents go on after them."""
    if cp.num_tokens == 0:
        return
    at, total = 0, received_g.shape[1]
    for dx, x, dy, w, b, h in zip(dxs, xs, dys, weights, biases, halos):
        _run_pass(BWD_TAILS, cp, x, w, b, h, dy=dy, out=dx, g_in=received_g.data_ptr() + 4 * at, g_ld=total,
                  g_in_rows=received_g.shape[0], round_preact=round_preact)
        at += x.shape[-1]


def _as_rows(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An incoming gradient as the passes read it: BF16, contiguous, 16-byte aligned, x's shape."""
    if dy.dtype == torch.bfloat16 and dy.is_contiguous() and dy.data_ptr() % 16 == 0:
        return dy
    return torch.empty_like(x, memory_format=torch.contiguous_format).copy_(dy)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _CPConv(torch.autograd.Function):
    """The autograd of one call over n tensors: inputs (cp, handle, policy, n, *xs, *weights,
    *biases)."""

    @staticmethod
    def forward(ctx, cp, handle, policy, n, *tensors):
        xs, weights, biases = list(tensors[:n]), list(tensors[n: 2 * n]), list(tensors[2 * n:])
        halos = None
        if handle is not None and _in_backward():  # checkpoint's recomputation: the kept halo
            halos = handle._take(cp, xs)
            if halos is None:
                raise RuntimeError(f"{_FN}: the recompute_handle holds no halo for these inputs: a forward recomputed "
                                   "in a backward pass takes the halo its first run kept (one handle per checkpointed "
                                   "call site; the first run must happen outside the backward)")
            halos = list(halos)
        work = received = None
        if halos is None:
            work, received = exchange_halo(cp, halo_send(cp, xs), async_op=True)
        ys = forward_interior(cp, xs, weights, biases)  # overlaps the exchange
        if halos is None:
            work.wait()
            halos = halos_of(cp, received, xs)
            if handle is not None:
                handle._keep(cp, xs, halos)
        forward_heads(cp, ys, xs, weights, biases, halos)
        ctx.cp, ctx.policy, ctx.n = cp, policy, n
        ctx.save_for_backward(*xs, *weights, *biases, *halos)
        ctx.set_materialize_grads(True)
        return tuple(ys)

    @staticmethod
    @once_differentiable
    def backward(ctx, *dys):
        n, cp, policy = ctx.n, ctx.cp, ctx.policy
        saved = ctx.saved_tensors
        xs, weights, biases, halos = saved[:n], saved[n: 2 * n], saved[2 * n: 3 * n], saved[3 * n:]
        dys = [_as_rows(dy, x) for dy, x in zip(dys, xs)]
        round_preact = 1 if policy == "bf16" else 0
        work, received = exchange_head_grads(cp, grad_send(cp, xs, dys, weights, biases, halos, round_preact),
                                             async_op=True)
        grads = backward_interior(cp, xs, dys, weights, biases, halos, policy)  # overlaps the exchange
        work.wait()
        dxs = [g[0] for g in grads]
        backward_tails(cp, dxs, xs, dys, weights, biases, halos, received, round_preact)
        return (None, None, None, None, *(dx.view(x.shape) for dx, x in zip(dxs, xs)), *(g[1] for g in grads),
                *(g[2] for g in grads))


def _check_call(fn: str, cp, xs, weights, biases, policy, handle) -> None:
    """Raises the error of the first rule the arguments break."""
    if handle is not None:
        if not isinstance(handle, CPRecomputeHandle):
            raise TypeError(f"{fn}: recompute_handle must be a CPRecomputeHandle or None, got {type(handle).__name__}")
        if capturing():
            raise RuntimeError(f"{fn}: recompute_handle is host state and cannot be used inside CUDA graph capture "
                               "(capture without it: a captured step replays its own exchange)")
    _checks.check_policy(fn, policy)
    if not xs or len(weights) != len(xs) or len(biases) != len(xs):
        raise ValueError(f"{fn}: expected as many weights and biases as inputs (at least one), got {len(xs)} inputs, "
                         f"{len(weights)} weights, {len(biases)} biases")
    single = fn == _FN
    names = [("x_local", "weight", "bias") if single else (f"xs[{i}]", f"weights[{i}]", f"biases[{i}]")
             for i in range(len(xs))]
    for (x, w, b), (xn, wn, bn) in zip(zip(xs, weights, biases), names):  # the CP rules of every tensor first
        _checks.check_types(fn, ((xn, x), (wn, w)), ((bn, b),))
        if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[0] != 1) or x.shape[-2] != cp.num_tokens:
            raise ValueError(f"{fn}: {xn} must be [T, C] or [1, T, C] with this rank's T = {cp.num_tokens} "
                             f"tokens (the context's partition), got shape {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{fn}: {xn} must be contiguous, got strides {x.stride()}")
    for (x, w, b), (xn, wn, bn) in zip(zip(xs, weights, biases), names):
        # the single-GPU rules, which name x, weight and bias: the prefix says which tensors
        _checks.check_forward_args(f"{fn} ({xn} as x)" if single else f"{fn} ({xn} as x, {wn}, {bn})", x, w,
                                   cp.cu_seqlens, b, None, None, None, None, op="backward")
        if x.device != xs[0].device:
            raise ValueError(f"{fn}: every input must be on {xs[0].device}, got {xn} on {x.device}")


def cake_causal_conv1d_cp_multi(xs, weights, ctx: CPContext, biases=None, *, silu_grad_preactivation: str = "bf16",
                                recompute_handle: CPRecomputeHandle | None = None) -> list[torch.Tensor]:
    """:func:`cake_causal_conv1d_cp` of several tensors of the same tokens (the q, k and v of one
    layer; channel counts and parameter dtypes may differ) with one exchange per direction for
    all of them: bitwise the results of separate calls. ``biases``: None, or one bias or None per
    tensor."""
    return _call(_FN_MULTI, xs, weights, ctx, biases, silu_grad_preactivation, recompute_handle)


def _call(fn: str, xs, weights, ctx, biases, policy: str, handle) -> list[torch.Tensor]:
    """Both public calls: their checks under the caller's name (check_call: on a context built
    with verify=True, also the same call on every rank, except in the recomputation through a
    recompute_handle, which exchanges nothing), then the autograd function."""
    xs, weights = list(xs), list(weights)
    biases = [None] * len(xs) if biases is None else list(biases)
    check_context(fn, ctx)
    check_call(fn, ctx, lambda: _check_call(fn, ctx, xs, weights, biases, policy, handle),
               lambda: (f"{len(xs)} tensor(s) of {[x.shape[-1] for x in xs]} channels, x {[str(x.dtype) for x in xs]}, "
                        f"weight {[str(w.dtype) for w in weights]}, bias "
                        f"{[None if b is None else str(b.dtype) for b in biases]}, silu_grad_preactivation {policy!r}"),
               collective=handle is None or not _in_backward())
    return list(_CPConv.apply(ctx, handle, policy, len(xs), *xs, *weights, *biases))


def cake_causal_conv1d_cp(x_local: torch.Tensor, weight: torch.Tensor, ctx: CPContext, bias: torch.Tensor | None = None,
                          *, silu_grad_preactivation: str = "bf16",
                          recompute_handle: CPRecomputeHandle | None = None) -> torch.Tensor:
    """The packed conv + SiLU of this rank's tokens of a context-parallel batch, with autograd.

    ``y_local`` and ``dx_local`` are bitwise those of the single-GPU :func:`cake_causal_conv1d`
    of the global batch restricted to this rank's tokens. ``weight``'s and ``bias``'s gradients
    are this rank's partial sums (the terms of its own tokens, in a fixed order): all-reduce them
    over the CP group (as data parallelism does) for the single-GPU gradient, equal to it within
    FP32 summation order.

    Every rank of ``ctx.group`` must make the same calls in the same order (each call's forward
    and backward is one ``all_to_all`` per direction of sizes fixed by the partition), with
    tensors of the same C and dtypes.

    Args:
        x_local: BF16 ``[T, C]`` or ``[1, T, C]``, contiguous: this rank's tokens in the order of
            its fragments (``ctx.partition.fragments[rank]``).
        weight, bias: as in :func:`cake_causal_conv1d` (FP32 or BF16).
        ctx: this rank's :class:`CPContext` (:func:`build_cp_context`).
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, as in :func:`cake_causal_conv1d`.
        recompute_handle: a :class:`CPRecomputeHandle` for activation checkpointing.

    Returns:
        BF16 ``y_local`` of x_local's shape.
    """
    return _call(_FN, [x_local], [weight], ctx, [bias], silu_grad_preactivation, recompute_handle)[0]
