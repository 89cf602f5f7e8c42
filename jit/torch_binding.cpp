// flashinfer_cake's torch binding: the eager call of the public functions in one C++ call.
//
// Why it exists: a call must cost at most 10 µs of host time, and reading ~30 tensor properties
// through Python plus a ctypes launch costs more than that. Here the metadata is read natively.
//
// try_forward(), try_backward() and try_autograd_forward() (cake_causal_conv1d's eager call,
// recording a C++ autograd node) take the public function's arguments as they came from the user,
// accept them only when every rule of flashinfer_cake/_checks.py holds, allocate outputs and
// default buffers with torch's caching allocator and call the C entry of the kernel module of the
// call's (device, weight dtype, bias dtype), which Python registers with register_kernel_module().
// They return None, having allocated and launched nothing, whenever they decline: an argument
// breaks a rule, or the module is not registered yet. The Python layer then raises the precise
// error (the messages live in one place, _checks.py), or loads and registers the module and calls
// again. A launch error raises RuntimeError with the CUDA message. The limits come from
// causal_conv1d_contract.h and the backward's sizes from causal_conv1d_bwd_plan.h; that these
// checks decline exactly what _checks.py rejects is tested on the GPU (every bad-argument case of
// tests/test_*_validation.py goes through this file first, every valid call must not decline).
// The context-parallel calls (flashinfer_cake/cp) have a section of their own at the end: the
// same pattern (cp_autograd_forward with its node), plus the collectives.
//
// Built once per torch build by flashinfer_cake.jit.binding (CPython API + ATen, no pybind11; no
// CUDA header: the current stream comes through c10's device-generic interface; c10d's process
// groups where torch has them, CAKE_C10D). The Python functions run under the GIL; the autograd
// nodes' backwards run on the engine's thread without it, so this file's tables have a mutex of
// their own.

#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#if CAKE_C10D  // torch.distributed is built (jit/binding.py): the CP calls' collectives
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <flashinfer_cake/causal_conv1d_bwd_plan.h>
#include <flashinfer_cake/causal_conv1d_contract.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using flashinfer_cake::BwdArgs;
using flashinfer_cake::CpArgs;
using flashinfer_cake::FwdArgs;
using flashinfer_cake::kBwdMaxElements;
using flashinfer_cake::kBwdMaxS;
using flashinfer_cake::kCpMaxC;
using flashinfer_cake::kFwdMaxElements;
using flashinfer_cake::kFwdMaxS;
using flashinfer_cake::kFwdWorkspaceCounters;
using flashinfer_cake::kMaxC;
using flashinfer_cake::kMaxCuSeqlens;
using flashinfer_cake::kMaxDevices;

// A kernel module's C entries (see flashinfer_cake.jit.variant._SOURCE).
struct KernelEntries {
  int (*fwd)(const FwdArgs*) = nullptr;
  int (*bwd)(const BwdArgs*) = nullptr;
  int (*cp)(const CpArgs*) = nullptr;
  int (*capturing)(const void* stream) = nullptr;
  const char* (*message)() = nullptr;
};

// The buffers the binding keeps per (kind, device, stream), for calls without a workspace of
// their own: the forward's workspace (its int32 counters), the backward's FP32 partial rows.
enum BufferKind : int { kFwdWorkspace = 0, kBwdWorkspace = 1 };

// Kept buffers: int32 counters (zeroed when made, except a capture's own while no route reads
// them; every launch leaves them as it found them) and FP32 scratch of any content; each
// undefined when its kind has none (the backward has no counters, the forward no scratch).
struct KeptBuffers {
  at::Tensor counters, scratch;
};

// Guards g_modules and g_buffers (the autograd node's backward reads them without the GIL).
std::mutex g_mutex;
// [device][weight: fp32, bf16][bias: none, fp32, bf16]; a null entry = not registered.
KernelEntries g_modules[kMaxDevices][2][3];
// (kind, device, stream) -> the kept buffers. Never destroyed: freeing CUDA memory from a static
// destructor at exit would race torch's teardown.
auto* const g_buffers = new std::map<std::tuple<int, int, intptr_t>, KeptBuffers>();

KernelEntries module_of(int device, int w, int b) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_modules[device][w][b];
}

// Parameter dtype codes, the indices of g_modules: weight 0 fp32 / 1 bf16; bias 0 none / 1 fp32 /
// 2 bf16 (this code + 1); -1 for any other dtype.
int param_code(at::ScalarType t) { return t == at::kFloat ? 0 : t == at::kBFloat16 ? 1 : -1; }

// The tensor of a Python argument: false when it is neither a tensor nor (if allowed) None, or a
// tensor that dispatches in Python (_checks.check_memory). The type itself is checked
// (THPVariable_Check also takes objects that only claim the class, e.g. mocks, whose memory is no
// tensor).
bool as_tensor(PyObject* obj, bool optional, const at::Tensor** out) {
  if (obj == Py_None) {
    *out = nullptr;
    return optional;
  }
  if (!PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass))) return false;
  *out = &THPVariable_Unpack(obj);
  // Not FakeTensor, DTensor (no memory of their own) nor torch.func's wrappers (the Python rules refuse them).
  const c10::TensorImpl* impl = (*out)->unsafeGetTensorImpl();
  return !impl->is_python_dispatch() && !impl->key_set().has_any(c10::functorch_transforms_ks);
}

int64_t span_bytes(const at::Tensor* t);

// Every element inside the tensor's storage (_checks.check_memory): a view keeps its shape when its
// storage is resized (untyped_storage().resize_(0)), and the kernels would address past it.
bool in_storage(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  return t.has_storage() &&
         t.storage_offset() * int64_t(t.element_size()) + span_bytes(&t) <= int64_t(t.storage().nbytes());
}

// Contiguous, no lazy negation or conjugation, inside its storage (_checks.check_memory), on CUDA
// device `device`.
bool usable_on(const at::Tensor& t, int device) {
  return t.is_contiguous() && !t.is_neg() && !t.is_conj() && t.is_cuda() && t.get_device() == device &&
         in_storage(t);
}

// The row stride of a BF16 [S, C] / [1, S, C] tensor of rows (x, out, dy, dx) whose rows the kernels
// read or write in place: stride(-1) == 1 and, for S > 1, stride(-2) at least C, a multiple of 8,
// S * stride(-2) below max_elements (C when S <= 1: one row has no stride). -1 when not accepted
// (_checks.check_rows). The shape is not checked here.
int64_t row_stride(const at::Tensor& t, int64_t max_elements) {
  const int64_t S = t.size(-2), C = t.size(-1);
  if (t.stride(-1) != 1 && C > 1) return -1;
  if (S <= 1) return C;
  const int64_t stride = t.stride(-2);
  return stride >= C && stride % 8 == 0 && stride <= (max_elements - 1) / S ? stride : -1;  // S * stride < max
}

// x: BF16 [S, C] or [1, S, C] of rows (row_stride), on a CUDA device, C a positive multiple of 8,
// within (max_s, max_elements).
bool check_x(const at::Tensor& x, int64_t max_s, int64_t max_elements, int64_t* S, int64_t* C, int* device) {
  if (x.scalar_type() != at::kBFloat16 || x.is_neg() || x.is_conj() || !x.is_cuda()) return false;
  const auto sizes = x.sizes();
  if (sizes.size() == 2) {
    *S = sizes[0], *C = sizes[1];
  } else if (sizes.size() == 3 && sizes[0] == 1) {
    *S = sizes[1], *C = sizes[2];
  } else {
    return false;
  }
  *device = x.get_device();
  return *C > 0 && *C % 8 == 0 && *C < kMaxC && *S < max_s && *S * *C < max_elements && *device >= 0 &&
         *device < kMaxDevices && row_stride(x, max_elements) > 0 && in_storage(x);
}

// weight FP32/BF16 [C, 4], bias None or FP32/BF16 [C], cu_seqlens int32 [num_docs + 1], all
// contiguous on `device`. Sets the dtype codes.
bool check_params(const at::Tensor& weight, const at::Tensor& cu_seqlens, const at::Tensor* bias, int64_t C,
                  int device, int* w, int* b) {
  *w = param_code(weight.scalar_type());
  if (*w < 0 || weight.dim() != 2 || weight.size(0) != C || weight.size(1) != 4 || !usable_on(weight, device)) {
    return false;
  }
  if (cu_seqlens.scalar_type() != at::kInt || cu_seqlens.dim() != 1 || cu_seqlens.size(0) < 1 ||
      cu_seqlens.size(0) > kMaxCuSeqlens || !usable_on(cu_seqlens, device)) {
    return false;
  }
  *b = 0;
  if (bias) {
    *b = param_code(bias->scalar_type()) + 1;
    if (*b < 1 || bias->dim() != 1 || bias->size(0) != C || !usable_on(*bias, device)) return false;
  }
  return true;
}

// t: exactly like `like` (dtype and shape), contiguous, on `device`.
bool check_like(const at::Tensor& t, const at::Tensor& like, int device) {
  return t.scalar_type() == like.scalar_type() && t.sizes() == like.sizes() && usable_on(t, device);
}

// t: rows like x (BF16, x's shape) with an accepted row stride, on `device`.
bool check_rows_like(const at::Tensor& t, const at::Tensor& x, int64_t max_elements, int device) {
  return t.scalar_type() == at::kBFloat16 && t.sizes() == x.sizes() && !t.is_neg() && !t.is_conj() && t.is_cuda() &&
         t.get_device() == device && row_stride(t, max_elements) > 0 && in_storage(t);
}

// Conv states: BF16 [num_docs, 3, C], contiguous, on `device`.
bool check_states(const at::Tensor& t, int64_t num_docs, int64_t C, int device) {
  const auto sizes = t.sizes();
  return t.scalar_type() == at::kBFloat16 && sizes.size() == 3 && sizes[0] == num_docs && sizes[1] == 3 &&
         sizes[2] == C && usable_on(t, device);
}

// A contiguous 1-D workspace of `dtype` with at least `need` bytes on `device`.
bool check_workspace(const at::Tensor& ws, at::ScalarType dtype, int64_t need, int device) {
  return ws.scalar_type() == dtype && ws.dim() == 1 && ws.numel() * ws.element_size() >= need &&
         usable_on(ws, device);
}

// Address and size of an optional tensor (null or undefined: 0).
intptr_t address(const at::Tensor* t) { return t && t->defined() ? reinterpret_cast<intptr_t>(t->data_ptr()) : 0; }

int64_t nbytes(const at::Tensor* t) { return t && t->defined() ? t->numel() * int64_t(t->element_size()) : 0; }

// The bytes from a tensor's first element to its last (its numel for a contiguous one; a
// row-strided view spans the gaps between its rows too). 0 when empty or null.
int64_t span_bytes(const at::Tensor* t) {
  if (!t || !t->defined() || t->numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t i = 0; i < t->dim(); ++i) last += (t->size(i) - 1) * t->stride(i);
  return (last + 1) * int64_t(t->element_size());
}

// Whether the byte spans of a and b intersect (_checks.check_no_overlap's rule).
bool overlaps(const at::Tensor* a, const at::Tensor* b) {
  const int64_t na = span_bytes(a);
  if (!na) return false;  // (absent: the usual written argument, no span of the others to compute)
  const int64_t nb = span_bytes(b);
  if (!nb) return false;
  const intptr_t pa = address(a), pb = address(b);
  return pa < pb + nb && pb < pa + na;
}

// The kernels read taps and bias 16 bytes at a time: a misaligned view (a slice of a larger
// parameter) is copied, a few KB. Returns the address to pass; `copy` keeps the copy alive.
intptr_t aligned_param(const at::Tensor* t, at::Tensor* copy) {
  if (!t) return 0;
  const intptr_t ptr = address(t);
  if (!(ptr & 15)) return ptr;
  *copy = t->clone();
  return reinterpret_cast<intptr_t>(copy->data_ptr());
}

// Errors are thrown (std::runtime_error for a failed launch or CUDA query, c10::Error from
// torch): HANDLE_TH_ERRORS turns them into the Python exception; from the autograd node's
// backward the engine hands them to the thread that called backward().

// The current stream of `device` (torch's, the one the caller's work is ordered on), as
// torch.cuda.current_stream(device).cuda_stream.
intptr_t current_stream(int device) {
  const c10::Device cuda(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  return reinterpret_cast<intptr_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(cuda).native_handle());
}

// Uninitialized memory of torch's CUDA caching allocator (at::empty's, or a pluggable one set by
// torch.cuda.memory.change_current_allocator; graph pools and memory statistics as usual) on the
// CURRENT device (callers hold a DeviceGuard: Outputs for the whole call, kept_buffers around its
// allocations), without the dispatcher: ~0.3-0.5 us less per tensor than at::empty, and no fill
// under torch.use_deterministic_algorithms (while capturing, that fill is a kernel in every
// replay). Only for memory the kernels write before anything reads it.
at::Tensor unfilled(c10::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, at::detail::getCUDAHooks().getCUDADeviceAllocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype, std::nullopt);
}

// The kept buffers of `kind` with at least `ints` counters and `floats` scratch elements: kept per
// (kind, device, stream), both replaced when a call needs more of either; buffers of the call's
// own while the stream captures a CUDA graph (the graph replays with them: never shared with eager
// calls or other graphs). A replaced buffer may still be in use by the stream's queued work: the
// caching allocator hands its memory out again only in the stream's order.
KeptBuffers kept_buffers(const KernelEntries& m, BufferKind kind, int device, intptr_t stream, int64_t ints,
                         int64_t floats, const at::TensorOptions& options, const char* fn) {
  const int status = m.capturing(reinterpret_cast<const void*>(stream));
  if (status < 0) throw std::runtime_error(std::string(fn) + ": cudaStreamIsCapturing failed: " + m.message());
  const auto enough = [&](const KeptBuffers& b) {
    return (!ints || b.counters.numel() >= ints) && (!floats || b.scratch.numel() >= floats);
  };
  const auto make = [&] {
    const c10::DeviceGuard guard(options.device());
    KeptBuffers b;
    if (ints) {  // zeroed, except while capturing when no route reads them (kFwdRoutesUseCounters)
      b.counters = status && !flashinfer_cake::kFwdRoutesUseCounters ? unfilled({ints}, at::kInt)
                                                                     : at::zeros({ints}, options.dtype(at::kInt));
    }
    if (floats) b.scratch = unfilled({floats}, at::kFloat);  // the kernels write what they read
    return b;
  };
  if (status) return make();
  const std::tuple<int, int, intptr_t> key{kind, device, stream};
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = g_buffers->find(key);
    if (it != g_buffers->end() && enough(it->second)) return it->second;
  }
  // Allocated and freed outside the mutex: the allocator may take the GIL (memory history, a
  // Python dispatch mode) while a Python thread holding it waits for the mutex.
  KeptBuffers fresh = make(), replaced;
  std::lock_guard<std::mutex> lock(g_mutex);
  KeptBuffers& kept = (*g_buffers)[key];
  if (enough(kept)) return kept;  // another thread's, meanwhile
  replaced = std::exchange(kept, fresh);
  return fresh;
}

// New outputs on one device, which the kernel writes in full (unfilled: no element is left
// unwritten for a fill to expose; the one exception, the CP backward's dinit rows of fragments
// without a halo, is discarded unread). The device is current while it lives (the allocator
// allocates on the current device; the launch then needs no device switch).
class Outputs {
 public:
  explicit Outputs(c10::Device device) : guard_(device) {}

  // No second guard per tensor (the hot path): guard_ keeps the device current.
  at::Tensor like(const at::Tensor& t) const { return unfilled(t.sizes(), t.scalar_type()); }

 private:
  const c10::DeviceGuard guard_;
};

// A caller's tensor the kernel writes: its version moves, as with an in-place op, so autograd
// refuses a saved tensor that changed (and an inference tensor outside inference mode raises).
void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

void check_launch(const KernelEntries& m, const char* fn, int rc) {
  if (rc) {
    throw std::runtime_error(std::string(fn) + ": launch failed with CUDA error " + std::to_string(rc) + ": " +
                             m.message());
  }
}

// The g_modules index of a dtype argument (a torch.dtype, or None for the bias); -1 otherwise.
int dtype_code(PyObject* obj, bool bias) {
  if (bias && obj == Py_None) return 0;
  if (!THPDtype_Check(obj)) return -1;
  const int code = param_code(reinterpret_cast<THPDtype*>(obj)->scalar_type);
  return code < 0 ? -1 : code + (bias ? 1 : 0);
}

// False, with a TypeError set, when a function of this file gets another argument count.
bool takes(const char* fn, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", fn, want);
  return false;
}

// A tuple of new references (all or nothing); null with the Python error set.
PyObject* tuple_of(std::vector<PyObject*> items) {
  bool ok = true;
  for (PyObject* it : items) ok = ok && it;
  PyObject* result = ok ? PyTuple_New(static_cast<Py_ssize_t>(items.size())) : nullptr;
  if (!result) {
    for (PyObject* it : items) Py_XDECREF(it);
    return nullptr;
  }
  for (size_t i = 0; i < items.size(); ++i) PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), items[i]);
  return result;
}

// A tuple of tensors (an undefined one: None); null with the Python error set.
PyObject* tensor_tuple(std::vector<at::Tensor> ts) {
  std::vector<PyObject*> items;
  for (at::Tensor& t : ts) items.push_back(t.defined() ? THPVariable_Wrap(std::move(t)) : Py_NewRef(Py_None));
  return tuple_of(std::move(items));
}

// register_kernel_module(device, weight dtype, bias dtype or None, fwd, bwd, cp, capturing,
// message): the addresses of a loaded kernel module's C entries (KernelModule.entry_addresses).
PyObject* register_kernel_module(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_kernel_module", nargs, 8)) return nullptr;
  const long device = PyLong_AsLong(args[0]);
  if (PyErr_Occurred()) return nullptr;
  const int w = dtype_code(args[1], false), b = dtype_code(args[2], true);
  void* p[5];
  for (int i = 0; i < 5; ++i) {
    p[i] = PyLong_AsVoidPtr(args[3 + i]);
    if (PyErr_Occurred()) return nullptr;
  }
  if (device < 0 || device >= kMaxDevices || w < 0 || b < 0 || !p[0] || !p[1] || !p[2] || !p[3] || !p[4]) {
    PyErr_SetString(PyExc_ValueError, "register_kernel_module: device, dtype or entry address out of range");
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_modules[device][w][b] = {reinterpret_cast<int (*)(const FwdArgs*)>(p[0]),
                             reinterpret_cast<int (*)(const BwdArgs*)>(p[1]),
                             reinterpret_cast<int (*)(const CpArgs*)>(p[2]),
                             reinterpret_cast<int (*)(const void*)>(p[3]), reinterpret_cast<const char* (*)()>(p[4])};
  Py_RETURN_NONE;
}

constexpr const char* kFwd = "cake_causal_conv1d_train_forward";
constexpr const char* kBwd = "cake_causal_conv1d_train_backward";
constexpr const char* kCp = "cake_causal_conv1d_cp";

// Whether any tensor of `spans` from index first_written on overlaps one before it (null: absent).
template <size_t N>
bool any_written_overlaps(const at::Tensor* const (&spans)[N], size_t first_written) {
  for (size_t i = first_written; i < N; ++i) {
    if (!span_bytes(spans[i])) continue;  // absent or empty: overlaps nothing
    for (size_t j = 0; j < i; ++j) {
      if (overlaps(spans[i], spans[j])) return true;
    }
  }
  return false;
}

// Whether any of the tensors is non-empty and not 16-byte aligned (null: absent).
bool misaligned16(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (t && t->defined() && t->numel() && address(t) & 15) return true;
  }
  return false;
}

// Whether t is a dual tensor of forward-mode AD (has a tangent). A dual tensor has autograd metadata:
// a tensor without it (most) skips isFwGradDefined's copy and lock.
bool has_tangent(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->autograd_meta() && torch::autograd::isFwGradDefined(t);
}

// Whether any of the tensors requires grad with grad mode on, or is a dual tensor of forward-mode AD
// (has a tangent): the raw forward and backward record no autograd graph, propagate no tangent and
// write their outputs in place, so they decline such a call (the Python rules raise
// _checks.check_no_grad's error).
bool grad_needed(std::initializer_list<const at::Tensor*> ts) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : ts) {
    if (!t) continue;
    if ((grad_mode && t->requires_grad()) || has_tangent(*t)) return true;
  }
  return false;
}

// A forward call: its tensors (null = None), then what check_forward() derives.
struct ForwardCall {
  const at::Tensor *x, *weight, *cu_seqlens, *bias, *initial_states, *final_states, *out, *workspace;
  int64_t S = 0, C = 0, max_elements = 0;
  int device = 0;
  KernelEntries m;
};

// Applies the forward's rules with S < max_s and S * C < max_elements; false = declined.
bool check_forward(ForwardCall* c, int64_t max_s, int64_t max_elements) {
  int w, b;
  c->max_elements = max_elements;
  if (!check_x(*c->x, max_s, max_elements, &c->S, &c->C, &c->device) ||
      !check_params(*c->weight, *c->cu_seqlens, c->bias, c->C, c->device, &w, &b) ||
      (c->out && !check_rows_like(*c->out, *c->x, max_elements, c->device)) ||
      (c->workspace && !check_workspace(*c->workspace, at::kInt, 4 * kFwdWorkspaceCounters, c->device))) {
    return false;
  }
  const int64_t num_docs = c->cu_seqlens->size(0) - 1;
  for (const at::Tensor* st : {c->initial_states, c->final_states}) {
    if (st && !check_states(*st, num_docs, c->C, c->device)) return false;
  }
  c->m = module_of(c->device, w, b);
  if (!c->m.fwd) return false;
  // out and the final states are written while x, the parameters, cu_seqlens and the initial
  // states are read; the workspace stays as it is.
  const at::Tensor* const spans[] = {c->x,        c->weight,         c->bias,         c->cu_seqlens,
                                     c->workspace, c->initial_states, c->final_states, c->out};
  constexpr size_t kFirstWritten = 6;  // final_states
  return !(misaligned16({c->x, c->out, c->initial_states, c->final_states}) ||
           any_written_overlaps(spans, kFirstWritten));
}

// Runs a checked forward; returns y (*out when given). final_states: the output to write (the
// caller's, or one made by the autograd forward), or null.
at::Tensor run_forward(const ForwardCall& c) {
  std::optional<Outputs> outputs;
  if (!c.out) outputs.emplace(c.x->device());
  at::Tensor weight_copy, bias_copy, y, ws;
  const intptr_t w_ptr = aligned_param(c.weight, &weight_copy);
  const intptr_t b_ptr = aligned_param(c.bias, &bias_copy);
  // the allocator's blocks are 512-byte aligned
  y = c.out ? *c.out : outputs->like(*c.x);
  const intptr_t stream = current_stream(c.device);
  if (!c.workspace) {
    ws = kept_buffers(c.m, kFwdWorkspace, c.device, stream, kFwdWorkspaceCounters, 0, c.x->options(), kFwd).counters;
  }
  for (const at::Tensor* t : {c.out, c.final_states}) {  // as in-place ops do: autograd sees the writes
    if (t) bump_version(*t);
  }
  FwdArgs a{};
  a.x = address(c.x);
  a.y = address(&y);
  a.weight = w_ptr;
  a.bias = b_ptr;
  a.cu_seqlens = address(c.cu_seqlens);
  a.workspace = address(c.workspace ? c.workspace : &ws);
  a.initial_states = address(c.initial_states);
  a.final_states = address(c.final_states);
  a.S = c.S;
  a.C = c.C;
  a.x_row_stride = row_stride(*c.x, c.max_elements);
  a.y_row_stride = row_stride(y, c.max_elements);
  a.num_docs = c.cu_seqlens->size(0) - 1;
  a.device = c.device;
  a.stream = stream;
  check_launch(c.m, kFwd, c.m.fwd(&a));
  return y;
}

// A backward call: its tensors (null = None) and SiLU' policy, then what check_backward() derives.
struct BackwardCall {
  const at::Tensor *x, *weight, *cu_seqlens, *dy, *bias, *initial_states, *dfinal_states, *workspace, *dx, *dweight,
      *dbias, *dinitial_states;
  int round_preact;
  const at::Tensor* frag_info = nullptr;  // the CP backward's (scan_documents)
  int64_t S = 0, C = 0, need = 0;
  int device = 0;
  KernelEntries m;
};

// Applies the backward's rules; false = declined.
bool check_backward(BackwardCall* c) {
  int w, b;
  if (!check_x(*c->x, kBwdMaxS, kBwdMaxElements, &c->S, &c->C, &c->device) ||
      !check_params(*c->weight, *c->cu_seqlens, c->bias, c->C, c->device, &w, &b) ||
      !check_rows_like(*c->dy, *c->x, kBwdMaxElements, c->device) ||
      (c->dx && !check_rows_like(*c->dx, *c->x, kBwdMaxElements, c->device)) ||
      (c->dweight && !check_like(*c->dweight, *c->weight, c->device)) ||
      (c->dbias && (!c->bias || !check_like(*c->dbias, *c->bias, c->device))) ||
      (c->dinitial_states && !c->initial_states)) {
    return false;
  }
  const int64_t num_docs = c->cu_seqlens->size(0) - 1;
  for (const at::Tensor* st : {c->initial_states, c->dfinal_states, c->dinitial_states}) {
    if (st && !check_states(*st, num_docs, c->C, c->device)) return false;
  }
  c->need = flashinfer_cake::bwd_workspace_bytes(c->S, c->C);
  if (c->workspace && !check_workspace(*c->workspace, at::kFloat, c->need, c->device)) return false;
  c->m = module_of(c->device, w, b);
  if (!c->m.bwd) return false;
  if (misaligned16({c->x, c->dy, c->dx, c->initial_states, c->dfinal_states, c->dinitial_states, c->workspace})) return false;
  // What the kernel writes (the workspace, dx, dweight, dbias, dinitial_states) overlaps nothing
  // else: it reads x, dy, the parameters, cu_seqlens and the states while writing dx, dinit and
  // the partial rows, and reads the partial rows while writing dweight and dbias.
  const at::Tensor* const spans[] = {c->x,         c->dy,          c->weight,        c->bias,
                                     c->cu_seqlens, c->initial_states, c->dfinal_states, c->workspace,
                                     c->dx,        c->dweight,     c->dbias,         c->dinitial_states};
  constexpr size_t kFirstWritten = 7;  // the workspace
  return !any_written_overlaps(spans, kFirstWritten);
}

// The backward's results: dx, dweight, dbias (undefined without bias), dinitial_states (undefined
// without initial states).
struct Grads {
  at::Tensor dx, dweight, dbias, dinitial_states;
};

// Runs a checked backward; given outputs are written and returned.
Grads run_backward(const BackwardCall& c) {
  at::Tensor weight_copy, bias_copy;
  const intptr_t w_ptr = aligned_param(c.weight, &weight_copy);
  const intptr_t b_ptr = aligned_param(c.bias, &bias_copy);
  Grads g;
  std::optional<Outputs> outputs;
  if (!c.dx || !c.dweight || (c.bias && !c.dbias) || (c.initial_states && !c.dinitial_states)) {
    outputs.emplace(c.x->device());
  }
  g.dx = c.dx ? *c.dx : outputs->like(*c.x);
  g.dweight = c.dweight ? *c.dweight : outputs->like(*c.weight);
  if (c.bias) g.dbias = c.dbias ? *c.dbias : outputs->like(*c.bias);
  if (c.initial_states) g.dinitial_states = c.dinitial_states ? *c.dinitial_states : outputs->like(*c.initial_states);
  const intptr_t stream = current_stream(c.device);
  const at::Tensor* workspace = c.workspace;
  KeptBuffers kept;
  if (!workspace) {
    kept = kept_buffers(c.m, kBwdWorkspace, c.device, stream, 0, flashinfer_cake::ceil_div(c.need, 4), c.x->options(), kBwd);
    workspace = &kept.scratch;
  }
  for (const at::Tensor* t : {c.dx, c.dweight, c.dbias, c.dinitial_states, c.workspace}) {  // as in-place ops do
    if (t) bump_version(*t);
  }
  BwdArgs a{};
  a.x = address(c.x);
  a.dy = address(c.dy);
  a.dx = address(&g.dx);
  a.weight = w_ptr;
  a.bias = b_ptr;
  a.cu_seqlens = address(c.cu_seqlens);
  a.initial_states = address(c.initial_states);
  a.dfinal_states = address(c.dfinal_states);
  a.dinitial_states = c.initial_states ? address(&g.dinitial_states) : 0;
  a.frag_info = address(c.frag_info);
  a.workspace = address(workspace);
  a.workspace_bytes = nbytes(workspace);
  a.dweight = address(&g.dweight);
  a.dbias = c.bias ? address(&g.dbias) : 0;
  a.S = c.S;
  a.C = c.C;
  a.x_row_stride = row_stride(*c.x, kBwdMaxElements);
  a.dy_row_stride = row_stride(*c.dy, kBwdMaxElements);
  a.dx_row_stride = row_stride(g.dx, kBwdMaxElements);
  a.num_docs = c.cu_seqlens->size(0) - 1;
  a.item_tokens = flashinfer_cake::bwd_item_tokens(c.S, c.C);
  a.round_preact = c.round_preact;
  a.device = c.device;
  a.stream = stream;
  check_launch(c.m, kBwd, c.m.bwd(&a));
  return g;
}

// silu_grad_preactivation -> the kernel's round_preact flag (1 "bf16", 0 "fp32"); -1 otherwise.
int round_preact_of(PyObject* policy) {
  if (!PyUnicode_Check(policy)) return -1;
  if (PyUnicode_CompareWithASCIIString(policy, "bf16") == 0) return 1;
  if (PyUnicode_CompareWithASCIIString(policy, "fp32") == 0) return 0;
  return -1;
}

// try_forward(x, weight, cu_seqlens, bias, initial_states, final_states_out, out, workspace) -> y,
// or None when declined.
PyObject* try_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("try_forward", nargs, 8)) return nullptr;
  ForwardCall c{};
  if (!as_tensor(args[0], false, &c.x) || !as_tensor(args[1], false, &c.weight) ||
      !as_tensor(args[2], false, &c.cu_seqlens) || !as_tensor(args[3], true, &c.bias) ||
      !as_tensor(args[4], true, &c.initial_states) || !as_tensor(args[5], true, &c.final_states) ||
      !as_tensor(args[6], true, &c.out) || !as_tensor(args[7], true, &c.workspace) ||
      !check_forward(&c, kFwdMaxS, kFwdMaxElements) ||
      grad_needed({c.x, c.weight, c.bias, c.initial_states, c.final_states, c.out, c.workspace})) {
    Py_RETURN_NONE;
  }
  at::Tensor y = run_forward(c);
  return c.out ? Py_NewRef(args[6]) : THPVariable_Wrap(std::move(y));  // out: the caller's object
  END_HANDLE_TH_ERRORS
}

// try_backward(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states,
// silu_grad_preactivation, workspace, dx, dweight, dbias, dinitial_states) -> (dx, dweight[, dbias]
// [, dinitial_states]), or None when declined.
PyObject* try_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("try_backward", nargs, 13)) return nullptr;
  BackwardCall c{};
  c.round_preact = round_preact_of(args[7]);
  if (!as_tensor(args[0], false, &c.x) || !as_tensor(args[1], false, &c.weight) ||
      !as_tensor(args[2], false, &c.cu_seqlens) || !as_tensor(args[3], false, &c.dy) ||
      !as_tensor(args[4], true, &c.bias) || !as_tensor(args[5], true, &c.initial_states) ||
      !as_tensor(args[6], true, &c.dfinal_states) || !as_tensor(args[8], true, &c.workspace) ||
      !as_tensor(args[9], true, &c.dx) || !as_tensor(args[10], true, &c.dweight) ||
      !as_tensor(args[11], true, &c.dbias) || !as_tensor(args[12], true, &c.dinitial_states) || c.round_preact < 0 ||
      !check_backward(&c) ||
      grad_needed({c.x, c.weight, c.dy, c.bias, c.initial_states, c.dfinal_states, c.workspace, c.dx, c.dweight, c.dbias,
                   c.dinitial_states})) {
    Py_RETURN_NONE;
  }
  Grads g = run_backward(c);
  // (dx, dweight[, dbias][, dinitial_states]); the given outputs as the caller's objects.
  const auto item = [](const at::Tensor* given, PyObject* given_obj, at::Tensor& made) {
    return given ? Py_NewRef(given_obj) : THPVariable_Wrap(std::move(made));
  };
  PyObject* items[4] = {item(c.dx, args[9], g.dx), item(c.dweight, args[10], g.dweight), nullptr, nullptr};
  int n = 2;
  if (c.bias) items[n++] = item(c.dbias, args[11], g.dbias);
  if (c.initial_states) items[n++] = item(c.dinitial_states, args[12], g.dinitial_states);
  bool ok = true;
  for (int i = 0; i < n; ++i) ok = ok && items[i];
  PyObject* result = ok ? PyTuple_New(n) : nullptr;
  if (!result) {
    for (PyObject* it : items) Py_XDECREF(it);
    return nullptr;
  }
  for (int i = 0; i < n; ++i) PyTuple_SET_ITEM(result, i, items[i]);
  return result;
  END_HANDLE_TH_ERRORS
}

constexpr const char* kAutograd = "cake_causal_conv1d";

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A new autograd node, held as this torch holds them: by c10::intrusive_ptr since torch 2.13, by
// std::shared_ptr with torch's iterative deleter before.
template <class N>
auto make_node() {
  if constexpr (std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });  // found by ADL where it exists
  } else {
    return c10::make_intrusive<N>();
  }
}

// A node's gradients as a function that is not itself differentiable returns them: under
// create_graph=True (grad mode on in the backward), outputs whose own backward raises when it is
// taken. (torch's @once_differentiable marks them only when an incoming gradient requires grad,
// so a gradient penalty through the op would treat them as constants, silently.)
variable_list not_differentiable(variable_list out, const char* fn) {
  if (!at::GradMode::is_enabled()) return out;
  for (at::Tensor& t : out) {
    if (t.defined()) t = t.detach().requires_grad_(true);
  }
  return std::make_shared<torch::autograd::DelayedError>(
             std::string(fn) + "'s backward is not itself differentiable: trying to differentiate twice "
                               "(create_graph=True, then a backward through its gradients)",
             int64_t(out.size()))
      ->apply(std::move(out));
}

// The autograd node of cake_causal_conv1d's eager calls, written as torch's generated nodes are
// (a torch::autograd::Function's generic bookkeeping costs ~2 us more per forward). It does what
// CakeCausalConv1dFunction (the path under torch.compile) does: saves x, weight, bias, cu_seqlens
// and the initial states only; passes an incoming gradient of y through when the backward takes it
// as it is (BF16 rows with an accepted row stride, 16-byte aligned), else materializes it once
// (zeros when undefined; the final states' gradient likewise, None when undefined); returns the
// gradients in the parameters' dtypes; is not itself differentiable (not_differentiable).
// The engine runs it without the GIL. Outputs: y, and the final states when asked for.
struct CakeCausalConv1dBackward final : Node {
  SavedVariable x, weight, bias, cu_seqlens, initial_states;  // bias, initial_states: default-constructed when None
  int round_preact = 1;

  std::string name() const override { return "CakeCausalConv1dBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&x, &weight, &bias, &cu_seqlens, &initial_states}) v->reset_data();
  }

  // grads: dy[, dfinal_states]. Returns the gradients of the next edges (x, weight, bias,
  // initial_states).
  variable_list apply(variable_list&& grads) override {
    // forward-over-reverse (a dual incoming gradient): its tangent would be dropped, silently
    TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(grads[0]) && (grads.size() < 2 || !has_tangent(grads[1])), kAutograd,
                                ": forward-mode AD (dual tensors, torch.func.jvp) is not supported");
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor xs = x.unpack(), ws = weight.unpack(), bs = bias.unpack(), cus = cu_seqlens.unpack(),
                     inits = initial_states.unpack();
    Grads g;
    {
      at::NoGradGuard no_grad;
      at::Tensor dy = grads[0], dfinal = grads.size() > 1 ? grads[1] : at::Tensor();
      if (!dy.defined()) {
        dy = at::zeros(xs.sizes(), xs.options());
      } else if (!check_rows_like(dy, xs, kBwdMaxElements, xs.get_device()) || misaligned16({&dy})) {
        dy = at::empty(xs.sizes(), xs.options()).copy_(dy);
      }
      if (dfinal.defined() && (dfinal.scalar_type() != at::kBFloat16 || !dfinal.is_contiguous() || dfinal.is_neg() ||
                               dfinal.is_conj() || misaligned16({&dfinal}))) {
        dfinal = at::empty(dfinal.sizes(), dfinal.options().dtype(at::kBFloat16)).copy_(dfinal);
      }
      BackwardCall c{&xs,    &ws,     &cus,    &dy,     bs.defined() ? &bs : nullptr, inits.defined() ? &inits : nullptr,
                     dfinal.defined() ? &dfinal : nullptr,  nullptr, nullptr, nullptr, nullptr, nullptr, round_preact};
      if (!check_backward(&c)) {
        throw std::runtime_error(std::string(kAutograd) +
                                 ": internal error: the backward declined the forward's saved tensors "
                                 "(please report it, with the arguments' dtypes, shapes and devices)");
      }
      g = run_backward(c);
    }
    variable_list out = {std::move(g.dx), std::move(g.dweight), std::move(g.dbias), std::move(g.dinitial_states)};
    return not_differentiable(std::move(out), kAutograd);
  }

  // Compiled autograd (torch._dynamo.compiled_autograd) traces the node through these two: its
  // backward becomes one call of the custom op flashinfer_cake::causal_conv1d_bwd on the swapped
  // saved tensors, as in CakeCausalConv1dFunction's backward under torch.compile.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(x, false);
    args.collect(weight, false);
    args.collect(bias, false);
    args.collect(cu_seqlens, false);
    args.collect(initial_states, false);
    args.collect(round_preact);
  }

  variable_list apply_with_saved(const variable_list& grads, torch::dynamo::autograd::SwapSavedVariables& saved) override {
    for (SavedVariable* v : {&x, &weight, &bias, &cu_seqlens, &initial_states}) saved.before(*v);
    const at::Tensor xs = x.unpack(), bs = bias.unpack(), inits = initial_states.unpack();
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("flashinfer_cake::causal_conv1d_bwd", "");
    const auto optional = [](const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); };
    // (x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation)
    //   -> (dx, dweight, dbias or empty, dinitial_states or empty)
    torch::jit::Stack stack{xs,
                            weight.unpack(),
                            cu_seqlens.unpack(),
                            grads[0].defined() ? grads[0] : at::zeros_like(xs),
                            optional(bs),
                            optional(inits),
                            optional(grads.size() > 1 ? grads[1] : at::Tensor()),
                            std::string(round_preact ? "bf16" : "fp32")};
    op.callBoxed(&stack);
    for (SavedVariable* v : {&x, &weight, &bias, &cu_seqlens, &initial_states}) saved.after(*v);
    return {stack[0].toTensor(), stack[1].toTensor(), bs.defined() ? stack[2].toTensor() : at::Tensor(),
            inits.defined() ? stack[3].toTensor() : at::Tensor()};
  }
};

// try_autograd_forward(x, weight, cu_seqlens, bias, initial_states, return_final_states,
// silu_grad_preactivation) -> y, or (y, final_states) when return_final_states is True, recorded
// for autograd when grad mode is on and x, weight, bias or initial_states requires grad; None when
// declined (also when x is outside the backward's range: the error comes now, not in the backward).
PyObject* try_autograd_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("try_autograd_forward", nargs, 7)) return nullptr;
  ForwardCall c{};
  const int round_preact = round_preact_of(args[6]);
  const bool return_final = args[5] == Py_True;
  // Under a TorchDispatchMode (selective activation checkpointing, FlopCounterMode, make_fx) the
  // call goes through the custom ops, where the mode sees it.
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || !as_tensor(args[0], false, &c.x) ||
      !as_tensor(args[1], false, &c.weight) ||
      !as_tensor(args[2], false, &c.cu_seqlens) || !as_tensor(args[3], true, &c.bias) ||
      !as_tensor(args[4], true, &c.initial_states) || (args[5] != Py_True && args[5] != Py_False) || round_preact < 0 ||
      !check_forward(&c, kBwdMaxS, kBwdMaxElements)) {
    Py_RETURN_NONE;
  }
  const at::Tensor& x = *c.x;
  const at::Tensor& weight = *c.weight;
  const at::Tensor bias = c.bias ? *c.bias : at::Tensor();
  const at::Tensor init = c.initial_states ? *c.initial_states : at::Tensor();
  TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(x) && !has_tangent(weight) && !has_tangent(bias) && !has_tangent(init),
                              kAutograd, ": forward-mode AD (dual tensors, torch.func.jvp) is not supported");
  at::Tensor y, final_states;
  {
    at::NoGradGuard no_grad;  // as a Function's forward: nothing in it is recorded (a parameter's aligned copy)
    if (return_final) {
      const c10::DeviceGuard guard(x.device());
      final_states = at::empty({c.cu_seqlens->size(0) - 1, 3, c.C}, x.options().dtype(at::kBFloat16));
      c.final_states = &final_states;  // new memory: overlaps nothing the checks saw
    }
    y = run_forward(c);
  }
  if (torch::autograd::compute_requires_grad(x, weight, bias, init)) {
    // register_kernel_module() gives a module's forward and backward at once: the backward is there too.
    auto node = make_node<CakeCausalConv1dBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, init));
    node->x = SavedVariable(x, false);
    node->weight = SavedVariable(weight, false);
    if (bias.defined()) node->bias = SavedVariable(bias, false);
    node->cu_seqlens = SavedVariable(*c.cu_seqlens, false);
    if (init.defined()) node->initial_states = SavedVariable(init, false);
    node->round_preact = round_preact;
    torch::autograd::set_history(y, node);
    if (return_final) torch::autograd::set_history(final_states, node);
  }
  if (!return_final) return THPVariable_Wrap(std::move(y));
  PyObject* items[2] = {THPVariable_Wrap(std::move(y)), THPVariable_Wrap(std::move(final_states))};
  PyObject* result = items[0] && items[1] ? PyTuple_New(2) : nullptr;
  if (!result) {
    for (PyObject* it : items) Py_XDECREF(it);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, items[0]);
  PyTuple_SET_ITEM(result, 1, items[1]);
  return result;
  END_HANDLE_TH_ERRORS
}

// ---- Context parallelism (flashinfer_cake/cp/conv.py) ----
//
// cp_autograd_forward() is a CP call's eager forward: the halo exchange (one all_to_all on the
// call's process group, issued here), the main forward while it is in flight, then the head rows;
// it records a C++ autograd node whose backward runs the backward's exchange and passes the same
// way, on the engine's thread without the GIL. The tensors come as tuples, one item per tensor of
// a multi call (xs[i] with weights[i] and biases[i]), the context's tables as tensors.
// It applies the call's rules (_checks.py's, the policy and the CP ones: a contiguous x of the
// context's token count; and the context's tables against each other) before anything is
// exchanged; when it declines, conv.py raises the precise error. The phases are also exposed one
// by one (cp_send ... cp_backward_tails): the tests run several ranks' phases in one process with
// the exchanges done by hand. Each entry checks what its memory safety needs and returns None,
// having launched nothing, when anything is off or a kernel module is not registered yet (conv.py
// registers it and calls again; a second None is an internal error).

// The tensors of a tuple argument: false when `obj` is not a tuple of `n` items (n < 0: at least
// one) or an item is neither a tensor nor (optional) None.
bool as_tensors(PyObject* obj, bool optional, Py_ssize_t n, std::vector<const at::Tensor*>* out) {
  if (!PyTuple_Check(obj)) return false;
  const Py_ssize_t size = PyTuple_GET_SIZE(obj);
  if (n >= 0 ? size != n : size < 1) return false;
  out->resize(size);
  for (Py_ssize_t i = 0; i < size; ++i) {
    if (!as_tensor(PyTuple_GET_ITEM(obj, i), optional, &(*out)[i])) return false;
  }
  return true;
}

// An int argument in [lo, hi]; false otherwise.
bool as_int(PyObject* obj, int64_t lo, int64_t hi, int64_t* out) {
  if (!PyLong_Check(obj)) return false;
  *out = PyLong_AsLongLong(obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return *out >= lo && *out <= hi;
}

// A tuple of non-negative ints (an exchange's rows per rank).
bool as_splits(PyObject* obj, std::vector<int64_t>* out) {
  if (!PyTuple_Check(obj)) return false;
  out->resize(PyTuple_GET_SIZE(obj));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); ++i) {
    if (!as_int(PyTuple_GET_ITEM(obj, i), 0, kMaxCuSeqlens, &(*out)[i])) return false;
  }
  return true;
}

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// A CP call's items: each x with its weight, bias (null: None) and kernel module.
struct CpItems {
  std::vector<const at::Tensor*> xs, weights, biases;
  std::vector<KernelEntries> modules;
  int64_t S = 0;        // the tokens, the same for every item
  int64_t total_c = 0;  // the items' channels side by side: the width of the exchanged rows
  int device = 0;
};

// Every item passes the forward's rules within the backward's range (check_forward) with a
// contiguous x of the same S on one device, and its variant's module is registered.
bool check_items(const at::Tensor& cu_seqlens, CpItems* c) {
  const size_t n = c->xs.size();
  if (n < 1 || c->weights.size() != n || c->biases.size() != n) return false;
  c->modules.resize(n);
  c->total_c = 0;
  for (size_t i = 0; i < n; ++i) {
    ForwardCall f{};
    f.x = c->xs[i];
    f.weight = c->weights[i];
    f.cu_seqlens = &cu_seqlens;
    f.bias = c->biases[i];
    if (!check_forward(&f, kBwdMaxS, kBwdMaxElements) || f.C >= kCpMaxC || !f.m.cp || !f.m.bwd || !c->xs[i]->is_contiguous() ||
        (i > 0 && (f.S != c->S || f.device != c->device))) {
      return false;
    }
    c->S = f.S, c->device = f.device, c->modules[i] = f.m;
    c->total_c += f.C;
  }
  return true;
}

// The items of tuple arguments xs, weights, biases, checked.
bool cp_items(PyObject* xs, PyObject* weights, PyObject* biases, const at::Tensor& cu_seqlens, CpItems* c) {
  return as_tensors(xs, false, -1, &c->xs) && as_tensors(weights, false, c->xs.size(), &c->weights) &&
         as_tensors(biases, true, c->xs.size(), &c->biases) && check_items(cu_seqlens, c);
}

// Rows of an item: BF16 contiguous, 16-byte aligned, of its x's shape (dy, y, dx).
bool rows_ok(const at::Tensor& t, const CpItems& c, size_t i) {
  return check_rows_like(t, *c.xs[i], kBwdMaxElements, c.device) && t.is_contiguous() && !misaligned16({&t});
}

// One tensor per item, each rows_ok.
bool cp_rows(PyObject* obj, const CpItems& c, std::vector<const at::Tensor*>* out) {
  if (!as_tensors(obj, false, c.xs.size(), out)) return false;
  for (size_t i = 0; i < out->size(); ++i) {
    if (!rows_ok(*(*out)[i], c, i)) return false;
  }
  return true;
}

// An item's halo: BF16 [num_frags, 3, C], contiguous, 16-byte aligned.
bool halo_ok(const at::Tensor& h, const CpItems& c, size_t i, int64_t num_frags) {
  return check_states(h, num_frags, c.xs[i]->size(-1), c.device) && !misaligned16({&h});
}

bool cp_halos(PyObject* obj, const CpItems& c, int64_t num_frags, std::vector<const at::Tensor*>* out) {
  if (!as_tensors(obj, false, c.xs.size(), out)) return false;
  for (size_t i = 0; i < out->size(); ++i) {
    if (!halo_ok(*(*out)[i], c, i, num_frags)) return false;
  }
  return true;
}

// A context table: int32 1-D contiguous on `device`, of `numel` entries (any count when < 0).
bool table_ok(const at::Tensor& t, int64_t numel, int device) {
  return t.scalar_type() == at::kInt && t.dim() == 1 && (numel < 0 || t.numel() == numel) && usable_on(t, device);
}

bool cp_table(PyObject* obj, int64_t numel, int device, const at::Tensor** out) {
  return as_tensor(obj, false, out) && table_ok(**out, numel, device);
}

// Exchanged rows: `dtype` [rows, c.total_c], contiguous, 16-byte aligned, on c's device.
bool exchanged_ok(const at::Tensor& t, const CpItems& c, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.dim() == 2 && t.size(1) == c.total_c && usable_on(t, c.device) &&
         !misaligned16({&t});
}

bool cp_exchanged(PyObject* obj, const CpItems& c, at::ScalarType dtype, const at::Tensor** out) {
  return as_tensor(obj, false, out) && exchanged_ok(**out, c, dtype);
}

// The context's tables (CPContext), checked against each other on `device`.
struct CpTables {
  const at::Tensor *cu_seqlens, *export_rows, *import_rows, *frag_info, *head_frags, *tail_frags, *g_rows, *g_import;
};

bool tables_ok(const CpTables& t, int device) {
  if (!table_ok(*t.cu_seqlens, -1, device) || t.cu_seqlens->numel() < 1) return false;
  const int64_t F = t.cu_seqlens->numel() - 1;
  return table_ok(*t.frag_info, F, device) && table_ok(*t.import_rows, 3 * F, device) &&
         table_ok(*t.g_import, 3 * F, device) && table_ok(*t.export_rows, -1, device) &&
         table_ok(*t.head_frags, -1, device) && table_ok(*t.tail_frags, -1, device) && table_ok(*t.g_rows, -1, device);
}

// The pass-specific arguments of one CP launch; the rest comes from the item.
struct CpPass {
  int pass = 0;
  const at::Tensor *dy = nullptr, *out = nullptr, *halo = nullptr, *cu_seqlens = nullptr, *frag_info = nullptr,
                   *frags = nullptr, *g_rows = nullptr, *g_import = nullptr, *import_rows = nullptr;
  intptr_t g_out = 0, g_in = 0, received = 0;
  int64_t g_ld = 0, g_in_rows = 0, received_ld = 0, received_rows = 0;
  int round_preact = 1;
};

// Launches pass p of item i on `stream` (causal_conv1d_cp_entry checks the rest).
void run_cp_pass(const CpItems& c, size_t i, const CpPass& p, intptr_t stream) {
  at::Tensor weight_copy, bias_copy;
  CpArgs a{};
  a.pass = p.pass;
  a.x = address(c.xs[i]);
  a.dy = address(p.dy);
  a.out = address(p.out);
  a.weight = aligned_param(c.weights[i], &weight_copy);
  a.bias = aligned_param(c.biases[i], &bias_copy);
  a.cu_seqlens = address(p.cu_seqlens);
  a.halo = address(p.halo);
  a.frag_info = address(p.frag_info);
  a.frags = address(p.frags);
  a.g_rows = address(p.g_rows);
  a.g_out = p.g_out;
  a.g_in = p.g_in;
  a.g_import = address(p.g_import);
  a.received = p.received;
  a.import_rows = address(p.import_rows);
  a.g_ld = p.g_ld;
  a.g_in_rows = p.g_in_rows;
  a.received_ld = p.received_ld;
  a.received_rows = p.received_rows;
  a.S = c.S;
  a.C = c.xs[i]->size(-1);
  a.num_frags = p.frag_info->numel();
  a.num_items = p.g_rows ? p.g_rows->numel() : p.frags ? p.frags->numel() : 0;
  a.round_preact = p.round_preact;
  a.device = c.device;
  a.stream = stream;
  check_launch(c.modules[i], kCp, c.modules[i].cp(&a));
}

// The phases, on the current stream of the items' device.

// The forward's exchange buffers: (send: the rows other ranks' halos need, [export_rows.numel(),
// total C] BF16, each x's columns side by side; received: [recv_rows + 1, total C], the first
// recv_rows for the exchange to fill; the last, import_rows' "before the document", is never read:
// the heads pass gives zeros for it).
std::pair<at::Tensor, at::Tensor> send_phase(const CpItems& c, const at::Tensor& export_rows, int64_t recv_rows) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (const at::Tensor* x : c.xs) parts.push_back(at::index_select(x->view({c.S, x->size(-1)}), 0, export_rows));
  at::Tensor send = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
  at::Tensor received = at::empty({recv_rows + 1, c.total_c}, c.xs[0]->options());
  return {std::move(send), std::move(received)};
}

// y of every item, each fragment read as a document (the head rows of continuing fragments still
// to fix).
std::vector<at::Tensor> forward_phase(const CpItems& c, const at::Tensor& cu_seqlens) {
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    ForwardCall f{};
    f.x = c.xs[i], f.weight = c.weights[i], f.cu_seqlens = &cu_seqlens, f.bias = c.biases[i];
    if (!check_forward(&f, kBwdMaxS, kBwdMaxElements)) {  // (accepted by check_items: sets what run_forward reads)
      throw std::runtime_error(std::string(kCp) + ": internal error: the forward declined a checked item");
    }
    ys.push_back(run_forward(f));
  }
  return ys;
}

// Each item's halo [num_frags, 3, C]: the rows of the fragments that continue their documents
// (head_frags) gathered from the received rows (its columns of them), the others not written (no
// pass reads them); and with it y of those fragments' head rows rewritten. One launch per item,
// none without such fragments.
std::vector<at::Tensor> heads_phase(const CpItems& c, const std::vector<const at::Tensor*>& ys,
                                    const at::Tensor& received, const at::Tensor& import_rows,
                                    const at::Tensor& cu_seqlens, const at::Tensor& frag_info,
                                    const at::Tensor& head_frags) {
  const int64_t F = frag_info.numel();
  const intptr_t stream = current_stream(c.device);
  std::vector<at::Tensor> halos;
  int64_t at_c = 0;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    const int64_t C = c.xs[i]->size(-1);
    at::Tensor halo = at::empty({F, 3, C}, c.xs[i]->options());
    if (c.S > 0 && head_frags.numel() > 0) {
      CpPass p;
      p.pass = flashinfer_cake::kCpFwdHeads, p.out = ys[i], p.halo = &halo, p.cu_seqlens = &cu_seqlens;
      p.frag_info = &frag_info, p.frags = &head_frags, p.import_rows = &import_rows;
      p.received = address(&received) + 2 * at_c, p.received_ld = received.size(1);
      p.received_rows = std::max<int64_t>(received.size(0) - 1, 0);
      run_cp_pass(c, i, p, stream);
    }
    halos.push_back(std::move(halo));
    at_c += C;
  }
  return halos;
}

// The backward's exchange buffers, FP32: (send [g_rows.numel(), total C]: the g of the head tokens
// other ranks need, each item's columns side by side; received: [recv_rows, total C], which the
// exchange fills).
std::pair<at::Tensor, at::Tensor> grad_send_phase(const CpItems& c, const std::vector<const at::Tensor*>& dys,
                                                  const std::vector<const at::Tensor*>& halos,
                                                  const at::Tensor& cu_seqlens, const at::Tensor& frag_info,
                                                  const at::Tensor& g_rows, int64_t recv_rows, int round_preact) {
  at::Tensor send, received;
  {
    const c10::DeviceGuard guard(c.xs[0]->device());
    const auto options = c.xs[0]->options().dtype(at::kFloat);
    send = at::empty({g_rows.numel(), c.total_c}, options);
    received = at::empty({recv_rows, c.total_c}, options);
  }
  if (send.numel() > 0) {  // (the pass takes no empty buffer)
    const intptr_t stream = current_stream(c.device);
    int64_t at_c = 0;
    for (size_t i = 0; i < c.xs.size(); ++i) {
      CpPass p;
      p.pass = flashinfer_cake::kCpBwdHeads, p.dy = dys[i], p.halo = halos[i], p.cu_seqlens = &cu_seqlens;
      p.frag_info = &frag_info, p.g_rows = &g_rows;
      p.g_out = address(&send) + 4 * at_c, p.g_ld = c.total_c, p.round_preact = round_preact;
      run_cp_pass(c, i, p, stream);
      at_c += c.xs[i]->size(-1);
    }
  }
  return {std::move(send), std::move(received)};
}

// The main backward of every item, its halo as the fragments' initial states (with frag_info: the
// fragments at offset 0 run as plain documents), dinit discarded (dx of the tail rows of
// continuing fragments still to fix): dx, dweight, dbias (undefined without bias).
std::vector<Grads> backward_phase(const CpItems& c, const std::vector<const at::Tensor*>& dys,
                                  const std::vector<const at::Tensor*>& halos, const at::Tensor& cu_seqlens,
                                  const at::Tensor& frag_info, int round_preact) {
  std::vector<Grads> grads;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    BackwardCall b{c.xs[i],  c.weights[i], &cu_seqlens, dys[i],  c.biases[i], halos[i], nullptr,
                   nullptr, nullptr,      nullptr,     nullptr, nullptr,     round_preact, &frag_info};
    if (!check_backward(&b)) {
      throw std::runtime_error(std::string(kCp) + ": internal error: the backward declined a checked item");
    }
    grads.push_back(run_backward(b));
  }
  return grads;
}

// dx of the tail rows of the fragments whose documents go on (tail_frags), rewritten with the
// received head g (FP32 [rows, total C], each item's columns side by side).
void tails_phase(const CpItems& c, const std::vector<const at::Tensor*>& dxs, const std::vector<const at::Tensor*>& dys,
                 const std::vector<const at::Tensor*>& halos, const at::Tensor& received, const at::Tensor& cu_seqlens,
                 const at::Tensor& frag_info, const at::Tensor& tail_frags, const at::Tensor& g_import,
                 int round_preact) {
  if (c.S == 0) return;
  const intptr_t stream = current_stream(c.device);
  int64_t at_c = 0;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    CpPass p;
    p.pass = flashinfer_cake::kCpBwdTails, p.dy = dys[i], p.out = dxs[i], p.halo = halos[i];
    p.cu_seqlens = &cu_seqlens, p.frag_info = &frag_info, p.frags = &tail_frags, p.g_import = &g_import;
    p.g_in = address(&received) + 4 * at_c, p.g_ld = c.total_c, p.g_in_rows = received.size(0);
    p.round_preact = round_preact;
    run_cp_pass(c, i, p, stream);
    at_c += c.xs[i]->size(-1);
  }
}

#if CAKE_C10D
// Releases the GIL while it lives (the caller holds it), so that other Python threads run while a
// collective blocks this one.
class WithoutGil {
 public:
  WithoutGil() : state_(PyEval_SaveThread()) {}
  ~WithoutGil() { PyEval_RestoreThread(state_); }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* const state_;
};

// The process group's all_to_all of rows: all_to_all_single where it has one (torch 2.13), else
// alltoall_base (deprecated there).
template <class Group, class = void>
struct HasAllToAllSingle : std::false_type {};
template <class Group>
struct HasAllToAllSingle<Group, std::void_t<decltype(std::declval<Group&>().all_to_all_single(
                                    std::declval<at::Tensor&>(), std::declval<at::Tensor&>(),
                                    std::declval<std::vector<int64_t>&>(), std::declval<std::vector<int64_t>&>()))>>
    : std::true_type {};

template <class Group>
c10::intrusive_ptr<c10d::Work> all_to_all_single(Group& group, at::Tensor& out, at::Tensor& in,
                                                 std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  if constexpr (HasAllToAllSingle<Group>::value) {
    return group.all_to_all_single(out, in, out_splits, in_splits);
  } else {
    return group.alltoall_base(out, in, out_splits, in_splits);
  }
}

// One all_to_all of rows on `group` (the current stream waits for it at work->wait()): send's rows,
// send_splits[t] for rank t, into received's first rows, recv_splits[s] from rank s.
c10::intrusive_ptr<c10d::Work> exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor received,
                                        at::Tensor send, std::vector<int64_t> recv_splits,
                                        std::vector<int64_t> send_splits) {
  at::Tensor head = received.narrow(0, 0, sum_of(recv_splits));
  return all_to_all_single(*group, head, send, recv_splits, send_splits);
}

// Pointers into a vector of tensors (null for an undefined one: a bias of None).
std::vector<const at::Tensor*> pointers(const std::vector<at::Tensor>& ts) {
  std::vector<const at::Tensor*> out;
  for (const at::Tensor& t : ts) out.push_back(t.defined() ? &t : nullptr);
  return out;
}

// The autograd node of a CP call (n items): saves the items' x, weight, bias and halo and the
// context's tables; gradients for x, weight and bias of every item, in that order. Passes an
// incoming gradient through when the passes read it as it is (BF16 contiguous, 16-byte aligned),
// else materializes it (zeros when undefined); is not itself differentiable.
struct CakeCPConvBackward final : Node {
  std::vector<SavedVariable> xs, weights, biases, halos;  // a bias of None: default-constructed
  at::Tensor cu_seqlens, frag_info, tail_frags, g_rows, g_import;  // the context's tables (no gradient)
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<int64_t> g_send_splits, g_recv_splits;
  int round_preact = 1;

  std::string name() const override { return "CakeCPConvBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* v : {&xs, &weights, &biases, &halos}) {
      for (SavedVariable& s : *v) s.reset_data();
    }
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto unpack = [](std::vector<SavedVariable>& v) {
      std::vector<at::Tensor> out;
      for (SavedVariable& s : v) out.push_back(s.unpack());
      return out;
    };
    const std::vector<at::Tensor> x = unpack(xs), w = unpack(weights), b = unpack(biases), h = unpack(halos);
    const size_t n = x.size();
    variable_list out(3 * n);
    {
      at::NoGradGuard no_grad;
      CpItems c;
      c.xs = pointers(x), c.weights = pointers(w), c.biases = pointers(b);
      if (!check_items(cu_seqlens, &c)) {
        throw std::runtime_error(std::string(kCp) + ": internal error: the backward declined the forward's saved "
                                 "tensors (please report it, with the arguments' dtypes, shapes and devices)");
      }
      std::vector<at::Tensor> dy(n);
      for (size_t i = 0; i < n; ++i) {
        dy[i] = grads[i];
        if (!dy[i].defined()) {
          dy[i] = at::zeros(x[i].sizes(), x[i].options());
        } else if (!rows_ok(dy[i], c, i)) {
          dy[i] = at::empty(x[i].sizes(), x[i].options()).copy_(dy[i]);
        }
      }
      const std::vector<const at::Tensor*> dys = pointers(dy), hs = pointers(h);
      auto [send, received] = grad_send_phase(c, dys, hs, cu_seqlens, frag_info, g_rows, sum_of(g_recv_splits),
                                              round_preact);
      const auto work = exchange(group, received, send, g_recv_splits, g_send_splits);
      std::vector<Grads> g = backward_phase(c, dys, hs, cu_seqlens, frag_info, round_preact);  // overlaps the exchange
      work->wait();
      std::vector<at::Tensor> dx;
      for (Grads& gi : g) dx.push_back(gi.dx);
      tails_phase(c, pointers(dx), dys, hs, received, cu_seqlens, frag_info, tail_frags, g_import, round_preact);
      for (size_t i = 0; i < n; ++i) {
        out[i] = std::move(g[i].dx), out[n + i] = std::move(g[i].dweight), out[2 * n + i] = std::move(g[i].dbias);
      }
    }
    return not_differentiable(std::move(out), kCp);
  }
};

// cp_autograd_forward(xs, weights, biases, received, (cu_seqlens, export_rows, import_rows,
// frag_info, head_frags, tail_frags, g_rows, g_import), num_tokens, group_name, (halo_send_splits,
// halo_recv_splits, g_send_splits, g_recv_splits), silu_grad_preactivation) -> (ys, received): the call's forward,
// recorded for autograd when grad mode is on and an x, weight or bias requires grad. received:
// None to exchange the halo rows (returned for a recompute handle to keep), or the rows an earlier
// run received (the recomputation under activation checkpointing: nothing is exchanged). None when
// declined (the xs' rows must be the context's num_tokens: export_rows index them).
PyObject* cp_autograd_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_autograd_forward", nargs, 9)) return nullptr;
  CpItems c;
  CpTables t{};
  std::vector<int64_t> splits[4];
  const at::Tensor* given = nullptr;
  int64_t num_tokens;
  PyObject* tables = args[4];
  PyObject* split_tuple = args[7];
  const int round_preact = round_preact_of(args[8]);
  if (!PyTuple_Check(tables) || PyTuple_GET_SIZE(tables) != 8 || !as_int(args[5], 0, kBwdMaxS - 1, &num_tokens) ||
      !PyUnicode_Check(args[6]) || !PyTuple_Check(split_tuple) || PyTuple_GET_SIZE(split_tuple) != 4 ||
      round_preact < 0) {
    Py_RETURN_NONE;
  }
  const at::Tensor** table_fields[8] = {&t.cu_seqlens, &t.export_rows, &t.import_rows, &t.frag_info,
                                        &t.head_frags, &t.tail_frags, &t.g_rows,    &t.g_import};
  for (int i = 0; i < 8; ++i) {
    if (!as_tensor(PyTuple_GET_ITEM(tables, i), false, table_fields[i])) Py_RETURN_NONE;
  }
  for (int i = 0; i < 4; ++i) {
    if (!as_splits(PyTuple_GET_ITEM(split_tuple, i), &splits[i])) Py_RETURN_NONE;
  }
  const auto& [halo_send_splits, halo_recv_splits, g_send_splits, g_recv_splits] = splits;
  if (!cp_items(args[0], args[1], args[2], *t.cu_seqlens, &c) || c.S != num_tokens || !tables_ok(t, c.device) ||
      sum_of(halo_send_splits) != t.export_rows->numel() || sum_of(g_send_splits) != t.g_rows->numel() ||
      !as_tensor(args[3], true, &given) ||
      (given && !(exchanged_ok(*given, c, at::kBFloat16) && given->size(0) == sum_of(halo_recv_splits) + 1))) {
    Py_RETURN_NONE;
  }
  for (size_t i = 0; i < c.xs.size(); ++i) {
    const at::Tensor bias = c.biases[i] ? *c.biases[i] : at::Tensor();
    TORCH_CHECK_NOT_IMPLEMENTED(!torch::autograd::isFwGradDefined(*c.xs[i]) &&
                                    !torch::autograd::isFwGradDefined(*c.weights[i]) &&
                                    !torch::autograd::isFwGradDefined(bias),
                                kCp, ": forward-mode AD (dual tensors, torch.func.jvp) is not supported");
  }
  const char* group_name = PyUnicode_AsUTF8(args[6]);
  if (!group_name) return nullptr;
  const auto group = c10d::resolve_process_group(group_name);
  std::vector<at::Tensor> ys, halos;
  at::Tensor received;
  {
    at::NoGradGuard no_grad;  // as a Function's forward: nothing in it is recorded
    c10::intrusive_ptr<c10d::Work> work;
    if (given) {
      received = *given;
    } else {
      at::Tensor send;
      std::tie(send, received) = send_phase(c, *t.export_rows, sum_of(halo_recv_splits));
      const WithoutGil unlocked;  // a collective may block (a lazy NCCL communicator's setup, a blocking wait)
      work = exchange(group, received, send, halo_recv_splits, halo_send_splits);
    }
    ys = forward_phase(c, *t.cu_seqlens);  // overlaps the exchange
    if (work) {
      const WithoutGil unlocked;
      work->wait();
    }
    halos = heads_phase(c, pointers(ys), received, *t.import_rows, *t.cu_seqlens, *t.frag_info, *t.head_frags);
  }
  std::vector<at::Tensor> x, w, b;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    x.push_back(*c.xs[i]), w.push_back(*c.weights[i]), b.push_back(c.biases[i] ? *c.biases[i] : at::Tensor());
  }
  if (torch::autograd::compute_requires_grad(x, w, b)) {
    auto node = make_node<CakeCPConvBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
    for (size_t i = 0; i < x.size(); ++i) {
      node->xs.emplace_back(x[i], false);
      node->weights.emplace_back(w[i], false);
      node->biases.emplace_back(b[i], false);
      node->halos.emplace_back(halos[i], false);
    }
    node->cu_seqlens = *t.cu_seqlens, node->frag_info = *t.frag_info, node->tail_frags = *t.tail_frags;
    node->g_rows = *t.g_rows;
    node->g_import = *t.g_import, node->group = group, node->g_send_splits = g_send_splits;
    node->g_recv_splits = g_recv_splits, node->round_preact = round_preact;
    torch::autograd::set_history(ys, node);
  }
  return tuple_of({tensor_tuple(std::move(ys)), THPVariable_Wrap(std::move(received))});
  END_HANDLE_TH_ERRORS
}

#endif  // CAKE_C10D

// The phases one by one, for tests (see above).

// cp_send(xs, export_rows, recv_rows) -> (send, received) (send_phase).
PyObject* cp_send(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_send", nargs, 3)) return nullptr;
  CpItems c;
  const at::Tensor* export_rows;
  int64_t recv_rows;
  if (!as_tensors(args[0], false, -1, &c.xs) || !as_int(args[2], 0, kMaxCuSeqlens, &recv_rows)) Py_RETURN_NONE;
  for (size_t i = 0; i < c.xs.size(); ++i) {
    int64_t S, C;
    int d;
    if (!check_x(*c.xs[i], kBwdMaxS, kBwdMaxElements, &S, &C, &d) || !c.xs[i]->is_contiguous() ||
        (i > 0 && (S != c.S || d != c.device))) {
      Py_RETURN_NONE;
    }
    c.S = S, c.device = d, c.total_c += C;
  }
  if (!cp_table(args[1], -1, c.device, &export_rows)) Py_RETURN_NONE;
  auto [send, received] = send_phase(c, *export_rows, recv_rows);
  return tensor_tuple({std::move(send), std::move(received)});
  END_HANDLE_TH_ERRORS
}

// cp_forward(xs, weights, biases, cu_seqlens) -> ys (forward_phase).
PyObject* cp_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_forward", nargs, 4)) return nullptr;
  CpItems c;
  const at::Tensor* cu;
  if (!as_tensor(args[3], false, &cu) || !cp_items(args[0], args[1], args[2], *cu, &c)) Py_RETURN_NONE;
  return tensor_tuple(forward_phase(c, *cu));
  END_HANDLE_TH_ERRORS
}

// cp_forward_heads(ys, xs, weights, biases, received, import_rows, cu_seqlens, frag_info, head_frags)
// -> halos (heads_phase).
PyObject* cp_forward_heads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_forward_heads", nargs, 9)) return nullptr;
  CpItems c;
  std::vector<const at::Tensor*> ys;
  const at::Tensor *received, *import_rows, *cu, *frag_info, *head_frags;
  if (!as_tensor(args[6], false, &cu) || !cp_items(args[1], args[2], args[3], *cu, &c) || !cp_rows(args[0], c, &ys) ||
      !cp_exchanged(args[4], c, at::kBFloat16, &received) || !cp_table(args[7], cu->numel() - 1, c.device, &frag_info) ||
      !cp_table(args[5], 3 * frag_info->numel(), c.device, &import_rows) ||
      !cp_table(args[8], -1, c.device, &head_frags)) {
    Py_RETURN_NONE;
  }
  return tensor_tuple(heads_phase(c, ys, *received, *import_rows, *cu, *frag_info, *head_frags));
  END_HANDLE_TH_ERRORS
}

// cp_grad_send(xs, dys, weights, biases, halos, cu_seqlens, frag_info, g_rows, recv_rows,
// silu_grad_preactivation) -> (send, received) (grad_send_phase).
PyObject* cp_grad_send(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_grad_send", nargs, 10)) return nullptr;
  CpItems c;
  std::vector<const at::Tensor*> dys, halos;
  const at::Tensor *cu, *frag_info, *g_rows;
  int64_t recv_rows;
  const int round_preact = round_preact_of(args[9]);
  if (!as_tensor(args[5], false, &cu) || !cp_items(args[0], args[2], args[3], *cu, &c) || !cp_rows(args[1], c, &dys) ||
      !cp_table(args[6], cu->numel() - 1, c.device, &frag_info) || !cp_halos(args[4], c, frag_info->numel(), &halos) ||
      !cp_table(args[7], -1, c.device, &g_rows) || !as_int(args[8], 0, kMaxCuSeqlens, &recv_rows) ||
      round_preact < 0) {
    Py_RETURN_NONE;
  }
  auto [send, received] = grad_send_phase(c, dys, halos, *cu, *frag_info, *g_rows, recv_rows, round_preact);
  return tensor_tuple({std::move(send), std::move(received)});
  END_HANDLE_TH_ERRORS
}

// cp_backward(xs, dys, weights, biases, halos, cu_seqlens, frag_info, silu_grad_preactivation) ->
// (*dxs, *dweights, *dbiases), a dbias None without bias (backward_phase).
PyObject* cp_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_backward", nargs, 8)) return nullptr;
  CpItems c;
  std::vector<const at::Tensor*> dys, halos;
  const at::Tensor *cu, *frag_info;
  const int round_preact = round_preact_of(args[7]);
  if (!as_tensor(args[5], false, &cu) || !cp_items(args[0], args[2], args[3], *cu, &c) || !cp_rows(args[1], c, &dys) ||
      !cp_table(args[6], cu->numel() - 1, c.device, &frag_info) || !cp_halos(args[4], c, frag_info->numel(), &halos) ||
      round_preact < 0) {
    Py_RETURN_NONE;
  }
  std::vector<Grads> g = backward_phase(c, dys, halos, *cu, *frag_info, round_preact);
  const size_t n = g.size();
  std::vector<at::Tensor> out(3 * n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::move(g[i].dx), out[n + i] = std::move(g[i].dweight), out[2 * n + i] = std::move(g[i].dbias);
  }
  return tensor_tuple(std::move(out));
  END_HANDLE_TH_ERRORS
}

// cp_backward_tails(dxs, xs, dys, weights, biases, halos, received, cu_seqlens, frag_info,
// tail_frags, g_import, silu_grad_preactivation) -> True (tails_phase).
PyObject* cp_backward_tails(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!takes("cp_backward_tails", nargs, 12)) return nullptr;
  CpItems c;
  std::vector<const at::Tensor*> dxs, dys, halos;
  const at::Tensor *received, *cu, *frag_info, *tail_frags, *g_import;
  const int round_preact = round_preact_of(args[11]);
  if (!as_tensor(args[7], false, &cu) || !cp_items(args[1], args[3], args[4], *cu, &c) || !cp_rows(args[0], c, &dxs) ||
      !cp_rows(args[2], c, &dys) || !cp_table(args[8], cu->numel() - 1, c.device, &frag_info) ||
      !cp_halos(args[5], c, frag_info->numel(), &halos) || !cp_exchanged(args[6], c, at::kFloat, &received) ||
      !cp_table(args[9], -1, c.device, &tail_frags) || !cp_table(args[10], 3 * frag_info->numel(), c.device, &g_import) ||
      round_preact < 0) {
    Py_RETURN_NONE;
  }
  tails_phase(c, dxs, dys, halos, *received, *cu, *frag_info, *tail_frags, *g_import, round_preact);
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

#define CAKE_METHOD(name, doc) \
  { #name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(name)), METH_FASTCALL, doc }

PyMethodDef g_methods[] = {
    CAKE_METHOD(try_forward,
                "try_forward(x, weight, cu_seqlens, bias, initial_states, final_states_out, out, workspace) -> y, or "
                "None when declined"),
    CAKE_METHOD(try_backward,
                "try_backward(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation, "
                "workspace, dx, dweight, dbias, dinitial_states) -> (dx, dweight[, dbias][, dinitial_states]), or None "
                "when declined"),
    CAKE_METHOD(try_autograd_forward,
                "try_autograd_forward(x, weight, cu_seqlens, bias, initial_states, return_final_states, "
                "silu_grad_preactivation) -> y or (y, final_states) with cake_causal_conv1d's autograd node, or None "
                "when declined"),
#if CAKE_C10D
    CAKE_METHOD(cp_autograd_forward,
                "cp_autograd_forward(xs, weights, biases, received, tables, num_tokens, group_name, splits, "
                "silu_grad_preactivation) -> (ys, received) with the CP call's autograd node, or None when declined"),
#endif
    CAKE_METHOD(cp_send, "cp_send(xs, export_rows, recv_rows) -> (send, received), or None"),
    CAKE_METHOD(cp_forward, "cp_forward(xs, weights, biases, cu_seqlens) -> ys, or None"),
    CAKE_METHOD(cp_forward_heads,
                "cp_forward_heads(ys, xs, weights, biases, received, import_rows, cu_seqlens, frag_info, head_frags) -> "
                "halos, or None"),
    CAKE_METHOD(cp_grad_send,
                "cp_grad_send(xs, dys, weights, biases, halos, cu_seqlens, frag_info, g_rows, recv_rows, "
                "silu_grad_preactivation) -> (send, received), or None"),
    CAKE_METHOD(cp_backward,
                "cp_backward(xs, dys, weights, biases, halos, cu_seqlens, frag_info, silu_grad_preactivation) -> "
                "(*dxs, *dweights, *dbiases), or None"),
    CAKE_METHOD(cp_backward_tails,
                "cp_backward_tails(dxs, xs, dys, weights, biases, halos, received, cu_seqlens, frag_info, tail_frags, "
                "g_import, silu_grad_preactivation) -> True, or None"),
    CAKE_METHOD(register_kernel_module,
                "register_kernel_module(device, weight_dtype, bias_dtype_or_None, fwd, bwd, cp, capturing, message): "
                "a kernel module's entries"),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_torch_binding", "flashinfer_cake's torch binding", -1, g_methods};

}  // namespace

PyMODINIT_FUNC PyInit__torch_binding() { return PyModule_Create(&g_module); }
