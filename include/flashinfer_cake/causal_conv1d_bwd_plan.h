// The backward's token groups and workspace size: plain C++ (no CUDA, no torch), shared by the
// kernels' launcher and the torch binding, so the sizes the binding allocates and the sizes the
// launcher checks come from one place.
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

// Workspace bytes the caller provides: one FP32 partial row set per group of bwd_groups(S, C).
inline int64_t bwd_workspace_bytes(int64_t S, int64_t C) {
  return bwd_groups(S, C) * kBwdPartialRows * C * int64_t(sizeof(float));
}

}  // namespace flashinfer_cake
