// flashinfer_cake's torch binding: the eager call of the public functions in one C++ call.
//
// Why it exists: a call must cost at most 10 µs of host time, and reading ~30 tensor properties
// through Python plus a ctypes launch costs more than that. Here the metadata is read natively.
//
// forward() and backward() take the public function's arguments as they came from the user,
// apply every rule flashinfer_cake/_checks.py documents, allocate outputs and default workspaces
// with torch's caching allocator and call the C entry of the kernel module of the call's (device,
// weight dtype, bias dtype), which Python registers with register_module(). They return None,
// having allocated and launched nothing, whenever they decline: an argument breaks a rule, or the
// module is not registered yet. The Python layer then raises the precise error (the messages live
// in one place, _checks.py), or loads and registers the module and calls again. A launch error
// raises RuntimeError with the CUDA message.
//
// Built once per torch build by flashinfer_cake.jit.binding (CPython API + ATen, no pybind11).
// Every function runs under the GIL, which also guards this file's tables.

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <flashinfer_cake/causal_conv1d_bwd_plan.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace {

using flashinfer_cake::bwd_item_tokens;
using flashinfer_cake::bwd_workspace_bytes;

constexpr int kMaxDevices = 64;  // launch_common.cuh's kMaxDevices
// The forward's workspace: two int32 token-chunk counters (kFwdWorkspaceCounters).
constexpr int64_t kFwdWorkspaceInts = 2;
// Index ranges of the kernels (_checks.MAX_S / MAX_ELEMENTS / MAX_C / MAX_CU_SEQLENS).
constexpr int64_t kFwdMaxS = int64_t(1) << 31, kFwdMaxElements = int64_t(1) << 35;
constexpr int64_t kBwdMaxS = int64_t(1) << 30, kBwdMaxElements = int64_t(1) << 34;
constexpr int64_t kMaxC = int64_t(1) << 28, kMaxCuSeqlens = (int64_t(1) << 31) - 1;

using Entry = int (*)(const void* packed_int64_args);
using Capturing = int (*)(const void* stream);
using Message = const char* (*)();

// A kernel module's C entries (see flashinfer_cake.jit.variant._SOURCE).
struct Module {
  Entry fwd = nullptr;
  Entry bwd = nullptr;
  Capturing capturing = nullptr;
  Message message = nullptr;
};

// [device][weight: fp32, bf16][bias: none, fp32, bf16]; a null entry = not registered.
Module g_modules[kMaxDevices][2][3];
// torch._C._cuda_getCurrentRawStream (None in a CPU-only torch: nothing reaches a launch there).
PyObject* g_current_stream = nullptr;
// (0 forward | 1 backward, device, stream) -> the default workspace of calls without one. Never
// destroyed: freeing CUDA memory from a static destructor at exit would race torch's teardown.
auto* const g_workspaces = new std::map<std::tuple<int, int, intptr_t>, at::Tensor>();

// Parameter dtype codes: weight 0 fp32 / 1 bf16; bias 0 none / 1 fp32 / 2 bf16; -1 otherwise.
int param_code(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? 0 : t.scalar_type() == at::kBFloat16 ? 1 : -1;
}

// The tensor of a Python argument: false when it is neither a tensor nor (if allowed) None. The
// type itself is checked (THPVariable_Check also takes objects that only claim the class, e.g.
// mocks, whose memory is no tensor).
bool as_tensor(PyObject* obj, bool optional, const at::Tensor** out) {
  if (obj == Py_None) {
    *out = nullptr;
    return optional;
  }
  if (!PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass))) return false;
  *out = &THPVariable_Unpack(obj);
  return true;
}

// Contiguous, no lazy negation or conjugation (_checks.check_not_lazy), on CUDA device `device`.
bool usable_on(const at::Tensor& t, int device) {
  return t.is_contiguous() && !t.is_neg() && !t.is_conj() && t.is_cuda() && t.get_device() == device;
}

// x: BF16 [S, C] or [1, S, C], contiguous, on a CUDA device, C a positive multiple of 8, within
// (max_s, max_elements).
bool check_x(const at::Tensor& x, int64_t max_s, int64_t max_elements, int64_t* S, int64_t* C, int* device) {
  if (x.scalar_type() != at::kBFloat16 || !x.is_contiguous() || x.is_neg() || x.is_conj() || !x.is_cuda()) {
    return false;
  }
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
         *device < kMaxDevices;
}

// weight FP32/BF16 [C, 4], bias None or FP32/BF16 [C], cu_seqlens int32 [num_docs + 1], all
// contiguous on `device`. Sets the dtype codes.
bool check_params(const at::Tensor& weight, const at::Tensor& cu_seqlens, const at::Tensor* bias, int64_t C,
                  int device, int* w, int* b) {
  *w = param_code(weight);
  if (*w < 0 || weight.dim() != 2 || weight.size(0) != C || weight.size(1) != 4 || !usable_on(weight, device)) {
    return false;
  }
  if (cu_seqlens.scalar_type() != at::kInt || cu_seqlens.dim() != 1 || cu_seqlens.size(0) < 1 ||
      cu_seqlens.size(0) > kMaxCuSeqlens || !usable_on(cu_seqlens, device)) {
    return false;
  }
  *b = 0;
  if (bias) {
    *b = param_code(*bias) + 1;
    if (*b < 1 || bias->dim() != 1 || bias->size(0) != C || !usable_on(*bias, device)) return false;
  }
  return true;
}

// t: exactly like `like` (dtype and shape), contiguous, on `device`.
bool check_like(const at::Tensor& t, const at::Tensor& like, int device) {
  return t.scalar_type() == like.scalar_type() && t.sizes() == like.sizes() && usable_on(t, device);
}

// A contiguous 1-D workspace of `dtype` with at least `need` bytes on `device`.
bool check_workspace(const at::Tensor& ws, at::ScalarType dtype, int64_t need, int device) {
  return ws.scalar_type() == dtype && ws.dim() == 1 && ws.numel() * ws.element_size() >= need &&
         usable_on(ws, device);
}

intptr_t address(const at::Tensor* t) { return t ? reinterpret_cast<intptr_t>(t->data_ptr()) : 0; }

int64_t nbytes(const at::Tensor* t) { return t ? t->numel() * int64_t(t->element_size()) : 0; }

bool overlaps(const at::Tensor* a, const at::Tensor* b) {
  const int64_t na = nbytes(a), nb = nbytes(b);
  if (!na || !nb) return false;
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

// The current stream of `device` (torch's, the one the caller's work is ordered on).
bool current_stream(int device, intptr_t* stream) {
  if (!g_current_stream || g_current_stream == Py_None) {
    PyErr_SetString(PyExc_RuntimeError, "flashinfer_cake: this torch build has no CUDA streams");
    return false;
  }
  PyObject* index = PyLong_FromLong(device);
  if (!index) return false;
  PyObject* handle = PyObject_Vectorcall(g_current_stream, &index, 1, nullptr);
  Py_DECREF(index);
  if (!handle) return false;
  *stream = reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(handle));
  Py_DECREF(handle);
  return !PyErr_Occurred();
}

// Whether `stream` captures a CUDA graph; -1 with a Python error set when the query failed.
int capturing(const Module& m, intptr_t stream, const char* fn) {
  const int status = m.capturing(reinterpret_cast<const void*>(stream));
  if (status < 0) PyErr_Format(PyExc_RuntimeError, "%s: cudaStreamIsCapturing failed: %s", fn, m.message());
  return status;
}

// The workspace of a call without one: kept per (kind, device, stream), replaced by a larger one
// when a call needs more; a buffer of the call's own while the stream captures a CUDA graph (the
// graph replays with it: never shared with eager calls or other graphs). A replaced buffer may
// still be in use by the stream's queued work: the caching allocator hands its memory out again
// only in the stream's order.
bool default_workspace(const Module& m, int kind, int device, intptr_t stream, int64_t elements,
                       const at::TensorOptions& options, const char* fn, at::Tensor* ws) {
  const int status = capturing(m, stream, fn);
  if (status < 0) return false;
  if (status) {  // zero, as every launch leaves a workspace
    *ws = at::zeros({elements}, options);
    return true;
  }
  at::Tensor& kept = (*g_workspaces)[{kind, device, stream}];
  if (!kept.defined() || kept.numel() < elements) kept = at::zeros({elements}, options);
  *ws = kept;
  return true;
}

// A caller's tensor the kernel writes: its version moves, as with an in-place op, so autograd
// refuses a saved tensor that changed (and an inference tensor outside inference mode raises).
void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

PyObject* launch_failed(const Module& m, const char* fn, int rc) {
  PyErr_Format(PyExc_RuntimeError, "%s: launch failed with CUDA error %d: %s", fn, rc, m.message());
  return nullptr;
}

// register_module(device, weight code, bias code, fwd, bwd, capturing, message): the addresses of
// a loaded kernel module's C entries.
PyObject* register_module(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "register_module takes 7 arguments");
    return nullptr;
  }
  long v[3];
  for (int i = 0; i < 3; ++i) {
    v[i] = PyLong_AsLong(args[i]);
    if (PyErr_Occurred()) return nullptr;
  }
  void* p[4];
  for (int i = 0; i < 4; ++i) {
    p[i] = PyLong_AsVoidPtr(args[3 + i]);
    if (PyErr_Occurred()) return nullptr;
  }
  if (v[0] < 0 || v[0] >= kMaxDevices || v[1] < 0 || v[1] > 1 || v[2] < 0 || v[2] > 2 || !p[0] || !p[1] || !p[2] ||
      !p[3]) {
    PyErr_SetString(PyExc_ValueError, "register_module: device, dtype code or entry address out of range");
    return nullptr;
  }
  g_modules[v[0]][v[1]][v[2]] = {reinterpret_cast<Entry>(p[0]), reinterpret_cast<Entry>(p[1]),
                                 reinterpret_cast<Capturing>(p[2]), reinterpret_cast<Message>(p[3])};
  Py_RETURN_NONE;
}

// set_stream_getter(torch._C._cuda_getCurrentRawStream or None)
PyObject* set_stream_getter(PyObject*, PyObject* getter) {
  Py_XSETREF(g_current_stream, Py_NewRef(getter));
  Py_RETURN_NONE;
}

// backward_plan(S, C) -> (item_tokens, workspace bytes): the backward's token groups
// (causal_conv1d_bwd_plan.h), for the Python workspace functions and the tools.
PyObject* backward_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "backward_plan takes 2 arguments");
    return nullptr;
  }
  const long long S = PyLong_AsLongLong(args[0]);
  if (PyErr_Occurred()) return nullptr;
  const long long C = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (S < 0 || S >= kBwdMaxS || C <= 0 || C >= kMaxC || S * C >= kBwdMaxElements) {
    PyErr_Format(PyExc_ValueError, "backward_plan: (S, C) = (%lld, %lld) is outside the backward's range", S, C);
    return nullptr;
  }
  return Py_BuildValue("(LL)", static_cast<long long>(bwd_item_tokens(S, C)),
                       static_cast<long long>(bwd_workspace_bytes(S, C)));
}

constexpr const char* kFwd = "cake_causal_conv1d_train_forward";
constexpr const char* kBwd = "cake_causal_conv1d_train_backward";

// forward(x, weight, cu_seqlens, bias, out, workspace) -> y, or None when declined.
PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "forward takes 6 arguments");
    return nullptr;
  }
  const at::Tensor *x, *weight, *cu_seqlens, *bias, *out, *workspace;
  if (!as_tensor(args[0], false, &x) || !as_tensor(args[1], false, &weight) ||
      !as_tensor(args[2], false, &cu_seqlens) || !as_tensor(args[3], true, &bias) ||
      !as_tensor(args[4], true, &out) || !as_tensor(args[5], true, &workspace)) {
    Py_RETURN_NONE;
  }
  int64_t S, C;
  int device, w, b;
  if (!check_x(*x, kFwdMaxS, kFwdMaxElements, &S, &C, &device) ||
      !check_params(*weight, *cu_seqlens, bias, C, device, &w, &b) || (out && !check_like(*out, *x, device)) ||
      (workspace && !check_workspace(*workspace, at::kInt, 4 * kFwdWorkspaceInts, device))) {
    Py_RETURN_NONE;
  }
  const Module& m = g_modules[device][w][b];
  if (!m.fwd) Py_RETURN_NONE;
  if (S == 0) return out ? Py_NewRef(args[4]) : THPVariable_Wrap(at::empty(x->sizes(), x->options()));
  // out is written while x, the parameters and cu_seqlens are read; the workspace stays as it is.
  if ((address(x) | address(out)) & 15 || overlaps(out, x) || overlaps(out, weight) || overlaps(out, bias) ||
      overlaps(out, cu_seqlens) || overlaps(out, workspace)) {
    Py_RETURN_NONE;
  }

  at::Tensor weight_copy, bias_copy, y, ws;
  const intptr_t w_ptr = aligned_param(weight, &weight_copy);
  const intptr_t b_ptr = aligned_param(bias, &bias_copy);
  if (!out) y = at::empty(x->sizes(), x->options());  // the allocator's blocks are 512-byte aligned
  intptr_t stream;
  if (!current_stream(device, &stream)) return nullptr;
  if (!workspace &&
      !default_workspace(m, 0, device, stream, kFwdWorkspaceInts, x->options().dtype(at::kInt), kFwd, &ws)) {
    return nullptr;
  }
  if (out) bump_version(*out);  // as an in-place op does: autograd sees the write
  // x, y, weight, bias, cu_seqlens, workspace, S, C, num_docs, device, stream
  const int64_t packed[11] = {address(x), out ? address(out) : address(&y), w_ptr, b_ptr, address(cu_seqlens),
                              workspace ? address(workspace) : address(&ws), S, C, cu_seqlens->size(0) - 1,
                              device, stream};
  const int rc = m.fwd(packed);
  if (rc) return launch_failed(m, kFwd, rc);
  return out ? Py_NewRef(args[4]) : THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx, dweight,
// dbias) -> (dx, dweight) or (dx, dweight, dbias), or None when declined.
PyObject* backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "backward takes 10 arguments");
    return nullptr;
  }
  const at::Tensor *x, *weight, *cu_seqlens, *dy, *bias, *workspace, *dx, *dweight, *dbias;
  if (!as_tensor(args[0], false, &x) || !as_tensor(args[1], false, &weight) ||
      !as_tensor(args[2], false, &cu_seqlens) || !as_tensor(args[3], false, &dy) ||
      !as_tensor(args[4], true, &bias) || !as_tensor(args[6], true, &workspace) || !as_tensor(args[7], true, &dx) ||
      !as_tensor(args[8], true, &dweight) || !as_tensor(args[9], true, &dbias)) {
    Py_RETURN_NONE;
  }
  int round_preact;
  if (PyUnicode_Check(args[5]) && PyUnicode_CompareWithASCIIString(args[5], "bf16") == 0) {
    round_preact = 1;
  } else if (PyUnicode_Check(args[5]) && PyUnicode_CompareWithASCIIString(args[5], "fp32") == 0) {
    round_preact = 0;
  } else {
    Py_RETURN_NONE;
  }
  int64_t S, C;
  int device, w, b;
  if (!check_x(*x, kBwdMaxS, kBwdMaxElements, &S, &C, &device) ||
      !check_params(*weight, *cu_seqlens, bias, C, device, &w, &b) || !check_like(*dy, *x, device) ||
      (dx && !check_like(*dx, *x, device)) || (dweight && !check_like(*dweight, *weight, device)) ||
      (dbias && (!bias || !check_like(*dbias, *bias, device)))) {
    Py_RETURN_NONE;
  }
  const int64_t need = bwd_workspace_bytes(S, C);
  if (workspace && !check_workspace(*workspace, at::kFloat, need, device)) Py_RETURN_NONE;
  const Module& m = g_modules[device][w][b];
  if (!m.bwd) Py_RETURN_NONE;
  if (S && (address(x) | address(dy) | address(dx)) & 15) Py_RETURN_NONE;
  // What the kernels write (dx, the workspace, dweight, dbias) overlaps nothing else: they read
  // x, dy, weight, bias and cu_seqlens while writing dx and the partial rows, and the reduction
  // reads the partial rows while writing dweight and dbias.
  const at::Tensor* const spans[] = {x, dy, weight, bias, cu_seqlens, workspace, dx, dweight, dbias};
  constexpr int kFirstWritten = 5;
  for (int i = kFirstWritten; i < 9; ++i) {
    for (int j = 0; j < i; ++j) {
      if (overlaps(spans[i], spans[j])) Py_RETURN_NONE;
    }
  }

  at::Tensor weight_copy, bias_copy, dx_own, dweight_own, dbias_own, ws;
  const intptr_t w_ptr = aligned_param(weight, &weight_copy);
  const intptr_t b_ptr = aligned_param(bias, &bias_copy);
  if (!dx) dx_own = at::empty(x->sizes(), x->options());
  if (!dweight) dweight_own = at::empty(weight->sizes(), weight->options());
  if (bias && !dbias) dbias_own = at::empty(bias->sizes(), bias->options());
  intptr_t stream;
  if (!current_stream(device, &stream)) return nullptr;
  if (!workspace && !default_workspace(m, 1, device, stream, flashinfer_cake::ceil_div(need, 4),
                                       x->options().dtype(at::kFloat), kBwd, &ws)) {
    return nullptr;
  }
  const at::Tensor& dx_t = dx ? *dx : dx_own;
  const at::Tensor& dweight_t = dweight ? *dweight : dweight_own;
  const at::Tensor* dbias_t = bias ? (dbias ? dbias : &dbias_own) : nullptr;
  const at::Tensor& ws_t = workspace ? *workspace : ws;
  for (const at::Tensor* t : {dx, dweight, dbias, workspace}) {  // as in-place ops do: autograd sees the writes
    if (t) bump_version(*t);
  }
  // x, dy, dx, weight, bias, cu_seqlens, workspace, workspace_bytes, dweight, dbias, S, C,
  // num_docs, item_tokens, round_preact, device, stream
  const int64_t packed[17] = {address(x), address(dy), address(&dx_t), w_ptr, b_ptr, address(cu_seqlens),
                              address(&ws_t), nbytes(&ws_t), address(&dweight_t), address(dbias_t), S, C,
                              cu_seqlens->size(0) - 1, bwd_item_tokens(S, C), round_preact, device, stream};
  const int rc = m.bwd(packed);
  if (rc) return launch_failed(m, kBwd, rc);
  // The given outputs are returned as the same Python objects.
  PyObject* items[3] = {dx ? Py_NewRef(args[7]) : THPVariable_Wrap(std::move(dx_own)),
                        dweight ? Py_NewRef(args[8]) : THPVariable_Wrap(std::move(dweight_own)),
                        !bias ? nullptr : dbias ? Py_NewRef(args[9]) : THPVariable_Wrap(std::move(dbias_own))};
  const int n = bias ? 3 : 2;
  PyObject* result = items[0] && items[1] && (n == 2 || items[2]) ? PyTuple_New(n) : nullptr;
  if (!result) {
    for (PyObject* item : items) Py_XDECREF(item);
    return nullptr;
  }
  for (int i = 0; i < n; ++i) PyTuple_SET_ITEM(result, i, items[i]);
  return result;
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_methods[] = {
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward)), METH_FASTCALL,
     "forward(x, weight, cu_seqlens, bias, out, workspace) -> y, or None when declined"},
    {"backward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(backward)), METH_FASTCALL,
     "backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx, dweight, dbias) "
     "-> (dx, dweight[, dbias]), or None when declined"},
    {"backward_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(backward_plan)), METH_FASTCALL,
     "backward_plan(S, C) -> (item_tokens, workspace bytes) of the backward"},
    {"register_module", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_module)), METH_FASTCALL,
     "register_module(device, weight_code, bias_code, fwd, bwd, capturing, message): a kernel module's entries"},
    {"set_stream_getter", set_stream_getter, METH_O,
     "set_stream_getter(fn): fn(device index) -> the current raw stream (torch._C._cuda_getCurrentRawStream)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_torch_binding", "flashinfer_cake's torch binding", -1, g_methods};

}  // namespace

PyMODINIT_FUNC PyInit__torch_binding() { return PyModule_Create(&g_module); }
