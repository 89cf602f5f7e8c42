"""CPU test of the FLASHINFER_CAKE_REQUIRE_GPU switch (conftest.py): a GPU test run by pytest in a child
process that sees no GPU (CUDA_VISIBLE_DEVICES empty) skips, fails when the switch is on, and a value
that is neither on nor off stops the run before any test (a misspelt switch on a GPU runner must not
pass on skips)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from isolated_env import child_env

GPU_TEST = '''
import pytest


@pytest.mark.gpu
def test_needs_a_gpu():
    pass
'''


@pytest.mark.parametrize("value,rc,says", [
    ("", 0, "1 skipped"), ("off", 0, "1 skipped"), ("1", 1, "1 error"), ("true", 1, "1 error"), ("YES", 1, "1 error"),
    ("maybe", 4, "FLASHINFER_CAKE_REQUIRE_GPU must be 1, true, yes or on"),
])
def test_require_gpu_switch(tmp_path, value, rc, says):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_gpu.py").write_text(GPU_TEST)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gpu.py"], cwd=tmp_path,
                       env=child_env(FLASHINFER_CAKE_REQUIRE_GPU=value, CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == rc and says in r.stdout + r.stderr, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    if rc == 1:
        assert f"FLASHINFER_CAKE_REQUIRE_GPU={value} but no CUDA device visible to torch" in r.stdout


NEEDS_TESTS = '''
import pytest


@pytest.mark.gpu_needs("frobnicate is not on PATH")
def test_needs_a_tool():
    pass


@pytest.mark.gpu_needs(None)
def test_needs_nothing_more():
    pass


def test_finds_a_feature_missing(gpu_feature_missing):
    gpu_feature_missing("NCCL is not available")
    raise AssertionError("not reached")
'''


@pytest.mark.parametrize("value,rc,says", [("", 0, "1 passed, 2 skipped"), ("on", 1, "1 failed, 1 passed, 1 error")])
def test_what_else_a_gpu_test_needs_follows_the_switch(tmp_path, value, rc, says):
    """A tool a GPU test needs (gpu_needs) or a feature it finds missing (the gpu_feature_missing fixture):
    skipped, or failed when the switch is on, as a missing GPU is (a GPU runner without compute-sanitizer or
    NCCL must not pass on skips)."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_needs.py").write_text(NEEDS_TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_needs.py"],
                       cwd=tmp_path, env=child_env(FLASHINFER_CAKE_REQUIRE_GPU=value), capture_output=True, text=True,
                       timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == rc and says in out, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    for problem in ("frobnicate is not on PATH", "NCCL is not available"):
        assert (f"FLASHINFER_CAKE_REQUIRE_GPU={value} but {problem}" if value else problem) in out, out[-2000:]
    assert "not reached" not in out
