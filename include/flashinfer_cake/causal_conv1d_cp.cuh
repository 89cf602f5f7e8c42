// The context-parallel (CP) passes of the conv (flashinfer_cake/cp.py): the few rows of each
// local fragment whose taps or gradient terms live on other ranks, recomputed with exactly the
// arithmetic of the single-GPU kernels, so a CP run is bitwise the single-GPU run.
//
// A rank holds fragments of documents (its local packed batch: cu_seqlens, one local document per
// fragment). Around the main kernels, which run on the local batch as if each fragment were a
// document:
//   kFwdHeads: the halo of a fragment that continues its document (offset > 0): the 3 rows before
//     it, gathered from the rows received from the ranks that hold them (zeros before the
//     document), and y of its first <= 3 tokens, which read them. The main forward ran without
//     them. The halo rows of the other fragments are not written and their values never used: the
//     main backward skips them (frag_info), kBwdHeads' tokens all have offset > 0, and kBwdTails
//     loads them for short fragments only where the position masks the tap (cp_grad_at: keep
//     those taps conditional).
//   kBwdHeads: g = dy * silu'(a) (FP32) of listed head tokens (position < 3 in their fragment):
//     what the rank holding the 3 tokens before them needs for its dx. Written into one exchange
//     buffer row each (a row of padding: zeros).
//   kBwdTails: dx of the last <= 3 tokens of a fragment whose document continues after it: the
//     single-GPU sum w3 g[s] + w2 g[s + 1] + w1 g[s + 2] + w0 g[s + 3], in that order, its own
//     terms recomputed and the others read from the received head g (as FP32, not a rounded state
//     gradient). The main backward wrote these rows without the later terms.
// A token at fragment position i (document position o + i) reads the taps k with
// min(o + i, 3) >= 3 - k, as the single-GPU kernels do; the FP32 expressions are the kernels'
// (causal_conv1d_fwd.cuh: taps pre-scaled by -log2 e; causal_conv1d_bwd.cuh: unscaled, silu'
// at the optionally BF16-rounded pre-activation).
//
// One thread per (item, 8 channels); items are (listed fragment, row) pairs (kFwdHeads: the
// fragments that continue their documents, kBwdTails: those whose documents go on; the context
// lists them, so the passes launch nothing for the other fragments) or exchange rows. Only x, dy,
// out rows [0, S), the halo, the tables' entries and the exchange rows are addressed.
#pragma once

#include "causal_conv1d_bwd.cuh"
#include "causal_conv1d_common.cuh"
#include "causal_conv1d_contract.h"  // the pass ids and frag_info bits

namespace flashinfer_cake {

struct CausalConv1dCpParams {
  const __nv_bfloat16* x;     // [S, C] contiguous: this rank's tokens
  const __nv_bfloat16* dy;    // [S, C] contiguous (backward passes)
  __nv_bfloat16* out;         // y (kFwdHeads) or dx (kBwdTails): [S, C] contiguous
  const void* weight;         // [C, 4], WeightT
  const void* bias;           // [C], BiasT (unused for NoBias)
  const int32_t* cu_seqlens;  // [num_frags + 1]
  const __nv_bfloat16* halo;  // [num_frags, 3, C]: the 3 rows before each fragment in its document
  __nv_bfloat16* halo_out;    // kFwdHeads: the same, written for the listed fragments
  const __nv_bfloat16* received;  // kFwdHeads: the received halo rows (this item's columns)
  const int32_t* import_rows;     // kFwdHeads: [num_frags * 3] each halo row's received row; other
                                  // values (received_rows: before the document) give zeros
  const int32_t* frag_info;   // [num_frags]
  const int32_t* frags;       // kFwdHeads / kBwdTails: [num_items / 3] the fragments the pass rewrites
  const int32_t* g_rows;      // kBwdHeads: [num_items] 4 * fragment + position (< 3), or -1: padding
  float* g_out;               // kBwdHeads: [num_items] rows, g_ld floats apart
  const float* g_in;          // kBwdTails: the received head g, rows g_ld floats apart
  const int32_t* g_import;    // kBwdTails: [num_frags * 3] row of g_in of the j-th token after the
                              // fragment, -1 when past its document
  int64_t g_ld;
  int64_t g_in_rows;  // rows of g_in (bounds g_import)
  int64_t received_ld, received_rows;  // kFwdHeads: elements between received rows; their count
  int32_t S, C, num_frags, num_items, round_preact;
};

namespace detail {

constexpr int kCpVec = 8;
constexpr int kCpThreads = 128;

// x of fragment position i (>= -3) of fragment f starting at local row `start`, channels of
// vector v: a local row, or one of the fragment's halo rows.
__device__ __forceinline__ void cp_x_row(const CausalConv1dCpParams& p, int f, int start, int i, int v,
                                         float (&out)[kCpVec]) {
  const uint4* src = i >= 0 ? reinterpret_cast<const uint4*>(p.x) + (static_cast<size_t>(start) + i) * (p.C / kCpVec)
                            : reinterpret_cast<const uint4*>(p.halo) + (static_cast<size_t>(f) * 3 + 3 + i) * (p.C / kCpVec);
  bf16x8_to_float(__ldg(src + v), out);
}

// The backward's g at fragment position i, document position min(head + i, 3): the main
// backward's expression (causal_conv1d_bwd.cuh).
template <bool kRoundPreact>
__device__ __forceinline__ void cp_grad_at(const CausalConv1dCpParams& p, int f, int start, int head, int i, int v,
                                           const float (&w)[4][kCpVec], const float (&b)[kCpVec],
                                           float (&g)[kCpVec]) {
  const int pos = min(head + i, 3);
  float xt[kCpVec], x1[kCpVec], x2[kCpVec], x3[kCpVec], dyt[kCpVec], a[kCpVec];
  cp_x_row(p, f, start, i, v, xt);
  cp_x_row(p, f, start, i - 1, v, x1);
  cp_x_row(p, f, start, i - 2, v, x2);
  cp_x_row(p, f, start, i - 3, v, x3);
  bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.dy) + (static_cast<size_t>(start) + i) * (p.C / kCpVec) + v), dyt);
#pragma unroll
  for (int j = 0; j < kCpVec; ++j) {
    a[j] = fmaf(w[3][j], xt[j], b[j]);
    if (pos >= 1) a[j] = fmaf(w[2][j], x1[j], a[j]);
    if (pos >= 2) a[j] = fmaf(w[1][j], x2[j], a[j]);
    if (pos >= 3) a[j] = fmaf(w[0][j], x3[j], a[j]);
  }
  if constexpr (kRoundPreact) {
#pragma unroll
    for (int j = 0; j < kCpVec; j += 2) round_to_bf16(a[j], a[j + 1]);
  }
#pragma unroll
  for (int j = 0; j < kCpVec; ++j) g[j] = dyt[j] * silu_grad(a[j]);
}

}  // namespace detail

template <class WeightT, class BiasT, int kPass, bool kRoundPreact>
__global__ void __launch_bounds__(detail::kCpThreads) causal_conv1d_cp_kernel(const CausalConv1dCpParams p) {
  constexpr int V = detail::kCpVec;
  const int v = blockIdx.y * detail::kCpThreads + threadIdx.x;  // my 8-channel vector
  if (v >= p.C / V) return;
  const int item = blockIdx.x;
  float w[4][V], b[V] = {};
  detail::load_weights<WeightT, V>(p.weight, v * V, w);
  detail::load_bias<BiasT, V>(p.bias, v * V, b);

  if constexpr (kPass == kCpBwdHeads) {
    const int code = p.g_rows[item];
    float g[V] = {};
    if (code >= 0 && (code >> 2) < p.num_frags) {
      const int f = code >> 2, i = code & 3;
      // (0 <= start < end <= S before their difference: any table content stays in int32)
      const int start = p.cu_seqlens[f], end = p.cu_seqlens[f + 1];
      if (i < 3 && start >= 0 && end <= p.S && end > start && i < end - start) {
        detail::cp_grad_at<kRoundPreact>(p, f, start, p.frag_info[f] & kCpHeadMask, i, v, w, b, g);
      }
    }
    float4* dst = reinterpret_cast<float4*>(p.g_out + static_cast<size_t>(item) * p.g_ld) + 2 * v;
    dst[0] = make_float4(g[0], g[1], g[2], g[3]);
    dst[1] = make_float4(g[4], g[5], g[6], g[7]);
    return;
  }

  const int f = p.frags[item / 3], r = item % 3;
  if (f < 0 || f >= p.num_frags) return;
  const int info = p.frag_info[f], head = info & kCpHeadMask;
  const int start = p.cu_seqlens[f], end = p.cu_seqlens[f + 1];
  if (start < 0 || end > p.S || end <= start) return;  // (before the difference: no int32 overflow)
  const int n = end - start;
  uint4* const out = reinterpret_cast<uint4*>(p.out);
  const size_t vecs = p.C / V;

  if constexpr (kPass == kCpFwdHeads) {
    // Halo row j of fragment f, vector v, from the received rows.
    const auto halo_row = [&](int j) {
      const int64_t src = p.import_rows[3 * f + j];
      return src >= 0 && src < p.received_rows
                 ? __ldg(reinterpret_cast<const uint4*>(p.received + src * p.received_ld) + v)
                 : make_uint4(0u, 0u, 0u, 0u);
    };
    reinterpret_cast<uint4*>(p.halo_out)[(static_cast<size_t>(f) * 3 + r) * vecs + v] = halo_row(r);  // its row
    // Head row r of a fragment that continues its document (its taps reach the halo).
    if (head == 0 || r >= n) return;
    const int pos = min(head + r, 3);
    const auto x_at = [&](int i, float(&row)[V]) {  // x at fragment position i >= -3
      if (i >= 0) {
        detail::cp_x_row(p, f, start, i, v, row);
      } else {
        detail::bf16x8_to_float(halo_row(3 + i), row);  // read where it comes from, not the halo
      }                                                 // other items are writing
    };
    float xt[V], x1[V], x2[V], x3[V], ys[V];
    x_at(r, xt);
    x_at(r - 1, x1);
    x_at(r - 2, x2);
    x_at(r - 3, x3);
#pragma unroll
    for (int j = 0; j < V; ++j) {  // the forward's expression: taps and bias pre-scaled by -log2 e
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k][j] *= -detail::kLog2e;
      b[j] *= -detail::kLog2e;
      float s = fmaf(w[3][j], xt[j], b[j]);
      if (pos >= 1) s = fmaf(w[2][j], x1[j], s);
      if (pos >= 2) s = fmaf(w[1][j], x2[j], s);
      if (pos >= 3) s = fmaf(w[0][j], x3[j], s);
      ys[j] = detail::silu_of_scaled(s);
    }
    out[(static_cast<size_t>(start) + r) * vecs + v] = detail::pack_row<V>(ys);
  } else {
    // Tail row: token s at end distance k = r + 1, fragment position i = n - k.
    const int k = r + 1, i = n - k;
    if (!(info & kCpContinues) || k > n) return;
    float gm[3][V];  // g of the fragment's tokens i .. n - 1 (k of them)
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      if (m < k) detail::cp_grad_at<kRoundPreact>(p, f, start, head, i + m, v, w, b, gm[m]);
    }
    float d[V];
#pragma unroll
    for (int j = 0; j < V; ++j) d[j] = w[3][j] * gm[0][j];
#pragma unroll
    for (int m = 1; m < 4; ++m) {  // the term of token s + m: own (m < k) or received
      if (m < k) {
#pragma unroll
        for (int j = 0; j < V; ++j) d[j] = fmaf(w[3 - m][j], gm[m][j], d[j]);
      } else {
        const int row = p.g_import[3 * f + m - k];
        if (row < 0 || row >= p.g_in_rows) continue;  // past the document: no term
        const float4* src = reinterpret_cast<const float4*>(p.g_in + static_cast<size_t>(row) * p.g_ld) + 2 * v;
        const float4 lo = __ldcg(src), hi = __ldcg(src + 1);
        const float gr[V] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < V; ++j) d[j] = fmaf(w[3 - m][j], gr[j], d[j]);
      }
    }
    out[(static_cast<size_t>(start) + i) * vecs + v] = detail::pack_row<V>(d);
  }
}

}  // namespace flashinfer_cake
