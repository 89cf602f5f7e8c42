"""The context-parallel all_to_alls done by hand on one process (tests/test_cp.py, test_cp_gpu.py)."""

from __future__ import annotations

import torch


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
