"""CPU tests of the torch binding (jit/torch_binding.cpp): built with the C++ compiler here, loaded
into this process. The GPU tests run every launch through it; these check what needs no GPU: it
declines what it cannot launch (so the Python checks raise), its name (tied to the torch and source
it was built from), and where the loader finds it. (The backward's plan is tests/test_contract.py's.)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from flashinfer_cake import jit
from flashinfer_cake.jit import binding, build, core, env


@pytest.fixture(scope="module")
def loaded():
    """The binding, built into (or found in) the default cache as the public functions do."""
    return jit.load_binding()


def cpu_args(S=16, C=32):
    x = torch.randn(S, C).to(torch.bfloat16)
    return x, torch.randn(C, 4), torch.tensor([0, 5, S], dtype=torch.int32)


def test_declines_cpu_tensors_and_non_tensors(loaded):
    x, w, cu = cpu_args()
    states = torch.zeros(2, 3, 32, dtype=torch.bfloat16)
    none4 = (None,) * 4
    assert loaded.try_forward(x, w, cu, None, *none4) is None
    assert loaded.try_forward([1.0], w, cu, None, *none4) is None
    assert loaded.try_forward(x, w, cu, 0.5, *none4) is None
    assert loaded.try_forward(x, w, cu, None, states, None, None, None) is None
    assert loaded.try_forward(x, w, cu, None, None, 1.0, None, None) is None
    assert loaded.try_backward(x, w, cu, x, None, None, None, "bf16", *none4, None) is None
    assert loaded.try_backward(x, w, cu, x, None, None, None, "fp16", *none4, None) is None
    assert loaded.try_backward(x, w, cu, x, None, states, states, "bf16", *none4, None) is None
    meta = torch.empty(16, 32, dtype=torch.bfloat16, device="meta")
    assert loaded.try_forward(meta, w, cu, None, *none4) is None
    fake = mock.Mock(spec=torch.Tensor)  # claims the class, is no tensor: declined, not read
    assert loaded.try_forward(fake, w, cu, None, *none4) is None
    assert loaded.try_forward(x, w, cu, None, fake, None, None, None) is None
    assert loaded.try_backward(x, w, cu, fake, None, None, None, "bf16", *none4, None) is None
    assert loaded.try_backward(x, w, cu, x, None, None, fake, "bf16", *none4, None) is None
    assert loaded.try_autograd_forward(x, w, cu, None, None, False, "bf16") is None
    assert loaded.try_autograd_forward(fake, w, cu, None, None, False, "bf16") is None
    assert loaded.try_autograd_forward(x, w, cu, None, None, False, "fp16") is None
    assert loaded.try_autograd_forward(x, w, cu, None, None, 1, "bf16") is None  # not a bool


def test_cp_phases_decline_cpu_tensors_and_non_tuples(loaded):
    """The context-parallel phases (flashinfer_cake/cp/conv.py) launch only on accepted CUDA
    tensors: anything else is declined (None), nothing read."""
    x, w, cu = cpu_args()
    xs, ws, bs = (x,), (w,), (None,)
    table = torch.zeros(6, dtype=torch.int32)
    halo = torch.zeros(2, 3, 32, dtype=torch.bfloat16)
    fake = mock.Mock(spec=torch.Tensor)
    assert loaded.cp_send(xs, table, 3) is None
    assert loaded.cp_send((fake,), table, 3) is None
    assert loaded.cp_forward(xs, ws, bs, cu) is None
    assert loaded.cp_forward_heads(xs, xs, ws, bs, x, table, cu, table[:2], table[:1]) is None
    assert loaded.cp_grad_send(xs, xs, ws, bs, (halo,), cu, table[:2], table, 0, "bf16") is None
    assert loaded.cp_backward(xs, xs, ws, bs, (halo,), cu, table[:2], "bf16") is None
    assert loaded.cp_backward(xs, xs, ws, bs, (halo,), cu, table[:2], 1) is None  # not a policy
    assert loaded.cp_backward_tails(xs, xs, xs, ws, bs, (halo,), x.float(), cu, table[:2], table[:1], table,
                                    "fp32") is None
    tables = (cu, table, table, table[:2], table[:1], table[:1], table, table)
    splits = ((0,), (0,), (6,), (0,))
    call = loaded.cp_autograd_forward  # (built with c10d: this torch has torch.distributed)
    assert call(xs, ws, bs, None, tables, 16, "0", splits, "bf16") is None
    assert call([x], ws, bs, None, tables, 16, "0", splits, "bf16") is None  # a list, not a tuple
    assert call((fake,), ws, bs, None, tables, 16, "0", splits, "bf16") is None
    assert call(xs, ws, (None, None), None, tables, 16, "0", splits, "bf16") is None  # lengths differ
    assert call((), (), (), None, tables, 16, "0", splits, "bf16") is None
    assert call(xs, ws, bs, None, tables[:7], 16, "0", splits, "bf16") is None
    assert call(xs, ws, bs, None, tables, -1, "0", splits, "bf16") is None
    assert call(xs, ws, bs, None, tables, 16, 0, splits, "bf16") is None
    assert call(xs, ws, bs, None, tables, 16, "0", ((-1,), (0,), (6,), (0,)), "bf16") is None
    assert call(xs, ws, bs, None, tables, 16, "0", splits, "fp16") is None


def test_wrong_argument_count_is_a_type_error(loaded):
    x, w, cu = cpu_args()
    with pytest.raises(TypeError, match="try_forward takes 8 arguments"):
        loaded.try_forward(x, w, cu)
    with pytest.raises(TypeError, match="try_backward takes 13 arguments"):
        loaded.try_backward(x, w, cu, x)
    with pytest.raises(TypeError, match="try_autograd_forward takes 7 arguments"):
        loaded.try_autograd_forward(x, w, cu)
    for name, count in (("cp_autograd_forward", 9), ("cp_send", 3), ("cp_forward", 4), ("cp_forward_heads", 9),
                        ("cp_grad_send", 10), ("cp_backward", 8), ("cp_backward_tails", 12)):
        with pytest.raises(TypeError, match=f"{name} takes {count} arguments"):
            getattr(loaded, name)(x, w)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("device, weight, bias", [(-1, F32, None), (64, F32, None), (0, torch.float16, None),
                                                  (0, F32, torch.float64), (0, "fp32", None), (0, F32, 0)])
def test_register_kernel_module_rejects_bad_arguments(loaded, device, weight, bias):
    with pytest.raises(ValueError, match="out of range"):
        loaded.register_kernel_module(device, weight, bias, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="out of range"):
        loaded.register_kernel_module(0, F32, BF16, 1, 1, 0, 1, 1)  # a null entry (cp)


def prefix() -> str:
    binding.binding_spec.cache_clear()
    return binding.binding_spec().module_prefix()


def test_name_tracks_torch_python_and_source(monkeypatch, tmp_path):
    before = prefix()
    assert before.startswith("torch_binding_") and before == prefix()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert prefix() != before
    monkeypatch.undo()
    # Another build of the same version (other compiler flags or options: its build settings) is another binding.
    show = torch.__config__.show()
    monkeypatch.setattr(torch.__config__, "show", lambda: show.replace("Build settings:", "Build settings: X=1,"))
    assert prefix() != before
    monkeypatch.undo()
    monkeypatch.setattr(torch.__config__, "show", lambda: show.replace("CPU capability usage:", "CPU capability: X"))
    assert prefix() == before  # what the running CPU supports is not the binding's
    monkeypatch.undo()
    # Where torch is installed is not part of the name: the same torch in another environment (another venv, a
    # container's path) finds the binding prebuilt for it. Its link searches that torch's lib/ (the process has
    # loaded torch's libraries before the binding: no run-path to the builder's).
    elsewhere = tmp_path / "venv" / "site-packages" / "torch"
    monkeypatch.setattr(torch, "__file__", str(elsewhere / "__init__.py"))
    assert prefix() == before
    ninja = build._ninja_file([build.BuildItem(binding.binding_spec(), "b", Path("/usr/bin/c++"))])
    [ldflags] = [line for line in ninja.splitlines() if line.startswith("  ldflags")]
    assert ldflags.split()[2:] == [f"-L{elsewhere / 'lib'}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    monkeypatch.undo()
    source = tmp_path / binding.SOURCE.name
    source.write_bytes(binding.SOURCE.read_bytes() + b"\n")
    monkeypatch.setattr(binding, "SOURCE", source)
    assert prefix() != before
    monkeypatch.undo()
    assert prefix() == before


def test_found_in_an_aot_dir_first_and_clear_error_when_missing(loaded, monkeypatch, tmp_path):
    built = jit.published(jit.binding_spec())[0]
    aot = tmp_path / "aot"
    aot.mkdir(mode=0o700)
    for suffix in (".so", ".json"):
        shutil.copy(built.with_suffix(suffix), aot / built.with_suffix(suffix).name)
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(aot))
    assert jit.published(jit.binding_spec())[0] == aot / built.name

    (tmp_path / "empty-aot").mkdir(mode=0o700)
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(tmp_path / "empty-aot"))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    monkeypatch.setattr(env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")
    monkeypatch.setattr(core, "_loaded", {})
    assert jit.published(jit.binding_spec()) == []
    with pytest.raises(RuntimeError, match="torch_binding is not prebuilt .* FLASHINFER_CAKE_DISABLE_JIT"):
        jit.load_binding()
