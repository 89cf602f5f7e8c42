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

__all__ = ["CPContext", "CPPartition", "build_cp_context", "cp_partition", "halo_exchange"]

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
        per_rank.append(tuple(frags))
    return CPPartition(P, lengths, tuple(per_rank), layout)


@dataclasses.dataclass(frozen=True)
class CPContext:
    """One rank's device tables of a :class:`CPPartition` (see :func:`build_cp_context`)."""

    partition: CPPartition
    group: object
    rank: int
    cu_seqlens: torch.Tensor     # int32 [num_fragments + 1]: the local batch
    export_rows: torch.Tensor    # int64 [export_size]: local rows other fragments' histories need
    import_rows: torch.Tensor    # int64 [num_fragments * 3]: rows of the gathered exports, or the zero row
    export_size: int             # rows each rank exports (the largest count, padded)
    num_tokens: int              # local tokens


def build_cp_context(partition: CPPartition, group, rank: int, device) -> CPContext:
    """Rank ``rank``'s tables of ``partition`` on ``device``, computed on the host from the
    partition alone (no communication: every rank derives the same plan) and moved with one
    copy. The exchange's size is the same on every rank: the largest number of rows a rank
    exports."""
    if not 0 <= rank < partition.world_size:
        raise ValueError(f"build_cp_context: rank must be in [0, {partition.world_size}), got {rank}")
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
    mine = export_lists[rank] + [0] * (size - len(export_lists[rank]))  # padding rows: exported, never imported
    cu = partition.local_cu_seqlens(rank)
    host = torch.tensor(cu + mine + imports, dtype=torch.int64)
    on_cuda = torch.device(device).type == "cuda"
    dev = host.pin_memory().to(device, non_blocking=True) if on_cuda else host.to(device)  # no host wait
    n_frag = len(cu) - 1
    return CPContext(partition, group, rank, dev[: n_frag + 1].to(torch.int32),
                     dev[n_frag + 1: n_frag + 1 + size], dev[n_frag + 1 + size:], size, cu[-1])


# torch 2.13 renames the fixed-size collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, cp):
        rows = x_local.reshape(-1, x_local.shape[-1])
        C = rows.shape[1]
        send = rows.index_select(0, cp.export_rows)
        gathered = rows.new_empty(cp.partition.world_size * cp.export_size + 1, C)
        _all_gather(gathered[:-1], send, group=cp.group)
        gathered[-1].zero_()
        ctx.cp, ctx.shape = cp, x_local.shape
        return gathered.index_select(0, cp.import_rows).view(-1, 3, C)

    @staticmethod
    def backward(ctx, dstates):
        cp = ctx.cp
        C = dstates.shape[-1]
        P, size = cp.partition.world_size, cp.export_size
        per_row = dstates.new_zeros(P * size + 1, C)
        per_row.index_add_(0, cp.import_rows, dstates.reshape(-1, C))
        mine = dstates.new_empty(size, C)
        _reduce_scatter(mine, per_row[:-1].contiguous(), group=cp.group)
        dx = dstates.new_zeros(cp.num_tokens, C)
        dx.index_add_(0, cp.export_rows, mine)  # padding rows receive zeros
        return dx.view(ctx.shape), None


def halo_exchange(x_local: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """The local fragments' initial states ``[num_fragments, 3, C]``: the 3 rows before each
    fragment in its document, gathered from the ranks holding them (zeros before a document's
    first token), with autograd (the backward returns the gradient to those rows' owners). One
    fixed-size collective per direction; every rank of ``ctx.group`` must call it."""
    if x_local.shape[-2] != ctx.num_tokens:
        raise ValueError(f"halo_exchange: x_local must have this rank's {ctx.num_tokens} tokens, got shape "
                         f"{tuple(x_local.shape)}")
    return _HaloExchange.apply(x_local, ctx)
