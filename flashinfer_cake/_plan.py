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
SMS = 132  # kBwdPlanSms
WAVE_ITEMS = 4 * SMS  # kBwdPlanWaveItems
VEC8_BALANCE_DIV = 32  # kBwdVec8BalanceDiv
RUN_GROUP_TOKENS = 16  # kBwdPlanRunGroupTokens
ITEM_COST_TOKENS = 96  # kBwdPlanItemCostTokens


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _groups_for_items(S: int, C: int) -> int:
    """bwd_groups_for_items: bwd_groups' first choice."""
    for_items = _ceil_div(1024, _ceil_div(C, 128))
    return min(_ceil_div(S, 128), max(_ceil_div(S, MAX_ITEM_TOKENS), for_items))


def _uniform_groups_bound(S: int, C: int) -> int:
    """bwd_uniform_groups_bound: the most uniform token groups (the wave choice's and the even-run choice's
    candidates)."""
    wave_choice = min(_ceil_div(S, 512), _ceil_div(14 * WAVE_ITEMS, _ceil_div(C, 128))) if C > WIDE_MIN_C else 0
    return max(_groups_for_items(S, C), wave_choice)


def groups_bound(S: int, C: int) -> int:
    """bwd_groups_bound: the most token groups, the tail's split included (sizes the workspace)."""
    uniform = _uniform_groups_bound(S, C)
    if C <= WIDE_MIN_C:
        return uniform
    return max(uniform, min(_ceil_div(S, FULL_TILE_TOKENS), uniform - 1 + _ceil_div(WAVE_ITEMS, _ceil_div(C, 128))))


def _tokens_per_group(S: int, groups: int) -> int:
    """bwd_tokens_per_group: whole strips."""
    return max(_ceil_div(S, STRIP_LEN * max(groups, 1)) * STRIP_LEN, STRIP_LEN)


def _uniform_groups(S: int, C: int) -> int:
    """bwd_uniform_groups: item_tokens-token groups before the tail's split (the wave choice included)."""
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
    bound = _uniform_groups_bound(S, C)
    for tokens in (MAX_ITEM_TOKENS, 768, 512):
        g = min(bound, _ceil_div(S, tokens))
        if cost(g) < cost(best):
            best = g
    return best if 8 * cost(best) < 7 * cost(first) else first


def item_tokens(S: int, C: int) -> int:
    """bwd_item_tokens: tokens per group (the long groups after the tail's split): whole strips, or the
    even-run choice's multiple of RUN_GROUP_TOKENS."""
    first = _tokens_per_group(S, _uniform_groups(S, C))
    if C <= WIDE_MIN_C or C % 128 != 0 or first < FULL_TILE_TOKENS:
        return first
    bound, first_cost = _uniform_groups_bound(S, C), _even_run_cost(S, C, first)
    best, best_cost = first, first_cost
    t = MAX_ITEM_TOKENS
    while t >= FULL_TILE_TOKENS and _ceil_div(S, t) <= bound:
        cost = _even_run_cost(S, C, t)
        if cost < best_cost:
            best, best_cost = t, cost
        t -= RUN_GROUP_TOKENS
    return best if 16 * best_cost < 15 * first_cost else first


def _even_run_cost(S: int, C: int, tokens: int) -> int:
    """bwd_even_run_cost: per CTA slot, waves x (tokens of a group + ITEM_COST_TOKENS), 16-byte rows x1.03."""
    split = _last_wave_split(S, C, tokens)
    big, tail_tokens = split
    n = group_count(S, tokens, split)
    vec8 = _vec8_rows(C, n, tokens, split)
    tiles, slots = _ceil_div(C, 256 if vec8 else 128), WAVE_ITEMS // 2 if vec8 else WAVE_ITEMS
    per_slot = (_ceil_div(big * tiles, slots) * (tokens + ITEM_COST_TOKENS)
                + _ceil_div((n - big) * tiles, slots) * (tail_tokens + ITEM_COST_TOKENS))
    return per_slot * (103 if vec8 else 100)


def tail(S: int, C: int, item_tokens: int) -> tuple[int, int]:
    """bwd_tail: (big_groups, tail_tokens), the split of the launched groups; (0, item_tokens): none.
    _last_wave_split's, else the last eighth of S in short groups: on Wide's 8-byte rows (with the split and
    without) from 15/8 waves on in 256-token groups, on grids of 16-byte rows from 9/2 waves on whose last wave
    is at most 7/8 full in 512-token groups; within groups_bound and with a long group."""
    split = _last_wave_split(S, C, item_tokens)
    if split[0] != 0 or C <= WIDE_MIN_C:
        return split
    uniform_groups = _ceil_div(S, item_tokens)
    items = uniform_groups * _ceil_div(C, 128)
    vec8 = _vec8_rows(C, uniform_groups, item_tokens, split)
    tail_tokens = 2 * FULL_TILE_TOKENS if vec8 else FULL_TILE_TOKENS
    last_wave = items % WAVE_ITEMS
    takes = (2 * items >= 9 * WAVE_ITEMS and last_wave != 0 and 8 * last_wave <= 7 * WAVE_ITEMS if vec8
             else 8 * items >= 15 * WAVE_ITEMS)
    if not takes or item_tokens <= tail_tokens:
        return split
    last_eighth = (7 * S // (8 * item_tokens), tail_tokens)
    n = group_count(S, item_tokens, last_eighth)
    if last_eighth[0] == 0 or n > groups_bound(S, C) or (not vec8 and _vec8_rows(C, n, item_tokens, last_eighth)):
        return split
    return last_eighth


def _last_wave_split(S: int, C: int, item_tokens: int) -> tuple[int, int]:
    """bwd_last_wave_split: the split of the grid's last wave; (0, item_tokens): none."""
    uniform = (0, item_tokens)
    if C <= WIDE_MIN_C or item_tokens < FULL_TILE_TOKENS or S <= item_tokens:
        return uniform
    units, n = _ceil_div(C, 128), _ceil_div(S, item_tokens)
    whole_waves = n * units // WAVE_ITEMS
    big = whole_waves * WAVE_ITEMS // units
    if big == 0 or big >= n:
        return uniform
    rest = S - big * item_tokens
    tail_tokens = _ceil_div(_ceil_div(rest * units, WAVE_ITEMS), FULL_TILE_TOKENS) * FULL_TILE_TOKENS
    tail_waves = _ceil_div(_ceil_div(rest, tail_tokens) * units, WAVE_ITEMS)
    cost = whole_waves * item_tokens + tail_waves * tail_tokens
    uniform_cost = _ceil_div(n * units, WAVE_ITEMS) * item_tokens
    return (big, tail_tokens) if 8 * cost < 7 * uniform_cost else uniform


def group_count(S: int, item_tokens: int, split: tuple[int, int]) -> int:
    """bwd_group_count: token groups of S tokens in item_tokens-token groups split by `split` (tail())."""
    big, tail_tokens = split
    return big + _ceil_div(S - big * item_tokens, tail_tokens)


def groups(S: int, C: int) -> int:
    """bwd_groups: token groups as launched (the wave choice and the tail's split included)."""
    n = item_tokens(S, C)
    return group_count(S, n, tail(S, C, n))


def _busiest_sm_work(C: int, n_groups: int, item_tokens: int, split: tuple[int, int], channels: int) -> int:
    """bwd_busiest_sm_work: the busiest SM's channel-tokens in items of `channels` channels."""
    big, tail_tokens = split
    tiles = _ceil_div(C, channels)
    return (_ceil_div(big * tiles, SMS) * channels * item_tokens
            + _ceil_div((n_groups - big) * tiles, SMS) * channels * tail_tokens)


def _vec8_rows(C: int, n_groups: int, tokens: int, split: tuple[int, int]) -> bool:
    """bwd_vec8_rows (bwd_vec8_balanced's test after C % 256)."""
    return C % 256 == 0 and (VEC8_BALANCE_DIV * _busiest_sm_work(C, n_groups, tokens, split, 256)
                             <= (VEC8_BALANCE_DIV + 1) * _busiest_sm_work(C, n_groups, tokens, split, 128))


def vec8_rows(S: int, C: int) -> bool:
    """bwd_vec8_rows on the plan's groups: whether a stateless backward runs in 16-byte rows (WideVec8)
    rather than 8-byte rows (Wide): C % 256 == 0 and a grid that balances the SMs as well (the same
    bits either way)."""
    n = item_tokens(S, C)
    split = tail(S, C, n)
    return _vec8_rows(C, group_count(S, n, split), n, split)


def workspace_bytes(S: int, C: int) -> int:
    """bwd_workspace_bytes: the FP32 partial rows of bwd_groups_bound's token groups."""
    return groups_bound(S, C) * PARTIAL_ROWS * C * 4

