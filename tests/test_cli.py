"""CPU tests of the `flashinfer-cake` command (`python -m flashinfer_cake`).

`build` compiles the six variants once into a module-scoped tmp cache; `env`, the default action
and `clear-cache` (on a copy) reuse it. Cheap error cases call `cli.main` in-process.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashinfer_cake import cli
from flashinfer_cake.jit import all_variants, build
from flashinfer_cake.jit import env as jit_env

URIS = [s.uri for s in all_variants(["sm_90a"])]
ISOLATED_VARS = ("FLASHINFER_CAKE_CACHE_DIR", "FLASHINFER_CAKE_AOT_DIR", "FLASHINFER_CAKE_DISABLE_JIT",
                 "FLASHINFER_CAKE_CUDA_ARCH_LIST")


def flashinfer_cake(*args: str, cache: Path, cwd: Path, command=(sys.executable, "-m", "flashinfer_cake"),
                    timeout: float = 120, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    e.update(MAX_JOBS="2", FLASHINFER_CAKE_CACHE_DIR=str(cache), **env)
    return subprocess.run([*command, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def listed_modules(stdout: str, directory: Path) -> dict[str, Path]:
    """uri -> module path of the `<uri>  <path>.so` lines of `build` / `env`."""
    found = re.findall(rf"^\s*(\S+)\s+({re.escape(str(directory))}/\S+\.so)$", stdout, re.M)
    return {uri: Path(path) for uri, path in found}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`flashinfer-cake build` into an empty tmp cache: (cache, completed process)."""
    root = tmp_path_factory.mktemp("cli")
    cache = root / "cache"
    return cache, flashinfer_cake("build", cache=cache, cwd=root, timeout=900)


def test_build(built):
    cache, r = built
    assert r.returncode == 0, r.stderr
    modules = listed_modules(r.stdout, cache)
    assert sorted(modules) == sorted(URIS), r.stdout
    for uri, path in modules.items():
        assert path.name.startswith(uri + "_") and build.verified_module(path) == path
    assert re.search(r"^\[12/12\] ", r.stdout, re.M), r.stdout  # ninja's progress: 6 compiles + 6 links
    assert "building 6 module(s)" in r.stderr


@pytest.mark.parametrize("state", ["built", "empty"])
def test_env(built, tmp_path, state):
    cache = built[0] if state == "built" else tmp_path / "empty-cache"
    r = flashinfer_cake("env", cache=cache, cwd=tmp_path, FLASHINFER_CAKE_CUDA_ARCH_LIST="9.0")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^cache dir\s+{re.escape(str(cache))}\s", r.stdout, re.M), r.stdout
    assert re.search(r"^arch list\s+sm_90a\s", r.stdout, re.M), r.stdout
    assert re.search(r"^nvcc\s+/\S*nvcc \(.*\d+\.\d", r.stdout, re.M), r.stdout  # path (version)
    if not torch.cuda.is_available():
        assert re.search(r"^gpu\s+none", r.stdout, re.M)
    # A module prebuilt into the package's own aot/ (scripts/ci_gpu.sh makes them) is found first.
    shipped = {}
    for directory in jit_env.aot_dirs():
        shipped.update(listed_modules(r.stdout, directory))
    if state == "built":
        assert sorted({**listed_modules(r.stdout, cache), **shipped}) == sorted(URIS), r.stdout
    else:
        for uri in URIS:
            assert uri in shipped or re.search(rf"^\s+{uri}\s+not built$", r.stdout, re.M), r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default action runs the forward on a GPU")
def test_default_action_without_gpu(built, tmp_path):
    cache, first = built
    assert first.returncode == 0
    r = flashinfer_cake(cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU visible to torch: building the variants only" in r.stdout
    assert listed_modules(r.stdout, cache) == listed_modules(first.stdout, cache)
    assert "building" not in r.stderr  # the build of `test_build` is found, not redone


def test_clear_cache(built, tmp_path):
    cache = shutil.copytree(built[0], tmp_path / "cache", symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not in the cache")
    (cache / "link").symlink_to(outside)
    locks = sorted(p.name for p in cache.glob("*.lock"))
    assert locks, "the built cache has lock files"
    entries = len([p for p in cache.iterdir() if p.suffix != ".lock"])
    r = flashinfer_cake("clear-cache", cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"removed {entries} entries from {cache}" in r.stdout
    # Lock files stay (a running build may hold one); everything else is gone.
    assert cache.is_dir() and sorted(p.name for p in cache.iterdir()) == locks
    assert (outside / "keep").is_file()  # a symlink is removed, not followed


def test_console_script(tmp_path):
    exe = shutil.which("flashinfer-cake")
    assert exe, "the flashinfer-cake console script is not on PATH"
    r = flashinfer_cake("--help", cache=tmp_path / "cache", cwd=tmp_path, command=(exe,))
    assert r.returncode == 0, r.stderr
    for word in ("env", "build", "clear-cache"):
        assert re.search(rf"\b{word}\b", r.stdout)
    assert not (tmp_path / "cache").exists()  # --help does no work


@pytest.mark.parametrize("argv, env, message", [
    (["build", "--arch", "8.0"], {}, "--arch: unsupported arch '8.0'"),
    (["env"], {"FLASHINFER_CAKE_CUDA_ARCH_LIST": "8.0"}, "FLASHINFER_CAKE_CUDA_ARCH_LIST: unsupported arch '8.0'"),
    (["build"], {"FLASHINFER_CAKE_NVCC": "/nonexistent/nvcc"}, "FLASHINFER_CAKE_NVCC='/nonexistent/nvcc'"),
    (["build"], {"MAX_JOBS": "zero"}, "MAX_JOBS must be a positive integer"),
], ids=["bad-arch", "bad-arch-list", "no-nvcc", "bad-max-jobs"])
def test_errors_exit_1_with_message(argv, env, message, tmp_path, monkeypatch, capsys):
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashinfer-cake: error: ") and message in err, err
