"""The backward's token groups and buffer sizes, as include/flashinfer_cake/causal_conv1d_bwd_plan.h
defines them (the launcher and the torch binding use the header). The Python layer must size a
workspace before anything is built, so it computes the same rule here; tests/test_contract.py
compiles the header and fails when the two drift."""

from __future__ import annotations

PARTIAL_ROWS = 5  # kBwdPartialRows: the four taps' g*x sums, then the sum of g
MAX_ITEM_TOKENS = 1024  # kBwdMaxItemTokens
STRIP_LEN = 64  # kBwdPlanStripLen
WIDE_MIN_C = 64  # kBwdPlanWideMinC
FULL_TILE_TOKENS = 256  # kBwdPlanFullTileTokens
NARROW_MAX_C = 32  # kBwdPlanNarrowMaxC
WAVE_ITEMS = 4 * 132  # kBwdPlanWaveItems


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _groups_for_items(S: int, C: int) -> int:
    """bwd_groups_for_items: bwd_groups' first choice."""
    for_items = _ceil_div(1024, _ceil_div(C, 128))
    return min(_ceil_div(S, 128), max(_ceil_div(S, MAX_ITEM_TOKENS), for_items))


def groups_bound(S: int, C: int) -> int:
    """bwd_groups_bound: the most token groups (sizes the workspace)."""
    wave_choice = min(_ceil_div(S, 512), _ceil_div(14 * WAVE_ITEMS, _ceil_div(C, 128))) if C > WIDE_MIN_C else 0
    return max(_groups_for_items(S, C), wave_choice)


def _tokens_per_group(S: int, groups: int) -> int:
    """bwd_tokens_per_group: whole strips."""
    return max(_ceil_div(S, STRIP_LEN * max(groups, 1)) * STRIP_LEN, STRIP_LEN)


def groups(S: int, C: int) -> int:
    """bwd_groups: token groups of a backward of S tokens x C channels (the wave choice included)."""
    if C <= NARROW_MAX_C:
        return _ceil_div(S, MAX_ITEM_TOKENS)
    n = _groups_for_items(S, C)
    if C <= WIDE_MIN_C or _tokens_per_group(S, n) < FULL_TILE_TOKENS:
        return n
    items = _ceil_div(C, 128)

    def cost(g: int) -> int:  # tokens per group x waves of the launched grid
        tokens = _tokens_per_group(S, g)
        return tokens * _ceil_div(_ceil_div(S, tokens) * items, WAVE_ITEMS)
    first = best = max(_ceil_div(S, MAX_ITEM_TOKENS), min(n, _ceil_div(512, items)))
    bound = groups_bound(S, C)
    for tokens in (MAX_ITEM_TOKENS, 768, 512):
        g = min(bound, _ceil_div(S, tokens))
        if cost(g) < cost(best):
            best = g
    return best if 8 * cost(best) < 7 * cost(first) else first


def item_tokens(S: int, C: int) -> int:
    """bwd_item_tokens: tokens per group, whole strips."""
    return _tokens_per_group(S, groups(S, C))


def workspace_bytes(S: int, C: int) -> int:
    """bwd_workspace_bytes: the FP32 partial rows of bwd_groups_bound's token groups."""
    return groups_bound(S, C) * PARTIAL_ROWS * C * 4

