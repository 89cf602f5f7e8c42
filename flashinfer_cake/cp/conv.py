"""The conv over a sequence-sharded packed batch: :func:`cake_causal_conv1d_cp` and
:func:`cake_causal_conv1d_cp_multi`, bitwise the single-GPU :func:`cake_causal_conv1d` of the
global batch restricted to this rank's tokens.

Forward, per call: the rows other ranks' fragments need as halo leave in one ``all_to_all``
(asynchronous; each rank receives what its fragments need, sizes fixed by the partition) while
the main kernel computes every local token as if each fragment were a document; then a small
pass recomputes the <= 3 head rows of each fragment that continues its document, with the
received halo. Backward: a small pass computes the FP32 pre-activation gradients g of the head
tokens other ranks need and sends them in one ``all_to_all`` while the main backward kernel runs
(with the halo as the initial states of the fragments that continue their documents, so
dweight/dbias take every tap of this rank's tokens; the others run as plain documents); then a
small pass rewrites dx of the <= 3 tail rows of each fragment whose document goes on, summing the
received terms in the single-GPU order. Each rank's dweight/dbias is the
fixed-order partial sum of its own tokens' terms; summed over the CP ranks (the data-parallel
all-reduce, where it spans them; else one over the CP group) it equals the single-GPU gradient
within FP32 summation order.

The forward, the collectives included, is one call of the torch binding (jit/torch_binding.cpp:
cp_autograd_forward), and the backward a C++ autograd node run by the engine without the GIL. The
binding checks the arguments before it exchanges anything; where it declines, the Python rules
here raise the precise error (or the call's kernel modules get registered and it is called
again). The Python keeps the recompute handle's rows.
No host synchronization; the collectives are the same on every rank whatever the data; CUDA-graph
capturable (build the context before capturing)."""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _checks, _dispatch
from .partition import (LOCAL_TOKENS_ORIGIN, CPContext, capturing, check_call, check_context, check_context_device,
                        check_tables)

__all__ = ["CPRecomputeHandle", "cake_causal_conv1d_cp", "cake_causal_conv1d_cp_multi"]

_FN, _FN_MULTI = "cake_causal_conv1d_cp", "cake_causal_conv1d_cp_multi"


class CPRecomputeHandle:
    """Lets an activation-checkpointed CP conv recompute its forward without communicating.

    Pass one handle to one checkpointed call site (one layer): a forward outside a backward pass
    exchanges the halo and keeps it in the handle (the received rows, ``[halo rows + 1, sum C]``
    BF16, from which its halos are gathered) for its context and inputs; a forward run inside a
    backward pass (the recomputation of ``torch.utils.checkpoint``) takes the halo kept for them
    and exchanges nothing, so ranks that recompute their layers in different orders cannot
    deadlock. A recomputation finds its halo by
    - its inputs, when they are the first run's (an input of the checkpointed function: the
      checkpoint keeps it alive; same storage, offset, version and shape), or
    - its context alone, when the first run's inputs have been freed (an ``x_local`` computed
      inside the checkpointed function is made anew by the recomputation): then the context must
      have exactly one such halo kept, so micro-batches in flight at once (pipeline schedules)
      need contexts of their own; two would be ambiguous and raise.
    A context is held weakly: the halos of a context that is gone are dropped. At most
    ``max_kept`` halos are kept (the oldest dropped): use the handle only on checkpointed calls of
    training steps. A forward that gets no backward (an evaluation, a step skipped on a bad loss)
    leaves its halo kept; with a context used again and x_local made inside the checkpointed
    function, that halo makes the next recomputation ambiguous: pass the handle only to forwards
    that run their backward, or call :meth:`clear` after the others. A recomputation takes its
    halo once: a second backward through the same checkpoint (``retain_graph=True``) raises.
    Refused inside CUDA graph capture (the handle is host state)."""

    def __init__(self, max_kept: int = 64):
        if not isinstance(max_kept, int) or isinstance(max_kept, bool) or max_kept < 1:
            raise ValueError(f"CPRecomputeHandle: max_kept must be an int >= 1, got {max_kept!r}")
        self._kept: list[_KeptHalo] = []  # oldest first
        self._max_kept = max_kept
        self._lost = weakref.WeakSet()  # contexts that lost a halo to max_kept (no match by context alone)

    def clear(self) -> None:
        """Drops every kept halo (e.g. after a forward that got no backward)."""
        self._kept.clear()
        self._lost.clear()

    def _live(self) -> list:
        """The kept halos whose contexts still exist (the others dropped)."""
        self._kept = [k for k in self._kept if k.context() is not None]
        return self._kept

    def _keep(self, cp, xs, received: torch.Tensor) -> None:
        """Keeps the call's received exchange rows (its halos are gathered from them), in place of
        a halo kept for the same context and inputs."""
        inputs = [_Input(x) for x in xs]
        self._kept = [k for k in self._live() if k.context() is not cp or k.inputs != inputs]
        self._kept.append(_KeptHalo(weakref.ref(cp), inputs, received))
        for dropped in self._kept[:-self._max_kept]:
            if dropped.context() is not None:
                self._lost.add(dropped.context())
        del self._kept[:-self._max_kept]

    def _take(self, fn: str, cp, xs):
        """The rows kept for a recomputation of ``xs`` on ``cp`` (removed from the handle), None if none."""
        mine = [i for i, k in enumerate(self._live()) if k.context() is cp]
        inputs = [_Input(x) for x in xs]
        same = [i for i in mine if self._kept[i].inputs == inputs]
        freed = [i for i in mine if all(a.freed() and a.shape == b.shape for a, b in zip(self._kept[i].inputs, inputs))
                 and len(self._kept[i].inputs) == len(inputs)]
        if not same and freed and cp in self._lost:
            raise RuntimeError(
                f"{fn}: the recompute_handle dropped a halo of this context to its max_kept={self._max_kept} limit, so "
                "a halo of freed inputs cannot be matched to this recomputation safely: raise max_kept, or pass "
                "x_local into the checkpointed function as an input")
        if not same and len(freed) > 1:
            raise RuntimeError(
                f"{fn}: the recompute_handle holds {len(freed)} halos of this context whose inputs were freed, "
                "so it cannot tell which one this recomputation needs: give each micro-batch in flight a context "
                "of its own (build_cp_context), or pass x_local into the checkpointed function as an input; a "
                "halo left by a forward that got no backward (an evaluation, a skipped step) counts too: pass "
                "the handle only to forwards that run their backward, or call handle.clear() after the others")
        pick = same or freed
        return self._kept.pop(pick[0]).received if pick else None

    def _none_kept(self, fn: str, cp) -> RuntimeError:
        """The error of a recomputation on ``cp`` that _take found no halo for."""
        dropped = (f"; this context lost halos to the handle's max_kept={self._max_kept} limit, so this one may be "
                   "among them: raise max_kept" if cp in self._lost else "")
        return RuntimeError(f"{fn}: the recompute_handle holds no halo for these inputs: a forward recomputed in a "
                            "backward pass takes the halo its first run kept (one handle per checkpointed call site; "
                            f"the first run must happen outside the backward){dropped}")

    def __len__(self) -> int:
        """The halos kept for contexts that still exist."""
        return len(self._live())

    def __repr__(self) -> str:
        return f"CPRecomputeHandle(holding {len(self)} halo{'s' if len(self) != 1 else ''})"


class _Input:
    """A kept call's input: its storage (held weakly), offset, version and shape."""

    __slots__ = ("storage", "data_ptr", "version", "shape")

    def __init__(self, x: torch.Tensor):
        self.storage = StorageWeakRef(x.untyped_storage())
        self.data_ptr, self.version, self.shape = x.data_ptr(), x._version, tuple(x.shape)

    def freed(self) -> bool:
        return self.storage.expired()

    def __eq__(self, other) -> bool:
        # a live storage held weakly is never another's (its weak reference pins the address)
        return (not self.freed() and not other.freed() and self.storage == other.storage
                and (self.data_ptr, self.version, self.shape) == (other.data_ptr, other.version, other.shape))


@dataclasses.dataclass
class _KeptHalo:
    context: weakref.ref
    inputs: list
    received: torch.Tensor


def _native(entry: str, weights, biases, device: int, *args, declined: bool = False):
    """An entry of the torch binding (torch_binding.cpp: cp_autograd_forward, and the phases one by
    one for tests) on the current stream. It declines (None) while a kernel module of the call is
    not registered: this registers them (loading, building them if needed) and calls again
    (``declined``: the caller's own call just declined; register first)."""
    binding = _dispatch.binding
    result = None if binding is None or declined else getattr(binding, entry)(*args)
    if result is None:
        for w, b in zip(weights, biases):
            binding = _dispatch.binding_for(device, w, b)
        result = getattr(binding, entry)(*args)
        if result is None:
            raise _dispatch.declined_error(f"flashinfer_cake.cp ({entry})")
    return result


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _check_handle(fn: str, handle) -> None:
    if handle is not None:
        if not isinstance(handle, CPRecomputeHandle):
            raise TypeError(f"{fn}: recompute_handle must be a CPRecomputeHandle or None, got {type(handle).__name__}")
        if capturing():
            raise RuntimeError(f"{fn}: recompute_handle is host state and cannot be used inside CUDA graph capture "
                               "(capture without it: a captured step replays its own exchange)")


def _check_call(fn: str, cp, xs, weights, biases, policy, handle) -> None:
    """Raises the error of the first rule the arguments break (the handle's, then the ones the
    binding applies natively)."""
    _check_handle(fn, handle)
    _checks.check_policy(fn, policy)
    check_tables(fn, cp)
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
                             f"tokens ({LOCAL_TOKENS_ORIGIN}), got shape {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{fn}: {xn} must be contiguous, got strides {x.stride()}")
        if x.shape[-1] >= _checks.MAX_CP_C:
            raise ValueError(f"{fn}: {xn} must have C below 2^25 channels (the context-parallel passes' range), "
                             f"got C={x.shape[-1]}")
        if not _checks.without_memory(x):  # (a meta or fake x: check_forward_args says where such tensors go)
            check_context_device(fn, xn, x, cp)  # (the single-GPU rules would name ctx.cu_seqlens "cu_seqlens")
    for (x, w, b), (xn, wn, bn) in zip(zip(xs, weights, biases), names):
        # the single-GPU rules, which name x, weight and bias: the prefix says which tensors
        _checks.check_forward_args(f"{fn} ({xn} as x)" if single else f"{fn} ({xn} as x, {wn}, {bn})", x, w,
                                   cp.cu_seqlens, b, None, None, None, None, op="backward")


def cake_causal_conv1d_cp_multi(xs, weights, ctx: CPContext, biases=None, *, silu_grad_preactivation: str = "bf16",
                                recompute_handle: CPRecomputeHandle | None = None) -> list[torch.Tensor]:
    """:func:`cake_causal_conv1d_cp` of several tensors of the same tokens (the q, k and v of one
    layer; channel counts and parameter dtypes may differ) with one exchange per direction for
    all of them: bitwise the results of separate calls. ``biases``: None, or one bias or None per
    tensor."""
    return _call(_FN_MULTI, xs, weights, ctx, biases, silu_grad_preactivation, recompute_handle)


def _call(fn: str, xs, weights, ctx, biases, policy: str, handle) -> list[torch.Tensor]:
    """Both public calls: the forward with its autograd node (the torch binding's
    cp_autograd_forward, which checks the tensors natively), the Python rules raising the precise
    error where it declines, all under the caller's name. On a context built with verify=True the
    Python rules run first, with check_call's test that every rank makes the same call (except in
    the recomputation through a recompute_handle, which exchanges nothing)."""
    for name, seq in (("xs", xs), ("weights", weights), ("biases", biases)):
        if isinstance(seq, torch.Tensor):  # iterated, a tensor's rows would pass for a list of tensors
            raise TypeError(f"{fn}: {name} must be a list of tensors{' or None' if name == 'biases' else ''}, got a "
                            f"tensor of shape {tuple(seq.shape)} (one per input: [{name[:-1]}])")
    xs, weights = tuple(xs), tuple(weights)
    biases = (None,) * len(xs) if biases is None else tuple(biases)
    check_context(fn, ctx)
    recompute = handle is not None and _in_backward()  # checkpoint's recomputation: the kept rows
    check = lambda: _check_call(fn, ctx, xs, weights, biases, policy, handle)  # noqa: E731
    if ctx.verify:
        check_call(fn, ctx, check,
                   lambda: (f"{len(xs)} tensor(s) of {[x.shape[-1] for x in xs]} channels, x "
                            f"{[str(x.dtype) for x in xs]}, weight {[str(w.dtype) for w in weights]}, bias "
                            f"{[None if b is None else str(b.dtype) for b in biases]}, silu_grad_preactivation "
                            f"{policy!r}"),
                   collective=not recompute)
    else:
        _check_handle(fn, handle)
    received = None
    if recompute:  # (once per checkpointed call: the Python rules first, so a bad call keeps its halo)
        check()
        received = handle._take(fn, ctx, xs)
        if received is None:
            raise handle._none_kept(fn, ctx)
    group = (dist.group.WORLD if ctx.group is None else ctx.group) if dist.is_available() else None
    args = (xs, weights, biases, received,
            (ctx.cu_seqlens, ctx.export_rows, ctx.import_rows, ctx.frag_info, ctx.head_frags, ctx.tail_frags,
             ctx.g_rows, ctx.g_import),
            ctx.num_tokens, getattr(group, "group_name", None),
            (ctx.halo_send_splits, ctx.halo_recv_splits, ctx.g_send_splits, ctx.g_recv_splits), policy)
    binding = _dispatch.binding
    result = None if binding is None else binding.cp_autograd_forward(*args)
    if result is None:  # the errors (raised here, before any collective), or a first call
        check()
        if not dist.is_available():
            raise RuntimeError(f"{fn}: needs torch.distributed, which this torch was built without")
        if group is None:
            raise RuntimeError(f"{fn}: the context's group is None and the default process group is not "
                               "initialized (torch.distributed.init_process_group)")
        if not isinstance(args[6], str):
            raise TypeError(f"{fn}: the context's group must be a torch.distributed ProcessGroup, got "
                            f"{type(group).__name__}")
        result = _native("cp_autograd_forward", weights, biases, xs[0].get_device(), *args, declined=True)
    ys, received = result
    if handle is not None and not recompute:
        handle._keep(ctx, xs, received)
    return list(ys)


def cake_causal_conv1d_cp(x_local: torch.Tensor, weight: torch.Tensor, ctx: CPContext, bias: torch.Tensor | None = None,
                          *, silu_grad_preactivation: str = "bf16",
                          recompute_handle: CPRecomputeHandle | None = None) -> torch.Tensor:
    """The packed conv + SiLU of this rank's tokens of a context-parallel batch, with autograd.

    ``y_local`` and ``dx_local`` are bitwise those of the single-GPU :func:`cake_causal_conv1d`
    of the global batch restricted to this rank's tokens. ``weight``'s and ``bias``'s gradients
    are this rank's partial sums (the terms of its own tokens, in a fixed order): their sum over
    the CP group (an all-reduce with SUM; DDP and FSDP average instead, so scale the loss by the
    CP size under them) is the single-GPU gradient within FP32 summation order.

    Every rank of ``ctx.group`` must make the same calls in the same order (each call's forward
    and backward is one ``all_to_all`` per direction of sizes fixed by the partition), with
    tensors of the same C and dtypes and the same ``silu_grad_preactivation``, and run their
    backward (a loss that does not reach y on one rank leaves the others waiting: add
    ``0 * y.sum()`` there). Unchecked by default; a context built with ``verify=True`` checks it
    before each exchange (one gather per call).

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
