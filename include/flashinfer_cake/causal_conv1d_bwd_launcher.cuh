// Host side of the backward: the route rule (tile geometry from C), the launches (the streaming
// kernel, then the passes that reduce dweight/dbias in order) and the C entry point's argument
// checks. No torch, no Python.
#pragma once

#include "causal_conv1d_bwd.cuh"
#include "launch_common.cuh"

#ifndef CAKE_BWD_ITEM_CHOICE_GROUPS_PER_DOC
// The stateful backward of the small-grid full-width routes (WideShort, WideHalf; Wide's threshold is
// CAKE_BWD_WIDE_ITEM_CHOICE_GROUPS_PER_DOC) takes the kernel with the item choice when the
// token groups are at least this many per document (a document puts state events in 1-2 items at
// each end). tune.py --states, H200, 2026-12-02, time over the stateless backward, the per-step
// kernel / the item choice, two runs (r57, r58; random cuts per run):
//   1 document: 8192x4096 1.044 / 0.997x and 1.047 / 1.022x, 32768x1024 1.043 / 0.999x and
//   1.045 / 1.018x, 16384x4096 1.045 / 0.996x, 65536x2048 1.059 / 1.005x, 4096x4096 1.032 /
//   1.002x and 1.044 / 1.028x;
//   16 groups per document: 32768x1024 with 4 documents 1.045 / 1.020x, 65536x2048 with 4
//   1.059 / 1.031x;
//   8 per document, a gamble: 65536x2048 with 8 1.060 / 1.041x, 8192x4096 with 2 1.045 / 1.000x
//   and 1.067 / 1.115x, 32768x1024 with 8 1.066 / 1.108x, 4096x4096 with 4 1.095 / 1.244x;
//   most items with events: 8192x4096 with 4 1.066 / 1.093x, 17 1.070 / 1.104x.
// Where CTAs of both loops share an SM, its instruction cache holds both: the event CTAs slow down.
// num_docs counts empty documents (a cu_seqlens padded to a fixed length) and, in the CP backward,
// fragments: the host cannot see which are empty without a sync. A value above any group count
// (1 << 30) turns the choice off (tune.py: ITEM_CHOICE_GROUPS_PER_DOC=1073741824, and
// WIDE_ITEM_CHOICE_GROUPS_PER_DOC=1073741824 for Wide's). It also decides between Wide's item choice and
// WideVec8's per-step kernel (launch_causal_conv1d_bwd): with 8-11 groups per document WideVec8's kernel
// won, 65536x2048 with 6 documents (10.7 groups each) 224.1 us against the item choice's 235.8, 8 documents
// 225.7 / 236.5, 32768x1024 with 8 67.1 / 70.3 (tune.py --states, H200, 2026-12-04, rested, r188).
// The small-grid routes (WideShort, WideHalf) keep 16: 8 lost at every grid of 8-13 groups per document
// timed, 16 -> 8 graph-replayed (r193): 4096x4096 with 3 documents 38.1 -> 41.5, 2048x8192 with 2 38.7 -> 42.5,
// 8192x2048 with 8 39.4 -> 41.8, 1024x8192 with 1 22.6 -> 24.5, 16384x512 with 12 25.9 -> 26.4.
#define CAKE_BWD_ITEM_CHOICE_GROUPS_PER_DOC 16
#endif
#ifndef CAKE_BWD_WIDE_ITEM_CHOICE_GROUPS_PER_DOC
// On Wide's own grids (128-thread CTAs, 8-byte rows, groups of 256+ tokens: no 16-byte rows to take instead)
// the item choice wins from 8 groups per document. tune.py --states, H200, 2026-12-04, rested, µs, its
// per-step kernel -> the item choice (r187, r188; 1408 groups at 1048576x128, 428 at 262144x384):
// 1048576x128 with 56-88 documents (the last eighth's groups: 16-25 per document) 238.5-239.1 ->
// 227.2-228.5 (1.035-1.040x the stateless time), 128 documents (11 each) 240.2 -> 229.0, 176 (8) 240.5 ->
// 230.0; 4 per document a gamble: 1048576x128 with 352 241.7 -> 237.7, 262144x384 with 54 (7.9) 184.1 ->
// 176.6, with 107 (4) 184.9 -> 187.2. Main (16) -> 8 (r189): 1048576x128 with 128 documents 241.5 -> 229.5
// (1.091 -> 1.036x), 176 241.5 -> 230.6, 262144x384 with 40 (10.7 each) 184.3 -> 177.4 (1.088 -> 1.046x).
// Wide grids at wide C (most of about one wave), 16 -> 8 (r191, r192): faster at 12 of 15, 10240x7168 with 2 documents
// (8 groups each) 148.8 -> 133.2, 49152x8192 with 4 660.2 -> 624.3, 8192x4480 with 1 (15) 75.3 -> 71.8,
// 8192x7432 with 1 (8) 132.8 -> 129.5; equal at 24576x7432 with 4 and 32768x1664 with 4; slower at
// 8768x7432 with 1 (14 groups: 8 x 768 tokens, then 6 x 512) 129.0 -> 133.8 in both runs.
#define CAKE_BWD_WIDE_ITEM_CHOICE_GROUPS_PER_DOC 8
#endif

namespace flashinfer_cake {

inline bool bwd_has_states(const CausalConv1dBwdParams& p) { return p.initial_states || p.dfinal_states; }

// Whether a stateful backward takes the item-choice kernel of a route whose threshold is groups_per_doc.
inline bool bwd_item_choice(const CausalConv1dBwdParams& p, int64_t groups_per_doc) {
  return bwd_has_states(p) && int64_t(p.groups) >= groups_per_doc * p.num_docs;
}

// The backward's kernel for the launch's round_preact and states (Route: a BwdRoute).
template <class Route, class WeightT, class BiasT>
auto bwd_kernel_for(const CausalConv1dBwdParams& p) {
  using Traits = typename Route::Traits;
  const bool states = bwd_has_states(p);
  const bool choice = Route::kMayChooseItems && bwd_item_choice(p, Route::kItemChoiceGroupsPerDoc);
  const auto pick = [&](auto round_preact) {
    constexpr bool kRound = decltype(round_preact)::value;
    if constexpr (Route::kMayChooseItems) {
      if (choice) return causal_conv1d_bwd_kernel<Traits, WeightT, BiasT, kRound, true, true>;
    }
    if (states) return causal_conv1d_bwd_kernel<Traits, WeightT, BiasT, kRound, true, false>;
    return causal_conv1d_bwd_kernel<Traits, WeightT, BiasT, kRound, false, false>;
  };
  return p.round_preact ? pick(std::true_type{}) : pick(std::false_type{});
}

// The reduction of the groups' partial rows into dweight / dbias: one pass per two levels of the
// tree (a single pass up to 64 groups, two up to 4096, ...), each launched with programmatic
// dependent launch after the grid before it (causal_conv1d_bwd_reduce_kernel). Stream order is
// kept: a later launch without the attribute waits for the last pass as for any kernel; one with it
// (the next call's kernel) may be scheduled early and waits before its first global access. The
// largest pass grid, quad blocks x ceil(groups / 64), stays below 2^18 CTAs within the C entry's
// limits (S * C < 2^34, groups of >= 64 tokens; one group: C < 2^28, below 2^24).
template <class WeightT, class BiasT>
cudaError_t launch_bwd_reduce(const CausalConv1dBwdParams& p, cudaStream_t stream) {
  const int64_t quad_blocks = bwd_reduce_quad_blocks(p.C);
  int64_t nodes = p.groups, span = 1;  // the pass's input level: its nodes, rows `span` groups apart
  for (;;) {
    const int64_t top_nodes = ceil_div(ceil_div(nodes, kBwdChunk), kBwdChunk);
    const bool last = top_nodes == 1;
    const cudaError_t e = launch_after_prerequisite(causal_conv1d_bwd_reduce_kernel<WeightT, BiasT>,
                                                    quad_blocks * top_nodes, kBwdReduceThreads, 0, stream, p,
                                                    static_cast<int>(nodes), span, last);
    if (e != cudaSuccess) return fail(e, "backward reduce kernel launch failed: %s", cudaGetErrorString(e));
    if (last) return cudaSuccess;
    nodes = top_nodes;
    span *= kBwdChunk * kBwdChunk;
  }
}

// A route's channel tiles: kLanesC row vectors each.
template <class Traits>
int64_t bwd_channel_tiles(int64_t C) {
  return ceil_div(C / Traits::kVec, int64_t(Traits::kLanesC));
}

// The rotation of a route's channel slots for row-strided views (bwd_row_block_offset), in its row
// vectors: only on routes whose tiles are whole 256-byte blocks and all full (C a multiple of the tile;
// the rotation then moves no lane off or onto a channel), and without states (the kernel's kRotates).
// Each channel keeps its own walk and sums: dx, dweight and dbias are bitwise the unrotated grid's.
template <class Traits>
int32_t bwd_vec_shift(const CausalConv1dBwdParams& p) {
  constexpr int64_t kBytes = sizeof(__nv_bfloat16);
  if (!Traits::kTilesOfRowBlocks || p.C % Traits::kTileChannels != 0 || bwd_has_states(p)) return 0;
  const auto stream = [](const void* ptr, int64_t row_elems) {
    return std::pair<int64_t, int64_t>{int64_t(reinterpret_cast<uintptr_t>(ptr) % kBwdRowBlockBytes), row_elems * kBytes};
  };
  // 16-byte aligned pointers: a whole number of row vectors
  return static_cast<int32_t>(bwd_row_block_offset({stream(p.x, p.x_row_elems), stream(p.dy, p.dy_row_elems), stream(p.dx, p.dx_row_elems)}) /
                              (Traits::kVec * kBytes));
}

// One route of the backward (launch_causal_conv1d_bwd picks it): its streaming kernels (by
// bwd_kernel_for) and the reduction passes. Each route is instantiated in one translation unit
// (jit/variant.py's BWD_ROUTE_UNITS), so a variant's routes compile in parallel.
template <class Route, class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_bwd_route(CausalConv1dBwdParams p, cudaStream_t stream) {
  using Traits = typename Route::Traits;
  const int64_t tiles_c = bwd_channel_tiles<Traits>(p.C);
  const int64_t blocks = int64_t(p.groups) * tiles_c;
  const int64_t rows_span = int64_t(p.S) * std::max({p.x_row_elems, p.dy_row_elems, p.dx_row_elems});  // elements
  // 32-bit offsets, in vectors. The C entry's limits (S * C and S * stride below 2^34) keep both
  // bounds: an invariant, checked where the offsets are formed.
  if (blocks > INT32_MAX || rows_span / Traits::kVec >= (int64_t(1) << 32)) {
    return fail(cudaErrorInvalidValue, "x: S * row stride = %lld elements is too large for the backward (must be below 2^34)",
                (long long)rows_span);
  }
  p.tiles_c = static_cast<int32_t>(tiles_c);
  p.vec_shift = bwd_vec_shift<Traits>(p);
  p.x_row_stride = static_cast<uint32_t>(p.x_row_elems / Traits::kVec);  // below 2^32: S * stride checked above
  p.dy_row_stride = static_cast<uint32_t>(p.dy_row_elems / Traits::kVec);
  p.dx_row_stride = static_cast<uint32_t>(p.dx_row_elems / Traits::kVec);
  const auto kernel = bwd_kernel_for<Route, WeightT, BiasT>(p);
  const cudaError_t e = launch_after_prerequisite(kernel, blocks, Traits::kThreads, 0, stream, p);
  if (e != cudaSuccess) return fail(e, "backward kernel launch failed: %s", cudaGetErrorString(e));
  return launch_bwd_reduce<WeightT, BiasT>(p, stream);
}

// S == 0: no token group, so no CTA reduces; dweight and dbias are zero, and every document is
// empty: dinit = dfinal (or zeros).
template <class WeightT, class BiasT>
cudaError_t grads_of_no_tokens(const CausalConv1dBwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(p.dweight, 0, size_t(p.C) * 4 * sizeof(WeightT), stream);
  if (e == cudaSuccess && detail::kHasBias<BiasT>) e = cudaMemsetAsync(p.dbias, 0, size_t(p.C) * detail::kBiasBytes<BiasT>, stream);
  if (e != cudaSuccess) return fail(e, "zeroing dweight/dbias failed: %s", cudaGetErrorString(e));
  if (p.initial_states) return copy_or_zero_states(p.dinitial_states, p.dfinal_states, p.num_docs, p.C, stream, "dinitial_states");
  return cudaSuccess;
}

// Tile geometry of the streaming kernel; -D overrides measure alternatives.
#ifndef CAKE_BWD_THREADS
#define CAKE_BWD_THREADS 128
#endif
#ifndef CAKE_BWD_STRIP_LEN
#define CAKE_BWD_STRIP_LEN 64  // a multiple of 8 (WideHalf and MidHalf walk half of it); the plan's groups are whole strips of it but for its even-run choice
#endif
#ifndef CAKE_BWD_RING
#define CAKE_BWD_RING 8  // at most CAKE_BWD_STRIP_LEN / 2 + 7 (BwdTraits of WideHalf, MidHalf)
#endif
#ifndef CAKE_BWD_MIN_CTAS
#define CAKE_BWD_MIN_CTAS 4
#endif
#ifndef CAKE_BWD_NARROW_RING
#define CAKE_BWD_NARROW_RING 12  // the warp-filled routes' ring (BwdTraits::kWarpFill)
#endif
#ifndef CAKE_BWD_VEC
#define CAKE_BWD_VEC 4  // channels per thread (WideVec8's: 8)
#endif
#ifndef CAKE_BWD_STATES_VEC8_MIN_DOC_TOKENS
// With states, WideVec8's shapes (bwd_vec8_rows) take its per-step kernel when the
// documents average at least this many
// tokens (num_docs counts empty documents and, in the CP backward, fragments) and the item choice does
// not apply; otherwise Wide's kernels. Its stateless steps gain what the 16-byte rows gain, its steps
// with state events lose: 2 CTAs of 4 warps per SM hide the dependent loads of state rows less than
// Wide's 4 CTAs, and it has no inside loop. tune.py --states, H200, 2026-12-03, rested, Wide ->
// WideVec8, µs (r147; r146):
//   2048 tokens per document: 32768x2048 with 16 documents 129.6 -> 120.6, 16384x4096 with 8 130.2 ->
//   122.2, 65536x1024 with 32 131.6 -> 124.3; 1024: 32768x2048 (32) 132.6 -> 125.7, 16384x4096 (16)
//   132.2 -> 123.3, 8192x8192 (8) 129.9 -> 122.2, 65536x1024 (62) 133.9 -> 128.0; 512: 32768x2048 (64)
//   133.8 -> 127.5 and 132.5 -> 124.7, 65536x1024 (128) 133.6 -> 127.5;
//   482: 8192x4096 (17) 73.7 -> 73.1; 431: 16384x4096 (38) 130.7 -> 134.6; 256: 32768x2048 (128)
//   134.4 -> 134.1, 16384x4096 (64) 134.1 -> 131.7; 171: 4096x8192 (24) 73.9 -> 81.4;
//   1-8 and 16 tokens: 32768x1024 (2048) 99.4 -> 121.0, 8192x8192 (1024) 195.6 -> 234.5, 16384x4096
//   (3634) 233.6 -> 258.6;
//   one document (the item choice, in 16-byte rows): 8192x4096 66.4 -> 68.3 and 66.2 -> 67.7,
//   16384x4096 120.6 -> 120.5, 32768x2048 120.6 -> 121.1, 65536x1024 120.5 -> 120.6, 4096x8192 68.7
//   -> 65.5, 16384x8192 230.9 -> 223.7, 32768x8192 435.1 -> 425.9: no item-choice kernel in 16-byte rows.
// A value above any S (1 << 30) keeps every stateful call on Wide (tune.py:
// STATES_VEC8_MIN_DOC_TOKENS=1073741824).
#define CAKE_BWD_STATES_VEC8_MIN_DOC_TOKENS 512
#endif
#ifndef CAKE_BWD_WIDE_VEC8
// 0: no 16-byte rows (WideVec8 is Wide's geometry, never launched). tune.py geometries whose
// WideVec8 kernels exceed static shared memory (the kernel's static_assert: ring 12 at 128 threads,
// 256 threads) need it (WIDE_VEC8=0); with VEC=8, Wide and WideVec8 differ only in their CTAs per SM.
#define CAKE_BWD_WIDE_VEC8 1
#endif

#ifndef CAKE_BWD_VEC8_BALANCE_DIV
// WideVec8 only where its busiest SM carries at most 1/N more work than Wide's (bwd_vec8_balanced);
// 0: wherever C % 256 == 0 (tune.py: VEC8_BALANCE_DIV=0). The plan (bwd_tail, the even-run cost) keeps
// the shipped kBwdVec8BalanceDiv.
#define CAKE_BWD_VEC8_BALANCE_DIV kBwdVec8BalanceDiv
#endif

#ifndef CAKE_BWD_TAIL
#define CAKE_BWD_TAIL 1  // 0: uniform token groups, without bwd_tail's splits (tune.py: TAIL=0)
#endif

// Token groups (the item_tokens argument) must be a multiple of this, but on the routes that walk even
// runs (bwd_even_run_groups).
constexpr int kBwdStripLen = CAKE_BWD_STRIP_LEN;

// A route: a tile geometry, its stateless and stateful (per-step) kernels, and whether it has a
// kernel with the item choice (Wide and the small-grid full-width routes; at C = 16, where the
// stateful kernel's shared memory also lowers its CTAs per SM, 1048576x16 with 1 document went
// 1.070 -> 1.057x and with 64 1.091 -> 1.106x: not worth a kernel per narrow route).
// kItemChoiceGroupsPerDoc: the item choice's threshold, 0 for a route without that kernel.
template <class Traits_, int64_t kItemChoiceGroupsPerDoc_ = 0>
struct BwdRoute {
  using Traits = Traits_;
  static constexpr int64_t kItemChoiceGroupsPerDoc = kItemChoiceGroupsPerDoc_;
  static constexpr bool kMayChooseItems = kItemChoiceGroupsPerDoc_ > 0;
};
// A new route goes into jit/variant.py's BWD_ROUTE_UNITS too (tests/test_jit.py compares the two), which
// also spells launch_causal_conv1d_bwd_route's signature for its instantiations.
namespace bwd_routes {  // launch_causal_conv1d_bwd says which shapes take which
constexpr int kVec = CAKE_BWD_VEC, kThreads = CAKE_BWD_THREADS, kStrip = CAKE_BWD_STRIP_LEN, kRing = CAKE_BWD_RING,
              kMinCtas = CAKE_BWD_MIN_CTAS, kNarrowRing = CAKE_BWD_NARROW_RING;
constexpr bool kWideVec8 = CAKE_BWD_WIDE_VEC8 != 0;
constexpr int64_t kItemChoicePerDoc = CAKE_BWD_ITEM_CHOICE_GROUPS_PER_DOC,
                  kWideItemChoicePerDoc = CAKE_BWD_WIDE_ITEM_CHOICE_GROUPS_PER_DOC;
static_assert(kItemChoicePerDoc > 0 && kWideItemChoicePerDoc > 0, "the item choice's thresholds: 1 << 30 turns it off");
using Wide = BwdRoute<BwdTraits<kVec, 32, kThreads, kStrip, kRing, kMinCtas>, kWideItemChoicePerDoc>;
// Wide's strips in 16-byte rows: items of twice the channels, half the CTAs per SM; with states its
// per-step kernel only (launch_causal_conv1d_bwd).
using WideVec8 = BwdRoute<std::conditional_t<kWideVec8, BwdTraits<8, 32, kThreads, kStrip, kRing, (kMinCtas + 1) / 2>,
                                              Wide::Traits>>;
using WideShort = BwdRoute<BwdTraits<kVec, 32, kThreads / 2, kStrip, kRing, 2 * kMinCtas>, kItemChoicePerDoc>;
using WideHalf = BwdRoute<BwdTraits<kVec, 32, kThreads, kStrip / 2, kRing, kMinCtas>, kItemChoicePerDoc>;
using Mid = BwdRoute<BwdTraits<kVec, 16, kThreads / 2, kStrip, kRing, 2 * kMinCtas>>;
using MidHalf = BwdRoute<BwdTraits<kVec, 16, kThreads / 2, kStrip / 2, kRing, 2 * kMinCtas>>;
using Narrow8 = BwdRoute<BwdTraits<kVec, 8, kThreads, kStrip, kRing, kMinCtas>>;
using Narrow4 = BwdRoute<BwdTraits<kVec, 4, kThreads / 2, kStrip, kNarrowRing, 2 * kMinCtas>>;
using Narrow2 = BwdRoute<BwdTraits<kVec, 2, kThreads / 4, kStrip, kNarrowRing, 4 * kMinCtas>>;
}  // namespace bwd_routes

// The routes' families, from C and the token groups alone: 32 channel lanes from a whole sub-tile of
// the full CTA on (Wide, WideVec8) or below it (WideShort, WideHalf), 16 lanes from a sub-tile on (Mid)
// or below it (MidHalf), fewer (Narrow8, Narrow4, Narrow2). launch_causal_conv1d_bwd takes the route
// within the family from the call's other arguments (the grid, C, states); bwd_even_run_groups asks
// which routes a call may take.
enum class BwdFamily { kWide, kWideSmall, kMid, kMidSmall, kNarrow };
inline BwdFamily bwd_family(int64_t C, int64_t item_tokens) {
  using namespace bwd_routes;
  if (C > 16 * kVec) return item_tokens >= Wide::Traits::kTileTokens ? BwdFamily::kWide : BwdFamily::kWideSmall;
  if (C > 8 * kVec) return item_tokens >= Mid::Traits::kTileTokens ? BwdFamily::kMid : BwdFamily::kMidSmall;
  return BwdFamily::kNarrow;
}

// Whether every route that may take token groups of item_tokens tokens at C channels walks them in even
// runs (BwdTraits::kLongWalk), which lets a group be any multiple of a 4-row step per strip; the other
// routes walk whole strips (a group of part of one would overlap the next).
inline bool bwd_even_run_groups(int64_t C, int64_t item_tokens) {
  using namespace bwd_routes;
  static_assert(WideVec8::Traits::kTileTokens == Wide::Traits::kTileTokens, "kWide's test is both routes' sub-tile");
  const auto walks_evenly = [&](auto route) {
    using Tr = typename decltype(route)::Traits;
    return Tr::kLongWalk && item_tokens % (4 * Tr::kStrips) == 0;
  };
  switch (bwd_family(C, item_tokens)) {
    case BwdFamily::kWide: return walks_evenly(Wide{}) && walks_evenly(WideVec8{});
    case BwdFamily::kMid: return walks_evenly(Mid{});
    case BwdFamily::kWideSmall:
    case BwdFamily::kMidSmall:
    case BwdFamily::kNarrow: break;  // routes of whole strips (-Wswitch names a family added later)
  }
  return false;
}

// The 4- and 2-lane routes' smallest grid: ~4 CTAs per SM on 132 SMs.
constexpr int kBwdNarrowRouteMinGroups = 512;

#ifndef CAKE_BWD_SMALL_GRID_WARPS
// C > 64: token groups shorter than one sub-tile of the full CTA whose grid of 64-thread CTAs has
// at most this many warps (~8 per SM on 132 SMs) take strips of half the length in the full CTA
// (WideHalf). 0 turns it off (tune.py: SMALL_GRID_WARPS=0).
#define CAKE_BWD_SMALL_GRID_WARPS 1024
#endif

// Whether the launch's grid takes WideVec8 over Wide without states (bwd_vec8_rows).
inline bool bwd_vec8_rows(const CausalConv1dBwdParams& p, int64_t vec8_channels, int64_t wide_channels) {
  static_assert(CAKE_BWD_VEC8_BALANCE_DIV >= 0, "CAKE_BWD_VEC8_BALANCE_DIV: 0 (always WideVec8) or N > 0");
  return bwd_vec8_rows(p.C, p.groups, p.item_tokens, BwdTail{p.big_groups, p.tail_tokens}, vec8_channels, wide_channels,
                       CAKE_BWD_VEC8_BALANCE_DIV);
}

// Routes, from shapes only: channel lanes per CTA 32; 16 when C <= 16 * kVec, in CTAs of half the
// threads (with 32 lanes half of each row would be idle: C = 64 ran at 37-40 % of copy); 8, 4 or 2
// when C <= 8, 4 or 2 * kVec, in CTAs of 16 strips: as many lanes as C needs (with 8 lanes C = 16
// and C = 8 left half and three quarters of the threads idle: 1048576x16 72.9 -> 54.0 us, 2097152x8
// 130.7 -> 86.0 us; tune.py, H200), when the grid has kBwdNarrowRouteMinGroups CTAs or more; fewer
// 32- or 64-thread CTAs leave an SM one or two warps to issue from, and the 8-lane CTAs (4 warps,
// the same strips) were faster there (70000x8: 34.8 against 38.4 us, 65536x16: 23.6 against 24.6).
// The routes of C <= 32 give bitwise the same results. When a token group is shorter than one
// sub-tile of the full CTA (small S: the group would leave strips idle), with 32 lanes half the
// threads (WideShort: 2 strips), or on a grid of at most CAKE_BWD_SMALL_GRID_WARPS warps the full
// CTA with strips of half the length (WideHalf), and with 16 lanes always the latter (MidHalf; with
// the plan's item_tokens such grids have at most 1024 groups). With 64-token strips a 4 M-element
// backward had ~4 warps per SM: graph-replayed 1024x4096 17.3 -> 14.4 us, 65536x64 19.3 -> 15.9,
// 1024x8192 22.3 -> 21.2, and at 2048 warps 4096x4096 35.0 -> 37.8 (tune.py, H200, 2026-12-03).
// Without states, items of 256 tokens or more at C a multiple of 256 run in 16-byte rows where their
// grid balances the SMs as Wide's does, by bwd_vec8_rows (WideVec8:
// 8 channels per thread, items of 256 channels, ~210 registers, 2 CTAs of 128 threads per SM;
// bitwise Wide's results), whose strips below S walk a loop without the rows' bounds tests (the
// kernel's inside strips): the bf16 policy's 4-row loop is 936 SASS instructions for 8 channels a
// row, 29.3 per channel against Wide's 35.4 (566 for 4; nvcc 13.0). tune.py, H200, 2026-12-03,
// rested, main -> WideVec8 (r137): 16384x8192 230.3 -> 223.4 us (83 -> 86 % of copy), 65536x2048
// (32 documents) 231.0 -> 225.5, 131072x4096 860.8 -> 857.0, 8192x4096 64.9 -> 62.8, 131072x256
// 66.8 -> 65.1; held at the power cap 2 s, 16384x8192 267.5 -> 251.5, 65536x2048 266.0 -> 252.9;
// r135, the same loops: 32768x1024 64.8 -> 62.6, 65536x512 66.6 -> 64.8.
// Without the inside strips 16-byte rows gained nothing (r133: 16384x8192 230.8 -> 230.9) or lost
// (131072x4096 862.1 -> 892.7): C not a multiple of 256, whose tiles with idle lanes would walk the
// bounded loop, stays on Wide (which has no inside strips: the kernel says why). In 16 lanes of
// 64-thread CTAs (Wide's 128-channel items, 4 CTAs per SM) they were 3.8 % faster at 1048576x128
// but 3.5 % slower at 16384x8192 and 25 % at 8192x4096 (r134).
// With states the same shapes take WideVec8's per-step kernel only where documents are long
// (CAKE_BWD_STATES_VEC8_MIN_DOC_TOKENS); the other stateful calls keep 4 channels per thread.
// Threads per SM stay 4 * CAKE_BWD_THREADS on the other routes of the stateless kernels (the
// stateful ones' shared memory fits fewer of the 32-thread CTAs: 19 792 bytes each, 11 per SM).
template <class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_bwd(const CausalConv1dBwdParams& p, cudaStream_t stream) {
  if (p.groups == 0) return grads_of_no_tokens<WeightT, BiasT>(p, stream);
  using namespace bwd_routes;
  using WideT = Wide::Traits;
  static_assert(WideHalf::Traits::kTileTokens == WideShort::Traits::kTileTokens &&
                    2 * MidHalf::Traits::kTileTokens == Mid::Traits::kTileTokens,
                "the half-length routes walk the sub-tile of a half CTA");
  // Each channel's tokens in the same strips, summed by one lane in the same order, and the strips
  // added in the same order: WideVec8 gives bitwise Wide's dx, dweight and dbias.
  static_assert(WideVec8::Traits::kStrips == WideT::kStrips && WideVec8::Traits::kTileTokens == WideT::kTileTokens,
                "WideVec8 walks Wide's strips");
  constexpr int64_t kSmallGridWarps = CAKE_BWD_SMALL_GRID_WARPS;
  // The plan (causal_conv1d_bwd_plan.h) gives longer token groups to the full-width routes and
  // groups of a whole sub-tile to the narrow ones; its thresholds are the shipped geometry's
  // (tune.py may build others).
  static_assert(!(kVec == 4 && kThreads == 128 && kStrip == 64) ||
                    (16 * kVec == kBwdPlanWideMinC && WideT::kTileTokens == kBwdPlanFullTileTokens &&
                     8 * kVec == kBwdPlanNarrowMaxC && Narrow8::Traits::kTileTokens == kBwdMaxItemTokens &&
                     Narrow4::Traits::kTileTokens == kBwdMaxItemTokens && Narrow2::Traits::kTileTokens == kBwdMaxItemTokens &&
                     kBwdPlanWaveItems == kBwdPlanSms * kMinCtas && (!kWideVec8 || 2 * WideVec8::Traits::kMinCtasPerSm == kMinCtas) &&
                     WideT::kTileChannels == 128 && (!kWideVec8 || WideVec8::Traits::kTileChannels == 256) &&
                     WideT::kLongWalk && WideVec8::Traits::kLongWalk && Mid::Traits::kLongWalk &&
                     kBwdPlanRunGroupTokens == 4 * WideT::kStrips && kBwdPlanRunGroupTokens == 4 * Mid::Traits::kStrips),
                "the plan's thresholds must match the routes");
  switch (bwd_family(p.C, p.item_tokens)) {
    case BwdFamily::kWide:
      if (kWideVec8 && bwd_vec8_rows(p, WideVec8::Traits::kTileChannels, WideT::kTileChannels) &&
          (!bwd_has_states(p) ||
           (!bwd_item_choice(p, kItemChoicePerDoc) && int64_t(p.S) >= int64_t(CAKE_BWD_STATES_VEC8_MIN_DOC_TOKENS) * p.num_docs))) {
        return launch_causal_conv1d_bwd_route<WideVec8, WeightT, BiasT>(p, stream);
      }
      return launch_causal_conv1d_bwd_route<Wide, WeightT, BiasT>(p, stream);
    case BwdFamily::kWideSmall:
      if (int64_t(p.groups) * bwd_channel_tiles<WideShort::Traits>(p.C) * (WideShort::Traits::kThreads / 32) <= kSmallGridWarps) {
        return launch_causal_conv1d_bwd_route<WideHalf, WeightT, BiasT>(p, stream);
      }
      return launch_causal_conv1d_bwd_route<WideShort, WeightT, BiasT>(p, stream);
    case BwdFamily::kMid: return launch_causal_conv1d_bwd_route<Mid, WeightT, BiasT>(p, stream);
    case BwdFamily::kMidSmall: return launch_causal_conv1d_bwd_route<MidHalf, WeightT, BiasT>(p, stream);
    case BwdFamily::kNarrow: break;
  }
  if (p.groups >= kBwdNarrowRouteMinGroups) {
    if (p.C <= 2 * kVec) return launch_causal_conv1d_bwd_route<Narrow2, WeightT, BiasT>(p, stream);
    if (p.C <= 4 * kVec) return launch_causal_conv1d_bwd_route<Narrow4, WeightT, BiasT>(p, stream);
  }
  return launch_causal_conv1d_bwd_route<Narrow8, WeightT, BiasT>(p, stream);
}

// The C entry point's body: re-checks what the binding validated (the module may be called
// directly, e.g. with ctypes), selects the device, launches the kernels. Returns a cudaError_t
// code; on failure the message is in last_error_buffer().
template <class WeightT, class BiasT>
cudaError_t causal_conv1d_bwd_entry(const BwdArgs& a) {
  last_error_buffer()[0] = '\0';
  if (a.S < 0 || a.S >= kBwdMaxS) return fail(cudaErrorInvalidValue, "x: S must be in [0, 2^30) for the backward, got %lld", (long long)a.S);
  if (a.C <= 0 || a.C % 8 != 0 || a.C >= kMaxC) return fail(cudaErrorInvalidValue, "x: C must be a positive multiple of 8 below 2^28, got %lld", (long long)a.C);
  if (a.S * a.C >= kBwdMaxElements) return fail(cudaErrorInvalidValue, "x: S * C must be below 2^34 for the backward, got %lld", (long long)(a.S * a.C));
  if (a.num_docs < 0 || a.num_docs >= kMaxCuSeqlens) return fail(cudaErrorInvalidValue, "cu_seqlens: num_docs must be in [0, 2^31 - 2], got %lld", (long long)a.num_docs);
  if (a.item_tokens <= 0 || a.item_tokens > kBwdMaxItemTokens ||
      (a.item_tokens % kBwdStripLen != 0 && !bwd_even_run_groups(a.C, a.item_tokens))) {
    // This build's even-run routes (Mid and Wide have the same strips, so the same sub-tile and step).
    return fail(cudaErrorInvalidValue,
                "item_tokens must be a positive multiple of %d (or, at C > %d from %d tokens on, of %d) up to %d, got %lld",
                kBwdStripLen, 8 * bwd_routes::kVec, bwd_routes::Mid::Traits::kTileTokens, 4 * bwd_routes::Mid::Traits::kStrips,
                kBwdMaxItemTokens, (long long)a.item_tokens);
  }
  if (a.round_preact != 0 && a.round_preact != 1) return fail(cudaErrorInvalidValue, "round_preact must be 0 or 1, got %lld", (long long)a.round_preact);
  if (a.device < 0 || a.device >= kMaxDevices) return fail(cudaErrorInvalidDevice, "device index %lld out of range", (long long)a.device);
  // The split's groups are whole 256-token sub-tiles: whole strips of the shipped geometry; a tune.py
  // geometry of longer strips keeps uniform groups (off the even-run routes a strip walks whole pieces:
  // a group of part of one would overlap the next).
  BwdTail tail = CAKE_BWD_TAIL ? bwd_tail(a.S, a.C, a.item_tokens) : BwdTail{0, a.item_tokens};
  if (tail.tail_tokens % kBwdStripLen != 0) tail = BwdTail{0, a.item_tokens};
  const int64_t groups = bwd_group_count(a.S, a.item_tokens, tail);
  const int64_t need = bwd_workspace_bytes_for_groups(a.C, groups);
  if (a.workspace_bytes < need) {
    return fail(cudaErrorInvalidValue, "workspace: expected at least %lld bytes, got %lld", (long long)need, (long long)a.workspace_bytes);
  }
  int64_t x_row_stride = 0, dy_row_stride = 0, dx_row_stride = 0;
  cudaError_t e = check_row_stride("x", a.S, a.C, a.x_row_stride, kBwdMaxElements, &x_row_stride);
  if (e == cudaSuccess) e = check_row_stride("dy", a.S, a.C, a.dy_row_stride, kBwdMaxElements, &dy_row_stride);
  if (e == cudaSuccess) e = check_row_stride("dx", a.S, a.C, a.dx_row_stride, kBwdMaxElements, &dx_row_stride);
  if (e != cudaSuccess) return e;
  if (a.num_docs > 0) {  // (without documents the states are empty: their addresses are not used)
    if (!a.initial_states != !a.dinitial_states) {
      return fail(cudaErrorInvalidValue, "dinitial_states: expected exactly when initial_states is given");
    }
    if (a.frag_info && (!a.initial_states || a.dfinal_states || a.frag_info % 4)) {
      return fail(cudaErrorInvalidValue, "frag_info: expected a 4-byte aligned pointer, only with initial_states and "
                  "without dfinal_states (the context-parallel backward)");
    }
    for (const auto& [name, ptr] : {std::pair<const char*, int64_t>{"initial_states", a.initial_states}, {"dfinal_states", a.dfinal_states},
                                    {"dinitial_states", a.dinitial_states}}) {
      if (ptr % 16) return fail(cudaErrorInvalidValue, "%s: expected a 16-byte aligned pointer", name);
    }
  }
  void* const dweight = as_ptr<void>(a.dweight);
  void* const dbias = as_ptr<void>(a.dbias);
  if (!dweight || !aligned_to(dweight, sizeof(WeightT))) return fail(cudaErrorInvalidValue, "dweight: expected a non-null pointer aligned to its dtype");
  if constexpr (detail::kHasBias<BiasT>) {
    if (!dbias || !aligned_to(dbias, sizeof(BiasT))) return fail(cudaErrorInvalidValue, "dbias: expected a non-null pointer aligned to its dtype");
  }
  CausalConv1dBwdParams p{};
  p.x = as_ptr<const __nv_bfloat16>(a.x);
  p.dy = as_ptr<const __nv_bfloat16>(a.dy);
  p.dx = as_ptr<__nv_bfloat16>(a.dx);
  p.weight = as_ptr<const void>(a.weight);
  p.bias = as_ptr<const void>(a.bias);
  p.cu_seqlens = as_ptr<const int32_t>(a.cu_seqlens);
  if (a.num_docs > 0) {  // no document, no state
    p.initial_states = as_ptr<const __nv_bfloat16>(a.initial_states);
    p.dfinal_states = as_ptr<const __nv_bfloat16>(a.dfinal_states);
    p.dinitial_states = as_ptr<__nv_bfloat16>(a.dinitial_states);
    p.frag_info = as_ptr<const int32_t>(a.frag_info);
  }
  p.x_row_elems = x_row_stride;
  p.dy_row_elems = dy_row_stride;
  p.dx_row_elems = dx_row_stride;
  p.partials = as_ptr<float>(a.workspace);
  if (a.S > 0) {
    if (!p.x || !aligned16(p.x)) return fail(cudaErrorInvalidValue, "x: expected a non-null 16-byte aligned pointer");
    if (!p.dy || !aligned16(p.dy)) return fail(cudaErrorInvalidValue, "dy: expected a non-null 16-byte aligned pointer");
    if (!p.dx || !aligned16(p.dx)) return fail(cudaErrorInvalidValue, "dx: expected a non-null 16-byte aligned pointer");
    if (!p.weight || !aligned16(p.weight)) return fail(cudaErrorInvalidValue, "weight: expected a non-null 16-byte aligned pointer");
    if (detail::kHasBias<BiasT> && (!p.bias || !aligned16(p.bias))) return fail(cudaErrorInvalidValue, "bias: expected a non-null 16-byte aligned pointer");
    if (!p.cu_seqlens || !aligned_to(p.cu_seqlens, 4)) return fail(cudaErrorInvalidValue, "cu_seqlens: expected a non-null 4-byte aligned pointer");
    if (!p.partials || !aligned16(p.partials)) return fail(cudaErrorInvalidValue, "workspace: expected a non-null 16-byte aligned pointer");
  }
  p.dweight = dweight;
  p.dbias = dbias;
  p.S = static_cast<int32_t>(a.S);
  p.C = static_cast<int32_t>(a.C);
  p.num_docs = static_cast<int32_t>(a.num_docs);
  p.item_tokens = static_cast<int32_t>(a.item_tokens);
  p.big_groups = static_cast<int32_t>(tail.big_groups);
  p.tail_tokens = static_cast<int32_t>(tail.tail_tokens);
  p.groups = static_cast<int32_t>(groups);
  p.round_preact = static_cast<int32_t>(a.round_preact);
  return on_device(static_cast<int>(a.device),
                   [&] { return launch_causal_conv1d_bwd<WeightT, BiasT>(p, as_ptr<CUstream_st>(a.stream)); });
}

}  // namespace flashinfer_cake
