"""Context parallelism (CP) for the packed conv over torch.distributed: the host partition of a
packed batch over the ranks of a CP group, the device tables of one rank, and the halo exchange
that hands each fragment of a document the 3 rows before it (its initial state) from the ranks
that hold them.

A document cut by the partition becomes fragments, one per rank piece, in each rank's local
packed batch in the partition's order; a fragment starting at offset ``o > 0`` of its document
continues the rows at positions ``o - 3 .. o - 1``, which may live on other ranks (several, when
fragments are shorter than 3 tokens) or on the same rank. :func:`halo_exchange` gathers them as
the fragments' ``initial_states`` ``[num_fragments, 3, C]`` (zeros before a document's first
token) with one ``all_gather_into_tensor`` of a fixed size, and its backward returns their
gradient to the owners' rows with one ``reduce_scatter``: no host synchronization, the same
collectives on every rank whatever the data.

Status: the partition, the tables and the exchange are complete and tested with gloo (CPU); the
fused CUDA path (``cake_causal_conv1d_cp``: the exchange overlapped with the interior tokens) is
issue 16's remaining work."""

from __future__ import annotations

import bisect
import dataclasses

import torch
import torch.distributed as dist

__all__ = ["CPContext", "CPPartition", "build_cp_context", "cp_partition", "halo_exchange", "halo_exchange_multi"]

LAYOUTS = ("contiguous", "zigzag", "zigzag_per_document")


@dataclasses.dataclass(frozen=True)
class CPPartition:
    """Which tokens of a packed global batch each rank holds: ``fragments[r]`` lists rank r's
    fragments ``(doc, offset, length)`` in the order of its local packed batch. Built by
    :func:`cp_partition`; identical on every rank."""

    world_size: int
    doc_lengths: tuple[int, ...]
    fragments: tuple[tuple[tuple[int, int, int], ...], ...]
    layout: str

    def local_tokens(self, rank: int) -> int:
        return sum(length for _, _, length in self.fragments[rank])

    def local_cu_seqlens(self, rank: int) -> list[int]:
        """The local batch's cu_seqlens: one local document per fragment (zero-length ones too)."""
        cu = [0]
        for _, _, length in self.fragments[rank]:
            cu.append(cu[-1] + length)
        return cu

    def global_tokens(self, rank: int) -> list[int]:
        """The global token index of each local token of ``rank``, in local order."""
        starts = [0]
        for n in self.doc_lengths:
            starts.append(starts[-1] + n)
        return [starts[d] + o + i for d, o, n in self.fragments[rank] for i in range(n)]


def _doc_lengths(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.is_cuda:
            raise ValueError("cp_partition: cu_seqlens_global_cpu must be a 1-D int32/int64 CPU tensor or a list of "
                             f"ints, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
        cu = cu_seqlens.tolist()
    else:
        cu = list(cu_seqlens)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in cu):
            raise ValueError("cp_partition: cu_seqlens_global_cpu must hold ints")
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cp_partition: cu_seqlens_global_cpu must start at 0 and never decrease, got {cu[:8]}"
                         f"{' ...' if len(cu) > 8 else ''}")
    return tuple(b - a for a, b in zip(cu, cu[1:]))


def _pieces(starts: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The non-empty pieces (doc, offset, length) of global tokens [lo, hi), in order."""
    out = []
    d = bisect.bisect_right(starts, lo) - 1
    while lo < hi and d < len(starts) - 1:
        end = min(hi, starts[d + 1])
        if end > lo:
            out.append((d, lo - starts[d], end - lo))
        lo = max(lo, end)
        d += 1
    return out


def _check_fragments(fragments, lengths: tuple[int, ...], world_size: int) -> tuple:
    if not isinstance(fragments, (list, tuple)) or len(fragments) != world_size:
        raise ValueError(f"cp_partition: fragments must hold one list per rank ({world_size}), got "
                         f"{len(fragments) if isinstance(fragments, (list, tuple)) else type(fragments).__name__}")
    covered = [[] for _ in lengths]
    out = []
    for r, frags in enumerate(fragments):
        rank_frags = []
        for f in frags:
            if (not isinstance(f, (list, tuple)) or len(f) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in f)):
                raise ValueError(f"cp_partition: rank {r}'s fragments must be (doc, offset, length) ints, got {f!r}")
            d, o, n = f
            if not (0 <= d < len(lengths) and n >= 0 and 0 <= o and o + n <= lengths[d]):
                raise ValueError(f"cp_partition: rank {r}'s fragment {tuple(f)} is outside its document "
                                 f"(doc in [0, {len(lengths)}), offset + length <= the document's length)")
            covered[d].append((o, o + n))
            rank_frags.append((d, o, n))
        out.append(tuple(rank_frags))
    for d, spans in enumerate(covered):
        at = 0
        for a, b in sorted(s for s in spans if s[1] > s[0]):
            if a != at:
                raise ValueError(f"cp_partition: document {d}'s tokens [{min(a, at)}, {max(a, at)}) are "
                                 f"{'missing' if a > at else 'in more than one fragment'}")
            at = b
        if at != lengths[d]:
            raise ValueError(f"cp_partition: document {d}'s tokens [{at}, {lengths[d]}) are in no fragment")
    return tuple(out)


def cp_partition(cu_seqlens_global_cpu, world_size: int, layout: str = "contiguous", *,
                 fragments=None) -> CPPartition:
    """Partition a packed global batch (its ``cu_seqlens``, on the host: read once per batch)
    over ``world_size`` ranks.

    Layouts: ``"contiguous"`` (rank r holds global tokens ``[r T / P, (r + 1) T / P)``, no
    ``T % P`` requirement), ``"zigzag"`` (the tokens in 2P chunks, rank r holds chunks r and
    2P - 1 - r: balanced causal attention), ``"zigzag_per_document"`` (each document in 2P chunks,
    rank r holding its chunks r and 2P - 1 - r, document by document). ``fragments``: explicit
    ``[(doc, offset, length), ...]`` per rank instead (any order; zero-length and short fragments
    allowed; every token of every document in exactly one). Raises ValueError naming what is
    wrong."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"cp_partition: world_size must be a positive int, got {world_size!r}")
    lengths = _doc_lengths(cu_seqlens_global_cpu)
    if fragments is not None:
        if layout != "contiguous":
            raise ValueError(f"cp_partition: give layout or fragments, not both (got layout={layout!r})")
        return CPPartition(world_size, lengths, _check_fragments(fragments, lengths, world_size), "fragments")
    if layout not in LAYOUTS:
        raise ValueError(f"cp_partition: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total, P = starts[-1], world_size
    per_rank = []
    for r in range(P):
        if layout == "contiguous":
            frags = _pieces(starts, r * total // P, (r + 1) * total // P)
        elif layout == "zigzag":
            frags = []
            for c in (r, 2 * P - 1 - r):
                frags += _pieces(starts, c * total // (2 * P), (c + 1) * total // (2 * P))
        else:
            frags = []
            for d, n in enumerate(lengths):
                for c in (r, 2 * P - 1 - r):
                    a, b = c * n // (2 * P), (c + 1) * n // (2 * P)
                    if b > a:
                        frags.append((d, a, b - a))
        per_rank.append(_merged(frags))
    return CPPartition(P, lengths, tuple(per_rank), layout)


def _merged(frags: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Consecutive pieces of one document that continue each other as one fragment (zigzag's
    middle rank holds chunks P - 1 and P: one piece, no history to export to itself)."""
    out: list[tuple[int, int, int]] = []
    for d, o, n in frags:
        if out and out[-1][0] == d and out[-1][1] + out[-1][2] == o:
            out[-1] = (d, out[-1][1], out[-1][2] + n)
        else:
            out.append((d, o, n))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class CPContext:
    """One rank's device tables of a :class:`CPPartition` (see :func:`build_cp_context`)."""

    partition: CPPartition
    group: object
    rank: int
    cu_seqlens: torch.Tensor     # int32 [num_fragments + 1]: the local batch
    export_rows: torch.Tensor    # int64 [export_size]: local rows other fragments' histories need
    import_rows: torch.Tensor    # int64 [num_fragments * 3]: rows of the gathered exports, or the zero row
    export_size: int             # rows each rank exports (the largest count, padded)
    num_exports: int             # rows this rank exports (the first num_exports of export_rows)
    num_tokens: int              # local tokens


def build_cp_context(partition: CPPartition, group, rank: int, device) -> CPContext:
    """Rank ``rank``'s tables of ``partition`` on ``device``, computed on the host from the
    partition alone (no communication: every rank derives the same plan) and moved with one
    copy. The exchange's size is the same on every rank: the largest number of rows a rank
    exports."""
    if not 0 <= rank < partition.world_size:
        raise ValueError(f"build_cp_context: rank must be in [0, {partition.world_size}), got {rank}")
    if group is not None and dist.is_available() and dist.is_initialized():
        size, group_rank = dist.get_world_size(group), dist.get_rank(group)
        if size != partition.world_size or group_rank != rank:
            raise ValueError(f"build_cp_context: the partition is for {partition.world_size} ranks and this is rank "
                             f"{rank}, but the group has {size} ranks and this process is its rank {group_rank} "
                             "(pass the rank within the CP group)")
    P = partition.world_size
    # Owner (rank, local row) of every fragment, by document, sorted by offset.
    owners = [[] for _ in partition.doc_lengths]
    for r in range(P):
        row = 0
        for d, o, n in partition.fragments[r]:
            if n:
                owners[d].append((o, n, r, row))
            row += n
    for spans in owners:
        spans.sort()

    def owner(d: int, p: int) -> tuple[int, int]:
        spans = owners[d]
        i = bisect.bisect_right(spans, (p, float("inf"))) - 1
        o, _, r, row = spans[i]
        return r, row + p - o

    # Each rank's exported rows (sorted, unique) and every fragment's history in those terms.
    needs = [[] for _ in range(P)]  # per importing rank: per fragment, 3 (owner rank, local row) or None
    exports = [set() for _ in range(P)]
    for r in range(P):
        for d, o, _ in partition.fragments[r]:
            hist = []
            for j in range(3):
                p = o - 3 + j
                hist.append(owner(d, p) if p >= 0 else None)
                if hist[-1] is not None:
                    exports[hist[-1][0]].add(hist[-1][1])
            needs[r].append(hist)
    export_lists = [sorted(e) for e in exports]
    size = max(1, max(len(e) for e in export_lists))
    position = [{row: i for i, row in enumerate(e)} for e in export_lists]
    zero_row = P * size
    imports = [zero_row if h is None else h[0] * size + position[h[0]][h[1]] for hist in needs[rank] for h in hist]
    mine = export_lists[rank] + [0] * (size - len(export_lists[rank]))  # padding: never read, sent as zeros
    cu = partition.local_cu_seqlens(rank)
    host = torch.tensor(cu + mine + imports, dtype=torch.int64)
    on_cuda = torch.device(device).type == "cuda"
    dev = host.pin_memory().to(device, non_blocking=True) if on_cuda else host.to(device)  # no host wait
    n_frag = len(cu) - 1
    return CPContext(partition, group, rank, dev[: n_frag + 1].to(torch.int32), dev[n_frag + 1: n_frag + 1 + size],
                     dev[n_frag + 1 + size:], size, len(export_lists[rank]), cu[-1])


# torch 2.13 renames the fixed-size collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _HaloExchange(torch.autograd.Function):
    """The exchange of one or more tensors of the same tokens (q, k, v of one layer): their
    export rows side by side along the channels, so one collective carries all of them."""

    @staticmethod
    def forward(ctx, cp, *xs):
        rows = [x.reshape(-1, x.shape[-1]) for x in xs]
        widths = [r.shape[1] for r in rows]
        n = cp.num_exports  # the rest of the buffer is padding (a rank may hold no token at all)
        send = rows[0].new_zeros(cp.export_size, sum(widths))
        if n:
            exports = cp.export_rows[:n]
            send[:n] = torch.cat([r.index_select(0, exports) for r in rows], dim=1)
        gathered = send.new_empty(cp.partition.world_size * cp.export_size + 1, send.shape[1])
        _all_gather(gathered[:-1], send, group=cp.group)
        gathered[-1].zero_()
        states = gathered.index_select(0, cp.import_rows)
        ctx.cp, ctx.shapes, ctx.widths = cp, [x.shape for x in xs], widths
        return tuple(s.reshape(-1, 3, w) for s, w in zip(states.split(widths, dim=1), widths))

    @staticmethod
    def backward(ctx, *dstates):
        cp, widths = ctx.cp, ctx.widths
        ref = next(d for d in dstates if d is not None)
        grads = torch.cat([ref.new_zeros(ref.shape[0] * 3, w) if d is None else d.reshape(-1, w)
                           for d, w in zip(dstates, widths)], dim=1)
        # FP32 at least: a row imported by several fragments, and the ranks' contributions, are
        # summed once each before the one rounding back to the inputs' dtype.
        acc = torch.promote_types(grads.dtype, torch.float32)
        per_row = grads.new_zeros(cp.partition.world_size * cp.export_size + 1, grads.shape[1], dtype=acc)
        per_row.index_add_(0, cp.import_rows, grads.to(acc))
        mine = per_row.new_empty(cp.export_size, grads.shape[1])
        _reduce_scatter(mine, per_row[:-1].contiguous(), group=cp.group)
        n = cp.num_exports
        dxs = []
        for part, shape in zip(mine[:n].split(widths, dim=1), ctx.shapes):
            dx = part.new_zeros(cp.num_tokens, part.shape[1])
            if n:
                dx.index_add_(0, cp.export_rows[:n], part)
            dxs.append(dx.to(grads.dtype).view(shape))
        return (None, *dxs)


def halo_exchange_multi(xs, ctx: CPContext) -> list[torch.Tensor]:
    """:func:`halo_exchange` of several ``[T, C_i]`` / ``[1, T, C_i]`` tensors of this rank's
    tokens (e.g. the q, k and v of one layer; one dtype and device) with one collective per
    direction: bitwise the results of separate calls."""
    xs = list(xs)
    if not xs:
        raise ValueError("halo_exchange_multi: xs must hold at least one tensor")
    for i, x in enumerate(xs):
        if not (x.dim() == 2 or (x.dim() == 3 and x.shape[0] == 1)) or x.shape[-2] != ctx.num_tokens \
                or x.dtype != xs[0].dtype or x.device != xs[0].device:
            raise ValueError(f"halo_exchange_multi: xs[{i}] must have this rank's {ctx.num_tokens} tokens and xs[0]'s "
                             f"dtype and device, got shape {tuple(x.shape)}, {x.dtype} on {x.device}")
    return list(_HaloExchange.apply(ctx, *xs))


def halo_exchange(x_local: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """The local fragments' initial states ``[num_fragments, 3, C]``: the 3 rows before each
    fragment in its document, gathered from the ranks holding them (zeros before a document's
    first token), with autograd (the backward returns the gradient to those rows' owners, summed in
    FP32 at least). ``x_local``: ``[T, C]`` or ``[1, T, C]``. One fixed-size collective per
    direction: every rank of ``ctx.group`` must call it, and must run its backward too (a loss
    that does not reach the states on one rank leaves the others waiting: add ``0 * states.sum()``
    there). The all_gather hands every rank the largest export of any rank times P: small for
    the contiguous and zigzag layouts (3 to 6 rows per rank), large for zigzag_per_document with
    many documents (every document exports from every rank)."""
    return halo_exchange_multi([x_local], ctx)[0]
