// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training backward.
//
// Forward: a[t] = b + sum_k w[k] x[t - 3 + k] (taps inside t's document), y[t] = silu(a[t]).
// Backward, per channel, with g[t] = dy[t] * silu'(a'[t]) where a' is a rounded to BF16 or not:
//   dx[s]  = sum_k w[k] g[s + 3 - k]            over the taps k with s in the document of s + 3 - k
//   dw[k]  = sum_t g[t] x[t - 3 + k]            over the taps inside t's document
//   db     = sum_t g[t]
// Framework-free: raw device pointers, sizes and a cudaStream_t.
//
// Two kernels. The first streams x and dy once: a CTA owns an item of item_tokens tokens x
// kTileChannels channels; a thread owns 4 channels (8 bytes: half the forward's vector, so the
// windows, taps and sums of the backward fit in ~120 registers, 4 CTAs per SM) of one
// kStripLen-token strip at a time and walks x[t0 - 3, t0 + L + 3) and dy[t0, t0 + L + 3)
// through a per-thread cp.async ring: it
// recomputes a and g for tokens t0 .. t0 + L + 2 and emits dx for t0 .. t0 + L - 1 (dx[s] needs g
// up to s + 3, the 3-token lookahead, recomputed by the next strip too). Each thread sums g*x and
// g over its strips' own tokens in registers; at the end of the item the CTA adds its strips in
// strip order and writes one partial row per channel to the workspace: partials[item's token
// group][5][C]. The second kernel adds the partial rows of every token group in a fixed order (a
// fixed tree over the groups), so dweight and dbias are bitwise identical run to run, whatever
// the scheduling: no float atomics anywhere.
//
// Document positions: per item sub-tile, min(position in document, 3) of its kTileTokens + 3
// tokens in shared memory (double-buffered), searched for the next sub-tile while this one streams
// (see DocSearch). Only x, dy, dx[0, S) and cu_seqlens[0, num_docs] are addressed, whatever
// cu_seqlens holds.
#pragma once

#include "causal_conv1d_common.cuh"

namespace flashinfer_cake {

struct CausalConv1dBwdParams {
  const __nv_bfloat16* x;   // [S, C]
  const __nv_bfloat16* dy;  // [S, C]
  __nv_bfloat16* dx;        // [S, C]
  const void* weight;       // [C, 4], WeightT
  const void* bias;         // [C], BiasT (unused for NoBias)
  const int32_t* cu_seqlens;  // [num_docs + 1]
  float* partials;          // workspace: [groups][kBwdPartialRows][C]
  void* dweight;            // [C, 4], WeightT
  void* dbias;              // [C], BiasT (unused for NoBias)
  int32_t S;
  int32_t C;
  int32_t num_docs;
  int32_t item_tokens;  // tokens of one token group, a multiple of kStripLen
  int32_t groups;       // ceil(S / item_tokens)
  int32_t tiles_c;      // channel tiles per token group
  int32_t round_preact;  // 1: silu' at the pre-activation rounded to BF16; 0: at the FP32 value
};

// Partial rows per token group: the four taps' g*x sums, then the sum of g.
constexpr int kBwdPartialRows = 5;
// Channels per thread: one 8-byte vector of BF16.
constexpr int kBwdVec = 4;

template <int kLanesC_, int kThreads_, int kStripLen_, int kRing_, int kMinCtasPerSm_>
struct BwdTraits {
  static constexpr int kLanesC = kLanesC_;    // threads side by side along channels
  static constexpr int kThreads = kThreads_;  // threads per CTA
  static constexpr int kStrips = kThreads / kLanesC;
  static constexpr int kStripLen = kStripLen_;  // tokens of dx one strip emits
  static constexpr int kRing = kRing_;          // shared-memory rows of x and of dy per thread
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;
  static constexpr int kTileTokens = kStrips * kStripLen;  // one sub-tile: every strip once
  static constexpr int kTileChannels = kLanesC * kBwdVec;
  static constexpr int kPosTokens = kTileTokens + 3;  // a sub-tile's tokens and their lookahead
  static_assert(kThreads % kLanesC == 0 && kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kRing >= 2, "the ring needs two rows");
};

namespace detail {

// 8-byte global -> shared copy (through L1: .cg takes 16 bytes only); valid == false writes
// zeros and reads nothing.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 8 : 0)
               : "memory");
}

// silu'(a) = r (1 + a (1 - r)) with r = sigmoid(a) = 1 / (1 + 2^(-a log2 e)): ex2 and rcp are
// the hardware approximations (relative error about 2^-22). Written with 1 - r rather than
// 2^(-a log2 e) r so that a -> -inf gives r = 0 and silu' = 0 (no inf * 0).
__device__ __forceinline__ float silu_grad(float a) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * -kLog2e));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r * fmaf(a, 1.0f - r, 1.0f);
}

__device__ __forceinline__ float round_to_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
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

template <class Traits, class WeightT, class BiasT>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_bwd_kernel(const CausalConv1dBwdParams p) {
  constexpr int L = Traits::kStripLen;
  constexpr int R = Traits::kRing;
  constexpr int N = L + 6;  // x rows a strip reads: 3 before t0, its L tokens, 3 of lookahead
  constexpr int TT = Traits::kTileTokens;
  constexpr int V = kBwdVec;
  constexpr int kSums = 5 * V;  // a thread's partial sums: 4 taps and g, V channels each
  // Per-thread rings of x and dy rows (8 bytes each), R - 1 rows ahead of the computed one. At
  // the end of an item the same bytes hold the strips' partial sums.
  constexpr int kRingBytes = 2 * R * Traits::kThreads * 8;
  constexpr int kSumBytes = kSums * Traits::kThreads * 4;
  __shared__ __align__(16) unsigned char s_raw[kRingBytes > kSumBytes ? kRingBytes : kSumBytes];
  uint2* const s_xring = reinterpret_cast<uint2*>(s_raw);
  uint2* const s_dyring = s_xring + R * Traits::kThreads;
  float* const s_sums = reinterpret_cast<float*>(s_raw);  // [kSums][kThreads]
  __shared__ __align__(16) uint8_t s_pos[2][Traits::kPosTokens];

  const int lane_c = threadIdx.x % Traits::kLanesC;
  const int strip = threadIdx.x / Traits::kLanesC;
  const int group = blockIdx.x / p.tiles_c;
  const int tile_c = blockIdx.x - group * p.tiles_c;
  const int vec = tile_c * Traits::kLanesC + lane_c;  // my 8-byte column
  const uint32_t vecs_per_row = p.C / V;
  const bool active = static_cast<uint32_t>(vec) < vecs_per_row;
  const int item_t0 = group * p.item_tokens;
  const int item_end = min(item_t0 + p.item_tokens, p.S);
  const uint2* __restrict__ xv = reinterpret_cast<const uint2*>(p.x);
  const uint2* __restrict__ dyv = reinterpret_cast<const uint2*>(p.dy);
  uint2* __restrict__ dxv = reinterpret_cast<uint2*>(p.dx);
  uint2* const my_xring = s_xring + threadIdx.x;
  uint2* const my_dyring = s_dyring + threadIdx.x;
  const int search_steps = detail::DocSearch::halvings(p.num_docs);
  const auto search_all = [&](int first_token, uint8_t* out) {
    for (int j = threadIdx.x; j < Traits::kPosTokens; j += Traits::kThreads) {
      detail::DocSearch ds;
      ds.start(p.num_docs, first_token + j);
      for (int k = 0; k <= search_steps + 1; ++k) ds.step(p.cu_seqlens, search_steps, k);
      out[j] = static_cast<uint8_t>(ds.pos);
    }
  };

  float w[4][V] = {}, b[V] = {};
  if (active) {
    detail::load_weights<WeightT>(p.weight, vec * V, w);
    detail::load_bias<BiasT>(p.bias, vec * V, b);
  }
  float dw[4][V] = {}, db[V] = {};

  int buf = 0;
  for (int sub_t0 = item_t0; sub_t0 < item_end; sub_t0 += TT) {
    const int t0 = sub_t0 + strip * L;
    const bool strip_on = t0 < item_end;
    // 8-byte offset of token t0 in my channels (32 bits: the launcher caps S * C / 4 < 2^32).
    const uint32_t base = static_cast<uint32_t>(t0) * vecs_per_row + vec;
    // x row i is token t0 - 3 + i; dy row i is the same token, read from i = 3 on. Rows outside
    // [0, S) and lanes past C read zeros (so g is 0 past S).
    auto issue_row = [&](int i, int slot) {  // slot == i % R
      const int t = t0 - 3 + i;
      const bool valid = active && t >= 0 && t < p.S;
      const uint32_t off = base + (i - 3) * vecs_per_row;
      detail::cp_async_8(my_xring + slot * Traits::kThreads, valid ? xv + off : xv, valid);
      if (i >= 3) detail::cp_async_8(my_dyring + slot * Traits::kThreads, valid ? dyv + off : dyv, valid);
    };
    if (strip_on) {
#pragma unroll
      for (int i = 0; i < R - 1; ++i) {
        issue_row(i, i);
        detail::cp_async_commit();
      }
    }
    if (sub_t0 == item_t0) {  // the item's first positions; the later ones are pipelined
      search_all(sub_t0, s_pos[0]);
      __syncthreads();
    }
    // The next sub-tile's positions: thread j searches its token j while the rows stream.
    const bool has_next = sub_t0 + TT < item_end;
    const bool searcher = has_next && threadIdx.x < Traits::kPosTokens;
    detail::DocSearch ds;
    if (searcher) ds.start(p.num_docs, sub_t0 + TT + threadIdx.x);
    int steps_done = 0;

    if (strip_on) {
      const uint8_t* my_pos = s_pos[buf] + strip * L;
      // Windows as 3-slot circular buffers, so a loop unrolled by 3 moves no registers: at row
      // r (token u = t0 + r) slot r % 3 holds x[u-3] and g[u-3], slot (r+1) % 3 x[u-2], g[u-2]
      // and pos[u-2], slot (r+2) % 3 x[u-1], g[u-1] and pos[u-1]; row r then overwrites slot
      // r % 3 with its own. The loop is not unrolled further: the body stays small in the
      // instruction cache, whatever the strip length.
      float xm[3][V], gm[3][V] = {};
      int pm[3] = {0, 0, 0};
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        if (i + R - 1 < N) issue_row(i + R - 1, (i + R - 1) % R);
        detail::cp_async_commit();
        if (searcher) ds.step(p.cu_seqlens, search_steps, i);
        detail::cp_async_wait<R - 1>();
        detail::bf16x4_to_float(my_xring[(i % R) * Traits::kThreads], xm[i]);
      }
      // Loop state, stepped once per row (no per-row multiplies): the ring slot of row r + 3,
      // the token and offset of the row to refill (r + R + 2, token >= 0) and of dx[t0 + r - 3].
      int slot = 3 % R;
      int refill_t = t0 + R - 1;
      uint32_t refill_off = base + (R - 1) * vecs_per_row;
      uint32_t dx_off = base - 3 * vecs_per_row;
      const int t_lim = active ? p.S : INT32_MIN;  // tokens < t_lim are read and written
      const auto row = [&](int r, auto phase) {
        constexpr int q = decltype(phase)::value, q1 = (q + 1) % 3, q2 = (q + 2) % 3;
        const int i = r + 3;
        if (i + R - 1 < N) {  // refill the slot row i - 1 has just left
          const bool valid = refill_t < t_lim;
          const int refill_slot = slot == 0 ? R - 1 : slot - 1;
          detail::cp_async_8(my_xring + refill_slot * Traits::kThreads, valid ? xv + refill_off : xv, valid);
          detail::cp_async_8(my_dyring + refill_slot * Traits::kThreads, valid ? dyv + refill_off : dyv, valid);
        }
        ++refill_t;
        refill_off += vecs_per_row;
        detail::cp_async_commit();  // possibly empty: keeps "row i is group i"
        if (searcher) ds.step(p.cu_seqlens, search_steps, i);
        detail::cp_async_wait<R - 1>();
        const int pos = my_pos[r];
        float xt[V], dyt[V], g[V];
        detail::bf16x4_to_float(my_xring[slot * Traits::kThreads], xt);
        detail::bf16x4_to_float(my_dyring[slot * Traits::kThreads], dyt);
        slot = slot + 1 == R ? 0 : slot + 1;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          // The FP32 pre-activation, bias first, then the taps current-first (the forward's order;
          // the forward sums taps pre-scaled by -log2 e, so the two may differ by an ulp).
          float a = fmaf(w[3][j], xt[j], b[j]);
          if (pos >= 1) a = fmaf(w[2][j], xm[q2][j], a);
          if (pos >= 2) a = fmaf(w[1][j], xm[q1][j], a);
          if (pos >= 3) a = fmaf(w[0][j], xm[q][j], a);
          if (p.round_preact) a = detail::round_to_bf16(a);
          g[j] = dyt[j] * detail::silu_grad(a);
        }
        if (r < L) {  // the strip's own tokens: each token's g is summed by exactly one strip
#pragma unroll
          for (int j = 0; j < V; ++j) {
            db[j] += g[j];
            dw[3][j] = fmaf(g[j], xt[j], dw[3][j]);
            if (pos >= 1) dw[2][j] = fmaf(g[j], xm[q2][j], dw[2][j]);
            if (pos >= 2) dw[1][j] = fmaf(g[j], xm[q1][j], dw[1][j]);
            if (pos >= 3) dw[0][j] = fmaf(g[j], xm[q][j], dw[0][j]);
          }
        }
        if (r >= 3) {  // dx of token s = u - 3 = t0 + r - 3, whose last consumer is u
          float d[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            // Token s + m read x[s] through tap 3 - m iff its position is >= m. FP32 order: tap 3
            // (token s itself) first.
            float v = w[3][j] * gm[q][j];
            if (pm[q1] >= 1) v = fmaf(w[2][j], gm[q1][j], v);
            if (pm[q2] >= 2) v = fmaf(w[1][j], gm[q2][j], v);
            if (pos >= 3) v = fmaf(w[0][j], g[j], v);
            d[j] = v;
          }
          if (t0 + r - 3 < t_lim) {
            dxv[dx_off] = make_uint2(detail::pack_bf16x2_rn(d[0], d[1]), detail::pack_bf16x2_rn(d[2], d[3]));
          }
        }
        dx_off += vecs_per_row;
        pm[q] = pos;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          xm[q][j] = xt[j];
          gm[q][j] = g[j];
        }
      };
      using P0 = std::integral_constant<int, 0>;
      using P1 = std::integral_constant<int, 1>;
      using P2 = std::integral_constant<int, 2>;
#pragma unroll 1
      for (int r = 0; r < L + 3; r += 3) {
        row(r, P0{});
        if (r + 1 < L + 3) row(r + 1, P1{});
        if (r + 2 < L + 3) row(r + 2, P2{});
      }
      steps_done = N;
    }
    if (searcher) {
      for (int k = steps_done; k <= search_steps + 1; ++k) ds.step(p.cu_seqlens, search_steps, k);
      s_pos[buf ^ 1][threadIdx.x] = static_cast<uint8_t>(ds.pos);
    }
    if (has_next && Traits::kPosTokens > Traits::kThreads) {  // more tokens than threads: a loop
      for (int j = threadIdx.x + Traits::kThreads; j < Traits::kPosTokens; j += Traits::kThreads) {
        detail::DocSearch rest;
        rest.start(p.num_docs, sub_t0 + TT + j);
        for (int k = 0; k <= search_steps + 1; ++k) rest.step(p.cu_seqlens, search_steps, k);
        s_pos[buf ^ 1][j] = static_cast<uint8_t>(rest.pos);
      }
    }
    __syncthreads();  // next positions visible; this sub-tile's ring and positions free
    buf ^= 1;
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
    const int c = tile_c * Traits::kTileChannels + ch;
    if (c >= p.C) continue;
    const float* src = s_sums + (q * V + ch % V) * Traits::kThreads + ch / V;
    float sum = 0.0f;
    for (int s = 0; s < Traits::kStrips; ++s) sum += src[s * Traits::kLanesC];
    rows[q * p.C + c] = sum;
  }
}

// dweight[c, k] = sum over groups of partials[group][k][c], dbias[c] likewise from row 4: each
// CTA owns 32 channels; its 8 warps add the groups congruent to the warp index, in group order,
// then warp 0's lanes add the 8 warp sums in warp order. Groups == 0 writes zeros.
constexpr int kReduceChannels = 32;
constexpr int kReduceWarps = 8;

template <class WeightT, class BiasT>
__global__ void __launch_bounds__(kReduceChannels * kReduceWarps)
causal_conv1d_bwd_reduce_kernel(const CausalConv1dBwdParams p) {
  __shared__ float s_sum[kBwdPartialRows][kReduceWarps][kReduceChannels];
  const int lane = threadIdx.x % kReduceChannels;
  const int warp = threadIdx.x / kReduceChannels;
  const int c = blockIdx.x * kReduceChannels + lane;
  float sum[kBwdPartialRows] = {};
  if (c < p.C) {
    for (int g = warp; g < p.groups; g += kReduceWarps) {
      const float* row = p.partials + static_cast<size_t>(g) * kBwdPartialRows * p.C + c;
#pragma unroll
      for (int q = 0; q < kBwdPartialRows; ++q) sum[q] += row[q * p.C];
    }
  }
#pragma unroll
  for (int q = 0; q < kBwdPartialRows; ++q) s_sum[q][warp][lane] = sum[q];
  __syncthreads();
  if (warp != 0 || c >= p.C) return;
  float total[kBwdPartialRows] = {};
#pragma unroll
  for (int q = 0; q < kBwdPartialRows; ++q) {
    for (int v = 0; v < kReduceWarps; ++v) total[q] += s_sum[q][v][lane];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) detail::store_param<WeightT>(p.dweight, c * 4 + k, total[k]);
  if constexpr (detail::kHasBias<BiasT>) detail::store_param<BiasT>(p.dbias, c, total[4]);
}

}  // namespace flashinfer_cake
