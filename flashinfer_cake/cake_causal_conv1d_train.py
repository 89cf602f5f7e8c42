"""Packed (varlen) width-4 causal conv1d + SiLU for training: the forward and its workspace."""

from __future__ import annotations

import functools
import math

import torch

from . import jit
from .jit.env import ARCH_OF_CAPABILITY

__all__ = [
    "cake_causal_conv1d_train_forward",
    "cake_causal_conv1d_train_forward_workspace",
    "cake_causal_conv1d_train_forward_workspace_bytes",
    "is_cake_causal_conv1d_train_supported",
]

_FN = "cake_causal_conv1d_train_forward"
_PARAM_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# Token-chunk counters of the persistent grid (kFwdWorkspaceCounters in the template): every
# route uses the same two int32.
_FWD_WORKSPACE_COUNTERS = 2

# (device index, stream handle) -> zeroed int32 workspace kept for calls without one.
_default_workspaces: dict[tuple[int, int], torch.Tensor] = {}
# (device index, weight dtype, bias dtype) -> loaded module.
_modules: dict[tuple[int, torch.dtype, torch.dtype | None], jit.core.CompiledModule] = {}


def _check_size_args(S, C, device) -> torch.device:
    if not isinstance(S, int) or isinstance(S, bool) or S < 0:
        raise ValueError(f"S must be a non-negative int, got {S!r}")
    if not isinstance(C, int) or isinstance(C, bool) or C <= 0 or C % 8:
        raise ValueError(f"C must be a positive multiple of 8, got {C!r}")
    return torch.device(device)


def cake_causal_conv1d_train_forward_workspace_bytes(S: int, C: int, device) -> int:
    """Bytes of int32 workspace a forward of ``[S, C]`` on ``device`` needs: the most over every
    route (today every route uses the same two token-chunk counters)."""
    _check_size_args(S, C, device)
    return 4 * _FWD_WORKSPACE_COUNTERS


def cake_causal_conv1d_train_forward_workspace(S: int, C: int, device) -> torch.Tensor:
    """A zeroed int32 workspace of at least
    ``cake_causal_conv1d_train_forward_workspace_bytes(S, C, device)`` bytes on ``device``.
    Every launch leaves it zero, so one serves every later call of one stream (graph replays
    included); launches that may run at once need one each."""
    device = _check_size_args(S, C, device)
    nbytes = cake_causal_conv1d_train_forward_workspace_bytes(S, C, device)
    return torch.zeros(math.ceil(nbytes / 4), dtype=torch.int32, device=device)


@functools.cache
def _arch_of(device_index: int) -> str | None:
    return ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(device_index))


def is_cake_causal_conv1d_train_supported(device=None) -> bool:
    """True when ``device`` (default: the current CUDA device) can run these kernels: a CUDA
    device of a supported arch (compute capability 9.0). False, not an error, otherwise."""
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        return False
    return _arch_of(index) is not None


def _check_args(x, weight, cu_seqlens, bias, out, workspace) -> tuple[int, int, int]:
    """Validate everything the host may look at (never an element of a device tensor). Types
    first, then dtypes/shapes/layouts, then devices. Returns (S, C, device index). Pointer
    alignment and overlap are checked by the caller, which reads the pointers once for the launch.
    Written for the eager host budget: each property is read once."""
    for name, t in (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_FN}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("bias", bias), ("out", out), ("workspace", workspace)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{_FN}: {name} must be a torch.Tensor or None, got {type(t).__name__}")

    shape = x.shape
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{_FN}: x must have dtype torch.bfloat16, got {x.dtype}")
    if len(shape) == 2:
        S, C = shape
    elif len(shape) == 3 and shape[0] == 1:
        S, C = shape[1], shape[2]
    else:
        raise ValueError(f"{_FN}: x must have shape [S, C] or [1, S, C], got {tuple(shape)}")
    if C <= 0 or C % 8:
        raise ValueError(f"{_FN}: x's channel count C must be a positive multiple of 8, got C={C}")
    if S >= 2**31 or S * C >= 2**35:  # int32 token indices; 32-bit 16-byte offsets in the kernel
        raise ValueError(f"{_FN}: x must have S < 2^31 and S * C < 2^35 elements, got S={S}, C={C}")
    if not x.is_contiguous():
        raise ValueError(f"{_FN}: x must be contiguous, got strides {x.stride()}")
    if weight.dtype not in _PARAM_DTYPES:
        raise ValueError(f"{_FN}: weight must have dtype torch.float32 or torch.bfloat16, got {weight.dtype}")
    if weight.shape != (C, 4):
        raise ValueError(f"{_FN}: weight must have shape [C, 4] = [{C}, 4] (C from x), got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"{_FN}: weight must be contiguous, got strides {weight.stride()}")
    if bias is not None:
        if bias.dtype not in _PARAM_DTYPES:
            raise ValueError(f"{_FN}: bias must have dtype torch.float32 or torch.bfloat16, got {bias.dtype}")
        if bias.shape != (C,):
            raise ValueError(f"{_FN}: bias must have shape [C] = [{C}] (C from x), got {tuple(bias.shape)}")
        if not bias.is_contiguous():
            raise ValueError(f"{_FN}: bias must be contiguous, got strides {bias.stride()}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{_FN}: cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"{_FN}: cu_seqlens must be 1-D [num_docs + 1] with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{_FN}: cu_seqlens must be contiguous, got strides {cu_seqlens.stride()}")
    if out is not None:
        if out.dtype != torch.bfloat16:
            raise ValueError(f"{_FN}: out must have dtype torch.bfloat16, got {out.dtype}")
        if out.shape != shape:
            raise ValueError(f"{_FN}: out must have x's shape {tuple(shape)}, got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"{_FN}: out must be contiguous, got strides {out.stride()}")
    if workspace is not None:
        if workspace.dtype != torch.int32:
            raise ValueError(f"{_FN}: workspace must have dtype torch.int32, got {workspace.dtype}")
        if workspace.dim() != 1 or not workspace.is_contiguous():
            raise ValueError(
                f"{_FN}: workspace must be a contiguous 1-D tensor, got shape {tuple(workspace.shape)} "
                f"strides {workspace.stride()}"
            )
        need = 4 * _FWD_WORKSPACE_COUNTERS
        if workspace.shape[0] * 4 < need:
            raise ValueError(
                f"{_FN}: workspace must hold at least {need} bytes "
                f"(cake_causal_conv1d_train_forward_workspace_bytes), got {workspace.shape[0] * 4}"
            )

    device = x.get_device()
    if device < 0:
        raise ValueError(f"{_FN}: x must be a CUDA tensor, got device {x.device}")
    for name, t in (("weight", weight), ("cu_seqlens", cu_seqlens), ("bias", bias), ("out", out),
                    ("workspace", workspace)):
        if t is not None and t.get_device() != device:
            raise ValueError(f"{_FN}: {name} must be on x's device {x.device}, got {t.device}")
    if _arch_of(device) is None:
        cap = torch.cuda.get_device_capability(device)
        raise RuntimeError(
            f"{_FN}: device cuda:{device} has compute capability {cap[0]}.{cap[1]}; supported: "
            f"{', '.join(f'{a}.{b}' for a, b in ARCH_OF_CAPABILITY)}"
        )
    return S, C, device


def _module(device: int, weight_dtype: torch.dtype, bias_dtype: torch.dtype | None):
    key = (device, weight_dtype, bias_dtype)
    module = _modules.get(key)
    if module is None:
        spec = jit.VariantSpec(
            _PARAM_DTYPES[weight_dtype], "none" if bias_dtype is None else _PARAM_DTYPES[bias_dtype], _arch_of(device)
        )
        module = _modules[key] = jit.load(spec)
    return module


def _capturing(device: int) -> bool:
    """Whether device's current stream (the one the launch uses) is capturing a CUDA graph."""
    if device == torch.cuda.current_device():
        return torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device):
        return torch._C._cuda_isCurrentStreamCapturing()


def _default_workspace(device: int, stream: int, S: int, C: int) -> torch.Tensor:
    if _capturing(device):
        # A graph replays with this buffer: never share it with eager calls or other graphs.
        return cake_causal_conv1d_train_forward_workspace(S, C, torch.device("cuda", device))
    ws = _default_workspaces.get((device, stream))
    if ws is None:
        ws = cake_causal_conv1d_train_forward_workspace(S, C, torch.device("cuda", device))
        _default_workspaces[(device, stream)] = ws
    return ws


def cake_causal_conv1d_train_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed width-4 depthwise causal convolution + SiLU, training forward.

    ``y[t, c] = bf16(silu(sum_k weight[c, k] * x[t - 3 + k, c] + bias[c]))`` with zero history
    before each document's first token. Math in FP32; the result is rounded to BF16 to nearest
    even, bitwise identical for a given (S, C, device, weight dtype, bias dtype).

    Args:
        x: BF16 ``[S, C]`` or ``[1, S, C]``, contiguous, 16-byte aligned (any tensor from the
            allocator is; an offset view may not be), on a CUDA device of compute capability 9.0;
            C is a multiple of 8; S < 2^31 and S * C < 2^35.
        weight: FP32 or BF16 ``[C, 4]``, contiguous; ``weight[c, 3]`` multiplies the current
            token, ``weight[c, 0]`` the token three positions back.
        cu_seqlens: int32 ``[num_docs + 1]``, contiguous, on x's device: prefix sums of the
            document lengths (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == S``; a repeated value
            is an empty document). The host reads its metadata only: no element is copied to
            the host and no stream is synchronized. Any content is memory-safe: with values out
            of order or out of [0, S] every row of ``y`` is still written, and token ``t`` keeps
            the history back to the last entry ``<= t`` that a binary search over ``cu_seqlens``
            finds (none when it finds none), so tokens past ``cu_seqlens[-1]`` continue one more
            document from there; only x, y and cu_seqlens[0..num_docs] are read.
        bias: optional FP32 or BF16 ``[C]``, contiguous, added after the four taps, before SiLU;
            its dtype is independent of weight's.
        out: optional preallocated BF16 output of x's shape, contiguous, 16-byte aligned, on
            x's device, not overlapping x. Written and returned.
        workspace: optional caller-owned int32 1-D buffer of at least
            :func:`cake_causal_conv1d_train_forward_workspace_bytes` bytes, e.g. from
            :func:`cake_causal_conv1d_train_forward_workspace`: zero before its first launch and
            left zero by every launch, so one buffer serves every later call of one stream, CUDA
            Graph replays included; launches that may run at once need one each. When omitted,
            a zeroed buffer kept per (device, current stream) is used, or a buffer of the call's
            own while the current stream is capturing a CUDA graph.

    Returns:
        BF16 ``y`` of x's shape (``out`` when given). ``S == 0`` returns the empty output
        without launching.

    Raises:
        TypeError: a tensor argument is not a tensor.
        ValueError: a bad dtype, shape, layout, device, alignment or size; nothing is launched
            and ``out`` / ``workspace`` are untouched.
        RuntimeError: x's device is not supported, the module cannot be built or loaded, or the
            launch fails (with the CUDA error string).
    """
    S, C, device = _check_args(x, weight, cu_seqlens, bias, out, workspace)
    if S == 0:
        return torch.empty_like(x) if out is None else out
    x_ptr, w_ptr = x.data_ptr(), weight.data_ptr()
    b_ptr = 0 if bias is None else bias.data_ptr()
    # The kernel reads taps and bias 16 bytes at a time: a misaligned view (a slice of a larger
    # parameter) is copied, a few KB; x and out are the caller's big buffers and must be aligned.
    if w_ptr & 15:
        weight = weight.clone()
        w_ptr = weight.data_ptr()
    if b_ptr & 15:
        bias = bias.clone()
        b_ptr = bias.data_ptr()
    if out is not None:
        out_ptr = out.data_ptr()
        if out_ptr < x_ptr + 2 * S * C and x_ptr < out_ptr + 2 * S * C:
            raise ValueError(f"{_FN}: out must not overlap x (the kernel reads x after writing out)")
    else:
        out_ptr = 0
    if (x_ptr | out_ptr) & 15:  # 16-byte vector loads and stores
        name, ptr = ("x", x_ptr) if x_ptr & 15 else ("out", out_ptr)
        raise ValueError(f"{_FN}: {name} must start at a 16-byte aligned address, got {ptr:#x}")
    module = _module(device, weight.dtype, None if bias is None else bias.dtype)
    if out is None:
        out = torch.empty_like(x)  # the allocator hands out 512-byte aligned blocks
        out_ptr = out.data_ptr()
    stream = torch._C._cuda_getCurrentRawStream(device)
    if workspace is None:
        workspace = _default_workspace(device, stream, S, C)
    rc = module.causal_conv1d_fwd(
        x_ptr, out_ptr, w_ptr, b_ptr, cu_seqlens.data_ptr(), workspace.data_ptr(), S, C, cu_seqlens.shape[0] - 1,
        device, stream,
    )
    if rc:
        raise RuntimeError(f"{_FN}: launch failed with CUDA error {rc}: {module.last_error_message()}")
    return out
