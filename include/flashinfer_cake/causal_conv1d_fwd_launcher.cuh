// Host side of the forward: the route rule (tile geometry from C), the launch and the C entry
// point's argument checks. No torch, no Python.
#pragma once

#include "causal_conv1d_fwd.cuh"
#include "launch_common.cuh"

namespace flashinfer_cake {

// One launch of a forward kernel over tiles of tile_tokens tokens x `lanes` row vectors (p.tiles_c
// and the grid from them), p.lanes_log2 given, with smem bytes of dynamic shared memory.
template <class KernelFn>
cudaError_t launch_fwd_tiles(KernelFn kernel, CausalConv1dFwdParams p, int64_t tile_tokens, int64_t lanes, int threads,
                             int smem, cudaStream_t stream) {
  constexpr int kVec = 8;  // both kernels' row vectors
  const int64_t vecs_per_row = p.C / kVec;
  const int64_t tiles_c = (vecs_per_row + lanes - 1) / lanes;
  const int64_t groups = (int64_t(p.S) + tile_tokens - 1) / tile_tokens;
  const int64_t blocks = groups * tiles_c;
  const int64_t rows_span = int64_t(p.S) * std::max(p.x_row_stride, p.y_row_stride);  // vectors
  if (blocks > INT32_MAX || rows_span >= (int64_t(1) << 32)) {  // 32-bit offsets
    return fail(cudaErrorInvalidValue,
                "x, out: S * row stride = %lld elements is too large for the forward (must be below %lld)",
                (long long)rows_span * kVec, (long long)kFwdMaxElements);
  }
  p.tiles_c = static_cast<int32_t>(tiles_c);
  const cudaError_t e = launch_after_prerequisite(kernel, blocks, threads, smem, stream, p);
  if (e != cudaSuccess) return fail(e, "forward kernel launch failed: %s", cudaGetErrorString(e));
  return cudaSuccess;
}

// The strip kernel's route of Traits' geometry.
template <class Traits, class WeightT, class BiasT, bool kStates>
cudaError_t launch_causal_conv1d_fwd_route(const CausalConv1dFwdParams& p, cudaStream_t stream) {
  return launch_fwd_tiles(causal_conv1d_fwd_kernel<Traits, WeightT, BiasT, kStates>, p, Traits::kTileTokens,
                          Traits::kLanesC, Traits::kThreads, 0, stream);
}

// The token-lane route: as many lanes per token as C needs (1, 2, 4, then kMaxLanesC per channel
// tile).
template <class Traits, class WeightT, class BiasT, bool kStates>
cudaError_t launch_causal_conv1d_fwd_token_lanes(CausalConv1dFwdParams p, cudaStream_t stream) {
  const int lanes_log2 = Traits::lanes_log2_for(p.C);
  p.lanes_log2 = lanes_log2;
  const int tile_tokens = Traits::tile_tokens(lanes_log2);
  return launch_fwd_tiles(causal_conv1d_fwd_token_lane_kernel<Traits, WeightT, BiasT, kStates>, p, tile_tokens,
                          int64_t(1) << lanes_log2, Traits::kThreads,
                          typename Traits::SmemLayout(tile_tokens, kStates).bytes, stream);
}

// Tile geometry; scripts/tune.py overrides these with -D to measure alternatives.
#ifndef CAKE_FWD_THREADS
#define CAKE_FWD_THREADS 128
#endif
#ifndef CAKE_FWD_STRIP_LEN
#define CAKE_FWD_STRIP_LEN 16
#endif
#ifndef CAKE_FWD_RING
#define CAKE_FWD_RING 8
#endif
#ifndef CAKE_FWD_MIN_CTAS
#define CAKE_FWD_MIN_CTAS 4
#endif
// With states, rows of more than 128 channels and documents of at most CAKE_FWD_SHORT_DOC_TOKENS
// tokens on average (S <= that * num_docs): a ring of CAKE_FWD_RING_SHORT_DOCS rows (see the rule).
#ifndef CAKE_FWD_RING_SHORT_DOCS
#define CAKE_FWD_RING_SHORT_DOCS 16
#endif
#ifndef CAKE_FWD_SHORT_DOC_TOKENS
#define CAKE_FWD_SHORT_DOC_TOKENS 8
#endif
#ifndef CAKE_FWD_VEC
#define CAKE_FWD_VEC 8  // channels per thread
#endif

// The token-lane route's geometry (FwdTokenLaneTraits): C up to CAKE_FWD_TL_MAX_C takes it.
#ifndef CAKE_FWD_TL_MAX_C
#define CAKE_FWD_TL_MAX_C 128
#endif
#ifndef CAKE_FWD_TL_THREADS
#define CAKE_FWD_TL_THREADS 128
#endif
#ifndef CAKE_FWD_TL_BLOCKS
#define CAKE_FWD_TL_BLOCKS 16  // blocks of 512 bytes a warp walks
#endif
#ifndef CAKE_FWD_TL_RING
#define CAKE_FWD_TL_RING 8  // ring blocks per warp
#endif
#ifndef CAKE_FWD_TL_MIN_CTAS
#define CAKE_FWD_TL_MIN_CTAS 5  // at most 96 registers (v16: both kernels use 91-96)
#endif
#ifndef CAKE_FWD_TL_MIN_CTAS_STATELESS
#define CAKE_FWD_TL_MIN_CTAS_STATELESS CAKE_FWD_TL_MIN_CTAS  // the stateless kernel's bound, if another
#endif

// With states, C above this and up to 64 takes the strip kernel with 8 lanes (below).
#ifndef CAKE_FWD_STATES_NARROW_ABOVE_C
#define CAKE_FWD_STATES_NARROW_ABOVE_C 32
#endif

// The route rule, from C and whether states are given (for non-decreasing cu_seqlens the output
// never depends on it: tune.py checks): C <= 128 the token-lane kernel, wider rows the strip kernel
// with 32 channel lanes; with states, 32 < C <= 64 the strip kernel with 8 lanes. Token lanes beat
// the strip kernel from 2097152x8 to 1048576x128 (4.6x to 1.6x; at C = 64 1.03x) without states;
// with states the strip kernel with 8 lanes is faster at 1048576 x 40..64 (70-79 against 91-92 us),
// though not with 64-token documents (127.1 against 104.8 us at C = 64), and token lanes stay ahead
// at C <= 32 and at C = 128 (tune.py, H200, 2026-12-02: README and NOTES_fwd sessions 25 and 26).
// With states and short documents the wide strip kernel's ring is deeper (probably more rows in flight
// while a strip waits on its documents' initial rows, several per strip there; tune.py --states, H200, r274,
// with the short scan, ring 8 -> 16 in us: 65536x1024 with 1-8-token documents 126.6 -> 123.4, 8192x8192
// with 8-token ones 104.5 -> 103.3; with 16-token ones 94.2 -> 94.7 (4096 documents) and 94.0 -> 94.9
// (32768x2048, 2048): hence the rule's 8 tokens; one document 71.9 -> 71.7).
template <class WeightT, class BiasT, bool kStates>
cudaError_t launch_causal_conv1d_fwd_routes(const CausalConv1dFwdParams& p, cudaStream_t stream) {
  constexpr int kVec = CAKE_FWD_VEC, kThreads = CAKE_FWD_THREADS, kStrip = CAKE_FWD_STRIP_LEN,
                kRing = CAKE_FWD_RING, kMinCtas = CAKE_FWD_MIN_CTAS;
  using TokenLanes = FwdTokenLaneTraits<8, CAKE_FWD_TL_THREADS, CAKE_FWD_TL_BLOCKS, CAKE_FWD_TL_RING,
                                        kStates ? CAKE_FWD_TL_MIN_CTAS : CAKE_FWD_TL_MIN_CTAS_STATELESS>;
  using Wide = FwdTraits<kVec, 32, kThreads, kStrip, kRing, kMinCtas>;
  using Narrow = FwdTraits<kVec, 8, kThreads, kStrip, kRing, kMinCtas>;
  // C above kNarrowAbove and up to 8 vectors: the 8-lane strip kernel.
  constexpr int kNarrowAbove =
      kStates ? std::min(CAKE_FWD_STATES_NARROW_ABOVE_C, CAKE_FWD_TL_MAX_C) : CAKE_FWD_TL_MAX_C;
  if constexpr (kNarrowAbove < 8 * kVec) {
    if (p.C > kNarrowAbove && p.C <= 8 * kVec) return launch_causal_conv1d_fwd_route<Narrow, WeightT, BiasT, kStates>(p, stream);
  }
  if (p.C <= CAKE_FWD_TL_MAX_C) return launch_causal_conv1d_fwd_token_lanes<TokenLanes, WeightT, BiasT, kStates>(p, stream);
  // (where the geometry takes that ring: a strip's rows hold it, and it takes at most 32 KB of shared memory, so
  // that the kernel's static shared memory stays under 48 KB: 40.9 KB at 16 rows of 128 threads; tune.py's
  // strip lengths of 8 and 256-thread CTAs keep one ring)
  constexpr int kRingShort = CAKE_FWD_RING_SHORT_DOCS;
  if constexpr (kStates && kRingShort != kRing && kRingShort <= kStrip + 4 && kRingShort * kThreads * 16 <= 32 * 1024) {
    using WideShortDocs = FwdTraits<kVec, 32, kThreads, kStrip, kRingShort, kMinCtas>;
    if (int64_t(p.S) <= int64_t(CAKE_FWD_SHORT_DOC_TOKENS) * p.num_docs) {
      return launch_causal_conv1d_fwd_route<WideShortDocs, WeightT, BiasT, kStates>(p, stream);
    }
  }
  return launch_causal_conv1d_fwd_route<Wide, WeightT, BiasT, kStates>(p, stream);
}

template <class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_fwd(const CausalConv1dFwdParams& p, cudaStream_t stream) {
  return p.initial_states || p.final_states ? launch_causal_conv1d_fwd_routes<WeightT, BiasT, true>(p, stream)
                                            : launch_causal_conv1d_fwd_routes<WeightT, BiasT, false>(p, stream);
}

// The C entry point's body: re-checks what the binding validated (the module may be called
// directly, e.g. with ctypes), selects the device, launches. Returns a cudaError_t code; on
// failure the message is in last_error_buffer().
template <class WeightT, class BiasT>
cudaError_t causal_conv1d_fwd_entry(const FwdArgs& a) {
  last_error_buffer()[0] = '\0';
  if (a.S < 0 || a.S >= kFwdMaxS) return fail(cudaErrorInvalidValue, "x: S must be in [0, 2^31), got %lld", (long long)a.S);
  if (a.C <= 0 || a.C % 8 != 0 || a.C >= kMaxC) return fail(cudaErrorInvalidValue, "x: C must be a positive multiple of 8 below 2^28, got %lld", (long long)a.C);
  if (a.S * a.C >= kFwdMaxElements) return fail(cudaErrorInvalidValue, "x: S * C must be below 2^35, got %lld", (long long)(a.S * a.C));
  if (a.num_docs < 0 || a.num_docs >= kMaxCuSeqlens) return fail(cudaErrorInvalidValue, "cu_seqlens: num_docs must be in [0, 2^31 - 2], got %lld", (long long)a.num_docs);
  if (a.device < 0 || a.device >= kMaxDevices) return fail(cudaErrorInvalidDevice, "device index %lld out of range", (long long)a.device);
  int64_t x_row_stride = 0, y_row_stride = 0;
  cudaError_t e = check_row_stride("x", a.S, a.C, a.x_row_stride, kFwdMaxElements, &x_row_stride);
  if (e == cudaSuccess) e = check_row_stride("out", a.S, a.C, a.y_row_stride, kFwdMaxElements, &y_row_stride);
  if (e != cudaSuccess) return e;
  const void* const initial_states = as_ptr<const void>(a.initial_states);
  void* const final_states = as_ptr<void>(a.final_states);
  if (a.num_docs > 0) {
    if (!aligned16(initial_states)) return fail(cudaErrorInvalidValue, "initial_states: expected a 16-byte aligned pointer");
    if (!aligned16(final_states)) return fail(cudaErrorInvalidValue, "final_states: expected a 16-byte aligned pointer");
  }
  if (a.S == 0) {  // every document is empty: its final state is its initial state
    if (final_states && a.num_docs > 0) {
      return on_device(static_cast<int>(a.device), [&] {
        return copy_or_zero_states(final_states, initial_states, a.num_docs, a.C, as_ptr<CUstream_st>(a.stream), "final_states");
      });
    }
    return cudaSuccess;
  }
  const void* const x = as_ptr<const void>(a.x);
  void* const y = as_ptr<void>(a.y);
  const void* const weight = as_ptr<const void>(a.weight);
  const void* const bias = as_ptr<const void>(a.bias);
  const int32_t* const cu_seqlens = as_ptr<const int32_t>(a.cu_seqlens);
  if (!x || !aligned16(x)) return fail(cudaErrorInvalidValue, "x: expected a non-null 16-byte aligned pointer");
  if (!y || !aligned16(y)) return fail(cudaErrorInvalidValue, "out: expected a non-null 16-byte aligned pointer");
  if (!weight || !aligned16(weight)) return fail(cudaErrorInvalidValue, "weight: expected a non-null 16-byte aligned pointer");
  if (detail::kHasBias<BiasT> && (!bias || !aligned16(bias))) return fail(cudaErrorInvalidValue, "bias: expected a non-null 16-byte aligned pointer");
  if (!cu_seqlens || !aligned_to(cu_seqlens, 4)) return fail(cudaErrorInvalidValue, "cu_seqlens: expected a non-null 4-byte aligned pointer");
  if (!a.workspace || a.workspace % 4) return fail(cudaErrorInvalidValue, "workspace: expected a non-null 4-byte aligned pointer");
  CausalConv1dFwdParams p{};
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.y = static_cast<__nv_bfloat16*>(y);
  p.weight = weight;
  p.bias = bias;
  p.cu_seqlens = cu_seqlens;
  p.initial_states = a.num_docs > 0 ? static_cast<const __nv_bfloat16*>(initial_states) : nullptr;
  p.final_states = a.num_docs > 0 ? static_cast<__nv_bfloat16*>(final_states) : nullptr;
  p.x_row_stride = static_cast<uint32_t>(x_row_stride / CAKE_FWD_VEC);  // in vectors: below 2^32 (S * stride checked)
  p.y_row_stride = static_cast<uint32_t>(y_row_stride / CAKE_FWD_VEC);
  p.S = static_cast<int32_t>(a.S);
  p.C = static_cast<int32_t>(a.C);
  p.num_docs = static_cast<int32_t>(a.num_docs);
  return on_device(static_cast<int>(a.device),
                   [&] { return launch_causal_conv1d_fwd<WeightT, BiasT>(p, as_ptr<CUstream_st>(a.stream)); });
}

}  // namespace flashinfer_cake
