"""Context parallelism by hand, for tests/test_cp.py and test_cp_gpu.py: the all_to_alls done on
one process, random ragged fragments, the plain all-pairs plan (build_cp_context's oracle), and
the conv's phases one by one."""

from __future__ import annotations

import torch

from flashinfer_cake.cp.conv import _native
from flashinfer_cake.cp.partition import CPContext


def exchanged_by_hand(ctxs, sends, kind: str) -> list[torch.Tensor]:
    """What each rank receives from the all_to_all of `kind` ("halo": the forward's rows, "g": the
    backward's), given every rank's send rows: from each rank s in rank order, s's rows for it.
    Checks that the senders' and the receivers' sizes agree."""
    P = len(ctxs)
    parts = [send.split(list(getattr(c, f"{kind}_send_splits")), dim=0) for c, send in zip(ctxs, sends)]
    for s in range(P):
        for t in range(P):
            assert parts[s][t].shape[0] == getattr(ctxs[t], f"{kind}_recv_splits")[s], (kind, s, t)
    return [torch.cat([parts[s][t] for s in range(P)]) for t in range(P)]


def halo_rows(part, x_global: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's fragments' halos ``[num_fragments, 3, C]`` from the global batch (the reference
    of the tables and of halo_exchange): the 3 rows before each fragment in its document, row 2 the
    nearest, zeros before the document's first token. Differentiable in x_global."""
    cu = [0]
    for n in part.doc_lengths:
        cu.append(cu[-1] + n)
    C = x_global.shape[1]
    padded = torch.cat([x_global.new_zeros(1, C), x_global])  # row 0: the zero row
    out = []
    for frags in part.fragments:
        rows = [cu[d] + o - k + 1 if o - k >= 0 else 0 for d, o, _ in frags for k in (3, 2, 1)]
        idx = torch.tensor(rows, dtype=torch.long, device=x_global.device)
        out.append(padded.index_select(0, idx).view(len(frags), 3, C))
    return out


def random_fragments(lengths, P, rng, pieces=(0, 1, 2, 3, 5, 30)):
    """Every document cut into pieces of `pieces` tokens (0: an empty fragment), each on a random
    rank; each rank's list shuffled (a rank may hold non-adjacent pieces of one document, in any
    order)."""
    frags = [[] for _ in range(P)]
    for d, n in enumerate(lengths):
        at = 0
        while True:
            k = min(n - at, rng.choice(pieces))
            frags[rng.randrange(P)].append((d, at, k))
            at += k
            if at == n:
                break
    for f in frags:
        rng.shuffle(f)
    return frags


def all_pairs_tables(part, rank: int) -> dict:
    """build_cp_context's tables for `rank`, the plain way (test oracle): every rank's needs of
    every other rank, then this rank's view of them. Same layout as CPContext's fields (lists)."""
    P, lengths = part.world_size, part.doc_lengths
    owners = [[] for _ in lengths]  # by document: (offset, length, rank, local row, fragment)
    for r in range(P):
        row = 0
        for f, (d, o, n) in enumerate(part.fragments[r]):
            if n:
                owners[d].append((o, n, r, row, f))
            row += n

    def owner(d, p):
        for o, n, r, row, f in owners[d]:
            if o <= p < o + n:
                return r, row + p - o, 4 * f + p - o
        raise AssertionError((d, p))

    halo = [[set() for _ in range(P)] for _ in range(P)]  # [sender][receiver]: sender's rows
    g = [[{} for _ in range(P)] for _ in range(P)]  # [sender][receiver]: sender's row -> code
    halo_needs, g_needs = [[] for _ in range(P)], [[] for _ in range(P)]
    for r in range(P):
        for d, o, n in part.fragments[r]:
            for j in range(3):
                h = owner(d, o - 3 + j) if o - 3 + j >= 0 else None
                halo_needs[r].append(h)
                if h:
                    halo[h[0]][r].add(h[1])
                t = owner(d, o + n + j) if n and o + n + j < lengths[d] else None
                g_needs[r].append(t)
                if t:
                    g[t[0]][r][t[1]] = t[2]
    halo = [[sorted(rows) for rows in to] for to in halo]
    g_sorted = [[sorted(rows) for rows in to] for to in g]

    def at(lists, needs, missing):
        base = [sum(len(lists[s][rank]) for s in range(k)) for k in range(P + 1)]
        return [missing if h is None else base[h[0]] + lists[h[0]][rank].index(h[1]) for h in needs]

    halo_recv = sum(len(halo[s][rank]) for s in range(P))
    return {"cu_seqlens": part.local_cu_seqlens(rank),
            "export_rows": [row for t in range(P) for row in halo[rank][t]],
            "import_rows": at(halo, halo_needs[rank], halo_recv),
            "frag_info": [min(o, 3) | (4 if o + n < lengths[d] else 0) for d, o, n in part.fragments[rank]],
            "g_rows": [g[rank][t][row] for t in range(P) for row in g_sorted[rank][t]],
            "g_import": at(g_sorted, g_needs[rank], -1),
            "halo_send_splits": tuple(len(halo[rank][t]) for t in range(P)),
            "halo_recv_splits": tuple(len(halo[s][rank]) for s in range(P)),
            "g_send_splits": tuple(len(g_sorted[rank][t]) for t in range(P)),
            "g_recv_splits": tuple(len(g_sorted[s][rank]) for s in range(P))}


# The phases of one CP call over tensors of the same tokens (xs[i] with weights[i] and biases[i]:
# tuples), each on the current stream (the torch binding's cp_autograd_forward and its node run
# them with the collectives between): the tests run several ranks' phases in one process, with
# exchanged_by_hand between.

def send_rows(cp: CPContext, xs, weights, biases) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward exchange's buffers: (this rank's halo rows for every rank, every x's columns
    side by side, ``[sum(halo_send_splits), sum C]``; the buffer it receives into, with a spare
    row after the received rows that the heads pass never reads)."""
    return _native("cp_send", weights, biases, xs[0].get_device(), xs, cp.export_rows, sum(cp.halo_recv_splits))


def forward_interior(cp: CPContext, xs, weights, biases) -> tuple[torch.Tensor, ...]:
    """y of every local token, each fragment read as a document (head rows of continuing
    fragments still to fix)."""
    return _native("cp_forward", weights, biases, xs[0].get_device(), xs, weights, biases, cp.cu_seqlens)


def forward_heads(cp: CPContext, ys, xs, weights, biases, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each x's halos ``[num_fragments, 3, C]`` from the received rows, and with them y of the
    head rows of the fragments that continue their documents rewritten."""
    return _native("cp_forward_heads", weights, biases, xs[0].get_device(), tuple(ys), xs, weights, biases, received,
                   cp.import_rows, cp.cu_seqlens, cp.frag_info, cp.head_frags)


def grad_send(cp: CPContext, xs, dys, weights, biases, halos, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward exchange's buffers, FP32: (the g of the head tokens this rank sends each
    rank, every tensor's columns side by side, ``[sum(g_send_splits), sum C]``; the buffer it
    receives into)."""
    return _native("cp_grad_send", weights, biases, xs[0].get_device(), xs, tuple(dys), weights, biases, tuple(halos),
                   cp.cu_seqlens, cp.frag_info, cp.g_rows, sum(cp.g_recv_splits), policy)


def backward_interior(cp: CPContext, xs, dys, weights, biases, halos, policy: str):
    """(dxs, dweights, dbiases) of every tensor (a dbias None without bias; dx of the tail rows of
    continuing fragments still to fix)."""
    n = len(xs)
    grads = _native("cp_backward", weights, biases, xs[0].get_device(), xs, tuple(dys), weights, biases, tuple(halos),
                    cp.cu_seqlens, cp.frag_info, policy)
    return grads[:n], grads[n: 2 * n], grads[2 * n:]


def backward_tails(cp: CPContext, dxs, xs, dys, weights, biases, halos, received: torch.Tensor,
                   policy: str) -> None:
    """Rewrites dx of the tail rows of the fragments whose documents go on after them."""
    _native("cp_backward_tails", weights, biases, xs[0].get_device(), tuple(dxs), xs, tuple(dys), weights, biases,
            tuple(halos), received, cp.cu_seqlens, cp.frag_info, cp.tail_frags, cp.g_import, policy)
