"""Packed (varlen) width-4 causal conv1d + SiLU for training: the forward, the backward, their
workspaces, and the autograd entry point :func:`cake_causal_conv1d` (also under torch.compile)."""

from __future__ import annotations

import math

import torch

from . import _checks, jit
from ._checks import PARAM_DTYPES, arch_of

__all__ = [
    "CakeCausalConv1dFunction",
    "cake_causal_conv1d",
    "cake_causal_conv1d_train_backward",
    "cake_causal_conv1d_train_backward_workspace",
    "cake_causal_conv1d_train_backward_workspace_bytes",
    "cake_causal_conv1d_train_forward",
    "cake_causal_conv1d_train_forward_workspace",
    "cake_causal_conv1d_train_forward_workspace_bytes",
    "is_cake_causal_conv1d_train_supported",
]

_FWD = "cake_causal_conv1d_train_forward"
_BWD = "cake_causal_conv1d_train_backward"
_AUTOGRAD = "cake_causal_conv1d"
# Token-chunk counters for forward routes with a persistent grid (kFwdWorkspaceCounters in the
# template): two int32, zero before and after every launch (no route of today writes them).
_FWD_WORKSPACE_COUNTERS = 2
# silu_grad_preactivation values (the binding maps them to the kernel's round_preact flag).
_SILU_GRAD_POLICIES = ("bf16", "fp32")
# The binding's dtype codes of the parameters (torch_binding.cpp).
_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1}
_BIAS_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def cake_causal_conv1d_train_forward_workspace_bytes(S: int, C: int, device) -> int:
    """Bytes of int32 workspace a forward of ``[S, C]`` on ``device`` needs: the most over every
    route (two token-chunk counters; no route of today writes them)."""
    _checks.check_sizes(S, C, device, "forward")
    return 4 * _FWD_WORKSPACE_COUNTERS


def cake_causal_conv1d_train_forward_workspace(S: int, C: int, device) -> torch.Tensor:
    """A zeroed int32 workspace of at least
    ``cake_causal_conv1d_train_forward_workspace_bytes(S, C, device)`` bytes on ``device``.
    Every launch leaves it zero, so one serves every later call of one stream (graph replays
    included); launches that may run at once need one each."""
    device = _checks.check_sizes(S, C, device, "forward")
    nbytes = cake_causal_conv1d_train_forward_workspace_bytes(S, C, device)
    return torch.zeros(math.ceil(nbytes / 4), dtype=torch.int32, device=device)


def _check_policy(fn: str, silu_grad_preactivation) -> None:
    """ValueError unless silu_grad_preactivation is one of the policies."""
    if not isinstance(silu_grad_preactivation, str) or silu_grad_preactivation not in _SILU_GRAD_POLICIES:
        raise ValueError(
            f"{fn}: silu_grad_preactivation must be one of {list(_SILU_GRAD_POLICIES)}, got {silu_grad_preactivation!r}"
        )


def cake_causal_conv1d_train_backward_workspace_bytes(S: int, C: int, device) -> int:
    """Bytes of FP32 workspace a backward of ``[S, C]`` on ``device`` needs: int32 counters of
    the reduction tree (per 32 channels, one per 8 token groups and one), then one partial row of
    the four taps' and the bias's gradient sums per token group (5 x C x 4 bytes per group of
    128 to 1024 tokens: 1 % to 8 % of x's bytes once S >= 128, 0.3 % to 2.6 % of the bytes the
    backward moves; a single group below that); 0 when ``S == 0``. Never decreases with S: a
    workspace for the largest S serves every smaller one. (The rule lives in
    causal_conv1d_bwd_plan.h; the first call builds the torch binding, which applies it.)"""
    _checks.check_sizes(S, C, device, "backward")
    return jit.load_binding().backward_plan(S, C)[1]


def cake_causal_conv1d_train_backward_workspace(S: int, C: int, device) -> torch.Tensor:
    """A zeroed FP32 workspace of at least
    ``cake_causal_conv1d_train_backward_workspace_bytes(S, C, device)`` bytes on ``device``.
    Every launch leaves it zero (the counters and partial rows it used are reset by the CTA that
    reduces them), so one serves every later call of one stream, of any shape it is large
    enough for, CUDA Graph replays included; launches that may run at once need one each."""
    device = _checks.check_sizes(S, C, device, "backward")
    nbytes = cake_causal_conv1d_train_backward_workspace_bytes(S, C, device)
    return torch.zeros(math.ceil(nbytes / 4), dtype=torch.float32, device=device)


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
    return arch_of(index) is not None


def _register(device: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Load (building if needed) the kernel module of weight's and bias's dtypes for ``device``
    and give the binding its entries."""
    bias_dtype = None if bias is None else bias.dtype
    spec = jit.VariantSpec(
        PARAM_DTYPES[weight.dtype], "none" if bias_dtype is None else PARAM_DTYPES[bias_dtype], arch_of(device)
    )
    module = jit.load(spec)
    jit.load_binding().register_module(device, _WEIGHT_CODES[weight.dtype], _BIAS_CODES[bias_dtype],
                                       *module.entry_addresses)


def _declined(fn: str) -> RuntimeError:
    return RuntimeError(f"{fn}: internal error: the torch binding declined arguments that pass every check "
                        "(please report it, with the arguments' dtypes, shapes and devices)")


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
            the host and no stream is synchronized. Any content is memory-safe: every row of ``y``
            is written and only x, y, the parameters and cu_seqlens[0..num_docs] are read. With
            non-decreasing values out of [0, S], token ``t`` keeps the history back to the last
            entry ``<= t`` (none when there is none), so tokens past ``cu_seqlens[-1]`` continue
            one more document; with values out of order each token keeps some 0 to 3 tokens of
            history, the same on every run.
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
    y = jit.load_binding().forward(x, weight, cu_seqlens, bias, out, workspace)
    return _forward_declined(x, weight, cu_seqlens, bias, out, workspace) if y is None else y


def _forward_declined(x, weight, cu_seqlens, bias, out, workspace) -> torch.Tensor:
    """The binding declined the call (it applies these rules without the messages): raise the
    error these checks find, else register the variant's module (its first call on the device)
    and call again."""
    device = _check_forward_args(x, weight, cu_seqlens, bias, out, workspace)
    _register(device, weight, bias)
    y = jit.load_binding().forward(x, weight, cu_seqlens, bias, out, workspace)
    if y is None:
        raise _declined(_FWD)
    return y


def _check_forward_args(x, weight, cu_seqlens, bias, out, workspace) -> int:
    """Raises the error of the first forward rule the arguments break; returns x's device index."""
    _checks.check_types(_FWD, (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens)),
                        (("bias", bias), ("out", out), ("workspace", workspace)))
    S, C = _checks.check_x(_FWD, x)
    _checks.check_params(_FWD, weight, cu_seqlens, bias, C)
    if out is not None:
        _checks.check_like(_FWD, "out", out, torch.bfloat16, x.shape, "x's shape")
    if workspace is not None:
        _checks.check_workspace(_FWD, workspace, torch.int32, 4 * _FWD_WORKSPACE_COUNTERS,
                                "cake_causal_conv1d_train_forward_workspace_bytes")
    device = _checks.check_devices(_FWD, x, (("weight", weight), ("cu_seqlens", cu_seqlens), ("bias", bias),
                                             ("out", out), ("workspace", workspace)))
    if S:
        # out is written while x, the parameters and cu_seqlens are read (the workspace, too,
        # must stay as it is).
        _checks.check_no_overlap(_FWD, (("x", x), ("weight", weight), ("bias", bias), ("cu_seqlens", cu_seqlens),
                                        ("workspace", workspace), ("out", out)), ("out",))
        x_ptr, out_ptr = x.data_ptr(), 0 if out is None else out.data_ptr()
        if (x_ptr | out_ptr) & 15:  # 16-byte vector loads and stores
            name, ptr = ("x", x_ptr) if x_ptr & 15 else ("out", out_ptr)
            raise ValueError(f"{_FWD}: {name} must start at a 16-byte aligned address, got {ptr:#x}")
    return device


def cake_causal_conv1d_train_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dy: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    silu_grad_preactivation: str = "bf16",
    workspace: torch.Tensor | None = None,
    dx: torch.Tensor | None = None,
    dweight: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of :func:`cake_causal_conv1d_train_forward`: gradients of x, weight and bias
    given ``dy``, the gradient of ``y``.

    Recomputes the FP32 pre-activation ``a[t, c] = bias[c] + sum_k weight[c, k] * x[t - 3 + k, c]``
    from x (the forward saves nothing else), forms ``g = dy * silu'(a')`` in FP32 and returns::

        dx[s, c]      = bf16(sum_k weight[c, k] * g[s + 3 - k, c])    (taps inside a document)
        dweight[c, k] = sum_t g[t, c] * x[t - 3 + k, c]              (taps inside t's document)
        dbias[c]      = sum_t g[t, c]

    No gradient crosses a document boundary: a tap the forward skipped contributes nothing.
    dweight and dbias are summed in FP32 in a fixed order (per-token-group partial sums in the
    workspace, added by a fixed two-level tree: the last CTA of each chunk of 8 groups adds the
    chunk in group order, the last chunk adds the chunk sums in chunk order; no float atomics),
    so they are bitwise identical run to run for a given (S, C, weight dtype, bias dtype,
    policy). No host synchronization; CUDA-graph capturable.

    Args:
        x, weight, cu_seqlens, bias: the forward's arguments, with the forward's requirements,
            except that the backward's range is S < 2^30 and S * C < 2^34.
        dy: BF16 gradient of ``y``, x's shape, contiguous, 16-byte aligned, on x's device.
        silu_grad_preactivation: ``"bf16"`` (default) evaluates ``silu'`` at the pre-activation
            rounded to BF16 (to nearest even), ``"fp32"`` at the unrounded FP32 value.
        workspace: optional caller-owned FP32 1-D buffer of at least
            :func:`cake_causal_conv1d_train_backward_workspace_bytes` bytes, e.g. from
            :func:`cake_causal_conv1d_train_backward_workspace`: zero before its first launch
            and left zero by every launch, so one buffer serves every later call of one
            stream, CUDA Graph replays included; launches that may run at once need one each.
            When omitted, a zeroed buffer kept per (device, current stream) is used (replaced
            by a larger one when too small), or a zeroed buffer of the call's own while the
            current stream is capturing a CUDA graph.
        dx: optional preallocated BF16 output of x's shape, contiguous, 16-byte aligned.
        dweight: optional preallocated output of weight's dtype and shape ``[C, 4]``, contiguous.
        dbias: optional preallocated output of bias's dtype and shape ``[C]``, contiguous; only
            with ``bias``. No output and no workspace may overlap an input or each other.

    Returns:
        ``(dx, dweight)``, or ``(dx, dweight, dbias)`` when ``bias`` is given; the given output
        tensors when passed. ``S == 0``: dx is empty, dweight and dbias are zero.

    Raises:
        TypeError: a tensor argument is not a tensor.
        ValueError: a bad dtype, shape, layout, device, alignment, overlap, size or policy;
            nothing is launched and no output is touched.
        RuntimeError: x's device is not supported, the module cannot be built or loaded, or the
            launch fails (with the CUDA error string).
    """
    grads = jit.load_binding().backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx,
                                        dweight, dbias)
    if grads is None:
        grads = _backward_declined(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx,
                                   dweight, dbias)
    return grads


def _backward_declined(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx, dweight,
                       dbias) -> tuple[torch.Tensor, ...]:
    """As _forward_declined, for the backward."""
    _checks.check_types(_BWD, (("x", x), ("weight", weight), ("cu_seqlens", cu_seqlens), ("dy", dy)),
                        (("bias", bias), ("workspace", workspace), ("dx", dx), ("dweight", dweight),
                         ("dbias", dbias)))
    _check_policy(_BWD, silu_grad_preactivation)
    S, C = _checks.check_x(_BWD, x, "backward")
    _checks.check_params(_BWD, weight, cu_seqlens, bias, C)
    _checks.check_like(_BWD, "dy", dy, torch.bfloat16, x.shape, "x's shape")
    if dx is not None:
        _checks.check_like(_BWD, "dx", dx, torch.bfloat16, x.shape, "x's shape")
    if dweight is not None:
        _checks.check_like(_BWD, "dweight", dweight, weight.dtype, weight.shape, "weight's dtype and shape")
    if dbias is not None:
        if bias is None:
            raise ValueError(f"{_BWD}: dbias must be None when bias is None, got a tensor of shape {tuple(dbias.shape)}")
        _checks.check_like(_BWD, "dbias", dbias, bias.dtype, bias.shape, "bias's dtype and shape")
    if workspace is not None:
        need = jit.load_binding().backward_plan(S, C)[1]
        _checks.check_workspace(_BWD, workspace, torch.float32, need,
                                "cake_causal_conv1d_train_backward_workspace_bytes")
    device = _checks.check_devices(_BWD, x, (("weight", weight), ("cu_seqlens", cu_seqlens), ("dy", dy),
                                             ("bias", bias), ("workspace", workspace), ("dx", dx),
                                             ("dweight", dweight), ("dbias", dbias)))
    x_ptr, dy_ptr = x.data_ptr(), dy.data_ptr()
    dx_ptr = 0 if dx is None else dx.data_ptr()
    if S and (x_ptr | dy_ptr | dx_ptr) & 15:  # 8-byte vectors; 16 keeps the forward's rule
        name, ptr = next((n, p) for n, p in (("x", x_ptr), ("dy", dy_ptr), ("dx", dx_ptr)) if p & 15)
        raise ValueError(f"{_BWD}: {name} must start at a 16-byte aligned address, got {ptr:#x}")
    # What the kernel writes (dx, the workspace's counters and partial rows, dweight, dbias) may
    # overlap nothing else: it reads x, dy, weight, bias and cu_seqlens while writing dx and the
    # partial rows, and reads the partial rows while writing dweight/dbias.
    _checks.check_no_overlap(_BWD, (("x", x), ("dy", dy), ("weight", weight), ("bias", bias),
                                    ("cu_seqlens", cu_seqlens), ("workspace", workspace), ("dx", dx),
                                    ("dweight", dweight), ("dbias", dbias)), ("workspace", "dx", "dweight", "dbias"))
    _register(device, weight, bias)
    grads = jit.load_binding().backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation, workspace, dx,
                                        dweight, dbias)
    if grads is None:
        raise _declined(_BWD)
    return grads


# torch.compile sees the kernels as two custom ops (opaque to the compiler, with fake
# implementations for shape propagation). Eager calls skip the op dispatcher: they call the
# functions above directly, which is what the ops run too.
@torch.library.custom_op("flashinfer_cake::causal_conv1d_fwd", mutates_args=(), device_types="cuda")
def _causal_conv1d_fwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    return cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)


@_causal_conv1d_fwd_op.register_fake
def _(x, weight, cu_seqlens, bias):
    return torch.empty_like(x)


@torch.library.custom_op("flashinfer_cake::causal_conv1d_bwd", mutates_args=(), device_types="cuda")
def _causal_conv1d_bwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, dy: torch.Tensor,
                          bias: torch.Tensor | None, silu_grad_preactivation: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, *dbias = _backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation)
    # A custom op returns tensors only: no bias -> an empty dbias, turned back into None by the caller.
    return dx, dweight, dbias[0] if dbias else x.new_empty(0)


@_causal_conv1d_bwd_op.register_fake
def _(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation):
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(0) if bias is None else torch.empty_like(bias)


def _backward(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation):
    """The backward with an incoming gradient of any dtype and layout, materialized once as a
    BF16 contiguous 16-byte aligned tensor when it is not one."""
    if dy.dtype != torch.bfloat16 or not dy.is_contiguous() or dy.is_neg() or dy.data_ptr() & 15:
        dy = torch.empty_like(x).copy_(dy)
    return cake_causal_conv1d_train_backward(x, weight, cu_seqlens, dy, bias=bias,
                                             silu_grad_preactivation=silu_grad_preactivation)


class CakeCausalConv1dFunction(torch.autograd.Function):
    """Autograd of :func:`cake_causal_conv1d` under torch.compile: saves x, weight, bias and
    cu_seqlens only (the backward recomputes the pre-activation); gradients come back in the
    inputs' dtypes. Eager calls of :func:`cake_causal_conv1d` use the torch binding's C++ node,
    which does the same for less host time; ``CakeCausalConv1dFunction.apply(x, weight,
    cu_seqlens, bias, silu_grad_preactivation)`` works eagerly too, with identical results."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, bias, silu_grad_preactivation):
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.silu_grad_preactivation = silu_grad_preactivation
        if torch.compiler.is_compiling():
            return torch.ops.flashinfer_cake.causal_conv1d_fwd(x, weight, cu_seqlens, bias)
        return cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is not itself differentiable
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        policy = ctx.silu_grad_preactivation
        if torch.compiler.is_compiling():
            dx, dweight, dbias = torch.ops.flashinfer_cake.causal_conv1d_bwd(x, weight, cu_seqlens, dy, bias, policy)
            dbias = None if bias is None else dbias
        else:
            dx, dweight, *rest = _backward(x, weight, cu_seqlens, dy, bias, policy)
            dbias = rest[0] if rest else None
        return dx, dweight, None, dbias, None


def cake_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_grad_preactivation: str = "bf16",
) -> torch.Tensor:
    """Packed width-4 causal conv1d + SiLU with autograd: the training entry point.

    ``y = cake_causal_conv1d_train_forward(x, weight, cu_seqlens, bias=bias)``; ``y.backward``
    runs :func:`cake_causal_conv1d_train_backward` (x, weight and bias get gradients in their own
    dtypes; cu_seqlens none). Only x, weight, bias and cu_seqlens are saved for the backward; an
    incoming gradient that is not BF16, contiguous and 16-byte aligned is copied once into one
    that is; the backward is not itself differentiable (``create_graph=True`` gives gradients
    whose own backward raises). Eager calls record a C++ autograd node of the torch binding;
    under ``torch.compile`` the call is :class:`CakeCausalConv1dFunction` over the custom ops
    ``torch.ops.flashinfer_cake.causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (no graph break,
    ``fullgraph=True`` works), and under ``torch.jit.trace`` that Function too. Both give bitwise
    the same results. ``torch.func`` transforms (grad, vmap) are not supported.

    Args:
        x, weight, cu_seqlens, bias: as in :func:`cake_causal_conv1d_train_forward`.
        silu_grad_preactivation: ``"bf16"`` or ``"fp32"``, as in
            :func:`cake_causal_conv1d_train_backward`.

    Returns:
        BF16 ``y`` of x's shape.

    Raises:
        As the forward; and a ValueError up front when x is outside the backward's range
        (S < 2^30, S * C < 2^34).
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # the binding is opaque to both
        _check_autograd_args(x, silu_grad_preactivation)
        return CakeCausalConv1dFunction.apply(x, weight, cu_seqlens, bias, silu_grad_preactivation)
    # Eager: the binding's C++ autograd node (a Python autograd.Function costs ~13 us more per call).
    y = jit.load_binding().autograd_forward(x, weight, cu_seqlens, bias, silu_grad_preactivation)
    return _autograd_declined(x, weight, cu_seqlens, bias, silu_grad_preactivation) if y is None else y


def _check_autograd_args(x, silu_grad_preactivation) -> None:
    """cake_causal_conv1d's own rules: the policy, and x within the backward's range (an error now,
    not in the backward)."""
    _check_policy(_AUTOGRAD, silu_grad_preactivation)
    if isinstance(x, torch.Tensor) and x.dim() in (2, 3):
        S, C = x.shape[-2], x.shape[-1]
        if S >= _checks.MAX_S["backward"] or S * C >= _checks.MAX_ELEMENTS["backward"]:
            _checks.check_x(_AUTOGRAD, x, "backward")


def _autograd_declined(x, weight, cu_seqlens, bias, silu_grad_preactivation) -> torch.Tensor:
    """As _forward_declined, for cake_causal_conv1d's eager call."""
    _check_autograd_args(x, silu_grad_preactivation)
    device = _check_forward_args(x, weight, cu_seqlens, bias, None, None)
    _register(device, weight, bias)
    y = jit.load_binding().autograd_forward(x, weight, cu_seqlens, bias, silu_grad_preactivation)
    if y is None:
        raise _declined(_AUTOGRAD)
    return y
