// Host side of the context-parallel passes (causal_conv1d_cp.cuh): the C entry point's argument
// checks and the launch. No torch, no Python.
#pragma once

#include "causal_conv1d_cp.cuh"
#include "launch_common.cuh"

namespace flashinfer_cake {

template <class WeightT, class BiasT>
cudaError_t causal_conv1d_cp_entry(const CpArgs& a) {
  last_error_buffer()[0] = '\0';
  if (a.pass < kCpFwdHeads || a.pass > kCpBwdTails) return fail(cudaErrorInvalidValue, "pass must be 0, 1 or 2, got %lld", (long long)a.pass);
  if (a.S < 0 || a.S >= kBwdMaxS) return fail(cudaErrorInvalidValue, "x: S must be in [0, 2^30), got %lld", (long long)a.S);
  if (a.C <= 0 || a.C % 8 != 0 || a.C >= kMaxC) return fail(cudaErrorInvalidValue, "x: C must be a positive multiple of 8 below 2^28, got %lld", (long long)a.C);
  if (a.S * a.C >= kBwdMaxElements) return fail(cudaErrorInvalidValue, "x: S * C must be below 2^34, got %lld", (long long)(a.S * a.C));
  static_assert((kCpMaxC - 1) / (detail::kCpVec * detail::kCpThreads) < 65535, "the passes' grid.y");
  if (a.C >= kCpMaxC) return fail(cudaErrorInvalidValue, "x: C must be below 2^25 for the context-parallel passes, got %lld", (long long)a.C);
  if (a.num_frags < 0 || a.num_frags >= kMaxCuSeqlens / 3) return fail(cudaErrorInvalidValue, "num_frags out of range: %lld", (long long)a.num_frags);
  if (a.num_items < 0 || a.num_items > INT32_MAX) return fail(cudaErrorInvalidValue, "num_items out of range: %lld", (long long)a.num_items);
  if (a.round_preact != 0 && a.round_preact != 1) return fail(cudaErrorInvalidValue, "round_preact must be 0 or 1, got %lld", (long long)a.round_preact);
  if (a.device < 0 || a.device >= kMaxDevices) return fail(cudaErrorInvalidDevice, "device index %lld out of range", (long long)a.device);
  const bool grads = a.pass != kCpFwdHeads;
  if (a.pass == kCpFwdHeads || a.pass == kCpBwdTails) {
    if (!a.out || a.out % 16) return fail(cudaErrorInvalidValue, "out: expected a non-null 16-byte aligned pointer");
    if (a.num_items > 0 && (!a.frags || a.frags % 4)) return fail(cudaErrorInvalidValue, "frags: expected a non-null 4-byte aligned pointer");
    if (a.num_items > INT32_MAX / 3) return fail(cudaErrorInvalidValue, "num_items out of range: %lld", (long long)a.num_items);
  }
  if (a.pass == kCpFwdHeads && a.num_items > 0) {
    if (!a.import_rows || a.import_rows % 4) return fail(cudaErrorInvalidValue, "import_rows: expected a non-null 4-byte aligned pointer");
    if (a.received_rows < 0 || (a.received_rows > 0 && (!a.received || a.received % 16)) || a.received_ld < a.C || a.received_ld % 8) {
      return fail(cudaErrorInvalidValue, "received: expected received_rows >= 0 rows (16-byte aligned, non-null when any) "
                  "received_ld >= C elements apart, a multiple of 8; got %lld rows, received_ld %lld",
                  (long long)a.received_rows, (long long)a.received_ld);
    }
  }
  if (grads && (!a.dy || a.dy % 16)) return fail(cudaErrorInvalidValue, "dy: expected a non-null 16-byte aligned pointer");
  if (grads && (a.g_ld < a.C || a.g_ld % 4)) return fail(cudaErrorInvalidValue, "g_ld: expected a multiple of 4, at least C = %lld, got %lld", (long long)a.C, (long long)a.g_ld);
  if (a.pass == kCpBwdHeads && (!a.g_out || a.g_out % 16 || !a.g_rows)) return fail(cudaErrorInvalidValue, "g_out, g_rows: expected non-null pointers (g_out 16-byte aligned)");
  if (a.pass == kCpBwdTails && ((a.g_in_rows > 0 && (!a.g_in || a.g_in % 16)) || !a.g_import)) return fail(cudaErrorInvalidValue, "g_in, g_import: expected non-null pointers (g_in 16-byte aligned)");
  for (const auto& [name, ptr] : {std::pair<const char*, int64_t>{"x", a.x}, {"weight", a.weight}, {"halo", a.halo}}) {
    if (!ptr || ptr % 16) return fail(cudaErrorInvalidValue, "%s: expected a non-null 16-byte aligned pointer", name);
  }
  if (detail::kHasBias<BiasT> && (!a.bias || a.bias % 16)) return fail(cudaErrorInvalidValue, "bias: expected a non-null 16-byte aligned pointer");
  if (!a.cu_seqlens || !a.frag_info) return fail(cudaErrorInvalidValue, "cu_seqlens, frag_info: expected non-null pointers");
  CausalConv1dCpParams p{};
  p.x = as_ptr<const __nv_bfloat16>(a.x);
  p.dy = as_ptr<const __nv_bfloat16>(a.dy);
  p.out = as_ptr<__nv_bfloat16>(a.out);
  p.weight = as_ptr<const void>(a.weight);
  p.bias = as_ptr<const void>(a.bias);
  p.cu_seqlens = as_ptr<const int32_t>(a.cu_seqlens);
  p.halo = as_ptr<const __nv_bfloat16>(a.halo);
  p.halo_out = a.pass == kCpFwdHeads ? as_ptr<__nv_bfloat16>(a.halo) : nullptr;
  p.received = as_ptr<const __nv_bfloat16>(a.received);
  p.import_rows = as_ptr<const int32_t>(a.import_rows);
  p.received_ld = a.received_ld;
  p.received_rows = a.received_rows;
  p.frag_info = as_ptr<const int32_t>(a.frag_info);
  p.frags = as_ptr<const int32_t>(a.frags);
  p.g_rows = as_ptr<const int32_t>(a.g_rows);
  p.g_out = as_ptr<float>(a.g_out);
  p.g_in = as_ptr<const float>(a.g_in);
  p.g_import = as_ptr<const int32_t>(a.g_import);
  p.g_ld = a.g_ld;
  p.g_in_rows = a.g_in_rows;
  p.S = static_cast<int32_t>(a.S);
  p.C = static_cast<int32_t>(a.C);
  p.num_frags = static_cast<int32_t>(a.num_frags);
  p.num_items = static_cast<int32_t>(a.pass == kCpBwdHeads ? a.num_items : 3 * a.num_items);
  p.round_preact = static_cast<int32_t>(a.round_preact);
  if (p.num_items == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.num_items),
                  static_cast<unsigned>(ceil_div(a.C / detail::kCpVec, int64_t(detail::kCpThreads))));
  return on_device(static_cast<int>(a.device), [&] {
    cudaStream_t stream = as_ptr<CUstream_st>(a.stream);
    (void)cudaGetLastError();  // clear a stale error of an earlier runtime call on this thread
    // Plain launches, not launch_after_prerequisite: the CP kernels have no griddepcontrol.wait.
    const bool round = p.round_preact != 0;
    switch (static_cast<int>(a.pass)) {
      case kCpFwdHeads:
        causal_conv1d_cp_kernel<WeightT, BiasT, kCpFwdHeads, false><<<grid, detail::kCpThreads, 0, stream>>>(p);
        break;
      case kCpBwdHeads:
        if (round) causal_conv1d_cp_kernel<WeightT, BiasT, kCpBwdHeads, true><<<grid, detail::kCpThreads, 0, stream>>>(p);
        else causal_conv1d_cp_kernel<WeightT, BiasT, kCpBwdHeads, false><<<grid, detail::kCpThreads, 0, stream>>>(p);
        break;
      default:
        if (round) causal_conv1d_cp_kernel<WeightT, BiasT, kCpBwdTails, true><<<grid, detail::kCpThreads, 0, stream>>>(p);
        else causal_conv1d_cp_kernel<WeightT, BiasT, kCpBwdTails, false><<<grid, detail::kCpThreads, 0, stream>>>(p);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fail(e, "context-parallel kernel launch failed: %s", cudaGetErrorString(e));
    return cudaSuccess;
  });
}

}  // namespace flashinfer_cake
