"""CPU tests of the torch binding (jit/torch_binding.cpp): built with the C++ compiler here, loaded
into this process. The GPU tests run every launch through it; these check what needs no GPU: it
declines what it cannot launch (so the Python checks raise), the backward's group plan, its name
(tied to the torch and source it was built from), and where the loader finds it.
"""

from __future__ import annotations

import shutil
from unittest import mock

import pytest
import torch

from flashinfer_cake import jit
from flashinfer_cake.jit import binding, env


@pytest.fixture(scope="module")
def loaded():
    """The binding, built into (or found in) the default cache as the public functions do."""
    return jit.load_binding()


def cpu_args(S=16, C=32):
    x = torch.randn(S, C).to(torch.bfloat16)
    return x, torch.randn(C, 4), torch.tensor([0, 5, S], dtype=torch.int32)


def test_declines_cpu_tensors_and_non_tensors(loaded):
    x, w, cu = cpu_args()
    assert loaded.forward(x, w, cu, None, None, None) is None
    assert loaded.forward([1.0], w, cu, None, None, None) is None
    assert loaded.forward(x, w, cu, 0.5, None, None) is None
    assert loaded.backward(x, w, cu, x, None, "bf16", None, None, None, None) is None
    assert loaded.backward(x, w, cu, x, None, "fp16", None, None, None, None) is None
    meta = torch.empty(16, 32, dtype=torch.bfloat16, device="meta")
    assert loaded.forward(meta, w, cu, None, None, None) is None
    fake = mock.Mock(spec=torch.Tensor)  # claims the class, is no tensor: declined, not read
    assert loaded.forward(fake, w, cu, None, None, None) is None
    assert loaded.backward(x, w, cu, fake, None, "bf16", None, None, None, None) is None
    assert loaded.autograd_forward(x, w, cu, None, "bf16") is None
    assert loaded.autograd_forward(fake, w, cu, None, "bf16") is None
    assert loaded.autograd_forward(x, w, cu, None, "fp16") is None


def test_wrong_argument_count_is_a_type_error(loaded):
    x, w, cu = cpu_args()
    with pytest.raises(TypeError, match="forward takes 6 arguments"):
        loaded.forward(x, w, cu)
    with pytest.raises(TypeError, match="backward takes 10 arguments"):
        loaded.backward(x, w, cu, x)
    with pytest.raises(TypeError, match="autograd_forward takes 5 arguments"):
        loaded.autograd_forward(x, w, cu)


@pytest.mark.parametrize("codes", [(-1, 0, 0), (64, 0, 0), (0, 2, 0), (0, 0, 3), (0, -1, 0)])
def test_register_module_rejects_bad_codes(loaded, codes):
    with pytest.raises(ValueError, match="out of range"):
        loaded.register_module(*codes, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="out of range"):
        loaded.register_module(0, 0, 0, 0, 1, 1, 1)  # a null entry


def plan_rule(S: int, C: int) -> tuple[int, int]:
    """The documented rule (causal_conv1d_bwd_plan.h), written independently."""
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    groups = min(ceil(S, 128), max(ceil(S, 1024), ceil(1024, ceil(C, 128))))
    item_tokens = max(ceil(S, 64 * max(groups, 1)) * 64, 64)
    # int32 counters per 32 channels (one per chunk of 8 groups, and one), 16-byte padded
    counters = ceil(4 * ceil(C, 32) * (ceil(groups, 8) + 1), 16) * 16
    return item_tokens, 0 if S == 0 else counters + groups * 5 * C * 4


@pytest.mark.parametrize("C", [8, 128, 136, 2048, 8192, 65536])
def test_backward_plan(loaded, C):
    previous = 0
    for S in [0, 1, 63, 64, 65, 127, 128, 129, 1000, 1024, 4096, 16383, 16384, 131072, 2**29 + 5, 2**30 - 1]:
        if S * C >= 2**34:  # past the backward's range (below)
            continue
        item_tokens, ws_bytes = loaded.backward_plan(S, C)
        assert (item_tokens, ws_bytes) == plan_rule(S, C), (S, C)
        assert item_tokens % 64 == 0 and 64 <= item_tokens <= 1024, (S, C, item_tokens)
        if S:
            assert ws_bytes >= -(-S // item_tokens) * 5 * C * 4, (S, C)  # a partial row set per group
        assert ws_bytes >= previous, (S, C)  # a workspace for the largest S serves every smaller one
        previous = ws_bytes
    for S, C_bad in ((-1, C), (2**30, C), (2**63 - 1, C), (1, 2**28), (-(-2**34 // C), C)):
        with pytest.raises(ValueError, match="outside the backward's range"):
            loaded.backward_plan(S, C_bad)


def test_name_tracks_torch_python_and_source(monkeypatch, tmp_path):
    before = binding.module_prefix()
    assert before.startswith("torch_binding_") and before == binding.module_prefix()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert binding.module_prefix() != before
    monkeypatch.undo()
    source = tmp_path / binding.SOURCE.name
    source.write_bytes(binding.SOURCE.read_bytes() + b"\n")
    monkeypatch.setattr(binding, "SOURCE", source)
    assert binding.module_prefix() != before


def test_found_in_an_aot_dir_first_and_clear_error_when_missing(loaded, monkeypatch, tmp_path):
    built = jit.published_binding()
    assert built is not None
    aot = tmp_path / "aot"
    aot.mkdir(mode=0o700)
    for suffix in (".so", ".json"):
        shutil.copy(built.with_suffix(suffix), aot / built.with_suffix(suffix).name)
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(aot))
    assert jit.published_binding() == aot / built.name

    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(tmp_path / "empty-aot"))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    monkeypatch.setattr(env, "SHIPPED_AOT_DIR", tmp_path / "no-shipped-aot")
    monkeypatch.setattr(binding, "_loaded", None)
    assert jit.published_binding() is None
    with pytest.raises(RuntimeError, match="torch binding .* is not prebuilt and FLASHINFER_CAKE_DISABLE_JIT"):
        jit.load_binding()
