"""CPU tests of the `flashinfer-cake` command (`python -m flashinfer_cake`).

`build` compiles the six variants and the torch binding once into a module-scoped tmp cache;
`env`, the default action and `clear-cache` (on a copy) reuse it. Cheap error cases call
`cli.main` in-process; the first-hour cases (unusable cache directories, read-only caches,
FLASHINFER_CAKE_DISABLE_JIT) run the command as a user would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashinfer_cake import __version__, cli, jit
from flashinfer_cake.jit import all_variants, build
from flashinfer_cake.jit import env as jit_env
from isolated_env import ISOLATED_VARS, child_env

URIS = [s.uri for s in all_variants(["sm_90a"])] + ["torch_binding"]


def flashinfer_cake(*args: str, cache: Path, cwd: Path, command=(sys.executable, "-m", "flashinfer_cake"),
                    timeout: float = 120, **env) -> subprocess.CompletedProcess:
    e = child_env(FLASHINFER_CAKE_CACHE_DIR=cache, **env)
    return subprocess.run([*command, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def listed_modules(stdout: str, directory: Path) -> dict[str, Path]:
    """uri -> module path of the `<uri>  <path>.so` lines of `build` / `env`."""
    found = re.findall(rf"^\s*(\S+)\s+({re.escape(str(directory))}/\S+\.so)$", stdout, re.M)
    return {uri: Path(path) for uri, path in found}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`flashinfer-cake build` into an empty tmp cache, under FLASHINFER_CAKE_DISABLE_JIT=1 (which
    build ignores: prebuilding is its job, README): (cache, completed process)."""
    root = tmp_path_factory.mktemp("cli")
    cache = root / "cache"
    return cache, flashinfer_cake("build", cache=cache, cwd=root, timeout=900, FLASHINFER_CAKE_DISABLE_JIT="1")


def test_build(built):
    cache, r = built
    assert r.returncode == 0, r.stderr
    modules = listed_modules(r.stdout, cache)
    assert sorted(modules) == sorted(URIS), r.stdout
    for uri, path in modules.items():
        assert path.name.startswith(uri + "_") and build.verified_module(path) == path
    # One progress line per module, not the compilers' output (that stays in the build log).
    progress = re.findall(r"^compiled (\S+) \((\d)/7, \d+\.\d s\)$", r.stdout, re.M)
    assert sorted(uri for uri, _ in progress) == sorted(URIS) and [n for _, n in progress] == list("1234567"), r.stdout
    assert re.search(rf"^built 7 module\(s\) into {re.escape(str(cache))} in \d+\.\d s$", r.stdout, re.M), r.stdout
    # (and, between them, how far the build is: a line a minute at the most)
    heartbeats = re.findall(r"^  compiling: (\d+) of (\d+) steps done \((\d+) s\)$", r.stdout, re.M)
    assert all(int(n) < int(m) for n, m, _ in heartbeats), r.stdout
    assert [int(t) for _, _, t in heartbeats] == sorted(int(t) for _, _, t in heartbeats), r.stdout
    others = [line for line in r.stdout.splitlines() if not line.startswith("  compiling: ")]
    assert "ptxas" not in r.stdout + r.stderr and len(others) <= 20, r.stdout
    log = (cache / "build" / "prebuild" / "build.log").read_text()
    assert len(re.findall(r"^ptxas info\s*: Used \d+ registers", log, re.M)) >= 7, log[-2000:]


def test_build_out_copies_what_the_cache_holds(built, tmp_path):
    """`build --out DIR` takes the JIT cache's verified modules of the same names (same sources, flags and
    compiler) instead of compiling them again (it compiled everything until 2026-12-07: 4.5 minutes on 2 cores).
    (What is not copied, a module whose bytes fail its record or that is gone: test_jit's
    test_a_prebuild_elsewhere_copies_only_what_the_cache_verifies.)"""
    cache, _ = built
    out = tmp_path / "out"
    r = flashinfer_cake("build", "--out", str(out), cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    copied = re.findall(r"^copied (\S+) from the JIT cache \((\S+)\)$", r.stdout, re.M)
    assert sorted(uri for uri, _ in copied) == sorted(URIS) and "compiled" not in r.stdout, r.stdout
    modules = listed_modules(r.stdout, out)
    assert sorted(modules) == sorted(URIS), r.stdout
    for uri, path in modules.items():
        assert build.verified_module(path) == path and path.read_bytes() == (cache / path.name).read_bytes()
        assert build.read_record(path)["compiler"] == build.read_record(cache / path.name)["compiler"]


# The kernels with local memory under nvcc 13.0 (CI's and the H200's), each with its (stack frame, spill stores, spill
# loads) bytes; every other kernel has none. None since dx's streaming stores (f3559a4): the stateful backward's two
# warp-filled kernels with bf16 taps + fp32 bias at the rounded pre-activation had 8-byte frames (8, 4, 4) before.
KNOWN_LOCAL_MEMORY: dict[str, tuple[int, int, int]] = {}


def test_no_kernel_spills_or_uses_a_stack_frame(built):
    """ptxas's report of every kernel of every variant (the prebuild's build.log): no stack frame and no spills, but
    exactly the known ones (KNOWN_LOCAL_MEMORY; an entry that no longer holds fails too, so the list stays true).
    Local memory in these memory-bound loops costs time the GPU runs showed (NOTES_bwd: 4-32 bytes of spills at 128
    registers, 88 -> 104 us at C = 8); a change that brings it fails here, on the CPU, before any GPU run. The list is
    nvcc 13.0's: another release's allocation differs, and only its report is checked."""
    cache, r = built
    assert r.returncode == 0, r.stderr
    releases = {re.search(r"release (\S+),", json.loads(p.read_text())["compiler_version"])[1]
                for p in cache.glob("causal_conv1d_w_*.json")}
    if releases != {"13.0"}:
        pytest.skip(f"the modules were built by nvcc {sorted(releases)}; KNOWN_LOCAL_MEMORY is nvcc 13.0's")
    log = (cache / "build" / "prebuild" / "build.log").read_text()
    reports = {name: tuple(map(int, usage)) for name, *usage in re.findall(
        r"^ptxas info\s*: Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads", log, re.M)}
    kernels = set(re.findall(r"^ptxas info\s*: Compiling entry function '(\S+)'", log, re.M))
    assert kernels and kernels <= set(reports), sorted(kernels - set(reports))[:3]
    wrong = {name: reports[name] for name in kernels if reports[name] != KNOWN_LOCAL_MEMORY.get(name, (0, 0, 0))}
    gone = sorted(set(KNOWN_LOCAL_MEMORY) - kernels)
    assert not wrong and not gone, f"(stack frame, spill stores, spill loads) unlike KNOWN_LOCAL_MEMORY: {wrong}; " \
                                   f"known kernels no longer built: {gone}"


def _other_toolchains_cache(built_cache: Path, cache: Path) -> Path:
    """A copy of ``built_cache`` whose every module is renamed as another compiler's build of the same sources."""
    shutil.copytree(built_cache, cache, symlinks=True)
    for so in cache.glob("*.so"):
        for path in (so, so.with_suffix(".json")):
            path.rename(path.with_stem(path.stem[:-8] + "0" * 8))
    return cache


@pytest.mark.parametrize("state", ["built", "empty", "another-toolchain"])
def test_env(built, tmp_path, state, monkeypatch):
    monkeypatch.delenv("FLASHINFER_CAKE_AOT_DIR", raising=False)  # (the child runs without it: aot_dirs() below)
    cache = {"built": built[0], "empty": tmp_path / "empty-cache",
             "another-toolchain": _other_toolchains_cache(built[0], tmp_path / "other-cache")}[state]
    r = flashinfer_cake("env", cache=cache, cwd=tmp_path, FLASHINFER_CAKE_CUDA_ARCH_LIST="9.0")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^cache dir\s+{re.escape(str(cache))}\s", r.stdout, re.M), r.stdout
    assert re.search(r"^arch list\s+sm_90a\s", r.stdout, re.M), r.stdout
    assert re.search(r"^nvcc\s+/\S*nvcc \(.*\d+\.\d", r.stdout, re.M), r.stdout  # path (version)
    assert re.search(r"^ninja\s+/\S*ninja$", r.stdout, re.M), r.stdout
    # which copy of the package runs (an install, a checkout)
    assert re.search(rf"^flashinfer_cake\s+\S+ \({re.escape(str(jit_env.PACKAGE_DIR))}\)$", r.stdout, re.M), r.stdout
    if not torch.cuda.is_available():
        assert re.search(r"^gpus\s+none", r.stdout, re.M)
    # A module prebuilt into the package's own aot/ (scripts/ci_gpu.sh makes them) is found first.
    shipped = {}
    for directory in jit_env.aot_dirs():
        shipped.update(listed_modules(r.stdout, directory))
    if state == "built":
        assert sorted({**listed_modules(r.stdout, cache), **shipped}) == sorted(URIS), r.stdout
    elif state == "empty":  # a cache that does not exist: env reports it and creates nothing
        assert not cache.exists() and re.search(r"^cache dir .*not created yet", r.stdout, re.M), r.stdout
        for uri in URIS:
            assert uri in shipped or re.search(rf"^\s+{uri}\s+not built$", r.stdout, re.M), r.stdout
    else:  # a first call compiles (a compiler is here): the other build is named, not listed as the one loaded
        assert not listed_modules(r.stdout, cache), r.stdout
        for uri in set(URIS) - set(shipped):
            other = re.escape(str(cache / uri)) + r"_\w+_0{8}\.so"
            assert re.search(rf"^\s+{uri}\s+not built by this toolchain \(a first call builds it; {other} is "
                             rf"another's\)$", r.stdout, re.M), r.stdout


def test_env_names_a_missing_aot_dir(tmp_path):
    """A FLASHINFER_CAKE_AOT_DIR that does not exist is env's error (and the loader's), not silently skipped."""
    missing = tmp_path / "no-such-aot"
    r = flashinfer_cake("env", cache=tmp_path / "cache", cwd=tmp_path, FLASHINFER_CAKE_AOT_DIR=str(missing))
    assert r.returncode == 1, r.stdout
    assert re.search(rf"^aot dirs\s+ERROR: .*FLASHINFER_CAKE_AOT_DIR={re.escape(str(missing))} does not exist",
                     r.stdout, re.M), r.stdout
    assert "FLASHINFER_CAKE_AOT_DIR" in r.stderr and "flashinfer-cake build --out DIR" in r.stderr, r.stderr


def test_env_says_which_wheel_tree_is_taken_and_why_the_others_are_not(monkeypatch, tmp_path):
    """Several trees: the one taken, one that can build but comes after it, one that cannot; with an explicit nvcc
    (even one that does not exist) no tree is taken, and `env` says FLASHINFER_CAKE_NVCC is why."""
    a, b, c = (tmp_path / n / "nvidia" / "cu13" for n in "abc")
    monkeypatch.setattr(jit_env, "pip_toolkits", lambda: [(a, []), (b, []), (c, ["no x: y"])])
    assert cli._wheel_trees(a / "bin" / "nvcc") == (f"{a} (the nvcc above) | {b} (can build; not taken: "
                                                    f"{a / 'bin' / 'nvcc'} comes first in the search order) | "
                                                    f"{c} (cannot build: no x: y; {jit_env.PIP_TOOLKIT_COMMAND} "
                                                    f"installs one release of every part)")
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", "/nonexistent/nvcc")
    assert cli._wheel_trees(None).startswith(f"{a} (can build; not taken: FLASHINFER_CAKE_NVCC comes first")
    monkeypatch.setattr(jit_env, "pip_toolkits", lambda: [])
    assert cli._wheel_trees(None) == "none"


def test_env_counts_a_flashinfer_cake_nvcc_that_is_no_nvcc_as_a_problem(monkeypatch, tmp_path):
    """No nvcc is no problem by itself (prebuilt modules need none), but FLASHINFER_CAKE_NVCC naming no executable
    is every build's error: env says it on the nvcc line and exits 1."""
    monkeypatch.delenv("FLASHINFER_CAKE_NVCC", raising=False)
    monkeypatch.setattr(jit_env, "nvcc_path", lambda: None)
    assert cli._no_nvcc_line() == "not found"
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", "/nonexistent/nvcc")
    with pytest.raises(RuntimeError, match=r"^FLASHINFER_CAKE_NVCC='/nonexistent/nvcc' is not an executable file"):
        cli._no_nvcc_line()
    r = flashinfer_cake("env", cache=tmp_path / "cache", cwd=tmp_path, FLASHINFER_CAKE_NVCC="/nonexistent/nvcc")
    assert r.returncode == 1, r.stdout
    assert re.search(r"^nvcc\s+ERROR: FLASHINFER_CAKE_NVCC='/nonexistent/nvcc' is not an executable", r.stdout, re.M)
    assert "FLASHINFER_CAKE_NVCC='/nonexistent/nvcc'" in r.stderr, r.stderr


def test_a_reader_that_goes_away_is_no_error_message(tmp_path):
    """`flashinfer-cake env | head -1`: the pipe's reader closes it early; the CLI stops without a traceback or an
    error line (exit status 1, as Python's own recipe for a broken pipe has it)."""
    e = child_env(FLASHINFER_CAKE_CACHE_DIR=tmp_path / "cache")
    p = subprocess.Popen([sys.executable, "-m", "flashinfer_cake", "env"], cwd=tmp_path, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before its first line (the CLI imports torch first)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "Broken pipe" not in err and "Traceback" not in err and "flashinfer-cake: error" not in err, err


def test_env_names_nvidia_cuda_wheels_it_cannot_build_with(built, tmp_path):
    """A bare nvidia-cuda-nvcc wheel (no nvvm, crt, runtime or cccl beside it) is passed over for the next nvcc; `env`
    says so on a line of its own, and that is not an error."""
    nvcc = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    r = flashinfer_cake("env", cache=built[0], cwd=tmp_path, PYTHONPATH=os.pathsep.join(
        filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    assert r.returncode == 0, r.stderr
    assert re.search(r"^nvcc\s+/\S*nvcc \(.*\d+\.\d", r.stdout, re.M) and str(nvcc) not in r.stdout.split("cuda wheels")[0]
    line = re.search(r"^cuda wheels\s+(\S+) \(cannot build: (.*)\)$", r.stdout, re.M)
    assert line and line[1] == str(nvcc.parent.parent), r.stdout
    assert all(f"{w} is not installed" in line[2] for w in ("nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl")), line[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default action runs the forward on a GPU")
def test_default_action_without_gpu(built, tmp_path):
    cache, first = built
    assert first.returncode == 0
    r = flashinfer_cake(cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # (a CPU-only torch is told apart from a machine without a GPU: the fix differs)
    why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA GPU"
    assert f"torch {torch.__version__} {why}: building the modules that are not built yet, no forward run" in r.stdout
    assert listed_modules(r.stdout, cache) == listed_modules(first.stdout, cache)
    assert "building" not in r.stderr  # the build of `test_build` is found, not redone


def test_clear_cache(built, tmp_path):
    cache = shutil.copytree(built[0], tmp_path / "cache", symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not in the cache")
    (cache / f"{_mod('link')}.so").symlink_to(outside)  # a link of a build's name
    locks = sorted(p.name for p in cache.glob("*.lock"))
    assert locks, "the built cache has lock files"
    entries = len([p for p in cache.iterdir() if p.suffix != ".lock" and p.name != "build"]) + \
        len(list((cache / "build").iterdir()))  # (build/'s entries are counted one by one)
    r = flashinfer_cake("clear-cache", cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"removed {entries} entries from {cache}\n" in r.stdout, r.stdout  # (nothing left that is not ours)
    # Lock files stay (a running build may hold one); every build's file is gone.
    assert cache.is_dir() and sorted(p.name for p in cache.iterdir()) == locks
    assert (outside / "keep").is_file()  # a symlink is removed, not followed


def _mod(short: str) -> str:
    """A build's file stem (the form JitSpec.module_name gives: uri, source and compiler digests) for a short name."""
    return f"{short}_{'a' * 16}_{'b' * 8}"


def _cache_of(root: Path, *names: str) -> Path:
    """A cache holding, per name, what a build leaves: the module, its record, its lock and its build directory."""
    (root / "build").mkdir(parents=True)
    for name in names:
        for suffix in (".so", ".json", ".lock"):
            (root / f"{name}{suffix}").write_text("")
        (root / "build" / name).mkdir()
        (root / "build" / name / "unit.cu").write_text("")
    (root / "prebuild.lock").write_text("")
    return root


def test_clear_cache_waits_for_a_running_build(tmp_path, monkeypatch, capfd):
    """A build holding its lock (another process) ends before its files go: nothing is removed under it."""
    cache = _cache_of(tmp_path / "cache", _mod("mod_a"), _mod("mod_b"))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    holder = subprocess.Popen([sys.executable, "-c", "import filelock, sys, time\n"
                               "lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True)\n"
                               "time.sleep(1.5); lock.release()", str(cache / f"{_mod('mod_b')}.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert cli.main(["clear-cache"]) == 0
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    assert waited > 1.0, waited
    out, err = capfd.readouterr()
    assert f"waiting for another process to finish building {_mod('mod_b')}" in err, err
    assert f"removed 6 entries from {cache}\n" in out, out
    assert sorted(p.name for p in cache.iterdir()) == [f"{_mod('mod_a')}.lock", f"{_mod('mod_b')}.lock", "prebuild.lock"]


def test_clear_cache_leaves_a_build_that_started_meanwhile(tmp_path, monkeypatch, capsys):
    """A build whose lock appears after clear-cache took its locks keeps its files (they may be being written)."""
    a, late = _mod("mod_a"), _mod("mod_late")
    cache = _cache_of(tmp_path / "cache", a)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    real = cli.hold_lock

    @contextlib.contextmanager
    def hold_then_start_a_build(root, name, what):
        with real(root, name, what):
            if name == a:  # the last lock taken: another process's first call begins its build now
                (cache / f"{late}.lock").write_text("")
                (cache / "build" / late).mkdir()
                for path in (cache / "build" / late / "unit.cu", cache / f"{late}.so", cache / f"{late}.json"):
                    path.write_text("")
            yield

    monkeypatch.setattr(cli, "hold_lock", hold_then_start_a_build)
    assert cli.main(["clear-cache"]) == 0
    out = capsys.readouterr().out
    assert f"removed 3 entries from {cache}; kept 3 of builds that started meanwhile" in out, out
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == [
        "build", f"build/{late}", f"build/{late}/unit.cu", f"{a}.lock", f"{late}.json", f"{late}.lock",
        f"{late}.so", "prebuild.lock"]


@pytest.mark.parametrize("odd", ["a-directory", "a-symlink"])
def test_clear_cache_removes_a_lock_path_that_is_not_a_lock_file(tmp_path, monkeypatch, capsys, odd):
    """A *.lock that is no lock file (a directory, a link) is removed like any entry, not taken (which failed)."""
    cache = _cache_of(tmp_path / "cache", _mod("mod_a"))
    odd_lock = cache / f"{_mod('odd')}.lock"
    if odd == "a-directory":
        odd_lock.mkdir()
    else:
        odd_lock.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["clear-cache"]) == 0
    assert f"removed 4 entries from {cache}\n" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == [f"{_mod('mod_a')}.lock", "prebuild.lock"]


def test_clear_cache_removes_only_this_packages_files(tmp_path, monkeypatch, capsys):
    """A FLASHINFER_CAKE_CACHE_DIR set to a shared directory (~/.cache): clear-cache removes the builds' files (by
    their names' form) and leaves everything else, saying how many."""
    cache = _cache_of(tmp_path / "cache", _mod("mod_a"))
    for foreign in ("pip", "torch"):
        (cache / foreign).mkdir()
        (cache / foreign / "data").write_text("not ours")
    (cache / "notes.txt").write_text("not ours")
    (cache / "build" / "other-tool").mkdir()
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["clear-cache"]) == 0
    assert f"removed 3 entries from {cache}; left 4 that are not flashinfer_cake's\n" in capsys.readouterr().out
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == [
        "build", "build/other-tool", f"{_mod('mod_a')}.lock", "notes.txt", "pip", "pip/data", "prebuild.lock",
        "torch", "torch/data"]


def test_clear_cache_of_a_read_only_cache_says_so(tmp_path, monkeypatch, capsys):
    cache = _cache_of(tmp_path / "cache", _mod("mod_a"))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)

    def refused(root, name, what):
        raise RuntimeError("flashinfer_cake: cannot build in ...") from PermissionError(13, "Permission denied",
                                                                                    str(root / f"{name}.lock"))

    monkeypatch.setattr(cli, "hold_lock", refused)
    assert cli.main(["clear-cache"]) == 1
    err = capsys.readouterr().err
    assert f"cannot clear {cache}: [Errno 13] Permission denied: '{cache / 'prebuild.lock'}'" in err, err
    assert (cache / f"{_mod('mod_a')}.so").exists()  # nothing removed


def test_clear_cache_of_a_missing_directory_creates_nothing(tmp_path):
    cache = tmp_path / "mistyped" / "cache"
    r = flashinfer_cake("clear-cache", cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"nothing to remove: {cache} does not exist" in r.stdout
    assert not (tmp_path / "mistyped").exists()


@pytest.mark.parametrize("argv, message", [
    *((["-j", jobs], "-j/--jobs: must be a positive integer") for jobs in ("0", "-1", "two")),
    (["--arch", "8.0"], "argument --arch: unsupported arch '8.0'; supported: "),
    (["--arch", "sm_90a", "--arch", "sm_80"], "argument --arch: unsupported arch 'sm_80'"),
    (["--weight", "fp16"], "argument --weight: invalid choice: 'fp16'"),
    (["--bias", "bf16", "--bias", "None"], "argument --bias: invalid choice: 'None'"),
])
def test_bad_option_values_are_usage_errors(argv, message, tmp_path):
    r = flashinfer_cake("build", *argv, cache=tmp_path / "cache", cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and r.stderr.startswith("usage: "), (r.returncode, r.stderr)
    assert not (tmp_path / "cache").exists()  # nothing built


@pytest.mark.parametrize("argv, uris", [
    (["--arch", "sm_90a", "--arch", "9.0a"], URIS),  # one arch: its specs once (each would take its lock twice)
    (["--weight", "bf16", "--bias", "none"], ["causal_conv1d_w_bf16_b_none_sm_90a", "torch_binding"]),
    (["--bias", "fp32", "--bias", "none", "--bias", "fp32"],
     [f"causal_conv1d_w_{w}_b_{b}_sm_90a" for w in ("fp32", "bf16") for b in ("fp32", "none")] + ["torch_binding"]),
    (list(jit.variant_spec("bf16", "fp32", "sm_90a").build_options), ["causal_conv1d_w_bf16_b_fp32_sm_90a",
                                                                       "torch_binding"]),
], ids=["arch-twice", "one-variant", "two-biases", "a-variants-advice"])
def test_build_selects_archs_and_variants(argv, uris, tmp_path, monkeypatch, capsys):
    """`build` prebuilds the variants its options select (each once), and always the torch binding (every call's);
    a variant's build_options (the advice of a call that finds it missing) select it alone."""
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    asked = []
    monkeypatch.setattr(cli.jit, "prebuild", lambda specs, out, **k: asked.append([s.uri for s in specs]) or
                        {s: tmp_path / "cache" / f"{s.uri}.so" for s in specs})
    assert cli.main(["build", *argv]) == 0
    assert asked == [uris]
    assert f"the {len(uris)} modules are in {tmp_path / 'cache'}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["env", "build", "clear-cache"])
def test_each_command_has_a_help_page(command, capsys):
    """`flashinfer-cake <command> --help` says what the command does (its description), not only its usage."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: flashinfer-cake {command}")
    description = {"env": cli.ENV_DESCRIPTION, "build": cli.BUILD_DESCRIPTION, "clear-cache": cli.CLEAR_CACHE_DESCRIPTION}
    assert description[command] in out, out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert cli.DESCRIPTION in capsys.readouterr().out


def test_version(capsys):
    """`flashinfer-cake --version` prints the package's version (what `env` prints first), exit status 0."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"flashinfer_cake {__version__}\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_clear_cache_of_a_dir_that_cannot_hold_a_lock_file_is_an_error_not_a_wait(tmp_path):
    """No file can be made in /proc/self: its lock file cannot be opened, which filelock retries for ever (clear-cache
    waited on it; `build` refuses the directory as unwritable before any lock). An error naming it, at once."""
    r = flashinfer_cake("clear-cache", cache=Path("/proc/self"), cwd=tmp_path, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("flashinfer-cake: error: ") and "/proc/self" in r.stderr, r.stderr
    assert "waiting for another process" not in r.stderr, r.stderr


def test_console_script(tmp_path):
    exe = shutil.which("flashinfer-cake")
    assert exe, "the flashinfer-cake console script is not on PATH"
    r = flashinfer_cake("--help", cache=tmp_path / "cache", cwd=tmp_path, command=(exe,))
    assert r.returncode == 0, r.stderr
    for word in ("env", "build", "clear-cache"):
        assert re.search(rf"\b{word}\b", r.stdout)
    assert not (tmp_path / "cache").exists()  # --help does no work


@pytest.mark.parametrize("argv, env, message", [
    (["env"], {"FLASHINFER_CAKE_CUDA_ARCH_LIST": "8.0"}, "FLASHINFER_CAKE_CUDA_ARCH_LIST: unsupported arch '8.0'"),
    (["build"], {"FLASHINFER_CAKE_NVCC": "/nonexistent/nvcc"}, "FLASHINFER_CAKE_NVCC='/nonexistent/nvcc'"),
    *(([command], {"FLASHINFER_CAKE_NVCC": sys.executable}, f"{sys.executable} is not CUDA's nvcc: `"
       f"{Path(sys.executable).name} --version` says 'Python ") for command in ("build", "env")),
    *(([command], {"MAX_JOBS": "zero"}, "MAX_JOBS must be a positive integer") for command in ("build", "env")),
], ids=["bad-arch-list", "no-nvcc", "not-nvcc-build", "not-nvcc-env", "bad-max-jobs-build", "bad-max-jobs-env"])
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


# ------------------------------------------------------------------- the first hour of a new user


def _file(root: Path) -> Path:
    (root / "afile").write_text("")
    return root / "afile"


def _dangling(root: Path) -> Path:
    (root / "link").symlink_to(root / "missing")
    return root / "link"


def _under_a_file(root: Path) -> Path:
    return _file(root) / "cache"


def _shared_sticky(root: Path) -> Path:  # like /tmp: no chmod of ours can make it private
    (root / "shared").mkdir()
    (root / "shared").chmod(0o1777)
    return root / "shared"


def _group_writable(root: Path) -> Path:
    (root / "mine").mkdir()
    (root / "mine").chmod(0o770)
    return root / "mine"


@pytest.mark.parametrize("make, words", [
    (_file, ["exists and is not a directory"]),
    (_dangling, ["is a symbolic link to", "which does not exist"]),
    (_under_a_file, ["cannot create", "Not a directory", "point FLASHINFER_CAKE_CACHE_DIR at a directory you can write"]),
    (_shared_sticky, ["writable by other users", "a directory of your own"]),
    (_group_writable, ["writable by its group", "chmod go-w"]),
], ids=["file", "dangling-symlink", "under-a-file", "shared-sticky-dir", "group-writable"])
def test_unusable_cache_dir_is_one_line_and_env_reports_it(make, words, tmp_path):
    """`build` (the default action without a GPU; with one, prebuilt modules may make the cache
    unnecessary) stops with one line; `env` lists everything and the problem."""
    cache = make(tmp_path)
    r = flashinfer_cake("build", cache=cache, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("flashinfer-cake: error: ")]
    assert len(error) == 1 and str(cache) in error[0] and all(w in error[0] for w in words), r.stderr
    if make is _shared_sticky:
        assert "chmod" not in error[0]  # never a chmod of a shared directory
    r = flashinfer_cake("env", cache=cache, cwd=tmp_path)  # the diagnostic: every line, the problem on its own
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(rf"^cache dir\s+ERROR: .*{re.escape(str(cache))}", r.stdout, re.M), r.stdout
    assert re.search(r"^jit\s+enabled", r.stdout, re.M) and re.search(r"^modules\s+not listed", r.stdout, re.M)
    assert r.stderr.startswith("flashinfer-cake: error: ") and str(cache) in r.stderr, r.stderr


@pytest.mark.parametrize("which, line", [("cache", "cache dir"), ("aot-dir", "aot dirs"), ("package-aot", "aot dirs")])
def test_env_reports_an_unreadable_directory(tmp_path, monkeypatch, capsys, unreadable, which, line):
    """A cache or prebuilt directory this process cannot read is env's problem (exit 1), on its line, with the fix;
    the package's own aot/, which calls skip (they use the JIT, as without one), is a note on its line (exit 0, the
    modules listed)."""
    directory = {"aot-dir": tmp_path / "aot", "cache": tmp_path / "cache", "package-aot": tmp_path / "pkg" / "aot"}[which]
    directory.mkdir(mode=0o700, parents=True)
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", directory if which == "package-aot" else tmp_path / "no-aot")
    if which == "aot-dir":
        monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(directory))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    unreadable(directory)
    package = which == "package-aot"
    assert cli.main(["env"]) == (0 if package else 1)
    out, err = capsys.readouterr()
    fix = {"cache": "700", "aot-dir": r"u\+rx", "package-aot": r"a\+rx"}[which]
    assert re.search(rf"^{line}\s+{'' if package else 'ERROR: '}.*{re.escape(str(directory))}(: it)? is not readable by "
                     rf"this process \(Permission denied.*`chmod {fix} {re.escape(str(directory))}`", out, re.M), out
    if package:
        assert "calls build with the JIT instead" in out and "modules          not listed" not in out, out
    else:
        assert err.count("\n") == 1 and str(directory) in err, err


@pytest.mark.parametrize("owner", ["its owner's", "another user's"])
def test_env_notes_a_package_aot_that_calls_skip(tmp_path, monkeypatch, capsys, owner):
    """A world-writable package aot/ (a broken install: calls skip it and use the JIT, as without one) is a note on
    env's 'aot dirs' line with its fix, not an error: exit 0, the modules listed. The fix is the rule's that failed:
    owned by another user than the package's, a reinstall (a chmod would leave it skipped)."""
    aot = tmp_path / "pkg" / "aot"
    aot.mkdir(parents=True)
    aot.chmod(0o777)
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", aot)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    if owner == "another user's":  # (the tests may run as root, who owns everything here)
        monkeypatch.setattr(jit_env, "_owners", lambda package: {aot.stat().st_uid + 1})
        assert cli.main(["env"]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^aot dirs\s+none  \(.*ignoring {re.escape(str(aot))}: it is owned by uid \d+, .*: reinstall the "
                         rf"package, so that its aot/ is owned as the package is: calls build with the JIT instead\)$",
                         out, re.M), out
        return
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    shown = re.escape(str(aot))
    assert re.search(rf"^aot dirs\s+none  \(FLASHINFER_CAKE_AOT_DIR, the package's aot/; ignoring {shown}: it is writable by "
                     rf"other users \(mode drwxrwxrwx\): its owner can run `chmod o-w {shown}`: calls build with the JIT "
                     rf"instead\)$", out, re.M), out
    assert re.search(r"^\s+torch_binding\s+", out, re.M), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default action runs the forward on a GPU")
def test_read_only_cache(built, tmp_path, monkeypatch, capsys):
    """A fully built cache is only read (no lock taken); a build into one that cannot be written
    is one line saying so. (Root ignores file modes: a lock that cannot be created stands in.)"""
    import filelock

    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr(filelock, "FileLock", unwritable)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(built[0]))
    assert cli.main([]) == 0, capsys.readouterr()
    partial = shutil.copytree(built[0], tmp_path / "partial", symlinks=True)
    next(partial.glob("causal_conv1d_w_bf16_b_none_*.json")).unlink()
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(partial))
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot build" in err and "Permission denied" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default action runs the forward on a GPU")
def test_disable_jit_default_action_builds_nothing(tmp_path):
    r = flashinfer_cake(cache=tmp_path / "cache", cwd=tmp_path, FLASHINFER_CAKE_DISABLE_JIT="1")
    assert r.returncode == 0, r.stderr
    assert "FLASHINFER_CAKE_DISABLE_JIT is set: nothing to run, nothing built" in r.stdout
    assert re.search(r"^jit\s+disabled", r.stdout, re.M) and not list((tmp_path / "cache").glob("*.so"))


@pytest.mark.parametrize("argv, where", [(["build", "--aot"], "package"), (["build", "--out", "DIR"], "elsewhere")])
def test_build_destination(argv, where, tmp_path, monkeypatch, capsys):
    """--aot writes where the installed package looks; any other directory gets the export line."""
    package_aot = tmp_path / "pkg" / "aot"
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", package_aot)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    seen = {}

    def fake_prebuild(specs, out, **kwargs):
        seen["out"] = Path(out)
        return {spec: Path(out) / f"{spec.uri}.so" for spec in specs}

    monkeypatch.setattr(jit, "prebuild", fake_prebuild)
    # the package this process runs is the installed one (whichever way the suite runs: python -m from
    # the checkout imports the checkout's sources)
    monkeypatch.setattr(jit_env, "installed_package_dir", lambda: jit_env.PACKAGE_DIR)
    argv = [str(tmp_path / "dir") if a == "DIR" else a for a in argv]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if where == "package":
        assert seen["out"] == package_aot and "export" not in out
        # Run from a checkout whose sources shadow the installed package: say where it went.
        monkeypatch.setattr(jit_env, "installed_package_dir", lambda: tmp_path / "site-packages" / "flashinfer_cake")
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "not the installed one" in out and f"export FLASHINFER_CAKE_AOT_DIR={package_aot}" in out, out
    else:
        assert f"export FLASHINFER_CAKE_AOT_DIR={tmp_path / 'dir'}" in out
    # A FLASHINFER_CAKE_AOT_DIR that is not a directory: the build stands, and the variable is named.
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(tmp_path / "mistyped"))
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"note: FLASHINFER_CAKE_AOT_DIR={tmp_path / 'mistyped'} does not exist" in out, out
    assert "calls fail until it is fixed" in out, out


def test_a_checkouts_own_metadata_is_not_the_installed_package(tmp_path, monkeypatch):
    """From a checkout's root, `pip install .` has left flashinfer_cake.egg-info there, found first
    on sys.path: installed_package_dir() must not take the checkout for the install (build --aot
    then skipped its "not the installed one" note)."""
    (tmp_path / "flashinfer_cake.egg-info").mkdir()
    (tmp_path / "flashinfer_cake.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: flashinfer_cake\n"
                                                                    "Version: 0.1.0\n")
    (tmp_path / "flashinfer_cake").mkdir()
    (tmp_path / "flashinfer_cake" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # as python -m from the checkout root
    assert jit_env.installed_package_dir() != (tmp_path / "flashinfer_cake").resolve()


def test_aot_build_script_is_build_aot(monkeypatch):
    script = Path(__file__).resolve().parent.parent / "scripts" / "aot_build.py"
    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr(sys, "argv", [str(script), "-j", "3"])
    with pytest.raises(SystemExit) as e:
        exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__"})
    assert e.value.code == 0 and calls == [["build", "--aot", "-j", "3"]]
    for out in (["--out", "/tmp/d"], ["--out=/tmp/d"]):  # an output directory replaces --aot, in either form
        calls.clear()
        monkeypatch.setattr(sys, "argv", [str(script), *out])
        with pytest.raises(SystemExit):
            exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__"})
        assert calls == [["build", *out]], out


def test_aot_build_script_help_says_what_it_is():
    """--help: the script's own use (its default --aot), then the build command's options."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "aot_build.py"
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Prebuild every variant") and "python scripts/aot_build.py" in run.stdout
    assert run.stdout.index("flashinfer-cake build --aot") < run.stdout.index("usage: flashinfer-cake build")


def test_module_state_lists_each_directory_once(tmp_path, monkeypatch):
    """`env`'s line of a module reads each directory once: the AOT directories and the cache are listed a single time
    per module, whatever it finds (here nothing: every question is asked)."""
    aot, cache = tmp_path / "aot", tmp_path / "cache"
    for d in (aot, cache):
        d.mkdir(mode=0o700)
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(aot))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")  # the cache then serves any compiler's build: listed too
    listed, real = [], os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(Path(path)) or real(path))
    assert cli._module_state(all_variants(["sm_90a"])[0]) == "not built"
    assert listed.count(aot) == 1 and listed.count(cache) == 1, listed


def test_env_names_the_compiler_behind_a_launchers_masquerade_link(tmp_path, monkeypatch):
    """`env`'s c++ line: through /usr/lib/ccache/c++ (a link to ccache), the compiler ccache runs, which names the
    binding's build, then the link it builds through."""
    masq, real = tmp_path / "ccache-bin", tmp_path / "bin"
    for d in (masq, real):
        d.mkdir()
    launcher = tmp_path / "ccache"
    launcher.write_text("#!/bin/sh\nexec \"$@\"\n")  # (run as c++ --version it runs `--version`: exit 127)
    (real / "c++").write_text("#!/bin/sh\necho 'c++ (Fake) 14.2.0'\n")
    for exe in (launcher, real / "c++"):
        exe.chmod(0o755)
    (masq / "c++").symlink_to(launcher)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(map(str, [masq, real])))
    line = cli._cxx_line()
    assert line.startswith(f"{real / 'c++'} (") and line.endswith(f", through {masq / 'c++'} (ccache)  (CXX)"), line
    monkeypatch.setenv("PATH", str(real))
    assert cli._cxx_line() == f"{real / 'c++'} (c++ (Fake) 14.2.0)  (CXX)"


def fake_build(directory: Path, uri: str, record: dict, digest: str = "0" * 16) -> Path:
    """A verified artifact of ``uri`` under a source digest no spec of this checkout has (bytes that match their
    record; not a library)."""
    data = b"not a library"
    path = directory / f"{uri}_{digest}_{'0' * 8}.so"
    path.write_bytes(data)
    path.with_suffix(".json").write_text(json.dumps({"uri": uri, **record, "sha256": hashlib.sha256(data).hexdigest()}))
    return path


@pytest.mark.parametrize("recorded", ["another torch", "other build settings", "an older record", "another form",
                                      "other sources"])
def test_a_binding_built_for_another_torch_is_named_as_that(tmp_path, monkeypatch, recorded):
    """A torch binding built for another torch (its digest differs) is named as that, with what differs, in `env` and
    in the error of a call under FLASHINFER_CAKE_DISABLE_JIT (which said 'not prebuilt' as if nothing were there): a
    short value quoted, a long one (torch's build settings) named; a record from before records kept the identity,
    one of another form, or of the same identity (other sources) says so. The latest such build is the one named."""
    from flashinfer_cake.jit import core

    spec = jit.binding_spec()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(core, "_loaded", {})
    identity = list(spec.identity)
    if recorded == "another torch":
        identity[0] = "2.10.0+cu128"
    elif recorded == "other build settings":
        identity[4] = "Build settings: " + "x" * 1500
    record = {"an older record": {}, "another form": {"identity": identity[:3]}}.get(recorded, {"identity": identity})
    older = fake_build(cache, "torch_binding", {"identity": ["an older one"]}, digest="1" * 16)
    os.utime(older.with_suffix(".json"), (1, 1))
    other = fake_build(cache, "torch_binding", record)
    said = {"another torch": f"built for torch 2.10.0+cu128 (this process: {torch.__version__})",
            "other build settings": "built for other torch's build settings",
            "an older record": "built for another torch or other sources (its record, from an older flashinfer_cake, "
                               "does not say which)",
            "another form": f"built for another torch or other sources (its record's identity has 3 entries, this "
                            f"one {len(spec.identity)})",
            "other sources": "built from other sources (another flashinfer_cake's)"}[recorded]
    assert cli._module_state(spec) == f"not built ({other} is {said})"
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    assert cli._module_state(spec) == f"not built ({other} is {said})"
    with pytest.raises(RuntimeError, match="torch_binding is not prebuilt") as e:
        jit.load(spec)
    assert f"; {other} is {said})" in str(e.value), e.value
    assert cli._module_state(all_variants(["sm_90a"])[0]) == "not built"  # another uri's build is not named


def test_build_out_that_cannot_be_created_names_the_fix(tmp_path, monkeypatch, capsys):
    """`build --out DIR` where DIR cannot be created (under a file here; a read-only parent alike): one error naming
    it and where to build instead, nothing compiled."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["build", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot create the output directory {out}: Not a directory" in err, err
    assert err.rstrip().endswith("build into a directory you can write (`flashinfer-cake build --out DIR`, then "
                                 "`export FLASHINFER_CAKE_AOT_DIR=DIR`)"), err


@pytest.mark.parametrize("held", ["every module", "all but the binding"])
def test_build_into_a_directory_it_cannot_write(tmp_path, monkeypatch, capsys, held):
    """`build --out DIR` into a directory this process cannot write (a read-only copy of another machine's prebuild):
    when it holds every module by another compiler (the same sources), that is what calls load from it, and the build
    only reads it (as a fully built read-only cache is only read); else it is refused before anything is compiled,
    naming the directory, that it is not writable and the fix. A first call that would build into such a cache too."""
    from flashinfer_cake.jit import core

    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    (tmp_path / "library.so").write_bytes(b"another compiler's build")
    specs = cli._specs(None)
    held_specs = specs if held == "every module" else [s for s in specs if s.uri != "torch_binding"]
    prebuilt = {s.uri: build.publish(tmp_path / "library.so", out, s.module_prefix() + "0" * 8, {"uri": s.uri})
                for s in held_specs}
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: not (Path(p) == out and mode & os.W_OK) and
                        real_access(p, mode, **k))
    for module in (build, core):  # (the late failure: compiling for minutes, then no publish)
        monkeypatch.setattr(module, "build_specs", lambda *a, **k: pytest.fail("compiled where it cannot publish"))
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit_env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")  # (a GPU round prebuilds into it)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    status = cli.main(["build", "--out", str(out)])
    stdout, err = capsys.readouterr()
    if held == "every module":
        assert status == 0, err
        assert listed_modules(stdout, out) == prebuilt, stdout
        assert f"note: {out} is not writable by this process, so nothing was compiled" in stdout, stdout
        return
    assert status == 1 and err.count("\n") == 1, err
    assert f"cannot build torch_binding in {out}: it is not writable by this process" in err, err
    assert f"`chmod u+w {out}`" in err and "`flashinfer-cake build --out DIR`" in err, err
    assert not (out / "build").exists() and sorted(out.glob("*.lock")) == []  # nothing written
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(out))  # the same directory as a first call's cache
    monkeypatch.setattr(core, "_loaded", {})
    with pytest.raises(RuntimeError, match=rf"cannot build torch_binding in {re.escape(str(out))}: it is not writable"):
        jit.load(jit.binding_spec())
