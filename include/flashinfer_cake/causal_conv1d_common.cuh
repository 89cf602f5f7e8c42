// Device helpers shared by the forward and backward kernels: BF16 packing, cp.async, loading
// taps and bias as FP32, row vectors of 4 or 8 channels, the document-position search, and the
// programmatic-dependent-launch wait and trigger.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstddef>
#include <type_traits>

#include "causal_conv1d_contract.h"  // kCpHeadMask (scan_documents' frag_info)

namespace flashinfer_cake {

struct NoBias {};  // the bias type of the variants without a bias

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

constexpr float kLog2e = 1.4426950408889634f;

// Alignment of both kernels' row rings in shared memory. With 16, the stateful kernels' rings sat
// 16 bytes past a 128-byte boundary (scan_documents' shared variables come first) and the stateful
// forward read 1.84x the L2 sectors of the same kernel on scan_positions (ncu). Aligned to 128 it
// went from 1.10x to 1.035x the stateless time at 8192x4096 and from 1.08x to 1.01x at 16384x8192
// with 1 document, and took 1.7-2.8 % less time with 512-7280 documents; the backward measured the
// same either way, within 1.5 % (tune.py A/B, H200, 2026-12-01).
constexpr int kRingAlign = 128;

// The taps and bias are pre-scaled by -log2(e), so the FP32 accumulator holds u = -a log2(e) for
// the pre-activation a. Then silu(a) = a / (1 + 2^u) = u / (-(1 + 2^u) log2(e)): one ex2, one
// FMA, one rcp, one multiply. ex2/rcp are the hardware approximations (relative error about
// 2^-22 each, far below the BF16 rounding of the result), written as PTX so the output does not
// depend on compiler flags such as --use_fast_math. Saturation: 2^u = +inf gives -0 (a -> -inf),
// 2^u = 0 gives a.
__device__ __forceinline__ float silu_of_scaled(float u) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u));
  // .ftz: for pre-activations in (-88.7, -87.3) the reciprocal is subnormal and flushes, giving
  // -0 where plain FP32 math gives about -1e-36 (absolute difference < 1e-35); the non-ftz
  // variant costs a register.
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(e, -kLog2e, -kLog2e)));
  return u * r;
}

// A shared-memory pointer's 32-bit shared-window address.
__device__ __forceinline__ uint32_t smem_addr(const void* smem) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}

// 16-byte global -> shared copy that bypasses L1; valid == false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(smem_addr(smem), gmem, valid);
}

// A 16-byte row from a shared-window address (volatile: stays after the cp.async wait before it).
__device__ __forceinline__ uint4 ld_shared_row(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most kPending of this thread's most recent groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void bf16x4_to_float(const uint2& v, float (&f)[4]) {
  f[0] = __uint_as_float(v.x << 16);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
}

// A read-only 16- or 8-byte vector: through the non-coherent cache from global memory, or a plain
// load from shared memory.
template <bool kShared, class U>
__device__ __forceinline__ U ld_vec(const U* p) {
  if constexpr (kShared) {
    return *p;
  } else {
    return __ldg(p);
  }
}

// Taps of V channels c0 .. c0 + V - 1 (V = 4 or 8, c0 a multiple of V): w[k][j] multiplies
// x[t - 3 + k] of channel c0 + j. 16-byte loads: FP32 one channel each, BF16 two channels each.
// kShared: weight points to a shared-memory copy (see stage_params), else to global memory.
template <class WeightT, int V, bool kShared = false>
__device__ __forceinline__ void load_weights(const void* weight, int c0, float (&w)[4][V]) {
  if constexpr (std::is_same<WeightT, float>::value) {
    const float4* p = reinterpret_cast<const float4*>(weight) + c0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4 v = ld_vec<kShared>(p + j);
      w[0][j] = v.x;
      w[1][j] = v.y;
      w[2][j] = v.z;
      w[3][j] = v.w;
    }
  } else {
    static_assert(std::is_same<WeightT, __nv_bfloat16>::value, "taps are FP32 or BF16");
    const uint4* p = reinterpret_cast<const uint4*>(weight) + c0 / 2;
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      const uint4 v = ld_vec<kShared>(p + j);
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
}

template <class BiasT>
constexpr bool kHasBias = !std::is_same<BiasT, NoBias>::value;

// Bias of V channels c0 .. c0 + V - 1 (V = 4 or 8); nothing for NoBias. kShared as for the taps.
template <class BiasT, int V, bool kShared = false>
__device__ __forceinline__ void load_bias(const void* bias, int c0, float (&b)[V]) {
  if constexpr (std::is_same<BiasT, float>::value) {
    const float4* p = reinterpret_cast<const float4*>(bias) + c0 / 4;
#pragma unroll
    for (int h = 0; h < V / 4; ++h) {
      const float4 v = ld_vec<kShared>(p + h);
      b[4 * h] = v.x;
      b[4 * h + 1] = v.y;
      b[4 * h + 2] = v.z;
      b[4 * h + 3] = v.w;
    }
  } else if constexpr (std::is_same<BiasT, __nv_bfloat16>::value) {
    if constexpr (V == 8) {
      bf16x8_to_float(ld_vec<kShared>(reinterpret_cast<const uint4*>(bias) + c0 / 8), b);
    } else {
      bf16x4_to_float(ld_vec<kShared>(reinterpret_cast<const uint2*>(bias) + c0 / 4), b);
    }
  }
}

// Bytes of one channel's taps and bias.
template <class WeightT>
constexpr int kTapBytes = 4 * static_cast<int>(sizeof(WeightT));
template <class BiasT>
constexpr int kBiasBytes = kHasBias<BiasT> ? static_cast<int>(sizeof(BiasT)) : 0;

// Shared-memory copies of a CTA's taps and bias, one block of 16-byte chunks per thread (its V
// channels), blocks padded by one chunk when they hold 2 or more: an odd block stride, so the
// 16-byte reads of 8 neighbouring threads hit 8 different bank groups (no conflicts).
template <int kBytesPerThread>
struct ParamBlocks {
  static_assert(kBytesPerThread % 16 == 0, "whole 16-byte chunks per thread");
  static constexpr int kChunks = kBytesPerThread / 16;
  static constexpr int kStride = kChunks >= 2 ? kChunks + 1 : kChunks;  // chunks
  __device__ __forceinline__ static int dst(int chunk) { return chunk / kChunks * kStride + chunk % kChunks; }
};

// Copies the taps, then the bias, of channels [c0, c0 + count) (count a multiple of 8) into the
// ParamBlocks layout (V channels per block) with 16-byte cp.async spread over the kThreads
// threads (not committed): one coalesced read per CTA instead of one strided read per strip.
template <class WeightT, class BiasT, int V, int kThreads>
__device__ __forceinline__ void stage_params(const void* weight, const void* bias, int64_t c0, int count,
                                             uint8_t* s_w, uint8_t* s_b) {
  using WB = ParamBlocks<V * kTapBytes<WeightT>>;
  const int w_chunks = count * kTapBytes<WeightT> / 16;
  const auto* wg = static_cast<const uint8_t*>(weight) + c0 * kTapBytes<WeightT>;
  for (int i = threadIdx.x; i < w_chunks; i += kThreads) cp_async_16(s_w + 16 * WB::dst(i), wg + 16 * i, true);
  if constexpr (kHasBias<BiasT>) {
    using BB = ParamBlocks<V * kBiasBytes<BiasT>>;
    const int b_chunks = count * kBiasBytes<BiasT> / 16;
    const auto* bg = static_cast<const uint8_t*>(bias) + c0 * kBiasBytes<BiasT>;
    for (int i = threadIdx.x; i < b_chunks; i += kThreads) cp_async_16(s_b + 16 * BB::dst(i), bg + 16 * i, true);
  }
}

// A row vector of V BF16 channels: 8 or 16 bytes.
template <int V>
using Row = std::conditional_t<V == 8, uint4, uint2>;

// 8-byte global -> shared copy (through L1: .cg takes 16 bytes only); valid == false writes
// zeros and reads nothing.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 8 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_row(uint2* smem, const uint2* gmem, bool valid) { cp_async_8(smem, gmem, valid); }
__device__ __forceinline__ void cp_async_row(uint4* smem, const uint4* gmem, bool valid) { cp_async_16(smem, gmem, valid); }
__device__ __forceinline__ void row_to_float(const uint2& v, float (&f)[4]) { bf16x4_to_float(v, f); }
__device__ __forceinline__ void row_to_float(const uint4& v, float (&f)[8]) { bf16x8_to_float(v, f); }

template <int V>
__device__ __forceinline__ Row<V> pack_row(const float (&d)[V]) {
  if constexpr (V == 8) {
    return make_uint4(pack_bf16x2_rn(d[0], d[1]), pack_bf16x2_rn(d[2], d[3]), pack_bf16x2_rn(d[4], d[5]),
                      pack_bf16x2_rn(d[6], d[7]));
  } else {
    return make_uint2(pack_bf16x2_rn(d[0], d[1]), pack_bf16x2_rn(d[2], d[3]));
  }
}

// Runs step(r, events) with events a std::true_type or std::false_type: the one step_events gave
// (one body for every step), or the one its bool chose (each step branches to one of two bodies).
template <class StepFn, class E>
__device__ __forceinline__ void run_step(StepFn&& step, int r, E events) {
  static_assert(std::is_same_v<E, bool> || std::is_same_v<E, std::true_type> || std::is_same_v<E, std::false_type>,
                "step_events returns bool, std::true_type or std::false_type");
  if constexpr (std::is_same_v<E, bool>) {
    if (events) {
      step(r, std::true_type{});
    } else {
      step(r, std::false_type{});
    }
  } else {
    step(r, events);
  }
}

// The strip loop of both kernels: row(r, phase, events) for r = 0 .. kRows - 1, phase = r % 4 as
// a compile-time constant (std::integral_constant), rolled in steps of 4 rows; after each step the
// ring slots of the 4-row windows advance (prev takes cur, cur moves 4 slots on, wrapping at
// kRing). The last kRows % 4 rows are peeled, so no row in the loop is conditional. events is a
// std::true_type or std::false_type for the whole step, from step_events(r) at its first row r
// (run_step).
template <int kRows, int kRing, class RowFn, class StepEventsFn>
__device__ __forceinline__ void walk_rows(RowFn&& row, int& cur, int& prev, StepEventsFn&& step_events) {
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  using P2 = std::integral_constant<int, 2>;
  using P3 = std::integral_constant<int, 3>;
  constexpr int kFull = kRows / 4 * 4;
  const auto whole = [&](int r, auto events) {
    row(r, P0{}, events);
    row(r + 1, P1{}, events);
    row(r + 2, P2{}, events);
    row(r + 3, P3{}, events);
  };
  const auto peeled = [&](int, auto events) {
    if constexpr (kFull < kRows) row(kFull, P0{}, events);
    if constexpr (kFull + 1 < kRows) row(kFull + 1, P1{}, events);
    if constexpr (kFull + 2 < kRows) row(kFull + 2, P2{}, events);
  };
#pragma unroll 1
  for (int r = 0; r < kFull; r += 4) {
    run_step(whole, r, step_events(r));
    prev = cur;
    cur = cur + 4 == kRing ? 0 : cur + 4;
  }
  if constexpr (kFull < kRows) run_step(peeled, kFull, step_events(kFull));
}

// Whether a row or step_events call came from a whole step of walk_rows_n (its one extra argument's
// type; walk_rows passes none).
template <class... Kind>
inline constexpr bool kIsWholeStep = sizeof...(Kind) == 1 && (Kind::value && ...);

// walk_rows of full + 3 rows, full (a multiple of 4) known at run time: the backward's walks of
// several pieces. row and step_events also take whether the step is a whole one (rows r .. r + 3, all
// below full) or the peeled last one, which a run-time full no longer tells the compiler.
template <int kRing, class RowFn, class StepEventsFn>
__device__ __forceinline__ void walk_rows_n(int full, RowFn&& row, int& cur, int& prev, StepEventsFn&& step_events) {
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  using P2 = std::integral_constant<int, 2>;
  using P3 = std::integral_constant<int, 3>;
  using Whole = std::true_type;
  using Peeled = std::false_type;
  const auto whole = [&](int r, auto events) {
    row(r, P0{}, events, Whole{});
    row(r + 1, P1{}, events, Whole{});
    row(r + 2, P2{}, events, Whole{});
    row(r + 3, P3{}, events, Whole{});
  };
  const auto peeled = [&](int r, auto events) {
    row(r, P0{}, events, Peeled{});
    row(r + 1, P1{}, events, Peeled{});
    row(r + 2, P2{}, events, Peeled{});
  };
#pragma unroll 1
  for (int r = 0; r < full; r += 4) {
    run_step(whole, r, step_events(r, Whole{}));
    prev = cur;
    cur = cur + 4 == kRing ? 0 : cur + 4;
  }
  run_step(peeled, full, step_events(full, Peeled{}));
}

// The first entry >= first among cu_seqlens[0 .. num_docs], num_docs + 1 when none (for sorted
// content; for any content a value in [0, num_docs + 1]; kCoarse: an entry at most kThreads before
// it), by the whole CTA: kThreads pivots per round, every thread must call it (it contains barriers).
// first_round: this thread's entry of the first round (load_first_round), or null to load it here.
// kCoarse: stops once at most kThreads candidates are left, a dependent load and a barrier fewer from
// kThreads entries on (lo is then an entry index with every entry before it below first, for sorted
// content, not necessarily the first entry >= first: a pass over the entries from there, as
// scan_documents', covers them).
template <int kThreads, bool kCoarse = false>
__device__ __forceinline__ int64_t search_first_entry(const int32_t* __restrict__ cu, int num_docs, int first,
                                                      const int32_t* first_round = nullptr) {
  int64_t lo = 0, hi = int64_t(num_docs) + 1;
  // At least one round, so at least one barrier, even coarse with few entries: callers order what
  // they write before the search (scan_documents' scratch) before what they read after it.
  do {  // uniform: lo and hi come from barrier counts
    const int64_t step = (hi - lo + kThreads - 1) / kThreads;
    const int64_t pivot = lo + threadIdx.x * step;
    const bool below = pivot < hi && (first_round && lo == 0 ? *first_round : __ldg(cu + pivot)) < first;
    const int c = __syncthreads_count(below);
    if (c == 0) break;  // cu[lo] >= first
    lo += (c - 1) * step + 1;
    hi = min(hi, lo - 1 + step);  // the next pivot, >= first (or past the candidates)
  } while (hi - lo > (kCoarse ? kThreads : 0));
  return lo;
}

// This thread's pivot of search_first_entry's first round (lo = 0: entry threadIdx.x * ceil((num_docs
// + 1) / kThreads)), loaded on its own: a kernel loads it before it prefetches its first rows, so
// that the position scan's first load does not wait behind them (a probe without the scan ran
// 0.3-1 us faster per call at 4-8 M elements; H200, NOTES_fwd / NOTES_bwd session 29).
template <int kThreads>
__device__ __forceinline__ int32_t load_first_round(const int32_t* __restrict__ cu, int num_docs) {
  const int64_t step = (int64_t(num_docs) + kThreads) / kThreads;
  const int64_t pivot = threadIdx.x * step;
  return pivot <= num_docs ? __ldg(cu + pivot) : 0;
}

// Positions of tokens first_token + j, j = 0 .. count - 1, into out[j], by the whole CTA
// (kThreads threads; every thread must call it, it contains barriers). Token t's position is
// min(t - start, 3) for the nearest document start <= t, so only starts in [first_token - 2,
// first_token + count) matter: a CTA-wide search finds the first cu_seqlens entry >= first_token
// - 2 (kThreads pivots per round, so ceil(log_kThreads(num_docs + 1)) dependent loads: 2 up to
// 16K documents at 128 threads), then the entries from there on mark the starts they hold in
// flags[0 .. count + 2) (flags[i]: a start at first_token - 2 + i), kThreads entries per pass,
// until an entry >= first_token + count (one more dependent load; more passes only when more
// than kThreads entries fall in the range, e.g. runs of empty documents: the scan costs one
// barrier round per kThreads entries, so out-of-order content can make a CTA walk all of
// cu_seqlens). A token's position is then its distance to the nearest flag at or before it, 3
// when there is none within 2.
//
// For non-decreasing content (values anywhere, even outside [0, S]) that is min(t - e, 3) for
// the last entry e <= t, and 0 when no entry is <= t: a binary search's answer. For content out
// of order the rounds still read only cu_seqlens[0 .. num_docs], write only flags[0 .. count +
// 2) and out[0 .. count), end (a round shrinks the candidates, a pass moves forward), and the
// positions (in [0, 3]) depend on the content only (every flag write is the same 1), so a call
// is deterministic.
// first_round: this thread's load_first_round; entries: kThreads ints of shared memory, which
// keep the first round's entries (every entry when num_docs < kThreads: the passes then load
// none, and the scan's only loads are the first round's).
template <int kThreads>
__device__ __forceinline__ void scan_positions(const int32_t* __restrict__ cu, int num_docs, int first_token,
                                               int count, uint8_t* flags, uint8_t* out, int32_t first_round,
                                               int32_t* entries) {
  const int first = first_token - 2;  // >= -2
  const int end = first_token + count;
  for (int i = threadIdx.x; i < count + 2; i += kThreads) flags[i] = 0;  // ordered by the first round's barrier
  entries[threadIdx.x] = first_round;  // likewise; entries[0] is cu[0] (thread 0's pivot is entry 0)
  const int64_t lo = search_first_entry<kThreads>(cu, num_docs, first, &first_round);
  const bool all_read = num_docs < kThreads;  // the first round read entries 0 .. num_docs
  for (int64_t d0 = lo;; d0 += kThreads) {  // passes over the entries from lo until one >= end
    const int64_t d = d0 + threadIdx.x;
    const bool in = d <= num_docs;
    const int v = in ? (all_read ? entries[d] : __ldg(cu + d)) : end;
    if (v >= first && v < end) flags[v - first] = 1;
    if (!__syncthreads_or(threadIdx.x == kThreads - 1 && v < end)) break;
  }
  // Tokens before every entry (lo == 0: cu[0] >= first; content with cu[0] > 0) have no start
  // at or before them: no history, as a binary search that finds none gives.
  const int64_t none_below = lo == 0 ? int64_t(entries[0]) : int64_t(INT32_MIN);
  for (int j = threadIdx.x; j < count; j += kThreads) {  // flags[j + 2] is token first_token + j
    out[j] = first_token + j < none_below ? 0 : flags[j + 2] ? 0 : flags[j + 1] ? 1 : flags[j] ? 2 : 3;
  }
}

// The token codes of scan_documents: bits 0-1 the position (as scan_positions gives it), bits 2-3
// the distance k = 1..3 to the next entry of cu_seqlens (0: none within 3 tokens), kInDoc when the
// token's document index is a document (0 <= d < num_docs) with states (see frag_info there).
constexpr int kPosMask = 3;
constexpr int kEndShift = 2;
constexpr int kInDoc = 16;

// Conv states [num_docs][3] rows of C channels: row i of document d starts (3 d + i) C / V
// vectors in.
__device__ __forceinline__ size_t state_row_offset(int d, int i, uint32_t vecs_per_row) {
  return (static_cast<size_t>(d) * 3 + i) * vecs_per_row;
}

// An empty document's state row i, vector column v, passed through (scan_documents' on_empty): the
// forward's final row is its initial row, the backward's dinitial row its dfinal row; zeros without
// src, nothing unless given (dst is) or past C. given, not a test of dst: the backward tests
// initial_states, which is given exactly when dinitial_states is, and a test of dinitial_states there
// spilled 4 bytes in 16 stateful backward kernels (ptxas, nvcc 13.0, at their 128-register bound).
template <class RowT>
__device__ __forceinline__ void empty_document_state_row(bool given, const RowT* src, RowT* dst, int d, int i, int v,
                                                         uint32_t vecs_per_row) {
  if (given && static_cast<uint32_t>(v) < vecs_per_row) {
    dst[state_row_offset(d, i, vecs_per_row) + v] = src ? __ldg(src + state_row_offset(d, i, vecs_per_row) + v) : RowT{};
  }
}

// Document d's initial rows (vector column vec) prefetched into L2, so the load of them at the
// document's first token waits on L2, not DRAM; nothing for a d outside [0, num_docs).
template <class RowT>
__device__ __forceinline__ void prefetch_initial_rows(const RowT* init_v, int d, int num_docs, uint32_t vecs_per_row,
                                                      int vec) {
  if (static_cast<unsigned>(d) < static_cast<unsigned>(num_docs)) {
    const RowT* row = init_v + state_row_offset(d, 0, vecs_per_row) + vec;
#pragma unroll
    for (int i = 0; i < 3; ++i) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + i * vecs_per_row));
  }
}

// An output row (y, dx) this call never reads back, stored with the streaming hint (st.global.cs: evict
// first from L2) or plainly. H100, NOTES_fwd / NOTES_bwd session 73: in the forward the strips' halo re-reads
// become L2 hits (ncu) and 0.6-1.2 % comes off; the backward gains 1.1-1.9 % at 64 M elements in consecutive
// calls but loses 0.35-0.64 % at 512 M, and profiled alone does not change (cause not found). The CP fix-up
// kernel's rows stay plain stores.
template <bool kStreaming, class T>
__device__ __forceinline__ void store_out_row(T* p, const T& v) {
  if constexpr (kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// A window slot (a row a few tokens back, kept in registers) as read (BF16: the stateful forward's,
// half the registers) or as FP32 (the others': fewer instructions); the same values either way.
template <int V>
__device__ __forceinline__ void set_window_row(Row<V>& slot, const Row<V>& r) { slot = r; }
template <int V>
__device__ __forceinline__ void set_window_row(float (&slot)[V], const Row<V>& r) { row_to_float(r, slot); }
template <int V>
__device__ __forceinline__ void window_to_float(const Row<V>& slot, float (&f)[V]) { row_to_float(slot, f); }
template <int V>
__device__ __forceinline__ void window_to_float(const float (&slot)[V], float (&f)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = slot[j];
}

// A strip whose first token (code: its scan_documents code, *doc: its document) is 1 or 2 tokens
// into a document with an initial state (given when `given`): the window rows before the document
// (xm[1], xm[2]: 3 and 2 tokens back) are the state's last rows, for vector column vec. The forward
// and the backward start their strips with it.
template <int V, class Slot>
__device__ __forceinline__ void strip_start_state_rows(int code, bool given, const int32_t* doc,
                                                       const Row<V>* __restrict__ init_v, uint32_t vecs_per_row,
                                                       int vec, Slot (&xm)[4]) {
  const int p0 = code & kPosMask;
  if (given && (code & kInDoc) && (p0 == 1 || p0 == 2)) {
    const size_t off = state_row_offset(*doc, 0, vecs_per_row) + vec;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (i < 3 - p0) set_window_row<V>(xm[i + 1], __ldg(init_v + off + (i + p0) * vecs_per_row));
    }
  }
}

// scan_positions plus what the per-document conv states need, for tokens first_token + j, j = 0 ..
// count - 1 (every thread must call it; it contains barriers): code[j] (above) and doc[j], the
// token's document when the token is less than 3 tokens into it (the last entry equal to its
// start: empty documents there come before it) or among its last 3 tokens (the first entry equal
// to its end, minus one); -1 when neither (no state row involves the token). For non-decreasing
// content both are the d with cu[d] <= t < cu[d + 1]; for other content a token less than 3 into
// its document counts the next entry as its end only when it is entry d + 1, so each state row has
// one writer. Unless blocks is nullptr, blocks[b] (b <= ceil(count / kBlock)) is 1 when a token of
// block b (tokens b kBlock .. (b + 1) kBlock - 1) has kInDoc: the forward's strip of a block without
// one runs the stateless walk, and so does every strip of the backward's item with kItemChoice (one
// block as long as the scan). Unless frag_info is nullptr (the
// context-parallel backward: documents are fragments, their initial states the halo), a token of a
// fragment whose frag_info offset bits are 0 has no kInDoc: it starts its document, so the
// stateless walk computes what the stateful one would with a zero halo, for finite values (up to
// the sign of a zero; an infinite dy or tap no longer meets a 0 * inf), and no state row is read
// or written for it (its halo rows may hold anything; an empty fragment's dinit rows are still
// zeroed, on_empty).
//
// first_round / entries (both or neither; every caller passes both: dropping the null paths spilled 4 bytes in
// 16 stateful backward kernels, ptxas, nvcc 13.0): as scan_positions', this thread's load_first_round and
// kThreads ints of shared memory (a pointer, not a value: a value's address put 8 bytes of stack into every
// stateful kernel); the search's first round then takes its entries from that early load, and
// with num_docs < kThreads the passes read every entry (and empty documents' ends) from shared memory, so a
// few-document scan's only load of cu_seqlens is the one issued before the rows (every caller's).
//
// Returns whether the passes recorded an entry in [first_token - 2, first_token + count + 2] (for
// content in order: whether one lies there): when none did, no token has kInDoc or an end
// distance, and the codes are the positions alone (written without the per-token search: a tile
// far from every document boundary, most tiles of long documents).
//
// Empty documents (cu[d] == cu[d + 1] == v, d < num_docs) that this CTA owns (first_token <= v <
// own_end, or v == S == own_end: the last tile owns those at the end of the batch, e.g. a
// cu_seqlens padded to a fixed length) have no token: the whole CTA runs on_empty(d, row, vec) for
// rows 0..2 and vectors 0 .. kTileVecs - 1 of each, a pass of entries at a time. Documents with
// entries out of [0, S] or out of order are not owned (their states stay unwritten), but every read
// and write stays in cu_seqlens[0 .. num_docs], entries[0 .. kThreads) and the scratch: first_idx / last_idx, int32 [count
// + 5] each (the least / greatest entry index of each value first_token - 2 .. first_token + count
// + 2).
// kShortScan: with kThreads documents or more, two dependent loads of cu_seqlens fewer for a few
// registers: the search stops coarse (search_first_entry's kCoarse) and an entry's successor, for the
// empty-document test, comes from the next lane (with fewer documents the entries are in shared memory
// and the search takes one round either way). The forward strip kernel takes it (with 1 024 to 14 564 documents 0.4-1.2 % faster at 64 M, H200, r274); in
// the backward's stateful kernels it spilled.
template <int kThreads, int kBlock, int kTileVecs, bool kShortScan = false, class Blocks, class OnEmpty>
__device__ __forceinline__ bool scan_documents(const int32_t* __restrict__ cu, int num_docs, int S, int first_token,
                                               int count, int own_end, int32_t* first_idx, int32_t* last_idx,
                                               uint8_t* code, int32_t* doc, Blocks blocks,
                                               const int32_t* __restrict__ frag_info, OnEmpty&& on_empty,
                                               const int32_t* first_round = nullptr, int32_t* entries = nullptr) {
  constexpr bool kBlocks = !std::is_same_v<Blocks, std::nullptr_t>;
  static_assert(kBlocks ? std::is_same_v<Blocks, uint8_t*> : true, "blocks: uint8_t* or nullptr");
  __shared__ int32_t s_empty[kThreads];  // per thread: the owned empty document its entry starts, or -1
  __shared__ bool s_more[2];             // whether another pass follows, by pass parity
  __shared__ bool s_hit;                 // whether an entry fell in [first, last]
  const int first = first_token - 2;  // >= -2
  // The greatest value the scratch holds, first_token + count + 2, in int32 (the forward's last
  // tile at S = 2^31 - 1 would pass 2^31 - 1: no entry can).
  const int last = static_cast<int>(min(int64_t(first_token) + count + 2, int64_t(INT32_MAX)));
  for (int i = threadIdx.x; i < count + 5; i += kThreads) {  // ordered by the search's barriers
    first_idx[i] = INT32_MAX;
    last_idx[i] = -1;
  }
  if constexpr (kBlocks) {
    for (int i = threadIdx.x; i <= (count + kBlock - 1) / kBlock; i += kThreads) blocks[i] = 0;
  }
  // Ordered by the search's barriers, as the scratch (its loop runs at least once: num_docs >= 0).
  if (threadIdx.x == 0) s_hit = false;
  if (entries) entries[threadIdx.x] = *first_round;  // likewise; entries[0] is cu[0]
  const bool all_read = entries && num_docs < kThreads;  // the first round read entries 0 .. num_docs
  const int64_t lo = search_first_entry<kThreads, kShortScan>(cu, num_docs, first, first_round);
  // Passes over the entries from lo until one > last, one barrier each (two with empty documents).
  // s_more alternates so that a pass's flag is never rewritten before every thread has read it
  // (the next pass's barrier separates them).
  for (int pass = 0;; ++pass) {
    const int64_t d = lo + int64_t(pass) * kThreads + threadIdx.x;
    const bool in = d <= num_docs;
    const int v = in ? (all_read ? entries[d] : __ldg(cu + d)) : 0;
    // kShortScan: cu[d + 1] is the next lane's v (read whenever d < num_docs): no load of it but in
    // a warp's last lane. Every thread runs every pass (the loop's exit is a barrier's flag).
    [[maybe_unused]] int v_next = 0;
    if constexpr (kShortScan) v_next = __shfl_down_sync(0xffffffffu, v, 1);
    const bool loads_next = !kShortScan || (threadIdx.x & 31) == 31;  // reads cu[d + 1] itself
    bool empty = false;
    if (in && v >= first && v <= last) {
      s_hit = true;  // every write the same true, read after the passes' barriers
      atomicMin(first_idx + (v - first), static_cast<int32_t>(d));
      atomicMax(last_idx + (v - first), static_cast<int32_t>(d));
      const bool owned = (v >= first_token && v < own_end) || (v == S && own_end == S);
      empty = owned && d < num_docs && (!loads_next ? v_next : all_read ? entries[d + 1] : __ldg(cu + d + 1)) == v;
    }
    s_empty[threadIdx.x] = empty ? static_cast<int32_t>(d) : -1;
    if (threadIdx.x == kThreads - 1) s_more[pass & 1] = in && v <= last;
    if (__syncthreads_count(empty)) {  // rare: the whole CTA writes their states
      for (int e = threadIdx.x; e < kThreads * 3 * kTileVecs; e += kThreads) {
        const int de = s_empty[e / (3 * kTileVecs)];
        if (de >= 0) on_empty(de, e / kTileVecs % 3, e % kTileVecs);
      }
      __syncthreads();  // s_empty is read before the next pass rewrites it
    }
    if (!s_more[pass & 1]) break;
  }
  const int64_t none_below = lo == 0 ? int64_t(entries ? entries[0] : __ldg(cu)) : int64_t(INT32_MIN);
  if (!s_hit) {  // the scratch untouched: what the loop below gives for it (keep the two in step)
    for (int j = threadIdx.x; j < count; j += kThreads) {
      code[j] = first_token + j < none_below ? 0 : 3;
      doc[j] = -1;
    }
    return false;
  }
  for (int j = threadIdx.x; j < count; j += kThreads) {  // slot j + 2 is token first_token + j
    int pos = 3, d = -1;
    if (first_token + j < none_below) {
      pos = 0;  // before every entry: no history, no document
    } else if (last_idx[j + 2] >= 0) {
      pos = 0, d = last_idx[j + 2];
    } else if (last_idx[j + 1] >= 0) {
      pos = 1, d = last_idx[j + 1];
    } else if (last_idx[j] >= 0) {
      pos = 2, d = last_idx[j];
    }
    int k = first_idx[j + 3] != INT32_MAX ? 1 : first_idx[j + 4] != INT32_MAX ? 2 : first_idx[j + 5] != INT32_MAX ? 3 : 0;
    if (pos == 3 && k) {
      d = first_idx[j + 2 + k] - 1;
    } else if (k && first_idx[j + 2 + k] - 1 != d) {
      k = 0;  // out-of-order content: that entry does not end document d
    }
    const bool in_doc = d >= 0 && d < num_docs && (!frag_info || (__ldg(frag_info + d) & kCpHeadMask) != 0);
    code[j] = static_cast<uint8_t>(pos | k << kEndShift | (in_doc ? kInDoc : 0));
    doc[j] = in_doc ? d : -1;
    if constexpr (kBlocks) {
      if (in_doc) blocks[j / kBlock] = 1;  // every write the same 1
    }
  }
  return true;
}

// Programmatic dependent launch (sm_90 and later; the modules are built for sm_90a): a grid launched
// after this one with the programmatic-serialization attribute (launch_after_prerequisite) may
// start once every CTA of this grid has run this or ended.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Waits until the grid this one was launched after has ended and its writes are visible (a no-op
// without the attribute: stream order already guarantees it).
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace detail

}  // namespace flashinfer_cake
