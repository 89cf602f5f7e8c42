// The backward's token groups and workspace size: plain C++ (no CUDA, no torch), shared
// by the kernels' launcher and the torch binding, so the sizes the binding allocates and the sizes
// the launcher checks come from one place (flashinfer_cake/_plan.py restates bwd_groups_bound and
// bwd_workspace_bytes for the Python layer, which must size a workspace before anything is built,
// and reads the rest from this header; tests/test_contract.py compares).
#pragma once

#include <stdint.h>

#include <algorithm>
#include <initializer_list>
#include <utility>

namespace flashinfer_cake {

// Partial rows per token group: the four taps' g*x sums, then the sum of g.
constexpr int kBwdPartialRows = 5;

// Most tokens of one token group (the item_tokens argument): the positions of a group's tokens
// and their 3-token lookahead sit in shared memory for the whole group.
constexpr int kBwdMaxItemTokens = 1024;

// Token groups are whole multiples of this many tokens (the shipped strip, CAKE_BWD_STRIP_LEN), but for the
// even-run choice's (bwd_item_tokens).
constexpr int kBwdPlanStripLen = 64;

// Token groups of the routes that walk even runs (the kernel's kLongWalk: Wide, WideVec8 and Mid, on groups
// of a 256-token sub-tile or more) may be any multiple of this many tokens: a 4-row step for each of
// their 4 strips. The others walk whole strips.
constexpr int kBwdPlanRunGroupTokens = 16;

// The routes of the shipped geometry (causal_conv1d_bwd_launcher.cuh checks): C above this many
// channels runs 32 channel lanes, in CTAs of 128 threads when a token group has at least
// kBwdPlanFullTileTokens tokens (one sub-tile of the full CTA), else of 64.
constexpr int kBwdPlanWideMinC = 64;
constexpr int kBwdPlanFullTileTokens = 256;
// C up to this many channels runs routes of 16 strips (a 1024-token sub-tile): their token groups
// are as long as groups get.
constexpr int kBwdPlanNarrowMaxC = 32;

// CTA slots of the full-width routes in 128-channel items: 4 CTAs of 128 channels (Wide) or 2 of 256
// (WideVec8) on each of the 132 SMs of an H100 SXM / H200 (the launcher asserts the 4 for its shipped
// geometry). bwd_groups sizes the grid's waves by it; on a 114-SM H100 PCIe the waves it counts are
// not the GPU's, but the plan stays a function of (S, C) only. bwd_busiest_sm_work counts the same SMs
// for the launcher's choice between 16- and 8-byte rows.
constexpr int kBwdPlanSms = 132;
constexpr int kBwdPlanWaveItems = 4 * kBwdPlanSms;

// Fan-in of the reduction tree: each node adds the rows of up to this many nodes of the level
// below (level 0: the token groups), level after level up to a single root.
constexpr int kBwdChunk = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Token groups for about 1024 work items (groups x 128-channel tiles) of 128 to 1024 tokens (fewer
// when S itself is shorter): bwd_groups' first choice.
inline int64_t bwd_groups_for_items(int64_t S, int64_t C) {
  const int64_t for_items = ceil_div(1024, ceil_div(C, 128));
  return std::min(ceil_div(S, 128), std::max(ceil_div(S, kBwdMaxItemTokens), for_items));
}

// The most uniform token groups a backward of S tokens x C channels may use: the first choice, or what
// bwd_uniform_groups' wave choice may take at C > 64: groups of 512 tokens, at most 14 waves of them
// (a grid of more waves never gains its 1/8). bwd_item_tokens' even-run choice stays within it too.
// Non-decreasing in S.
inline int64_t bwd_uniform_groups_bound(int64_t S, int64_t C) {
  const int64_t wave_choice =
      C > kBwdPlanWideMinC ? std::min(ceil_div(S, 512), ceil_div(14 * kBwdPlanWaveItems, ceil_div(C, 128))) : 0;
  return std::max(bwd_groups_for_items(S, C), wave_choice);
}

// The most token groups a backward of S tokens x C channels may use: that, or with bwd_last_wave_split's
// split at C > 64 (at most ceil(kBwdPlanWaveItems / ceil(C / 128)) groups in the place of one or more,
// every group of at least 256 tokens); bwd_tail's other split keeps within it. Non-decreasing in S, so
// the workspace sized from it for the largest S serves every smaller one.
inline int64_t bwd_groups_bound(int64_t S, int64_t C) {
  const int64_t uniform = bwd_uniform_groups_bound(S, C);
  if (C <= kBwdPlanWideMinC) return uniform;
  return std::max(uniform, std::min(ceil_div(S, kBwdPlanFullTileTokens), uniform - 1 + ceil_div(kBwdPlanWaveItems, ceil_div(C, 128))));
}

// Tokens per group when S is split over `groups` groups: whole strips, at most that many groups
// then cover S.
inline int64_t bwd_tokens_per_group(int64_t S, int64_t groups) {
  return std::max<int64_t>(ceil_div(S, kBwdPlanStripLen * std::max<int64_t>(groups, 1)) * kBwdPlanStripLen, kBwdPlanStripLen);
}

// Uniform token groups of a backward of S tokens x C channels: how many item_tokens-token groups cover
// S before bwd_tail splits them.
// Groups shorter than a full CTA's 256-token sub-tile run on CTAs of half the threads (8 per SM),
// or with strips of half the length on small grids (the launcher's route rule): bwd_groups_for_items'
// ~1024 items fill the 132 SMs of an H100 SXM / H200 about once. When C > 64
// and the groups are 256 tokens or longer, CTAs have 128 threads (4 per SM): ~512 items fill those
// SMs once, where 1024 ran two waves, each SM slot paying a CTA's start and end twice (8192x4096
// 66 -> 69 %, 32768x1024 59 -> 67 %, 65536x512 53 -> 64 % of copy; tune.py ITEM_TOKENS, H200,
// 2026-12-01; on a 114-SM H100 PCIe, ~1.1 waves). C <= 32 runs routes whose CTAs have 16
// strips (1024 tokens): ceil(S / 1024) groups of up to 1024 tokens (no idle strip once S >= 1024).
// A function of (S, C) only, so the summation order, and with it every bit of dweight/dbias, is
// the same on every GPU.
// Then the grid's last wave: of that choice and groups of about 1024, 768 or 512 tokens, the one
// whose waves (ceil(items / kBwdPlanWaveItems)) times tokens per group is least (the first on a tie:
// the first choice, then the longer groups), when it is 1/8 less than the first choice's. A grid
// just over a whole number of waves leaves its last wave nearly empty, and its few CTAs run as long
// as a full wave's: 16384x4352 (Mamba2's xBC width) took 16 groups x 34 items = 544 > 528 (172.6 us,
// 60 % of copy), in 768-token groups 158.6 us, in 512 146.3 (a tie for the model, which takes 768:
// 512 lost at the next two); 16384x6144 208.0 -> 163.9 (768; 512 167.1), 32768x4352 273.7 -> 238.5
// (768; 512 250.2), 8192x4352 in 512-token groups 93.5 -> 82.3 (768); 16384x4096 114.1 in 1024 and
// 114.6 in 512 (0.97 or 1.94 waves: the same cost, the first choice kept) (tune.py ITEM_TOKENS, H200,
// 2026-12-04, r155).
inline int64_t bwd_uniform_groups(int64_t S, int64_t C) {
  if (C <= kBwdPlanNarrowMaxC) return ceil_div(S, kBwdMaxItemTokens);
  const int64_t groups = bwd_groups_for_items(S, C);
  if (C <= kBwdPlanWideMinC || bwd_tokens_per_group(S, groups) < kBwdPlanFullTileTokens) return groups;
  const int64_t items_per_group = ceil_div(C, 128);
  const auto launched = [&](int64_t g) { return ceil_div(S, bwd_tokens_per_group(S, g)); };
  const auto cost = [&](int64_t g) {
    return bwd_tokens_per_group(S, g) * ceil_div(launched(g) * items_per_group, kBwdPlanWaveItems);
  };
  const int64_t first = std::max(ceil_div(S, kBwdMaxItemTokens), std::min(groups, ceil_div(512, items_per_group)));
  const int64_t bound = bwd_uniform_groups_bound(S, C);
  int64_t best = first;
  for (const int64_t tokens : {int64_t(kBwdMaxItemTokens), int64_t(768), int64_t(512)}) {
    const int64_t g = std::min(bound, ceil_div(S, tokens));
    if (cost(g) < cost(best)) best = g;
  }
  // Only a clear gain (1/8) changes the first choice: with many waves the model's differences are
  // small and unmeasured.
  return 8 * cost(best) < 7 * cost(first) ? best : first;
}

// A split of the token groups (bwd_tail): the first big_groups token groups have item_tokens tokens, the
// others tail_tokens (the batch's last group: up to them). big_groups == 0: uniform groups
// (tail_tokens == item_tokens).
struct BwdTail {
  int64_t big_groups;
  int64_t tail_tokens;
};

// Token groups of S tokens in item_tokens-token groups split by `tail`.
inline int64_t bwd_group_count(int64_t S, int64_t item_tokens, BwdTail tail) {
  return tail.big_groups + ceil_div(S - tail.big_groups * item_tokens, tail.tail_tokens);
}

// The grid's last wave, split (bwd_tail's first rule). Uniform groups whose grid
// runs a little past a whole number of waves leave the last wave's few CTAs walking a whole group
// while most SMs idle. Instead: as many item_tokens-token groups as fill the whole waves, then the
// rest of S in groups of tail_tokens (whole 256-token sub-tiles, enough for about one wave), which
// the block scheduler starts as the long groups end, with the batch's last group the first of them
// (the kernel's launch order). Taken when the model (tokens per group x waves: whole waves of long
// groups, then those of the tail) says 1/8 less than the uniform grid's, at C > 64 on groups of a
// whole sub-tile (the full-width routes, whose waves kBwdPlanWaveItems counts).
inline BwdTail bwd_last_wave_split(int64_t S, int64_t C, int64_t item_tokens) {
  const BwdTail uniform{0, item_tokens};
  if (C <= kBwdPlanWideMinC || item_tokens < kBwdPlanFullTileTokens || S <= item_tokens) return uniform;
  const int64_t units = ceil_div(C, 128), groups = ceil_div(S, item_tokens);
  const int64_t whole_waves = groups * units / kBwdPlanWaveItems;
  const int64_t big = whole_waves * kBwdPlanWaveItems / units;
  if (big == 0 || big >= groups) return uniform;
  const int64_t rest = S - big * item_tokens;
  const int64_t tail = ceil_div(ceil_div(rest * units, kBwdPlanWaveItems), kBwdPlanFullTileTokens) * kBwdPlanFullTileTokens;
  const int64_t tail_waves = ceil_div(ceil_div(rest, tail) * units, kBwdPlanWaveItems);
  const int64_t cost = whole_waves * item_tokens + tail_waves * tail;
  const int64_t uniform_cost = ceil_div(groups * units, kBwdPlanWaveItems) * item_tokens;
  return 8 * cost < 7 * uniform_cost ? BwdTail{big, tail} : uniform;
}

// The busiest SM's work when the launch's token groups (groups of them: item_tokens-token ones, split
// by `tail`) run in items of `channels` channels, in channel-tokens: each phase of the launch
// (bwd_tail's long groups, then the rest) puts ceil(CTAs / kBwdPlanSms) CTAs on some SM.
inline int64_t bwd_busiest_sm_work(int64_t C, int64_t groups, int64_t item_tokens, BwdTail tail, int64_t channels) {
  const int64_t tiles = ceil_div(C, channels);
  const auto phase = [&](int64_t n, int64_t tokens) { return ceil_div(n * tiles, kBwdPlanSms) * channels * tokens; };
  return phase(tail.big_groups, item_tokens) + phase(groups - tail.big_groups, tail.tail_tokens);
}

// The launcher's choice between its two full-width routes at C a multiple of 256 (the same bits either
// way, so not the plan's summation order, but a function of the same shape): 16-byte rows (WideVec8,
// 256-channel items, 2 CTAs per SM) only where their busiest SM carries at most 1/div more work than
// the 8-byte rows' (Wide, 128-channel items, 4 per SM); div 0: always. The 16-byte rows gain 3-6 %
// where both grids load the SMs alike; where their coarser items leave the busiest SM more work, Wide
// wins. tune.py, H200, 2026-12-04, 1 document, rested, WideVec8 -> Wide (WIDE_VEC8=0), µs, by the ratio
// of the busiest SMs' work (r160, r161; the plan's groups then, before the even-run choice, which has since
// given the 4352-channel shapes groups that balance the 16-byte rows):
//   4 : 3: 8192x4352 (11 groups: WideVec8's 187 CTAs put 2 of 256 channels on 55 SMs, Wide's 374 at
//   most 3 of 128) 81.8 -> 71.4, 4096x12288 111.6 -> 92.1; 1.14: 8192x10240 159.6 -> 152.0, 16384x7168
//   210.5 -> 198.5, 24576x3584 161.3 -> 152.3; 1.11: 16384x4352 (the split) 136.5 -> 132.9, 32768x2304
//   136.8 -> 132.8; 1.09: 24576x7168 310.3 -> 302.4; 1.07: 24576x10240 410.9 -> 404.6; 1.06: 28672x10240
//   504.7 -> 457.4; 1.05: 26624x6144 271.0 -> 265.4, 30720x5120 268.6 -> 264.5;
//   1.02: 20480x10240 327.1 -> 337.6; 1 (equal): 16384x4096 113.1 -> 119.9, 16384x8192 216.1 -> 226.2.
constexpr int64_t kBwdVec8BalanceDiv = 32;
inline bool bwd_vec8_balanced(int64_t C, int64_t groups, int64_t item_tokens, BwdTail tail, int64_t vec8_channels = 256,
                              int64_t wide_channels = 128, int64_t div = kBwdVec8BalanceDiv) {
  return div == 0 || div * bwd_busiest_sm_work(C, groups, item_tokens, tail, vec8_channels) <=
                         (div + 1) * bwd_busiest_sm_work(C, groups, item_tokens, tail, wide_channels);
}

// Whether a stateless launch of these groups runs in 16-byte rows: C a multiple of their items' channels
// and bwd_vec8_balanced. The launcher takes its route by it (with states it asks more), the even-run
// choice's cost prices the grid by it.
inline bool bwd_vec8_rows(int64_t C, int64_t groups, int64_t item_tokens, BwdTail tail, int64_t vec8_channels = 256,
                          int64_t wide_channels = 128, int64_t div = kBwdVec8BalanceDiv) {
  return C % vec8_channels == 0 && bwd_vec8_balanced(C, groups, item_tokens, tail, vec8_channels, wide_channels, div);
}

// The split of a backward's token groups as launched (the launcher applies it to any item_tokens):
// bwd_last_wave_split's, else, on a grid of many waves, the last eighth of S in short groups, launched after
// the long groups: in Wide's 8-byte rows (not bwd_vec8_rows, with the split or without) from 15/8 waves on,
// in groups of 256 tokens; on a grid of 16-byte rows (bwd_vec8_rows without the split; with it the launcher
// may take Wide) from 9/2 waves on whose last wave is at most 7/8 full, in groups of 512.
// The CTAs of a wave do not end together (the slots of an SM finish ~10 % apart, r103), so the last wave's
// items start at uneven times and its last CTAs walk alone; short items last, started as slots free up, even
// that out. The model of the other rules (tokens x waves) does not see it: measured. tune.py, H200,
// 2026-12-04, rested, µs, uniform (TAIL=0) -> the last eighth in 256 (r184): 1048576x128 225.9 -> 220.0 (85
// -> 87 % of copy; 4096 documents 226.3 -> 221.0, with states 229.1 -> 222.4), 2097152x128 428.5 -> 415.9,
// 262144x384 172.5 -> 168.5, 524288x192 221.1 -> 215.6, 24576x7432 311.1 -> 306.5, 24576x10240 400.1 ->
// 390.7; 1048576x640 (9.7 waves) 1009.2 / 1010.2. The last quarter gained 0.2-2 % less, the last half 0.3-0.6 %
// slower to 0.6 % faster (r183). 16-byte rows (2 CTAs per SM, each CTA's start less hidden), the plan ->
// the last eighth in 512 / in 256 (r186-r188, exptail's forced split): 1.94 waves 2-4 % / 1-3 % slower
// (16384x8192 215.2 -> 220.3 / 217.4), 3.9 waves 1-2 % slower / equal to 0.7 % slower (65536x4096 414.0 ->
// 421.5 / 417.1); 4.85 waves 40960x8192 523.2 -> 514.9 / 513.6, 81920x4096 517.6 -> 514.6 / 513.6; 5.8
// waves 49152x8192 630.8 -> 614.0 / 614.7, 98304x4096 618.5 -> 614.8 / 613.4, 196608x2048 (32 documents)
// 621.3 -> 614.5 / 612.8; 7.8 waves 131072x4096 819.5 -> 804.5 / 809.8, 1048576x512 (64) 822.2 -> 809.5 /
// 814.0; 9.7 waves 81920x8192 1034.2 -> 1014.0 / 1019.5, 163840x4096 1019.3 -> 1000.7 / 1006.4; 11.6 waves
// 98304x8192 1239.8 -> 1221.6 / 1222.0 (the last quarter in 512: 0.5 % slower to 1.7 % faster). The split
// grids of 4.85 and 5.8 waves ran on Wide (their 16-byte rows would load the SMs unevenly). A full last wave
// leaves nothing to fill: the even-run choice's grids of 4.9-5.0 waves lost, main -> the last eighth in 512
// (r189): 28672x10240 (5.0 waves of 880-token groups) 445.9 -> 452.1, 40960x7168 (4.98) 448.8 -> 454.4,
// 131072x2304 (4.91) 465.1 -> 477.8; so did 3.9 waves (last wave 0.88 full). Taken (r189, main -> tree):
// 49152x8192 631.9 -> 614.9, 131072x4096 820.0 -> 805.3, 81920x8192 1034.7 -> 1013.6, 98304x6144 (8.7
// waves, on Wide) 920.6 -> 909.7, 196608x3072 (32 documents) 924.7 -> 910.6, 1048576x512 (64) 822.1 -> 809.8.
// Only within bwd_groups_bound (the workspace is unchanged), which ends it at ~11 waves of 8-byte rows
// (5898240x128, 100352x7432: uniform groups again) and ~13 of 16-byte rows; never with no
// long group (a short S of a very wide C).
inline BwdTail bwd_tail(int64_t S, int64_t C, int64_t item_tokens) {
  const BwdTail split = bwd_last_wave_split(S, C, item_tokens);
  if (split.big_groups != 0 || C <= kBwdPlanWideMinC) return split;
  const int64_t uniform_groups = ceil_div(S, item_tokens), items = uniform_groups * ceil_div(C, 128);
  const bool vec8 = bwd_vec8_rows(C, uniform_groups, item_tokens, split);
  const int64_t tail_tokens = vec8 ? 2 * kBwdPlanFullTileTokens : kBwdPlanFullTileTokens;
  const int64_t last_wave = items % kBwdPlanWaveItems;  // the uniform grid's last wave, in 128-channel items
  const bool takes = vec8 ? 2 * items >= 9 * kBwdPlanWaveItems && last_wave != 0 && 8 * last_wave <= 7 * kBwdPlanWaveItems
                          : 8 * items >= 15 * kBwdPlanWaveItems;
  if (!takes || item_tokens <= tail_tokens) return split;
  const BwdTail last_eighth{7 * S / (8 * item_tokens), tail_tokens};
  const int64_t groups = bwd_group_count(S, item_tokens, last_eighth);
  if (last_eighth.big_groups == 0 || groups > bwd_groups_bound(S, C) || (!vec8 && bwd_vec8_rows(C, groups, item_tokens, last_eighth))) {
    return split;
  }
  return last_eighth;
}

// The even-run choice's cost of groups of item_tokens tokens (bwd_last_wave_split's split applied, on the
// route the launcher takes for them): per CTA slot (4 Wide CTAs or 2 WideVec8 CTAs per SM), waves of the grid times
// the tokens of a group plus kBwdPlanItemCostTokens (a CTA's start and end: its position scan, its first
// rows' latency, its partial rows), the 16-byte rows' waves 3 % dearer (fitted to r172's 66 timings; the
// model's ranking, not its values, is what the choice uses).
constexpr int64_t kBwdPlanItemCostTokens = 96;
inline int64_t bwd_even_run_cost(int64_t S, int64_t C, int64_t item_tokens) {
  const BwdTail tail = bwd_last_wave_split(S, C, item_tokens);
  const int64_t groups = bwd_group_count(S, item_tokens, tail);
  const bool vec8 = bwd_vec8_rows(C, groups, item_tokens, tail);
  const int64_t tiles = ceil_div(C, vec8 ? 256 : 128), slots = vec8 ? kBwdPlanWaveItems / 2 : kBwdPlanWaveItems;
  const auto waves = [&](int64_t n) { return ceil_div(n * tiles, slots); };
  const int64_t per_slot = waves(tail.big_groups) * (item_tokens + kBwdPlanItemCostTokens) +
                           waves(groups - tail.big_groups) * (tail.tail_tokens + kBwdPlanItemCostTokens);
  return per_slot * (vec8 ? 103 : 100);
}

// Tokens per group of a backward of S tokens x C channels (the item_tokens argument: the groups before
// bwd_tail's split, and the long groups after it). bwd_uniform_groups' whole strips, unless, at C a
// multiple of 128 on the full-width routes (C > 64, groups of 256+ tokens), groups of another multiple of
// kBwdPlanRunGroupTokens from 1024 down to 256 tokens cost 1/16 less by bwd_even_run_cost (the longest
// of equal costs; no more groups than bwd_uniform_groups_bound, which sizes the workspace). The CTAs walk
// a group in 4 even runs, so a group need not be whole sub-tiles, and a grid can fill its last wave
// where whole strips left it part empty. tune.py, H200, 2026-12-04, rested, 1 document, µs, the plan
// before -> this choice: 16384x4352 (Mamba2's xBC width) 132.6 -> 120.0 (544 tokens; 78 -> 86 % of
// copy), 8192x4352 71.6 -> 63.7 (560), 24576x3584 152.3 -> 145.0 (672), 16384x7168 198.0 -> 191.0
// (912), 32768x3328 198.3 -> 174.3 (832; 80 -> 91 %), each the fastest of seven group lengths timed
// (r173); out of the fit's sample (r174): 24576x7168 301.4 -> 273.0 (880; 84 -> 93 %), 8192x7168 111.6
// -> 101.1 (912), 8192x10240 151.8 -> 138.9 (640), 32768x2304 136.6 -> 125.2 (880, split), 16384x10240
// 268.6 -> 262.7 (1024, split), 4096x12288 92.2 -> 90.7 (832). Not at C % 128 != 0, whose last channel
// tile is part empty: at 8768x7432 the model's 528 read 124.0 against the plan's 120.2.
inline int64_t bwd_item_tokens(int64_t S, int64_t C) {
  const int64_t first = bwd_tokens_per_group(S, bwd_uniform_groups(S, C));
  if (C <= kBwdPlanWideMinC || C % 128 != 0 || first < kBwdPlanFullTileTokens) return first;
  const int64_t bound = bwd_uniform_groups_bound(S, C), first_cost = bwd_even_run_cost(S, C, first);
  int64_t best = first, best_cost = first_cost;
  for (int64_t t = kBwdMaxItemTokens; t >= kBwdPlanFullTileTokens && ceil_div(S, t) <= bound; t -= kBwdPlanRunGroupTokens) {
    const int64_t cost = bwd_even_run_cost(S, C, t);
    if (cost < best_cost) {
      best = t;
      best_cost = cost;
    }
  }
  return 16 * best_cost < 15 * first_cost ? best : first;
}

// Token groups of a backward of S tokens x C channels as launched (one partial row of dweight/dbias
// each): bwd_item_tokens' groups, split by bwd_tail.
inline int64_t bwd_groups(int64_t S, int64_t C) {
  const int64_t item_tokens = bwd_item_tokens(S, C);
  return bwd_group_count(S, item_tokens, bwd_tail(S, C, item_tokens));
}

// The workspace: FP32 partial rows [groups][kBwdPartialRows][C]. Any content: every row a call
// reads was written by the same call first (the streaming kernel, or an earlier reduction pass).
inline int64_t bwd_workspace_bytes_for_groups(int64_t C, int64_t groups) {
  return groups * kBwdPartialRows * C * int64_t(sizeof(float));
}

// What the caller provides: enough for bwd_groups_bound(S, C) token groups (at least
// bwd_groups(S, C)); 0 when S == 0. Non-decreasing in S, so a buffer for the largest S serves
// every smaller one.
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C) { return bwd_workspace_bytes_for_groups(C, bwd_groups_bound(S, C)); }

// Row-strided views whose rows start 128 bytes past a 256-byte boundary (a column slice at an odd multiple
// of 64 channels of a buffer whose row pitch is a multiple of 256 bytes) ran the backward 7.6-9.7 % slower
// than contiguous rows, slices whose rows start on a boundary 0-3 % (r153, H200, 16-byte rows, NOTES_bwd
// session 39): each 512-byte channel tile then spans three 256-byte blocks, two of them shared with the
// neighbouring tiles. So the full-width stateless kernels rotate their channel slots until their tiles
// start this many bytes into the rows, i.e. on the rows' 256-byte blocks (the launcher's bwd_vec_shift).
// H100 (NOTES_bwd session 58, WideVec8's shapes): 1.2-2.3 % faster at column 64 of [S, C + 128], of which
// 0.3-0.7 % showed on contiguous shapes too (no rotation there); H200 (session 60): 0.7-3.9 %. Of x, dy and
// dx (each: its address mod 256, its row pitch in bytes), those whose every row has the same offset (pitch
// a multiple of 256 bytes) vote with their offset; the most votes win, a tie goes to 0 if it is among
// them (no rotation), else to the first stream's offset (x, then dy).
constexpr int64_t kBwdRowBlockBytes = 256;
inline int64_t bwd_row_block_offset(std::initializer_list<std::pair<int64_t, int64_t>> address_and_row_bytes) {
  int64_t offsets[3] = {}, best = 0;
  int n = 0, best_votes = 0;
  for (const auto& [address, row_bytes] : address_and_row_bytes) {
    if (n < 3 && row_bytes % kBwdRowBlockBytes == 0) offsets[n++] = address % kBwdRowBlockBytes;
  }
  for (int i = 0; i < n; ++i) {
    const int votes = static_cast<int>(std::count(offsets, offsets + n, offsets[i]));
    if (votes > best_votes || (votes == best_votes && offsets[i] == 0)) best = offsets[i], best_votes = votes;
  }
  return best;
}

}  // namespace flashinfer_cake
