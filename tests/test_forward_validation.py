"""CPU tests of the forward's argument validation (no GPU needed: they run in CI).

The forward validates argument types first, then dtypes/shapes/contiguity of every argument,
then devices, so every dtype/shape/type error below is raised for CPU tensors. Each case
checks the exact exception type and that the offending argument is named as a word.
"""

from __future__ import annotations

import numbers
import os
import re
import subprocess
import sys

import pytest
import torch

from flashinfer_cake import (
    cake_causal_conv1d,
    cake_causal_conv1d_train_forward,
    cake_causal_conv1d_train_forward_workspace_bytes,
    check_cu_seqlens,
    is_cake_causal_conv1d_train_supported,
)

FN = "cake_causal_conv1d_train_forward"
S, C = 16, 32
D = 3  # documents of valid_args' cu_seqlens
BF16 = torch.bfloat16
I32 = torch.int32


def valid_args(**override):
    """Valid arguments (all on the CPU) with some of them replaced by `override`."""
    args = {
        "x": torch.randn(S, C).to(BF16),
        "weight": torch.randn(C, 4),
        "cu_seqlens": torch.tensor([0, 5, 5, S], dtype=I32),
        "bias": None,
        "initial_states": None,
        "final_states_out": None,
        "out": None,
        "workspace": None,
    }
    args.update(override)
    return args


def call(args):
    return cake_causal_conv1d_train_forward(
        args["x"],
        args["weight"],
        args["cu_seqlens"],
        bias=args["bias"],
        initial_states=args["initial_states"],
        final_states_out=args["final_states_out"],
        out=args["out"],
        workspace=args["workspace"],
    )


def case(case_id, exc, argname, **override):
    """One bad-input case: `override` maps an argument to a zero-argument tensor factory."""
    return pytest.param(override, exc, argname, id=case_id)


def states():
    return torch.randn(D, 3, C).to(BF16)


def two_tensor(t):
    """t wrapped in torch's test subclass that dispatches in Python (as DTensor does)."""
    from torch.testing._internal.two_tensor import TwoTensor
    return TwoTensor(t, t.clone())


def resized(t, nbytes):
    """t, its storage resized to nbytes since (t keeps its shape: a view past its storage)."""
    t.untyped_storage().resize_(nbytes)
    return t


def bad_states(name, **extra):
    """The cases of a conv-state argument `name` (BF16 [num_docs, 3, C], contiguous), each with
    the `extra` overrides too."""
    bad = [
        ("fp32", ValueError, lambda: torch.randn(D, 3, C)),
        ("fp16", ValueError, lambda: torch.randn(D, 3, C).half()),
        ("docs+1", ValueError, lambda: torch.randn(D + 1, 3, C).to(BF16)),
        ("4-rows", ValueError, lambda: torch.randn(D, 4, C).to(BF16)),
        ("C+8", ValueError, lambda: torch.randn(D, 3, C + 8).to(BF16)),
        ("2d", ValueError, lambda: torch.randn(D * 3, C).to(BF16)),
        ("noncontig", ValueError, lambda: torch.randn(D, C, 3).to(BF16).transpose(1, 2)),
        ("neg-view", ValueError, lambda: torch._neg_view(states())),
        ("list", TypeError, lambda: states().tolist()),
    ]
    return [case(f"{name}-{bad_id}", exc, name, **extra, **{name: make}) for bad_id, exc, make in bad]


def bad_rows(name, huge, peers=("x",)):
    """The layout cases of an [S, C] argument `name` read or written row by row: contiguous
    channels, a row stride >= C and a multiple of 8, S * stride(-2) within range (`huge`: a
    zero-argument factory of a meta tensor past it). `peers`: the given [S, C] arguments, made
    [1, S, C] with `name` for its 3-D case."""
    peers_3d = {peer: lambda: torch.randn(1, S, C).to(BF16) for peer in peers if peer != name}
    return [
        case(f"{name}-channel-stride-2", ValueError, name, **{name: lambda: torch.randn(S, 2 * C).to(BF16)[:, ::2]}),
        case(f"{name}-row-stride-not-mult-8", ValueError, name,
             **{name: lambda: torch.randn(S, C + 4).to(BF16)[:, :C]}),
        case(f"{name}-3d-row-stride-not-mult-8", ValueError, name,
             **peers_3d,
             **{name: lambda: torch.randn(1, S, C + 4).to(BF16)[:, :, :C]}),
        case(f"{name}-row-stride-below-C", ValueError, name,
             **{name: lambda: torch.randn(S * C).to(BF16).as_strided((S, C), (C - 8, 1))}),
        case(f"{name}-S-times-stride-over-range", ValueError, name, **{name: huge}),
    ]


def one_buffer(numel, **views):
    """Factories of views of one BF16 buffer of `numel` elements (view: a function of the
    buffer), made afresh, on the current device, by the first view's factory (overrides are made
    in order)."""
    made = {}
    first = next(iter(views))

    def factory(name, view):
        def make():
            if name == first:
                made["buffer"] = torch.randn(numel).to(BF16)
            return view(made["buffer"])

        return make

    return {name: factory(name, view) for name, view in views.items()}


def rows(b, offset=0, stride=C):
    """An [S, C] view of buffer b, `offset` elements in, with row stride `stride`."""
    return b.as_strided((S, C), (stride, 1), offset)


def state_view(b, offset=0):
    return b[offset : offset + D * 3 * C].view(D, 3, C)


BAD_INPUTS = [
    # x
    case("x-fp16", ValueError, "x", x=lambda: torch.randn(S, C).half()),
    case("x-fp32", ValueError, "x", x=lambda: torch.randn(S, C)),
    case("x-1d", ValueError, "x", x=lambda: torch.randn(S * C).to(BF16)),
    case("x-4d", ValueError, "x", x=lambda: torch.randn(1, 1, S, C).to(BF16)),
    case("x-batch2", ValueError, "x", x=lambda: torch.randn(2, S, C).to(BF16)),
    case("x-C-not-mult-8", ValueError, "x",
         x=lambda: torch.randn(S, 12).to(BF16), weight=lambda: torch.randn(12, 4)),
    case("x-noncontig", ValueError, "x", x=lambda: torch.randn(C, S).to(BF16).t()),
    case("x-noncontig-3d", ValueError, "x",
         x=lambda: torch.randn(1, C, S).to(BF16).transpose(1, 2)),
    case("x-neg-view", ValueError, "x", x=lambda: torch._neg_view(torch.randn(S, C).to(BF16))),
    case("x-C-2^28", ValueError, "x", x=lambda: torch.empty(1, 2**28, dtype=BF16, device="meta"),
         weight=lambda: torch.empty(2**28, 4, device="meta")),
    case("x-list", TypeError, "x", x=lambda: torch.randn(S, C).tolist()),
    case("x-none", TypeError, "x", x=lambda: None),
    *bad_rows("x", lambda: torch.empty(2, 2**34, dtype=BF16, device="meta")[:, :8]),
    # weight
    case("weight-width3", ValueError, "weight", weight=lambda: torch.randn(C, 3)),
    case("weight-width5", ValueError, "weight", weight=lambda: torch.randn(C, 5)),
    case("weight-wrong-C", ValueError, "weight", weight=lambda: torch.randn(C + 8, 4)),
    case("weight-fp16", ValueError, "weight", weight=lambda: torch.randn(C, 4).half()),
    case("weight-fp64", ValueError, "weight", weight=lambda: torch.randn(C, 4).double()),
    case("weight-transposed", ValueError, "weight", weight=lambda: torch.randn(4, C).t()),
    case("weight-1d", ValueError, "weight", weight=lambda: torch.randn(4 * C)),
    case("weight-3d", ValueError, "weight", weight=lambda: torch.randn(C, 4, 1)),
    case("weight-neg-view", ValueError, "weight", weight=lambda: torch._neg_view(torch.randn(C, 4))),
    case("weight-list", TypeError, "weight", weight=lambda: torch.randn(C, 4).tolist()),
    # bias
    case("bias-wrong-len", ValueError, "bias", bias=lambda: torch.randn(C + 8)),
    case("bias-fp16", ValueError, "bias", bias=lambda: torch.randn(C).half()),
    case("bias-fp64", ValueError, "bias", bias=lambda: torch.randn(C).double()),
    case("bias-2d", ValueError, "bias", bias=lambda: torch.randn(1, C)),
    case("bias-noncontig", ValueError, "bias", bias=lambda: torch.randn(2 * C)[::2]),
    case("bias-float", TypeError, "bias", bias=lambda: 0.5),
    # cu_seqlens
    case("cu-int64", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.tensor([0, 5, S], dtype=torch.int64)),
    case("cu-fp32", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.tensor([0.0, 5.0, S])),
    case("cu-2d", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.tensor([[0, 5, S]], dtype=I32)),
    case("cu-empty", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.empty(0, dtype=I32)),
    case("cu-noncontig", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.tensor([0, 9, 5, 9, S, 9], dtype=I32)[::2]),
    case("cu-2^31-entries", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.empty(2**31, dtype=I32, device="meta")),
    case("cu-list", TypeError, "cu_seqlens", cu_seqlens=lambda: [0, 5, S]),
    case("cu-neg-view", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch._neg_view(torch.tensor([0, -5, -S], dtype=I32))),
    # out
    case("out-fp32", ValueError, "out", out=lambda: torch.empty(S, C)),
    case("out-fp16", ValueError, "out", out=lambda: torch.empty(S, C, dtype=torch.half)),
    case("out-more-rows", ValueError, "out", out=lambda: torch.empty(S + 1, C, dtype=BF16)),
    case("out-more-cols", ValueError, "out", out=lambda: torch.empty(S, C + 8, dtype=BF16)),
    case("out-3d-for-2d-x", ValueError, "out", out=lambda: torch.empty(1, S, C, dtype=BF16)),
    case("out-noncontig", ValueError, "out", out=lambda: torch.empty(C, S, dtype=BF16).t()),
    case("out-neg-view", ValueError, "out", out=lambda: torch._neg_view(torch.empty(S, C, dtype=BF16))),
    case("out-list", TypeError, "out", out=lambda: [[0.0] * C] * S),
    *bad_rows("out", lambda: torch.empty(S, 2**31, dtype=BF16, device="meta")[:, :C]),
    # initial_states / final_states_out
    *bad_states("initial_states"),
    *bad_states("final_states_out"),
    # workspace
    case("ws-int64", ValueError, "workspace",
         workspace=lambda: torch.zeros(1 << 16, dtype=torch.int64)),
    case("ws-fp32", ValueError, "workspace", workspace=lambda: torch.zeros(1 << 16)),
    case("ws-too-small", ValueError, "workspace", workspace=lambda: torch.zeros(0, dtype=I32)),
    case("ws-2d", ValueError, "workspace",
         workspace=lambda: torch.zeros(256, 256, dtype=I32)),
    case("ws-noncontig", ValueError, "workspace",
         workspace=lambda: torch.zeros(1 << 17, dtype=I32)[::2]),
    case("ws-list", TypeError, "workspace", workspace=lambda: [0] * 1024),
    case("ws-neg-view", ValueError, "workspace", workspace=lambda: torch._neg_view(torch.zeros(1 << 16, dtype=I32))),
    # a view whose storage was resized since (untyped_storage().resize_): the kernels would address past it
    case("x-storage-resized", ValueError, "x", x=lambda: resized(torch.randn(S, C).to(BF16), 16)),
    case("x-strided-storage-resized", ValueError, "x",
         x=lambda: resized(torch.randn(S, C + 64).to(BF16)[:, :C], 2 * ((S - 1) * (C + 64) + C) - 2)),
    case("weight-storage-freed", ValueError, "weight", weight=lambda: resized(torch.randn(C, 4), 0)),
    case("out-storage-resized", ValueError, "out", out=lambda: resized(torch.empty(S, C, dtype=BF16), 2 * S * C - 2)),
    case("initial_states-storage-resized", ValueError, "initial_states",
         initial_states=lambda: resized(states(), 64)),
    # grad mode on: no autograd graph is recorded, outputs are written in place (check_no_grad)
    case("x-requires-grad", RuntimeError, "x", x=lambda: torch.randn(S, C).to(BF16).requires_grad_()),
    case("weight-requires-grad", RuntimeError, "weight", weight=lambda: torch.randn(C, 4).requires_grad_()),
    case("bias-requires-grad", RuntimeError, "bias", bias=lambda: torch.randn(C).requires_grad_()),
    case("initial_states-requires-grad", RuntimeError, "initial_states",
         initial_states=lambda: states().requires_grad_()),
    case("final_states_out-requires-grad", RuntimeError, "final_states_out",
         final_states_out=lambda: states().requires_grad_()),
    case("out-requires-grad", RuntimeError, "out", out=lambda: torch.empty(S, C, dtype=BF16).requires_grad_()),
    # device: every argument is well-formed, but x is not on a CUDA device
    case("x-on-cpu", ValueError, "x"),
]

# Rules checked after the devices' (alignment, devices, overlap: byte spans from first to last
# element), so only on the GPU: on the CPU these raise about x's device.
GPU_ONLY_BAD_INPUTS = [
    case("x-strided-misaligned", ValueError, "x", x=lambda: torch.randn(S, C + 8).to(BF16)[:, 4 : 4 + C]),
    case("out-strided-misaligned", ValueError, "out", out=lambda: torch.empty(S, C + 8, dtype=BF16)[:, 4 : 4 + C]),
    case("initial_states-misaligned", ValueError, "initial_states",
         **one_buffer(D * 3 * C + 8, initial_states=lambda b: state_view(b, 1))),
    case("final_states_out-misaligned", ValueError, "final_states_out",
         **one_buffer(D * 3 * C + 8, final_states_out=lambda b: state_view(b, 1))),
    case("initial_states-on-cpu", ValueError, "initial_states",
         initial_states=lambda: torch.randn(D, 3, C, device="cpu").to(BF16)),
    case("final_states_out-on-cpu", ValueError, "final_states_out",
         final_states_out=lambda: torch.empty(D, 3, C, dtype=BF16, device="cpu")),
    case("final_states_out-overlaps-x", ValueError, "final_states_out",
         **one_buffer(2 * S * C, x=rows, final_states_out=lambda b: state_view(b, S * C // 2))),
    case("final_states_out-in-x-row-gap", ValueError, "final_states_out",  # disjoint elements, inside x's span
         **one_buffer(S * (C + 320), x=lambda b: rows(b, stride=C + 320), final_states_out=lambda b: state_view(b, C))),
    case("final_states_out-is-initial_states", ValueError, "final_states_out",
         **one_buffer(D * 3 * C, initial_states=state_view, final_states_out=state_view)),
    case("final_states_out-overlaps-initial_states", ValueError, "final_states_out",
         **one_buffer(D * 3 * C + 8, initial_states=state_view, final_states_out=lambda b: state_view(b, 8))),
    # of two outputs sharing bytes, the later in the order (out) is named, with the other
    case("out-overlaps-final_states_out", ValueError, "out",
         **one_buffer(2 * S * C, final_states_out=state_view, out=lambda b: rows(b, D * 3 * C // 2))),
    case("out-interleaved-with-x", ValueError, "out",  # disjoint elements, overlapping spans
         **one_buffer(2 * S * C, x=lambda b: rows(b, 0, 2 * C), out=lambda b: rows(b, C, 2 * C))),
    # a subclass that dispatches in Python (DTensor-like): no memory of its values of its own
    case("x-python-subclass", ValueError, "x", x=lambda: two_tensor(torch.randn(S, C).to(BF16))),
    case("weight-python-subclass", ValueError, "weight", weight=lambda: two_tensor(torch.randn(C, 4))),
]

# Well-formed arguments with row-strided views (and states): the Python rules accept them, so on
# the CPU the call fails on x's device, not on a layout rule.
VALID_ON_CPU = [
    pytest.param({"x": lambda: torch.randn(S, C + 64).to(BF16)[:, 32 : 32 + C]}, id="x-row-strided"),
    pytest.param({"x": lambda: torch.randn(1, S, C + 64).to(BF16)[:, :, 32 : 32 + C]}, id="x-3d-row-strided"),
    pytest.param({"out": lambda: torch.empty(S, C + 64, dtype=BF16)[:, 32 : 32 + C]}, id="out-row-strided"),
    pytest.param({"x": lambda: torch.randn(S, 2 * C).to(BF16)[:, C:],
                  "out": lambda: torch.empty(S, 3 * C, dtype=BF16)[:, C : 2 * C]}, id="x-and-out-row-strided"),
    pytest.param({"x": lambda: torch.randn(1, C + 4).to(BF16)[:, :C],
                  "out": lambda: torch.randn(3 * C).to(BF16).as_strided((1, C), (3, 1))}, id="S=1-any-row-stride"),
    pytest.param({"x": lambda: torch.empty(2, 2**34 - 8, dtype=BF16, device="meta")[:, :8],
                  "weight": lambda: torch.randn(8, 4)}, id="x-S-times-stride-just-in-range"),
    pytest.param({"initial_states": states, "final_states_out": states}, id="states"),
]


@pytest.mark.parametrize("override, exc, argname", BAD_INPUTS)
def test_bad_input_is_rejected_naming_the_argument(override, exc, argname):
    args = valid_args(**{name: make() for name, make in override.items()})
    with pytest.raises(exc, match=rf"^{FN}: {argname}\b"):
        call(args)


@pytest.mark.parametrize("override", VALID_ON_CPU)
def test_valid_views_pass_the_python_rules(override):
    args = valid_args(**{name: make() for name, make in override.items()})
    with pytest.raises(ValueError, match=rf"^{FN}: x must be a CUDA tensor"):
        call(args)


@pytest.mark.gpu
@pytest.mark.parametrize("override, exc, argname",
                         [c for c in BAD_INPUTS if not c.id.startswith("x-on-cpu")] + GPU_ONLY_BAD_INPUTS)
def test_bad_cuda_input_is_rejected_naming_the_argument(override, exc, argname, bad_cuda_args):
    """The same cases on the GPU: the torch binding applies these rules itself and declines, so
    the checks raise; a rule it missed would launch instead of raising."""
    args = bad_cuda_args(call, valid_args, override)
    with pytest.raises(exc, match=rf"^{FN}: {argname}\b"):
        call(args)


def test_not_supported_on_cpu():
    assert is_cake_causal_conv1d_train_supported(torch.device("cpu")) is False
    assert is_cake_causal_conv1d_train_supported("cpu") is False
    if not torch.cuda.is_available():
        # No CUDA device: the default (current CUDA device), an index or a CUDA device name are
        # unsupported, and it never raises (torch.device(0) alone raises on a CPU-only torch).
        for device in (None, 0, 1, "cuda", "cuda:0", torch.device("cuda", 0)):
            assert is_cake_causal_conv1d_train_supported(device) is False, device
        assert is_cake_causal_conv1d_train_supported() is False


class _Index:
    """An integer type of another library (numpy's int64 is one): a numbers.Integral, not an int."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value

    __index__ = __int__


numbers.Integral.register(_Index)


def test_supported_takes_any_integer_index():
    """An integral index of any type is an index, as an int is (torch.device of one raises on a
    CPU-only torch)."""
    for index in (0, 1, 7):
        assert is_cake_causal_conv1d_train_supported(_Index(index)) is is_cake_causal_conv1d_train_supported(index)


@pytest.mark.parametrize("device", ["cuda:x", "cuda0", "cuda:0:1"])
def test_supported_raises_for_a_device_torch_cannot_parse(device):
    """The same error on any machine (before, a CPU-only one returned False and a GPU one raised)."""
    with pytest.raises(RuntimeError):
        is_cake_causal_conv1d_train_supported(device)


@pytest.mark.parametrize("override, words", [
    pytest.param({"cu_seqlens": lambda: torch.tensor([0, 5, 5, S])}, r"cu_seqlens\.to\(torch\.int32\)", id="int64-cu"),
    pytest.param({"cu_seqlens": lambda: torch.randn(C)}, r"\(x, weight, cu_seqlens, bias\)", id="dao-order"),
    pytest.param({"weight": lambda: torch.randn(C, 1, 4)}, r"weight\.squeeze\(1\)", id="conv1d-weight"),
    pytest.param({"x": lambda: torch.randn(2, S, C).to(BF16)},
                 r"x\.reshape\(B \* T, C\) .*device=x\.device", id="batched-x"),
    # Dao's causal_conv1d_fn(x, weight, bias, ...): the order's hint although bias's dtype is wrong too
    pytest.param({"cu_seqlens": lambda: torch.randn(C), "bias": lambda: torch.tensor([0, 5, 5, S], dtype=I32)},
                 r"\(x, weight, cu_seqlens, bias\)", id="dao-order-with-bias"),
    # Dao's channel-last [1, C, S] view as x (its rows taken as channels: 32 tokens of 16 / of 12 channels);
    # the strides are also those of a column-major [S, C]: both fixes
    pytest.param({"x": lambda: torch.randn(1, S, C).to(BF16).transpose(1, 2)},
                 r"contiguous channels .*x_dao\.transpose\(1, 2\) .*column-major\), pass x\.contiguous\(\); if it is "
                 r"Dao's channel-last \[1, C, S\] view itself, pass x\.transpose\(-1, -2\)",
                 id="dao-channel-last-x"),
    pytest.param({"x": lambda: torch.randn(1, 12, C).to(BF16).transpose(1, 2)},
                 r"multiple of 8 .*x\.transpose\(-1, -2\)", id="dao-channel-last-x-C12"),
    pytest.param({"x": lambda: torch.randn(2, S, C).to(BF16).transpose(1, 2)},
                 r"x\.transpose\(1, 2\)\.reshape\(B \* T, C\)", id="dao-channel-last-batch"),
    pytest.param({"out": lambda: torch.empty(C, S, dtype=BF16).t()}, r"pass out\.contiguous\(\)$",
                 id="column-major-out"),
    pytest.param({"initial_states": lambda: torch.randn(D, C, 4).to(BF16)},
                 r"fla's .*s\[:, :, 1:\]\.transpose\(1, 2\)\.contiguous\(\)", id="fla-state"),
    pytest.param({"initial_states": lambda: torch.randn(D, C, 3).to(BF16)},
                 r"Dao's .*s\.transpose\(1, 2\)\.contiguous\(\)", id="dao-state"),
    # an output is written in place: no converted copy
    pytest.param({"final_states_out": lambda: torch.empty(D, C, 3, dtype=BF16)},
                 r"Dao's \[N, C, 3\] states pass a new \[num_docs, 3, C\] tensor and convert it after",
                 id="dao-state-out"),
])
def test_messages_show_the_fix_for_a_peers_layout(override, words):
    """Arguments in fla's / Dao's / nn.Conv1d's layouts: the ValueError names the argument and the fix."""
    args = valid_args(**{name: make() for name, make in override.items()})
    with pytest.raises(ValueError, match=rf"^{FN}: {next(iter(override))}\b.*{words}"):
        call(args)


@pytest.mark.parametrize("shape,layout", [((1, C, S), r"\[1, C, S\]"), ((C, S), r"\[C, S\]")], ids=["3d", "2d"])
def test_a_channels_first_x_gets_the_fix_in_the_weights_message(shape, layout):
    """A contiguous [1, C, S] or [C, S] x (Dao's layout made contiguous): its S is read as C, so the
    weight's shape is the first rule it breaks, and that message names x's layout and how to pass x."""
    args = valid_args(x=torch.randn(*shape).to(BF16))
    with pytest.raises(ValueError, match=rf"^{FN}: weight must have shape \[C, 4\] = \[{S}, 4\] .*x looks "
                                         rf"channels-first {layout} .*x\.transpose\(-1, -2\)\.contiguous\(\)"):
        call(args)


def test_a_misaligned_start_names_its_offset_and_for_rows_the_column_rule():
    """The alignment rule (checked after the device's, so called directly here): the address, the storage
    offset, and for the tensors that may be row-strided views that a column slice starts at a multiple of 8
    columns; for the others (contiguous by rule), a tensor of their own: a copy of a state the kernels read, a new
    allocation of what they write (a copy of it would take the results, not the caller's tensor)."""
    from flashinfer_cake import _checks
    with pytest.raises(ValueError, match=r"^f: x must start at a 16-byte aligned address, got 0x[0-9a-f]+ \(storage "
                                         r"offset 4 elements of 2 bytes: a column slice of rows must start at a "
                                         r"multiple of 8 columns\)$"):
        _checks._check_aligned("f", (("x", torch.randn(16, 72).to(BF16)[:, 4:68]),))
    with pytest.raises(ValueError, match=r"^f: workspace must start .*\(storage offset 1 elements of 4 bytes: pass one "
                                         r"allocated on its own \(torch\.empty's storage starts aligned\), which is "
                                         r"written\)$"):
        _checks._check_aligned("f", (("workspace", torch.zeros(9)[1:]),))
    with pytest.raises(ValueError, match=r"^f: initial_states must start .*\(storage offset 1 elements of 2 bytes: pass "
                                         r"a tensor of its own, e\.g\. initial_states\.clone\(\)\)$"):
        _checks._check_aligned("f", (("initial_states", torch.zeros(2 * 3 * 8 + 1).to(BF16)[1:].view(2, 3, 8)),))


def test_a_lazily_negated_view_is_named_with_its_fix():
    from flashinfer_cake import _checks
    with pytest.raises(ValueError, match=re.escape("f: bias must not be a lazily negated or conjugated view, got one "
                                                   "(is_neg True, is_conj False): pass bias.resolve_neg() / "
                                                   "bias.resolve_conj()")):
        _checks.check_memory("f", "bias", torch._neg_view(torch.randn(4)))


def test_an_overlap_names_both_spans_and_the_fix():
    """Two column slices of one buffer share no element but their spans (first to last element) interleave: the
    overlap rule (checked after the device's, so called directly here) names both spans and says what to pass."""
    from flashinfer_cake import _checks
    buffer = torch.zeros(16, 32).to(BF16)
    x, out = buffer[:, :8], buffer[:, 8:16]
    x0, o0 = x.data_ptr(), out.data_ptr()
    span = (15 * 32 + 8) * 2
    with pytest.raises(ValueError, match=re.escape(
            f"f: out must not overlap x, got spans (first to last element, row gaps included) sharing bytes: out "
            f"[{o0:#x}, {o0 + span:#x}), x [{x0:#x}, {x0 + span:#x}) (column slices of one buffer overlap so): pass "
            f"out as a tensor of its own")):
        _checks.check_no_overlap("f", (("x", x), ("out", out)), ("out",))
    _checks.check_no_overlap("f", (("x", x), ("out", torch.empty_like(x))), ("out",))


def test_a_channels_first_x_of_a_length_not_a_multiple_of_8_gets_the_fix_in_the_channel_rule():
    """The same x with T % 8 != 0: x's channel rule (checked before the weight's) breaks first, and its
    message names the channels-first reading (C from x.shape[-2], where the weight's C agrees) and the fix."""
    for x in (torch.randn(1, C, S + 1).to(BF16), torch.randn(C, S + 1).to(BF16)):
        with pytest.raises(ValueError, match=rf"^{FN}: x's channel count C must be .*got C={S + 1}; if x is "
                                             rf"channels-first \[C, T\] or \[1, C, T\] with C={C}, pass "
                                             rf"x\.transpose\(-1, -2\)\.contiguous\(\)"):
            call(valid_args(x=x))
    # no such reading when dimension -2 cannot be a channel count
    with pytest.raises(ValueError, match=rf"^{FN}: x's channel count C must be .*got C=12$"):
        call(valid_args(x=torch.randn(S + 1, 12).to(BF16)))
    # nor when the weight's C is another (x [C_w * 2, 12] with a [C_w, 4] weight: a bad x, not a transposed one)
    with pytest.raises(ValueError, match=rf"^{FN}: x's channel count C must be .*got C=12$"):
        call(valid_args(x=torch.randn(2 * C, 12).to(BF16)))


_BAD_CALLS = """
import torch, flashinfer_cake as f
x = torch.randn(16, 32).to(torch.bfloat16)
w = torch.randn(32, 4)
cu = torch.tensor([0, 16], dtype=torch.int32)
cases = [
    (TypeError, "x", lambda: f.cake_causal_conv1d_train_forward(1, 2, 3)),
    (ValueError, "x", lambda: f.cake_causal_conv1d_train_forward(x.float(), w, cu)),
    (ValueError, "x", lambda: f.cake_causal_conv1d_train_forward(x, w, cu)),  # valid, but on the CPU
    (TypeError, "dy", lambda: f.cake_causal_conv1d_train_backward(x, w, cu, None)),
    (ValueError, "silu_grad_preactivation",
     lambda: f.cake_causal_conv1d_train_backward(x, w, cu, x, silu_grad_preactivation="fp16")),
    (ValueError, "workspace", lambda: f.cake_causal_conv1d_train_backward(x, w, cu, x, workspace=torch.zeros(1))),
    (TypeError, "weight", lambda: f.cake_causal_conv1d(x, None, cu)),
    (ValueError, "silu_grad_preactivation", lambda: f.cake_causal_conv1d(x, w, cu, silu_grad_preactivation="no")),
]
for exc, name, call in cases:
    try:
        call()
    except exc as e:
        assert name in str(e), (name, e)
    else:
        raise SystemExit(f"no {exc.__name__} for {name}")
print(f.cake_causal_conv1d_train_backward_workspace_bytes(4096, 4096, "cpu"))
"""


@pytest.mark.parametrize("nothing_may_build", [{"FLASHINFER_CAKE_DISABLE_JIT": "1"},
                                               {"CXX": "/nonexistent/c++", "FLASHINFER_CAKE_NVCC": "/nonexistent/nvcc"}],
                         ids=["disable-jit", "no-compilers"])
def test_bad_arguments_raise_before_anything_is_built(nothing_may_build, tmp_path):
    """A bad call raises its documented TypeError / ValueError on a fresh machine without
    loading or building anything (before, the binding was built first: ~15 s, or a RuntimeError
    about it); the cache directory is not even looked up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_CAKE_")}
    env.update(FLASHINFER_CAKE_CACHE_DIR=str(tmp_path / "cache"), **nothing_may_build)
    r = subprocess.run([sys.executable, "-c", _BAD_CALLS], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(20 * 4096 * 32)]  # 32 groups of 128 tokens, no build needed
    assert not (tmp_path / "cache").exists()


def test_workspace_bytes_is_positive_and_monotone_in_S():
    device = torch.device("cpu")
    for c in (8, 32, 1000, 4096, 16384):
        previous = 0
        for s in (0, 1, 2, 7, 64, 1000, 4097, 65536, 1 << 20, 1 << 24):
            if s * c >= 2**35:  # past the forward's range (test_workspace_bytes_rejects_bad_sizes)
                continue
            n = cake_causal_conv1d_train_forward_workspace_bytes(s, c, device)
            assert isinstance(n, int) and not isinstance(n, bool), (s, c, n)
            assert n >= previous, f"workspace bytes shrank from {previous} to {n} at S={s}, C={c}"
            if s > 0:
                assert n > 0, (s, c, n)
            previous = n


@pytest.mark.parametrize(
    "s, c, argname",
    [
        pytest.param(-1, 32, "S", id="S-negative"),
        pytest.param(16, 12, "C", id="C-not-mult-8"),
        pytest.param(16, 4, "C", id="C-4"),
        pytest.param(16, -8, "C", id="C-negative"),
        pytest.param(16, 2**28, "C", id="C-2^28"),
        pytest.param(2**31, 8, "S", id="S-2^31"),
        pytest.param(2**27, 256, "S", id="SC-2^35"),
    ],
)
def test_workspace_bytes_rejects_bad_sizes(s, c, argname):
    with pytest.raises(ValueError, match=rf"^cake_causal_conv1d_train_forward_workspace_bytes: {argname}\b"):
        cake_causal_conv1d_train_forward_workspace_bytes(s, c, torch.device("cpu"))


def test_workspace_functions_take_integers_and_name_a_bad_argument():
    """S and C: any integer (operator.index), named when not one; the *_bytes functions need no device
    (the size does not depend on it); the allocating ones name a missing device."""
    from flashinfer_cake import (cake_causal_conv1d_train_backward_workspace,
                                 cake_causal_conv1d_train_backward_workspace_bytes)
    want = cake_causal_conv1d_train_backward_workspace_bytes(4096, 4096, "cpu")
    assert cake_causal_conv1d_train_backward_workspace_bytes(_Index(4096), _Index(4096)) == want
    assert cake_causal_conv1d_train_forward_workspace_bytes(_Index(16), 32) == 8
    ws = cake_causal_conv1d_train_backward_workspace(_Index(4096), 4096, "cpu")
    assert ws.dtype == torch.float32 and ws.numel() * 4 >= want and ws.numel() * 4 < want + 4
    for fn, args, exc, words in [
        (cake_causal_conv1d_train_forward_workspace_bytes, (16.0, 32), TypeError, "S must be an int, got float"),
        (cake_causal_conv1d_train_backward_workspace_bytes, (16, True), TypeError, "C must be an int, got bool"),
        (cake_causal_conv1d_train_backward_workspace, (16, 32, None), TypeError, "device must be a torch.device"),
        (cake_causal_conv1d_train_backward_workspace_bytes, (torch.tensor(16), 32), TypeError,
         "S must be an int, got Tensor"),
    ]:
        with pytest.raises(exc, match=rf"^{fn.__name__}: {words}"):
            fn(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_workspace_on_a_missing_cuda_device_is_named():
    """Without a CUDA device, the allocating workspace functions name the device argument and why
    (torch's own error on a CPU-only build is an AssertionError naming neither)."""
    from flashinfer_cake import (cake_causal_conv1d_train_backward_workspace,
                                 cake_causal_conv1d_train_forward_workspace)
    for fn in (cake_causal_conv1d_train_forward_workspace, cake_causal_conv1d_train_backward_workspace):
        for device in ("cuda", torch.device("cuda", 0)):
            with pytest.raises(RuntimeError, match=rf"^{fn.__name__}: device must be an available CUDA device, "
                                                   rf"got cuda(:0)? \(torch .* (built without CUDA|sees no CUDA GPU)\)"):
                fn(16, 32, device)


def test_a_cuda_index_that_torch_wrapped_negative_is_named(monkeypatch):
    """torch keeps a device index in 8 bits: "cuda:128" is cuda:-128, which no index test of `>= device_count`
    catches (the allocation would then fail in torch, naming no argument). A GPU machine is stood in for."""
    from flashinfer_cake import _checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _checks.check_allocation_device("f", "cuda:0") == torch.device("cuda", 0)
    for device in ("cuda:128", "cuda:1"):
        with pytest.raises(RuntimeError, match=r"^f: device must be an available CUDA device, got cuda:-?1(28)? "
                                               r"\(torch sees 1 CUDA device\(s\): cuda:0 .. cuda:0\)$"):
            _checks.check_allocation_device("f", device)


@pytest.mark.gpu
def test_workspace_on_a_cuda_index_past_the_device_count_is_named():
    """cuda:N with N past torch's device count: the allocating functions name the device and the count (torch's
    own error names no argument)."""
    from flashinfer_cake import cake_causal_conv1d_train_backward_workspace
    from flashinfer_cake.cp import build_cp_context, cp_partition
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=rf"^cake_causal_conv1d_train_backward_workspace: device must be an available "
                                           rf"CUDA device, got cuda:{n} \(torch sees {n} CUDA device"):
        cake_causal_conv1d_train_backward_workspace(16, 32, f"cuda:{n}")
    with pytest.raises(RuntimeError, match=rf"^build_cp_context: device must be an available CUDA device, got cuda:{n}"):
        build_cp_context(cp_partition([0, 10, 20], 1), None, 0, torch.device("cuda", n))


@pytest.mark.parametrize("shape", [(2**31, 8), (2**28, 128), (1, 2**30, 32)], ids=["S=2^31", "SC=2^35", "3d"])
def test_too_large_is_rejected_before_anything(shape):
    """Sizes past the kernel's index range are a ValueError naming x (meta tensors: no memory)."""
    x = torch.empty(shape, dtype=BF16, device="meta")
    C = shape[-1]
    with pytest.raises(ValueError, match=r"\bx\b.*2\^3"):
        cake_causal_conv1d_train_forward(x, torch.randn(C, 4), torch.tensor([0], dtype=I32))


def test_tensors_that_require_grad_pass_under_no_grad():
    """check_no_grad's rule holds only with grad mode on: under torch.no_grad the same arguments
    pass the Python rules (on the CPU the call then fails on x's device)."""
    args = valid_args(x=torch.randn(S, C).to(BF16).requires_grad_(), weight=torch.randn(C, 4).requires_grad_(),
                      out=torch.empty(S, C, dtype=BF16).requires_grad_())
    with torch.no_grad(), pytest.raises(ValueError, match=rf"^{FN}: x must be a CUDA tensor"):
        call(args)


def dual(t):
    """t as a dual tensor of forward-mode AD (inside forward_ad.dual_level())."""
    return torch.autograd.forward_ad.make_dual(t, torch.randn_like(t))


DUAL_CASES = {  # an argument made a dual tensor: the inputs and the outputs the raw forward writes
    "x": lambda: torch.randn(S, C).to(BF16), "weight": lambda: torch.randn(C, 4), "bias": lambda: torch.randn(C),
    "initial_states": states, "final_states_out": states, "out": lambda: torch.empty(S, C, dtype=BF16),
}
DUAL_OUTPUTS = ("final_states_out", "out", "dx", "dweight", "dbias", "dinitial_states", "workspace")


def dual_message(fn, argname):
    """check_no_grad's message for a dual tensor ``argname``: an input's, or an output's."""
    fix = "writes it in place without a tangent" if argname in DUAL_OUTPUTS else rf"unpack_dual\({argname}\)\.primal"
    return rf"^{fn}: {argname} is a dual tensor of forward-mode AD .*{fix}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("argname", list(DUAL_CASES))
def test_dual_tensors_are_refused_naming_the_argument(argname, grad_mode, device, request):
    """Forward-mode AD: the raw forward propagates no tangent, so a dual tensor among its inputs
    (its results would have none, silently) or outputs is a RuntimeError naming it, in either grad
    mode. On the GPU after a valid call: the torch binding declines such a call itself."""
    with torch.autograd.forward_ad.dual_level(), torch.set_grad_enabled(grad_mode):
        if device == "cuda":
            make = request.getfixturevalue("bad_cuda_args")
            args = make(call, valid_args, {argname: lambda: dual(DUAL_CASES[argname]())})
        else:
            args = valid_args(**{argname: dual(DUAL_CASES[argname]())})
        with pytest.raises(RuntimeError, match=dual_message(FN, argname)):
            call(args)


@pytest.mark.parametrize("argname", ["x", "weight", "bias", "initial_states"])
def test_autograd_names_a_dual_tensor_without_memory(argname):
    """cake_causal_conv1d on meta tensors (its Function's path): a dual input is the library's
    NotImplementedError naming it, as the binding's node says on the GPU (test_backward_gpu), not
    torch's about a missing jvp."""
    from flashinfer_cake import cake_causal_conv1d
    args = {"x": torch.empty(S, C, dtype=BF16, device="meta"), "weight": torch.empty(C, 4, device="meta"),
            "bias": torch.empty(C, device="meta"), "initial_states": torch.empty(2, 3, C, dtype=BF16, device="meta")}
    cu = torch.tensor([0, 5, S], dtype=torch.int32, device="meta")
    with torch.autograd.forward_ad.dual_level():
        args[argname] = dual(args[argname])
        with pytest.raises(NotImplementedError, match=rf"^cake_causal_conv1d: forward-mode AD .* not supported: "
                                                      rf"{argname} is a dual tensor"):
            cake_causal_conv1d(args["x"], args["weight"], cu, args["bias"], initial_states=args["initial_states"])


def raw_backward(x, w, cu):
    from flashinfer_cake import cake_causal_conv1d_train_backward
    return cake_causal_conv1d_train_backward(x, w, cu, torch.ones_like(x))[0]


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("transform, argname", [("grad", "x"), ("vmap", "x"), ("jvp", "x"), ("vmap", "weight"),
                                                ("vmap-empty", "x")])
@pytest.mark.parametrize("fn", [cake_causal_conv1d_train_forward, raw_backward, cake_causal_conv1d],
                         ids=["forward", "backward", "autograd"])
def test_torch_func_transforms_are_refused_naming_the_argument(transform, argname, fn, device, request):
    """torch.func's transforms wrap their tensors (no storage of their own): refused by name as not
    supported, not torch's "Cannot access storage" from a later rule; on the GPU after a valid call
    (the binding declines the wrappers itself, empty ones too); of meta tensors too (cake_causal_conv1d
    takes those through its Function: torch's error about setup_context, before)."""
    n = 0 if transform == "vmap-empty" else S
    x, w = torch.randn(n, C, device=device).to(BF16), torch.randn(C, 4, device=device)
    cu = torch.tensor([0, 5, 5, S] if n else [0, 0], dtype=I32, device=device)
    if device == "cuda":
        fn(x, w, cu)  # registers the variant with the binding (the raw backward of this shape too)
    name = {raw_backward: "cake_causal_conv1d_train_backward"}.get(fn, getattr(fn, "__name__", ""))
    f = (lambda x: fn(x, w, cu).float().sum()) if argname == "x" else (lambda w: fn(x, w, cu).float().sum())
    arg = x if argname == "x" else w
    run = {"grad": lambda: torch.func.grad(f)(arg), "vmap": lambda: torch.func.vmap(f)(arg.unsqueeze(0)),
           "vmap-empty": lambda: torch.func.vmap(f)(arg.unsqueeze(0)),
           "jvp": lambda: torch.func.jvp(f, (arg,), (torch.randn_like(arg),))}[transform]
    with pytest.raises(NotImplementedError, match=rf"^{name}: {argname} is a tensor of a torch.func transform"):
        run()


def test_tensors_without_memory_are_named():
    """The raw functions and the CP calls run kernels on memory: a tensor without memory of its own
    (meta, fake, a subclass that dispatches in Python) is a ValueError saying what to pass
    instead (cake_causal_conv1d takes such tensors through its custom ops)."""
    from flashinfer_cake import _checks
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(S, C, dtype=BF16)
    for t in (two_tensor(torch.randn(S, C).to(BF16)), fake, torch.empty(S, C, device="meta")):
        assert _checks.without_memory(t)
        with pytest.raises(ValueError, match=rf"^f: dy must be a CUDA tensor with memory of its own, got a tensor of "
                                             rf"type {type(t).__name__} .*cake_causal_conv1d takes such tensors"):
            _checks.check_has_memory("f", (("x", torch.zeros(1)), ("dy", t)))
    for t in (torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), torch.zeros(2).as_subclass(torch.nn.Parameter)):
        assert not _checks.without_memory(t)
    # The raw forward on meta tensors: this error, not "x must be a CUDA tensor" (which would hide where they go)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in valid_args().items()}
    with pytest.raises(ValueError, match=rf"^{FN}: x must be a CUDA tensor with memory of its own"):
        call(meta)


@pytest.mark.parametrize("cu, num_tokens", [
    ([0], None), ([0], 0), ([0, 3, 3, 10], 10), ((0, 0, 0), 0), (torch.tensor([0, 4, 9], dtype=I32), 9),
    (torch.tensor([0, 2**31 - 1], dtype=torch.int64), None), ([0, torch.tensor(5)], torch.tensor(5)), ("numpy", 12),
])
def test_check_cu_seqlens_takes_prefix_sums(cu, num_tokens):
    if isinstance(cu, str):
        np = pytest.importorskip("numpy")
        cu, num_tokens = np.array([0, 5, 12], dtype=np.int64), np.int64(num_tokens)
    assert check_cu_seqlens(cu, num_tokens) is None


def _numpy_array(values, dtype):
    np = pytest.importorskip("numpy")
    return np.array(values, dtype=dtype)


@pytest.mark.parametrize("cu, num_tokens, message", [
    ([], None, r"cu_seqlens must have at least one entry \(0\), got none$"),
    ([1, 4], None, r"cu_seqlens\[0\] must be 0, got 1$"),
    ([0, 5, 9, 7, 12], 12, r"cu_seqlens must never decrease .*, got cu_seqlens\[2\] = 9 > cu_seqlens\[3\] = 7$"),
    (torch.tensor([0, 6, -1], dtype=I32), None, r"cu_seqlens must never decrease .*, got cu_seqlens\[1\] = 6 > "
                                                r"cu_seqlens\[2\] = -1$"),
    ([0, 4, 8], 10, r"cu_seqlens\[-1\] \(index 2\) must be the token count S = 10, got 8 \(for a padded batch, "
                    r"end it with S"),
    ([0, 4, 12], 10, r"cu_seqlens\[-1\] \(index 2\) must be the token count S = 10, got 12$"),
    (torch.tensor([0, 2**40], dtype=torch.int64), None, r"cu_seqlens\[-1\] \(index 1\) must be below 2\^31 "
                                                        r"\(the kernels' int32 cu_seqlens and S\), got 1099511627776$"),
    ([0, 2**31], 2**31, r"cu_seqlens\[-1\] \(index 1\) must be below 2\^31"),
    ([0, 2.0], None, r"cu_seqlens must hold ints, got 2.0 \(float\) at index 1$"),
    ([0, True], None, r"cu_seqlens must hold ints, got True \(bool\) at index 1$"),
    ([0, torch.tensor(True)], None, r"cu_seqlens must hold ints, got tensor\(True\) \(Tensor\) at index 1$"),
    (torch.tensor([0.0, 2.0]), None, r"cu_seqlens must be a 1-D integer tensor, .*, got torch.float32 of shape \(2,\)"),
    (torch.zeros(2, 2, dtype=I32), None, r"cu_seqlens must be a 1-D integer tensor, .*, got torch.int32 of shape "
                                         r"\(2, 2\) on cpu$"),
    (torch.tensor(0, dtype=I32), None, r"cu_seqlens must be a 1-D integer tensor, .*, got torch.int32 of shape \(\)"),
    (torch.zeros(3, dtype=I32, device="meta"), None, r"cu_seqlens must be a tensor with values to read, got a Tensor "
                                                     r"on meta \(a meta, fake or traced tensor has none\)$"),
    ("0,4", None, r"cu_seqlens must be a 1-D integer tensor, a 1-D integer NumPy array, or a list / tuple of ints, "
                  r"got str$"),
    (("numpy", [[0, 4]], "int32"), None, r"cu_seqlens must be .*, got a NumPy array of dtype int32 and shape \(1, 2\)$"),
    (("numpy", [0.0, 4.0], "float64"), None, r"cu_seqlens must be .*, got a NumPy array of dtype float64 and shape "
                                             r"\(2,\)$"),
])
def test_check_cu_seqlens_names_the_first_bad_entry(cu, num_tokens, message):
    if isinstance(cu, tuple) and cu[0] == "numpy":
        cu = _numpy_array(cu[1], cu[2])
    with pytest.raises(ValueError, match=rf"^check_cu_seqlens: {message}"):
        check_cu_seqlens(cu, num_tokens)


@pytest.mark.parametrize("num_tokens, exc", [(-1, ValueError), (2.0, TypeError), ("8", TypeError), (True, TypeError)])
def test_check_cu_seqlens_names_a_bad_num_tokens(num_tokens, exc):
    with pytest.raises(exc, match=r"^check_cu_seqlens: num_tokens must be None or a non-negative int"):
        check_cu_seqlens([0, 8], num_tokens)


def test_check_cu_seqlens_runs_outside_a_compiled_graph():
    """torch.compile breaks the graph around it, so the values of every call are read (a fixed
    shape with new content included); fullgraph=True says it cannot be traced."""
    def f(cu, n):
        check_cu_seqlens(cu, n)
        return cu + 1

    compiled = torch.compile(f, backend="eager")
    compiled(torch.tensor([0, 4, 8], dtype=I32), 8)
    with pytest.raises(ValueError, match=r"got cu_seqlens\[1\] = 9 > cu_seqlens\[2\] = 8$"):
        compiled(torch.tensor([0, 9, 8], dtype=I32), 8)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"check_cu_seqlens reads cu_seqlens on the host"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.tensor([0, 4, 8], dtype=I32), 8)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_check_cu_seqlens_reads_a_cuda_tensor_but_not_while_capturing():
    cu = torch.tensor([0, 3, 2], dtype=I32, device="cuda")
    with pytest.raises(ValueError, match=r"^check_cu_seqlens: cu_seqlens must never decrease .*, got cu_seqlens\[1\] "
                                         r"= 3 > cu_seqlens\[2\] = 2$"):
        check_cu_seqlens(cu)
    good = torch.tensor([0, 3, 8], dtype=I32, device="cuda")
    check_cu_seqlens(good, 8)
    graph, stream, good_cpu = torch.cuda.CUDAGraph(), torch.cuda.Stream(), good.cpu()
    x = torch.zeros(8, device="cuda")
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            x.add_(1)
            check_cu_seqlens(good_cpu, 8)  # a CPU tensor: nothing of the capture's
            with pytest.raises(RuntimeError, match=r"^check_cu_seqlens: cu_seqlens is read on the host, which a CUDA "
                                                    r"graph capture cannot do"):
                check_cu_seqlens(good, 8)
    graph.replay()
    torch.cuda.synchronize()
    assert x.eq(1).all()
