"""Document-length generators shared by the GPU tests: lengths that sum to S, and cu_seqlens."""

from __future__ import annotations

import torch


def make_cu(S, lengths, device="cuda"):
    """int32 cu_seqlens on `device` from document lengths that sum to S (0 = empty document)."""
    assert sum(lengths) == S and min(lengths, default=0) >= 0, (S, lengths)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def split(S, n_docs, rng):
    """`n_docs` lengths summing to S at random cut points (repeated cuts are empty documents)."""
    cuts = sorted(rng.randint(0, S) for _ in range(n_docs - 1))
    bounds = [0, *cuts, S]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def fill(S, rng, choices, p_empty=0.0):
    """Lengths drawn from `choices` (the last one cut short) until they sum to S."""
    lengths, left = [], S
    while left:
        n = min(left, rng.choice(choices))
        lengths.append(n)
        left -= n
        if rng.random() < p_empty:
            lengths.append(0)
    return lengths


# Document mixes: (S, rng) -> lengths.
def one_doc(S, rng):
    return [S]


def docs_16_to_64(S, rng):
    return split(S, rng.randint(16, 64), rng)


def docs_3000(S, rng):
    return split(S, 3000, rng)


def empty_at_ends(S, rng):
    """Six random documents between empty ones: two before, three after."""
    return [0, 0] + split(S, 6, rng) + [0, 0, 0]


def tiny_docs(S, rng):
    """1-3 token documents and a few empty ones: every token is within 3 of a document start."""
    return fill(S, rng, (1, 1, 2, 3), p_empty=0.05)
