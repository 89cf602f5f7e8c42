"""The halo exchange with autograd, on its own: each local fragment's initial state gathered from
the ranks holding the rows before it, and its gradient returned to them (:func:`halo_exchange`),
for callers that feed the states to other ops; any dtype and backend (gloo included). The conv
(:mod:`.conv`) has an exchange of its own in the torch binding (jit/torch_binding.cpp:
send_phase and the forward heads pass gather the same rows through the same tables, export_rows
then import_rows, but only for the fragments that continue their documents, the rows the conv's
passes read), overlapped with its kernels and exact in the backward."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import _checks
from .partition import LOCAL_TOKENS_ORIGIN, CPContext, check_call, check_context, check_context_device

try:  # the process group's own collective call (see exchange_rows)
    from torch._C._distributed_c10d import AllToAllOptions as _AllToAllOptions
except ImportError:  # a torch without distributed support
    _AllToAllOptions = None

__all__ = ["halo_exchange", "halo_exchange_multi"]


@functools.cache
def _options_take_async() -> bool:
    return _AllToAllOptions is not None and hasattr(_AllToAllOptions(), "asyncOp")


def exchange_rows(out: torch.Tensor, send: torch.Tensor, out_splits, send_splits, group) -> None:
    """One all_to_all of rows, waited for (the current stream is ordered after it): ``send``'s
    rows, ``send_splits[t]`` for rank t in rank order, into ``out``, ``out_splits[s]`` from rank s
    (a pair may have none). The process group's own call where it has one (the public wrapper's
    checks cost ~130 µs of host time per call, NOTES_cp.md)."""
    pg = dist.group.WORLD if group is None else group
    call = getattr(pg, "all_to_all_single", None) or getattr(pg, "alltoall_base", None)  # torch 2.13 / 2.11
    if call is None or not _options_take_async():
        dist.all_to_all_single(out, send, list(out_splits), list(send_splits), group=group)
        return
    opts = _AllToAllOptions()
    opts.asyncOp = False
    work = call(out, send, list(out_splits), list(send_splits), opts)
    if work is not None:  # (a backend may have waited itself: no work)
        work.wait()


def exchange_halo(cp: CPContext, send: torch.Tensor) -> torch.Tensor:
    """The forward's exchange of halo_send's rows: the rows every rank sends this one and a zero
    row after them, the halo rows before a document."""
    received = send.new_empty(sum(cp.halo_recv_splits) + 1, send.shape[1])
    received[-1].zero_()
    exchange_rows(received[:-1], send, cp.halo_recv_splits, cp.halo_send_splits, cp.group)
    return received


def halo_send(cp: CPContext, xs) -> torch.Tensor:
    """This rank's halo rows for every rank, of every x side by side: ``[sum(halo_send_splits),
    sum C]`` BF16."""
    rows = [x.reshape(-1, x.shape[-1]).index_select(0, cp.export_rows) for x in xs]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def halos_of(cp: CPContext, received: torch.Tensor, xs) -> list[torch.Tensor]:
    """Each x's fragments' halos ``[num_fragments, 3, C]`` from the received rows."""
    halos, at = [], 0
    for x in xs:
        C = x.shape[-1]
        cols = received if len(xs) == 1 else received[:, at: at + C]
        halos.append(cols.index_select(0, cp.import_rows).view(cp.num_fragments, 3, C))
        at += C
    return halos


class _HaloExchange(torch.autograd.Function):
    """The exchange of one or more tensors of the same tokens (q, k, v of one layer): their
    rows side by side along the channels, so one collective carries all of them."""

    @staticmethod
    def forward(ctx, cp, *xs):
        received = exchange_halo(cp, halo_send(cp, xs))
        ctx.cp, ctx.shapes, ctx.widths = cp, [x.shape for x in xs], [x.shape[-1] for x in xs]
        return tuple(halos_of(cp, received, xs))

    @staticmethod
    def backward(ctx, *dstates):
        cp, widths = ctx.cp, ctx.widths
        ref = next(d for d in dstates if d is not None)
        grads = torch.cat([ref.new_zeros(ref.shape[0] * 3, w) if d is None else d.reshape(-1, w)
                           for d, w in zip(dstates, widths)], dim=1)
        # FP32 at least: a row imported by several fragments, and a row sent to several ranks, are
        # summed once each before the one rounding back to the inputs' dtype; in a fixed order
        # (index_put_'s accumulation sorts the indices; index_add_ on a GPU adds duplicates in any order).
        acc = torch.promote_types(grads.dtype, torch.float32)
        per_row = grads.new_zeros(sum(cp.halo_recv_splits) + 1, grads.shape[1], dtype=acc)
        per_row.index_put_((cp.import_rows.long(),), grads.to(acc), accumulate=True)
        back = per_row.new_empty(sum(cp.halo_send_splits), grads.shape[1])  # the exchange reversed
        exchange_rows(back, per_row[:-1], cp.halo_send_splits, cp.halo_recv_splits, cp.group)
        dxs = []
        for part, shape in zip(back.split(widths, dim=1), ctx.shapes):
            dx = part.new_zeros(cp.num_tokens, part.shape[1])
            dx.index_put_((cp.export_rows.long(),), part, accumulate=True)
            dxs.append(dx.to(grads.dtype).view(shape))
        return (None, *dxs)


def halo_exchange_multi(xs, ctx: CPContext) -> list[torch.Tensor]:
    """:func:`halo_exchange` of several ``[T, C_i]`` / ``[1, T, C_i]`` tensors of this rank's
    tokens (e.g. the q, k and v of one layer; one dtype and device) with one collective per
    direction: bitwise the results of separate calls."""
    xs = list(xs)
    return _exchange("halo_exchange_multi", xs, ctx, [f"xs[{i}]" for i in range(len(xs))])


def _exchange(fn: str, xs: list, ctx, names: list[str]) -> list[torch.Tensor]:
    """Both public exchanges: their checks under the caller's name and argument names."""
    check_context(fn, ctx)
    check_call(fn, ctx, lambda: _check_exchange(fn, xs, ctx, names),
               lambda: f"{len(xs)} tensor(s) of {[x.shape[-1] for x in xs]} channels, {xs[0].dtype}")
    return list(_HaloExchange.apply(ctx, *xs))


def _check_exchange(fn: str, xs: list, ctx: CPContext, names: list[str]) -> None:
    if not xs:
        raise ValueError(f"{fn}: xs must hold at least one tensor")
    for x, name in zip(xs, names):
        _checks.check_types(fn, ((name, x),), ())
        if not (x.dim() == 2 or (x.dim() == 3 and x.shape[0] == 1)) or x.shape[-2] != ctx.num_tokens:
            raise ValueError(f"{fn}: {name} must be [T, C] or [1, T, C] with this rank's T = {ctx.num_tokens} tokens "
                             f"({LOCAL_TOKENS_ORIGIN}), got shape {tuple(x.shape)}")
        if x.dtype != xs[0].dtype:
            raise ValueError(f"{fn}: {name} must have {names[0]}'s dtype {xs[0].dtype}, got {x.dtype}")
        check_context_device(fn, name, x, ctx)
        _checks.check_has_memory(fn, ((name, x),))  # (a meta context took a meta x: the exchange ran on no rows)


def halo_exchange(x_local: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """The local fragments' initial states ``[num_fragments, 3, C]``: the 3 rows before each
    fragment in its document, gathered from the ranks holding them (zeros before a document's
    first token), with autograd (the backward returns the gradient to those rows' owners, summed in
    FP32 at least). ``x_local``: ``[T, C]`` or ``[1, T, C]``. One fixed-size collective per
    direction (an all_to_all: each rank receives the rows its fragments need): every rank of
    ``ctx.group`` must call it with the same C and dtype (checked only on a context built with
    ``verify=True``: otherwise another C or dtype on one rank fails the exchange, hangs, or gives
    rows of garbage), and must run its backward too (a loss
    that does not reach the states on one rank leaves the others waiting: add ``0 * states.sum()``
    there)."""
    return _exchange("halo_exchange", [x_local], ctx, ["x_local"])[0]
