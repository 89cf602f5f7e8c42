// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training forward.
//
// y[t, c] = bf16_rn(silu(sum_k w[c, k] * x[t - 3 + k, c] + b[c])); a tap before the first token of
// t's document reads the document's initial state when one is given, else nothing. Optionally the
// documents' final states (the last 3 rows of each one's history). Framework-free: raw device
// pointers, sizes, row strides and a cudaStream_t.
//
// Geometry (FwdTraits): a CTA owns one tile of kTileTokens tokens x kTileChannels channels (64 x
// 256 on the wide route): many small CTAs, so the hardware's block scheduler balances the grid
// to its last few microseconds. A thread owns kVec channels (8: one 16-byte row vector) of one
// kStripLen-token strip and walks x[t0 - 3, t0 + L) through a per-thread cp.async ring in
// shared memory, with the last three rows in registers, so x is read once from DRAM (plus a
// 3-row halo per strip, which the strip before it reads at about the same time: L2 hits). Which
// CTA computes a token never changes its value: the output is bitwise deterministic.
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

// kStates: initial_states or final_states may be given (either may still be null).
template <class Traits, class WeightT, class BiasT, bool kStates>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_fwd_kernel(const CausalConv1dFwdParams p) {
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
    detail::scan_documents<T, L, Traits::kLanesC>(
        p.cu_seqlens, p.num_docs, p.S, tile_t0, tile_len, tile_t0 + tile_len, s_first_idx, s_last_idx, s_pos, s_doc,
        s_strip_events, nullptr, [&](int d, int i, int v) {
          // An empty document's final state is its initial state (zeros without one), for this
          // tile's channels.
          v += tile_c * Traits::kLanesC;
          if (final_v && static_cast<uint32_t>(v) < vecs_per_row) {
            final_v[state_off(d, i) + v] = init_v ? __ldg(init_v + state_off(d, i) + v) : Row{};
          }
        });
  } else {
    detail::scan_positions<T>(p.cu_seqlens, p.num_docs, tile_t0, tile_len, s_flags, s_pos);
  }
  if (has_rows) {
    detail::cp_async_wait<R - 1>();  // my part of the taps and bias has landed
  } else {
    detail::cp_async_wait<0>();
  }
  __syncthreads();
  if (!has_rows) return;
  // Taps and bias pre-scaled by -log2(e) (see silu_of_scaled); lanes past C use zeros.
  float w[4][V] = {}, b[V] = {};
  if (active) {
    detail::load_weights<WeightT, V, true>(s_w + lane_c * WBlocks::kStride * 16, 0, w);
    detail::load_bias<BiasT, V, true>(s_b + lane_c * BBlocks::kStride * 16, 0, b);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k][j] *= -detail::kLog2e;
    b[j] *= -detail::kLog2e;
  }

  // pos_row[r]: token t0 + r (past S it was never written: those rows are not stored); with
  // kStates its code (scan_documents) and doc_row[r] its document.
  const uint8_t* pos_row = s_pos + strip * L;
  const int32_t* doc_row = s_doc + strip * L;
  // Window as a 4-slot circular buffer and a loop stepping 4 rows, so no register moves: at
  // row r (token u = t0 + r, phase q = r % 4) slot (q+1) % 4 holds x[u-3], (q+2) % 4 x[u-2],
  // (q+3) % 4 x[u-1], and row r writes x[u] into slot q. Token u's position p (capped at 3)
  // says which of them are in its document: x[u-k] counts iff k <= p. The taps outside are
  // skipped (predicated FMAs), never multiplied by zero, so nothing leaks across documents.
  float xm[4][V];
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
    detail::row_to_float(my_ring[(i + 1) * T], xm[i + 1]);
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
  const auto document_states = [&](int r, int code, float(&x1)[V], float(&x2)[V], float(&x3)[V], const Row& xrow) {
    const int pos = code & detail::kPosMask, k = code >> detail::kEndShift & 3;
    const size_t off = state_off(doc_row[r], 0) + vec;
    if (pos == 0 && init_v) {
      detail::row_to_float(__ldg(init_v + off + 2 * vecs_per_row), x1);
      detail::row_to_float(__ldg(init_v + off + vecs_per_row), x2);
      detail::row_to_float(__ldg(init_v + off), x3);
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
    float xt[V], ys[V];
    detail::row_to_float(my_ring[(cur + q) * T], xt);
    if constexpr (kEvents) {
      if (static_cast<uint32_t>(r + 3) < lim && (pos & detail::kInDoc)) {
        pos = document_states(r, pos, xm[s1], xm[s2], xm[s3], my_ring[(cur + q) * T]);
      }
    }
    if constexpr (kStates) pos &= detail::kPosMask;  // the code's position bits
#pragma unroll
    for (int j = 0; j < V; ++j) {
      // FP32 accumulation in a fixed order: the bias, then the taps, current token first.
      float s = fmaf(w[3][j], xt[j], b[j]);
      if (pos >= 1) s = fmaf(w[2][j], xm[s1][j], s);
      if (pos >= 2) s = fmaf(w[1][j], xm[s2][j], s);
      if (pos >= 3) s = fmaf(w[0][j], xm[s3][j], s);
      ys[j] = detail::silu_of_scaled(s);
    }
    if (static_cast<uint32_t>(r + 3) < lim) yv[y_off] = detail::pack_row<V>(ys);
    y_off += p.y_row_stride;
#pragma unroll
    for (int j = 0; j < V; ++j) xm[q][j] = xt[j];
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

}  // namespace flashinfer_cake
