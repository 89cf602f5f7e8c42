"""Packed (varlen) width-4 causal conv1d + SiLU for training: the eager forward and backward and
their workspaces. The autograd entry point is :func:`flashinfer_cake.cake_causal_conv1d`
(flashinfer_cake/autograd.py)."""

from __future__ import annotations

import math
import numbers

import torch

from . import _checks, _dispatch, _plan

__all__ = [
    "cake_causal_conv1d_train_backward",
    "cake_causal_conv1d_train_backward_workspace",
    "cake_causal_conv1d_train_backward_workspace_bytes",
    "cake_causal_conv1d_train_forward",
    "cake_causal_conv1d_train_forward_workspace",
    "cake_causal_conv1d_train_forward_workspace_bytes",
    "check_cu_seqlens",
    "is_cake_causal_conv1d_train_supported",
]

_FWD = "cake_causal_conv1d_train_forward"
_BWD = "cake_causal_conv1d_train_backward"


def cake_causal_conv1d_train_forward_workspace_bytes(S: int, C: int, device=None) -> int:
    """Bytes of int32 workspace a forward of ``[S, C]`` needs: the most over every route (two
    token-chunk counters; no route of today writes them). ``device`` does not change it (the
    parameter mirrors :func:`cake_causal_conv1d_train_forward_workspace`)."""
    _checks.check_sizes("cake_causal_conv1d_train_forward_workspace_bytes", S, C, "forward")
    return 4 * _checks.FWD_WORKSPACE_COUNTERS


def cake_causal_conv1d_train_forward_workspace(S: int, C: int, device) -> torch.Tensor:
    """A zeroed int32 workspace of at least
    ``cake_causal_conv1d_train_forward_workspace_bytes(S, C)`` bytes on ``device``.
    Every launch leaves it zero, so one serves every later call of one stream (graph replays
    included); launches that may run at once need one each."""
    fn = "cake_causal_conv1d_train_forward_workspace"
    S, C = _checks.check_sizes(fn, S, C, "forward")
    device = _checks.check_allocation_device(fn, device)
    nbytes = cake_causal_conv1d_train_forward_workspace_bytes(S, C)
    return torch.zeros(math.ceil(nbytes / 4), dtype=torch.int32, device=device)


def cake_causal_conv1d_train_backward_workspace_bytes(S: int, C: int, device=None) -> int:
    """Bytes of FP32 workspace a backward of ``[S, C]`` needs: one partial row of the four taps'
    and the bias's gradient sums per token group (5 x C x 4 bytes per group of 128 to 1024 tokens,
    the group count rounded up: 1 % to 8.1 % of x's bytes from S = 4096 on, up to 15 % from S =
    128, a third of that against the bytes the backward moves; a single group below S = 128); 0
    when ``S == 0``. ``device`` does not change it (the parameter mirrors
    :func:`cake_causal_conv1d_train_backward_workspace`).
    Never decreases with S: a workspace for the largest S serves every smaller one. (The rule is
    causal_conv1d_bwd_plan.h's; nothing is built to compute it.)"""
    S, C = _checks.check_sizes("cake_causal_conv1d_train_backward_workspace_bytes", S, C, "backward")
    return _plan.workspace_bytes(S, C)


def cake_causal_conv1d_train_backward_workspace(S: int, C: int, device) -> torch.Tensor:
    """An FP32 workspace of at least ``cake_causal_conv1d_train_backward_workspace_bytes(S, C)``
    bytes on ``device`` (uninitialized: its content never matters). One serves every later call
    of one stream, of any shape it is large enough for, CUDA Graph replays included; calls that
    may run at once need one each."""
    fn = "cake_causal_conv1d_train_backward_workspace"
    S, C = _checks.check_sizes(fn, S, C, "backward")
    device = _checks.check_allocation_device(fn, device)
    nbytes = cake_causal_conv1d_train_backward_workspace_bytes(S, C)
    return torch.empty(math.ceil(nbytes / 4), dtype=torch.float32, device=device)


def is_cake_causal_conv1d_train_supported(device=None) -> bool:
    """True when ``device`` (default: the current CUDA device) can run these kernels: a CUDA
    device of a supported arch (compute capability 9.0). False, not an error, otherwise (a CPU
    device, another GPU, an index past the device count, no CUDA at all); a device string torch
    cannot parse is torch's RuntimeError on any machine."""
    if isinstance(device, numbers.Integral):  # an index (torch.device(index) raises without an accelerator)
        device = int(device)
    elif device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return False
    if not torch.cuda.is_available():
        return False
    if device is None or isinstance(device, int):
        index = torch.cuda.current_device() if device is None else device
    else:
        index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        return False
    return _checks.arch_of(index) is not None


@torch.compiler.disable(reason="check_cu_seqlens reads cu_seqlens on the host: call it outside the compiled region")
def check_cu_seqlens(cu_seqlens, num_tokens=None) -> None:
    """Raise ValueError unless ``cu_seqlens`` holds the prefix sums of a packed batch's document
    lengths as the kernels take them: ``cu_seqlens[0] == 0``, never decreasing, the last entry
    below 2^31 and, with ``num_tokens`` (the batch's S), equal to it. The message names the first
    entry that breaks the rule.

    The kernels never read ``cu_seqlens`` on the host, so they cannot tell content they do not
    define (it stays memory-safe, with the results the README describes). This opt-in check reads
    every entry on the host: call it on the data loader's CPU copy (no GPU work; an int64 one is
    checked before its conversion to int32), or on a CUDA tensor while debugging (one copy to the
    host, which synchronizes). ``cu_seqlens``: a 1-D integer tensor on any device, a 1-D integer
    NumPy array, or a list / tuple of ints.

    Raises ValueError for content or a form other than these, TypeError for a ``num_tokens`` that is
    not an integer, RuntimeError for a CUDA tensor while its device's current stream captures a CUDA
    graph. torch.compile runs it outside the graph (a graph break; with ``fullgraph=True`` an error:
    call it before the compiled function)."""
    fn = "check_cu_seqlens"
    if num_tokens is not None:
        n = _checks.as_int(num_tokens)
        if n is None or n < 0:
            raise (TypeError if n is None else ValueError)(
                f"{fn}: num_tokens must be None or a non-negative int (the batch's S), got {num_tokens!r}")
        num_tokens = n
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_cuda:
        with torch.cuda.device(cu_seqlens.device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{fn}: cu_seqlens is read on the host, which a CUDA graph capture cannot do: "
                                   f"check it before capturing (or its CPU copy)")
    cu = _checks.cu_seqlens_values(fn, "cu_seqlens", cu_seqlens, device_read=True)
    problem = _checks.cu_seqlens_problem("cu_seqlens", cu, num_tokens, below=_checks.MAX_S["forward"])
    if problem:
        raise ValueError(f"{fn}: {problem}")


def cake_causal_conv1d_train_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    final_states_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed width-4 depthwise causal convolution + SiLU, training forward.

    ``y[t, c] = bf16(silu(sum_k weight[c, k] * x[t - 3 + k, c] + bias[c]))`` where a tap before
    a document's first token reads the document's initial state when ``initial_states`` is
    given, and nothing (zero history) otherwise. Math in FP32 with the taps in one fixed order;
    the result is rounded to BF16 to nearest even, bitwise identical for a given (S, C, device,
    weight dtype, bias dtype).

    Per-document conv states (``[num_docs, 3, C]``, row 2 the token right before the document,
    row 0 three before): a document's final state is the last 3 rows of its history after its
    tokens (its last 3 tokens; for a document shorter than 3 tokens, or empty, the tail of its
    initial rows, zeros without them, followed by its tokens). Feeding one chunk's final states
    as the next chunk's initial states gives the y of the unsplit sequence bitwise (up to the sign
    of an exactly zero pre-activation, where a tap reads a zero state row instead of nothing).

    Args:
        x: BF16 ``[S, C]`` or ``[1, S, C]``, 16-byte aligned (any tensor from the allocator is;
            an offset view may not be), on a CUDA device of compute capability 9.0; C is a
            multiple of 8; S < 2^31 and S * C < 2^35. Contiguous, or a row-strided view read in
            place: ``stride(-1) == 1`` and a row stride ``stride(-2)`` of at least C elements, a
            multiple of 8 (a column slice of a wider tensor, e.g. Mamba2's ``xBC`` out of
            ``in_proj``'s output), with S * stride(-2) < 2^35.
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
            history, the same on every run. The states are defined for non-decreasing content
            within [0, S]; for other content they are memory-safe but unspecified: the final
            states of documents out of [0, S] (or out of order) are not written, so a given
            ``final_states_out`` keeps its rows there and new final states (``cake_causal_conv1d``'s)
            hold whatever their memory held. :func:`check_cu_seqlens` checks the content on the
            host (opt-in: it reads every entry).
        bias: optional FP32 or BF16 ``[C]``, contiguous, added after the four taps, before SiLU;
            its dtype is independent of weight's.
        initial_states: optional BF16 ``[num_docs, 3, C]``, contiguous, 16-byte aligned, on
            x's device: each document's history before its first token.
        final_states_out: optional preallocated BF16 ``[num_docs, 3, C]``, contiguous, 16-byte
            aligned, on x's device, overlapping no input: written with the documents' final
            states.
        out: optional preallocated BF16 output of x's shape, 16-byte aligned, on x's device,
            contiguous or row-strided as x may be, overlapping no input (byte spans from first
            to last element). Written and returned.
        workspace: optional caller-owned int32 1-D buffer of at least
            :func:`cake_causal_conv1d_train_forward_workspace_bytes` bytes, e.g. from
            :func:`cake_causal_conv1d_train_forward_workspace`: zero before its first launch and
            left zero by every launch, so one buffer serves every later call of one stream, CUDA
            Graph replays included; launches that may run at once need one each. When omitted,
            a zeroed buffer kept per (device, current stream) is used, or a buffer of the call's
            own while the current stream is capturing a CUDA graph (left unfilled while no route
            reads the counters: a fill would be one more kernel per call in every replay).

    Returns:
        BF16 ``y`` of x's shape (``out`` when given). ``S == 0``: the empty output, and the
        final states (every document empty) are the initial states, or zeros.

    Raises:
        TypeError: a tensor argument is not a tensor.
        ValueError: a bad dtype, shape, layout, device, alignment or size; nothing is launched
            and ``out`` / ``workspace`` are untouched.
        NotImplementedError: a tensor of a ``torch.func`` transform.
        RuntimeError: with grad mode on, a tensor argument requires grad, or in any mode one is a
            dual tensor of forward-mode AD (this function records no autograd graph, propagates
            no tangent and writes its outputs in place: :func:`cake_causal_conv1d` is the
            autograd entry point); x's device is not supported, the module cannot be built or
            loaded, or the launch fails (with the CUDA error string).
    """
    binding = _dispatch.binding
    args = (x, weight, cu_seqlens, bias, initial_states, final_states_out, out, workspace)
    y = None if binding is None else binding.try_forward(*args)
    if y is None:  # a bad argument (raised here, before anything is built), or a first call
        device = _checks.check_forward_args(_FWD, *args, raw=True)
        y = _dispatch.binding_for(device, weight, bias).try_forward(*args)
        if y is None:
            raise _dispatch.declined_error(_FWD)
    return y


def cake_causal_conv1d_train_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dy: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dfinal_states: torch.Tensor | None = None,
    silu_grad_preactivation: str = "bf16",
    workspace: torch.Tensor | None = None,
    dx: torch.Tensor | None = None,
    dweight: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
    dinitial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward of :func:`cake_causal_conv1d_train_forward`: gradients of x, weight, bias and
    the initial states given ``dy``, the gradient of ``y``, and optionally ``dfinal_states``,
    the gradient of the final states.

    Recomputes the FP32 pre-activation ``a[t, c] = bias[c] + sum_k weight[c, k] * x[t - 3 + k, c]``
    from x (the forward saves nothing else; a tap before a document reads its initial state),
    forms ``g = dy * silu'(a')`` in FP32 and returns::

        dx[s, c]      = bf16(sum_k weight[c, k] * g[s + 3 - k, c])    (taps inside a document)
        dweight[c, k] = sum_t g[t, c] * (what tap k of t read: x or an initial state row)
        dbias[c]      = sum_t g[t, c]
        dinitial_states[d, r, c] = bf16(sum of weight[c, k] * g[t, c] over the taps of document
                                   d's first tokens that read its initial row r)

    plus ``dfinal_states``, added (in FP32, before the rounding) to the dx row, or the
    dinitial_states row, each final-state row came from. No gradient crosses a document boundary:
    a tap the forward skipped contributes nothing.
    dweight and dbias are summed in FP32 in a fixed order (per-token-group partial sums in the
    workspace, added by a fixed tree in a second kernel launched right after the first, with
    programmatic dependent launch like the forward and streaming kernels: each node adds its up to
    8 children in order, level after level up to one root; no float atomics), so they are bitwise
    identical run to run for a given (S, C, weight dtype, bias dtype, policy). Every part of
    ``workspace`` the call reads it wrote first: no workspace content can change a result. No
    host synchronization; CUDA-graph capturable.

    Args:
        x, weight, cu_seqlens, bias: the forward's arguments, with the forward's requirements,
            except that the backward's range is S < 2^30 and S * C < 2^34. For cu_seqlens content
            other than non-decreasing within [0, S], ``dinitial_states`` is unspecified as the
            forward's final states are: the rows of documents out of [0, S] (or out of order) are
            not written (a new ``dinitial_states`` holds whatever its memory held there).
        dy: BF16 gradient of ``y``, x's shape, 16-byte aligned, on x's device, contiguous or
            row-strided as x may be.
        initial_states: optional, as in the forward; with it, ``dinitial_states`` is returned.
        dfinal_states: optional BF16 gradient of the forward's final states ``[num_docs, 3,
            C]``, contiguous, 16-byte aligned (with or without initial_states; without them,
            the gradient of rows that came from the zero history is dropped).
        silu_grad_preactivation: ``"bf16"`` (default) evaluates ``silu'`` at the pre-activation
            rounded to BF16 (to nearest even), ``"fp32"`` at the unrounded FP32 value.
        workspace: optional caller-owned FP32 1-D contiguous buffer, 16-byte aligned, of at least
            :func:`cake_causal_conv1d_train_backward_workspace_bytes` bytes, e.g. from
            :func:`cake_causal_conv1d_train_backward_workspace`: scratch for the partial sums,
            any content (each call writes every part it reads first), so one buffer serves
            every later call of one stream, CUDA Graph replays included; calls that may run
            at once need one each. When omitted, a buffer kept per (device, current stream) is
            used (replaced by a larger one when too small), or a buffer of the call's own while
            the current stream is capturing a CUDA graph.
        dx: optional preallocated BF16 output of x's shape, 16-byte aligned, contiguous or
            row-strided as x may be.
        dweight: optional preallocated output of weight's dtype and shape ``[C, 4]``, contiguous.
        dbias: optional preallocated output of bias's dtype and shape ``[C]``, contiguous; only
            with ``bias``.
        dinitial_states: optional preallocated BF16 ``[num_docs, 3, C]``, contiguous, 16-byte
            aligned; only with ``initial_states``. No output and no workspace may overlap an
            input or each other (byte spans from first to last element).

    Returns:
        ``(dx, dweight)``, then ``dbias`` when ``bias`` is given, then ``dinitial_states`` when
        ``initial_states`` is given; the given output tensors when passed. ``S == 0``: dx is
        empty, dweight and dbias are zero, dinitial_states is dfinal_states (or zero).

    Raises:
        TypeError: a tensor argument is not a tensor.
        ValueError: a bad dtype, shape, layout, device, alignment, overlap, size or policy;
            nothing is launched and no output is touched.
        NotImplementedError: a tensor of a ``torch.func`` transform.
        RuntimeError: with grad mode on, a tensor argument requires grad, or in any mode one is a
            dual tensor of forward-mode AD (this function is not differentiable and writes its
            outputs in place); x's device is not supported, the
            module cannot be built or loaded, or the launch fails (with the CUDA error string).
    """
    binding = _dispatch.binding
    args = (x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation, workspace, dx,
            dweight, dbias, dinitial_states)
    grads = None if binding is None else binding.try_backward(*args)
    if grads is None:  # a bad argument (raised here, before anything is built), or a first call
        device = _checks.check_backward_args(_BWD, *args)
        grads = _dispatch.binding_for(device, weight, bias).try_backward(*args)
        if grads is None:
            raise _dispatch.declined_error(_BWD)
    return grads
