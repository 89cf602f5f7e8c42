"""The context-parallel all_to_alls done by hand on one process (tests/test_cp.py, test_cp_gpu.py),
and the conv's phases one by one (test_cp_gpu.py)."""

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


# The phases of one CP call over tensors of the same tokens (xs[i] with weights[i] and biases[i]:
# tuples), each on the current stream (the torch binding's cp_autograd_forward and its node run
# them with the collectives between): the tests run several ranks' phases in one process, with
# exchanged_by_hand between.

def send_rows(cp: CPContext, xs, weights, biases) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward exchange's buffers: (this rank's halo rows for every rank, every x's columns
    side by side, ``[sum(halo_send_splits), sum C]``; the buffer it receives into, with a zero
    row after the received rows)."""
    return _native("cp_send", weights, biases, xs[0].get_device(), xs, cp.export_rows, sum(cp.halo_recv_splits))


def forward_interior(cp: CPContext, xs, weights, biases) -> tuple[torch.Tensor, ...]:
    """y of every local token, each fragment read as a document (head rows of continuing
    fragments still to fix)."""
    return _native("cp_forward", weights, biases, xs[0].get_device(), xs, weights, biases, cp.cu_seqlens)


def forward_heads(cp: CPContext, ys, xs, weights, biases, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each x's halos ``[num_fragments, 3, C]`` from the received rows, and with them y of the
    head rows of the fragments that continue their documents rewritten."""
    return _native("cp_forward_heads", weights, biases, xs[0].get_device(), tuple(ys), xs, weights, biases, received,
                   cp.import_rows, cp.cu_seqlens, cp.frag_info)


def grad_send(cp: CPContext, xs, dys, weights, biases, halos, round_preact: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward exchange's buffers, FP32: (the g of the head tokens this rank sends each
    rank, every tensor's columns side by side, ``[sum(g_send_splits), sum C]``; the buffer it
    receives into)."""
    return _native("cp_grad_send", weights, biases, xs[0].get_device(), xs, tuple(dys), weights, biases, tuple(halos),
                   cp.cu_seqlens, cp.frag_info, cp.g_rows, sum(cp.g_recv_splits), round_preact)


def backward_interior(cp: CPContext, xs, dys, weights, biases, halos, round_preact: int):
    """(dxs, dweights, dbiases) of every tensor (a dbias None without bias; dx of the tail rows of
    continuing fragments still to fix)."""
    n = len(xs)
    grads = _native("cp_backward", weights, biases, xs[0].get_device(), xs, tuple(dys), weights, biases, tuple(halos),
                    cp.cu_seqlens, round_preact)
    return grads[:n], grads[n: 2 * n], grads[2 * n:]


def backward_tails(cp: CPContext, dxs, xs, dys, weights, biases, halos, received: torch.Tensor,
                   round_preact: int) -> None:
    """Rewrites dx of the tail rows of the fragments whose documents go on after them."""
    _native("cp_backward_tails", weights, biases, xs[0].get_device(), tuple(dxs), xs, tuple(dys), weights, biases,
            tuple(halos), received, cp.cu_seqlens, cp.frag_info, cp.g_import, round_preact)
