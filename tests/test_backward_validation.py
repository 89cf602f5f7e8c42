"""CPU tests of the backward's argument validation and of the FP64 backward reference (no GPU
needed: they run in CI).

The backward validates argument types first, then the policy, then dtypes/shapes/contiguity of
every argument, then devices, so every dtype/shape/type/policy error below is raised for CPU
tensors. Each case checks the exact exception type and that the message is about the offending
argument (the argument is the subject of the message, right after the function's name).
"""

from __future__ import annotations

import contextlib
import random

import re

import pytest
import torch

from flashinfer_cake import (
    CakeCausalConv1dFunction,
    cake_causal_conv1d,
    cake_causal_conv1d_train_backward,
    cake_causal_conv1d_train_backward_workspace,
    cake_causal_conv1d_train_backward_workspace_bytes,
)
from flashinfer_cake.reference import (
    causal_conv1d_backward_reference,
    causal_conv1d_preactivation_reference,
    causal_conv1d_reference,
)
from test_forward_validation import (  # same S, C, cu
    D, bad_rows, bad_states, dual, dual_message, one_buffer, resized, rows, state_view, states)

FN = "cake_causal_conv1d_train_backward"
S, C = 16, 32
BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64
I32 = torch.int32
workspace_bytes = cake_causal_conv1d_train_backward_workspace_bytes


# ---------------------------------------------------------------------------------------------
# bad inputs


def valid_args(**override):
    """Valid arguments (all on the CPU, with a bias) with some of them replaced by `override`."""
    args = {
        "x": torch.randn(S, C).to(BF16),
        "weight": torch.randn(C, 4),
        "cu_seqlens": torch.tensor([0, 5, 5, S], dtype=I32),
        "dy": torch.randn(S, C).to(BF16),
        "bias": torch.randn(C),
        "initial_states": None,
        "dfinal_states": None,
        "silu_grad_preactivation": "bf16",
        "workspace": None,
        "dx": None,
        "dweight": None,
        "dbias": None,
        "dinitial_states": None,
    }
    args.update(override)
    return args


def call(args):
    return cake_causal_conv1d_train_backward(
        args["x"],
        args["weight"],
        args["cu_seqlens"],
        args["dy"],
        bias=args["bias"],
        initial_states=args["initial_states"],
        dfinal_states=args["dfinal_states"],
        silu_grad_preactivation=args["silu_grad_preactivation"],
        workspace=args["workspace"],
        dx=args["dx"],
        dweight=args["dweight"],
        dbias=args["dbias"],
        dinitial_states=args["dinitial_states"],
    )


def case(case_id, exc, argname, **override):
    """One bad-input case: `override` maps an argument to a zero-argument factory."""
    return pytest.param(override, exc, argname, id=case_id)


def policy(case_id, value):
    return case(case_id, ValueError, "silu_grad_preactivation", silu_grad_preactivation=lambda: value)


BAD_INPUTS = [
    # x
    case("x-fp16", ValueError, "x", x=lambda: torch.randn(S, C).half()),
    case("x-fp32", ValueError, "x", x=lambda: torch.randn(S, C)),
    case("x-1d", ValueError, "x", x=lambda: torch.randn(S * C).to(BF16)),
    case("x-4d", ValueError, "x", x=lambda: torch.randn(1, 1, S, C).to(BF16)),
    case("x-batch2", ValueError, "x", x=lambda: torch.randn(2, S, C).to(BF16)),
    case("x-C-not-mult-8", ValueError, "x",
         x=lambda: torch.randn(S, 12).to(BF16), weight=lambda: torch.randn(12, 4),
         dy=lambda: torch.randn(S, 12).to(BF16), bias=lambda: torch.randn(12)),
    case("x-noncontig", ValueError, "x", x=lambda: torch.randn(C, S).to(BF16).t()),
    case("x-neg-view", ValueError, "x", x=lambda: torch._neg_view(torch.randn(S, C).to(BF16))),
    case("x-list", TypeError, "x", x=lambda: torch.randn(S, C).tolist()),
    case("x-none", TypeError, "x", x=lambda: None),
    *bad_rows("x", lambda: torch.empty(2, 2**33, dtype=BF16, device="meta")[:, :8], peers=("x", "dy")),
    # weight
    case("weight-width3", ValueError, "weight", weight=lambda: torch.randn(C, 3)),
    case("weight-wrong-C", ValueError, "weight", weight=lambda: torch.randn(C + 8, 4)),
    case("weight-fp16", ValueError, "weight", weight=lambda: torch.randn(C, 4).half()),
    case("weight-fp64", ValueError, "weight", weight=lambda: torch.randn(C, 4).double()),
    case("weight-transposed", ValueError, "weight", weight=lambda: torch.randn(4, C).t()),
    case("weight-list", TypeError, "weight", weight=lambda: torch.randn(C, 4).tolist()),
    # bias
    case("bias-wrong-len", ValueError, "bias", bias=lambda: torch.randn(C + 8)),
    case("bias-fp16", ValueError, "bias", bias=lambda: torch.randn(C).half()),
    case("bias-2d", ValueError, "bias", bias=lambda: torch.randn(1, C)),
    case("bias-noncontig", ValueError, "bias", bias=lambda: torch.randn(2 * C)[::2]),
    case("bias-neg-view", ValueError, "bias", bias=lambda: torch._neg_view(torch.randn(C))),
    case("bias-float", TypeError, "bias", bias=lambda: 0.5),
    # cu_seqlens
    case("cu-int64", ValueError, "cu_seqlens", cu_seqlens=lambda: torch.tensor([0, 5, S])),
    case("cu-2d", ValueError, "cu_seqlens", cu_seqlens=lambda: torch.tensor([[0, 5, S]], dtype=I32)),
    case("cu-empty", ValueError, "cu_seqlens", cu_seqlens=lambda: torch.empty(0, dtype=I32)),
    case("cu-neg-view", ValueError, "cu_seqlens", cu_seqlens=lambda: torch._neg_view(torch.tensor([0, -5, -S], dtype=I32))),
    case("cu-noncontig", ValueError, "cu_seqlens",
         cu_seqlens=lambda: torch.tensor([0, 9, 5, 9, S, 9], dtype=I32)[::2]),
    case("cu-list", TypeError, "cu_seqlens", cu_seqlens=lambda: [0, 5, S]),
    # dy
    case("dy-neg-view", ValueError, "dy", dy=lambda: torch._neg_view(torch.randn(S, C).to(BF16))),
    case("dy-fp32", ValueError, "dy", dy=lambda: torch.randn(S, C)),
    case("dy-fp16", ValueError, "dy", dy=lambda: torch.randn(S, C).half()),
    case("dy-more-rows", ValueError, "dy", dy=lambda: torch.randn(S + 1, C).to(BF16)),
    case("dy-fewer-cols", ValueError, "dy", dy=lambda: torch.randn(S, C - 8).to(BF16)),
    case("dy-3d-for-2d-x", ValueError, "dy", dy=lambda: torch.randn(1, S, C).to(BF16)),
    case("dy-2d-for-3d-x", ValueError, "dy", x=lambda: torch.randn(1, S, C).to(BF16)),
    case("dy-noncontig", ValueError, "dy", dy=lambda: torch.randn(C, S).to(BF16).t()),
    case("dy-expanded", ValueError, "dy", dy=lambda: torch.ones((), dtype=BF16).expand(S, C)),
    case("dy-list", TypeError, "dy", dy=lambda: torch.randn(S, C).tolist()),
    case("dy-none", TypeError, "dy", dy=lambda: None),
    *bad_rows("dy", lambda: torch.empty(S, 2**30, dtype=BF16, device="meta")[:, :C], peers=("x", "dy")),
    # dx
    case("dx-fp32", ValueError, "dx", dx=lambda: torch.empty(S, C)),
    case("dx-more-rows", ValueError, "dx", dx=lambda: torch.empty(S + 1, C, dtype=BF16)),
    case("dx-3d-for-2d-x", ValueError, "dx", dx=lambda: torch.empty(1, S, C, dtype=BF16)),
    case("dx-noncontig", ValueError, "dx", dx=lambda: torch.empty(C, S, dtype=BF16).t()),
    case("dx-list", TypeError, "dx", dx=lambda: [[0.0] * C] * S),
    *bad_rows("dx", lambda: torch.empty(S, 2**30, dtype=BF16, device="meta")[:, :C], peers=("x", "dy")),
    # initial_states / dfinal_states / dinitial_states (only with initial_states)
    *bad_states("initial_states"),
    *bad_states("dfinal_states"),
    *bad_states("dinitial_states", initial_states=states),
    case("dinitial_states-without-initial_states", ValueError, "dinitial_states", dinitial_states=states),
    # dweight: weight's dtype (FP32 here) and shape
    case("dweight-bf16-for-fp32", ValueError, "dweight", dweight=lambda: torch.empty(C, 4, dtype=BF16)),
    case("dweight-fp32-for-bf16", ValueError, "dweight",
         weight=lambda: torch.randn(C, 4).to(BF16), dweight=lambda: torch.empty(C, 4)),
    case("dweight-fp64", ValueError, "dweight", dweight=lambda: torch.empty(C, 4, dtype=F64)),
    case("dweight-width3", ValueError, "dweight", dweight=lambda: torch.empty(C, 3)),
    case("dweight-flat", ValueError, "dweight", dweight=lambda: torch.empty(4 * C)),
    case("dweight-transposed", ValueError, "dweight", dweight=lambda: torch.empty(4, C).t()),
    case("dweight-list", TypeError, "dweight", dweight=lambda: [[0.0] * 4] * C),
    # dbias: bias's dtype (FP32 here) and shape; only with a bias
    case("dbias-without-bias", ValueError, "dbias", bias=lambda: None, dbias=lambda: torch.empty(C)),
    case("dbias-bf16-for-fp32", ValueError, "dbias", dbias=lambda: torch.empty(C, dtype=BF16)),
    case("dbias-fp32-for-bf16", ValueError, "dbias",
         bias=lambda: torch.randn(C).to(BF16), dbias=lambda: torch.empty(C)),
    case("dbias-wrong-len", ValueError, "dbias", dbias=lambda: torch.empty(C + 8)),
    case("dbias-2d", ValueError, "dbias", dbias=lambda: torch.empty(1, C)),
    case("dbias-noncontig", ValueError, "dbias", dbias=lambda: torch.empty(2 * C)[::2]),
    case("dbias-float", TypeError, "dbias", dbias=lambda: 0.0),
    # silu_grad_preactivation
    policy("policy-upper", "BF16"),
    policy("policy-fp16", "fp16"),
    policy("policy-fp64", "fp64"),
    policy("policy-empty", ""),
    policy("policy-padded", " bf16"),
    policy("policy-none", None),
    policy("policy-int", 1),
    policy("policy-bool", True),
    policy("policy-bytes", b"bf16"),
    policy("policy-list", ["bf16"]),
    policy("policy-dtype", torch.bfloat16),
    # workspace: FP32, 1-D, contiguous, large enough
    case("ws-int32", ValueError, "workspace", workspace=lambda: torch.zeros(1 << 16, dtype=I32)),
    case("ws-fp64", ValueError, "workspace", workspace=lambda: torch.zeros(1 << 16, dtype=F64)),
    case("ws-bf16", ValueError, "workspace", workspace=lambda: torch.zeros(1 << 16, dtype=BF16)),
    case("ws-empty", ValueError, "workspace", workspace=lambda: torch.zeros(0)),
    case("ws-one-float-short", ValueError, "workspace",
         workspace=lambda: torch.zeros(workspace_bytes(S, C, "cpu") // 4 - 1)),
    case("ws-2d", ValueError, "workspace", workspace=lambda: torch.zeros(256, 256)),
    case("ws-noncontig", ValueError, "workspace", workspace=lambda: torch.zeros(1 << 17)[::2]),
    case("ws-neg-view", ValueError, "workspace", workspace=lambda: torch._neg_view(torch.zeros(1 << 16))),
    case("ws-list", TypeError, "workspace", workspace=lambda: [0.0] * 1024),
    # a view whose storage was resized since (the kernels would address past it)
    case("dy-storage-resized", ValueError, "dy", dy=lambda: resized(torch.randn(S, C).to(BF16), 2 * S * C - 2)),
    case("dx-storage-freed", ValueError, "dx", dx=lambda: resized(torch.empty(S, C, dtype=BF16), 0)),
    case("ws-storage-resized", ValueError, "workspace",
         workspace=lambda: resized(torch.zeros(workspace_bytes(S, C, "cpu") // 4), 64)),
    # grad mode on: the backward is not differentiable and writes its outputs in place (check_no_grad)
    case("x-requires-grad", RuntimeError, "x", x=lambda: torch.randn(S, C).to(BF16).requires_grad_()),
    case("dy-requires-grad", RuntimeError, "dy", dy=lambda: torch.randn(S, C).to(BF16).requires_grad_()),
    case("dfinal_states-requires-grad", RuntimeError, "dfinal_states", initial_states=states,
         dfinal_states=lambda: states().requires_grad_()),
    case("dx-requires-grad", RuntimeError, "dx", dx=lambda: torch.empty(S, C, dtype=BF16).requires_grad_()),
    case("dweight-requires-grad", RuntimeError, "dweight", dweight=lambda: torch.empty(C, 4).requires_grad_()),
    case("ws-requires-grad", RuntimeError, "workspace",
         workspace=lambda: torch.zeros(workspace_bytes(S, C, "cpu") // 4).requires_grad_()),
    # device: every argument is well-formed, but x is not on a CUDA device
    case("x-on-cpu", ValueError, "x"),
    case("x-on-cpu-no-bias", ValueError, "x", bias=lambda: None),
    case("x-on-cpu-all-outputs", ValueError, "x",
         workspace=lambda: torch.zeros(1 << 16), dx=lambda: torch.empty(S, C, dtype=BF16),
         dweight=lambda: torch.empty(C, 4), dbias=lambda: torch.empty(C)),
]

# Rules checked after the devices' (alignment, devices, overlap: byte spans from first to last
# element), so only on the GPU: on the CPU these raise about x's device.
GPU_ONLY_BAD_INPUTS = [
    case("x-strided-misaligned", ValueError, "x", x=lambda: torch.randn(S, C + 8).to(BF16)[:, 4 : 4 + C]),
    case("dy-strided-misaligned", ValueError, "dy", dy=lambda: torch.randn(S, C + 8).to(BF16)[:, 4 : 4 + C]),
    case("dx-strided-misaligned", ValueError, "dx", dx=lambda: torch.empty(S, C + 8, dtype=BF16)[:, 4 : 4 + C]),
    case("initial_states-misaligned", ValueError, "initial_states",
         **one_buffer(D * 3 * C + 8, initial_states=lambda b: state_view(b, 1))),
    case("dfinal_states-misaligned", ValueError, "dfinal_states",
         **one_buffer(D * 3 * C + 8, dfinal_states=lambda b: state_view(b, 1))),
    case("dinitial_states-misaligned", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(D * 3 * C + 8, dinitial_states=lambda b: state_view(b, 1))),
    case("initial_states-on-cpu", ValueError, "initial_states",
         initial_states=lambda: torch.randn(D, 3, C, device="cpu").to(BF16)),
    case("dfinal_states-on-cpu", ValueError, "dfinal_states",
         dfinal_states=lambda: torch.randn(D, 3, C, device="cpu").to(BF16)),
    case("ws-misaligned", ValueError, "workspace",  # the partial rows are summed with 16-byte loads
         workspace=lambda: torch.zeros(workspace_bytes(S, C, "cpu") // 4 + 4)[1:]),
    case("dinitial_states-on-cpu", ValueError, "dinitial_states", initial_states=states,
         dinitial_states=lambda: torch.empty(D, 3, C, dtype=BF16, device="cpu")),
    case("dinitial_states-overlaps-x", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(2 * S * C, x=rows, dinitial_states=lambda b: state_view(b, S * C // 2))),
    case("dinitial_states-overlaps-dy", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(2 * S * C, dy=rows, dinitial_states=lambda b: state_view(b, S * C // 2))),
    case("dinitial_states-in-dy-row-gap", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(S * (C + 320), dy=lambda b: rows(b, stride=C + 320), dinitial_states=lambda b: state_view(b, C))),
    case("dinitial_states-overlaps-dx", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(2 * S * C, dx=rows, dinitial_states=lambda b: state_view(b, S * C // 2))),
    case("dinitial_states-is-initial_states", ValueError, "dinitial_states",
         **one_buffer(D * 3 * C, initial_states=state_view, dinitial_states=state_view)),
    case("dinitial_states-overlaps-initial_states", ValueError, "dinitial_states",
         **one_buffer(D * 3 * C + 8, initial_states=state_view, dinitial_states=lambda b: state_view(b, 8))),
    case("dinitial_states-overlaps-dfinal_states", ValueError, "dinitial_states", initial_states=states,
         **one_buffer(D * 3 * C + 8, dfinal_states=state_view, dinitial_states=lambda b: state_view(b, 8))),
    case("dx-overlaps-initial_states", ValueError, "dx",
         **one_buffer(2 * S * C, initial_states=state_view, dx=lambda b: rows(b, D * 3 * C // 2))),
    case("dx-interleaved-with-dy", ValueError, "dx",  # disjoint elements, overlapping spans
         **one_buffer(2 * S * C, dy=lambda b: rows(b, 0, 2 * C), dx=lambda b: rows(b, C, 2 * C))),
]

# Well-formed arguments with row-strided views (and states): the Python rules accept them, so on
# the CPU the call fails on x's device, not on a layout rule.
VALID_ON_CPU = [
    pytest.param({"x": lambda: torch.randn(S, C + 64).to(BF16)[:, 32 : 32 + C]}, id="x-row-strided"),
    pytest.param({"dy": lambda: torch.randn(S, C + 64).to(BF16)[:, 32 : 32 + C]}, id="dy-row-strided"),
    pytest.param({"dx": lambda: torch.empty(S, C + 64, dtype=BF16)[:, 32 : 32 + C]}, id="dx-row-strided"),
    pytest.param({"x": lambda: torch.randn(1, S, 2 * C).to(BF16)[:, :, C:],
                  "dy": lambda: torch.randn(1, S, 3 * C).to(BF16)[:, :, :C],
                  "dx": lambda: torch.empty(1, S, C + 8, dtype=BF16)[:, :, 8:]}, id="3d-all-row-strided"),
    pytest.param({"x": lambda: torch.randn(1, C + 4).to(BF16)[:, :C],
                  "dy": lambda: torch.randn(3 * C).to(BF16).as_strided((1, C), (3, 1)),
                  "dx": lambda: torch.empty(1, 2 * C - 1, dtype=BF16)[:, C - 1 : 2 * C - 1]}, id="S=1-any-row-stride"),
    pytest.param({"x": lambda: torch.empty(2, 2**33 - 8, dtype=BF16, device="meta")[:, :8],
                  "dy": lambda: torch.empty(2, 2**33 - 8, dtype=BF16, device="meta")[:, :8],
                  "weight": lambda: torch.randn(8, 4), "bias": lambda: torch.randn(8)},
                 id="S-times-stride-just-in-range"),
    pytest.param({"initial_states": states, "dfinal_states": states, "dinitial_states": states}, id="states"),
    pytest.param({"dfinal_states": states}, id="dfinal_states-without-initial_states"),
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


def test_rejected_call_leaves_outputs_untouched():
    """A ValueError (here: x on the CPU) is raised before anything is written."""
    dx = torch.full((S, C), float("nan"), dtype=BF16)
    dweight = torch.full((C, 4), float("nan"))
    dbias = torch.full((C,), float("nan"))
    workspace = torch.full((1 << 12,), 7.0)
    args = valid_args(dx=dx, dweight=dweight, dbias=dbias, workspace=workspace)
    with pytest.raises(ValueError, match=rf"^{FN}: x\b"):
        call(args)
    assert dx.isnan().all() and dweight.isnan().all() and dbias.isnan().all()
    assert (workspace == 7.0).all()


BACKWARD_TOO_LARGE = [(2**31, 8), (2**28, 128), (1, 2**30, 32), (2**30, 8), (2**20, 16384), (1, 2**29, 32)]
BACKWARD_TOO_LARGE_IDS = ["S=2^31", "SC=2^35", "3d", "S=2^30", "SC=2^34", "3d-SC=2^34"]


@pytest.mark.parametrize("shape", BACKWARD_TOO_LARGE, ids=BACKWARD_TOO_LARGE_IDS)
def test_too_large_is_rejected_before_anything(shape):
    """Sizes past the backward kernel's index range (S < 2^30, S * C < 2^34: half the
    forward's) are a ValueError naming x (meta tensors: no memory)."""
    x = torch.empty(shape, dtype=BF16, device="meta")
    dy = torch.empty(shape, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=rf"^{FN}: x\b.*2\^3"):
        cake_causal_conv1d_train_backward(x, torch.randn(shape[-1], 4), torch.tensor([0], dtype=I32), dy)


@pytest.mark.parametrize("shape", BACKWARD_TOO_LARGE[3:], ids=BACKWARD_TOO_LARGE_IDS[3:])
def test_autograd_entry_rejects_what_the_backward_cannot_take(shape):
    """A size the forward accepts but the backward does not fails before the forward runs."""
    x = torch.empty(shape, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=r"^cake_causal_conv1d: x\b.*backward"):
        cake_causal_conv1d(x, torch.randn(shape[-1], 4), torch.tensor([0], dtype=I32))


@pytest.mark.parametrize("value", ["BF16", "fp16", "", None, 1, b"fp32", ["bf16"], {"bf16": 1}], ids=repr)
def test_autograd_entry_rejects_bad_policy(value):
    x = torch.randn(S, C).to(BF16)
    with pytest.raises(ValueError, match=r"\bsilu_grad_preactivation\b"):
        cake_causal_conv1d(x, torch.randn(C, 4), torch.tensor([0, S], dtype=I32), silu_grad_preactivation=value)


def test_autograd_entry_with_cpu_x_is_a_value_error():
    x = torch.randn(S, C).to(BF16).requires_grad_()
    with pytest.raises(ValueError, match=r"\bx\b"):
        cake_causal_conv1d(x, torch.randn(C, 4), torch.tensor([0, S], dtype=I32), silu_grad_preactivation="fp32")


AUTOGRAD = "cake_causal_conv1d"
# x on the CPU: the first device rule's message (the calls' eager error there)
CPU_X = (r"x must be a CUDA tensor, got device cpu \(the kernels run on CUDA GPUs; "
         r"flashinfer_cake\.reference's functions compute the same op in FP64 on any device\)$")


def autograd_valid_args(**override):
    """Valid arguments of cake_causal_conv1d (on the CPU) with some of them replaced."""
    args = {"x": torch.randn(S, C).to(BF16), "weight": torch.randn(C, 4),
            "cu_seqlens": torch.tensor([0, 5, 5, S], dtype=I32), "bias": torch.randn(C), "initial_states": None,
            "return_final_states": False, "silu_grad_preactivation": "bf16"}
    args.update(override)
    return args


def autograd_call(args):
    return cake_causal_conv1d(args["x"], args["weight"], args["cu_seqlens"], args["bias"],
                              initial_states=args["initial_states"], return_final_states=args["return_final_states"],
                              silu_grad_preactivation=args["silu_grad_preactivation"])


def autograd_apply(args):
    """CakeCausalConv1dFunction.apply called directly (public; torch.compile's path): the same rules."""
    return CakeCausalConv1dFunction.apply(*(args[k] for k in ("x", "weight", "cu_seqlens", "bias", "initial_states",
                                                               "return_final_states", "silu_grad_preactivation")))


AUTOGRAD_ENTRIES = pytest.mark.parametrize("entry", [autograd_call, autograd_apply], ids=["function", "apply"])


def flag(case_id, value):
    return case(f"return_final_states-{case_id}", TypeError, "return_final_states", return_final_states=lambda: value)


AUTOGRAD_BAD_INPUTS = [
    flag("int", 1),
    flag("zero", 0),
    flag("none", None),
    flag("str", "True"),
    flag("tensor", torch.tensor(True)),
    *bad_states("initial_states"),
    *bad_rows("x", lambda: torch.empty(2, 2**34, dtype=BF16, device="meta")[:, :8]),
    case("cu_seqlens-list-with-final-states", TypeError, "cu_seqlens", cu_seqlens=lambda: [0, 5, 5, S],
         return_final_states=lambda: True),
    case("silu_grad_preactivation-typo", ValueError, "silu_grad_preactivation",
         silu_grad_preactivation=lambda: "bf_16"),
]
AUTOGRAD_GPU_ONLY_BAD_INPUTS = [
    case("initial_states-misaligned", ValueError, "initial_states",
         **one_buffer(D * 3 * C + 8, initial_states=lambda b: state_view(b, 1))),
    case("initial_states-on-cpu", ValueError, "initial_states",
         initial_states=lambda: torch.randn(D, 3, C, device="cpu").to(BF16)),
]


@AUTOGRAD_ENTRIES
@pytest.mark.parametrize("override, exc, argname", AUTOGRAD_BAD_INPUTS)
def test_autograd_entry_rejects_bad_input_naming_the_argument(override, exc, argname, entry):
    args = autograd_valid_args(**{name: make() for name, make in override.items()})
    with pytest.raises(exc, match=rf"^{AUTOGRAD}: {argname}\b"):
        entry(args)


@pytest.mark.gpu
@AUTOGRAD_ENTRIES
@pytest.mark.parametrize("override, exc, argname", AUTOGRAD_BAD_INPUTS + AUTOGRAD_GPU_ONLY_BAD_INPUTS)
def test_autograd_entry_rejects_bad_cuda_input_naming_the_argument(override, exc, argname, entry, bad_cuda_args):
    args = bad_cuda_args(entry, autograd_valid_args, override)
    with pytest.raises(exc, match=rf"^{AUTOGRAD}: {argname}\b"):
        entry(args)


@pytest.mark.parametrize("override", [
    pytest.param({"x": lambda: torch.randn(S, C + 64).to(BF16)[:, 32 : 32 + C]}, id="x-row-strided"),
    pytest.param({"x": lambda: torch.randn(S, C + 64).to(BF16)[:, 32 : 32 + C], "initial_states": states,
                  "return_final_states": lambda: True}, id="x-row-strided-with-states"),
])
def test_autograd_entry_valid_views_pass_the_python_rules(override):
    args = autograd_valid_args(**{name: make() for name, make in override.items()})
    with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: x must be a CUDA tensor"):
        autograd_call(args)


def test_autograd_entry_rejects_a_row_stride_past_the_backwards_range():
    """S * C within the backward's range but S * stride(-2) = 2^34 past it: the forward could take
    x, the backward could not; a ValueError up front (meta tensors: no memory)."""
    x = torch.empty(2, 2**33, dtype=BF16, device="meta")[:, :8]
    with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: x\b.*backward"):
        cake_causal_conv1d(x, torch.randn(8, 4), torch.tensor([0, 2], dtype=I32))


DUAL_CASES = {  # an argument made a dual tensor: the inputs and the outputs the raw backward writes
    "x": lambda: torch.randn(S, C).to(BF16), "dy": lambda: torch.randn(S, C).to(BF16),
    "weight": lambda: torch.randn(C, 4), "bias": lambda: torch.randn(C), "initial_states": states,
    "dfinal_states": states, "dx": lambda: torch.empty(S, C, dtype=BF16), "dweight": lambda: torch.empty(C, 4),
    "dbias": lambda: torch.empty(C), "dinitial_states": states,
    "workspace": lambda: torch.zeros(workspace_bytes(S, C) // 4),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("argname", list(DUAL_CASES))
def test_dual_tensors_are_refused_naming_the_argument(argname, grad_mode, device, request):
    """Forward-mode AD: the raw backward propagates no tangent, so a dual tensor among its inputs or
    outputs is a RuntimeError naming it, in either grad mode; on the GPU the binding declines it."""
    override = {argname: lambda: dual(DUAL_CASES[argname]())}
    if argname in ("dfinal_states", "dinitial_states"):
        override["initial_states"] = states
    with torch.autograd.forward_ad.dual_level(), torch.set_grad_enabled(grad_mode):
        if device == "cuda":
            args = request.getfixturevalue("bad_cuda_args")(call, valid_args, override)
        else:
            args = valid_args(**{name: make() for name, make in override.items()})
        with pytest.raises(RuntimeError, match=dual_message(FN, argname)):
            call(args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("entry", ["function", "node"])
@pytest.mark.parametrize("which", ["dy", "dfinal_states"])
def test_a_dual_incoming_gradient_is_refused(which, entry, device):
    """Forward-over-reverse (autograd.grad with a dual grad_outputs): the backward would drop the
    tangent, silently, so it is cake_causal_conv1d's NotImplementedError, through the Function and
    (on the GPU) the binding's C++ node. On the CPU only the Function's wrapper runs (the forward
    needs a GPU): its check comes before anything reads the saved tensors."""
    if device == "cpu" and entry == "node":
        pytest.skip("the C++ node is the GPU's eager path")
    x = torch.randn(S, C, device=device).to(BF16).requires_grad_()
    w, cu = torch.randn(C, 4, device=device, requires_grad=True), torch.tensor([0, 5, 5, S], dtype=I32, device=device)
    h0 = torch.randn(D, 3, C, device=device).to(BF16).requires_grad_()
    with torch.autograd.forward_ad.dual_level():
        if device == "cpu":
            grads = [torch.randn(S, C).to(BF16), torch.randn(D, 3, C).to(BF16)]
            grads[which == "dfinal_states"] = dual(grads[which == "dfinal_states"])
            with pytest.raises(NotImplementedError, match=rf"^{AUTOGRAD}: forward-mode AD .* not supported"):
                CakeCausalConv1dFunction.backward(None, *grads)
            return
        if entry == "function":
            y, fs = CakeCausalConv1dFunction.apply(x, w, cu, None, h0, True, "bf16")
        else:
            y, fs = cake_causal_conv1d(x, w, cu, initial_states=h0, return_final_states=True)
        grads = [torch.randn_like(y), torch.randn_like(fs)]
        grads[which == "dfinal_states"] = dual(grads[which == "dfinal_states"])
        with pytest.raises(NotImplementedError, match=rf"{AUTOGRAD}: forward-mode AD .* not supported"):
            torch.autograd.grad((y, fs), (x, w, h0), grads)


@pytest.mark.parametrize("dy", [torch.randn(C), torch.randn(1, C).to(BF16)], ids=["fp32-row", "bf16-row"])
def test_custom_ops_backward_does_not_broadcast_dy(dy):
    """The custom op's backward copies an incoming gradient it cannot read as it is, but one of
    another shape is the backward's ValueError naming dy, not broadcast into x's shape."""
    from flashinfer_cake._custom_ops import backward_of_any_grads

    x = torch.randn(S, C).to(BF16)
    with pytest.raises(ValueError, match=r"^cake_causal_conv1d_train_backward: dy\b"):
        backward_of_any_grads(x, torch.randn(C, 4), torch.tensor([0, S], dtype=I32), dy, None, None, None, "bf16")


class _Traced(Exception):
    """Raised by the recording compilers in place of running a graph (the ops need a GPU)."""


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("states", [False, True], ids=["plain", "states"])
def test_torch_compile_traces_one_graph_through_the_custom_ops(dynamic, states):
    """torch.compile(fullgraph=True) of a loss through cake_causal_conv1d, traced on the CPU with fake
    tensors (the compilers record the graphs and run nothing): one graph, no break, the forward
    custom op in AOT autograd's forward graph and the backward op in its backward graph."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def recorder(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm.code

            def run(*args):
                raise _Traced(name)
            return run
        return compiler

    def loss(x, w, b, h0, cu):
        out = cake_causal_conv1d(x, w, cu, b, initial_states=h0, return_final_states=h0 is not None)
        y, fs = out if h0 is not None else (out, None)
        return y.float().sum() + (0 if fs is None else fs.float().sum())

    x = torch.randn(S, C).to(BF16).requires_grad_()
    w, b = torch.randn(C, 4, requires_grad=True), torch.randn(C).to(BF16).requires_grad_()
    h0 = torch.randn(3, 3, C).to(BF16).requires_grad_() if states else None
    # the backward graph compiled with the forward (else at the first backward, which never comes here)
    eager_bw = hasattr(functorch_config, "force_non_lazy_backward_lowering")
    torch._dynamo.reset()
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True) if eager_bw else contextlib.nullcontext():
            compiled = torch.compile(loss, fullgraph=True, dynamic=dynamic,
                                     backend=aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw")))
            with pytest.raises(_Traced, match="fw"):
                compiled(x, w, b, h0, torch.tensor([0, 5, 5, S], dtype=I32))
    finally:
        torch._dynamo.reset()  # no compiled state left to other tests
    assert "flashinfer_cake.causal_conv1d_fwd" in graphs["fw"] and "causal_conv1d_bwd" not in graphs["fw"]
    if eager_bw or dynamic:
        assert "flashinfer_cake.causal_conv1d_bwd" in graphs.get("bw", ""), sorted(graphs)


def test_torch_compile_on_cpu_tensors_is_the_eager_error():
    """A compiled graph run on CPU tensors (tracing takes them as fakes, the graph then runs the ops
    on the CPU): the eager call's "x must be a CUDA tensor", not the dispatcher's "Could not run
    ... with arguments from the 'CPU' backend"; the ops called directly likewise."""
    x = torch.randn(S, C).to(BF16).requires_grad_()
    w, cu = torch.randn(C, 4), torch.tensor([0, 5, S], dtype=I32)
    expected = rf"^{AUTOGRAD}: {CPU_X}"
    torch._dynamo.reset()
    try:
        with pytest.raises(ValueError, match=expected):
            torch.compile(cake_causal_conv1d, fullgraph=True, backend="aot_eager")(x, w, cu)
    finally:
        torch._dynamo.reset()
    with pytest.raises(ValueError, match=expected):
        torch.ops.flashinfer_cake.causal_conv1d_fwd(x, w, cu, None, None, False)
    with pytest.raises(ValueError, match=expected):
        torch.ops.flashinfer_cake.causal_conv1d_bwd(x, w, cu, x, None, None, None, "bf16")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("override, argname", [
    pytest.param({"w": lambda: torch.randn(C, 1, 4)}, "weight", id="conv1d-weight"),
    pytest.param({"cu": lambda: torch.tensor([0, 5, S])}, "cu_seqlens", id="int64-cu_seqlens"),
    pytest.param({"cu": lambda: torch.zeros(0, dtype=I32)}, "cu_seqlens", id="no-cu_seqlens-entry"),
    pytest.param({"x": lambda: torch.randn(S, C).half().requires_grad_()}, "x", id="fp16-x"),
    pytest.param({"x": lambda: torch.randn(2, S, C).to(BF16).requires_grad_()}, "x", id="batched-x"),
    pytest.param({"h0": lambda: torch.randn(3, 3, C).to(BF16)}, "initial_states", id="states-of-other-docs"),
    pytest.param({"x": lambda: torch.empty(2, 2**33, dtype=BF16, device="meta")[:, :C]}, "x", id="row-stride-range"),
    pytest.param({"policy": lambda: "fp16"}, "silu_grad_preactivation", id="policy"),
])
def test_torch_compile_raises_a_bad_argument_while_tracing(dynamic, override, argname):
    """Under torch.compile the metadata rules run while tracing (fake tensors): a bad argument is
    the eager call's message at compile time, whole, not a wrong fake output or an error in the
    compiled graph's first run."""
    args = {"x": lambda: torch.randn(S, C).to(BF16).requires_grad_(), "w": lambda: torch.randn(C, 4),
            "cu": lambda: torch.tensor([0, 5, S], dtype=I32), "h0": lambda: torch.randn(2, 3, C).to(BF16),
            "policy": lambda: "bf16"}
    args.update(override)
    a = {name: make() for name, make in args.items()}

    def loss(x, w, cu, h0):
        return cake_causal_conv1d(x, w, cu, initial_states=h0, return_final_states=True,
                                  silu_grad_preactivation=a["policy"])[0].float().sum()

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as info:
            torch.compile(loss, fullgraph=True, dynamic=dynamic, backend="aot_eager")(a["x"], a["w"], a["cu"], a["h0"])
    finally:
        torch._dynamo.reset()
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    # the ValueError itself, or dynamo's error quoting it: a size rule's from the op's fake call
    # ("got ValueError('...')"), a constant's from the traced code ("ValueError('...')" in torch 2.13,
    # "ValueError([ConstantVariable(str: '...')])" in 2.11)
    quoted = r"ValueError\((\[ConstantVariable\(str: )?['\"]"
    assert any(re.search(rf"(^|{quoted}){AUTOGRAD}: {argname}\b", str(e)) for e in chain), \
        [f"{type(e).__name__}: {e}" for e in chain]
    # with dynamic sizes the message shows this call's values, not the trace's symbols (s42 - 1)
    messages = [m.group(2) for e in chain for m in [re.search(rf"(^|['\"])({AUTOGRAD}: {argname}\b.*?)(['\"]\)|$)",
                                                              str(e), re.S)] if m]
    assert messages and not any(re.search(r"\b[su]\d+\b", m) for m in messages), messages


# ---------------------------------------------------------------------------------------------
# workspace size


SIZES_S = (0, 1, 2, 7, 63, 64, 65, 1000, 4097, 65536, 70001, 131071, 131072, 1 << 20, 1 << 24)
SIZES_C = (8, 32, 136, 1000, 4096, 16384)


def test_workspace_bytes_properties():
    device = torch.device("cpu")
    for c in SIZES_C:
        assert workspace_bytes(0, c, device) == 0
        for s in SIZES_S:
            if s * c >= 2**34:  # past the backward's range (test_workspace_functions_reject_bad_sizes)
                continue
            n = workspace_bytes(s, c, device)
            assert isinstance(n, int) and not isinstance(n, bool), (s, c, n)
            assert n % 4 == 0, (s, c, n)
            if s > 0:
                # Between one FP32 partial row of the four taps and the bias per channel per
                # 1024 tokens and one per 64 tokens (rounded up).
                assert 20 * c * -(-s // 1024) <= n <= 20 * c * -(-s // 64), (s, c, n)
    # The same whatever form the device argument takes.
    assert workspace_bytes(4097, 264, "cpu") == workspace_bytes(4097, 264, torch.device("cpu"))


def test_workspace_bytes_is_monotone_in_S():
    """A workspace sized for the largest S serves every smaller S: checked on a grid and on
    every S up to 2^17 + 2^10 for a few C (the group size changes with S)."""
    device = torch.device("cpu")
    for c in SIZES_C:
        previous = 0
        for s in SIZES_S:
            if s * c >= 2**34:
                continue
            n = workspace_bytes(s, c, device)
            assert n >= previous, f"workspace bytes shrank from {previous} to {n} at S={s}, C={c}"
            previous = n
    for c in (8, 136, 2048, 16384):
        previous = 0
        for s in range(0, (1 << 17) + 1024):
            n = workspace_bytes(s, c, device)
            assert n >= previous, f"workspace bytes shrank from {previous} to {n} at S={s}, C={c}"
            previous = n


@pytest.mark.parametrize("s, c", [(0, 8), (1, 8), (16, 32), (4097, 264), (70000, 136), (1 << 20, 2048)])
def test_workspace_tensor_matches_bytes(s, c):
    ws = cake_causal_conv1d_train_backward_workspace(s, c, "cpu")
    assert ws.dtype == F32 and ws.dim() == 1 and ws.is_contiguous()
    assert ws.device == torch.device("cpu")
    assert ws.numel() * 4 == workspace_bytes(s, c, "cpu")


@pytest.mark.parametrize(
    "s, c, argname, exc",  # a value out of range is a ValueError; not an integer, a TypeError (as torch's sizes)
    [
        pytest.param(-1, 32, "S", ValueError, id="S-negative"),
        pytest.param(16.0, 32, "S", TypeError, id="S-float"),
        pytest.param(True, 32, "S", TypeError, id="S-bool"),
        pytest.param("16", 32, "S", TypeError, id="S-str"),
        pytest.param(16, 12, "C", ValueError, id="C-not-mult-8"),
        pytest.param(16, 0, "C", ValueError, id="C-0"),
        pytest.param(16, -8, "C", ValueError, id="C-negative"),
        pytest.param(16, 32.0, "C", TypeError, id="C-float"),
        pytest.param(16, 2**28, "C", ValueError, id="C-2^28"),
        pytest.param(2**30, 8, "S", ValueError, id="S-2^30"),
        pytest.param(2**26, 256, "S", ValueError, id="SC-2^34"),
        pytest.param(2**63 - 1, 8, "S", ValueError, id="S-huge"),
    ],
)
def test_workspace_functions_reject_bad_sizes(s, c, argname, exc):
    with pytest.raises(exc, match=rf"\b{argname}\b"):
        workspace_bytes(s, c, torch.device("cpu"))
    with pytest.raises(exc, match=rf"\b{argname}\b"):
        cake_causal_conv1d_train_backward_workspace(s, c, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# the FP64 reference backward


def make_lengths(S, rng):
    """Random document lengths summing to S: a mix of 0 (empty), 1-3 token and longer documents,
    with empty documents at both ends."""
    lengths, left = [0], S
    while left:
        n = min(left, rng.choice((0, 1, 1, 2, 3, 3, 4, 7, 16, 40)))
        lengths.append(n)
        left -= n
    return lengths + [0, 0]


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)


def random_case(seed, S, C, *, bias=True, batch_dim=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, C, generator=g).to(BF16)
    dy = torch.randn(S, C, generator=g).to(BF16)
    if batch_dim:
        x, dy = x.unsqueeze(0), dy.unsqueeze(0)
    w = 0.5 * torch.randn(C, 4, generator=g)
    b = 0.5 * torch.randn(C, generator=g) if bias else None
    cu = cu_of(make_lengths(S, random.Random(seed)))
    return x, w, cu, dy, b


def autograd_grads(x, w, cu, dy, b):
    """FP64 autograd of the forward reference: (dx, dweight, dbias or None)."""
    leaves = [x.double().requires_grad_(), w.double().requires_grad_()]
    if b is not None:
        leaves.append(b.double().requires_grad_())
    y = causal_conv1d_reference(leaves[0], leaves[1], cu, leaves[2] if b is not None else None)
    grads = torch.autograd.grad(y, leaves, dy.double())
    return grads[0], grads[1], grads[2] if b is not None else None


def assert_close64(got, want, what, tol=1e-10):
    assert got.dtype == F64 and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("S, C, bias, batch_dim", [
    (1, 8, True, False),
    (3, 8, False, False),
    (50, 16, True, False),
    (300, 24, False, False),
    (777, 40, True, True),
])
def test_reference_backward_fp32_policy_matches_autograd(S, C, bias, batch_dim):
    for seed in range(3):
        x, w, cu, dy, b = random_case(100 * S + seed, S, C, bias=bias, batch_dim=batch_dim)
        dx, dw, db = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="fp32")
        want_dx, want_dw, want_db = autograd_grads(x, w, cu, dy, b)
        assert dx.shape == x.shape and dw.shape == (C, 4)
        assert_close64(dx, want_dx, "dx")
        assert_close64(dw, want_dw, "dweight")
        if b is None:
            assert db is None
        else:
            assert_close64(db, want_db, "dbias")


def test_reference_backward_bf16_policy_is_autograd_at_rounded_preactivation():
    """"bf16" = the chain rule with silu' taken at bf16(a): g from autograd of silu at the rounded
    pre-activation, then autograd of the (linear) pre-activation with that g."""
    x, w, cu, dy, b = random_case(5, 500, 24)
    dx, dw, db = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="bf16")

    a = causal_conv1d_preactivation_reference(x, w, cu, b)
    a_bf16 = a.to(BF16).double().requires_grad_()
    (g,) = torch.autograd.grad(torch.nn.functional.silu(a_bf16), a_bf16, dy.double())
    leaves = [x.double().requires_grad_(), w.double().requires_grad_(), b.double().requires_grad_()]
    want = torch.autograd.grad(causal_conv1d_preactivation_reference(*leaves[:2], cu, leaves[2]), leaves, g)
    assert_close64(dx, want[0], "dx")
    assert_close64(dw, want[1], "dweight")
    assert_close64(db, want[2], "dbias")


def test_reference_policies_equal_when_preactivation_is_bf16_exact():
    """Small integers and halves: every pre-activation is a multiple of 1/4 below 16, exact in
    BF16, so rounding changes nothing and the two policies agree bit for bit."""
    S, C = 400, 16
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-2, 3, (S, C), generator=g).to(BF16)
    w = torch.randint(-2, 3, (C, 4), generator=g) / 2.0
    b = torch.randint(-4, 5, (C,), generator=g) / 4.0
    dy = torch.randn(S, C, generator=g).to(BF16)
    cu = cu_of(make_lengths(S, random.Random(11)))
    a = causal_conv1d_preactivation_reference(x, w, cu, b)
    assert torch.equal(a.to(BF16).double(), a), "test inputs should make every pre-activation BF16-exact"
    assert a.abs().max() > 2  # the inputs exercise a range of silu' values
    bf16 = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="bf16")
    fp32 = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="fp32")
    for got, want in zip(bf16, fp32):
        assert torch.equal(got, want)


def test_reference_policies_differ_only_by_the_rounding():
    """On random inputs the policies differ, by at most |dy| max|silu''| |a - bf16(a)| per g."""
    x, w, cu, dy, b = random_case(12, 600, 32)
    bf16 = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="bf16")
    fp32 = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation="fp32")
    assert not torch.equal(bf16[0], fp32[0]), "random pre-activations are not all BF16-exact"

    a = causal_conv1d_preactivation_reference(x, w, cu, b)
    g_bound = dy.double().abs() * 0.5 * (a - a.to(BF16).double()).abs()  # max |silu''| = 0.5
    slack = 1e-12
    db_diff = (bf16[2] - fp32[2]).abs()
    assert (db_diff <= g_bound.sum(0) + slack).all()
    # dx[s] mixes g of tokens s .. s + 3 with |w| <= max|w|: a coarse but sound bound.
    window = g_bound.clone()
    for back in (1, 2, 3):
        window[:-back] += g_bound[back:]
    dx_diff = (bf16[0] - fp32[0]).abs()
    assert (dx_diff <= w.abs().max().double() * window + slack).all()
    assert dx_diff.max() < 0.05 * fp32[0].abs().max()


def test_reference_gradients_stay_in_their_document():
    """Changing dy inside one document changes dx only in that document, and changes no dx of
    another document (tokens right before it included)."""
    lengths = [5, 1, 0, 7, 2, 3, 9]
    S, C = sum(lengths), 8
    cu = cu_of(lengths)
    x, w, _, dy, b = random_case(13, S, C)
    bounds = cu.tolist()
    for d in range(len(lengths)):
        lo, hi = bounds[d], bounds[d + 1]
        if lo == hi:
            continue
        dy2 = dy.clone()
        dy2[lo:hi] = torch.randn(hi - lo, C).to(BF16)
        for pol in ("bf16", "fp32"):
            base = causal_conv1d_backward_reference(x, w, cu, dy, b, silu_grad_preactivation=pol)[0]
            moved = causal_conv1d_backward_reference(x, w, cu, dy2, b, silu_grad_preactivation=pol)[0]
            changed = (base != moved).any(dim=1).nonzero().flatten()
            assert changed.numel() > 0
            assert changed.min() >= lo and changed.max() < hi, (d, pol, changed.tolist())


def test_reference_matches_shifted_single_document_case():
    """A document's gradients do not depend on what comes before it: the same document alone
    (cu = [0, n]) gives the same dx rows and its share of dweight/dbias."""
    x, w, _, dy, b = random_case(14, 30, 8)
    cu = torch.tensor([0, 11, 30], dtype=I32)
    full = causal_conv1d_backward_reference(x, w, cu, dy, b)
    alone = causal_conv1d_backward_reference(x[11:], w, torch.tensor([0, 19], dtype=I32), dy[11:], b)
    first = causal_conv1d_backward_reference(x[:11], w, torch.tensor([0, 11], dtype=I32), dy[:11], b)
    assert torch.equal(full[0][11:], alone[0])
    assert torch.equal(full[0][:11], first[0])
    assert_close64(full[1], alone[1] + first[1], "dweight")
    assert_close64(full[2], alone[2] + first[2], "dbias")


def test_reference_empty_sequence():
    x = torch.empty(0, 16, dtype=BF16)
    dx, dw, db = causal_conv1d_backward_reference(x, torch.randn(16, 4), torch.zeros(3, dtype=I32),
                                                  torch.empty(0, 16), torch.randn(16))
    assert dx.shape == (0, 16) and dx.dtype == F64
    assert torch.equal(dw, torch.zeros(16, 4, dtype=F64))
    assert torch.equal(db, torch.zeros(16, dtype=F64))


@pytest.mark.parametrize("value", ["BF16", "fp16", None, 1])
def test_reference_rejects_bad_policy(value):
    x = torch.randn(4, 8).to(BF16)
    with pytest.raises(ValueError, match=r"\bsilu_grad_preactivation\b"):
        causal_conv1d_backward_reference(x, torch.randn(8, 4), torch.tensor([0, 4], dtype=I32), x,
                                         silu_grad_preactivation=value)


@pytest.mark.parametrize("penalty_of", ["x", "weight"])
def test_function_gradients_are_not_differentiable_under_create_graph(monkeypatch, penalty_of):
    """CakeCausalConv1dFunction on the CPU (the kernels replaced by the FP64 reference): under
    create_graph=True its gradients carry an error node even when the incoming gradient does not
    require grad (a gradient penalty's case), so differentiating them raises instead of treating
    them as constants; without create_graph they are plain tensors."""
    from flashinfer_cake import autograd, reference

    def forward(x, weight, cu_seqlens, bias=None, initial_states=None, final_states_out=None):
        return reference.causal_conv1d_reference(x, weight, cu_seqlens, bias).to(x.dtype)

    def backward(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, policy):
        grads = reference.causal_conv1d_backward_reference(x, weight, cu_seqlens, dy, bias,
                                                           silu_grad_preactivation=policy)
        return [g.to(t.dtype) for g, t in zip(grads, (x, weight, bias)) if t is not None]

    monkeypatch.setattr(autograd, "cake_causal_conv1d_train_forward", forward)
    monkeypatch.setattr(autograd, "backward_of_any_grads", backward)
    monkeypatch.setattr(autograd._checks, "check_autograd_args", lambda *args: 0)
    x = torch.randn(S, C).to(BF16).requires_grad_()
    w, b = torch.randn(C, 4, requires_grad=True), torch.randn(C, requires_grad=True)
    cu = torch.tensor([0, 5, S], dtype=I32)
    apply = lambda: autograd.CakeCausalConv1dFunction.apply(x, w, cu, b, None, False, "bf16")  # noqa: E731
    gx, gw = torch.autograd.grad(apply().float().sum(), (x, w), create_graph=True)
    assert gx.requires_grad and gw.requires_grad
    penalty = (gx if penalty_of == "x" else gw).float().square().sum()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        penalty.backward()
    gx, gw = torch.autograd.grad(apply().float().sum(), (x, w))
    assert not gx.requires_grad and not gw.requires_grad
    ref = reference.causal_conv1d_backward_reference(x.detach(), w.detach(), cu, torch.ones(S, C), b.detach())
    assert torch.equal(gx, ref[0].to(BF16)) and torch.equal(gw, ref[1].float())


@pytest.mark.parametrize("mode", ["meta", "fake"])
def test_tensors_without_memory_go_through_the_fake_implementations(mode):
    """Meta tensors and FakeTensorMode (memory estimators, meta-device initialization, make_fx):
    cake_causal_conv1d gives outputs and gradients of the right shapes and dtypes through the
    custom ops' fake implementations (no kernel, no device), and still checks its arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = "meta" if mode == "meta" else "cpu"
    with FakeTensorMode() if mode == "fake" else contextlib.nullcontext():
        x = torch.empty(S, C, dtype=BF16, device=device, requires_grad=True)
        w = torch.empty(C, 4, device=device, requires_grad=True)
        b = torch.empty(C, dtype=BF16, device=device, requires_grad=True)
        cu = torch.zeros(3, dtype=I32, device=device)
        h0 = torch.empty(2, 3, C, dtype=BF16, device=device, requires_grad=True)
        y, fs = cake_causal_conv1d(x, w, cu, b, initial_states=h0, return_final_states=True)
        assert (y.shape, y.dtype, fs.shape, fs.dtype) == ((S, C), BF16, (2, 3, C), BF16)
        (y.float().sum() + fs.float().sum()).backward()
        for t in (x, w, b, h0):
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device == t.device
        with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: weight must have shape \[C, 4\]"):
            cake_causal_conv1d(x, w.unsqueeze(1), cu)


@pytest.mark.parametrize("bad, argname", [
    pytest.param({"w": lambda: torch.empty(C, 1, 4, device="meta")}, "weight", id="conv1d-weight"),
    pytest.param({"h0": lambda: torch.empty(3, 3, C, dtype=BF16, device="meta")}, "initial_states",
                 id="states-of-other-docs"),
    pytest.param({"x": lambda: torch.empty(2, S, C, dtype=BF16, device="meta")}, "x", id="batched-x"),
])
def test_the_forward_ops_fake_implementation_checks_the_sizes(bad, argname):
    """The forward op's fake implementation runs cake_causal_conv1d's size rules (dynamo quotes its
    error whole while tracing), also for a direct call of the op: a wrong fake output never."""
    args = {"x": lambda: torch.empty(S, C, dtype=BF16, device="meta"), "w": lambda: torch.empty(C, 4, device="meta"),
            "cu": lambda: torch.empty(3, dtype=I32, device="meta"),
            "h0": lambda: torch.empty(2, 3, C, dtype=BF16, device="meta")}
    a = {name: make() for name, make in {**args, **bad}.items()}
    with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: {argname}\b"):
        torch.ops.flashinfer_cake.causal_conv1d_fwd(a["x"], a["w"], a["cu"], None, a["h0"], True)
    y, fs = torch.ops.flashinfer_cake.causal_conv1d_fwd(*(args[n]() for n in ("x", "w", "cu")), None, None, True)
    assert (y.shape, fs.shape) == ((S, C), (2, 3, C))


def test_make_fx_traces_the_call_with_symbolic_shapes():
    """make_fx with symbolic shapes (FakeTensors whose sizes, strides and storage sizes are
    SymInts): the call's rules that need no memory hold symbolically, the storage-bounds rule is
    skipped, and the graph holds both custom ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w, cu):
        y = cake_causal_conv1d(x, w, cu)
        return torch.autograd.grad(y.float().sum(), (x, w))

    x = torch.randn(S, C).to(BF16).requires_grad_()
    w = torch.randn(C, 4, requires_grad=True)
    gm = make_fx(step, tracing_mode="symbolic")(x, w, torch.tensor([0, 5, S], dtype=I32))
    assert "flashinfer_cake.causal_conv1d_fwd" in gm.code and "flashinfer_cake.causal_conv1d_bwd" in gm.code


def test_a_subclass_that_dispatches_in_python_goes_through_the_custom_ops():
    """An x of a __torch_dispatch__ subclass (an AsyncCollectiveTensor of tensor parallelism, a
    FunctionalTensor while AOTAutograd traces; here torch's TwoTensor) is declined by the binding
    and taken through the custom op, whose dispatch hands the subclass its call: on the CPU the
    op's CPU kernel (the eager error, from inside the op), not the checks before the op."""
    from test_forward_validation import two_tensor

    x = two_tensor(torch.randn(S, C).to(BF16))
    with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: {CPU_X}") as e:
        cake_causal_conv1d(x, torch.randn(C, 4), torch.tensor([0, S], dtype=I32))
    assert any(entry.name == "_cpu_kernel" for entry in e.traceback), e.traceback


def test_a_dispatch_mode_sees_the_custom_ops():
    """Under a TorchDispatchMode (selective activation checkpointing's caching, FlopCounterMode,
    make_fx in real mode) cake_causal_conv1d goes through the custom ops, so the mode sees the
    call (the binding would run the kernel behind its back): the mode logs the op (meta tensors
    here: the op's fake implementation runs, the shapes come back). Real tensors on the CPU are
    refused as eager calls refuse them, before the op (whose missing CPU kernel would say less)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.empty(S, C, dtype=BF16, device="meta")
    with Log() as log:
        y = cake_causal_conv1d(x, torch.empty(C, 4, device="meta"), torch.empty(2, dtype=I32, device="meta"))
    assert y.shape == x.shape and y.device == x.device
    assert "flashinfer_cake.causal_conv1d_fwd.default" in log.ops, log.ops
    x, w, cu = torch.randn(S, C).to(BF16), torch.randn(C, 4), torch.tensor([0, S], dtype=I32)
    with Log() as log, pytest.raises(ValueError, match=rf"^{AUTOGRAD}: {CPU_X}"):
        cake_causal_conv1d(x, w, cu)
    assert not [op for op in log.ops if "flashinfer_cake" in op], log.ops


def test_fake_tensor_mode_takes_real_cpu_inputs_as_fakes():
    """Under FakeTensorMode(allow_non_fake_inputs=True) a real CPU x becomes a fake one: the op's fake
    implementation gives y's shape, no CUDA rule refuses it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, cu = torch.randn(S, C).to(BF16), torch.randn(C, 4), torch.tensor([0, S], dtype=I32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = cake_causal_conv1d(x, w, cu)
    assert y.shape == x.shape and y.dtype == BF16


@pytest.mark.parametrize("other", ["weight", "cu_seqlens"])
def test_autograd_entry_names_a_cpu_x_before_the_other_devices(other):
    """x on the CPU with another argument on a GPU (or the meta device, on a machine without one): x's own
    device is the error, not the other's device measured against x's ("weight must be on x's device cpu")."""
    device = "cuda" if torch.cuda.is_available() else "meta"
    args = autograd_valid_args()
    args[other] = args[other].to(device)
    with pytest.raises(ValueError, match=rf"^{AUTOGRAD}: {CPU_X}"):
        autograd_call(args)
