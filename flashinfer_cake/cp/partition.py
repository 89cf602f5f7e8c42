"""The host plan of context parallelism: the partition of a packed global batch over the ranks of
a CP group (:func:`cp_partition`) and one rank's device tables (:func:`build_cp_context`).

A document cut by the partition becomes fragments, one per rank piece, in each rank's local
packed batch in the partition's order. A fragment starting at offset ``o > 0`` of its document
continues the rows at positions ``o - 3 .. o - 1`` (its halo), which may live on other ranks
(several, when fragments are shorter than 3 tokens) or on the same rank; a fragment whose
document goes on after it needs, in the backward, the gradient terms of the next 3 tokens. A
rank's tables say which of its rows it sends to each rank and where each of its fragments finds
what it needs in the rows it receives: fixed sizes, derived from the partition alone, so the
plans of all ranks agree."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools

import torch
import torch.distributed as dist

from .. import _checks

__all__ = ["CPContext", "CPPartition", "build_cp_context", "cp_partition"]

LAYOUTS = ("contiguous", "zigzag", "zigzag_per_document")
EXPLICIT = "fragments"  # the layout name of a partition of explicit fragments
# frag_info: min(a fragment's offset in its document, 3) | FRAG_CONTINUES when its document has
# tokens after it (causal_conv1d_contract.h)
FRAG_HEAD_MASK, FRAG_CONTINUES = 3, 4


@dataclasses.dataclass(frozen=True)
class CPPartition:
    """Which tokens of a packed global batch each rank holds: ``fragments[r]`` lists rank r's
    fragments ``(doc, offset, length)`` in the order of its local packed batch; identical on every
    rank. Built by :func:`cp_partition` (a layout, or explicit ``fragments=``), or by hand:
    constructed directly, it is checked on the host when made (no collective, no device tensor
    read) by cp_partition's rules, a ValueError naming the first one broken: ``world_size`` a
    positive int, ``doc_lengths`` non-negative ints, one sequence of fragments per rank, each
    ``(doc, offset, length)`` ints within its document, every token of every document in exactly
    one fragment, ``layout`` ``"fragments"`` or one of :data:`LAYOUTS`, whose cut the fragments must
    then be. Lists and integers of any library (not tensors) are taken as tuples of
    ints. (cp_partition's layouts are correct by construction and skip the checks, whose Python
    loop costs about as much as building them, ~0.5 µs per fragment.)"""

    world_size: int
    doc_lengths: tuple[int, ...]
    fragments: tuple[tuple[tuple[int, int, int], ...], ...]
    layout: str

    def __post_init__(self):
        world_size = _world_size("CPPartition", self.world_size)
        lengths = _int_sequence("CPPartition", "doc_lengths", self.doc_lengths, "(one per document)")
        fragments = _check_fragments("CPPartition", self.fragments, lengths, world_size)
        if not isinstance(self.layout, str) or self.layout not in (*LAYOUTS, EXPLICIT):
            raise ValueError(f"CPPartition: layout must be one of {[*LAYOUTS, EXPLICIT]}, got {self.layout!r}")
        if self.layout in LAYOUTS and cp_partition(list(itertools.accumulate(lengths, initial=0)), world_size,
                                                   self.layout).fragments != fragments:
            raise ValueError(f"CPPartition: layout {self.layout!r} names cp_partition's cut of these documents, but "
                             f"the fragments are another: pass layout={EXPLICIT!r} for fragments of your own")
        for name, value in (("world_size", world_size), ("doc_lengths", lengths), ("fragments", fragments)):
            object.__setattr__(self, name, value)  # (frozen: the checked values as tuples of ints)

    def _rank(self, fn: str, rank) -> int:
        """``rank`` as an index into the partition's ranks (not Python's negative indexing: a -1
        would pick the last rank's tokens)."""
        value = _checks.as_int(rank)
        if value is None or not 0 <= value < self.world_size:
            raise ValueError(f"CPPartition.{fn}: rank must be an int in [0, {self.world_size}) (the rank within "
                             f"the CP group), got {rank!r}")
        return value

    def local_tokens(self, rank: int) -> int:
        return sum(length for _, _, length in self.fragments[self._rank("local_tokens", rank)])

    def local_cu_seqlens(self, rank: int) -> list[int]:
        """The local batch's cu_seqlens: one local document per fragment (zero-length ones too)."""
        cu = [0]
        for _, _, length in self.fragments[self._rank("local_cu_seqlens", rank)]:
            cu.append(cu[-1] + length)
        return cu

    def global_tokens(self, rank: int) -> list[int]:
        """The global token index of each local token of ``rank``, in local order."""
        frags = self.fragments[self._rank("global_tokens", rank)]
        starts = [0]
        for n in self.doc_lengths:
            starts.append(starts[-1] + n)
        return [starts[d] + o + i for d, o, n in frags for i in range(n)]


# Where a rank's token count T comes from, for the messages of a tensor of another length.
LOCAL_TOKENS_ORIGIN = ("ctx.partition.local_tokens(ctx.rank): pass cp_partition the whole batch's cu_seqlens, "
                       "not a rank's")


def _doc_lengths(cu_seqlens) -> tuple[int, ...]:
    cu = _checks.cu_seqlens_values("cp_partition", "cu_seqlens_global_cpu", cu_seqlens, device_read=False)
    problem = _checks.cu_seqlens_problem("cu_seqlens_global_cpu", cu)
    if problem:
        raise ValueError(f"cp_partition: {problem}")
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


def _world_size(fn: str, value) -> int:
    """``value`` as the CP group's size: a positive integer of any library (a CPU tensor's read once)."""
    n = _checks.as_int(value)
    if n is None or n < 1:
        raise ValueError(f"{fn}: world_size must be a positive int (the CP group's size), got {value!r}")
    return n


def _int_sequence(fn: str, name: str, values, what: str) -> tuple[int, ...]:
    """``values``, a list or tuple of non-negative integers of any library (not tensors: no device
    read), as a tuple of ints."""
    if type(values) is tuple and all(type(v) is int and v >= 0 for v in values):
        return values
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{fn}: {name} must be a sequence of non-negative ints {what}, got a {type(values).__name__}")
    ints = tuple(_checks.as_int(v, tensors=False) for v in values)
    for i, (v, n) in enumerate(zip(values, ints)):
        if n is None or n < 0:
            raise ValueError(f"{fn}: {name} must be a sequence of non-negative ints {what}, got {v!r} at index {i}")
    return ints


def _check_fragments(fn: str, fragments, lengths: tuple[int, ...], world_size: int) -> tuple:
    """``fragments`` (one sequence per rank of ``(doc, offset, length)`` integers of any library,
    not tensors) as tuples of ints, each within its document and every token of every document in
    exactly one; else a ValueError naming the first rule broken, what it takes and what it got."""
    if not isinstance(fragments, (list, tuple)) or len(fragments) != world_size:
        got = len(fragments) if isinstance(fragments, (list, tuple)) else type(fragments).__name__
        raise ValueError(f"{fn}: fragments must hold one sequence per rank (world_size = {world_size}), got {got}")
    D, starts = len(lengths), list(itertools.accumulate(lengths, initial=0))
    spans, out = [], []  # spans: (global start, length) of each non-empty fragment
    for r, frags in enumerate(fragments):
        if not isinstance(frags, (list, tuple)):
            raise ValueError(f"{fn}: fragments[{r}] must be a sequence of (doc, offset, length) triples, got {frags!r}")
        rank_frags = []
        for i, f in enumerate(frags):
            if not (type(f) is tuple and len(f) == 3 and type(f[0]) is int and type(f[1]) is int
                    and type(f[2]) is int):  # (the common case, fast) else ints of any library (NumPy's), as tuples
                ints = tuple(_checks.as_int(v, tensors=False) for v in f) if isinstance(f, (list, tuple)) else ()
                if len(ints) != 3 or None in ints:
                    raise ValueError(f"{fn}: fragments[{r}][{i}] must be a (doc, offset, length) triple of ints, "
                                     f"got {f!r}")
                f = ints
            d, o, n = f
            if not (0 <= d < D and o >= 0 and n >= 0 and o + n <= lengths[d]):
                within = f", offset + length <= {lengths[d]} (doc_lengths[{d}])" if 0 <= d < D else ""
                raise ValueError(f"{fn}: fragments[{r}][{i}] = {f} must lie in its document: doc in [0, {D}), "
                                 f"offset >= 0, length >= 0{within}")
            if n:
                spans.append((starts[d] + o, n))
            rank_frags.append(f)
        out.append(tuple(rank_frags))
    spans.sort()
    at = 0  # the global tokens before `at` are each in exactly one fragment
    for g, n in spans:
        if g > at:
            raise _coverage_error(fn, out, starts, at, g, False)
        if g < at:
            raise _coverage_error(fn, out, starts, g, min(at, g + n), True)
        at = g + n
    if at != starts[-1]:
        raise _coverage_error(fn, out, starts, at, starts[-1], False)
    return tuple(out)


def _coverage_error(fn: str, fragments: tuple, starts: list[int], lo: int, hi: int, twice: bool) -> ValueError:
    """The error of the global tokens [lo, hi) (lo < hi), in no fragment or (``twice``: within
    one document) in more than one: their first document's."""
    d = bisect.bisect_right(starts, lo) - 1
    a, b = lo - starts[d], min(hi, starts[d + 1]) - starts[d]
    head = (f"{fn}: every token of every document must be in exactly one fragment, but document {d}'s tokens "
            f"[{a}, {b})")
    if not twice:
        return ValueError(f"{head} are in no fragment: give a rank the fragment ({d}, {a}, {b - a})")
    holders = [f"fragments[{r}][{i}] = {f}" for r, frags in enumerate(fragments) for i, f in enumerate(frags)
               if f[0] == d and f[2] and f[1] < b and a < f[1] + f[2]]
    return ValueError(f"{head} are in more than one fragment ({', '.join(holders)})")


def cp_partition(cu_seqlens_global_cpu, world_size: int, layout: str | None = None, *,
                 fragments=None) -> CPPartition:
    """Partition a packed global batch (its ``cu_seqlens``, on the host: read once per batch)
    over ``world_size`` ranks.

    Layouts (floor division; a loader that cuts the batch itself must cut so, in this order):
    ``"contiguous"`` (rank r holds global tokens ``[r T // P, (r + 1) T // P)``, no ``T % P``
    requirement), ``"zigzag"`` (the tokens in 2P chunks ``[c T // 2P, (c + 1) T // 2P)``, rank r
    holds chunk r then chunk 2P - 1 - r: balanced causal attention), ``"zigzag_per_document"``
    (each document of n tokens in 2P chunks ``[c n // 2P, (c + 1) n // 2P)``, rank r holding its
    chunks r and 2P - 1 - r, document by document); None: ``"contiguous"``. The partition's
    ``global_tokens(r)`` lists rank r's tokens in that order.
    ``fragments``: explicit ``[(doc, offset, length), ...]`` per rank instead of a layout (any
    order; zero-length and short fragments allowed; every token of every document in exactly
    one). Raises ValueError naming what is wrong."""
    world_size = _world_size("cp_partition", world_size)
    lengths = _doc_lengths(cu_seqlens_global_cpu)
    if fragments is not None:
        if layout is not None:
            raise ValueError(f"cp_partition: give layout or fragments, not both (got layout={layout!r})")
        return _made(world_size, lengths, _check_fragments("cp_partition", fragments, lengths, world_size), EXPLICIT)
    layout = "contiguous" if layout is None else layout
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
    return _made(P, lengths, tuple(per_rank), layout)


def _made(world_size: int, lengths: tuple, fragments: tuple, layout: str) -> CPPartition:
    """cp_partition's CPPartition, without the constructor's second pass over its fields: a
    layout's fragments are correct by construction (tests/test_cp.py passes them through the
    constructor's checks too) and explicit ones have just passed cp_partition's (_check_fragments,
    the same rules)."""
    part = object.__new__(CPPartition)
    values = {"world_size": world_size, "doc_lengths": lengths, "fragments": fragments, "layout": layout}
    assert values.keys() == {f.name for f in dataclasses.fields(CPPartition)}  # (every field, by name)
    for name, value in values.items():
        object.__setattr__(part, name, value)
    return part


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
    """One rank's device tables of a :class:`CPPartition` (see :func:`build_cp_context`); int32."""

    partition: CPPartition
    group: object
    rank: int
    cu_seqlens: torch.Tensor   # [num_fragments + 1]: the local batch, one local document per fragment
    export_rows: torch.Tensor  # [sum(halo_send_splits)]: the local rows each rank's halos need, rank by rank
                               # (a row sent to two ranks twice)
    import_rows: torch.Tensor  # [num_fragments * 3]: each halo row's row of the received rows, or the row
                               # after them, sum(halo_recv_splits): before its document (zeros: halo_exchange
                               # puts a zero row there, the conv's heads pass reads it as zeros)
    frag_info: torch.Tensor    # [num_fragments]: min(offset, 3) | 4 when its document goes on after it
    head_frags: torch.Tensor   # the non-empty fragments with offset > 0 (the forward's head pass rewrites them)
    tail_frags: torch.Tensor   # the non-empty fragments whose documents go on (the backward's tail pass)
    g_rows: torch.Tensor       # [sum(g_send_splits)]: 4 * fragment + position of the head tokens whose gradient
                               # terms each rank needs, rank by rank
    g_import: torch.Tensor     # [num_fragments * 3]: row of the received head terms of the j-th token after
                               # each fragment, -1 past its document (or for an empty fragment)
    halo_send_splits: tuple    # halo rows this rank sends to rank 0, 1, ...
    halo_recv_splits: tuple    # halo rows it receives from rank 0, 1, ...
    g_send_splits: tuple       # head-token rows (backward) it sends to each rank, likewise
    g_recv_splits: tuple
    num_tokens: int            # local tokens
    num_fragments: int
    verify: bool = False       # build_cp_context(verify=True): each call checks every rank makes the same (check_call)
    # the process group the partition and rank were compared with (build_cp_context, or the first call with this
    # group: check_context); None: not yet (group None: the default group of that time, which a re-init replaces)
    _checked_group: object = dataclasses.field(default=None, init=False, repr=False)


def build_cp_context(partition: CPPartition, group, rank: int, device, *, verify: bool = False) -> CPContext:
    """Rank ``rank``'s tables of ``partition`` on ``device``, computed on the host from the
    partition alone (no communication: every rank derives the same plan) and moved with one
    asynchronous copy on the current stream (use the context on that stream, or order other
    streams after it). Each exchange is one ``all_to_all`` whose sizes, pair by pair, are the rows
    the receiver needs from the sender, the same on every rank. ``group``: the CP
    group (None: the default group), whose size and this process's rank in it must match: checked
    here, or, where torch.distributed is not initialized yet (a context built before
    ``init_process_group``: group None names a default group that does not exist yet), at the
    context's first call, before its collective.

    Every rank must pass the same partition: ranks planning different batches exchange rows that
    do not match (wrong halos where the sizes happen to agree, else a collective that fails or
    hangs). ``verify=True`` checks it (every rank must pass it): one ``all_gather_object`` over
    ``group`` of each rank's partition digest and of what its own checks found (a host
    synchronization; with NCCL, set the process's CUDA device first), then the same ValueError on
    every rank, grouping the ranks by what they planned. The context then checks every call the
    same way (the tensors' count, channels and dtypes, the SiLU' policy: one more gather per
    call). For debugging and tests."""
    problem = _context_problem(partition, group, rank)
    if problem is None:
        try:  # before the gather: with verify, a rank's bad device is every rank's ValueError, not a hang
            device = _checks.check_allocation_device("build_cp_context", device)
        except (TypeError, ValueError, RuntimeError) as e:  # (torch.device(2**70): a ValueError)
            problem = e
    if verify:
        _verify_same_partition(partition, group, problem)
    if problem is not None:
        raise problem
    rank = _checks.as_int(rank)
    P, lengths = partition.world_size, partition.doc_lengths
    frags = partition.fragments
    # The documents this rank holds fragments of (empty ones too: they have a halo) are the only
    # ones its tables involve. In each: the non-empty spans (offset, length, rank, local row,
    # fragment) by offset, every fragment's (offset, rank) and every non-empty one's (end, rank).
    spans, frag_starts, frag_ends = {}, {}, {}
    for d, _, _ in frags[rank]:
        spans[d], frag_starts[d], frag_ends[d] = [], [], []
    for r in range(P):
        row = 0
        for f, (d, o, n) in enumerate(frags[r]):
            if d in spans:
                frag_starts[d].append((o, r))
                if n:
                    spans[d].append((o, n, r, row, f))
                    frag_ends[d].append((o + n, r))
            row += n
    for d in spans:
        spans[d].sort()
        frag_starts[d].sort()
        frag_ends[d].sort()

    def owner(d: int, p: int) -> tuple[int, int]:
        """(rank, local row) of token p of document d."""
        o, _, r, row, _ = spans[d][bisect.bisect_right(spans[d], (p, float("inf"))) - 1]
        return r, row + p - o

    # Forward: the halo rows (the 3 before each fragment); backward: the head tokens (the 3 after
    # each non-empty fragment whose document goes on). What this rank needs, by sender (its local
    # rows), and what each rank needs from it: for each of its spans [o, o + n), the fragments
    # starting in o + 1 .. o + n + 2 (their halo reaches into it) and the non-empty ones ending in
    # o - 2 .. o + n - 1 (their head tokens are in it; the span's fragment f and position give the
    # backward pass's code 4 f + position).
    halo_needs, g_needs = [], []
    halo_in, g_in = [set() for _ in range(P)], [set() for _ in range(P)]  # [sender]: its local rows
    halo_out, g_out = [set() for _ in range(P)], [{} for _ in range(P)]  # [receiver]: my rows (-> g code)
    for d, o, n in frags[rank]:
        for j in range(3):
            p = o - 3 + j
            h = owner(d, p) if p >= 0 else None
            halo_needs.append(h)
            if h is not None:
                halo_in[h[0]].add(h[1])
            p = o + n + j
            t = owner(d, p) if n and p < lengths[d] else None
            g_needs.append(t)
            if t is not None:
                g_in[t[0]].add(t[1])
    for d in spans:
        starts, ends = frag_starts[d], frag_ends[d]
        for o, n, r, row, f in spans[d]:
            if r != rank:
                continue
            for o2, r2 in starts[bisect.bisect_left(starts, (o + 1, -1)): bisect.bisect_left(starts, (o + n + 3, -1))]:
                for p in range(max(o2 - 3, o), min(o2, o + n)):
                    halo_out[r2].add(row + p - o)
            for e2, r2 in ends[bisect.bisect_left(ends, (o - 2, -1)): bisect.bisect_left(ends, (o + n, -1))]:
                for p in range(max(e2, o), min(e2 + 3, o + n)):  # (o + n <= the document's length)
                    g_out[r2][row + p - o] = 4 * f + p - o
    # One all_to_all per direction: each pair's rows (a pair may have none) in the sender's local
    # order; the receiver finds sender s's rows after those of the ranks before s.
    halo_from, halo_to = [sorted(rows) for rows in halo_in], [sorted(rows) for rows in halo_out]
    g_from, g_to = [sorted(rows) for rows in g_in], [sorted(rows) for rows in g_out]

    def received_at(from_sender, rows_needed) -> list[int]:
        """Each needed (sender, row)'s row in this rank's received rows; None stays None."""
        base = [0]
        for rows in from_sender:
            base.append(base[-1] + len(rows))
        slot = [{row: i for i, row in enumerate(rows)} for rows in from_sender]
        return [None if h is None else base[h[0]] + slot[h[0]][h[1]] for h in rows_needed]

    halo_at, g_at = received_at(halo_from, halo_needs), received_at(g_from, g_needs)
    halo_recv = sum(len(rows) for rows in halo_from)
    imports = [halo_recv if i is None else i for i in halo_at]  # the row after the received rows: zeros
    g_import = [-1 if i is None else i for i in g_at]
    mine = [row for rows in halo_to for row in rows]
    g_rows = [g_out[t][row] for t in range(P) for row in g_to[t]]
    frag_info = [min(o, FRAG_HEAD_MASK) | (FRAG_CONTINUES if o + n < lengths[d] else 0)
                 for d, o, n in partition.fragments[rank]]
    head_frags = [f for f, (d, o, n) in enumerate(partition.fragments[rank]) if n and o]
    tail_frags = [f for f, (d, o, n) in enumerate(partition.fragments[rank]) if n and o + n < lengths[d]]
    cu = partition.local_cu_seqlens(rank)
    parts = [cu, mine, imports, frag_info, head_frags, tail_frags, g_rows, g_import]
    host = torch.tensor([v for part in parts for v in part], dtype=torch.int32)
    on_cuda = torch.device(device).type == "cuda"
    dev = host.pin_memory().to(device, non_blocking=True) if on_cuda else host.to(device)  # no host wait
    views, at = [], 0
    for part in parts:
        views.append(dev[at: at + len(part)])
        at += len(part)
    sends = [tuple(len(rows) for rows in to) for to in (halo_to, g_to)]
    recvs = [tuple(len(rows) for rows in frm) for frm in (halo_from, g_from)]
    ctx = CPContext(partition, group, rank, *views, sends[0], recvs[0], sends[1], recvs[1], cu[-1], len(cu) - 1,
                    verify=bool(verify))
    if _initialized():  # (_context_problem compared them then)
        object.__setattr__(ctx, "_checked_group", _resolved(group))
    return ctx


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _resolved(group):
    """The process group a call on ``group`` uses: group None is the default group of the time."""
    return dist.group.WORLD if group is None else group


def _context_problem(partition, group, rank) -> Exception | None:
    """The error build_cp_context raises for its arguments, or None."""
    if not isinstance(partition, CPPartition):
        return TypeError(f"build_cp_context: partition must be a CPPartition (cp_partition), got "
                         f"{type(partition).__name__}")
    if _checks.as_int(rank) is None:  # ints, numpy ints, 0-d integer tensors
        return TypeError(f"build_cp_context: rank must be an int, got {rank!r} ({type(rank).__name__})")
    rank = _checks.as_int(rank)
    if not 0 <= rank < partition.world_size:
        return ValueError(f"build_cp_context: rank must be in [0, {partition.world_size}), got {rank}")
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:  # dist.new_group's answer to a non-member
        return ValueError(f"build_cp_context: this process (global rank {dist.get_rank()}) is not a member of the "
                          f"group: pass the CP group this process belongs to")
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        hint = " (a list of ranks, e.g. Megatron's CP ranks, is dist.new_group(ranks))" if isinstance(
            group, (list, tuple)) else ""
        return TypeError(f"build_cp_context: group must be a torch.distributed ProcessGroup or None (the default "
                         f"group), got {type(group).__name__}{hint}")
    return _group_problem("build_cp_context", partition, group, rank) if _initialized() else None


def _group_problem(fn: str, partition: CPPartition, group, rank: int, first_call: bool = False) -> ValueError | None:
    """The error of a partition or rank that is not the group's (group None: the default group),
    or None; torch.distributed initialized. ``first_call``: checked at a context's first call on the group."""
    size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if size == partition.world_size and group_rank == rank:
        return None
    when = (" (checked at the context's first call on this group: the context was built before the group existed, "
            "before init_process_group or a re-initialization)" if first_call else "")
    return ValueError(f"{fn}: the partition is for {partition.world_size} ranks and this is rank {rank}, but the group "
                      f"has {size} ranks and this process is its rank {group_rank}{when}: pass build_cp_context the "
                      f"rank within the CP group (dist.get_rank(group)) and cp_partition its size "
                      f"(dist.get_world_size(group))")


def _verify_same_partition(partition, group, problem: Exception | None) -> None:
    """build_cp_context(verify=True): every rank of ``group`` gathers every rank's partition
    summary (or its own argument error) and raises the same ValueError where they differ or any
    failed, so no rank is left waiting in a later collective."""
    if not _initialized():
        raise ValueError("build_cp_context: verify=True needs an initialized torch.distributed process group")
    if (group is not None and not isinstance(group, dist.ProcessGroup)) or group is dist.GroupMember.NON_GROUP_MEMBER:
        raise problem  # no group to gather over: this rank's own error (the others' gather waits on it, as a call's)
    if problem is not None:
        mine = f"its arguments: {problem}"
    else:
        digest = hashlib.sha256(repr((partition.world_size, partition.doc_lengths, partition.fragments)).encode())
        mine = (f"{partition.world_size} ranks, {len(partition.doc_lengths)} documents, "
                f"{sum(partition.doc_lengths)} tokens, layout {partition.layout!r}, digest {digest.hexdigest()[:16]}")
    # the same partition: the same digest (the layout's name is shown, not compared)
    _gather_and_compare("build_cp_context", "planned different partitions", group, problem, mine,
                        lambda m: m.rsplit("digest ", 1)[-1])


def check_context(fn: str, ctx) -> None:
    """ctx is a CPContext; at its first call on a process group it was not compared with (built
    before init_process_group, or group None after a re-initialization replaced the default group),
    its partition's size and rank compared with the group's, as build_cp_context does otherwise
    (host calls only: no collective; an error on some ranks leaves the others in the call's
    collective, as a mismatch is at build time: build_cp_context(verify=True) makes every rank
    raise). A group that is no process group is the call's own error, later."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"{fn}: ctx must be a CPContext (flashinfer_cake.cp.build_cp_context), got "
                        f"{type(ctx).__name__}")
    if (_initialized() and (ctx.group is None or isinstance(ctx.group, dist.ProcessGroup))
            and ctx._checked_group is not _resolved(ctx.group)):
        problem = _group_problem(fn, ctx.partition, ctx.group, ctx.rank, first_call=True)
        if problem is not None:
            raise problem
        object.__setattr__(ctx, "_checked_group", _resolved(ctx.group))


def check_context_device(fn: str, name: str, t: torch.Tensor, ctx: CPContext) -> None:
    """``t`` (the call's argument ``name``) on the device of ctx's tables."""
    device = ctx.cu_seqlens.device
    if t.device != device:
        raise ValueError(f"{fn}: {name} must be on the context's device {device} (ctx's tables, from "
                         f"build_cp_context), got {t.device}: move it there ({name}.to('{device}')), or build the "
                         f"context on its device (build_cp_context(partition, group, rank, {name}.device))")


def check_tables(fn: str, ctx: CPContext) -> None:
    """The context's tables and sizes as build_cp_context makes them (what the binding's tables_ok
    takes): int32, 1-D, contiguous, on one device, of the partition's sizes. Only a context edited
    by hand (dataclasses.replace) breaks them."""
    F, P = ctx.num_fragments, ctx.partition.world_size
    for name in ("halo_send_splits", "halo_recv_splits", "g_send_splits", "g_recv_splits"):
        splits = getattr(ctx, name)
        if (not isinstance(splits, tuple) or len(splits) != P
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in splits)):
            raise ValueError(f"{fn}: ctx.{name} must be a tuple of {P} non-negative ints (one per rank), got "
                             f"{splits!r}: build contexts with build_cp_context")
    sizes = {"cu_seqlens": F + 1, "frag_info": F, "import_rows": 3 * F, "g_import": 3 * F,
             "export_rows": sum(ctx.halo_send_splits), "g_rows": sum(ctx.g_send_splits), "head_frags": None,
             "tail_frags": None}
    device = getattr(ctx.cu_seqlens, "device", None)
    for name, n in sizes.items():
        t = getattr(ctx, name)
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous()
                or t.device != device or (n is not None and t.numel() != n)):
            want = "int32 1-D contiguous" + ("" if n is None else f" [{n}]") + f" on {device}"
            got = (f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{fn}: ctx.{name} must be {want} (the context's tables), got {got}: build contexts "
                             f"with build_cp_context")
        _checks.check_not_transformed(fn, ((f"ctx.{name}", t),))
        _checks.check_memory(fn, f"ctx.{name}", t)


def capturing() -> bool:
    """Inside CUDA graph capture (no host collective may run there)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_call(fn: str, ctx: CPContext, check, describe, *, collective: bool = True) -> None:
    """The argument checks of one call on ``ctx`` (``check()`` raises the call's error). On a
    context built with verify=True, where the call runs its collective (``collective``) outside
    graph capture, every rank of the group first gathers every rank's ``describe()`` of the call
    or its argument error, and raises the same ValueError where they differ or any failed (so no
    rank is left waiting in the call's collective)."""
    if not (ctx.verify and collective and not capturing()):
        check()
        return
    try:
        check()
        problem = None
    except (TypeError, ValueError, RuntimeError) as e:
        problem = e
    _gather_and_compare(fn, "made different calls", ctx.group, problem,
                        describe() if problem is None else f"its arguments: {problem}", lambda m: m)


def _gather_and_compare(fn: str, what: str, group, problem: Exception | None, mine: str, key) -> None:
    """Every rank's (ok, text) gathered; where any failed or the keys of the texts differ, the
    same ValueError on every rank (chained to this rank's own error, if any)."""
    ok = problem is None
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (ok, mine), group=group)
    if all(o for o, _ in every) and len({key(m) for _, m in every}) == 1:
        return
    by_text: dict = {}
    for r, (_, m) in enumerate(every):
        by_text.setdefault(m, []).append(r)
    seen = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_text.items())
    raise ValueError(f"{fn}: the ranks of the CP group {what} or failed ({seen})") from problem
