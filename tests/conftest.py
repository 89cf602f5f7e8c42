"""Shared test plumbing: the GPU marker and the FLASHINFER_CAKE_REQUIRE_GPU switch.

GPU tests are marked ``@pytest.mark.gpu``. Without a usable sm_90 GPU they are skipped, unless
``FLASHINFER_CAKE_REQUIRE_GPU`` is set (1, true, yes or on: the GPU CI runner), where a missing GPU
fails them instead; a value that is neither on nor off stops the run before any test. What else a GPU
test needs (a tool on PATH, NCCL) is missing the same way: ``@pytest.mark.gpu_needs(problem)`` (None
when nothing is missing), or, found at run time, the ``gpu_feature_missing`` fixture's function.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from flashinfer_cake.jit.env import ARCH_OF_CAPABILITY, env_flag


@functools.cache
def _gpu_problem() -> str | None:
    """Why GPU tests cannot run here, or None when an sm_90 GPU is usable."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) not in ARCH_OF_CAPABILITY:
        supported = ", ".join(f"{a}.{b}" for a, b in ARCH_OF_CAPABILITY)
        return f"GPU tests need compute capability {supported}, found {major}.{minor}"
    return None


def _gpu_required() -> bool:
    return env_flag("FLASHINFER_CAKE_REQUIRE_GPU", "GPU tests fail without a usable GPU", "they skip")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 GPU (skipped without one)")
    config.addinivalue_line("markers", "gpu_needs(problem): what else the GPU test lacks here, or None")
    try:
        _gpu_required()  # a misspelt value must not let a GPU runner pass on skips
    except RuntimeError as e:
        raise pytest.UsageError(str(e)) from None


def _skip_or_fail(problem: str) -> None:
    """A GPU test that cannot run here: skipped, or failed on a GPU runner (it must not pass on skips)."""
    if _gpu_required():
        pytest.fail(f"FLASHINFER_CAKE_REQUIRE_GPU={os.environ['FLASHINFER_CAKE_REQUIRE_GPU']} but {problem}",
                    pytrace=False)
    pytest.skip(problem)


def pytest_runtest_setup(item):
    problems = [_gpu_problem()] if "gpu" in item.keywords else []
    problems += [m.args[0] for m in item.iter_markers("gpu_needs")]
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        _skip_or_fail(problem)


@pytest.fixture(scope="session")
def gpu_feature_missing():
    """``missing(problem)``: what a GPU test found missing at run time (NCCL, a free default process group):
    the test is skipped, or failed under FLASHINFER_CAKE_REQUIRE_GPU."""
    return _skip_or_fail


@pytest.fixture
def bad_cuda_args():
    """``make(call, valid_args, override)``: a bad-input case's arguments built on the current
    CUDA device, after one valid call (which registers the variant with the torch binding, so the
    binding's own checks see the bad call)."""
    def make(call, valid_args, override):
        with torch.device("cuda"):
            call(valid_args())
            return valid_args(**{name: factory() for name, factory in override.items()})

    return make


@pytest.fixture
def unreadable(monkeypatch):
    """``unreadable(directory)``: the directory is unreadable to this process as chmod 000 makes it for a user (a root
    test process reads anything): listing it is a PermissionError and os.access says no."""
    def make(directory: Path) -> None:
        real_access = os.access
        for name in ("scandir", "listdir"):
            def refused(path=".", real=getattr(os, name)):
                if Path(path) == directory:
                    raise PermissionError(13, "Permission denied", str(path))
                return real(path)

            monkeypatch.setattr(os, name, refused)
        monkeypatch.setattr(os, "access", lambda path, mode, **k: Path(path) != directory and real_access(path, mode, **k))

    return make
