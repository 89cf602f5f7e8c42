// Host helpers shared by the launchers: the error message of the last failed call, argument
// addresses, pointer alignment, launching after the stream's previous grid (programmatic dependent
// launch), and launching on a given device.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>

#include "causal_conv1d_contract.h"

namespace flashinfer_cake {

// Message of the last failed call on this thread ("" after a success).
inline char* last_error_buffer() {
  static thread_local char buffer[512] = "";
  return buffer;
}

template <class... Args>
inline cudaError_t fail(cudaError_t code, const char* fmt, Args... args) {
  if constexpr (sizeof...(Args) == 0) {
    std::snprintf(last_error_buffer(), 512, "%s", fmt);
  } else {
    std::snprintf(last_error_buffer(), 512, fmt, args...);
  }
  return code;
}

// An address field of an argument struct (causal_conv1d_contract.h) as a typed pointer.
template <class T>
T* as_ptr(int64_t address) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(address));
}

inline bool aligned_to(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }
inline bool aligned16(const void* ptr) { return aligned_to(ptr, 16); }

// The row stride of a [S, C] BF16 argument, in elements, into *out: stride for S > 1 (at least C,
// a multiple of 8, S * stride below max_elements), C when S <= 1 (a single row has none).
inline cudaError_t check_row_stride(const char* name, int64_t S, int64_t C, int64_t stride, int64_t max_elements,
                                    int64_t* out) {
  *out = C;
  if (S <= 1) return cudaSuccess;
  if (stride < C || stride % 8 != 0 || stride > (max_elements - 1) / S) {  // S * stride < max_elements
    return fail(cudaErrorInvalidValue, "%s: expected a row stride >= C = %lld, a multiple of 8, with S * stride below 2^%d; got %lld",
                name, (long long)C, 63 - __builtin_clzll(static_cast<unsigned long long>(max_elements)), (long long)stride);
  }
  *out = stride;
  return cudaSuccess;
}

// dst = src (or zeros when src is null): [num_docs, 3, C] BF16 states, on the current device.
inline cudaError_t copy_or_zero_states(void* dst, const void* src, int64_t num_docs, int64_t C, cudaStream_t stream,
                                       const char* name) {
  const size_t bytes = static_cast<size_t>(num_docs) * 3 * C * 2;
  const cudaError_t e = src ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) : cudaMemsetAsync(dst, 0, bytes, stream);
  if (e != cudaSuccess) return fail(e, "writing %s failed: %s", name, cudaGetErrorString(e));
  return cudaSuccess;
}

// kernel<<<grid, threads, smem, stream>>>(args...) with programmatic stream serialization: the
// grid may be scheduled once every CTA of the stream's previous grid has triggered
// (launch_dependents) or ended, so its launch overlaps that grid's last CTAs. Only kernels whose
// first statement is detail::wait_for_prerequisite_grid may be launched so (the forward, the
// backward's stream and reduce kernels; the CP kernels are not). A previous kernel that never
// triggers (torch's, anyone's not built for it) ends before this grid starts, as without the
// attribute; a later kernel launched with the attribute by someone else may start while ours run
// and must wait (griddepcontrol.wait) before reading what ours write.
template <class... Params, class... Args>
cudaError_t launch_after_prerequisite(void (*kernel)(Params...), int64_t grid, int threads, int smem,
                                      cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, args...);
  if (e != cudaSuccess) (void)cudaGetLastError();  // this launch's error: reported by the caller
  return e;
}

// 1 while `stream` captures a CUDA graph (the torch binding then gives the call a workspace of its
// own), 0 when it does not, -1 when the query fails (message in last_error_buffer()).
inline int stream_is_capturing(cudaStream_t stream) {
  last_error_buffer()[0] = '\0';
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e != cudaSuccess) {
    fail(e, "%s", cudaGetErrorString(e));
    return -1;
  }
  return status == cudaStreamCaptureStatusNone ? 0 : 1;
}

// Runs launch() with `device` current, then gives the thread back its current device (the driver
// context is shared with the caller's runtime, torch's included).
template <class Launch>
cudaError_t on_device(int device, Launch&& launch) {
  int previous = -1;
  cudaError_t e = cudaGetDevice(&previous);
  if (e != cudaSuccess) return fail(e, "cudaGetDevice failed: %s", cudaGetErrorString(e));
  if (previous != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return fail(e, "cudaSetDevice(%d) failed: %s", device, cudaGetErrorString(e));
  }
  e = launch();
  if (previous != device) {
    const cudaError_t restore = cudaSetDevice(previous);
    if (e == cudaSuccess && restore != cudaSuccess) {
      return fail(restore, "cudaSetDevice(%d) (restoring the caller's device) failed: %s", previous,
                  cudaGetErrorString(restore));
    }
  }
  return e;
}

}  // namespace flashinfer_cake
