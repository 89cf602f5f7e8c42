// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training forward.
//
// y[t, c] = bf16_rn(silu(sum_k w[c, k] * x[t - 3 + k, c] + b[c])), taps before the first token of
// t's document are zero. Framework-free: raw device pointers, sizes and a cudaStream_t.
//
// Geometry (FwdTraits): a CTA owns a chunk of kTileTokens tokens x kTileChannels channels. A thread
// owns 8 channels (one 16-byte vector) of a strip of kStripLen consecutive tokens and walks it
// with a sliding window of the last three rows in registers, so x is read once from DRAM (plus a
// 3-row halo per strip, which the neighbouring strip of the same CTA also reads: mostly L2 hits).
//
// Scheduling: a persistent grid. A CTA starts on chunk blockIdx.x and takes further chunks from
// the workspace counter (counters[0]); the last CTA to leave resets both counters to zero, so the
// workspace is zero on entry and on exit of every launch (CUDA-graph replays rely on it). Which CTA
// computes a chunk never changes its values: the output is bitwise deterministic.
//
// Document boundaries: while a CTA streams one chunk, each of its first kTileTokens threads
// binary-searches cu_seqlens for one token of the next chunk, a step per streamed row, and stores
// min(position in document, 3) in shared memory (double-buffered). Only x[0, S) and y[0, S) are
// ever addressed and every cu_seqlens read is in [0, num_docs], whatever cu_seqlens holds; see
// DocSearch for what garbage values produce.
#pragma once

#include "causal_conv1d_common.cuh"

namespace flashinfer_cake {

struct CausalConv1dFwdParams {
  const __nv_bfloat16* x;  // [S, C]
  __nv_bfloat16* y;        // [S, C]
  const void* weight;      // [C, 4], WeightT
  const void* bias;        // [C], BiasT (unused for NoBias)
  const int32_t* cu_seqlens;  // [num_docs + 1]
  unsigned int* counters;     // workspace: [0] next chunk, [1] CTAs done; zero on entry and exit
  int32_t S;
  int32_t C;
  int32_t num_docs;
  int32_t tiles_c;     // channel tiles per token tile
  int32_t num_chunks;  // token tiles * tiles_c
};

// Number of int32 counters a launch uses in its workspace.
constexpr int kFwdWorkspaceCounters = 2;

template <int kLanesC_, int kThreads_, int kStripLen_, int kRing_, int kMinCtasPerSm_>
struct FwdTraits {
  static constexpr int kLanesC = kLanesC_;    // threads side by side along channels
  static constexpr int kThreads = kThreads_;  // threads per CTA
  static constexpr int kStrips = kThreads / kLanesC;
  static constexpr int kStripLen = kStripLen_;  // tokens one thread walks
  static constexpr int kRing = kRing_;          // shared-memory rows per thread (kRing - 1 in flight)
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;  // register budget: 64K / (this * kThreads)
  static constexpr int kTileTokens = kStrips * kStripLen;
  static constexpr int kTileChannels = kLanesC * 8;
  static_assert(kThreads % kLanesC == 0 && kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kRing >= 2, "the ring needs two rows");
  static_assert(kTileTokens % 32 == 0 || kTileTokens > kThreads, "searching threads are whole warps");
};

template <class Traits, class WeightT, class BiasT>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
causal_conv1d_fwd_kernel(const CausalConv1dFwdParams p) {
  constexpr int L = Traits::kStripLen;
  constexpr int R = Traits::kRing;
  constexpr int N = L + 3;  // rows a strip reads: the 3-row halo, then its L tokens
  // Each thread streams its rows through its own column of this ring (cp.async, 16 bytes a row,
  // R - 1 rows ahead of the one it computes), so the bytes in flight cost no registers.
  __shared__ __align__(16) uint4 s_ring[R][Traits::kThreads];
  // Positions of a chunk's tokens, double-buffered: one chunk's are read while the next's land.
  __shared__ __align__(16) uint8_t s_pos[2][Traits::kTileTokens];
  __shared__ int s_claim[2];  // chunk ids claimed two chunks ahead, double-buffered likewise
  // The bias (pre-scaled), thread-private: read back per token instead of held in 8 registers.
  __shared__ __align__(16) float4 s_bias[Traits::kThreads][2];

  const int lane_c = threadIdx.x % Traits::kLanesC;
  const int strip = threadIdx.x / Traits::kLanesC;
  const uint32_t vecs_per_row = p.C / 8;
  const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(p.x);
  uint4* __restrict__ yv = reinterpret_cast<uint4*>(p.y);
  uint4* const my_ring = &s_ring[0][threadIdx.x];
  const auto claim = [&] { return static_cast<int>(atomicAdd(p.counters, 1u)) + gridDim.x; };
  const int search_steps = detail::DocSearch::halvings(p.num_docs);  // K
  // Token j of chunk c's token tile (positions past S are never read).
  const auto token_of = [&](int c, int j) { return (c / p.tiles_c) * Traits::kTileTokens + j; };
  // With one token per thread the next chunk's search runs a step per streamed row; tiles with more
  // tokens than threads (C <= 64: many strips) search in a loop after the rows.
  constexpr bool kPipelinedSearch = Traits::kTileTokens <= Traits::kThreads;
  const auto search_all = [&](int c, uint8_t* out) {
    for (int j = threadIdx.x; j < Traits::kTileTokens; j += Traits::kThreads) {
      detail::DocSearch ds;
      ds.start(p.num_docs, token_of(c, j));
      for (int k = 0; k <= search_steps + 1; ++k) ds.step(p.cu_seqlens, search_steps, k);
      out[j] = static_cast<uint8_t>(ds.pos);
    }
  };
  const bool searcher = threadIdx.x < Traits::kTileTokens;  // whole warps: kTileTokens % 32 == 0

  // A CTA starts on chunk blockIdx.x; the next comes from the counter. The first chunk's
  // positions are searched up front, every later chunk's during the chunk before it.
  int chunk = blockIdx.x;
  int buf = 0;
  if (threadIdx.x == 0) s_claim[1] = claim();
  search_all(chunk, s_pos[0]);
  __syncthreads();
  int next_chunk = s_claim[1];

  while (chunk < p.num_chunks) {
    // The chunk after next; read after this chunk's closing barrier.
    if (threadIdx.x == 0) s_claim[buf] = claim();

    const int tile_t = chunk / p.tiles_c;
    const int t0 = tile_t * Traits::kTileTokens + strip * L;
    const int vec = (chunk - tile_t * p.tiles_c) * Traits::kLanesC + lane_c;
    const bool active = static_cast<uint32_t>(vec) < vecs_per_row;
    // 16-byte offset of token t0 in my channels; 32 bits (the launcher caps S * C / 8 < 2^32),
    // one offset for x and y, so no 64-bit pointers are held in registers.
    const uint32_t base = static_cast<uint32_t>(t0) * vecs_per_row + vec;

    // Row i of the strip is token t0 - 3 + i; rows outside [0, S) and lanes past C read zeros.
    auto issue_row = [&](int i) {
      const int t = t0 - 3 + i;
      const bool valid = active && t >= 0 && t < p.S;
      detail::cp_async_16(my_ring + (i % R) * Traits::kThreads,
                          valid ? xv + (base + (i - 3) * vecs_per_row) : xv, valid);
    };
#pragma unroll
    for (int i = 0; i < R - 1; ++i) {
      issue_row(i);
      detail::cp_async_commit();
    }
    float w[4][8];
    if (active) {
      detail::load_weights<WeightT>(p.weight, vec * 8, w);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k][j] *= -detail::kLog2e;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k][j] = 0.0f;
      }
    }
    if (detail::kHasBias<BiasT>) {
      float b[8] = {};
      if (active) detail::load_bias<BiasT>(p.bias, vec * 8, b);
      s_bias[threadIdx.x][0] = make_float4(b[0] * -detail::kLog2e, b[1] * -detail::kLog2e, b[2] * -detail::kLog2e, b[3] * -detail::kLog2e);
      s_bias[threadIdx.x][1] = make_float4(b[4] * -detail::kLog2e, b[5] * -detail::kLog2e, b[6] * -detail::kLog2e, b[7] * -detail::kLog2e);
    }
    detail::DocSearch ds;
    ds.start(p.num_docs, token_of(next_chunk, threadIdx.x));
    const uint8_t* my_pos = s_pos[buf] + strip * L;

    // Window: xm[0] = x[t-3], xm[1] = x[t-2], xm[2] = x[t-1]. Token t's position p (capped at
    // 3) says which of them are in its document: x[t-k] counts iff k <= p. The taps outside are
    // skipped (predicated FMAs), never multiplied by zero, so nothing leaks across documents.
    float xm[3][8];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      // Refill the slot of row i - 1, whose data the previous iteration has consumed.
      if (i + R - 1 < N) issue_row(i + R - 1);
      detail::cp_async_commit();  // possibly empty: keeps "row i is group i" for the wait below
      if (kPipelinedSearch && searcher) ds.step(p.cu_seqlens, search_steps, i);
      detail::cp_async_wait<R - 1>();
      const uint4 v = my_ring[(i % R) * Traits::kThreads];
      if (i < 3) {
        detail::bf16x8_to_float(v, xm[i]);
        continue;
      }
      const int r = i - 3;  // token t0 + r
      const int pos = my_pos[r];
      float xt[8];
      detail::bf16x8_to_float(v, xt);
      float acc0[8] = {};
      if (detail::kHasBias<BiasT>) {
        const float4 lo = s_bias[threadIdx.x][0], hi = s_bias[threadIdx.x][1];
        acc0[0] = lo.x; acc0[1] = lo.y; acc0[2] = lo.z; acc0[3] = lo.w;
        acc0[4] = hi.x; acc0[5] = hi.y; acc0[6] = hi.z; acc0[7] = hi.w;
      }
      uint32_t packed[4];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        float a[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // FP32 accumulation in a fixed order: the bias, then the taps, current token first.
          // (Starting from the bias keeps it out of registers past this FMA: the kernel stays
          // within 96 registers, 5 CTAs per SM; the order changes the pre-activation by at most
          // an FP32 rounding, far below the BF16 rounding of y.)
          float s = fmaf(w[3][j + h], xt[j + h], acc0[j + h]);
          if (pos >= 1) s = fmaf(w[2][j + h], xm[2][j + h], s);
          if (pos >= 2) s = fmaf(w[1][j + h], xm[1][j + h], s);
          if (pos >= 3) s = fmaf(w[0][j + h], xm[0][j + h], s);
          a[h] = detail::silu_of_scaled(s);
        }
        packed[j / 2] = detail::pack_bf16x2_rn(a[0], a[1]);
      }
      if (active && t0 + r < p.S) {
        yv[base + r * vecs_per_row] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        xm[0][j] = xm[1][j];
        xm[1][j] = xm[2][j];
        xm[2][j] = xt[j];
      }
    }
    if (kPipelinedSearch) {
      if (searcher) {
        for (int k = N; k <= search_steps + 1; ++k) {  // over 2^(N-2) documents: finish here
          ds.step(p.cu_seqlens, search_steps, k);
        }
        s_pos[buf ^ 1][threadIdx.x] = static_cast<uint8_t>(ds.pos);
      }
    } else {
      search_all(next_chunk, s_pos[buf ^ 1]);
    }
    __syncthreads();  // the next chunk's positions and claim are visible; this chunk's are free
    chunk = next_chunk;
    next_chunk = s_claim[buf];
    buf ^= 1;
  }

  // Leave the counters zero: the last CTA out resets them. The fence orders this CTA's last
  // claim on counters[0] before its arrival on counters[1].
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int done = atomicAdd(p.counters + 1, 1u);
    if (done == gridDim.x - 1) {
      atomicExch(p.counters, 0u);
      atomicExch(p.counters + 1, 0u);
    }
  }
}

}  // namespace flashinfer_cake
