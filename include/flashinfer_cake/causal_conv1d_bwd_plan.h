// The backward's token groups, workspace and counter sizes: plain C++ (no CUDA, no torch), shared
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

// The narrowest channel tile of any route (8 lanes x 4 channels): there are counters for tiles of
// at least this many channels.
constexpr int kBwdMinTileChannels = 32;

// Token groups per chunk of the reduction tree (the kernel adds a chunk's rows, then the chunk
// sums).
constexpr int kBwdChunk = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Token groups of a backward of S tokens x C channels (one partial row of dweight/dbias each):
// about 1024 work items (groups x 128-channel tiles, a few waves of an H200's resident CTAs),
// with groups of 128 to 1024 tokens (fewer when S itself is shorter). Non-decreasing in S, so a
// workspace sized for the largest S serves every smaller one; a function of (S, C) only, so the
// summation order, and with it every bit of dweight/dbias, is the same on every GPU.
inline int64_t bwd_groups(int64_t S, int64_t C) {
  const int64_t for_items = ceil_div(1024, ceil_div(C, 128));
  return std::min(ceil_div(S, 128), std::max(ceil_div(S, kBwdMaxItemTokens), for_items));
}

// Tokens per group: S split over bwd_groups(S, C) groups, rounded up to whole strips; at most
// that many groups then cover S.
inline int64_t bwd_item_tokens(int64_t S, int64_t C) {
  const int64_t groups = std::max<int64_t>(bwd_groups(S, C), 1);
  return std::max<int64_t>(ceil_div(S, kBwdPlanStripLen * groups) * kBwdPlanStripLen, kBwdPlanStripLen);
}

// The workspace: FP32 partial rows [groups][kBwdPartialRows][C]. Any content: every row a launch
// reads was written by the same launch first.
inline int64_t bwd_workspace_bytes_for_groups(int64_t C, int64_t groups) {
  return groups * kBwdPartialRows * C * int64_t(sizeof(float));
}

// The reduction tree's counters: 64-bit words, word 0 the count of words a launch found not zero
// (causal_conv1d_bwd.cuh), then per channel tile of kBwdMinTileChannels channels one per chunk of
// kBwdChunk groups and one for the chunk sums. Zero before the first launch; every launch leaves
// the words it uses zero (the torch binding keeps them; a caller's workspace never holds them).
inline int64_t bwd_counter_bytes_for_groups(int64_t C, int64_t groups) {
  return groups == 0 ? 0 : (1 + ceil_div(C, kBwdMinTileChannels) * (ceil_div(groups, kBwdChunk) + 1)) * int64_t(sizeof(uint64_t));
}

// Workspace and counter bytes a backward of S tokens x C channels in token groups of item_tokens
// tokens uses.
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C, int64_t item_tokens) {
  return bwd_workspace_bytes_for_groups(C, ceil_div(S, item_tokens));
}
inline int64_t bwd_counter_bytes(int64_t S, int64_t C, int64_t item_tokens) {
  return bwd_counter_bytes_for_groups(C, ceil_div(S, item_tokens));
}

// What the caller provides: enough for every token group of bwd_groups(S, C); 0 when S == 0.
// Non-decreasing in S, as bwd_groups is, so a buffer for the largest S serves every smaller one.
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C) { return bwd_workspace_bytes_for_groups(C, bwd_groups(S, C)); }
inline int64_t bwd_counter_bytes(int64_t S, int64_t C) { return bwd_counter_bytes_for_groups(C, bwd_groups(S, C)); }

}  // namespace flashinfer_cake
