// Host side of the backward: the route rule (tile geometry from C), the launch (the kernel also
// reduces dweight/dbias in order) and the C entry point's argument checks. No torch, no Python.
#pragma once

#include "causal_conv1d_bwd.cuh"
#include "launch_common.cuh"

namespace flashinfer_cake {

template <class Traits, class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_bwd_route(CausalConv1dBwdParams p, cudaStream_t stream) {
  const int64_t vecs_per_row = p.C / Traits::kVec;
  const int64_t tiles_c = (vecs_per_row + Traits::kLanesC - 1) / Traits::kLanesC;
  const int64_t blocks = int64_t(p.groups) * tiles_c;
  if (blocks > INT32_MAX || int64_t(p.S) * vecs_per_row >= (int64_t(1) << 32)) {  // 32-bit offsets
    return fail(cudaErrorInvalidValue, "x: S * C = %lld elements is too large for the backward (S * C / %d must be below 2^32)",
                (long long)p.S * p.C, Traits::kVec);
  }
  static_assert(Traits::kTileChannels >= kBwdMinTileChannels, "the workspace has counters per kBwdMinTileChannels");
  p.tiles_c = static_cast<int32_t>(tiles_c);
  (void)cudaGetLastError();  // clear a stale error of an earlier runtime call on this thread
  const auto kernel = p.round_preact ? causal_conv1d_bwd_kernel<Traits, WeightT, BiasT, true>
                                     : causal_conv1d_bwd_kernel<Traits, WeightT, BiasT, false>;
  kernel<<<static_cast<int>(blocks), Traits::kThreads, 0, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(e, "backward kernel launch failed: %s", cudaGetErrorString(e));
  return cudaSuccess;
}

// S == 0: no token group, so no CTA reduces; dweight and dbias are zero.
template <class WeightT, class BiasT>
cudaError_t zero_param_grads(const CausalConv1dBwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(p.dweight, 0, size_t(p.C) * 4 * sizeof(WeightT), stream);
  if (e == cudaSuccess && detail::kHasBias<BiasT>) e = cudaMemsetAsync(p.dbias, 0, size_t(p.C) * detail::kBiasBytes<BiasT>, stream);
  if (e != cudaSuccess) return fail(e, "zeroing dweight/dbias failed: %s", cudaGetErrorString(e));
  return cudaSuccess;
}

// Tile geometry of the streaming kernel; -D overrides measure alternatives.
#ifndef CAKE_BWD_THREADS
#define CAKE_BWD_THREADS 128
#endif
#ifndef CAKE_BWD_STRIP_LEN
#define CAKE_BWD_STRIP_LEN 64  // bwd_item_tokens (causal_conv1d_bwd_plan.h) rounds groups to it
#endif
#ifndef CAKE_BWD_RING
#define CAKE_BWD_RING 8
#endif
#ifndef CAKE_BWD_MIN_CTAS
#define CAKE_BWD_MIN_CTAS 4
#endif
#ifndef CAKE_BWD_VEC
#define CAKE_BWD_VEC 4  // channels per thread
#endif

// Token groups (the item_tokens argument) must be a multiple of this.
constexpr int kBwdStripLen = CAKE_BWD_STRIP_LEN;

// Routes, from shapes only: channel lanes per CTA 32; 16 when C <= 16 * kVec, in CTAs of half
// the threads (with 32 lanes half of each row would be idle: C = 64 ran at 37-40 % of copy);
// 8 when C <= 8 * kVec (a few idle lanes at tiny C). With 32 or 16 lanes, half the threads
// (2 strips) when a token group is shorter than one sub-tile of the full CTA (small S: the
// group would leave strips idle). Threads per SM stay 4 * CAKE_BWD_THREADS on every route.
template <class WeightT, class BiasT>
cudaError_t launch_causal_conv1d_bwd(const CausalConv1dBwdParams& p, cudaStream_t stream) {
  if (p.groups == 0) return zero_param_grads<WeightT, BiasT>(p, stream);
  constexpr int kVec = CAKE_BWD_VEC, kThreads = CAKE_BWD_THREADS, kStrip = CAKE_BWD_STRIP_LEN,
                kRing = CAKE_BWD_RING, kMinCtas = CAKE_BWD_MIN_CTAS;
  using Wide = BwdTraits<kVec, 32, kThreads, kStrip, kRing, kMinCtas>;
  using WideShort = BwdTraits<kVec, 32, kThreads / 2, kStrip, kRing, 2 * kMinCtas>;
  using Mid = BwdTraits<kVec, 16, kThreads / 2, kStrip, kRing, 2 * kMinCtas>;
  using MidShort = BwdTraits<kVec, 16, kThreads / 4, kStrip, kRing, 4 * kMinCtas>;
  if (p.C > 16 * kVec) {
    if (p.item_tokens >= Wide::kTileTokens) return launch_causal_conv1d_bwd_route<Wide, WeightT, BiasT>(p, stream);
    return launch_causal_conv1d_bwd_route<WideShort, WeightT, BiasT>(p, stream);
  }
  if (p.C > 8 * kVec) {
    if (p.item_tokens >= Mid::kTileTokens) return launch_causal_conv1d_bwd_route<Mid, WeightT, BiasT>(p, stream);
    return launch_causal_conv1d_bwd_route<MidShort, WeightT, BiasT>(p, stream);
  }
  return launch_causal_conv1d_bwd_route<BwdTraits<kVec, 8, kThreads, kStrip, kRing, kMinCtas>, WeightT, BiasT>(p, stream);
}

// The C entry point's body: re-checks what the Python layer validated (the binary may be called
// directly), selects the device, launches the kernel. Returns a cudaError_t code; on failure the
// message is in last_error_buffer().
template <class WeightT, class BiasT>
cudaError_t causal_conv1d_bwd_entry(const void* x, const void* dy, void* dx, const void* weight,
                                    const void* bias, const int32_t* cu_seqlens, void* workspace,
                                    int64_t workspace_bytes, void* dweight, void* dbias, int64_t S,
                                    int64_t C, int64_t num_docs, int64_t item_tokens,
                                    int64_t round_preact, int64_t device, cudaStream_t stream) {
  last_error_buffer()[0] = '\0';
  // Token indices of a group, its sub-tiles and their 3-token lookahead stay below 2^31.
  if (S < 0 || S >= (int64_t(1) << 30)) return fail(cudaErrorInvalidValue, "x: S must be in [0, 2^30) for the backward, got %lld", (long long)S);
  if (C <= 0 || C % 8 != 0 || C > INT32_MAX / 8) return fail(cudaErrorInvalidValue, "x: C must be a positive multiple of 8, got %lld", (long long)C);
  if (num_docs < 0 || num_docs >= INT32_MAX) return fail(cudaErrorInvalidValue, "cu_seqlens: num_docs must be in [0, 2^31 - 1), got %lld", (long long)num_docs);
  if (item_tokens <= 0 || item_tokens % kBwdStripLen != 0 || item_tokens > kBwdMaxItemTokens) {
    return fail(cudaErrorInvalidValue, "item_tokens must be a positive multiple of %d up to %d, got %lld", kBwdStripLen, kBwdMaxItemTokens, (long long)item_tokens);
  }
  if (round_preact != 0 && round_preact != 1) return fail(cudaErrorInvalidValue, "round_preact must be 0 or 1, got %lld", (long long)round_preact);
  if (device < 0 || device >= kMaxDevices) return fail(cudaErrorInvalidDevice, "device index %lld out of range", (long long)device);
  const int64_t need = bwd_workspace_bytes(S, C, item_tokens);
  if (workspace_bytes < need) {
    return fail(cudaErrorInvalidValue, "workspace: expected at least %lld bytes, got %lld", (long long)need, (long long)workspace_bytes);
  }
  if (!dweight || !aligned_to(dweight, sizeof(WeightT))) return fail(cudaErrorInvalidValue, "dweight: expected a non-null pointer aligned to its dtype");
  if constexpr (detail::kHasBias<BiasT>) {
    if (!dbias || !aligned_to(dbias, sizeof(BiasT))) return fail(cudaErrorInvalidValue, "dbias: expected a non-null pointer aligned to its dtype");
  }
  if (S > 0) {
    if (!x || !aligned16(x)) return fail(cudaErrorInvalidValue, "x: expected a non-null 16-byte aligned pointer");
    if (!dy || !aligned16(dy)) return fail(cudaErrorInvalidValue, "dy: expected a non-null 16-byte aligned pointer");
    if (!dx || !aligned16(dx)) return fail(cudaErrorInvalidValue, "dx: expected a non-null 16-byte aligned pointer");
    if (!weight || !aligned16(weight)) return fail(cudaErrorInvalidValue, "weight: expected a non-null 16-byte aligned pointer");
    if (detail::kHasBias<BiasT> && (!bias || !aligned16(bias))) return fail(cudaErrorInvalidValue, "bias: expected a non-null 16-byte aligned pointer");
    if (!cu_seqlens || !aligned_to(cu_seqlens, 4)) return fail(cudaErrorInvalidValue, "cu_seqlens: expected a non-null 4-byte aligned pointer");
    if (!workspace || !aligned_to(workspace, 4)) return fail(cudaErrorInvalidValue, "workspace: expected a non-null 4-byte aligned pointer");
  }
  CausalConv1dBwdParams p{};
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.dy = static_cast<const __nv_bfloat16*>(dy);
  p.dx = static_cast<__nv_bfloat16*>(dx);
  p.weight = weight;
  p.bias = bias;
  p.cu_seqlens = cu_seqlens;
  p.dweight = dweight;
  p.dbias = dbias;
  p.S = static_cast<int32_t>(S);
  p.C = static_cast<int32_t>(C);
  p.num_docs = static_cast<int32_t>(num_docs);
  p.item_tokens = static_cast<int32_t>(item_tokens);
  p.groups = static_cast<int32_t>((S + item_tokens - 1) / item_tokens);
  if (S > 0) {  // the counters, then the partial rows (see bwd_counter_bytes)
    p.counters = static_cast<int32_t*>(workspace);
    p.partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + bwd_counter_bytes(C, p.groups));
  }
  p.round_preact = static_cast<int32_t>(round_preact);
  return on_device(static_cast<int>(device), [&] { return launch_causal_conv1d_bwd<WeightT, BiasT>(p, stream); });
}

}  // namespace flashinfer_cake
