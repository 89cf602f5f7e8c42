// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training forward.
//
// y[t, c] = bf16_rn(silu(sum_k w[c, k] * x[t - 3 + k, c] + b[c])); a tap before the first token of
// t's document reads the document's initial state when one is given, else nothing. Optionally the
// documents' final states (the last 3 rows of each one's history). Framework-free: raw device
// pointers, sizes, row strides and a cudaStream_t.
//
// Two kernels: C <= 128 runs the token-lane kernel (the end of this file), whose warps read whole rows
// (with states but for 32 < C <= 64: the launcher's route rule); wider rows the strip kernel. The strip
// kernel's geometry (FwdTraits): a CTA owns one tile of kTileTokens tokens x kTileChannels channels (64 x
// 256 on the wide route): many small CTAs, so the hardware's block scheduler balances the grid to its last
// few microseconds. A thread owns kVec channels (8: one 16-byte row vector) of one kStripLen-token strip
// and walks x[t0 - 3, t0 + L) through a per-thread cp.async ring in shared memory, with the last three rows
// in registers (with states as read, BF16; without, FP32), so x is read once from DRAM (plus a 3-row halo
// per strip, which the strip before it reads at about the same time: L2 hits). Which CTA computes a token
// never changes its value for non-decreasing cu_seqlens (for other content the positions depend on where a
// tile starts: the same on every run of one route): the output is bitwise deterministic.
//
// Per CTA, while the first rows stream in: the taps and bias are staged once in shared memory
// (one coalesced read instead of one strided read per strip), and scan_positions (scan_documents
// with states) finds the
// document positions of the tile's tokens (two dependent loads up to 16K documents); then the
// strips run without barriers. Only x[0, S), y[0, S), weight and bias of [0, C),
// cu_seqlens[0, num_docs] and the state rows of documents 0 .. num_docs - 1 are ever addressed,
// whatever cu_seqlens holds.
//
// States (kStates; the stateless kernel is the same code without them): at a document's first
// token the window of the last three rows is loaded from the document's initial state (or at the
// strip's first token when the document started 1 or 2 tokens before it), and every tap of the
// document's tokens then reads the window: a tap before the first token reads the initial rows in
// the same FP32 order as a tap inside. A token among its document's last 3 copies its x row into
// the final state; the first token of a shorter document also copies the initial rows that stay
// in its final state, and the CTA owning an empty document copies its whole initial state.
#pragma once

#include "causal_conv1d_common.cuh"

namespace flashinfer_cake {

// No field for the workspace's counters: no route reads them (a route given them sets
// kFwdRoutesUseCounters, causal_conv1d_contract.h).
struct CausalConv1dFwdParams {
  const __nv_bfloat16* x;  // [S, C], rows x_row_stride vectors apart
  __nv_bfloat16* y;        // [S, C], rows y_row_stride vectors apart
  const void* weight;      // [C, 4], WeightT
  const void* bias;        // [C], BiasT (unused for NoBias)
  const int32_t* cu_seqlens;  // [num_docs + 1]
  const __nv_bfloat16* initial_states;  // [num_docs, 3, C] or null (kStates only)
  __nv_bfloat16* final_states;          // [num_docs, 3, C] or null (kStates only)
  int32_t S;
  int32_t C;
  int32_t num_docs;
  int32_t tiles_c;  // channel tiles per token tile
  int32_t lanes_log2;  // the token-lane route: log2 of the channel lanes of a token (1, 2, 4 or 8 lanes)
  uint32_t x_row_stride;  // in kVec-channel vectors
  uint32_t y_row_stride;
};

template <int kVec_, int kLanesC_, int kThreads_, int kStripLen_, int kRing_, int kMinCtasPerSm_>
struct FwdTraits {
  static constexpr int kVec = kVec_;          // channels per thread: 8 (16-byte rows)
  static constexpr int kLanesC = kLanesC_;    // threads side by side along channels
  static constexpr int kThreads = kThreads_;  // threads per CTA
  static constexpr int kStrips = kThreads / kLanesC;
  static constexpr int kStripLen = kStripLen_;  // tokens one strip emits
  static constexpr int kRing = kRing_;          // shared-memory rows per thread (kRing - 1 in flight)
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;  // register budget: 64K / (this * kThreads)
  static constexpr int kTileTokens = kStrips * kStripLen;  // a CTA's tokens: every strip once
  static constexpr int kTileChannels = kLanesC * kVec;
  static_assert(kVec == 8, "16-byte rows: the staged taps and bias are 16-byte chunks per thread");
  static_assert(kThreads % kLanesC == 0 && kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kStripLen % 4 == 0, "the loop steps 4 rows");
  static_assert(kRing >= 4 && kRing % 4 == 0, "the loop steps 4 rows, so 4 ring slots, at a time");
  static_assert(kRing <= kStripLen + 4, "the first R - 1 rows are rows of the strip");
};

#ifndef CAKE_FWD_Y_STREAMING
#define CAKE_FWD_Y_STREAMING 1  // y stored with st.global.cs (store_out_row; tune.py: Y_STREAMING=0)
#endif

namespace detail {

// y of one token from its row xt and the rows 1, 2, 3 tokens back (x1, x2, x3: window slots, BF16
// rows or their FP32 values): FP32 accumulation in a fixed order, the bias, then the taps current
// token first, every route the same bits. Taps and bias pre-scaled by -log2(e) (silu_of_scaled).
// pos (0..3): the taps reaching back further are skipped (predicated FMAs), never multiplied by
// zero, so nothing leaks across documents.
template <int V, class Slot>
__device__ __forceinline__ Row<V> conv_silu_row(const float (&w)[4][V], const float (&b)[V], const float (&xt)[V],
                                                const Slot& x1, const Slot& x2, const Slot& x3, int pos) {
  float f1[V], f2[V], f3[V], ys[V];
  window_to_float<V>(x1, f1);
  window_to_float<V>(x2, f2);
  window_to_float<V>(x3, f3);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float s = fmaf(w[3][j], xt[j], b[j]);
    if (pos >= 1) s = fmaf(w[2][j], f1[j], s);
    if (pos >= 2) s = fmaf(w[1][j], f2[j], s);
    if (pos >= 3) s = fmaf(w[0][j], f3[j], s);
    ys[j] = silu_of_scaled(s);
  }
  return pack_row<V>(ys);
}

// A lane's taps and bias (V channels) from the CTA's staged copies (stage_params' blocks at s_w,
// s_b), pre-scaled by -log2(e) for silu_of_scaled; w and b stay as given (zeros) when !active.
template <class WeightT, class BiasT, int V>
__device__ __forceinline__ void load_scaled_params(const uint8_t* s_w, const uint8_t* s_b, bool active,
                                                   float (&w)[4][V], float (&b)[V]) {
  if (active) {
    load_weights<WeightT, V, true>(s_w, 0, w);
    load_bias<BiasT, V, true>(s_b, 0, b);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k][j] *= -kLog2e;
    b[j] *= -kLog2e;
  }
}

}  // namespace detail

// kStates: initial_states or final_states may be given (either may still be null).
template <class Traits, class WeightT, class BiasT, bool kStates>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_fwd_kernel(const CausalConv1dFwdParams p) {
  // Launched after the stream's previous grid (launch_after_prerequisite): nothing is read or
  // written before that grid has ended; the next call's kernel may then be scheduled.
  detail::wait_for_prerequisite_grid();
  detail::launch_dependents();
  constexpr int L = Traits::kStripLen;
  constexpr int R = Traits::kRing;
  constexpr int N = L + 3;  // rows a strip reads: the 3-row halo, then its L tokens
  constexpr int TT = Traits::kTileTokens;
  constexpr int T = Traits::kThreads;
  constexpr int V = Traits::kVec;
  constexpr int kTC = Traits::kTileChannels;
  using Row = detail::Row<V>;
  using WBlocks = detail::ParamBlocks<V * detail::kTapBytes<WeightT>>;
  using BBlocks = detail::ParamBlocks<V * detail::kBiasBytes<BiasT>>;  // no chunks without a bias
  // Each thread streams its rows through its own column of this ring (cp.async, R - 1 rows
  // ahead of the one it computes), so the bytes in flight cost no registers.
  __shared__ __align__(detail::kRingAlign) Row s_ring[R * T];
  __shared__ uint8_t s_pos[TT];  // min(position in document, 3) per tile token; with kStates its code
  __shared__ uint8_t s_flags[kStates ? 1 : TT + 2];  // document starts (scan_positions)
  __shared__ int32_t s_entries[T];  // the position scan's first round (scan_positions, scan_documents)
  // kStates: the tokens' documents, and scan_documents' scratch.
  __shared__ int32_t s_doc[kStates ? TT : 1];
  __shared__ int32_t s_first_idx[kStates ? TT + 5 : 1], s_last_idx[kStates ? TT + 5 : 1];
  __shared__ uint8_t s_strip_events[kStates ? Traits::kStrips + 1 : 1];  // 1: the strip has a token with kInDoc
  __shared__ __align__(16) uint8_t s_w[Traits::kLanesC * WBlocks::kStride * 16];  // the tile's taps
  constexpr int kBiasSmem = detail::kHasBias<BiasT> ? Traits::kLanesC * BBlocks::kStride * 16 : 16;
  __shared__ __align__(16) uint8_t s_b[kBiasSmem];  // and bias

  const int lane_c = threadIdx.x % Traits::kLanesC;
  const int strip = threadIdx.x / Traits::kLanesC;
  const int group = blockIdx.x / p.tiles_c;  // token tile; neighbouring CTAs share it
  const int tile_c = blockIdx.x - group * p.tiles_c;
  const int vec = tile_c * Traits::kLanesC + lane_c;  // my row-vector column
  const uint32_t vecs_per_row = p.C / V;
  const bool active = static_cast<uint32_t>(vec) < vecs_per_row;
  // Token indices stay in int32 (S < 2^31) for any geometry, even a tuning tile that does not
  // divide 2^31: tile_t0 < S; a strip with rows starts below S (strips past the tile's end are
  // never formed: has_rows is decided on offsets); and a row's validity is tested on its offset
  // in the strip against lim, never on a token index that could pass 2^31.
  const int tile_t0 = group * TT;
  const int tile_len = min(TT, p.S - tile_t0);
  const bool has_rows = strip * L < tile_len;
  const int t0 = tile_t0 + (has_rows ? strip * L : 0);  // my strip's first token
  const Row* __restrict__ xv = reinterpret_cast<const Row*>(p.x);
  Row* __restrict__ yv = reinterpret_cast<Row*>(p.y);
  Row* const my_ring = s_ring + threadIdx.x;
  // 32-bit offsets (the launcher caps S * row stride < 2^32 vectors).
  const uint32_t xs = p.x_row_stride;
  const uint32_t base = static_cast<uint32_t>(t0) * xs + vec;
  // Ring row j (token t0 - 3 + j) is inside [0, S) iff t0 - 3 + j >= 0 and j < lim.
  const uint32_t lim = active ? static_cast<uint32_t>(p.S - t0) + 3u : 0u;

  // The position scan's first load, ahead of the rows.
  const int32_t first_round = detail::load_first_round<T>(p.cu_seqlens, p.num_docs);
  // cp.async groups, in order: the taps and bias, then ring rows 0 .. R - 2 of the strip (row i
  // is token t0 - 3 + i, in slot i + 1; rows outside [0, S) and lanes past C read zeros), all
  // streaming while the positions are found.
  const int64_t c_tile0 = int64_t(tile_c) * kTC;
  detail::stage_params<WeightT, BiasT, V, T>(p.weight, p.bias, c_tile0,
                                             static_cast<int>(min(int64_t(kTC), p.C - c_tile0)), s_w, s_b);
  detail::cp_async_commit();
  if (has_rows) {
#pragma unroll
    for (int i = 0; i < R - 1; ++i) {
      const bool valid = (i >= 3 || t0 >= 3 - i) && static_cast<uint32_t>(i) < lim;
      const uint32_t off = valid ? base + (i - 3) * xs : 0u;
      detail::cp_async_row(my_ring + (i + 1) * T, xv + off, valid);
      detail::cp_async_commit();
    }
  }
  // State rows: [num_docs][3] rows of C / V vectors; row i of document d at (3 d + i) C / V.
  const Row* __restrict__ init_v = reinterpret_cast<const Row*>(p.initial_states);
  Row* __restrict__ final_v = reinterpret_cast<Row*>(p.final_states);
  const auto state_off = [&](int d, int i) { return detail::state_row_offset(d, i, vecs_per_row); };
  if constexpr (kStates) {
    detail::scan_documents<T, L, Traits::kLanesC, /*kShortScan=*/true>(
        p.cu_seqlens, p.num_docs, p.S, tile_t0, tile_len, tile_t0 + tile_len, s_first_idx, s_last_idx, s_pos, s_doc,
        s_strip_events, nullptr,
        [&](int d, int i, int v) {
          detail::empty_document_state_row(final_v != nullptr, init_v, final_v, d, i, v + tile_c * Traits::kLanesC, vecs_per_row);
        },
        &first_round, s_entries);
  } else {
    detail::scan_positions<T>(p.cu_seqlens, p.num_docs, tile_t0, tile_len, s_flags, s_pos, first_round, s_entries);
  }
  if (has_rows) {
    detail::cp_async_wait<R - 1>();  // my part of the taps and bias has landed
  } else {
    detail::cp_async_wait<0>();
  }
  __syncthreads();
  if (!has_rows) return;
  float w[4][V] = {}, b[V] = {};
  detail::load_scaled_params<WeightT, BiasT, V>(s_w + lane_c * WBlocks::kStride * 16,
                                                s_b + lane_c * BBlocks::kStride * 16, active, w, b);

  // pos_row[r]: token t0 + r (past S it was never written: those rows are not stored); with
  // kStates its code (scan_documents) and doc_row[r] its document.
  const uint8_t* pos_row = s_pos + strip * L;
  const int32_t* doc_row = s_doc + strip * L;
  // Window as a 4-slot circular buffer and a loop stepping 4 rows, so no register moves: at
  // row r (token u = t0 + r, phase q = r % 4) slot (q+1) % 4 holds x[u-3], (q+2) % 4 x[u-2],
  // (q+3) % 4 x[u-1], and row r writes x[u] into slot q. Token u's position p (capped at 3)
  // says which of them are in its document: x[u-k] counts iff k <= p. The taps outside are
  // skipped (predicated FMAs), never multiplied by zero, so nothing leaks across documents.
  // With states as read (BF16 rows): 16 registers where FP32 takes 32 (r283, H100: 0.3-0.9 % less
  // time); the stateless kernel keeps FP32 (its loop 421 instructions a step against 470 packed).
  std::conditional_t<kStates, Row, float[V]> xm[4];
  // Rows 0..2 (x before t0), each refilling the ring with row i + R - 1.
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    if (i + R - 1 < N) {
      const bool valid = static_cast<uint32_t>(R - 1 + i) < lim;  // ring row R - 1 + i, token >= t0
      const uint32_t off = valid ? base + (R - 4 + i) * xs : 0u;
      detail::cp_async_row(my_ring + i * T, xv + off, valid);  // slot (i + R) % R
    }
    detail::cp_async_commit();
    detail::cp_async_wait<R - 1>();
    detail::set_window_row<V>(xm[i + 1], my_ring[(i + 1) * T]);
  }
  if constexpr (kStates) {
    detail::strip_start_state_rows<V>(pos_row[0], init_v && active, doc_row, init_v, vecs_per_row, vec, xm);
  }
  // Loop state, stepped once per row or per step (no per-row multiplies): the ring slots of the
  // step's 4 rows (cur) and of the 4 rows before them (prev), the offset of the next row to
  // refill and of the next y row. Ring row j (token t0 - 3 + j) is in slot (j + 1) % R, so a
  // step's rows r + 3 .. r + 6 take slots cur .. cur + 3 without wrapping.
  // kStates, a token with a document (code & kInDoc): at the document's first token, the window
  // (x1, x2, x3: the rows 1, 2, 3 tokens back) takes the initial state; the token's x row goes to
  // the final state when it is one of the document's last 3 (k tokens before its end), and the
  // first token of a document shorter than 3 also writes the initial rows its final state keeps.
  // Returns the position the taps use: 3 with an initial state (every tap reads the window). Only
  // for tokens below S of active lanes (s_pos past S was never written).
  const auto document_states = [&](int r, int code, auto& x1, auto& x2, auto& x3, const Row& xrow) {
    const int pos = code & detail::kPosMask, k = code >> detail::kEndShift & 3;
    const size_t off = state_off(doc_row[r], 0) + vec;
    if (pos == 0 && init_v) {
      detail::set_window_row<V>(x1, __ldg(init_v + off + 2 * vecs_per_row));
      detail::set_window_row<V>(x2, __ldg(init_v + off + vecs_per_row));
      detail::set_window_row<V>(x3, __ldg(init_v + off));
      // the next document's, read at its first token (in this strip when documents are short)
      detail::prefetch_initial_rows(init_v, doc_row[r] + 1, p.num_docs, vecs_per_row, vec);
    }
    if (final_v && k) {
      final_v[off + (3 - k) * vecs_per_row] = xrow;
      if (pos == 0) {  // a document of k < 3 tokens: final rows 0 .. 2 - k are initial rows k ..
        for (int i = 0; i < 3 - k; ++i) final_v[off + i * vecs_per_row] = init_v ? __ldg(init_v + off + (k + i) * vecs_per_row) : Row{};
      }
    }
    return init_v ? 3 : pos;
  };
  int cur = 4 % R, prev = 0;
  uint32_t refill_off = base + (R - 1) * xs;
  uint32_t y_off = static_cast<uint32_t>(t0) * p.y_row_stride + vec;
  // kEvents (a compile-time bool): the strip has a token with a state event (kInDoc); strips
  // without one run the stateless body.
  const auto row = [&](int r, auto phase, auto events) {
    constexpr int q = decltype(phase)::value, s3 = (q + 1) % 4, s2 = (q + 2) % 4, s1 = (q + 3) % 4;
    constexpr bool kEvents = decltype(events)::value;
    if (r + R + 2 < N) {  // refill the slot ring row r + 2 has just left with row r + R + 2
      const bool valid = static_cast<uint32_t>(r + R + 2) < lim;
      const uint32_t off = valid ? refill_off : 0u;
      const int slot = q == 0 ? prev + 3 : cur + q - 1;
      detail::cp_async_row(my_ring + slot * T, xv + off, valid);
    }
    refill_off += xs;
    detail::cp_async_commit();  // possibly empty: keeps "ring row j is group j after the parameters'"
    detail::cp_async_wait<R - 1>();
    int pos = pos_row[r];
    const Row xrow = my_ring[(cur + q) * T];
    if constexpr (kEvents) {
      if (static_cast<uint32_t>(r + 3) < lim && (pos & detail::kInDoc)) {
        pos = document_states(r, pos, xm[s1], xm[s2], xm[s3], xrow);
      }
    }
    if constexpr (kStates) pos &= detail::kPosMask;  // the code's position bits
    float xt[V];
    detail::row_to_float(xrow, xt);
    const Row y = detail::conv_silu_row(w, b, xt, xm[s1], xm[s2], xm[s3], pos);
    if (static_cast<uint32_t>(r + 3) < lim) detail::store_out_row<CAKE_FWD_Y_STREAMING != 0>(yv + y_off, y);
    y_off += p.y_row_stride;
    // Not set_window_row: the stateless kernel copies xt, where converting xrow again costs 16
    // instructions a step (not merged with xt's conversion).
    if constexpr (kStates) {
      xm[q] = xrow;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) xm[q][j] = xt[j];
    }
  };
  const auto walk = [&](auto events) {
    detail::walk_rows<L, R>(row, cur, prev, [&](int) { return events; });
  };
  if constexpr (kStates) {
    if (s_strip_events[strip]) {
      // Prefetched initial rows: the first document starting in the strip (token 0's, or the next
      // one), and the last token's (r37, H200: many documents 2-3 % faster).
      if (init_v && active) {
        const int c0 = pos_row[0];
        if (c0 & detail::kInDoc) {
          detail::prefetch_initial_rows(init_v, doc_row[0] + ((c0 & detail::kPosMask) != 0), p.num_docs, vecs_per_row,
                                        vec);
        }
        if (static_cast<uint32_t>(L + 2) < lim && (pos_row[L - 1] & detail::kInDoc)) {
          detail::prefetch_initial_rows(init_v, doc_row[L - 1], p.num_docs, vecs_per_row, vec);
        }
      }
      walk(std::true_type{});
    } else {
      walk(std::false_type{});
    }
  } else {
    walk(std::false_type{});
  }
  detail::cp_async_wait<0>();  // no copy outlives the CTA's shared memory
}

// The token-lane route (FwdTokenLaneTraits; the launcher's rule says which C take it): the lanes of
// a warp side by side along tokens. At narrow C the strip-per-thread kernel above leaves lanes idle
// (its tile is 8 or more vectors wide) and reads and writes 16-byte rows of 32 strips per warp
// instruction: 2097152x8 ran at 15 % of a graph copy, 1048576x16 at 30 % (tune.py, H200). Here a
// warp reads and writes whole rows: one instruction covers 32 / lanes consecutive tokens of lanes
// vectors each (512 contiguous bytes when C = 8 lanes), so every sector is whole and no store is
// staged.
template <int kMaxLanesC_, int kThreads_, int kSegBlocks_, int kRingBlocks_, int kMinCtasPerSm_>
struct FwdTokenLaneTraits {
  static constexpr int kVec = 8;                  // channels per lane (a 16-byte row vector)
  static constexpr int kMaxLanesC = kMaxLanesC_;  // most lanes of one token (a power of 2 up to 8)
  static constexpr int kThreads = kThreads_;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSegBlocks = kSegBlocks_;  // blocks (one row vector per lane) a warp walks
  static constexpr int kRingBlocks = kRingBlocks_;  // shared-memory blocks per warp (RB - 2 in flight)
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;
  static constexpr int kMaxTileTokens = kWarps * kSegBlocks * 32;  // a CTA's tokens at 1 lane per token
  static_assert(kSegBlocks <= 32, "a warp's blocks with a state event fit one 32-bit mask");
  // Lanes per token for C channels (log2): as many as C / kVec needs, at most kMaxLanesC (then
  // channel tiles); a CTA's tokens at that many.
  __host__ __device__ static constexpr int lanes_log2_for(int64_t C) {
    int lg = 0;
    while ((1 << lg) < kMaxLanesC && (int64_t(kVec) << lg) < C) ++lg;
    return lg;
  }
  __host__ __device__ static constexpr int tile_tokens(int lanes_log2) {
    return kWarps * kSegBlocks * (32 >> lanes_log2);
  }
  // The tile's positions (and with states its documents and scan_documents' scratch) live in
  // dynamic shared memory sized for the launch's tile (static arrays sized for one lane per token
  // held the stateful kernel of C >= 16 at 4 CTAs per SM). Byte offsets: doc, first_idx, last_idx
  // (int32, with states), then pos and flags (bytes, flags without states).
  struct SmemLayout {
    int doc = 0, first_idx = 0, last_idx = 0, pos = 0, flags = 0, bytes = 0;
    __host__ __device__ constexpr SmemLayout(int tile_tokens, bool states) {
      const int ints = states ? tile_tokens : 0, idx = states ? tile_tokens + 5 : 0;
      doc = 0;
      first_idx = doc + 4 * ints;
      last_idx = first_idx + 4 * idx;
      pos = last_idx + 4 * idx;
      flags = pos + tile_tokens;
      bytes = flags + (states ? 0 : tile_tokens + 2);
    }
  };
  // Static shared memory (the rings; the taps and bias, at most 12 16-byte chunks per lane with
  // their padding (ParamBlocks); the scan's first-round entries, and scan_documents' s_empty, s_more
  // and s_hit; 128 bytes of alignment) and the largest dynamic part stay within the 48 KB a launch
  // may take without an opt-in.
  static constexpr int kStaticSmemBound =
      kWarps * kRingBlocks * 32 * 16 + kMaxLanesC * 12 * 16 + 8 * kThreads + 3 + 128;
  static_assert(kStaticSmemBound + SmemLayout(kMaxTileTokens, true).bytes <= 48 * 1024 &&
                    kStaticSmemBound + SmemLayout(kMaxTileTokens, false).bytes <= 48 * 1024,
                "shared memory per CTA above 48 KB");
  static_assert(kMaxLanesC >= 1 && kMaxLanesC <= 8 && (kMaxLanesC & (kMaxLanesC - 1)) == 0,
                "1 to 8 lanes per token: a block of 4 or more tokens holds the 3 rows before its first");
  static_assert(kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kRingBlocks >= 4 && (kRingBlocks & (kRingBlocks - 1)) == 0,
                "a power of 2 (entries wrap with a mask) holding the block read, the one before it and 2 in flight");
};

// The token-lane kernel. A CTA owns kSegBlocks * 32 / lanes tokens per warp, each warp a segment of
// consecutive tokens, and the row vectors [tile_c * lanes, + lanes); lane l of a block (32 / lanes
// tokens) owns token l / lanes, row vector l % lanes. The warp streams its segment through its
// own ring of blocks in shared memory (cp.async, kRingBlocks - 2 blocks ahead), entry = token row
// vector in token order, so a token's 3 rows before are the entries 1, 2, 3 token rows back (a
// 3-row halo before the segment is read once). Each lane reads its 4 rows from shared memory, sums
// them as every route does (conv_silu_row) and stores its y vector: the warp's store is whole rows.
// Positions and states as in the strip kernel (scan_positions / scan_documents); with states, a tap
// of a document's token reaching before its first token reads the initial state's row directly
// (the token's position says which), and the blocks without a state event run the stateless body.
template <class Traits, class WeightT, class BiasT, bool kStates>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_fwd_token_lane_kernel(const CausalConv1dFwdParams p) {
  // Launched after the stream's previous grid (launch_after_prerequisite): nothing is read or
  // written before that grid has ended. No early trigger: the next grid starts as this one ends
  // (with it, 65536 x 128 back to back took 12.3 against 11.1 us per call, NOTES_fwd r110).
  detail::wait_for_prerequisite_grid();
  constexpr int V = Traits::kVec;
  constexpr int T = Traits::kThreads;
  constexpr int RB = Traits::kRingBlocks;
  using Row = detail::Row<V>;
  using WBlocks = detail::ParamBlocks<V * detail::kTapBytes<WeightT>>;
  using BBlocks = detail::ParamBlocks<V * detail::kBiasBytes<BiasT>>;
  __shared__ __align__(detail::kRingAlign) Row s_ring[Traits::kWarps * RB * 32];
  extern __shared__ __align__(16) uint8_t s_dyn[];  // Traits::SmemLayout
  __shared__ __align__(16) uint8_t s_w[Traits::kMaxLanesC * WBlocks::kStride * 16];
  constexpr int kBiasSmem = detail::kHasBias<BiasT> ? Traits::kMaxLanesC * BBlocks::kStride * 16 : 16;
  __shared__ __align__(16) uint8_t s_b[kBiasSmem];
  // The position scan's first round (scan_positions, scan_documents). With states at C <= 8 (the
  // 2048-token tile) these 512 bytes leave FP32 taps + bias room for 4 CTAs per SM, not 5, by the
  // arithmetic; measured, the scan ahead with them is still the fastest there (r268, H100:
  // 2097152x8 with 65536 documents 50.3 us, first round alone 52.4, neither 53.0).
  __shared__ int32_t s_entries[T];

  const int lg = p.lanes_log2;  // Traits::lanes_log2_for(C): up to kMaxLanesC lanes (s_w, s_b)
  const int lanes = 1 << lg;
  const int tpb = 32 >> lg;  // tokens per block
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int lane_c = lane & (lanes - 1), lane_t = lane >> lg;
  const int group = blockIdx.x / p.tiles_c;
  const int tile_c = blockIdx.x - group * p.tiles_c;
  const int vec = tile_c * lanes + lane_c;
  const uint32_t vecs_per_row = p.C / V;
  const bool active = static_cast<uint32_t>(vec) < vecs_per_row;
  const int seg_tokens = Traits::kSegBlocks * tpb;
  const int tile_tokens = Traits::tile_tokens(lg);
  // int32 token indices as in the strip kernel: tile_t0 < S, a walking warp's seg0 < S, and a
  // token is tested on its offset from seg0 against s_left before its index is formed.
  const int tile_t0 = group * tile_tokens;
  const int tile_len = min(tile_tokens, p.S - tile_t0);
  const int seg_off = warp * seg_tokens;  // the warp's first token, in the tile
  const bool walks = seg_off < tile_len;
  const int seg0 = walks ? tile_t0 + seg_off : 0;
  const int s_left = p.S - seg0;  // tokens from seg0 to the end of the batch
  const typename Traits::SmemLayout layout(tile_tokens, kStates);
  uint8_t* const s_pos = s_dyn + layout.pos;  // per tile token, as in the strip kernel
  uint8_t* const s_flags = s_dyn + layout.flags;
  int32_t* const s_doc = reinterpret_cast<int32_t*>(s_dyn + layout.doc);
  int32_t* const s_first_idx = reinterpret_cast<int32_t*>(s_dyn + layout.first_idx);
  int32_t* const s_last_idx = reinterpret_cast<int32_t*>(s_dyn + layout.last_idx);
  const Row* __restrict__ xv = reinterpret_cast<const Row*>(p.x);
  Row* __restrict__ yv = reinterpret_cast<Row*>(p.y);
  Row* const ring = s_ring + warp * RB * 32;
  const uint32_t xs = p.x_row_stride, ys = p.y_row_stride;

  // Block b (b >= -1; block -1 holds the 3 rows before seg0) into ring slot (b + 1) % RB: tokens
  // before seg0 - 3, outside [0, S) and lanes past C read zeros (those entries are never stored).
  const auto fill = [&](int b) {
    const int u_off = b * tpb + lane_t;  // the lane's token, from seg0
    const bool valid = active && u_off >= -3 && u_off >= -seg0 && u_off < s_left;
    const uint32_t off = valid ? static_cast<uint32_t>(seg0 + u_off) * xs + vec : 0u;
    detail::cp_async_row(ring + ((b + 1) & (RB - 1)) * 32 + lane, xv + off, valid);
  };
  // The position scan's first load, ahead of the rows.
  const int32_t first_round = detail::load_first_round<T>(p.cu_seqlens, p.num_docs);
  // cp.async groups: the taps and bias with block -1, then blocks 0 .. RB - 3, one group each,
  // streaming while the positions are found.
  const int64_t c_tile0 = int64_t(tile_c) * lanes * V;
  detail::stage_params<WeightT, BiasT, V, T>(p.weight, p.bias, c_tile0,
                                             static_cast<int>(min(int64_t(lanes) * V, p.C - c_tile0)), s_w, s_b);
  if (walks) fill(-1);
  detail::cp_async_commit();
#pragma unroll
  for (int b = 0; b < RB - 2; ++b) {
    if (walks && b < Traits::kSegBlocks) fill(b);
    detail::cp_async_commit();
  }
  const Row* __restrict__ init_v = reinterpret_cast<const Row*>(p.initial_states);
  Row* __restrict__ final_v = reinterpret_cast<Row*>(p.final_states);
  const auto state_off = [&](int d, int i) { return detail::state_row_offset(d, i, vecs_per_row); };
  [[maybe_unused]] bool entries = false;  // kStates: an entry of cu_seqlens within the tile's reach
  if constexpr (kStates) {
    entries = detail::scan_documents<T, 1, Traits::kMaxLanesC>(
        p.cu_seqlens, p.num_docs, p.S, tile_t0, tile_len, tile_t0 + tile_len, s_first_idx, s_last_idx, s_pos, s_doc,
        nullptr, nullptr,
        [&](int d, int i, int v) {
          if (v < lanes) detail::empty_document_state_row(final_v != nullptr, init_v, final_v, d, i, v + tile_c * lanes, vecs_per_row);
        },
        &first_round, s_entries);
  } else {
    detail::scan_positions<T>(p.cu_seqlens, p.num_docs, tile_t0, tile_len, s_flags, s_pos, first_round, s_entries);
  }
  detail::cp_async_wait<RB - 2>();  // group 0 (the taps, bias and block -1) has landed
  __syncthreads();
  if (!walks) return;
  float w[4][V] = {}, b[V] = {};
  detail::load_scaled_params<WeightT, BiasT, V>(s_w + lane_c * WBlocks::kStride * 16,
                                                s_b + lane_c * BBlocks::kStride * 16, active, w, b);
  const uint8_t* const pos_seg = s_pos + seg_off;  // pos_seg[j]: token seg0 + j (j < tile_len - seg_off)
  const int32_t* const doc_seg = s_doc + seg_off;
  const int seg_len = min(seg_tokens, tile_len - seg_off);
  // kStates: bit i of `events` is set when a token of block i has a state event (kInDoc; uniform in
  // the warp): those blocks run the stateful body, and the documents starting in them get their
  // initial rows prefetched into L2 when the block is copied (read at the token, RB - 2 blocks
  // later; the blocks already in flight, now).
  [[maybe_unused]] uint32_t events = 0;
  [[maybe_unused]] const auto prefetch_block = [&](int blk) {
    const int j = blk * tpb + lane_t;
    if (init_v && active && j < seg_len) {
      const int c = pos_seg[j];
      if ((c & detail::kInDoc) && (c & detail::kPosMask) == 0) {
        detail::prefetch_initial_rows(init_v, doc_seg[j], p.num_docs, vecs_per_row, vec);
      }
    }
  };
  if constexpr (kStates) {
    for (int i = 0; entries && i * tpb < seg_len; ++i) {  // no entry: no event
      const int j = i * tpb + lane_t;
      events |= uint32_t(__ballot_sync(0xffffffffu, active && j < seg_len && (pos_seg[j] & detail::kInDoc)) != 0) << i;
    }
#pragma unroll
    for (int blk = 0; blk < RB - 2; ++blk) {
      if (events >> blk & 1) prefetch_block(blk);
    }
  }
  uint32_t y_off = (static_cast<uint32_t>(seg0) + lane_t) * ys + vec;  // wraps only past S (never stored)
  const uint32_t y_step = static_cast<uint32_t>(tpb) * ys;
  // The lane's token j (from seg0) of the block being computed: its row r0 and the rows 1, 2, 3
  // tokens back r1..r3, from the ring.
  const auto block = [&](int j, Row r0, Row r1, Row r2, Row r3, auto events) {
    constexpr bool kEvents = decltype(events)::value;
    const bool valid = active && j < seg_len;
    int pos = j < seg_len ? pos_seg[j] : 0;
    if constexpr (kEvents) {
      // A token of a document with states: the taps reaching before its first token read the
      // initial rows (row 3 - k + pos for the tap k back), so every tap is read; one of the
      // document's last 3 (kend before its end) copies its row into the final state, and the first
      // token of a document shorter than 3 also the initial rows its final state keeps.
      if (valid && (pos & detail::kInDoc)) {
        const int ps = pos & detail::kPosMask, kend = pos >> detail::kEndShift & 3;
        const size_t off = state_off(doc_seg[j], 0) + vec;
        if (init_v) {
          if (ps < 3) r3 = __ldg(init_v + off + ps * vecs_per_row);
          if (ps < 2) r2 = __ldg(init_v + off + (ps + 1) * vecs_per_row);
          if (ps < 1) r1 = __ldg(init_v + off + 2 * vecs_per_row);
          pos = 3;
        }
        if (final_v && kend) {  // as the strip kernel's document_states
          final_v[off + (3 - kend) * vecs_per_row] = r0;
          if (ps == 0) {
            for (int k = 0; k < 3 - kend; ++k) {
              final_v[off + k * vecs_per_row] = init_v ? __ldg(init_v + off + (kend + k) * vecs_per_row) : Row{};
            }
          }
        }
      }
    }
    if constexpr (kStates) pos &= detail::kPosMask;
    float xt[V];
    detail::row_to_float(r0, xt);
    const Row y = detail::conv_silu_row(w, b, xt, r1, r2, r3, pos);
    if (valid) detail::store_out_row<CAKE_FWD_Y_STREAMING != 0>(yv + y_off, y);
    y_off += y_step;
  };
  if constexpr (kStates) {
    // Ring entry e = slot * 32 + lane of block i, the rows back at e - m lanes (wrapping).
    constexpr int kRingMask = RB * 32 - 1;
    int slot = 1;  // block i's ring slot, (i + 1) % RB
#pragma unroll 1
    for (int i = 0; i < Traits::kSegBlocks; ++i) {
      // Block i landed for every lane, and every lane is done with iteration i - 1, the last to
      // read block i - 2: its slot takes block i + RB - 2.
      detail::cp_async_wait<RB - 3>();
      __syncwarp();
      if (i + RB - 2 < Traits::kSegBlocks) {
        fill(i + RB - 2);
        if (events >> (i + RB - 2) & 1) prefetch_block(i + RB - 2);
      }
      detail::cp_async_commit();  // possibly empty: keeps "block i is group i + 1"
      if (i * tpb >= seg_len) break;  // uniform: the segment's end (the batch's last tile)
      const int e = slot * 32 + lane;
      const Row r0 = ring[e], r1 = ring[(e - lanes) & kRingMask], r2 = ring[(e - 2 * lanes) & kRingMask],
                r3 = ring[(e - 3 * lanes) & kRingMask];
      if (events >> i & 1) {
        block(i * tpb + lane_t, r0, r1, r2, r3, std::true_type{});
      } else {
        block(i * tpb + lane_t, r0, r1, r2, r3, std::false_type{});
      }
      slot = (slot + 1) & (RB - 1);
    }
  } else {
    // The loop unrolled over the ring's turn (a turn starts at slot 1: i0 is a multiple of RB), every
    // ring address a register plus a constant: fewer instructions per block than the loop above and
    // less time; the stateful kernel stays on the rolled loop, which measured faster for it
    // (NOTES_fwd, session 26). Shared-window addresses: slot k of the warp's ring at 512 k, a
    // lane's entry of a block at 16 lane. The entries 1, 2, 3 tokens back are 16 m lanes before it,
    // in the slot before for lane < m lanes: for slots 1 .. RB - 1 the same address, for slot 0
    // slot RB - 1's, 512 RB later (back_wrap).
    const uint32_t a_lane = detail::smem_addr(ring) + 16 * lane;
    uint32_t back[3], back_wrap[3];
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      back[m] = a_lane - 16 * (m + 1) * lanes;
      back_wrap[m] = back[m] + (lane < (m + 1) * lanes ? RB * 512 : 0);
    }
    const int n_blocks = min(Traits::kSegBlocks, (seg_len + tpb - 1) / tpb);  // blocks with a token
    // The next block to copy, RB - 2 on: the lane's token of it (from seg0) and its x row.
    int fill_u = (RB - 2) * tpb + lane_t;
    uint32_t fill_off = (static_cast<uint32_t>(seg0) + fill_u) * xs + vec;  // wraps only when not copied
    const uint32_t fill_step = static_cast<uint32_t>(tpb) * xs;
#pragma unroll 1
    for (int i0 = 0; i0 < n_blocks; i0 += RB) {
#pragma unroll
      for (int k = 0; k < RB; ++k) {
        if (i0 + k >= n_blocks) break;  // uniform: the segment's end (the batch's last tile)
        // As above: block i0 + k landed, its slot k + 1 takes block i0 + k + RB - 2.
        detail::cp_async_wait<RB - 3>();
        __syncwarp();
        if (i0 + k + RB - 2 < n_blocks) {
          const bool copy = active && fill_u < s_left;
          detail::cp_async_16(a_lane + ((k + RB - 1) & (RB - 1)) * 512, xv + (copy ? fill_off : 0u), copy);
        }
        detail::cp_async_commit();
        fill_u += tpb;
        fill_off += fill_step;
        const int slot = (k + 1) & (RB - 1);
        block((i0 + k) * tpb + lane_t, detail::ld_shared_row(a_lane + slot * 512),
              detail::ld_shared_row(slot ? back[0] + slot * 512 : back_wrap[0]),
              detail::ld_shared_row(slot ? back[1] + slot * 512 : back_wrap[1]),
              detail::ld_shared_row(slot ? back[2] + slot * 512 : back_wrap[2]), std::false_type{});
      }
    }
  }
  detail::cp_async_wait<0>();  // no copy outlives the CTA's shared memory
}

}  // namespace flashinfer_cake
