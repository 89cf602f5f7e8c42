// The backward's token groups and workspace size: plain C++ (no CUDA, no torch), shared
// by the kernels' launcher and the torch binding, so the sizes the binding allocates and the sizes
// the launcher checks come from one place (flashinfer_cake/_plan.py mirrors it for the Python
// layer, which must size a workspace before anything is built; tests/test_contract.py compares).
#pragma once

#include <stdint.h>

#include <algorithm>

namespace flashinfer_cake {

// Partial rows per token group: the four taps' g*x sums, then the sum of g.
constexpr int kBwdPartialRows = 5;

// Most tokens of one token group (the item_tokens argument): the positions of a group's tokens
// and their 3-token lookahead sit in shared memory for the whole group.
constexpr int kBwdMaxItemTokens = 1024;

// Token groups are whole multiples of this many tokens (the shipped strip, CAKE_BWD_STRIP_LEN).
constexpr int kBwdPlanStripLen = 64;

// The routes of the shipped geometry (causal_conv1d_bwd_launcher.cuh checks): C above this many
// channels runs 32 channel lanes, in CTAs of 128 threads when a token group has at least
// kBwdPlanFullTileTokens tokens (one sub-tile of the full CTA), else of 64.
constexpr int kBwdPlanWideMinC = 64;
constexpr int kBwdPlanFullTileTokens = 256;
// C up to this many channels runs routes of 16 strips (a 1024-token sub-tile): their token groups
// are as long as groups get.
constexpr int kBwdPlanNarrowMaxC = 32;

// Fan-in of the reduction tree: each node adds the rows of up to this many nodes of the level
// below (level 0: the token groups), level after level up to a single root.
constexpr int kBwdChunk = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most token groups a backward of S tokens x C channels may use: about 1024 work items
// (groups x 128-channel tiles) of 128 to 1024 tokens (fewer when S itself is shorter).
// Non-decreasing in S, so the workspace sized from it for the largest S serves every smaller one.
inline int64_t bwd_groups_bound(int64_t S, int64_t C) {
  const int64_t for_items = ceil_div(1024, ceil_div(C, 128));
  return std::min(ceil_div(S, 128), std::max(ceil_div(S, kBwdMaxItemTokens), for_items));
}

// Tokens per group when S is split over `groups` groups: whole strips, at most that many groups
// then cover S.
inline int64_t bwd_tokens_per_group(int64_t S, int64_t groups) {
  return std::max<int64_t>(ceil_div(S, kBwdPlanStripLen * std::max<int64_t>(groups, 1)) * kBwdPlanStripLen, kBwdPlanStripLen);
}

// Token groups of a backward of S tokens x C channels (one partial row of dweight/dbias each).
// Groups shorter than a full CTA's 256-token sub-tile run on CTAs of half the threads (8 per SM),
// or with strips of half the length on small grids (the launcher's route rule): bwd_groups_bound's
// ~1024 items fill the 132 SMs of an H100 SXM / H200 about once. When C > 64
// and the groups are 256 tokens or longer, CTAs have 128 threads (4 per SM): ~512 items fill those
// SMs once, where 1024 ran two waves, each SM slot paying a CTA's start and end twice (8192x4096
// 66 -> 69 %, 32768x1024 59 -> 67 %, 65536x512 53 -> 64 % of copy; tune.py ITEM_TOKENS, H200,
// 2026-12-01; on a 114-SM H100 PCIe, ~1.1 waves). C <= 32 runs routes whose CTAs have 16
// strips (1024 tokens): ceil(S / 1024) groups of up to 1024 tokens (no idle strip once S >= 1024).
// A function of (S, C) only, so the summation order, and with it every bit of dweight/dbias, is
// the same on every GPU.
inline int64_t bwd_groups(int64_t S, int64_t C) {
  if (C <= kBwdPlanNarrowMaxC) return ceil_div(S, kBwdMaxItemTokens);
  const int64_t groups = bwd_groups_bound(S, C);
  if (C <= kBwdPlanWideMinC || bwd_tokens_per_group(S, groups) < kBwdPlanFullTileTokens) return groups;
  return std::max(ceil_div(S, kBwdMaxItemTokens), std::min(groups, ceil_div(512, ceil_div(C, 128))));
}

// Tokens per group of a backward of S tokens x C channels (the item_tokens argument).
inline int64_t bwd_item_tokens(int64_t S, int64_t C) { return bwd_tokens_per_group(S, bwd_groups(S, C)); }

// The workspace: FP32 partial rows [groups][kBwdPartialRows][C]. Any content: every row a call
// reads was written by the same call first (the streaming kernel, or an earlier reduction pass).
inline int64_t bwd_workspace_bytes_for_groups(int64_t C, int64_t groups) {
  return groups * kBwdPartialRows * C * int64_t(sizeof(float));
}

// Workspace bytes a backward of S tokens x C channels in token groups of item_tokens tokens uses.
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C, int64_t item_tokens) {
  return bwd_workspace_bytes_for_groups(C, ceil_div(S, item_tokens));
}

// What the caller provides: enough for bwd_groups_bound(S, C) token groups (at least
// bwd_groups(S, C)); 0 when S == 0. Non-decreasing in S, so a buffer for the largest S serves
// every smaller one.
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C) { return bwd_workspace_bytes_for_groups(C, bwd_groups_bound(S, C)); }

}  // namespace flashinfer_cake
