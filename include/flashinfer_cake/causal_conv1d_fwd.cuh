// Packed (varlen) width-4 depthwise causal conv1d + SiLU, training forward.
//
// y[t, c] = bf16_rn(silu(b[c] + sum_k w[c, k] * x[t - 3 + k, c])), taps before the first token of
// t's document are zero. Framework-free: raw device pointers, sizes and a cudaStream_t.
//
// Geometry (FwdTraits): a CTA owns a chunk of kTileTokens tokens x kTileChannels channels. A thread
// owns 8 channels (one 16-byte vector) of a strip of kStripLen consecutive tokens and walks it
// with a sliding window of the last three rows in registers, so x is read once (plus a 3-row halo
// per strip, which the neighbouring strip of the same CTA has just pulled into L1/L2).
//
// Scheduling: a persistent grid. A CTA starts on chunk blockIdx.x and takes further chunks from
// the workspace counter (counters[0]); the last CTA to leave resets both counters to zero, so the
// workspace is zero on entry and on exit of every launch (CUDA-graph replays rely on it). Which CTA
// computes a chunk never changes its values: the output is bitwise deterministic.
//
// Document boundaries: every thread binary-searches cu_seqlens for one token of the chunk (all in
// parallel, overlapped with the chunk's first loads) and stores min(position in document, 3) in
// shared memory. Only x[0, S) and y[0, S) are ever addressed and every cu_seqlens read is in
// [0, num_docs], whatever cu_seqlens holds; see doc_position() for what garbage values produce.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace flashinfer_cake {

struct NoBias {};  // the bias type of the variants without a bias

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

template <int kLanesC_, int kThreads_, int kStripLen_, int kBatch_>
struct FwdTraits {
  static constexpr int kLanesC = kLanesC_;    // threads side by side along channels
  static constexpr int kThreads = kThreads_;  // threads per CTA
  static constexpr int kStrips = kThreads / kLanesC;
  static constexpr int kStripLen = kStripLen_;  // tokens one thread walks
  static constexpr int kBatch = kBatch_;        // rows loaded ahead of the ones being computed
  static constexpr int kTileTokens = kStrips * kStripLen;
  static constexpr int kTileChannels = kLanesC * 8;
  static_assert(kThreads % kLanesC == 0 && kThreads % 32 == 0, "CTA must be whole warps");
  static_assert(kStripLen % kBatch == 0 && kStripLen % 4 == 0, "strip must be whole batches");
};

namespace detail {

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2_rn(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // round to nearest even
  return *reinterpret_cast<const uint32_t*>(&h);
}

// silu(a) = a / (1 + exp(-a)) in FP32. exp and the division use the hardware approximations
// (relative error ~2^-21), far below the BF16 rounding of the result, and explicit here so that
// the output does not depend on compiler flags such as --use_fast_math.
__device__ __forceinline__ float silu(float a) {
  return __fdividef(a, 1.0f + __expf(-a));
}

// Taps of 8 channels: w[k][j] multiplies x[t - 3 + k] of channel c0 + j.
template <class WeightT>
__device__ __forceinline__ void load_weights(const void* weight, int c0, float (&w)[4][8]);

template <>
__device__ __forceinline__ void load_weights<float>(const void* weight, int c0, float (&w)[4][8]) {
  const float4* p = reinterpret_cast<const float4*>(weight) + c0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float4 v = __ldg(p + j);
    w[0][j] = v.x;
    w[1][j] = v.y;
    w[2][j] = v.z;
    w[3][j] = v.w;
  }
}

template <>
__device__ __forceinline__ void load_weights<__nv_bfloat16>(const void* weight, int c0,
                                                            float (&w)[4][8]) {
  // 4 BF16 taps per channel = 8 bytes; one 16-byte load holds two channels.
  const uint4* p = reinterpret_cast<const uint4*>(weight) + c0 / 2;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 v = __ldg(p + j);
    const uint32_t q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[0][2 * j + h] = __uint_as_float(q[2 * h] << 16);
      w[1][2 * j + h] = __uint_as_float(q[2 * h] & 0xffff0000u);
      w[2][2 * j + h] = __uint_as_float(q[2 * h + 1] << 16);
      w[3][2 * j + h] = __uint_as_float(q[2 * h + 1] & 0xffff0000u);
    }
  }
}

template <class BiasT>
__device__ __forceinline__ void load_bias(const void* bias, int c0, float (&b)[8]);

template <>
__device__ __forceinline__ void load_bias<NoBias>(const void*, int, float (&b)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) b[j] = 0.0f;
}

template <>
__device__ __forceinline__ void load_bias<float>(const void* bias, int c0, float (&b)[8]) {
  const float4* p = reinterpret_cast<const float4*>(bias) + c0 / 4;
  const float4 lo = __ldg(p), hi = __ldg(p + 1);
  b[0] = lo.x; b[1] = lo.y; b[2] = lo.z; b[3] = lo.w;
  b[4] = hi.x; b[5] = hi.y; b[6] = hi.z; b[7] = hi.w;
}

template <>
__device__ __forceinline__ void load_bias<__nv_bfloat16>(const void* bias, int c0, float (&b)[8]) {
  bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(bias) + c0 / 8), b);
}

// min(t - start, 3), where start is the value of the last cu_seqlens entry <= t (binary search
// over cu_seqlens[0..num_docs]); 0 when there is none. For a valid cu_seqlens that is the
// position of t in its document, capped at 3. For any other content the search still reads only
// cu_seqlens[0..num_docs] and returns a value in [0, 3]: each token then sees the history that
// this rule gives it, never memory outside x.
__device__ __forceinline__ int doc_position(const int32_t* __restrict__ cu, int num_docs, int t) {
  int lo = -1, hi = num_docs;  // answer in [lo, hi]; lo == -1 means "no entry <= t"
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) <= t) lo = mid; else hi = mid - 1;
  }
  if (lo < 0) return 0;
  const int64_t d = static_cast<int64_t>(t) - __ldg(cu + lo);
  return d < 3 ? static_cast<int>(d) : 3;
}

}  // namespace detail

template <class Traits, class WeightT, class BiasT>
__global__ void __launch_bounds__(Traits::kThreads)
causal_conv1d_fwd_kernel(const CausalConv1dFwdParams p) {
  constexpr int L = Traits::kStripLen;
  constexpr int B = Traits::kBatch;
  __shared__ __align__(16) uint8_t s_pos[Traits::kTileTokens];
  __shared__ int s_next_chunk;

  const int lane_c = threadIdx.x % Traits::kLanesC;
  const int strip = threadIdx.x / Traits::kLanesC;
  const int vecs_per_row = p.C / 8;
  const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(p.x);
  uint4* __restrict__ yv = reinterpret_cast<uint4*>(p.y);

  int chunk = blockIdx.x;
  while (chunk < p.num_chunks) {
    // Claim the next chunk now; the atomic's latency hides behind this chunk's work.
    if (threadIdx.x == 0) s_next_chunk = static_cast<int>(atomicAdd(p.counters, 1u)) + gridDim.x;

    const int tile_t = chunk / p.tiles_c;
    const int tile_c = chunk - tile_t * p.tiles_c;
    const int tile_t0 = tile_t * Traits::kTileTokens;
    const int t0 = tile_t0 + strip * L;
    const int vec = tile_c * Traits::kLanesC + lane_c;
    const bool active = vec < vecs_per_row;
    const int64_t base = static_cast<int64_t>(t0) * vecs_per_row + vec;

    // Issue the halo and the first batch before the document search so they are in flight.
    uint4 halo[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int t = t0 - 3 + k;
      halo[k] = (active && t >= 0 && t < p.S) ? __ldg(xv + base + (k - 3) * int64_t(vecs_per_row))
                                             : make_uint4(0, 0, 0, 0);
    }
    uint4 cur[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      cur[i] = (active && t0 + i < p.S) ? __ldg(xv + base + i * int64_t(vecs_per_row))
                                        : make_uint4(0, 0, 0, 0);
    }
    float w[4][8], acc0[8];
    if (active) {
      detail::load_weights<WeightT>(p.weight, vec * 8, w);
      detail::load_bias<BiasT>(p.bias, vec * 8, acc0);
    }

    for (int j = threadIdx.x; j < Traits::kTileTokens; j += Traits::kThreads) {
      const int t = tile_t0 + j;
      s_pos[j] = t < p.S ? static_cast<uint8_t>(detail::doc_position(p.cu_seqlens, p.num_docs, t))
                         : uint8_t(0);
    }
    __syncthreads();
    const int next_chunk = s_next_chunk;

    if (active) {
      uint32_t pos_words[L / 4];
#pragma unroll
      for (int i = 0; i < L / 4; ++i) {
        pos_words[i] = reinterpret_cast<const uint32_t*>(s_pos + strip * L)[i];
      }
      // Window: xm[0] = x[t-3], xm[1] = x[t-2], xm[2] = x[t-1]; halo rows outside t0's document
      // are zero (position p keeps the last p rows).
      const int pos0 = pos_words[0] & 0xff;
      float xm[3][8];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        detail::bf16x8_to_float(halo[k], xm[k]);
        if (k < 3 - pos0) {
#pragma unroll
          for (int j = 0; j < 8; ++j) xm[k][j] = 0.0f;
        }
      }

#pragma unroll
      for (int b0 = 0; b0 < L; b0 += B) {
        uint4 nxt[B];
        if (b0 + B < L) {
#pragma unroll
          for (int i = 0; i < B; ++i) {
            const int t = t0 + b0 + B + i;
            nxt[i] = t < p.S ? __ldg(xv + base + (b0 + B + i) * int64_t(vecs_per_row))
                             : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int i = 0; i < B; ++i) {
          const int r = b0 + i;
          const int t = t0 + r;
          // A document starts at t: no history.
          if (r > 0 && ((pos_words[r / 4] >> (8 * (r % 4))) & 0xff) == 0) {
#pragma unroll
            for (int k = 0; k < 3; ++k) {
#pragma unroll
              for (int j = 0; j < 8; ++j) xm[k][j] = 0.0f;
            }
          }
          float xt[8];
          detail::bf16x8_to_float(cur[i], xt);
          uint32_t packed[4];
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            float a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float s = acc0[j + h];
              s = fmaf(w[0][j + h], xm[0][j + h], s);
              s = fmaf(w[1][j + h], xm[1][j + h], s);
              s = fmaf(w[2][j + h], xm[2][j + h], s);
              s = fmaf(w[3][j + h], xt[j + h], s);
              a[h] = detail::silu(s);
            }
            packed[j / 2] = detail::pack_bf16x2_rn(a[0], a[1]);
          }
          if (t < p.S) yv[base + r * int64_t(vecs_per_row)] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            xm[0][j] = xm[1][j];
            xm[1][j] = xm[2][j];
            xm[2][j] = xt[j];
          }
        }
        if (b0 + B < L) {
#pragma unroll
          for (int i = 0; i < B; ++i) cur[i] = nxt[i];
        }
      }
    }
    __syncthreads();  // s_pos and s_next_chunk are rewritten by the next chunk
    chunk = next_chunk;
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
