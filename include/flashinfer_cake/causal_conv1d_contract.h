// The contract of the kernel modules' C entries, in one place: the index ranges the kernels
// accept, the forward's workspace size, and the argument struct of each entry. Plain C++ (no
// CUDA, no torch): the launchers, the generated module source and the torch binding include it.
// The Python layer mirrors the numbers (flashinfer_cake/_checks.py) and reads the argument names
// from the loaded module (cake_arg_names); tests/test_contract.py compiles this header and fails
// when the Python side drifts from it.
#pragma once

#include <stdint.h>

namespace flashinfer_cake {

// Device indices the C entries and the binding accept.
constexpr int64_t kMaxDevices = 64;

// Index ranges (exclusive bounds). The forward addresses 16-byte vectors of 8 channels with 32-bit
// offsets (S * row stride / 8 < 2^32, the row stride C for a contiguous tensor); the backward
// 8-byte vectors of 4 channels (S * row stride / 4 < 2^32) and keeps the token indices of a token
// group, its sub-tiles and their 3-token lookahead in int32. The same bounds hold for S * C and for
// S times each row stride.
constexpr int64_t kFwdMaxS = int64_t(1) << 31;
constexpr int64_t kFwdMaxElements = int64_t(1) << 35;
constexpr int64_t kBwdMaxS = int64_t(1) << 30;
constexpr int64_t kBwdMaxElements = int64_t(1) << 34;
// Both kernels keep C (C / 8 vectors per row) and the entries of cu_seqlens in int32.
constexpr int64_t kMaxC = int64_t(1) << 28;
constexpr int64_t kMaxCuSeqlens = (int64_t(1) << 31) - 1;  // inclusive: num_docs + 1 entries at most

// The forward's workspace: int32 token-chunk counters for routes with a persistent grid (zero on
// entry, left zero). No route of today reads or writes them (the kernels are not given them), so
// kFwdRoutesUseCounters is false and the binding leaves a default workspace made while a stream
// captures a CUDA graph unfilled: a zero fill there is a kernel in every replay (H200, a graph of
// forwards at 1024x4096: 7.14 us per call with workspace=, 8.33 with a filled default). A route
// given the counters (a CausalConv1dFwdParams field) sets it true.
constexpr int64_t kFwdWorkspaceCounters = 2;
constexpr bool kFwdRoutesUseCounters = false;

// The context-parallel passes (causal_conv1d_cp.cuh; flashinfer_cake/cp): the pass argument, and
// the bits of a fragment's frag_info table entry: min(its offset in its document, 3), and
// whether its document has tokens after it.
constexpr int kCpFwdHeads = 0;
constexpr int kCpBwdHeads = 1;
constexpr int kCpBwdTails = 2;
constexpr int kCpHeadMask = 3;
constexpr int kCpContinues = 4;
// Channels of one context-parallel tensor (exclusive bound): the passes' grids run C / 1024
// blocks in their y dimension, at most 65535.
constexpr int64_t kCpMaxC = int64_t(1) << 25;

// The C entries take one struct of int64 fields (device addresses, sizes, flags, the stream):
// one ctypes argument instead of 15 or 25 (the eager host budget), filled by name in the binding.
// The [S, C] tensors are BF16 rows of C channels, *_row_stride elements apart (a multiple of 8,
// at least C; C itself for a contiguous tensor); the states are BF16 [num_docs, 3, C], contiguous,
// 0 (null) when absent.
//   forward:  x, y, weight, bias, cu_seqlens, workspace (the counters above), initial_states,
//             final_states (written), S, C, x_row_stride, y_row_stride, num_docs, device, stream
//   backward: x, dy, dx, weight, bias, cu_seqlens, initial_states, dfinal_states, dinitial_states
//             (written; given iff initial_states is), frag_info (null, or, context-parallel
//             backward only, with initial_states given and dfinal_states null: int32 [num_docs],
//             the fragments' frag_info; the halo rows of a fragment with offset 0 are not read (any
//             content) and its dinitial_states rows are not written; scan_documents), workspace
//             (FP32 partial rows, any content, 16-byte aligned; read by the reduction kernels the
//             call launches after the streaming one) and its size in bytes, dweight, dbias, S, C,
//             x_row_stride, dy_row_stride, dx_row_stride, num_docs, item_tokens
//             (causal_conv1d_bwd_plan.h), round_preact (1: SiLU' at the BF16-rounded
//             pre-activation), device, stream
//   context-parallel passes (causal_conv1d_cp.cuh): pass (0 forward heads, 1 backward head g,
//             2 backward tails), x, dy, out (y or dx; contiguous [S, C]), weight, bias, cu_seqlens
//             (the local fragments), halo ([num_frags, 3, C]; the forward heads pass writes the
//             rows of its non-empty fragments, gathered from `received`: received_rows rows
//             received_ld elements apart, through import_rows), frag_info, frags (int32
//             [num_items]: the fragments the forward heads / backward tails pass rewrites; others
//             are not; an entry out of [0, num_frags) or with nothing to do is skipped), g_rows,
//             g_out, g_in, g_import (int32 tables and FP32 exchange rows, g_ld floats apart;
//             g_in_rows rows of g_in), received, import_rows, g_ld, g_in_rows, received_ld,
//             received_rows, S, C, num_frags, num_items (g_rows' entries, or frags' for the passes
//             over fragments), round_preact, device, stream
#define CAKE_FWD_ARGS(X)                                                                                   \
  X(x) X(y) X(weight) X(bias) X(cu_seqlens) X(workspace) X(initial_states) X(final_states) X(S) X(C)      \
  X(x_row_stride) X(y_row_stride) X(num_docs) X(device) X(stream)
#define CAKE_BWD_ARGS(X)                                                                                  \
  X(x) X(dy) X(dx) X(weight) X(bias) X(cu_seqlens) X(initial_states) X(dfinal_states) X(dinitial_states) \
  X(frag_info) X(workspace) X(workspace_bytes) X(dweight) X(dbias) X(S) X(C)                              \
  X(x_row_stride) X(dy_row_stride) X(dx_row_stride) X(num_docs) X(item_tokens) X(round_preact) X(device)  \
  X(stream)

#define CAKE_CP_ARGS(X)                                                                                  \
  X(pass) X(x) X(dy) X(out) X(weight) X(bias) X(cu_seqlens) X(halo) X(frag_info) X(frags) X(g_rows) X(g_out) \
  X(g_in) X(g_import) X(received) X(import_rows) X(g_ld) X(g_in_rows) X(received_ld) X(received_rows) X(S)   \
  X(C) X(num_frags) X(num_items) X(round_preact) X(device) X(stream)

#define CAKE_ARG_FIELD(name) int64_t name;
#define CAKE_ARG_NAME(name) #name " "

struct FwdArgs {
  CAKE_FWD_ARGS(CAKE_ARG_FIELD)
};
struct BwdArgs {
  CAKE_BWD_ARGS(CAKE_ARG_FIELD)
};
struct CpArgs {
  CAKE_CP_ARGS(CAKE_ARG_FIELD)
};

// The field names in order, space-separated: what the module exports for its ctypes callers.
constexpr const char kFwdArgNames[] = CAKE_FWD_ARGS(CAKE_ARG_NAME);
constexpr const char kBwdArgNames[] = CAKE_BWD_ARGS(CAKE_ARG_NAME);
constexpr const char kCpArgNames[] = CAKE_CP_ARGS(CAKE_ARG_NAME);

}  // namespace flashinfer_cake
