// Host side of the forward: the route rule (tile geometry from C), the persistent grid size and
// the C entry point's argument checks. No torch, no Python.
#pragma once

#include "causal_conv1d_fwd.cuh"
#include "launch_common.cuh"

namespace flashinfer_cake {

template <class Traits, class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_fwd_route(CausalConv1dFwdParams p, int device,
                                           cudaStream_t stream) {
  const auto kernel = causal_conv1d_fwd_kernel<Traits, WeightT, BiasT>;
  const int vecs_per_row = p.C / 8;
  const int64_t tiles_t = (int64_t(p.S) + Traits::kTileTokens - 1) / Traits::kTileTokens;
  const int64_t tiles_c = (vecs_per_row + Traits::kLanesC - 1) / Traits::kLanesC;
  const int64_t chunks = tiles_t * tiles_c;
  if (chunks > INT32_MAX / 2 || int64_t(p.S) * vecs_per_row >= (int64_t(1) << 32)) {
    return fail(cudaErrorInvalidValue, "x: S * C = %lld elements is too large for the forward (max 2^35 - 1)",
                (long long)p.S * p.C);
  }
  p.tiles_c = static_cast<int32_t>(tiles_c);
  p.num_chunks = static_cast<int32_t>(chunks);
  int resident = 0;
  cudaError_t e = resident_ctas(kernel, Traits::kThreads, device, &resident);
  if (e != cudaSuccess) {
    return fail(e, "occupancy query failed on device %d: %s", device, cudaGetErrorString(e));
  }
  const int grid = static_cast<int>(chunks < resident ? chunks : resident);
  (void)cudaGetLastError();  // clear a stale error of an earlier runtime call on this thread
  kernel<<<grid, Traits::kThreads, 0, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return fail(e, "kernel launch failed: %s", cudaGetErrorString(e));
  return cudaSuccess;
}

// Tile geometry; scripts/tune_fwd.py overrides these with -D to measure alternatives.
#ifndef CAKE_FWD_THREADS
#define CAKE_FWD_THREADS 128
#endif
#ifndef CAKE_FWD_STRIP_LEN
#define CAKE_FWD_STRIP_LEN 16
#endif
#ifndef CAKE_FWD_RING
#define CAKE_FWD_RING 6
#endif
#ifndef CAKE_FWD_MIN_CTAS
#define CAKE_FWD_MIN_CTAS 5
#endif


#ifndef CAKE_FWD_MAX_LANES
#define CAKE_FWD_MAX_LANES 32
#endif

// The route rule: channel lanes per CTA = the smallest power of two >= C / 8, capped at
// CAKE_FWD_MAX_LANES; a function of C only, so a given (S, C, device) always runs the same program.
template <class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_fwd(CausalConv1dFwdParams p, int device, cudaStream_t stream) {
  constexpr int kThreads = CAKE_FWD_THREADS, kStrip = CAKE_FWD_STRIP_LEN, kRing = CAKE_FWD_RING,
                kMinCtas = CAKE_FWD_MIN_CTAS, kMaxLanes = CAKE_FWD_MAX_LANES;
  // C < 256: more strips per CTA (and for C <= 64 several searched tokens per thread): these
  // routes need more registers, so they run 4 CTAs per SM and do not spill.
  constexpr int kNarrowMinCtas = kMinCtas > 4 ? 4 : kMinCtas;
  const int vecs = p.C / 8;
  if constexpr (kMaxLanes >= 256 && kThreads % 256 == 0) {
    if (vecs > 128) return launch_causal_conv1d_fwd_route<FwdTraits<256, kThreads, kStrip, kRing, kMinCtas>, WeightT, BiasT>(p, device, stream);
  }
  if constexpr (kMaxLanes >= 128 && kThreads % 128 == 0) {
    if (vecs > 64) return launch_causal_conv1d_fwd_route<FwdTraits<128, kThreads, kStrip, kRing, kMinCtas>, WeightT, BiasT>(p, device, stream);
  }
  if constexpr (kMaxLanes >= 64 && kThreads % 64 == 0) {
    if (vecs > 32) return launch_causal_conv1d_fwd_route<FwdTraits<64, kThreads, kStrip, kRing, kMinCtas>, WeightT, BiasT>(p, device, stream);
  }
  if (vecs > 16) return launch_causal_conv1d_fwd_route<FwdTraits<32, kThreads, kStrip, kRing, kMinCtas>, WeightT, BiasT>(p, device, stream);
  if (vecs > 8) return launch_causal_conv1d_fwd_route<FwdTraits<16, kThreads, kStrip, kRing, kNarrowMinCtas>, WeightT, BiasT>(p, device, stream);
  if (vecs > 4) return launch_causal_conv1d_fwd_route<FwdTraits<8, kThreads, kStrip, kRing, kNarrowMinCtas>, WeightT, BiasT>(p, device, stream);
  if (vecs > 2) return launch_causal_conv1d_fwd_route<FwdTraits<4, kThreads, kStrip, kRing, kNarrowMinCtas>, WeightT, BiasT>(p, device, stream);
  if (vecs > 1) return launch_causal_conv1d_fwd_route<FwdTraits<2, kThreads, kStrip, kRing, kNarrowMinCtas>, WeightT, BiasT>(p, device, stream);
  return launch_causal_conv1d_fwd_route<FwdTraits<1, kThreads, kStrip, kRing, kNarrowMinCtas>, WeightT, BiasT>(p, device, stream);
}

// The C entry point's body: re-checks what the Python layer validated (the binary may be called
// directly), selects the device, launches. Returns a cudaError_t code; on failure the message is
// in last_error_buffer().
template <class WeightT, class BiasT>
cudaError_t causal_conv1d_fwd_entry(const void* x, void* y, const void* weight, const void* bias,
                                    const int32_t* cu_seqlens, int32_t* workspace, int64_t S,
                                    int64_t C, int64_t num_docs, int64_t device, cudaStream_t stream) {
  last_error_buffer()[0] = '\0';
  if (S < 0 || S > INT32_MAX) return fail(cudaErrorInvalidValue, "x: S must be in [0, 2^31), got %lld", (long long)S);
  if (C <= 0 || C % 8 != 0 || C > INT32_MAX / 8) return fail(cudaErrorInvalidValue, "x: C must be a positive multiple of 8, got %lld", (long long)C);
  if (num_docs < 0 || num_docs >= INT32_MAX) return fail(cudaErrorInvalidValue, "cu_seqlens: num_docs must be in [0, 2^31 - 1), got %lld", (long long)num_docs);
  if (device < 0 || device >= kMaxDevices) return fail(cudaErrorInvalidDevice, "device index %lld out of range", (long long)device);
  if (S == 0) return cudaSuccess;
  if (!x || !aligned16(x)) return fail(cudaErrorInvalidValue, "x: expected a non-null 16-byte aligned pointer");
  if (!y || !aligned16(y)) return fail(cudaErrorInvalidValue, "out: expected a non-null 16-byte aligned pointer");
  if (!weight || !aligned16(weight)) return fail(cudaErrorInvalidValue, "weight: expected a non-null 16-byte aligned pointer");
  if (detail::kHasBias<BiasT> && (!bias || !aligned16(bias))) return fail(cudaErrorInvalidValue, "bias: expected a non-null 16-byte aligned pointer");
  if (!cu_seqlens || !aligned_to(cu_seqlens, 4)) return fail(cudaErrorInvalidValue, "cu_seqlens: expected a non-null 4-byte aligned pointer");
  if (!workspace || !aligned_to(workspace, 4)) return fail(cudaErrorInvalidValue, "workspace: expected a non-null 4-byte aligned pointer");
  CausalConv1dFwdParams p{};
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.y = static_cast<__nv_bfloat16*>(y);
  p.weight = weight;
  p.bias = bias;
  p.cu_seqlens = cu_seqlens;
  p.counters = reinterpret_cast<unsigned int*>(workspace);
  p.S = static_cast<int32_t>(S);
  p.C = static_cast<int32_t>(C);
  p.num_docs = static_cast<int32_t>(num_docs);
  const int dev = static_cast<int>(device);
  return on_device(dev, [&] { return launch_causal_conv1d_fwd<WeightT, BiasT>(p, dev, stream); });
}

}  // namespace flashinfer_cake
