// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training backward.
//
// Forward: a[t] = b + sum_k w[k] x[t - 3 + k] (taps inside t's document, or reading its initial
// state before its first token), y[t] = silu(a[t]).
// Backward, per channel, with g[t] = dy[t] * silu'(a'[t]) where a' is a rounded to BF16 or not:
//   dx[s]  = sum_k w[k] g[s + 3 - k]            over the taps k with s in the document of s + 3 - k
//   dw[k]  = sum_t g[t] x[t - 3 + k]            over the taps t reads (x or its initial state)
//   db     = sum_t g[t]
//   dinit[d][j] = sum_{p <= j} w[j - p] g[start_d + p]  over the document's tokens
// plus the final states' gradient, added to the dx (or dinit) rows the final states came from.
// Framework-free: raw device pointers, sizes, row strides and a cudaStream_t.
//
// Two kernels. The first streams x and dy once: a CTA owns an item of one token group (item_tokens
// tokens, or tail_tokens past the long groups of a split: bwd_tail) x
// kTileChannels channels; a thread owns kVec channels (4: an 8-byte row vector, so the windows,
// taps and sums of the backward fit in ~110-128 registers, 4 CTAs of 128 threads per SM; 8 on the
// full-width route at C a multiple of 256 on a grid that balances the SMs, stateless or with long
// documents, 16-byte rows in ~210
// (stateful 227-240) registers, 2 CTAs of 128 threads: fewer instructions per channel, the
// launcher's WideVec8) of one strip. A strip walks Lw tokens at a time, x[t0 - 3, t0 + Lw + 3) and
// dy[t0, t0 + Lw + 3), through a per-thread cp.async ring: on the routes of 256-token sub-tiles its
// item's kStripLen-token (L) pieces split into one run per strip, walked at once (kLongWalk);
// elsewhere it walks L tokens at a time, the CTA's strips side by side (at C <= 16 the whole warp
// fills the rings, 4 rows of several strips per copy: BwdTraits::kWarpFill; at C <= 8 without
// states its dx rows are stored so too, kDxSlots). A walk recomputes a and g for tokens t0 .. t0 +
// Lw + 2 and emits dx for t0 .. t0 + Lw - 1 (dx[s] needs g up to s + 3, the 3-token lookahead,
// recomputed by the next walk too). Each thread sums g*x and g over its walks' own tokens in
// registers; at the end of the item the CTA adds its strips in strip order and writes one partial
// row per channel to the workspace: partials[item's token group][5][C]. A second kernel
// (causal_conv1d_bwd_reduce_kernel, launched with programmatic dependent launch like the stream
// kernel, so it is resident and waiting when the streaming kernel ends) adds them up a fixed tree
// (8 groups per node, 8 nodes per node of the level above, up to one root) into dweight and dbias:
// bitwise identical run to run (no float atomics anywhere), and the last CTAs of the stream no
// longer pay the tree's dependent round trips. Every row is written before it is read, so the
// workspace may hold anything on entry.
//
// Document positions: min(position in document, 3) of the item's tokens and the 3 after it, one
// byte each in shared memory, found once per item by scan_positions (a CTA-wide pivot search,
// then a scan of the document starts; scan_documents with states) while the first rows stream
// in; then the strips run without barriers. Only x, dy, dx[0, S), cu_seqlens[0, num_docs],
// frag_info[0, num_docs) and the state rows of documents 0 .. num_docs - 1 are addressed, whatever
// cu_seqlens holds.
//
// States (kStates; the stateless kernel is the same code without them): as in the forward, the
// x window takes a document's initial state at its first token (so a and the dweight sums read
// it); the strip that owns a document's first token emits the document's dinit two rows later,
// from the g of its first 3 tokens in the window; a token among its document's last 3 adds its
// final-state row's gradient to its dx; the CTA owning an empty document copies dfinal to dinit.
#pragma once

#include "causal_conv1d_bwd_plan.h"
#include "causal_conv1d_common.cuh"

namespace flashinfer_cake {

struct CausalConv1dBwdParams {
  const __nv_bfloat16* x;   // [S, C], rows x_row_stride vectors apart
  const __nv_bfloat16* dy;  // [S, C], rows dy_row_stride vectors apart
  __nv_bfloat16* dx;        // [S, C], rows dx_row_stride vectors apart
  const void* weight;       // [C, 4], WeightT
  const void* bias;         // [C], BiasT (unused for NoBias)
  const int32_t* cu_seqlens;  // [num_docs + 1]
  const __nv_bfloat16* initial_states;  // [num_docs, 3, C] or null (kStates only)
  const __nv_bfloat16* dfinal_states;   // [num_docs, 3, C] or null (kStates only)
  __nv_bfloat16* dinitial_states;       // [num_docs, 3, C], given iff initial_states is
  const int32_t* frag_info;  // [num_docs] or null: the CP backward's (scan_documents)
  float* partials;          // workspace: [groups][kBwdPartialRows][C], any content on entry
  void* dweight;            // [C, 4], WeightT
  void* dbias;              // [C], BiasT (unused for NoBias)
  int32_t S;
  int32_t C;
  int32_t num_docs;
  int32_t item_tokens;  // tokens of a token group below big_groups (all of them when big_groups is 0)
  int32_t big_groups;   // bwd_tail: groups of item_tokens tokens, then groups of tail_tokens
  int32_t tail_tokens;  // item_tokens when big_groups is 0; whole strips, or steps of 4 rows per strip on the
                        // routes that walk even runs (the launcher checks)
  int32_t groups;       // bwd_group_count
  int32_t tiles_c;      // channel tiles per token group
  int32_t round_preact;  // 1: silu' at the pre-activation rounded to BF16; 0: at the FP32 value
  // Row strides in kVec-channel vectors of the launched route (launch_causal_conv1d_bwd_route sets
  // them from the *_row_elems below).
  uint32_t x_row_stride;
  uint32_t dy_row_stride;
  uint32_t dx_row_stride;
  int32_t vec_shift;  // the rotation of channel slots to row-vector columns (bwd_vec_shift)
  // Row strides in elements (multiples of 8, so of either kVec), set by the C entry; read on the
  // host only.
  int64_t x_row_elems;
  int64_t dy_row_elems;
  int64_t dx_row_elems;
};

template <int kVec_, int kLanesC_, int kThreads_, int kStripLen_, int kRing_, int kMinCtasPerSm_>
struct BwdTraits {
  static constexpr int kVec = kVec_;          // channels per thread: 4 (8-byte rows) or 8 (16-byte)
  static constexpr int kLanesC = kLanesC_;    // threads side by side along channels
  static constexpr int kThreads = kThreads_;  // threads per CTA
  static constexpr int kStrips = kThreads / kLanesC;
  static constexpr int kStripLen = kStripLen_;  // tokens of a piece: a walk emits dx for one or more
  static constexpr int kRing = kRing_;          // shared-memory rows of x and of dy per thread
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;
  static constexpr int kTileTokens = kStrips * kStripLen;  // one sub-tile: every strip once
  static constexpr int kTileChannels = kLanesC * kVec;
  // Tiles of whole 256-byte row blocks: the stateless kernels may rotate them onto the rows' blocks
  // (the kernel's kRotates, the launcher's bwd_vec_shift).
  static constexpr bool kTilesOfRowBlocks = (kTileChannels * sizeof(__nv_bfloat16)) % kBwdRowBlockBytes == 0;
  static constexpr int kPosTokens = kBwdMaxItemTokens + 3;  // a group's tokens and their lookahead
  // The warp fills its strips' rings together, a chunk of 4 ring rows of every strip per step of 4
  // rows (the kernel's fill_piece), when a warp holds 8 or 16 strips (2 or 4 channel lanes: C <= 16).
  // Filled strip by strip, one cp.async of the warp read 32 / kLanesC strips' rows, each in a line of
  // its own, and wrote shared memory one line at a time: at C = 8, 16 wavefronts per cp.async, and
  // short-scoreboard stalls were 43 % of the samples (ncu, H200). Warp-filled (tune.py, H200,
  // graph-replayed): 1048576x16 47.6 -> 40.9 us, 2097152x8 76.8 -> 74.9 us; with states 2097152x8
  // 129 -> 89 us, 1048576x16 with 4096 documents 66.3 -> 71.0 us (the stateful kernel then spilled 4-8
  // bytes at 128 registers; none since dx's streaming stores, f3559a4). With 8 lanes (C = 32, 4 strips
  // per warp) 1-2 % slower: not taken.
  static constexpr bool kWarpFill = kLanesC <= 4;
  // A strip walks one even run of its group's tokens (the kernel says why): not where the warp fills its
  // strips' rings together, nor on the small-grid sub-tiles (under 256 tokens) or where one sub-tile is a
  // longest group (Narrow8). Such routes take groups of any multiple of 4 kStrips tokens (the launcher).
  static constexpr bool kLongWalk = !kWarpFill && kTileTokens >= kBwdPlanFullTileTokens && kTileTokens < kBwdMaxItemTokens;
  static_assert(kVec == 4 || kVec == 8, "rows of 8 or 16 bytes");
  static_assert(kThreads % kLanesC == 0 && kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kRing >= 4 && kRing % 4 == 0, "the loop steps 4 rows, so 4 ring slots, at a time");
  static_assert(kRing <= kStripLen + 7, "the first R - 1 rows are rows of the strip");
  static_assert(kStripLen % 4 == 0,
                "the step choice reads 4 codes at once from a strip's start, and its peeled step has 3 rows");
  static_assert(kBwdMaxItemTokens % kStripLen == 0, "groups are whole strips");
  // 12 rows: the chunk read, one landed or landing, one filling (8 would wait on each chunk at once).
  static_assert(!kWarpFill || kRing >= 12, "the warp-filled ring holds 3 chunks of 4 rows or more");
  // A walking warp's strips past the item's end read positions up to one warp's span past it.
  static_assert(!kWarpFill || kBwdMaxItemTokens % (32 / kLanesC * kStripLen) == 0,
                "a warp's strips stay inside the positions array");
};

#ifndef CAKE_BWD_DX_STREAMING
#define CAKE_BWD_DX_STREAMING 1  // dx stored with st.global.cs (store_out_row; tune.py: DX_STREAMING=0)
#endif

namespace detail {

// silu'(a) = r + a r (1 - r) with r = sigmoid(a) = 1 / (1 + 2^(-a log2 e)): ex2 and rcp are the
// hardware approximations (relative error about 2^-22); r (1 - r) = r - r^2 is one FMA (one rounding),
// and silu' one more. Written with r - r^2 rather than 2^(-a log2 e) r^2 so that a very negative finite
// a (2^(-a log2 e) overflows to inf) gives r = 0 and silu' = 0, not inf * 0 (a = +-inf gives NaN either way).
__device__ __forceinline__ float silu_grad(float a) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * -kLog2e));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return fmaf(a, fmaf(-r, r, r), r);
}

// Both values rounded to BF16 (to nearest even) and back: one packing conversion for two.
__device__ __forceinline__ void round_to_bf16(float& lo, float& hi) {
  const uint32_t h = pack_bf16x2_rn(lo, hi);
  lo = __uint_as_float(h << 16);
  hi = __uint_as_float(h & 0xffff0000u);
}

template <class T>
__device__ __forceinline__ void store_param(void* base, int i, float v);

template <>
__device__ __forceinline__ void store_param<float>(void* base, int i, float v) {
  static_cast<float*>(base)[i] = v;
}

template <>
__device__ __forceinline__ void store_param<__nv_bfloat16>(void* base, int i, float v) {
  static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
}

}  // namespace detail

// kRoundPreact: p.round_preact as a template argument (a branch per row otherwise). kStates:
// initial_states or dfinal_states may be given (either may still be null). kItemChoice (with
// kStates): a CTA whose item has no state event (no kInDoc among its tokens and their lookahead)
// walks a stateless-only loop, a third row body; the launcher picks it where such items are most
// of the grid (causal_conv1d_bwd_launcher.cuh has the rule and the figures).
template <class Traits, class WeightT, class BiasT, bool kRoundPreact, bool kStates, bool kItemChoice>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_bwd_kernel(const CausalConv1dBwdParams p) {
  static_assert(kStates || !kItemChoice, "the item choice is a choice between state events and none");
  // Launched after the stream's previous grid (launch_after_prerequisite): nothing is read or
  // written before that grid has ended.
  detail::wait_for_prerequisite_grid();
  // The reduce kernel may be scheduled once every CTA of this grid has passed its wait (it waits
  // for the whole grid's end before reading the partial rows).
  detail::launch_dependents();
  constexpr int L = Traits::kStripLen;
  constexpr int R = Traits::kRing;
  constexpr int N = L + 6;  // x rows a walk of one piece reads: 3 before t0, its L tokens, 3 of lookahead
  constexpr int TT = Traits::kTileTokens;
  constexpr int T = Traits::kThreads;
  constexpr int V = Traits::kVec;
  using Row = detail::Row<V>;
  constexpr int kSums = kBwdPartialRows * V;  // a thread's partial sums: 4 taps and g, V channels each
  // Per-thread rings of x and dy rows, R - 1 rows ahead of the computed one (kWarpFill: 4 to 8).
  // At the end of an item the same bytes hold the strips' partial sums.
  // A strip row of the tile under a 32-byte sector (C <= 8 on the shipped geometry), stateless:
  // dx rows staged in kDxSlots slots per thread and stored by the warp in chunks of 4 rows of a
  // strip (flush_piece). Stored per thread, a strip's 16-byte dx row was half a sector (twice the
  // L2 write sectors of the bytes, ncu) and one store wrote 16 strips' rows in 16 lines. tune.py,
  // H200, graph-replayed: 2097152x8 73.8 -> 51.3 us, 4194305x8 137 -> 98 us eager; at C = 16 (full
  // sectors already) 41.1 -> 45.5 us, and with states (128 registers: 32 bytes of spills) 88 -> 104
  // us at C = 8: not taken there.
  constexpr int kDxSlots = Traits::kWarpFill && Traits::kTileChannels * 2 < 32 && !kStates ? 12 : 0;
  constexpr int kRingBytes = (2 * R + kDxSlots) * T * sizeof(Row);
  constexpr int kSumBytes = kSums * T * 4;
  __shared__ __align__(detail::kRingAlign) unsigned char s_raw[kRingBytes > kSumBytes ? kRingBytes : kSumBytes];
  Row* const s_xring = reinterpret_cast<Row*>(s_raw);
  Row* const s_dyring = s_xring + R * T;
  [[maybe_unused]] Row* const s_dxring = s_dyring + R * T;
  float* const s_sums = reinterpret_cast<float*>(s_raw);  // [kSums][T]
  // min(position in document, 3) per item token; kStates: its code. Words, as a 4-row step reads
  // its 4 codes at once (one load per step; with states also the step choice); the peeled step's
  // word reads the byte after the item's last code (one more than kPosTokens at the longest
  // item), masked off.
  __shared__ uint32_t s_pos_words[(Traits::kPosTokens + 4) / 4];
  uint8_t* const s_pos = reinterpret_cast<uint8_t*>(s_pos_words);
  __shared__ uint8_t s_flags[kStates ? 1 : Traits::kPosTokens + 2];  // document starts (scan_positions)
  __shared__ int32_t s_entries[T];  // the position scan's first round (scan_positions, scan_documents)
  // kStates: the tokens' documents, and scan_documents' scratch.
  __shared__ int32_t s_doc[kStates ? Traits::kPosTokens : 1];
  __shared__ int32_t s_first_idx[kStates ? Traits::kPosTokens + 5 : 1], s_last_idx[kStates ? Traits::kPosTokens + 5 : 1];
  // kItemChoice: [0] is 1 when a token of the item or of its lookahead has kInDoc (scan_documents'
  // one block, as long as the scan's tokens).
  __shared__ uint8_t s_item_events[kItemChoice ? 2 : 1];
  // Static shared memory (the launch asks for no more): within the 48 KiB a kernel may declare,
  // counting scan_documents' (kStates) per-thread scratch. The shipped geometry's largest, WideVec8
  // with states, has 47 312 bytes.
  static_assert(sizeof(s_raw) + sizeof(s_pos_words) + sizeof(s_flags) + sizeof(s_entries) + sizeof(s_doc) +
                        sizeof(s_first_idx) + sizeof(s_last_idx) + (kStates ? T * sizeof(int32_t) + 8 : 0) <=
                    48 * 1024,
                "the backward's static shared memory exceeds 48 KiB: fewer ring rows or threads (tune.py: WIDE_VEC8=0 "
                "keeps 8-byte rows, whose rings are half the size)");

  const int lane_c = threadIdx.x % Traits::kLanesC;
  const int strip = threadIdx.x / Traits::kLanesC;
  // Launch order: the long groups of a split (bwd_tail), then the last token group, then the
  // rest. The last group runs first among groups of its length: with states it holds the end of the
  // batch's last document, whose strips wait on the final states' gradient (loaded where it was added,
  // before v27); run last, that wait extended the whole kernel (1 document: 1.11-1.19x the stateless
  // time, 1.02-1.08x so; tune.py --states, H200; not re-measured since v27 loads it 3 rows ahead). A
  // short group ahead of the long ones would start a long one late. The reduction adds groups by
  // index, not launch order.
  const int launch_group = blockIdx.x / p.tiles_c;
  const int tile_c = blockIdx.x - launch_group * p.tiles_c;
  const int group = launch_group < p.big_groups    ? launch_group
                    : launch_group == p.big_groups ? p.groups - 1
                                                   : launch_group - 1;
  // My row-vector column: the grid's channel slot, rotated by p.vec_shift in the stateless kernels of
  // tiles of whole 256-byte blocks (bwd_vec_shift: the tiles' bounds then fall on the rows' blocks; the
  // launcher sets a shift only where C is a multiple of the tile, so every lane stays on a channel). Not
  // in the stateful kernels: at their 128-register cap the rotated column spilled (8-byte stack frames).
  const int channel_slot = tile_c * Traits::kLanesC + lane_c;
  const uint32_t vecs_per_row = p.C / V;
  constexpr bool kRotates = !kStates && Traits::kTilesOfRowBlocks;
  const int vec = !kRotates                    ? channel_slot
                  : channel_slot < p.vec_shift ? channel_slot - p.vec_shift + static_cast<int>(vecs_per_row)
                                               : channel_slot - p.vec_shift;
  const bool active = static_cast<uint32_t>(vec) < vecs_per_row;  // (a rotation keeps every lane on)
  // No idle lane in this CTA's channel tile (the inside strips, below; always true on the shipped
  // route that has them, WideVec8, whose C is a multiple of its 256-channel tile).
  [[maybe_unused]] const bool tile_full = static_cast<uint32_t>((tile_c + 1) * Traits::kLanesC) <= vecs_per_row;
  const int t_lim = active ? p.S : INT32_MIN;  // tokens < t_lim are read and written
  const bool big_group = group < p.big_groups;
  const int group_tokens = big_group ? p.item_tokens : p.tail_tokens;
  const int item_t0 = big_group ? group * p.item_tokens : p.big_groups * p.item_tokens + (group - p.big_groups) * p.tail_tokens;
  const int item_end = min(item_t0 + group_tokens, p.S);
  const Row* __restrict__ xv = reinterpret_cast<const Row*>(p.x);
  const Row* __restrict__ dyv = reinterpret_cast<const Row*>(p.dy);
  Row* __restrict__ dxv = reinterpret_cast<Row*>(p.dx);
  // (A swizzle of the rings' odd slots against bank conflicts was measured and removed: NOTES_bwd sessions 55-57.)
  static_assert(kDxSlots % 4 == 0, "the dx flush steps 4 slots at a time");
  Row* const my_xring = s_xring + threadIdx.x;
  Row* const my_dyring = s_dyring + threadIdx.x;

  // The first R - 1 rows of the strip at t0 into ring slots 1 .. R - 1, one cp.async group each
  // (kWarpFill: one group per chunk, below). x row i is token t0 - 3 + i; dy row i is the same
  // token, read from i = 3 on. Rows outside [0, S) and lanes past C read zeros (so g is 0 past S).
  // Offsets are 32-bit: the launcher caps S * row stride / V < 2^32 for each of x, dy and dx.
  const uint32_t xs = p.x_row_stride, dys = p.dy_row_stride;
  // kWarpFill: chunk k of a strip is ring rows 4k - 1 .. 4k + 2 (tokens t0 - 4 + 4k ..), in slots
  // 4k .. 4k + 3 (mod R). Lane l's piece of a chunk is ring row 4k - 1 + piece_row of channel lane
  // piece_lane of the warp's strip piece_strip + q kFillStride at phase q = 0..3: the warp's 32
  // pieces of one phase are 4 consecutive rows of kFillStride strips (at C = 8: 4 lines, not 16).
  // kDxSlots: the same lane stores row piece_row of that strip's dx chunk m (tokens 4m .. 4m + 3).
  constexpr bool kWarpFill = Traits::kWarpFill;
  constexpr int kFillStride = kWarpFill ? 8 / Traits::kLanesC : 1;
  const int strip_in_warp = strip % (32 / Traits::kLanesC);
  const int lane = threadIdx.x % 32;
  const int piece_lane = lane % Traits::kLanesC, piece_row = lane / Traits::kLanesC % 4,
            piece_strip = lane / (4 * Traits::kLanesC);
  // (unrotated: the warp-filled routes' tiles are narrower than 256 bytes, so their vec_shift is 0)
  const uint32_t piece_vec = static_cast<uint32_t>(tile_c * Traits::kLanesC + piece_lane);
  const bool piece_active = piece_vec < vecs_per_row;
  // phase q's owner thread is q kFillStride strips (8 q threads) on from phase 0's
  static_assert(!kWarpFill || kFillStride * Traits::kLanesC == 8, "phase q's owner is 8 q threads on");
  // The piece's entry in its slot: the owner thread's index in the warp at phase 0 (phase q adds 8 q).
  const int piece_entry = piece_strip * Traits::kLanesC + piece_lane;
  Row* const piece_xring = s_xring + (threadIdx.x - lane) + piece_strip * Traits::kLanesC + piece_lane + piece_row * T;
  Row* const piece_dyring = piece_xring + R * T;
  // The t0 of the warp's first strip, and of the strip a lane's piece of phase q belongs to.
  const auto warp_t0_of = [&](int t0) { return t0 - strip_in_warp * L; };
  const auto piece_t0 = [&](int warp_t0, int q) { return warp_t0 + (piece_strip + q * kFillStride) * L; };
  // Chunk k into slots first_slot .. first_slot + 3.
  [[maybe_unused]] const auto fill_piece = [&](int warp_t0, int k, int first_slot, auto phase) {
    constexpr int q = decltype(phase)::value;
    const int st0 = piece_t0(warp_t0, q);
    const int i = 4 * k - 1 + piece_row;  // ring row: token st0 - 3 + i
    const int t = st0 - 3 + i;
    const bool valid = piece_active && st0 < item_end && i < N && t >= 0 && t < p.S;
    const int dst = first_slot * T + 8 * q;
    detail::cp_async_row(piece_xring + dst, xv + (valid ? static_cast<uint32_t>(t) * xs + piece_vec : 0u), valid);
    detail::cp_async_row(piece_dyring + dst, dyv + (valid ? static_cast<uint32_t>(t) * dys + piece_vec : 0u), valid && i >= 3);
  };
  // dx chunk m from slots first_slot .. first_slot + 3 (token u is in slot u mod kDxSlots).
  const uint32_t dxs = p.dx_row_stride;
  [[maybe_unused]] const auto flush_piece = [&](int warp_t0, int m, int first_slot, auto phase) {
    constexpr int q = decltype(phase)::value;
    const int st0 = piece_t0(warp_t0, q);
    const int t = st0 + 4 * m + piece_row;
    const Row v =
        s_dxring[(first_slot + piece_row) * T + (threadIdx.x - lane) + (piece_entry + 8 * q)];
    if (piece_active && st0 < item_end && t < p.S)
      detail::store_out_row<CAKE_BWD_DX_STREAMING != 0>(dxv + (static_cast<uint32_t>(t) * dxs + piece_vec), v);
  };
  const auto prefetch = [&](int t0) {
    if constexpr (kWarpFill) {  // chunks 0 .. R / 4 - 1, one cp.async group each
      const int warp_t0 = warp_t0_of(t0);
#pragma unroll
      for (int k = 0; k < R / 4; ++k) {
        fill_piece(warp_t0, k, 4 * k, std::integral_constant<int, 0>{});
        fill_piece(warp_t0, k, 4 * k, std::integral_constant<int, 1>{});
        fill_piece(warp_t0, k, 4 * k, std::integral_constant<int, 2>{});
        fill_piece(warp_t0, k, 4 * k, std::integral_constant<int, 3>{});
        detail::cp_async_commit();
      }
      return;
    }
    const uint32_t x_base = static_cast<uint32_t>(t0) * xs + vec, dy_base = static_cast<uint32_t>(t0) * dys + vec;
#pragma unroll
    for (int i = 0; i < R - 1; ++i) {
      const int t = t0 - 3 + i;
      const bool valid = t >= 0 && t < t_lim;
      detail::cp_async_row(my_xring + (i + 1) * T, xv + (valid ? x_base + (i - 3) * xs : 0u), valid);
      if (i >= 3) detail::cp_async_row(my_dyring + (i + 1) * T, dyv + (valid ? dy_base + (i - 3) * dys : 0u), valid);
      detail::cp_async_commit();
    }
  };

  // The position scan's first load, ahead of the rows.
  const int32_t first_round = detail::load_first_round<T>(p.cu_seqlens, p.num_docs);
  // The strip's walks. Routes that fill their rings per thread (all but kWarpFill) give each strip one
  // run of the item's consecutive tokens, walked at once (kLongWalk): its ring streams on through the
  // run. Walked a piece at a time (the CTA's strips side by side, TT tokens a sub-tile, as the other
  // routes still do), each walk re-read and recomputed a 3-token halo on both sides and refilled its
  // ring only once the walk before had consumed it. tune.py, H200, 2026-12-03, rested, 1024-token
  // groups (a strip's 4 walks one): 16384x8192 223.4 -> 218.4 us (86 -> 88 % of copy), 65536x2048 (32
  // documents) 223.3 -> 214.3, 131072x4096 (32) 857.6 -> 824.6, 1048576x128 232.9 -> 228.4; dx bitwise,
  // dweight and dbias summed in another (fixed) order (r141).
  // The runs split the item evenly: ceil(tokens / kStrips) rounded up to a whole step of 4 rows (a
  // step reads its 4 codes as one word). A CTA lasts as long as its longest strip, and runs of whole
  // L-token pieces (until r173) walked a 576-token group as 192, 128, 128, 128 tokens and an 832-token
  // one as 256, 256, 256, 64. tune.py, H200, 2026-12-04, rested, 1 document, main -> even runs (r173):
  // 16384x3328 (832-token groups) 105.9 -> 91.6 us (77 -> 89 % of copy), 12288x3072 (576) 81.7 -> 65.9,
  // 50000x1024 (832) 105.7 -> 88.5, 8192x5120 (640) 82.5 -> 74.3, 100003x512 (832) 108.2 -> 90.4. Groups
  // of whole sub-tiles walk the runs they walked before (the same dweight / dbias bits; r172:
  // 16384x4096 112.9 / 113.0, 16384x8192 217.5 / 217.6).
  // Only where a strip may get more than one piece (Traits::kLongWalk): not on the small-grid routes,
  // whose sub-tiles of 128 tokens serve groups under 256 (1 or 2 pieces a strip; the long walk's code was
  // 2-2.7 % slower there, r142, graph-replayed: 4096x4096 33.5 -> 34.4 us, 1024x8192 19.8 -> 20.2,
  // 8192x2048 33.8 -> 34.6), nor where one sub-tile is a longest group (Narrow8: one piece a strip).
  constexpr bool kLongWalk = Traits::kLongWalk;
  const int run_tokens = kLongWalk ? ((item_end - item_t0 + Traits::kStrips - 1) / Traits::kStrips + 3) / 4 * 4 : L;
  const int first_t0 = item_t0 + strip * run_tokens;
  // Tokens of dx a walk emits (a multiple of 4; the item's last walk may pass S) and the step to the
  // strip's next walk (kLongWalk: past the item).
  const int walk_len = kLongWalk ? min(run_tokens, (item_end - first_t0 + 3) / 4 * 4) : L;
  const int walk_step = kLongWalk ? Traits::kStrips * run_tokens : TT;
  // kWarpFill: the warp walks while its first strip has tokens (a strip past the item's end walks
  // zeros; its lanes fill the others' rings).
  const auto walks = [&](int t0) { return (kWarpFill ? warp_t0_of(t0) : t0) < item_end; };
  if (walks(first_t0)) prefetch(first_t0);  // streams while the positions are searched
  float w[4][V] = {}, b[V] = {};
  if (active) {
    detail::load_weights<WeightT>(p.weight, vec * V, w);
    detail::load_bias<BiasT>(p.bias, vec * V, b);
  }
  if constexpr (!detail::kHasBias<BiasT>) {
    // Without a bias, a zero the compiler cannot see: the pre-activation's first tap is then an FFMA
    // as with a bias (a = w x + 0 differs from w x only in the sign of a zero, which silu' ignores),
    // and the loop is the bias variant's. The known zero left 13 more MOVs per 4 rows in WideVec8's
    // inside loop (949 against 937, nvcc 13.0); r145 (tune.py, H200, FP32 taps, rested): 16384x8192
    // 220.2 -> 215.1 us, 131072x4096 840.2 -> 821.2, 8192x4096 63.1 -> 62.0, bitwise the same.
#pragma unroll
    for (int j = 0; j < V; ++j) b[j] = __int_as_float(min(p.S, 0));  // S >= 0: +0.0f
  }
  // Positions of the item's tokens and of the 3 tokens after it (the last strip's lookahead).
  // State rows: [num_docs][3] rows of C / V vectors; row i of document d at (3 d + i) C / V.
  const Row* __restrict__ init_v = reinterpret_cast<const Row*>(p.initial_states);
  const Row* __restrict__ dfinal_v = reinterpret_cast<const Row*>(p.dfinal_states);
  Row* __restrict__ dinit_v = reinterpret_cast<Row*>(p.dinitial_states);
  const auto state_off = [&](int d, int i) { return detail::state_row_offset(d, i, vecs_per_row); };
  if constexpr (kStates) {
    // An empty document passes its final state's gradient to its initial state, for this tile's
    // channels.
    const auto on_empty = [&](int d, int i, int v) {
      detail::empty_document_state_row(init_v != nullptr, dfinal_v, dinit_v, d, i, v + tile_c * Traits::kLanesC, vecs_per_row);
    };
    const auto scan = [&](auto blocks) {
      detail::scan_documents<T, Traits::kPosTokens, Traits::kLanesC>(p.cu_seqlens, p.num_docs, p.S, item_t0,
                                                                    group_tokens + 3, item_end, s_first_idx, s_last_idx,
                                                                    s_pos, s_doc, blocks, p.frag_info, on_empty,
                                                                    &first_round, s_entries);
    };
    if constexpr (kItemChoice) {
      scan(static_cast<uint8_t*>(s_item_events));
    } else {
      scan(nullptr);
    }
  } else {
    detail::scan_positions<T>(p.cu_seqlens, p.num_docs, item_t0, group_tokens + 3, s_flags, s_pos, first_round,
                              s_entries);
  }
  __syncthreads();

  float dw[4][V] = {}, db[V] = {};
  for (int t0 = first_t0; walks(t0); t0 += walk_step) {
    const int Lw = walk_len;  // the walk's own tokens
    const bool live = kWarpFill ? active && t0 < item_end : active;  // the strip's rows are read and written
    const int dx_lim = live ? p.S : INT32_MIN;
    const uint32_t x_base = static_cast<uint32_t>(t0) * xs + vec, dy_base = static_cast<uint32_t>(t0) * dys + vec;
    const uint8_t* pos_row = s_pos + (t0 - item_t0);  // pos_row[r]: token t0 + r (kStates: its code)
    const int32_t* doc_row = s_doc + (t0 - item_t0);  // kStates: doc_row[r], its document
    // Windows as 4-slot circular buffers and a loop stepping 4 rows, so no register moves: at
    // row r (token u = t0 + r, phase q = r % 4) slot (q+1) % 4 holds x[u-3] and g[u-3], slot
    // (q+2) % 4 x[u-2], g[u-2] and pos[u-2], slot (q+3) % 4 x[u-1], g[u-1] and pos[u-1], and
    // row r writes its own into slot q (whose x[u-4] and g[u-4] are no longer needed). The loop
    // is not unrolled further: the body stays small in the instruction cache.
    float xm[4][V], gm[4][V] = {};
    [[maybe_unused]] Row fm[4];  // kStates: slot q, the dfinal row of the token of phase q
    int pm[4] = {0, 0, 0, 0};
    // Rows 0..2 (x before t0), each refilling the ring with row i + R - 1 (a token >= t0 - 1).
    if constexpr (kWarpFill) {  // chunk 0 has them; the steps refill
      detail::cp_async_wait<R / 4 - 1>();
      __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < 3 && kWarpFill; ++i) {  // slot i + 1
      detail::row_to_float(my_xring[(i + 1) * T], xm[i + 1]);
    }
#pragma unroll
    for (int i = 0; i < 3 && !kWarpFill; ++i) {
      if (i + R - 1 < N) {
        const int t = t0 + R - 4 + i;
        const bool valid = t >= 0 && t < t_lim;
        detail::cp_async_row(my_xring + i * T, xv + (valid ? x_base + (R - 4 + i) * xs : 0u), valid);  // slot (i + R) % R
        if (i + R - 1 >= 3) detail::cp_async_row(my_dyring + i * T, dyv + (valid ? dy_base + (R - 4 + i) * dys : 0u), valid);
      }
      detail::cp_async_commit();
      detail::cp_async_wait<R - 1>();
      detail::row_to_float(my_xring[(i + 1) * T], xm[i + 1]);
    }
    if constexpr (kStates) {
      detail::strip_start_state_rows<V>(pos_row[0], init_v && live, doc_row, init_v, vecs_per_row, vec, xm);
    }
    // Loop state, stepped once per row or per step (no per-row multiplies): the ring slots of the
    // step's 4 rows (cur) and of the 4 rows before them (prev), the token and offset of the next
    // row to refill, and of the next dx row. Ring row j (token t0 - 3 + j) is in slot (j + 1) % R,
    // so a step's rows r + 3 .. r + 6 take slots cur .. cur + 3 without wrapping.
    // kStates: dinit of document d from the g of its first three tokens (g1, g2 only where
    // in1, in2: still in the document) and, for a document of n < 3 tokens (n = 1, 2: the end
    // distance of its first token; 0 or 3 for longer ones), the gradient of the final rows that
    // are its initial rows n .. 2. FP32, rounded once.
    [[maybe_unused]] const auto emit_dinit = [&](int d, int n, const float(&g0)[V], const float(&g1)[V], bool in1,
                                                 const float(&g2)[V], bool in2) {
      float d0[V], d1[V], d2[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        d0[j] = w[0][j] * g0[j];
        d1[j] = w[1][j] * g0[j];
        d2[j] = w[2][j] * g0[j];
        if (in1) {
          d1[j] = fmaf(w[0][j], g1[j], d1[j]);
          d2[j] = fmaf(w[1][j], g1[j], d2[j]);
        }
        if (in2) d2[j] = fmaf(w[0][j], g2[j], d2[j]);
      }
      const size_t off = state_off(d, 0) + vec;
      if (dfinal_v && (n == 1 || n == 2)) {  // final row i is initial row n + i (i < 3 - n)
        float f[V];
        detail::row_to_float(__ldg(dfinal_v + off + (2 - n) * vecs_per_row), f);  // -> initial row 2
#pragma unroll
        for (int j = 0; j < V; ++j) d2[j] += f[j];
        if (n == 1) {
          detail::row_to_float(__ldg(dfinal_v + off), f);  // final row 0 -> initial row 1
#pragma unroll
          for (int j = 0; j < V; ++j) d1[j] += f[j];
        }
      }
      dinit_v[off] = detail::pack_row<V>(d0);
      dinit_v[off + vecs_per_row] = detail::pack_row<V>(d1);
      dinit_v[off + 2 * vecs_per_row] = detail::pack_row<V>(d2);
    };
    int cur = 4 % R, prev = 0;
    int refill_t = t0 + R - 1;
    uint32_t refill_x = x_base + (R - 1) * xs, refill_dy = dy_base + (R - 1) * dys;
    [[maybe_unused]] int flush_slot = 4;  // kDxSlots: (r0 - 8) mod 12 at the step of row r0
    int dx_t = t0 - 3;
    uint32_t dx_off = static_cast<uint32_t>(t0 - 3) * dxs + vec;
    // kEvents (a compile-time bool): the stateful body, which the walk below runs on a step when
    // a token near it has a state event (kInDoc) in this lane or another lane of the warp. Its
    // kInDoc-gated work reads the row's own code (the dfinal load), the one 2 rows back (dinit)
    // and 3 back (the dfinal add): a new kInDoc-gated read must stay in that window or widen
    // step_events' masks. Where no token in the window has kInDoc it computes bitwise what the
    // stateless body does.
    [[maybe_unused]] uint32_t step_codes = 0;
    // kInside (a compile-time bool): every row the walk refills (up to token t0 + Lw + 2) and every
    // dx row it stores (t0 .. t0 + Lw - 1) is below S, and every lane of the tile is active, so the
    // row needs no bounds tests (row_inside, below; the rows before t0 come from prefetch and the
    // prologue, which keep theirs).
    // kWhole (a compile-time bool): the row is in a whole step of the walk (so r + 3 < Lw), not its
    // peeled last step (r >= Lw: the lookahead).
    const auto row_body = [&](int r, auto phase, auto events, auto inside, auto whole) {
      constexpr int q = decltype(phase)::value, s3 = (q + 1) % 4, s2 = (q + 2) % 4, s1 = (q + 3) % 4;
      constexpr bool kWhole = decltype(whole)::value;
      constexpr bool kEvents = decltype(events)::value;
      constexpr bool kInside = decltype(inside)::value;
      if constexpr (q == 0) step_codes = *reinterpret_cast<const uint32_t*>(pos_row + r);
      const int code = step_codes >> (8 * q) & 0xff;
      if constexpr (kEvents) {
        // The token is one of its document's last 3, k before its end: its final-state row's
        // gradient (row 3 - k) is loaded now and added to its dx 3 rows later, so the load's
        // latency is hidden behind 3 rows (loaded where it is added, it was 12 % of the stall
        // samples at 1024 documents, r35). The step of row r + 3 is stateful too: it looks 3
        // tokens back. Rows >= Lw are the lookahead: their dx is the next walk's, which loads
        // their dfinal itself (skipping them: 1-2.6 % at many documents, r41).
        const int c = code, k = c >> detail::kEndShift & 3;
        if ((kWhole || r < Lw) && dfinal_v && live && k && (c & detail::kInDoc)) {
          fm[q] = __ldg(dfinal_v + state_off(doc_row[r], 3 - k) + vec);
        }
      }
      if constexpr (kWarpFill) {
        // The step's chunk (slots cur ..) landed for every lane, and every lane has read the
        // chunk before it (slots prev ..), which the step refills with chunk r / 4 + R / 4.
        if constexpr (q == 0) {
          detail::cp_async_wait<R / 4 - 2>();
          __syncwarp();
        }
        // Without states the chunk's 4 phases go at the step's first row, one group (the loads issue
        // up to 3 rows earlier; Narrow4's 4-row loop 575 -> 536 instructions, Narrow2's 626 -> 590;
        // H100 graph-replayed 530000x8 with 2000 documents 24.8 -> 23.1 us, but 2097152x8 58.3 -> 58.6,
        // NOTES_bwd session 57; scripts/probes/bwd_fill_c8_per_row.diff keeps C = 8 per row).
        // With states one phase a row: batched there, the no-bias stateful kernels got stack frames.
        if constexpr (kStates) {
          if (r - q + R - 1 < N) fill_piece(warp_t0_of(t0), r / 4 + R / 4, prev, phase);
          if constexpr (q == 3) detail::cp_async_commit();  // possibly empty: keeps "chunk k is group k"
        } else if constexpr (q == 0) {
          if (r + R - 1 < N) {
            const int warp_t0 = warp_t0_of(t0);
            fill_piece(warp_t0, r / 4 + R / 4, prev, std::integral_constant<int, 0>{});
            fill_piece(warp_t0, r / 4 + R / 4, prev, std::integral_constant<int, 1>{});
            fill_piece(warp_t0, r / 4 + R / 4, prev, std::integral_constant<int, 2>{});
            fill_piece(warp_t0, r / 4 + R / 4, prev, std::integral_constant<int, 3>{});
          }
          detail::cp_async_commit();  // possibly empty: keeps "chunk k is group k"
        }
      } else {
        // Refill the slot ring row r + 2 has just left with row r + R + 2, if below Lw + 6. Tested on
        // the step's first row r - q (the same answer for its 4 rows: Lw and R are multiples of 4), one
        // test per step.
        if (r - q + R + 2 < Lw + 6) {
          const bool valid = kInside || refill_t < t_lim;
          const int slot = q == 0 ? prev + 3 : cur + q - 1;
          detail::cp_async_row(my_xring + slot * T, xv + (valid ? refill_x : 0u), valid);
          detail::cp_async_row(my_dyring + slot * T, dyv + (valid ? refill_dy : 0u), valid);
        }
        ++refill_t;
        refill_x += xs;
        refill_dy += dys;
        detail::cp_async_commit();  // possibly empty: keeps "ring row j is group j"
        detail::cp_async_wait<R - 1>();
      }
      const int pos = code & detail::kPosMask;  // the token's position: which later tokens' taps reach it
      int read_pos = pos;  // the taps the token reads itself: all of them with an initial state
      if constexpr (kEvents) {
        if (init_v && live && (code & detail::kInDoc)) {
          if (pos == 0) {  // a document's first token: the window takes its initial state
            const size_t off = state_off(doc_row[r], 0) + vec;
            detail::row_to_float(__ldg(init_v + off + 2 * vecs_per_row), xm[s1]);
            detail::row_to_float(__ldg(init_v + off + vecs_per_row), xm[s2]);
            detail::row_to_float(__ldg(init_v + off), xm[s3]);
          }
          read_pos = 3;
        }
      }
      float xt[V], dyt[V], g[V];
      detail::row_to_float(my_xring[(cur + q) * T], xt);
      detail::row_to_float(my_dyring[(cur + q) * T], dyt);
      float a[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        // The FP32 pre-activation, bias first, then the taps current-first (the forward's order;
        // the forward sums taps pre-scaled by -log2 e, so the two may differ by an ulp).
        a[j] = fmaf(w[3][j], xt[j], b[j]);
        if (read_pos >= 1) a[j] = fmaf(w[2][j], xm[s1][j], a[j]);
        if (read_pos >= 2) a[j] = fmaf(w[1][j], xm[s2][j], a[j]);
        if (read_pos >= 3) a[j] = fmaf(w[0][j], xm[s3][j], a[j]);
      }
      if constexpr (kRoundPreact) {
#pragma unroll
        for (int j = 0; j < V; j += 2) detail::round_to_bf16(a[j], a[j + 1]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) g[j] = dyt[j] * detail::silu_grad(a[j]);
      if (kWhole || r < Lw) {  // the walk's own tokens: each token's g is summed by exactly one walk
#pragma unroll
        for (int j = 0; j < V; ++j) {
          db[j] += g[j];
          dw[3][j] = fmaf(g[j], xt[j], dw[3][j]);
          if (read_pos >= 1) dw[2][j] = fmaf(g[j], xm[s1][j], dw[2][j]);
          if (read_pos >= 2) dw[1][j] = fmaf(g[j], xm[s2][j], dw[1][j]);
          if (read_pos >= 3) dw[0][j] = fmaf(g[j], xm[s3][j], dw[0][j]);
        }
      }
      if constexpr (kEvents) {
        // dinit of the document whose first token is u - 2, one of the strip's own: its first 3
        // tokens' g are in the window now (those still in the document).
        if (init_v && live && r >= 2 && (kWhole || r - 2 < Lw) && (pm[s2] & detail::kPosMask) == 0 && (pm[s2] & detail::kInDoc)) {
          emit_dinit(doc_row[r - 2], pm[s2] >> detail::kEndShift & 3, gm[s2], gm[s1], (pm[s1] & detail::kPosMask) >= 1, g,
                     pos >= 2);
        }
      }
      if (r >= 3) {  // dx of token s = u - 3 = t0 + r - 3, whose last consumer is u
        float d[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          // Token s + m read x[s] through tap 3 - m iff its position is >= m. FP32 order: tap 3
          // (token s itself) first.
          float v = w[3][j] * gm[s3][j];
          if ((pm[s2] & detail::kPosMask) >= 1) v = fmaf(w[2][j], gm[s2][j], v);
          if ((pm[s1] & detail::kPosMask) >= 2) v = fmaf(w[1][j], gm[s1][j], v);
          if (pos >= 3) v = fmaf(w[0][j], g[j], v);
          d[j] = v;
        }
        if constexpr (kEvents) {
          // s is one of its document's last 3 tokens: its final-state row's gradient, loaded
          // 3 rows ago into slot s3, adds to its dx.
          const int cs = pm[s3], k = cs >> detail::kEndShift & 3;
          if (dfinal_v && live && k && (cs & detail::kInDoc)) {
            float f[V];
            detail::row_to_float(fm[s3], f);
#pragma unroll
            for (int j = 0; j < V; ++j) d[j] += f[j];
          }
        }
        if constexpr (kDxSlots > 0) {  // token r - 3 into slot (r - 3) mod 12 = flush_slot + 5 + q mod 12
          const int slot = flush_slot + 5 + q >= kDxSlots ? flush_slot + 5 + q - kDxSlots : flush_slot + 5 + q;
          s_dxring[slot * T + threadIdx.x] = detail::pack_row<V>(d);
        } else {
          if (kInside || dx_t < dx_lim)
            detail::store_out_row<CAKE_BWD_DX_STREAMING != 0>(dxv + dx_off, detail::pack_row<V>(d));
        }
      }
      if constexpr (kDxSlots > 0) {
        // Chunk r / 4 - 2, at the step's first row (its last row was stored 2 rows into the step
        // before, before the step's __syncwarp); the peeled step leaves its chunks to the tail. Its
        // 4 phases at once: one phase per row re-formed the lane's piece terms for each row under
        // the register cap (Narrow2's 4-row loop, FP32 taps + bias, the bf16 policy: 662 -> 626
        // instructions, cuobjdump; H200 graph-replayed 2097152x8 47.4 -> 46.9 us, NOTES_bwd session 56).
        if constexpr (q == 0) {
          if (r >= 8 && r + 4 <= L + 3) {
            const int warp_t0 = warp_t0_of(t0), m = r / 4 - 2;
            flush_piece(warp_t0, m, flush_slot, std::integral_constant<int, 0>{});
            flush_piece(warp_t0, m, flush_slot, std::integral_constant<int, 1>{});
            flush_piece(warp_t0, m, flush_slot, std::integral_constant<int, 2>{});
            flush_piece(warp_t0, m, flush_slot, std::integral_constant<int, 3>{});
          }
        }
        if constexpr (q == 3) flush_slot = flush_slot + 4 == kDxSlots ? 0 : flush_slot + 4;
      }
      ++dx_t;
      dx_off += dxs;
      pm[q] = code;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        xm[q][j] = xt[j];
        gm[q][j] = g[j];
      }
    };
    // whole: walk_rows_n's step kind; walk_rows (!kLongWalk) gives none, and there the row's index
    // against Lw (= L, a constant) tells the compiler.
    const auto row = [&](int r, auto phase, auto events, auto... whole) {
      row_body(r, phase, events, std::false_type{}, std::bool_constant<detail::kIsWholeStep<decltype(whole)...>>{});
    };
    [[maybe_unused]] const auto row_inside = [&](int r, auto phase, auto events, auto... whole) {
      row_body(r, phase, events, std::true_type{}, std::bool_constant<detail::kIsWholeStep<decltype(whole)...>>{});
    };
    const auto no_events = [](int, auto...) { return std::false_type{}; };
    // Rows 0 .. Lw + 2: Lw in steps of 4, then a peeled step of 3.
    const auto walk = [&](auto&& row_fn, int& cur_, int& prev_, auto&& events_fn) {
      if constexpr (kLongWalk) {
        detail::walk_rows_n<R>(Lw, row_fn, cur_, prev_, events_fn);
      } else {
        detail::walk_rows<L + 3, R>(row_fn, cur_, prev_, events_fn);
      }
    };
    // With states, each step of 4 rows r .. r + 3 runs the stateful body when one of the tokens
    // r - 3 .. r + 3 has kInDoc (rows read their own code, dinit the one 2 rows back, dfinal 3
    // back) in any lane of the warp converged at the vote (routes of fewer than 32 channel lanes
    // put 2-16 strips in a warp: voted per lane, the warp would run both bodies one after the
    // other), else the stateless body. tune.py --states (H200, 2026-12-01), time over the
    // stateless backward, against a first choice per strip (a strip without kInDoc in its block
    // and the next walked a third, stateless-only loop; code 92-95 KB, now 77-80 KB): 8192x4096
    // 17 documents 1.19 -> 1.07x, 4096x8192 24 documents 1.31 -> 1.14x, 524288x64 2048 documents
    // 1.90 -> 1.27x, 1048576x16 4096 documents 2.21 -> 1.31x; 1 document 1.006 -> 1.038x, 512-1820
    // documents within 1 %. Reading the next step's choice one step ahead was slower (1 document
    // 1.057x).
    if constexpr (kStates) {
      const auto step_events = [&](int r, auto... whole) {
        // codes of tokens r .. r + 3 (the peeled step: r .. r + 2) and r - 3 .. r - 1 (the word
        // r - 4 .. r - 1, r - 4 masked off; none before the first step, whose rows look back to
        // token 0 only, and whose word would precede the item's first strip)
        const uint32_t mine = detail::kIsWholeStep<decltype(whole)...> || r + 4 <= Lw + 3 ? 0x10101010u : 0x00101010u;
        static_assert(detail::kInDoc == 0x10, "the masks test kInDoc in each byte");
        uint32_t m = *reinterpret_cast<const uint32_t*>(pos_row + r) & mine;
        if (r >= 4) m |= *reinterpret_cast<const uint32_t*>(pos_row + r - 4) & 0x10101000u;
        // Every lane's vote includes its own m (a lane the mask leaves out votes on its own), and
        // the stateful body is bitwise the stateless one where m is 0: which lanes converge here
        // changes the time, never the result.
        return __any_sync(__activemask(), m != 0) != 0;
      };
      if constexpr (kItemChoice) {
        if (s_item_events[0]) {  // uniform in the CTA
          walk(row, cur, prev, step_events);
        } else {
          walk(row, cur, prev, no_events);
        }
      } else {
        walk(row, cur, prev, step_events);
      }
    } else if constexpr (V == 8 && Traits::kLanesC == 32) {
      // Stateless 16-byte rows in warps of one strip (the launcher's WideVec8; tune.py's VEC=8 gives
      // them to Wide too, not to the routes with several strips per warp, whose strips could take
      // different loops near S and the warp run both): a strip of a tile without idle lanes whose
      // walk stays below S (its refills up to token t0 + Lw + 2), every walk but the batch's last
      // ones, walks without the rows' bounds tests: ~6 % fewer instructions per row, the gain of
      // the 16-byte rows. The test is the tile's, which the CTA shares: tested per lane, the idle
      // lanes past C took the other loop and the warp ran both (r135, 262144x192 121.2 -> 217.3 us);
      // with a lane test in the loop instead, the 16-byte rows lost their gain (r136, 16384x8192
      // 232.4 us against 223.1). Not with 8-byte rows: there the second loop made the compiler's
      // bounded loop 16 instructions longer (567 -> 583 for 4 rows, 110 -> 120 registers), and the
      // tiles with idle lanes, which walk it, slower (r137: 262144x72 65.1 -> 68.9 us, 262144x192
      // 121.2 -> 128.3) for 0.8 % at 1048576x128.
      if (tile_full && t0 + Lw + 3 <= p.S) {
        walk(row_inside, cur, prev, no_events);
      } else {
        walk(row, cur, prev, no_events);
      }
    } else {
      walk(row, cur, prev, no_events);
    }
    if constexpr (kWarpFill) __syncwarp();  // every lane has read its last ring row
    if constexpr (kDxSlots > 0) {  // the strips' last two dx chunks
      const int warp_t0 = warp_t0_of(t0);
#pragma unroll
      for (int m = L / 4 - 2; m < L / 4; ++m) {
        flush_piece(warp_t0, m, 4 * m % kDxSlots, std::integral_constant<int, 0>{});
        flush_piece(warp_t0, m, 4 * m % kDxSlots, std::integral_constant<int, 1>{});
        flush_piece(warp_t0, m, 4 * m % kDxSlots, std::integral_constant<int, 2>{});
        flush_piece(warp_t0, m, 4 * m % kDxSlots, std::integral_constant<int, 3>{});
      }
      __syncwarp();  // the next sub-tile's rows reuse the slots
    }
    if (walks(t0 + walk_step)) prefetch(t0 + walk_step);  // the ring is free: every row was consumed
  }

  // The item's partial rows: strips added in strip order, one row per (tap or g, channel).
  detail::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s_sums[(k * V + j) * Traits::kThreads + threadIdx.x] = dw[k][j];
    s_sums[(4 * V + j) * Traits::kThreads + threadIdx.x] = db[j];
  }
  __syncthreads();
  float* const rows = p.partials + static_cast<size_t>(group) * kBwdPartialRows * p.C;
  for (int e = threadIdx.x; e < kBwdPartialRows * Traits::kTileChannels; e += Traits::kThreads) {
    const int q = e / Traits::kTileChannels;  // 0..3 tap, 4 the sum of g
    const int ch = e - q * Traits::kTileChannels;
    int c = tile_c * Traits::kTileChannels + ch;  // lane ch / V's channel (rotated as vec is)
    if constexpr (kRotates) c = c < p.vec_shift * V ? c - p.vec_shift * V + p.C : c - p.vec_shift * V;
    if (c >= p.C) continue;
    const float* src = s_sums + (q * V + ch % V) * Traits::kThreads + ch / V;
    float sum = 0.0f;
    for (int s = 0; s < Traits::kStrips; ++s) sum += src[s * Traits::kLanesC];
    rows[q * p.C + c] = sum;
  }
}

// One pass of the dweight/dbias reduction (the launcher's launch_bwd_reduce): two levels of the
// fixed tree over the token groups. A node of level l + 1 is 0 + its up to kBwdChunk children of
// level l, added in index order (level 0: the groups' partial rows); node i of level l is kept in
// the row of group i * 8^l. The pass reads the `nodes` nodes of its level (rows `span` groups
// apart) and writes the nodes two levels up; the last pass (one node there) writes the root to
// dweight / dbias. When one level is left, the root is 0 + (0 + children): the same bits as 0 +
// children, as a sum that starts at +0 is never -0 (round to nearest, no flush to zero). Each CTA
// owns one node two levels up and kBwdReduceQuads column quads of the kBwdPartialRows * C
// partial-row columns: warp k adds the up to 8 children of that node's child k (8 loads in flight
// per thread, one L2 round trip), warp 0 adds the warps' sums in order. Launched with programmatic
// dependent launch: its CTAs wait, resident, for the grid before them (the streaming kernel or
// the previous pass) to end, so the stream's end is followed by one round trip per two levels
// (4096x4096 graph-replayed 38.3 -> 35.4 us against the previous design, whose last CTAs to
// finish added the tree behind counters: a fence, an atomic and the loads per level; tune.py,
// H200, 2026-12-02).
constexpr int kBwdReduceThreads = 256;
constexpr int kBwdReduceQuads = 32;
// A pass's CTAs per node two levels up: blocks of kBwdReduceQuads column quads over the
// kBwdPartialRows * C partial-row columns (below 2^31 for C < 2^28).
__host__ __device__ constexpr int bwd_reduce_quad_blocks(int C) {
  return (kBwdPartialRows * C / 4 + kBwdReduceQuads - 1) / kBwdReduceQuads;
}
template <class WeightT, class BiasT>
__global__ void __launch_bounds__(kBwdReduceThreads)
causal_conv1d_bwd_reduce_kernel(const CausalConv1dBwdParams p, int nodes, int64_t span, bool last) {
  static_assert(kBwdReduceThreads == kBwdChunk * kBwdReduceQuads, "a warp per child of the CTA's node");
  detail::wait_for_prerequisite_grid();
  detail::launch_dependents();  // the next pass, or the next call's kernel, may become resident
  __shared__ float4 s_mid[kBwdChunk][kBwdReduceQuads];
  const int quads = kBwdPartialRows * p.C / 4;  // C % 8 == 0: a quad never straddles two rows
  const int mid_nodes = (nodes + kBwdChunk - 1) / kBwdChunk;
  const int quad_blocks = bwd_reduce_quad_blocks(p.C);
  const int top = blockIdx.x / quad_blocks;
  const int lane = threadIdx.x % kBwdReduceQuads;
  const int quad = (blockIdx.x - top * quad_blocks) * kBwdReduceQuads + lane;
  const int k = threadIdx.x / kBwdReduceQuads;
  const bool ok = quad < quads;
  const size_t group_stride = static_cast<size_t>(kBwdPartialRows) * p.C;
  const float4* const partials = reinterpret_cast<const float4*>(p.partials) + quad;
  const int mid = top * kBwdChunk + k;
  if (ok && mid < mid_nodes) {
    const int children = min(kBwdChunk, nodes - mid * kBwdChunk);
    const float4* const first = partials + static_cast<size_t>(mid) * kBwdChunk * span * (group_stride / 4);
    float4 v[kBwdChunk];
#pragma unroll
    for (int i = 0; i < kBwdChunk; ++i) {
      if (i < children) v[i] = __ldcg(first + i * span * (group_stride / 4));
    }
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kBwdChunk; ++i) {
      if (i < children) {
        sum.x += v[i].x;
        sum.y += v[i].y;
        sum.z += v[i].z;
        sum.w += v[i].w;
      }
    }
    s_mid[k][lane] = sum;
  }
  __syncthreads();
  // Warp 0 (k == 0) of the active quads goes on. threadIdx.x re-read after the barrier: tested as
  // k != 0 || !ok, ptxas (13.0) kept that predicate in a 4-byte stack slot across the loads above
  // in the NoBias kernels (one STL, one LDL per thread).
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  if (tid >= kBwdReduceQuads || (blockIdx.x - top * quad_blocks) * kBwdReduceQuads + static_cast<int>(tid) >= quads) return;
  const int count = min(kBwdChunk, mid_nodes - top * kBwdChunk);
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = 0; i < count; ++i) {
    const float4 v = s_mid[i][lane];
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  if (!last) {
    __stcg(const_cast<float4*>(partials) + static_cast<size_t>(top) * kBwdChunk * kBwdChunk * span * (group_stride / 4), sum);
    return;
  }
  const int q = 4 * quad / p.C, c = 4 * quad - q * p.C;
  const float f[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (q < 4) {
      detail::store_param<WeightT>(p.dweight, (c + i) * 4 + q, f[i]);
    } else if constexpr (detail::kHasBias<BiasT>) {
      detail::store_param<BiasT>(p.dbias, c + i, f[i]);
    }
  }
}

}  // namespace flashinfer_cake
