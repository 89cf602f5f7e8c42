"""The argument rules of the public functions, with their messages: host-side metadata only
(never an element of a device tensor). Checked in this order: types, then dtypes/shapes/layouts
of every argument, then devices, so a mistake is reported the same way on any device. Each
message names the argument, the expected and the received value.

These run before anything is built (a bad argument never waits for a compiler) and whenever the
torch binding declines a call: the binding applies the same rules natively, without messages, on
the warm path. The limits mirror include/flashinfer_cake/causal_conv1d_contract.h
(tests/test_contract.py compares them)."""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch.autograd import forward_ad

from . import _plan
from .jit.env import ARCH_OF_CAPABILITY

PARAM_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
SILU_GRAD_POLICIES = ("bf16", "fp32")


def check_types(fn: str, required, optional) -> None:
    """``required`` / ``optional``: (name, value) pairs; optional ones may be None. Then
    check_not_transformed: the first rule on each tensor (of a meta one too, which the later rules pass)."""
    for name, t in required:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in optional:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    check_not_transformed(fn, (*required, *optional))


def check_not_transformed(fn: str, named_tensors) -> None:
    """No (name, tensor or None) of ``named_tensors`` is a tensor of a torch.func transform (a functorch
    wrapper, without storage): NotImplementedError naming it, not a later rule's error nor torch's about
    the Function's setup_context. (Not while torch.compile traces: dynamo handles torch.func itself.)"""
    if torch.compiler.is_compiling():
        return
    for name, t in named_tensors:
        if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise NotImplementedError(f"{fn}: {name} is a tensor of a torch.func transform (grad, vmap, jvp, "
                                      f"functionalize), which "
                                      f"this library does not support: call it outside torch.func (for gradients, "
                                      f"torch.autograd: loss.backward() or torch.autograd.grad)")


def has_tangent(t) -> bool:
    """Whether ``t`` is a dual tensor of forward-mode AD (a tensor with a tangent)."""
    return isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None


# The autograd entry point's words for forward-mode AD (the binding's node says the same).
FORWARD_AD_UNSUPPORTED = "forward-mode AD (dual tensors, torch.func.jvp) is not supported"


def check_not_dual(fn: str, named_tensors) -> None:
    """The autograd entry point's forward-mode AD rule where its Function runs (tensors without
    memory): NotImplementedError naming a dual input (the binding's node refuses them for tensors
    with memory; torch's own error, from the Function's missing jvp, names none)."""
    for name, t in named_tensors:
        if has_tangent(t):
            raise NotImplementedError(f"{fn}: {FORWARD_AD_UNSUPPORTED}: {name} is a dual tensor (for y without a "
                                      f"tangent pass forward_ad.unpack_dual({name}).primal)")


def shown(v):
    """A size, shape or strides as a message shows it: while torch.compile traces with dynamic sizes
    they are SymInts, which print as symbols (s42 - 1); shown as the values this call has (their
    hints), as the eager call's message would."""
    if isinstance(v, (tuple, list)):  # torch.Size too
        return tuple(shown(e) for e in v)
    if isinstance(v, torch.SymInt) and v.node.hint is not None:
        return int(v.node.hint)
    return v


# The contract's limits (exclusive bounds but MAX_CU_SEQLENS): kFwdMaxS / kBwdMaxS,
# kFwdMaxElements / kBwdMaxElements, kMaxC, kCpMaxC, kMaxCuSeqlens, kMaxDevices, kFwdWorkspaceCounters.
MAX_S = {"forward": 2**31, "backward": 2**30}
MAX_ELEMENTS = {"forward": 2**35, "backward": 2**34}
MAX_C = 2**28
MAX_CP_C = 2**25  # kCpMaxC: channels of one context-parallel tensor
MAX_CU_SEQLENS = 2**31 - 1
MAX_DEVICES = 64
FWD_WORKSPACE_COUNTERS = 2


def check_x(fn: str, x: torch.Tensor, op: str = "forward", weight=None) -> tuple[int, int]:
    """x: BF16 [S, C] or [1, S, C] of rows (check_rows), C a multiple of 8, within the index range
    of ``op``'s kernel ("forward", or "backward": both kernels of a training step). Returns (S, C).
    ``weight`` (unchecked yet): its channel count tells whether a channels-first reading of a bad x
    fits (_channels_first_hint)."""
    shape = x.shape
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{fn}: x must have dtype torch.bfloat16, got {x.dtype}")
    if len(shape) == 2:
        S, C = shape
    elif len(shape) == 3 and shape[0] == 1:
        S, C = shape[1], shape[2]
    else:
        hint = ("; a [B, T, C] batch of equal-length sequences is x.reshape(B * T, C) with cu_seqlens "
                "torch.arange(0, B * T + 1, T, dtype=torch.int32, device=x.device)" if len(shape) == 3 else "")
        if len(shape) == 3 and shape[1] > 1 and x.stride(1) == 1 and x.stride(2) != 1:
            hint += " (Dao's channel-last [B, C, T] view: x.transpose(1, 2).reshape(B * T, C))"
        raise ValueError(f"{fn}: x must have shape [S, C] or [1, S, C], got {shown(shape)}{hint}")
    if C <= 0 or C % 8 or C >= MAX_C:
        raise ValueError(f"{fn}: x's channel count C must be a positive multiple of 8 below 2^28, got C={shown(C)}"
                         f"{_unit_stride_rows_hint('x', x) or _channels_first_hint(S, weight)}")
    max_s, max_elements = MAX_S[op], MAX_ELEMENTS[op]
    if S >= max_s or S * C >= max_elements:
        whose = "" if op == "forward" else " (the backward's range)"
        raise ValueError(
            f"{fn}: x must have S < 2^{max_s.bit_length() - 1} and S * C < 2^{max_elements.bit_length() - 1} "
            f"elements{whose}, got S={shown(S)}, C={shown(C)}"
        )
    check_rows(fn, "x", x, op)
    check_memory(fn, "x", x)
    return S, C


def _row_problem(t: torch.Tensor, op: str) -> str | None:
    """Which row rule of check_rows ``t`` breaks ("channels", "stride", "range"), None when none."""
    S, C = t.shape[-2], t.shape[-1]
    if t.stride(-1) != 1:
        return "channels"
    if S <= 1:
        return None
    stride = t.stride(-2)
    if stride < C or stride % 8:
        return "stride"
    return "range" if S * stride >= MAX_ELEMENTS[op] else None


def rows_read_as_they_are(t: torch.Tensor, x: torch.Tensor, op: str) -> bool:
    """Whether ``op``'s kernel takes ``t`` as it is where it takes a BF16 tensor of x's shape
    (check_rows_like's and _check_aligned's rules as a predicate); else a caller copies it."""
    return (t.dtype == torch.bfloat16 and t.shape == x.shape and _row_problem(t, op) is None and not t.is_neg()
            and not t.is_conj() and _aligned(t))


def states_read_as_they_are(t: torch.Tensor) -> bool:
    """Whether the kernels take conv states ``t`` as they are (check_states' dtype and layout and
    _check_aligned's rule as a predicate; the shape aside); else a caller copies them."""
    return t.dtype == torch.bfloat16 and t.is_contiguous() and not t.is_neg() and not t.is_conj() and _aligned(t)


def _unit_stride_rows_hint(name: str, t: torch.Tensor) -> str:
    """For a tensor whose dimension -2 has the unit stride (channels not contiguous), the fixes of
    its two readings; "" for any other tensor. x: either already token-major with its tokens
    contiguous (Dao's default layout transposed, or an [S, C] stored column-major: a copy) or Dao's
    channel-last [B, C, S] view itself (the transpose): the strides cannot tell which, the caller
    can. dy, out, dx (x's shape already): a copy."""
    if t.dim() < 2 or t.shape[-2] <= 1 or t.stride(-2) != 1 or t.stride(-1) == 1:
        return ""
    if name != "x":
        return f"; pass {name}.contiguous()"
    return ("; its tokens are contiguous, not its channels: if x is token-major already (x_dao.transpose(1, 2) "
            "of Dao's default contiguous [1, C, S], or an [S, C] stored column-major), pass x.contiguous(); if it "
            "is Dao's channel-last [1, C, S] view itself, pass x.transpose(-1, -2) (token-major [1, S, C])")


# The fix for a contiguous channels-first x ([C, T] / [1, C, T], e.g. Dao's layout made contiguous).
_CHANNELS_FIRST_FIX = "pass x.transpose(-1, -2).contiguous(), token-major"


def _channels_first_hint(S, weight) -> str:
    """For an x whose last dimension is no channel count but whose dimension -2 could be one (a
    positive multiple of 8 below 2^28, and the weight's C where the weight is a [C, 4] tensor): the
    channels-first reading and its fix; "" otherwise (check_params says it for a good C the weight
    contradicts; here C is checked first)."""
    weight_c = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    if 0 < S < MAX_C and S % 8 == 0 and weight_c in (None, S):
        return f"; if x is channels-first [C, T] or [1, C, T] with C={shown(S)}, {_CHANNELS_FIRST_FIX}"
    return ""


def check_rows(fn: str, name: str, t: torch.Tensor, op: str) -> None:
    """An [S, C] / [1, S, C] tensor the kernels read or write in place, row by row: contiguous
    channels (stride(-1) == 1) and, for S > 1, a row stride stride(-2) of at least C elements, a
    multiple of 8 (16 bytes, the kernels' vectors), with S * stride(-2) within ``op``'s range (a
    column slice of a wider tensor, e.g. of a fused projection, is taken without a copy)."""
    problem = _row_problem(t, op)
    if problem == "channels":
        raise ValueError(f"{fn}: {name} must have contiguous channels (stride(-1) == 1; rows may be strided), "
                         f"got strides {shown(t.stride())}{_unit_stride_rows_hint(name, t)}")
    if problem == "stride":
        raise ValueError(f"{fn}: {name}'s row stride stride(-2) must be at least C = {shown(t.shape[-1])} and a "
                         f"multiple of 8 elements (16 bytes), got strides {shown(t.stride())}")
    if problem == "range":
        raise ValueError(f"{fn}: {name} must have S * stride(-2) < 2^{MAX_ELEMENTS[op].bit_length() - 1} elements "
                         f"(the {op}'s range), got S={shown(t.shape[-2])}, stride(-2)={shown(t.stride(-2))}")


def check_rows_like(fn: str, name: str, t: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """t: BF16 of x's shape, rows as check_rows accepts."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{fn}: {name} must have dtype torch.bfloat16, got {t.dtype}")
    if t.shape != x.shape:
        raise ValueError(f"{fn}: {name} must have x's shape {shown(x.shape)}, got {shown(t.shape)}")
    check_rows(fn, name, t, op)
    check_memory(fn, name, t)


STATE_INPUTS = ("initial_states", "dfinal_states")  # the states the kernels read (the others they write)
ROW_TENSORS = ("x", "out", "dy", "dx")  # the tensors that may be row-strided views (the others are contiguous)


def check_states(fn: str, name: str, t: torch.Tensor, num_docs: int, C: int) -> None:
    """Per-document conv states: BF16 [num_docs, 3, C], contiguous."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{fn}: {name} must have dtype torch.bfloat16, got {t.dtype}")
    if t.shape != (num_docs, 3, C):
        # (compared, not looked up: sizes are SymInts while torch.compile traces, which do not hash)
        peer, fix = (("fla's [N, C, 4]", "s[:, :, 1:].transpose(1, 2).contiguous()") if t.shape == (num_docs, C, 4)
                     else ("Dao's [N, C, 3]", "s.transpose(1, 2).contiguous()") if t.shape == (num_docs, C, 3)
                     else (None, None))
        if peer is None:
            hint = ""
        elif name in STATE_INPUTS:
            hint = f"; {peer} state s is {fix}"
        else:  # an output is written in place: a converted copy of it would not be the caller's tensor
            hint = (f"; for {peer} states pass a new [num_docs, 3, C] tensor and convert it after (README: the "
                    f"peers' layouts)")
        raise ValueError(f"{fn}: {name} must have shape [num_docs, 3, C] = [{shown(num_docs)}, 3, {shown(C)}] "
                         f"(num_docs from cu_seqlens, C from x), got {shown(t.shape)}{hint}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {shown(t.stride())}")
    check_memory(fn, name, t)


def without_memory(t: torch.Tensor) -> bool:
    """A tensor whose memory is not its values for the kernels: a meta tensor, or a subclass that
    dispatches in Python (a FakeTensor under FakeTensorMode or make_fx, a FunctionalTensor while
    AOTAutograd traces, an AsyncCollectiveTensor of a functional collective, a DTensor). The
    binding declines them; cake_causal_conv1d takes them through the custom ops, whose dispatch
    handles each (the fake implementations, an AsyncCollectiveTensor's wait)."""
    return t.is_meta or torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def check_has_memory(fn: str, named_tensors) -> None:
    """No (name, tensor or None) of ``named_tensors`` is without_memory: the raw functions and the
    CP calls run the kernels on the tensors' memory (cake_causal_conv1d takes them otherwise)."""
    for name, t in named_tensors:
        if t is not None and without_memory(t):
            raise ValueError(
                f"{fn}: {name} must be a CUDA tensor with memory of its own, got a tensor of type {type(t).__name__} "
                f"(meta, fake, or a subclass that dispatches in Python): cake_causal_conv1d takes such tensors "
                f"through its custom ops; an AsyncCollectiveTensor needs .wait() here, a DTensor its local tensor "
                f"(or, for a sequence-sharded batch, flashinfer_cake.cp)")


def check_memory(fn: str, name: str, t: torch.Tensor) -> None:
    """The memory the kernels read or write for ``t`` is its own: no lazily negated or conjugated
    view (torch._neg_view, .conj(): the values without the pending sign), and every element inside
    its storage (a view keeps its shape when its storage is resized, e.g. by
    untyped_storage().resize_(0), and the kernels would address the bytes past it). (Not while
    torch.compile traces nor for tensors without memory (without_memory), which have none to
    check: the op's eager call checks them when it runs. A tensor of a torch.func transform, which
    has no storage, is check_types' error before.)"""
    if torch.compiler.is_compiling() or without_memory(t):
        return
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{fn}: {name} must not be a lazily negated or conjugated view, got one (is_neg "
                         f"{t.is_neg()}, is_conj {t.is_conj()}): pass {name}.resolve_neg() / {name}.resolve_conj()")
    if t.numel():
        start = t.storage_offset() * t.element_size()
        have = t.untyped_storage().nbytes()
        if start + span_bytes(t) > have:
            raise ValueError(f"{fn}: {name} reaches past its storage: its elements span bytes {start} to "
                             f"{start + span_bytes(t)} of a storage of {have} bytes (a view of a storage resized "
                             f"since, e.g. by untyped_storage().resize_())")


def check_params(fn: str, weight: torch.Tensor, cu_seqlens: torch.Tensor, bias, x: torch.Tensor) -> None:
    """weight FP32/BF16 [C, 4], bias None or FP32/BF16 [C], cu_seqlens int32 [num_docs + 1] (C: x's
    channels, x checked by check_x)."""
    S, C = x.shape[-2], x.shape[-1]
    if bias is not None and bias.dtype == torch.int32 and cu_seqlens.is_floating_point():
        # Dao's causal_conv1d_fn(x, weight, bias, ...): said before bias's own dtype rule
        raise ValueError(f"{fn}: cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}, and bias "
                         f"torch.float32 or torch.bfloat16, got torch.int32: the order is (x, weight, cu_seqlens, "
                         f"bias)")
    if weight.dtype not in PARAM_DTYPES:
        raise ValueError(f"{fn}: weight must have dtype torch.float32 or torch.bfloat16, got {weight.dtype}")
    if weight.shape != (C, 4):
        layout = "[1, C, S]" if x.dim() == 3 else "[C, S]"
        hint = ("; an nn.Conv1d weight [C, 1, 4] is weight.squeeze(1)" if weight.shape == (C, 1, 4) else
                f"; x looks channels-first {layout} (the weight's C is x.shape[-2]): {_CHANNELS_FIRST_FIX}"
                if weight.shape in ((S, 4), (S, 1, 4)) else "")
        raise ValueError(f"{fn}: weight must have shape [C, 4] = [{shown(C)}, 4] (C from x), "
                         f"got {shown(weight.shape)}{hint}")
    if not weight.is_contiguous():
        raise ValueError(f"{fn}: weight must be contiguous, got strides {shown(weight.stride())}")
    check_memory(fn, "weight", weight)
    if bias is not None:
        if bias.dtype not in PARAM_DTYPES:
            raise ValueError(f"{fn}: bias must have dtype torch.float32 or torch.bfloat16, got {bias.dtype}")
        if bias.shape != (C,):
            raise ValueError(f"{fn}: bias must have shape [C] = [{shown(C)}] (C from x), got {shown(bias.shape)}")
        if not bias.is_contiguous():
            raise ValueError(f"{fn}: bias must be contiguous, got strides {shown(bias.stride())}")
        check_memory(fn, "bias", bias)
    if cu_seqlens.dtype != torch.int32:
        hint = ("; convert it once per batch with cu_seqlens.to(torch.int32)" if cu_seqlens.dtype == torch.int64
                else "; the order is (x, weight, cu_seqlens, bias)" if cu_seqlens.is_floating_point() else "")
        raise ValueError(f"{fn}: cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}{hint}")
    if cu_seqlens.dim() != 1 or not 1 <= cu_seqlens.shape[0] <= MAX_CU_SEQLENS:
        raise ValueError(
            f"{fn}: cu_seqlens must be 1-D [num_docs + 1] with 1 to 2^31 - 1 entries, got shape "
            f"{shown(cu_seqlens.shape)}"
        )
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{fn}: cu_seqlens must be contiguous, got strides {shown(cu_seqlens.stride())}")
    check_memory(fn, "cu_seqlens", cu_seqlens)


def check_like(fn: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape, shape_text: str) -> None:
    """t has exactly ``dtype`` and ``shape`` and is contiguous."""
    if t.dtype != dtype:
        raise ValueError(f"{fn}: {name} must have dtype {dtype}, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{fn}: {name} must have {shape_text} {shown(shape)}, got {shown(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {shown(t.stride())}")
    check_memory(fn, name, t)


def check_workspace(fn: str, workspace: torch.Tensor, dtype: torch.dtype, need: int, bytes_fn: str) -> None:
    """A contiguous 1-D ``dtype`` buffer of at least ``need`` bytes."""
    if workspace.dtype != dtype:
        raise ValueError(f"{fn}: workspace must have dtype {dtype}, got {workspace.dtype}")
    if workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(
            f"{fn}: workspace must be a contiguous 1-D tensor, got shape {shown(workspace.shape)} "
            f"strides {shown(workspace.stride())}"
        )
    check_memory(fn, "workspace", workspace)
    have = workspace.shape[0] * workspace.element_size()
    if have < need:
        raise ValueError(f"{fn}: workspace must hold at least {shown(need)} bytes ({bytes_fn}), got {shown(have)}")


def check_same_device(fn: str, x: torch.Tensor, others) -> None:
    """Every tensor of ``others`` ((name, tensor or None) pairs) on x's device."""
    for name, t in others:
        if t is not None and t.device != x.device:
            raise ValueError(f"{fn}: {name} must be on x's device {x.device}, got {t.device}")


def check_devices(fn: str, x: torch.Tensor, others) -> int:
    """x on a CUDA device of a supported index and arch (check_cuda_device), and every tensor of
    ``others`` ((name, tensor or None) pairs) on it. Returns the device index."""
    device = check_cuda_device(fn, x)
    check_same_device(fn, x, others)
    return device


def check_cuda_device(fn: str, x: torch.Tensor) -> int:
    """x on a CUDA device of a supported index and arch. Returns the device index."""
    device = x.get_device()
    if device < 0 or not x.is_cuda:
        raise ValueError(f"{fn}: x must be a CUDA tensor, got device {x.device} (the kernels run on CUDA GPUs; "
                         f"flashinfer_cake.reference's functions compute the same op in FP64 on any device)")
    if device >= MAX_DEVICES:
        raise RuntimeError(f"{fn}: device cuda:{device} is not supported: device indices must be below {MAX_DEVICES}")
    if arch_of(device) is None:
        cap = torch.cuda.get_device_capability(device)
        raise RuntimeError(
            f"{fn}: device cuda:{device} has compute capability {cap[0]}.{cap[1]}; supported: "
            f"{', '.join(f'{a}.{b}' for a, b in ARCH_OF_CAPABILITY)}"
        )
    return device


@functools.cache
def arch_of(device_index: int) -> str | None:
    """The module arch of a CUDA device (e.g. "sm_90a"), None when unsupported; queried once."""
    return ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(device_index))


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to its last: its numel for a contiguous tensor, with
    the gaps between the rows of a row-strided view; 0 when empty."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_no_overlap(fn: str, tensors, written) -> None:
    """No tensor named in ``written`` shares a byte of its span (span_bytes) with any tensor before
    it in ``tensors`` ((name, tensor or None) pairs, in the order of the message's "other")."""
    spans = [(n, t.data_ptr(), span_bytes(t)) for n, t in tensors if t is not None]
    for i, (name, ptr, size) in enumerate(spans):
        if name not in written or not size:
            continue
        for other, optr, osize in spans[:i]:
            if osize and ptr < optr + osize and optr < ptr + size:
                slices = " (column slices of one buffer overlap so)" if {name, other} <= set(ROW_TENSORS) else ""
                raise ValueError(f"{fn}: {name} must not overlap {other}, got spans (first to last element, row "
                                 f"gaps included) sharing bytes: {name} [{ptr:#x}, {ptr + size:#x}), {other} "
                                 f"[{optr:#x}, {optr + osize:#x}){slices}: pass {name} as a tensor of its own")


def as_int(v, tensors: bool = True) -> int | None:
    """An integer of any library as an int (operator.index: Python's, NumPy's, with ``tensors`` a
    0-d integer tensor too); None for anything else, bools included."""
    if isinstance(v, bool) or (not tensors and isinstance(v, torch.Tensor)):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def cu_seqlens_values(fn: str, name: str, cu_seqlens, *, device_read: bool) -> list[int]:
    """``cu_seqlens`` (a 1-D integer tensor, NumPy array, list or tuple) as a list of ints. A tensor
    on a device is copied to the host (one synchronization) only with ``device_read``; without it
    only CPU tensors are taken (a list's 0-d tensors too)."""
    forms = (f"a 1-D integer {'' if device_read else 'CPU '}tensor, a 1-D integer NumPy array, or a list / tuple "
             f"of ints")
    if isinstance(cu_seqlens, torch.Tensor):
        if (cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex
                or cu_seqlens.dtype == torch.bool or (cu_seqlens.device.type != "cpu" and not device_read)):
            where = "" if device_read else " (read on the host once per batch: keep the data loader's CPU copy)"
            raise ValueError(f"{fn}: {name} must be {forms}, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}{where}")
        if without_memory(cu_seqlens):
            raise ValueError(f"{fn}: {name} must be a tensor with values to read, got a {type(cu_seqlens).__name__} "
                             f"on {cu_seqlens.device} (a meta, fake or traced tensor has none)")
        return cu_seqlens.tolist()
    if type(cu_seqlens).__name__ == "ndarray":
        kind = getattr(getattr(cu_seqlens, "dtype", None), "kind", None)
        if getattr(cu_seqlens, "ndim", None) != 1 or kind not in ("i", "u"):
            raise ValueError(f"{fn}: {name} must be {forms}, got a NumPy array of dtype {cu_seqlens.dtype} and shape "
                             f"{tuple(cu_seqlens.shape)}")
        return cu_seqlens.tolist()
    if not isinstance(cu_seqlens, (list, tuple)):
        raise ValueError(f"{fn}: {name} must be {forms}, got {type(cu_seqlens).__name__}")
    # (a list's tensors: CPU integer ones only, each read once; a bool is not an int here, as as_int says)
    cu = [None if isinstance(v, torch.Tensor) and (v.device.type != "cpu" or v.dtype == torch.bool) else as_int(v)
          for v in cu_seqlens]
    bad = next((i for i, v in enumerate(cu) if v is None), None)
    if bad is not None:
        raise ValueError(f"{fn}: {name} must hold ints, got {cu_seqlens[bad]!r} ({type(cu_seqlens[bad]).__name__}) "
                         f"at index {bad}")
    return cu


def cu_seqlens_problem(name: str, cu: list[int], num_tokens: int | None = None, below: int | None = None) -> str | None:
    """What makes ``cu`` not the prefix sums of a packed batch's document lengths, or None. The one
    rule of cu_seqlens content: cu[0] == 0, never decreasing, cu[-1] == the batch's token count
    when it is given, and cu[-1] < ``below`` when that is given."""
    if not cu:
        return f"{name} must have at least one entry (0), got none"
    if cu[0] != 0:
        return f"{name}[0] must be 0, got {cu[0]}"
    if not all(map(operator.le, cu, itertools.islice(cu, 1, None))):  # (at C speed; then find where)
        i = next(i for i in range(1, len(cu)) if cu[i] < cu[i - 1])
        return (f"{name} must never decrease (document lengths are its differences), got {name}[{i - 1}] = "
                f"{cu[i - 1]} > {name}[{i}] = {cu[i]}")
    if num_tokens is not None and cu[-1] != num_tokens:
        padded = " (for a padded batch, end it with S: the padding is then a document of its own)"
        return (f"{name}[-1] (index {len(cu) - 1}) must be the token count S = {num_tokens}, got {cu[-1]}"
                f"{padded if cu[-1] < num_tokens else ''}")
    if below is not None and cu[-1] >= below:
        return (f"{name}[-1] (index {len(cu) - 1}) must be below 2^{below.bit_length() - 1} (the kernels' int32 "
                f"cu_seqlens and S), got {cu[-1]}")
    return None


def check_sizes(fn: str, S, C, op: str) -> tuple[int, int]:
    """S and C of ``fn``, a *_workspace_bytes / *_workspace function of ``op`` ("forward" or
    "backward"): integers (as_int; not tensors, whose read may be a device sync: TypeError) within
    op's range (ValueError). Returns them as ints."""
    values = []
    for name, v in (("S", S), ("C", C)):
        values.append(as_int(v, tensors=False))
        if values[-1] is None:  # the wrong type: a TypeError, as torch.empty(16.0) raises
            raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__} {v!r}")
    S, C = values
    if S < 0:
        raise ValueError(f"{fn}: S must be a non-negative int, got {S}")
    if C <= 0 or C % 8 or C >= MAX_C:
        raise ValueError(f"{fn}: C must be a positive multiple of 8 below 2^28, got {C}")
    if S >= MAX_S[op] or S * C >= MAX_ELEMENTS[op]:
        raise ValueError(f"{fn}: S must be below 2^{MAX_S[op].bit_length() - 1} and S * C below "
                         f"2^{MAX_ELEMENTS[op].bit_length() - 1} for the {op}, got S={S}, C={C}")
    return S, C


def no_cuda_reason() -> str:
    """Why torch has no CUDA device here (torch.cuda.is_available() is False): a CPU-only build of torch
    (the fix is another torch), or no GPU it can see."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    return f"torch {torch.__version__} sees no CUDA GPU"


def check_allocation_device(fn: str, device) -> torch.device:
    """The device a function allocates on (the *_workspace functions, build_cp_context): what
    torch.device takes (a torch.device, a string, an index), not None; a CUDA device only where
    torch has one, by an index below its device count (torch's own errors there, an AssertionError
    or a RuntimeError, name no argument)."""
    if device is None or isinstance(device, bool):
        raise TypeError(f"{fn}: device must be a torch.device, a device string or an index, e.g. x.device, "
                        f"got {device!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(f"{fn}: device must be an available CUDA device, got {device} ({no_cuda_reason()})")
    if device.index is not None and not 0 <= device.index < torch.cuda.device_count():  # (torch wraps cuda:128 to -128)
        raise RuntimeError(f"{fn}: device must be an available CUDA device, got {device} (torch sees "
                           f"{torch.cuda.device_count()} CUDA device(s): cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return device


def check_policy(fn: str, silu_grad_preactivation) -> None:
    """ValueError unless silu_grad_preactivation is one of the policies."""
    if not isinstance(silu_grad_preactivation, str) or silu_grad_preactivation not in SILU_GRAD_POLICIES:
        raise ValueError(
            f"{fn}: silu_grad_preactivation must be one of {list(SILU_GRAD_POLICIES)}, got {silu_grad_preactivation!r}"
        )


def _aligned(t: torch.Tensor) -> bool:
    """Empty, or starting at a 16-byte aligned address."""
    return not (t.numel() and t.data_ptr() & 15)


def _check_aligned(fn: str, named_tensors) -> None:
    """Each non-empty (name, tensor or None) starts at a 16-byte aligned address (the kernels'
    vectors)."""
    for name, t in named_tensors:
        if t is not None and not _aligned(t):
            rows = (": a column slice of rows must start at a multiple of 8 columns" if name in ROW_TENSORS
                    else f": pass a tensor of its own, e.g. {name}.clone()" if name in STATE_INPUTS
                    else ": pass one allocated on its own (torch.empty's storage starts aligned), which is written")
            raise ValueError(f"{fn}: {name} must start at a 16-byte aligned address, got {t.data_ptr():#x} (storage "
                             f"offset {t.storage_offset()} elements of {t.element_size()} bytes{rows})")


def check_no_grad(fn: str, inputs, outputs, why: str) -> None:
    """With grad mode on, no tensor of ``inputs`` / ``outputs`` ((name, tensor or None) pairs)
    requires grad, and in any mode none is a dual tensor of forward-mode AD (one with a tangent):
    the raw forward and backward record no autograd graph and propagate no tangent (their results
    would be constants to autograd, or without a tangent, silently) and write their outputs in place
    (as torch refuses for out= arguments). ``why``: the way to gradients, for the message."""
    if torch.is_grad_enabled():
        for name, t in inputs:
            if t is not None and t.requires_grad:
                raise RuntimeError(f"{fn}: {name} requires grad, but this function records no autograd graph, so "
                                   f"its results would be constants to autograd ({why}): call it under "
                                   f"torch.no_grad() or on {name}.detach()")
        for name, t in outputs:
            if t is not None and t.requires_grad:
                raise RuntimeError(f"{fn}: {name} requires grad, but this function writes it in place without "
                                   f"autograd: pass a tensor that does not require grad, or call it under "
                                   f"torch.no_grad()")
    if torch.compiler.is_compiling():  # (dynamo traces forward AD itself)
        return
    for name, t in inputs:
        if has_tangent(t):
            raise RuntimeError(f"{fn}: {name} is a dual tensor of forward-mode AD (torch.autograd.forward_ad), but "
                               f"this function propagates no tangent, so its results would have none, silently: "
                               f"pass forward_ad.unpack_dual({name}).primal")
    for name, t in outputs:
        if has_tangent(t):
            raise RuntimeError(f"{fn}: {name} is a dual tensor of forward-mode AD (torch.autograd.forward_ad), but "
                               f"this function writes it in place without a tangent (its tangent would be stale): "
                               f"pass a tensor that is not a dual tensor")


def check_forward_args(fn: str, x, weight, cu_seqlens, bias, initial_states, final_states_out, out, workspace,
                       op: str = "forward", raw: bool = False) -> int:
    """Raises the error of the first forward rule the arguments break (x within ``op``'s range;
    ``raw``: the raw forward's call, which also takes no tensor that requires grad while grad mode
    is on); returns x's device index."""
    check_types(fn, (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens)),
                (("bias", bias), ("initial_states", initial_states), ("final_states_out", final_states_out),
                 ("out", out), ("workspace", workspace)))
    S, C = check_x(fn, x, op, weight)
    check_params(fn, weight, cu_seqlens, bias, x)
    for name, t in (("initial_states", initial_states), ("final_states_out", final_states_out)):
        if t is not None:
            check_states(fn, name, t, cu_seqlens.shape[0] - 1, C)
    if out is not None:
        check_rows_like(fn, "out", out, x, op)
    if workspace is not None:
        check_workspace(fn, workspace, torch.int32, 4 * FWD_WORKSPACE_COUNTERS,
                        "cake_causal_conv1d_train_forward_workspace_bytes")
    if raw:
        check_no_grad(fn, (("x", x), ("weight", weight), ("bias", bias), ("initial_states", initial_states)),
                      (("final_states_out", final_states_out), ("out", out), ("workspace", workspace)),
                      "for gradients call flashinfer_cake.cake_causal_conv1d")
    named = (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens), ("bias", bias),
             ("initial_states", initial_states), ("final_states_out", final_states_out), ("out", out),
             ("workspace", workspace))
    check_has_memory(fn, named)  # first: a meta tensor's error says where such tensors go, not "not CUDA"
    device = check_devices(fn, x, named[1:])
    _check_aligned(fn, (("x", x), ("out", out), ("initial_states", initial_states),
                        ("final_states_out", final_states_out)))
    # out and the final states are written while x, the parameters, cu_seqlens and the initial
    # states are read (the workspace, too, must stay as it is).
    check_no_overlap(fn, (("x", x), ("weight", weight), ("bias", bias), ("cu_seqlens", cu_seqlens),
                          ("workspace", workspace), ("initial_states", initial_states),
                          ("final_states_out", final_states_out), ("out", out)), ("final_states_out", "out"))
    return device


def check_backward_args(fn: str, x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states,
                        silu_grad_preactivation, workspace, dx, dweight, dbias, dinitial_states) -> int:
    """Raises the error of the first backward rule the arguments break; returns x's device index."""
    check_types(fn, (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens), ("dy", dy)),
                (("bias", bias), ("initial_states", initial_states), ("dfinal_states", dfinal_states),
                 ("workspace", workspace), ("dx", dx), ("dweight", dweight), ("dbias", dbias),
                 ("dinitial_states", dinitial_states)))
    check_policy(fn, silu_grad_preactivation)
    S, C = check_x(fn, x, "backward", weight)
    check_params(fn, weight, cu_seqlens, bias, x)
    check_rows_like(fn, "dy", dy, x, "backward")
    if dinitial_states is not None and initial_states is None:
        raise ValueError(f"{fn}: dinitial_states must be None when initial_states is None, got a tensor of shape "
                         f"{shown(dinitial_states.shape)}")
    for name, t in (("initial_states", initial_states), ("dfinal_states", dfinal_states),
                    ("dinitial_states", dinitial_states)):
        if t is not None:
            check_states(fn, name, t, cu_seqlens.shape[0] - 1, C)
    if dx is not None:
        check_rows_like(fn, "dx", dx, x, "backward")
    if dweight is not None:
        check_like(fn, "dweight", dweight, weight.dtype, weight.shape, "weight's dtype and shape")
    if dbias is not None:
        if bias is None:
            raise ValueError(f"{fn}: dbias must be None when bias is None, got a tensor of shape {shown(dbias.shape)}")
        check_like(fn, "dbias", dbias, bias.dtype, bias.shape, "bias's dtype and shape")
    if workspace is not None:
        check_workspace(fn, workspace, torch.float32, _plan.workspace_bytes(S, C),
                        "cake_causal_conv1d_train_backward_workspace_bytes")
    check_no_grad(fn, (("x", x), ("weight", weight), ("dy", dy), ("bias", bias), ("initial_states", initial_states),
                       ("dfinal_states", dfinal_states)),
                  (("workspace", workspace), ("dx", dx), ("dweight", dweight), ("dbias", dbias),
                   ("dinitial_states", dinitial_states)), "the backward is not itself differentiable")
    named = (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens), ("dy", dy), ("bias", bias),
             ("initial_states", initial_states), ("dfinal_states", dfinal_states), ("workspace", workspace),
             ("dx", dx), ("dweight", dweight), ("dbias", dbias), ("dinitial_states", dinitial_states))
    check_has_memory(fn, named)  # first: a meta tensor's error says where such tensors go, not "not CUDA"
    device = check_devices(fn, x, named[1:])
    # 8-byte vectors for x, dy, dx (16 keeps the forward's rule); the partial rows are summed with
    # 16-byte loads
    _check_aligned(fn, (("x", x), ("dy", dy), ("dx", dx), ("initial_states", initial_states),
                        ("dfinal_states", dfinal_states), ("dinitial_states", dinitial_states),
                        ("workspace", workspace)))
    # What the kernel writes (the workspace's partial rows, dx, dweight, dbias, dinitial_states)
    # may overlap nothing else: it reads x, dy, the parameters, cu_seqlens and the states while
    # writing dx, dinitial_states and the partial rows, and reads the partial rows while writing
    # dweight/dbias.
    check_no_overlap(fn, (("x", x), ("dy", dy), ("weight", weight), ("bias", bias), ("cu_seqlens", cu_seqlens),
                          ("initial_states", initial_states), ("dfinal_states", dfinal_states),
                          ("workspace", workspace), ("dx", dx), ("dweight", dweight), ("dbias", dbias),
                          ("dinitial_states", dinitial_states)),
                     ("workspace", "dx", "dweight", "dbias", "dinitial_states"))
    return device


def check_autograd_constants(fn: str, x, weight, cu_seqlens, bias, initial_states, return_final_states,
                             silu_grad_preactivation) -> None:
    """The rules of cake_causal_conv1d on what is not a size: the arguments' types, the flag and
    the policy (constants while torch.compile traces)."""
    check_types(fn, (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens)),
                (("bias", bias), ("initial_states", initial_states)))
    if not isinstance(return_final_states, bool):
        raise TypeError(f"{fn}: return_final_states must be a bool, got {type(return_final_states).__name__}")
    check_policy(fn, silu_grad_preactivation)


def check_autograd_sizes(fn: str, x, weight, cu_seqlens, bias, initial_states) -> int | None:
    """The rules of cake_causal_conv1d on the tensors' metadata that need no data pointer (so they
    also run on fake tensors): x within the backward's range (an error now, not in the backward),
    the parameters, the initial states; then, for an x with memory of its own outside a fake mode,
    its CUDA device (check_cuda_device, whose index it returns; else None); all on x's device."""
    C = check_x(fn, x, "backward", weight)[1]
    check_params(fn, weight, cu_seqlens, bias, x)
    if initial_states is not None:
        check_states(fn, "initial_states", initial_states, cu_seqlens.shape[0] - 1, C)
    device = None
    if not without_memory(x) and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        # a real x on the CPU is refused as the raw functions refuse it: before its device is the others'
        # measure ("weight must be on x's device cpu"), and before a dispatch mode (FlopCounterMode, selective
        # checkpointing) sees a call that the ops' CPU kernel only refuses. (Under FakeTensorMode a real
        # input becomes a fake one: the op's fake implementation takes it.)
        device = check_cuda_device(fn, x)
    check_same_device(fn, x, (("weight", weight), ("cu_seqlens", cu_seqlens), ("bias", bias),
                              ("initial_states", initial_states)))
    return device


def check_autograd_args(fn: str, x, weight, cu_seqlens, bias, initial_states, return_final_states,
                        silu_grad_preactivation) -> int:
    """cake_causal_conv1d's rules: those that need no data pointer (check_autograd_constants',
    check_autograd_sizes': the devices alike among them), then the forward's that need a device and
    memory (x's CUDA device, alignment; it writes no tensor of the caller's). Returns x's device
    index."""
    check_autograd_constants(fn, x, weight, cu_seqlens, bias, initial_states, return_final_states,
                             silu_grad_preactivation)
    device = check_autograd_sizes(fn, x, weight, cu_seqlens, bias, initial_states)  # (x has memory here)
    if device is None:
        device = check_cuda_device(fn, x)
    _check_aligned(fn, (("x", x), ("initial_states", initial_states)))
    return device
