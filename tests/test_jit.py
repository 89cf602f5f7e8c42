"""CPU tests of the JIT (no GPU needed; a real nvcc builds real modules).

Real compiles are few: the session fixture `concurrent_build` (8 processes, one build) fills the
cache that most tests read or copy (the AOT test copies its module); the killed-build test starts
one compile and kills it. A copy of the built cache carries ninja's build directory, so a
"rebuild" from it (corrupt module, log test) republishes without recompiling. Every cache and AOT
directory is a tmp dir.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from flashinfer_cake import jit
from flashinfer_cake.jit import build, core, env, variant
from isolated_env import ISOLATED_VARS, MAX_JOBS, child_env

SPEC = jit.variant_spec("fp32", "none", "sm_90a")
DTYPES = [(w, b) for w in variant.WEIGHT_DTYPES for b in variant.BIAS_DTYPES]
ALL = jit.all_variants(["sm_90a"])
CXX = {"fp32": "float", "bf16": "__nv_bfloat16", "none": "flashinfer_cake::NoBias"}
ENTRY_POINTS = ("cake_variant", "cake_fwd_arg_names", "cake_bwd_arg_names", "cake_cp_arg_names",
                "cake_last_error_message", "cake_stream_is_capturing", "cake_causal_conv1d_fwd", "cake_causal_conv1d_bwd",
                "cake_causal_conv1d_cp")
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_DEVICE = 101
# Subprocesses ignore a package-shipped aot/ a developer may have built in the checkout.
PREAMBLE = "from flashinfer_cake.jit import env as _e; _e.PACKAGE_AOT_DIR = _e.Path('/nonexistent/aot')\n"
LOAD_SCRIPT = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from flashinfer_cake import jit
m = jit.load(jit.variant_spec("fp32", "none", "sm_90a"))
print(m.path)
print(m.variant)
"""


# ---------------------------------------------------------------------------------------- helpers


def popen_py(code: str, cwd: Path, *args, **env_overrides) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PREAMBLE + textwrap.dedent(code), *map(str, args)],
                            cwd=cwd, env=child_env(**env_overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_py(code: str, cwd: Path, timeout: float = 600, **env_overrides) -> subprocess.CompletedProcess:
    p = popen_py(code, cwd, **env_overrides)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def toolchain() -> str:
    return env.toolchain_digest(env.require_nvcc())


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def published(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("causal_conv1d_w_*") if p.suffix in (".so", ".json"))


def forbid_processes(monkeypatch) -> None:
    def no_process(*a, **k):
        raise AssertionError(f"a process was started: {a!r}")

    for mod, name in [(subprocess, "Popen"), (subprocess, "run"), (os, "system"), (os, "fork"),
                      (os, "posix_spawn"), (os, "posix_spawnp")]:
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, no_process)


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """A fresh tmp cache and an empty in-process memo for every test; no shipped AOT dir."""
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MAX_JOBS", MAX_JOBS)
    monkeypatch.setattr(core, "_loaded", {})
    monkeypatch.setattr(env, "PACKAGE_AOT_DIR", tmp_path / "no-package-aot")


def fresh_spec():
    """SPEC computed anew (its digest is cached on the instance, the templates' per process)."""
    core.templates_digest.cache_clear()
    variant.variant_spec.cache_clear()
    return jit.variant_spec("fp32", "none", "sm_90a")


@pytest.fixture
def fresh_templates_digest():
    fresh_spec()
    yield
    fresh_spec()


@pytest.fixture(scope="session")
def name() -> str:
    """File stem of SPEC's module for the nvcc the tests build with."""
    return SPEC.module_name(toolchain())


@pytest.fixture(scope="session")
def concurrent_build(tmp_path_factory):
    """8 processes call the first load of SPEC at once into an empty cache (the session's build)."""
    root = tmp_path_factory.mktemp("concurrent")
    cache = root / "cache"
    code = textwrap.dedent("""
    import os, sys, time
    root = sys.argv[1]
    from flashinfer_cake import jit  # the slow part (torch): done before the start signal
    open(os.path.join(root, f"ready.{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(root, "go")):
        time.sleep(0.005)
    """) + LOAD_SCRIPT
    procs = [popen_py(code, root, root, FLASHINFER_CAKE_CACHE_DIR=cache) for _ in range(8)]
    try:
        wait_for(lambda: len(list(root.glob("ready.*"))) == 8 or any(p.poll() is not None for p in procs),
                 300, "8 processes to import flashinfer_cake")
        (root / "go").touch()
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return cache, [(p.returncode, out, err) for p, (out, err) in zip(procs, results)]


@pytest.fixture(scope="session")
def built_cache(concurrent_build) -> Path:
    """A JIT cache holding SPEC's module (do not modify: copy it)."""
    cache, results = concurrent_build
    assert all(rc == 0 for rc, _, _ in results), [err for rc, _, err in results if rc]
    return cache


@pytest.fixture(scope="module")
def fresh_import(tmp_path_factory):
    """`import flashinfer_cake` in a fresh process from a neutral cwd, HOME and cache dir."""
    root = tmp_path_factory.mktemp("import")
    (root / "home").mkdir()
    (root / "cwd").mkdir()
    code = """
    import importlib.util, json
    import flashinfer_cake, flashinfer_cake.jit
    print(json.dumps({"jit": repr(importlib.util.find_spec("jit")), "pkg_jit": flashinfer_cake.jit.__file__}))
    """
    r = run_py(code, root / "cwd", timeout=120, FLASHINFER_CAKE_CACHE_DIR=root / "never" / "cache",
               HOME=root / "home")
    assert r.returncode == 0, r.stderr
    return root, json.loads(r.stdout)


# ------------------------------------------------------------------------- names, digests, source


@pytest.mark.parametrize("weight, bias", DTYPES)
def test_variant_naming(weight, bias):
    spec = jit.variant_spec(weight, bias, "sm_90a")
    assert spec.uri == f"causal_conv1d_w_{weight}_b_{bias}_sm_90a" and spec.language == "cuda"
    tc = toolchain()
    module_name = spec.module_name(tc)
    assert re.fullmatch(rf"{spec.uri}_[0-9a-f]{{16}}_{tc[:8]}", module_name)
    assert module_name.startswith(spec.module_prefix())
    assert spec.module_prefix() == f"{spec.uri}_{spec.digest[:16]}_"
    assert spec.module_name("f" * 64) != module_name and spec.module_name("f" * 64).startswith(spec.module_prefix())


@pytest.mark.parametrize("kwargs", [dict(weight="fp16", bias="none", arch="sm_90a"),
                                    dict(weight="fp32", bias="fp16", arch="sm_90a"),
                                    dict(weight="fp32", bias="none", arch="sm_80")], ids=["weight", "bias", "arch"])
def test_invalid_variant_rejected(kwargs):
    bad = next(k for k, v in kwargs.items() if v in ("fp16", "sm_80"))
    with pytest.raises(ValueError, match=bad):
        jit.variant_spec(**kwargs)


def test_digests_stable_and_distinct(tmp_path):
    here = {s.uri: s.module_name(toolchain()) for s in ALL}
    assert len(set(here.values())) == len(ALL) == 6
    assert len({s.digest for s in ALL}) == 6
    code = """
    import json
    from flashinfer_cake.jit import all_variants, env
    tc = env.toolchain_digest(env.require_nvcc())
    print(json.dumps({s.uri: s.module_name(tc) for s in all_variants(["sm_90a"])}))
    """
    r = run_py(code, tmp_path, timeout=120, PYTHONHASHSEED=str(12345 + os.getpid()))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == here


def test_digest_changes_when_a_template_byte_changes(tmp_path, monkeypatch, fresh_templates_digest):
    real, real_prefix = SPEC.digest, SPEC.module_prefix()
    copy = shutil.copytree(env.include_dir(), tmp_path / "include")
    monkeypatch.setattr(env, "include_dir", lambda: copy)
    assert fresh_spec().digest == real  # same bytes elsewhere: same digest
    templates = sorted(p for p in copy.rglob("*") if p.is_file())
    assert templates
    for path in templates:
        data = path.read_bytes()
        changed = bytearray(data)
        changed[len(data) // 2] ^= 1  # one bit of one byte
        path.write_bytes(bytes(changed))
        assert fresh_spec().digest != real, path
        assert fresh_spec().module_prefix() != real_prefix  # a new module name: the old build is not reused
        path.write_bytes(data)
        assert fresh_spec().digest == real
    (copy / "flashinfer_cake" / "new.cuh").write_text("// new\n")
    assert fresh_spec().digest != real


def test_binding_and_variants_share_one_pipeline():
    """Both are JitSpecs: one digest rule (the templates, the source, the flags, the identity)."""
    binding = jit.binding_spec()
    assert isinstance(binding, jit.JitSpec) and binding.language == "c++" and binding.python_extension
    assert torch.__version__ in binding.identity
    assert not SPEC.python_extension and SPEC.identity == ()
    assert dataclasses.replace(SPEC, cflags=SPEC.cflags + ("-DX",)).digest != SPEC.digest
    assert dataclasses.replace(SPEC, units=SPEC.units + ("// another unit",)).digest != SPEC.digest
    assert dataclasses.replace(binding, identity=("other torch", *binding.identity[1:])).digest != binding.digest


@pytest.mark.parametrize("weight, bias", DTYPES)
def test_generated_source(weight, bias):
    spec = jit.variant_spec(weight, bias, "sm_90a")
    src = spec.source
    assert "#include <flashinfer_cake/causal_conv1d_fwd_launcher.cuh>" in src
    assert (env.include_dir() / "flashinfer_cake" / "causal_conv1d_fwd_launcher.cuh").is_file()
    assert re.search(r'#define CAKE_EXPORT extern "C" __attribute__\(\(visibility\("default"\)\)\)', src)
    for fn in ENTRY_POINTS:
        assert re.search(rf"^CAKE_EXPORT (int|const char\*) {fn}\(", src, re.M), fn
    assert f"using WeightT = {CXX[weight]};" in src
    assert f"using BiasT = {CXX[bias]};" in src
    assert f'return "{spec.uri}";' in src
    # Each backward route is instantiated in exactly one unit and only declared in the main one.
    assert len(spec.units) == len(jit.variant.BWD_ROUTE_UNITS)
    for routes, unit in zip(jit.variant.BWD_ROUTE_UNITS, spec.units):
        assert "extern" not in unit
        for route in routes:
            inst = (f"template cudaError_t flashinfer_cake::launch_causal_conv1d_bwd_route<flashinfer_cake::bwd_routes::{route}, "
                    f"{CXX[weight]}, {CXX[bias]}>(flashinfer_cake::CausalConv1dBwdParams, cudaStream_t);")
            assert src.count(f"\nextern {inst}") == 1 and f"\n{inst}" in unit, route
            assert sum(inst in u for u in spec.units) == 1, route
    one = jit.variant_spec(weight, bias, "sm_90a", split=False)
    assert one.units == () and "extern template" not in one.source and one.uri != spec.uri


def test_bwd_routes_are_the_launchers():
    """The generator's route list is the launcher's: a route missing from it would be instantiated
    in the main unit (built serially), one it invents would not compile."""
    header = (env.include_dir() / "flashinfer_cake" / "causal_conv1d_bwd_launcher.cuh").read_text()
    assert tuple(re.findall(r"^using (\w+) = BwdRoute<", header, re.M)) == jit.variant.BWD_ROUTES
    assert len(set(jit.variant.BWD_ROUTES)) == len(jit.variant.BWD_ROUTES)


def test_spec_units_must_be_sources():
    with pytest.raises(TypeError, match="units must be a tuple of source strings"):
        dataclasses.replace(SPEC, units="// one unit")


def test_spec_identity_names_name_every_entry_and_are_not_its_identity():
    """identity_names label identity's entries for messages (core.built_for): one per entry, and not part of the
    spec's equality or digest (a prebuilt module's name does not change with them)."""
    with pytest.raises(ValueError, match="identity_names must name each of the 2 identity entries, got 1 names"):
        dataclasses.replace(SPEC, identity=("a", "b"), identity_names=("A",))
    named = dataclasses.replace(SPEC, identity=("a", "b"), identity_names=("A", "B"))
    unnamed = dataclasses.replace(SPEC, identity=("a", "b"))
    assert named == unnamed and named.digest == unnamed.digest


def test_nvcc_flags():
    flags = SPEC.cflags
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert not [f for f in flags if "fast_math" in f or "fast-math" in f]
    assert "-cudart=static" in flags


def test_build_used_generated_source_and_flags(built_cache, name):
    build_dir = built_cache / "build" / name
    assert (build_dir / f"{name}.cu").read_text() == SPEC.source
    ninja = (build_dir / "build.ninja").read_text()
    for k, unit in enumerate(SPEC.units):  # compiled on their own, linked into the one library
        assert (build_dir / f"{name}.unit{k}.cu").read_text() == unit
        assert f"build {name}.unit{k}.cu.o: compile {name}.unit{k}.cu" in ninja
    assert re.search(rf"^build {name}\.so: link {name}\.cu\.o( {name}\.unit\d\.cu\.o){{{len(SPEC.units)}}}$", ninja, re.M)
    # the same flags on every edge: each unit's compile, the main one's and the link
    assert ninja.count(f"  cflags = {' '.join(SPEC.cflags)} -I{env.include_dir()}\n") == len(SPEC.units) + 2
    assert "-gencode=arch=compute_90a,code=sm_90a" in ninja and "fast_math" not in ninja


def test_main_unit_compiles_no_backward_route(built_cache, name):
    """The routes are compiled in their units only: the main unit's object references them."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on this machine")
    build_dir = built_cache / "build" / name
    symbols = lambda obj: subprocess.run([nm, "-C", str(build_dir / obj)], capture_output=True, text=True,  # noqa: E731
                                         check=True).stdout.splitlines()
    main = symbols(f"{name}.cu.o")
    assert len([s for s in main if " U " in s and "launch_causal_conv1d_bwd_route<" in s]) == len(jit.variant.BWD_ROUTES)
    assert not [s for s in main if "causal_conv1d_bwd_kernel<" in s]
    for k in range(len(SPEC.units)):
        assert [s for s in symbols(f"{name}.unit{k}.cu.o") if "causal_conv1d_bwd_kernel<" in s], k


# ---------------------------------------------------------------------------------- env surface


@pytest.mark.parametrize("value", [None, "3", "1", "16"])
def test_max_jobs(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("MAX_JOBS")
    else:
        monkeypatch.setenv("MAX_JOBS", value)
    assert env.max_jobs() == (int(value) if value else max(1, os.cpu_count() or 1))


@pytest.mark.parametrize("value", ["0", "-2", "two", "2.5", " ", "\u00b2"])
def test_max_jobs_invalid(monkeypatch, value):
    monkeypatch.setenv("MAX_JOBS", value)
    with pytest.raises(RuntimeError, match=f"^MAX_JOBS must be a positive integer \\(or unset: every core\\), got {value!r}$"):
        env.max_jobs()


@pytest.mark.parametrize("value, disabled", [(None, False), ("", False), ("0", False), ("false", False), (" Off ", False),
                                             ("no", False), ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_disable_jit_reads_the_usual_words(monkeypatch, value, disabled):
    """FLASHINFER_CAKE_DISABLE_JIT=false leaves the JIT on (it disabled it: any value but empty and 0 did)."""
    if value is None:
        monkeypatch.delenv("FLASHINFER_CAKE_DISABLE_JIT", raising=False)
    else:
        monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", value)
    assert env.jit_disabled() is disabled


@pytest.mark.parametrize("value", ["00", "2", "disable", "y"])
def test_disable_jit_refuses_another_value(monkeypatch, value, capsys):
    """Any other value is an error naming the variable, the accepted words and the value, from a call and in `env`'s
    line (whose other lines still print)."""
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", value)
    expected = (f"FLASHINFER_CAKE_DISABLE_JIT must be 1, true, yes or on (calls never compile) or 0, false, no, off "
                f"or empty (they build what is missing), got {value!r}")
    with pytest.raises(RuntimeError) as e:
        env.jit_disabled()
    assert str(e.value) == expected
    with pytest.raises(RuntimeError, match="FLASHINFER_CAKE_DISABLE_JIT must be"):
        jit.load(SPEC)
    from flashinfer_cake import cli
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["env"]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^jit\s+ERROR: {re.escape(expected)}$", out, re.M), out
    assert re.search(r"^modules\s+not listed \(see the errors above\)$", out, re.M), out


@pytest.mark.parametrize("value", [None, "", "9.0a", "9.0", "sm_90a", "sm_90", "90a", "9.0a, 9.0;sm_90a"])
def test_arch_list_accepted(monkeypatch, value):
    """Unset or empty (as every variable takes empty) is the default, 9.0a."""
    if value is not None:
        monkeypatch.setenv("FLASHINFER_CAKE_CUDA_ARCH_LIST", value)
    assert env.arch_list() == ["sm_90a"]


@pytest.mark.parametrize("value", ["8.0", "9.0a 8.0", "sm_80", "10.0", " ,; "])
def test_arch_list_rejected(monkeypatch, value):
    monkeypatch.setenv("FLASHINFER_CAKE_CUDA_ARCH_LIST", value)
    with pytest.raises(ValueError, match="FLASHINFER_CAKE_CUDA_ARCH_LIST"):
        env.arch_list()


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_cache_dir_created_0700(monkeypatch, tmp_path, umask):
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(root))
    old = os.umask(umask)
    try:
        assert env.cache_dir() == root
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def make_cuda_wheels(site: Path, versions: dict | None = None, missing: tuple[str, ...] = ()) -> Path:
    """A site directory holding what NVIDIA's CUDA 13 wheels install (nvidia/cu13 with an executable nvcc, and the
    wheels' metadata at ``versions``), less the ``missing`` parts; its tree."""
    top = site / "nvidia" / "cu13"
    for part, _ in env.PIP_TOOLKIT_PARTS:
        if part not in missing:
            (top / part).parent.mkdir(parents=True, exist_ok=True)
            (top / part).write_text("#!/bin/sh\n")
            (top / part).chmod(0o755)
    for name, version in (versions or {}).items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return top


def fake_nvcc(directory: Path) -> Path:
    (directory / "bin").mkdir(parents=True)
    nvcc = directory / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return nvcc


ONE_RELEASE = {"nvidia-cuda-nvcc": "13.0.88", "nvidia-nvvm": "13.0.88", "nvidia-cuda-crt": "13.0.88",
               "nvidia-cuda-runtime": "13.0.96"}


@pytest.fixture
def only_test_nvcc(monkeypatch, tmp_path):
    """No nvcc but what a test puts in place: no explicit choice, CUDA_HOME / CUDA_PATH unset, an empty PATH
    (fake_nvcc(tmp_path / "path") fills it), no /usr/local/cuda, and an import path without NVIDIA's wheels (a
    machine with the cu13 extra installed has them); returns a function putting a site directory first on it."""
    for var in ("FLASHINFER_CAKE_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "path" / "bin"))
    monkeypatch.setattr(env, "SYSTEM_NVCC", str(tmp_path / "no-system-cuda" / "nvcc"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (isinstance(p, str) and any(
        os.path.isfile(os.path.join(p, "nvidia", tree, "bin", "nvcc")) for tree in env.PIP_TOOLKIT_TREES))])
    return lambda site: monkeypatch.setattr(sys, "path", [str(site), *sys.path])


def test_nvidia_cuda_wheels_are_found_after_cuda_home_and_before_path(only_test_nvcc, tmp_path, monkeypatch):
    """The cu13 extra on a machine without the CUDA toolkit: the JIT builds with the wheels' nvcc. An explicit
    FLASHINFER_CAKE_NVCC or CUDA_HOME still wins; an nvcc on PATH does not."""
    top = make_cuda_wheels(tmp_path / "site", ONE_RELEASE)
    only_test_nvcc(tmp_path / "site")
    assert env.pip_toolkits() == [(top, [])]
    assert env.require_nvcc() == top / "bin" / "nvcc"
    fake_nvcc(tmp_path / "path")
    assert env.nvcc_path() == top / "bin" / "nvcc"
    cuda_home = fake_nvcc(tmp_path / "cuda_home")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda_home"))
    assert env.nvcc_path() == cuda_home
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(tmp_path / "path" / "bin" / "nvcc"))
    assert env.nvcc_path() == tmp_path / "path" / "bin" / "nvcc"


def test_import_path_entries_are_read_when_absolute_strings_once_per_tree(only_test_nvcc, tmp_path, monkeypatch):
    """A tree is listed once however its site directory is spelled (a trailing slash, a link: venvs with lib64 ->
    lib); relative entries (the working directory) and entries that are not strings are passed over, never an
    error; with CUDA_HOME's nvcc there, the import path is not read at all."""
    top = make_cuda_wheels(tmp_path / "site", ONE_RELEASE)
    (tmp_path / "link").symlink_to(tmp_path / "site")
    monkeypatch.chdir(tmp_path / "site")
    monkeypatch.setattr(sys, "path", [b"/bytes", 3, "", ".", "site", str(tmp_path / "site") + "/", str(tmp_path / "link"),
                                      *sys.path])
    assert env.pip_toolkits() == [(Path(str(tmp_path / "site") + "/") / "nvidia" / "cu13", [])]
    assert env.nvcc_path().resolve() == (top / "bin" / "nvcc").resolve()
    cuda_home = fake_nvcc(tmp_path / "cuda_home")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda_home"))
    monkeypatch.setattr(env, "_pip_toolkit_trees", lambda: pytest.fail("read the import path past CUDA_HOME's nvcc"))
    assert env.nvcc_path() == cuda_home


def test_the_cu13_extra_is_the_requirement_the_messages_and_the_readme_name():
    """pyproject.toml's cu13 extra, env.PIP_TOOLKIT_REQUIREMENT (the errors' and `env`'s fix) and the README's command:
    one requirement."""
    root = Path(__file__).resolve().parent.parent
    extra = re.search(r'^cu13 = \["([^"]+)"\]$', (root / "pyproject.toml").read_text(), re.M)
    assert extra and extra[1] == env.PIP_TOOLKIT_REQUIREMENT, extra
    assert f'pip install "{env.PIP_TOOLKIT_REQUIREMENT}"' in (root / "README.md").read_text()


@pytest.mark.parametrize("case", ["nvvm of another release", "no cccl", "runtime in another site directory"])
def test_nvidia_cuda_wheels_that_cannot_build_are_passed_over_and_named(only_test_nvcc, tmp_path, case):
    """A tree that would fail mid-build is not chosen: nvvm and crt of another release than nvcc (pip's choice for a
    pinned nvidia-cuda-nvcc==13.0.88 beside torch 2.11: ptxas then refuses cicc's PTX), a wheel missing, or one
    installed into another site directory (a venv over system site-packages: nvcc reads its own tree only). The next
    nvcc builds; with none, the error names the tree, what is wrong and the requirement that installs one release."""
    versions = dict(ONE_RELEASE)
    missing = ()
    if case == "nvvm of another release":
        versions.update({"nvidia-nvvm": "13.5.37", "nvidia-cuda-crt": "13.5.37"})
    elif case == "no cccl":
        missing = ("include/cccl/nv/target",)
    else:  # (the runtime's metadata with its files, in the other site directory)
        missing = ("include/cuda_runtime.h", "lib/libcudart_static.a")
        del versions["nvidia-cuda-runtime"]
        make_cuda_wheels(tmp_path / "system-site", {"nvidia-cuda-runtime": "13.0.96"}, missing=tuple(
            part for part, wheel in env.PIP_TOOLKIT_PARTS if wheel != "nvidia-cuda-runtime"))  # the runtime alone
        only_test_nvcc(tmp_path / "system-site")
    top = make_cuda_wheels(tmp_path / "site", versions, missing)
    only_test_nvcc(tmp_path / "site")
    [(found, problems)] = [(t, p) for t, p in env.pip_toolkits() if t == top]
    assert len(problems) == 1, problems
    with pytest.raises(RuntimeError) as e:
        env.require_nvcc()
    message = str(e.value)
    assert f"NVIDIA's CUDA wheels at {top} cannot build" in message and env.PIP_TOOLKIT_REQUIREMENT in message, message
    want = {"nvvm of another release": "nvidia-cuda-nvcc 13.0.88, nvidia-nvvm 13.5.37, nvidia-cuda-crt 13.5.37 are "
                                       "of different releases",
            "no cccl": f"no {top / 'include/cccl/nv/target'}: nvidia-cuda-cccl is not installed",
            "runtime in another site directory": f"no {top / 'include/cuda_runtime.h'}: nvidia-cuda-runtime is installed "
                                                 f"into {tmp_path / 'system-site'}, not beside nvcc in {tmp_path / 'site'} "
                                                 f"(`pip install --ignore-installed nvidia-cuda-runtime` puts it there)"}[case]
    assert want in message, message
    on_path = fake_nvcc(tmp_path / "path")
    assert env.require_nvcc() == on_path


def test_the_link_finds_the_static_runtime_of_nvidia_cuda_wheels(tmp_path):
    """The wheels' nvcc.profile links from <tree>/lib64, the static runtime is in <tree>/lib ("cannot find
    -lcudart_static" before): the CUDA link edges add it, also through a wrapper script of the wheels' nvcc, not
    the C++ ones; other toolkits get nothing."""
    top = make_cuda_wheels(tmp_path / "site")
    nvcc = top / "bin" / "nvcc"
    assert env.toolkit_link_flags(nvcc) == (f"-L{top / 'lib'}",)
    wrapper = tmp_path / "wrapper" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    assert env.toolkit_link_flags(wrapper) == (f"-L{top / 'lib'}",)
    cxx = core.JitSpec(uri="cxx", source="", language="c++", ldflags=("-lm",))
    ninja = build._ninja_file([build.BuildItem(SPEC, "m", nvcc), build.BuildItem(cxx, "b", Path("/usr/bin/c++"))])
    assert [line for line in ninja.splitlines() if line.startswith("  ldflags")] == [
        f"  ldflags = {' '.join(SPEC.ldflags)} -L{top / 'lib'}", "  ldflags = -lm"]
    other = fake_nvcc(tmp_path / "prefix")  # e.g. a conda prefix: bin/nvcc beside lib/
    (tmp_path / "prefix" / "lib").mkdir()
    (tmp_path / "prefix" / "lib" / "libcudart_static.a").write_text("")
    assert env.toolkit_link_flags(other) == ()


@pytest.mark.parametrize("part", ["nvvm/bin/cicc", "include/crt/host_config.h", "include/cccl/nv/target"])
def test_an_updated_wheel_changes_the_module_name(tmp_path, part):
    """NVIDIA's wheels update cicc (nvidia-nvvm), crt and CCCL apart from nvcc: the compiler digest, part of a
    module's name, reads them, so an update never loads a module built before it."""
    top = make_cuda_wheels(tmp_path / "site")
    nvcc = top / "bin" / "nvcc"
    before = env.toolchain_digest(nvcc)
    os.utime(top / part, ns=(0, (top / part).stat().st_mtime_ns + 10**9))
    env._toolchain_digest.cache_clear()  # the next process (one process reads a toolkit's identity once)
    assert env.toolchain_digest(nvcc) != before


def test_compiler_flags_in_the_environment_change_the_module_name(tmp_path, monkeypatch):
    """nvcc reads NVCC_APPEND_FLAGS (and gcc CPATH, ...) as more flags: a module built under them is
    another build, never loaded once they are unset; with none set the name is the compiler's alone."""
    nvcc = make_cuda_wheels(tmp_path / "site") / "bin" / "nvcc"
    for name in env.COMPILER_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = env.toolchain_digest(nvcc)
    seen = {plain}
    for name in env.COMPILER_ENV:
        monkeypatch.setenv(name, "-G")
        seen.add(env.toolchain_digest(nvcc))
        monkeypatch.setenv(name, "")  # set but empty: as unset
        assert env.toolchain_digest(nvcc) == plain
        monkeypatch.delenv(name)
    assert len(seen) == 1 + len(env.COMPILER_ENV)


def test_an_extension_that_cannot_be_opened_is_a_runtime_error(tmp_path):
    """A prebuilt binding that cannot be opened (another platform's, a missing library) is the
    RuntimeError the loader skips (to the cache or JIT), not an ImportError that stops the call."""
    from flashinfer_cake.jit.binding import binding_spec

    path = tmp_path / "binding.so"
    path.write_bytes(b"not an ELF file")
    with pytest.raises(RuntimeError, match="cannot load"):
        core.open_artifact(binding_spec(), path)


def _no_ninja_distribution(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_ninja_package_that_does_not_import_is_the_install_hint(monkeypatch):
    """Without ninja on PATH and with a ninja package that does not import and no ninja distribution (e.g.
    --no-deps): the one-line hint, not an ImportError's traceback."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "ninja", None)  # import ninja raises ImportError
    monkeypatch.setattr(importlib.metadata, "files", _no_ninja_distribution)
    with pytest.raises(RuntimeError, match="ninja not found: `pip install ninja`"):
        env.ninja_path()


def test_ninja_of_a_venv_over_the_install_is_found_by_its_record(monkeypatch, tmp_path):
    """A venv made with --system-site-packages over the install that holds the ninja package: no ninja on PATH and
    an empty ninja.BIN_DIR (the venv's own scripts directory holds none), so the binary is where the distribution's
    record puts it; never a file named ninja in the working directory (what an empty BIN_DIR joined to "ninja"
    names)."""
    binary = tmp_path / "prefix" / "bin" / "ninja"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (tmp_path / "cwd").mkdir()
    decoy = tmp_path / "cwd" / "ninja"
    decoy.write_text("#!/bin/sh\n")
    decoy.chmod(0o755)
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    fake = type(sys)("ninja")
    fake.BIN_DIR, fake.__file__ = "", str(tmp_path / "site" / "ninja" / "__init__.py")
    monkeypatch.setitem(sys.modules, "ninja", fake)

    class Record(type(Path())):  # a distribution file: a relative path that locates to the binary
        def locate(self):
            return binary
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [Record("../../../bin/ninja"), Record("ninja/__init__.py")])
    assert env.ninja_path() == str(binary)
    monkeypatch.setattr(importlib.metadata, "files", _no_ninja_distribution)
    with pytest.raises(RuntimeError, match="ninja not found"):
        env.ninja_path()


def test_env_names_a_missing_ninja_and_goes_on(monkeypatch, capsys):
    """`env` names a missing ninja on its line and how to get it, but as no nvcc it is no problem by itself
    (prebuilt modules need none): it is not the error `env` exits with."""
    from flashinfer_cake import cli

    def missing():
        raise RuntimeError("ninja not found: `pip install ninja` (a dependency of flashinfer_cake)")
    monkeypatch.setattr(env, "ninja_path", missing)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    cli.main(["env"])
    captured = capsys.readouterr()
    assert re.search(r"^ninja\s+not found \(a build needs it: `pip install ninja`\)$", captured.out, re.M), captured.out
    assert "ninja" not in captured.err


def test_no_top_level_jit_module(fresh_import):
    _, result = fresh_import
    checkout = Path(__file__).resolve().parent.parent
    if result["jit"] != "None" and any(p and Path(p).resolve() == checkout
                                       for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        pytest.skip("PYTHONPATH holds the checkout root, so its jit/ imports as a top-level module: the path's "
                    "doing, not the install's")
    assert result["jit"] == "None"
    assert Path(result["pkg_jit"]).name == "__init__.py"
    # the installed distribution's files (a checkout's leftover egg-info, found first when the suite
    # runs from the checkout root, names no installer and lists the sources)
    files = [f for d in importlib.metadata.distributions(name="flashinfer_cake") if d.read_text("INSTALLER")
             for f in d.files or []]
    assert not [f for f in files if f.parts[0] in ("jit", "jit.py")]


def test_the_sdist_carries_the_test_suite_and_its_scripts(tmp_path):
    """The source distribution (setuptools' sdist of the checkout's tracked files) holds every tracked
    tests/*.py (conftest.py and the helpers too) and scripts/*.py / *.sh the tests run, so the README's
    test command works from it; not the outputs of runs beside them."""
    root = Path(__file__).resolve().parent.parent
    try:  # the build-system's requirement (pyproject.toml), which this process's setuptools must meet
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        setuptools_major = 0
    if setuptools_major < 77:
        pytest.skip("building the sdist here needs setuptools >= 77 (pyproject.toml's build-system)")
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = listed.stdout.split()
    src = tmp_path / "src"
    for name in tracked:
        if (root / name).is_file():  # (a tracked link: flashinfer_cake/jit, copied as a link)
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, src / name, follow_symlinks=False)
    for output in ("scripts/tune.json", "scripts/probe/r1.sh", "tests/__pycache__/conftest.cpython-312.pyc"):
        (src / output).parent.mkdir(parents=True, exist_ok=True)
        (src / output).write_text("")  # a run's outputs beside the sources
    r = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                        f"print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import tarfile
    with tarfile.open(tmp_path / "dist" / r.stdout.split()[-1]) as tar:
        shipped = {"/".join(n.split("/")[1:]) for n in tar.getnames()}
    want = {n for n in tracked if re.fullmatch(r"tests/[^/]+\.py|scripts/[^/]+\.(py|sh)", n)}
    assert "tests/conftest.py" in want and not want - shipped, sorted(want - shipped)
    assert not [n for n in shipped if "tune.json" in n or "probe" in n or "__pycache__" in n]


def test_the_checkout_root_imports_its_own_package(tmp_path):
    """`python -c 'import flashinfer_cake'` (and the README's example) in the checkout's root, where
    the checkout's sources shadow an installed copy (CI: after `pip install .`): they import,
    jit and cli included."""
    root = Path(__file__).resolve().parent.parent
    code = """
    import flashinfer_cake, flashinfer_cake.jit, flashinfer_cake.cli
    print(flashinfer_cake.__file__)
    """
    r = run_py(code, root, timeout=120, FLASHINFER_CAKE_CACHE_DIR=tmp_path / "cache", HOME=tmp_path)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve().parent == root / "flashinfer_cake", r.stdout


def test_import_creates_no_directories(fresh_import):
    root, _ = fresh_import
    assert not (root / "never").exists()
    assert not (root / "home" / ".cache" / "flashinfer_cake").exists()
    assert list((root / "cwd").iterdir()) == []


# ----------------------------------------------------------------------------- real builds, load


def test_built_module_entries(built_cache, name, monkeypatch):
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(built_cache))
    m = jit.load(SPEC)
    assert m.path == built_cache / f"{name}.so"
    assert m.variant == SPEC.uri
    raw = ctypes.CDLL(str(m.path))  # the plain C ABI, without KernelModule's declarations
    for fn in ENTRY_POINTS:
        assert hasattr(raw, fn), fn
    aligned = 1 << 20  # a fake but 16-byte aligned "device pointer": never dereferenced below

    def fwd(**at):
        args = dict(x=aligned, y=aligned, weight=aligned, bias=aligned, cu_seqlens=aligned, workspace=aligned,
                    initial_states=0, final_states=0, S=64, C=8, x_row_stride=8, y_row_stride=8, num_docs=1, device=0,
                    stream=0)
        return m.causal_conv1d_fwd(**{**args, **at})

    assert fwd(C=7) == CUDA_ERROR_INVALID_VALUE
    assert "C must be a positive multiple of 8 below 2^28, got 7" in m.last_error_message()
    assert fwd(x=0) == CUDA_ERROR_INVALID_VALUE
    assert "x: expected a non-null 16-byte aligned pointer" in m.last_error_message()
    assert fwd(S=0) == 0 and m.last_error_message() == ""  # S == 0: nothing to do
    assert fwd(device=2**32) == CUDA_ERROR_INVALID_DEVICE  # no truncation to device 0
    assert fwd(S=2**31) == CUDA_ERROR_INVALID_VALUE and "S must be in [0, 2^31)" in m.last_error_message()
    with pytest.raises(TypeError, match="takes exactly the fields"):
        m.causal_conv1d_fwd(x=aligned)  # a missing field is never passed as 0
    if not torch.cuda.is_available():  # valid-looking args, no GPU: a CUDA error code, no crash
        assert fwd() != 0 and m.last_error_message()

    def bwd(**at):
        args = dict(x=aligned, dy=aligned, dx=aligned, weight=aligned, bias=aligned, cu_seqlens=aligned,
                    initial_states=0, dfinal_states=0, dinitial_states=0, frag_info=0, workspace=aligned,
                    workspace_bytes=1 << 20, dweight=aligned, dbias=aligned, S=128, C=8,
                    x_row_stride=8, dy_row_stride=8, dx_row_stride=8, num_docs=1, item_tokens=64, round_preact=1,
                    device=0, stream=0)
        return m.causal_conv1d_bwd(**{**args, **at})

    for kwargs, message in [
        ({"S": 2**30}, "S must be in [0, 2^30) for the backward"),
        ({"C": 12}, "C must be a positive multiple of 8"),
        ({"item_tokens": 96}, "item_tokens must be a positive multiple of 64"),
        ({"item_tokens": 1088}, "item_tokens must be a positive multiple of 64 (or, at C > 32 from 256 tokens on, of 16) up to 1024, got 1088"),
        ({"item_tokens": 272}, "got 272"),  # a multiple of 16 at C = 8 (whole strips there)
        ({"round_preact": 2**32 + 1}, "round_preact must be 0 or 1"),
        ({"workspace_bytes": 5 * 8 * 4 * 2 - 4}, "workspace: expected at least 320 bytes"),  # 2 groups' rows
        ({"workspace": aligned + 4}, "workspace: expected a non-null 16-byte aligned pointer"),  # 16-byte loads
        ({"dy": aligned + 8}, "dy: expected a non-null 16-byte aligned pointer"),
        ({"cu_seqlens": aligned + 2}, "cu_seqlens: expected a non-null 4-byte aligned pointer"),
        ({"initial_states": aligned}, "dinitial_states: expected exactly when initial_states is given"),
        # frag_info (the context-parallel backward's): only with initial_states, without dfinal_states
        ({"frag_info": aligned}, "frag_info: expected a 4-byte aligned pointer, only with initial_states"),
        ({"frag_info": aligned, "initial_states": aligned, "dinitial_states": aligned, "dfinal_states": aligned},
         "frag_info: expected"),
        ({"frag_info": aligned + 2, "initial_states": aligned, "dinitial_states": aligned}, "frag_info: expected"),
    ]:
        assert bwd(**kwargs) == CUDA_ERROR_INVALID_VALUE, kwargs
        assert message in m.last_error_message(), (kwargs, m.last_error_message())
    assert bwd(device=2**32) == CUDA_ERROR_INVALID_DEVICE

    # the context-parallel passes: C within their grids (kCpMaxC), S and C checked before anything else
    cp_fields = m.cp_args._fields_
    cp = lambda **at: m.causal_conv1d_cp(**{**{name: 0 for name, _ in cp_fields}, "S": 16, **at})  # noqa: E731
    assert cp(C=2**25) == CUDA_ERROR_INVALID_VALUE
    assert "C must be below 2^25 for the context-parallel passes, got 33554432" in m.last_error_message()
    assert cp(C=2**25 - 8) == CUDA_ERROR_INVALID_VALUE and "below 2^25" not in m.last_error_message()


def test_warm_load_starts_no_process(built_cache, name, monkeypatch):
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(built_cache))
    before = sorted(p.name for p in built_cache.rglob("*"))
    forbid_processes(monkeypatch)
    m = jit.load(SPEC)
    assert m.path == built_cache / f"{name}.so" and m.variant == SPEC.uri
    assert jit.load(SPEC) is m  # memoized in-process
    assert sorted(p.name for p in built_cache.rglob("*")) == before


def test_concurrent_first_load_compiles_once(concurrent_build, name):
    cache, results = concurrent_build
    assert [rc for rc, _, _ in results] == [0] * 8, [err[-3000:] for rc, _, err in results if rc]
    assert {out for _, out, _ in results} == {f"{cache / name}.so\n{SPEC.uri}\n"}
    stderr = "".join(err for _, _, err in results)
    assert len(re.findall(rf"^flashinfer_cake: building {name} \(first use; ", stderr, re.M)) == 1, stderr
    assert len(re.findall(rf"^flashinfer_cake: built {name} in ", stderr, re.M)) == 1, stderr
    # The others say why they wait (the build takes seconds): one line each at most.
    waiting = re.findall(r"^flashinfer_cake: waiting for another process to finish building causal_conv1d_w_fp32_b_none_"
                         r"sm_90a \(lock .*\.lock\)$", stderr, re.M)
    assert 1 <= len(waiting) <= 7, stderr
    ninja_log = (cache / "build" / name / ".ninja_log").read_text()
    assert len(re.findall(rf"\t{name}\.so\t", ninja_log)) == 1, ninja_log  # linked once: one build
    assert build.verified_module(cache / f"{name}.so")


def test_build_logs_at_info_and_cleans_stale_temporaries(built_cache, name, tmp_path, monkeypatch, caplog):
    cache = copy_cache(built_cache, tmp_path / "cache")  # with ninja's build dir: republish only
    (cache / f"{name}.so").unlink()
    (cache / f"{name}.json").unlink()
    stale = [cache / f".{name}.k1ll3d.so", cache / f".{name}.k1ll3d.json"]  # a publish killed midway
    for path in stale:
        path.write_bytes(b"half")
    other = cache / ".causal_conv1d_w_bf16_b_none_sm_90a_0123.x.so"  # another module's: not this lock's
    other.write_bytes(b"")
    caplog.set_level(logging.INFO, logger="flashinfer_cake.jit")
    assert jit.load(SPEC).path == cache / f"{name}.so"
    assert not any(p.exists() for p in stale) and other.exists()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos[0] == f"flashinfer_cake: building {name} (first use; later calls and processes load it from {cache})"
    assert infos[1] == f"flashinfer_cake: compiling with {env.require_nvcc()} ({build.compiler_version(env.require_nvcc())})"
    assert re.fullmatch(rf"flashinfer_cake: built {name} in \d+\.\d s", infos[2]) and len(infos) == 3, infos
    caplog.clear()
    monkeypatch.setattr(core, "_loaded", {})
    jit.load(SPEC)  # warm: no log line
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


def test_first_build_notice_shows_under_warning_logging(built_cache, name, tmp_path, capsys):
    """An application that set up logging at WARNING still sees the one line of a first build
    (it takes seconds), on stderr."""
    cache = copy_cache(built_cache, tmp_path / "cache")
    (cache / f"{name}.json").unlink()  # republish: a "build" from ninja's directory
    root = logging.getLogger()
    handler, level = logging.StreamHandler(), root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        os.environ["FLASHINFER_CAKE_CACHE_DIR"] = str(cache)
        jit.load(SPEC)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert f"flashinfer_cake: building {name} (first use; " in capsys.readouterr().err


def test_prebuilt_everything_needs_no_compiler(built_cache, name, tmp_path, monkeypatch):
    """`flashinfer-cake build` on a directory that holds every module works without nvcc (and a
    cache this process cannot write serves any compiler's build)."""
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(tmp_path / "no-nvcc"))
    forbid_processes(monkeypatch)
    assert jit.prebuild([SPEC], built_cache) == {SPEC: built_cache / f"{name}.so"}
    with pytest.raises(RuntimeError, match="FLASHINFER_CAKE_NVCC"):
        jit.prebuild([jit.variant_spec("bf16", "none", "sm_90a")], built_cache)
    monkeypatch.delenv("FLASHINFER_CAKE_NVCC")
    cache = copy_cache(built_cache, tmp_path / "cache")
    other = SPEC.module_prefix() + "0" * 8  # another compiler's build of the same sources
    for ext in (".so", ".json"):
        (cache / f"{name}{ext}").rename(cache / f"{other}{ext}")
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.W_OK and os.path.exists(path))
    assert jit.load(SPEC).path == cache / f"{other}.so"


def test_killed_build_leaves_nothing_loadable(tmp_path, name, caplog):
    cache = tmp_path / "cache"
    build_dir = cache / "build" / name
    p = popen_py(LOAD_SCRIPT, tmp_path, FLASHINFER_CAKE_CACHE_DIR=cache)
    try:
        wait_for(lambda: (build_dir / "build.ninja").exists() or p.poll() is not None, 300, "the build to start")
        time.sleep(1.0)  # ninja and nvcc are running
        assert p.poll() is None, p.communicate()
        os.kill(p.pid, signal.SIGKILL)  # the Python process only, mid-build
        time.sleep(0.5)
        assert not (build_dir / "build.log").exists(), "the build finished before the kill"
        assert published(cache) == []
        assert build.find_published(cache, SPEC.module_prefix()) is None
    finally:
        # End the killed process's orphaned ninja/nvcc (its own process group; p is not reaped yet).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    assert p.returncode == -signal.SIGKILL
    caplog.set_level(logging.INFO, logger="flashinfer_cake.jit")
    m = jit.load(SPEC)  # a later call builds and works
    assert any(m.startswith(f"flashinfer_cake: building {name} ") for m in caplog.messages)
    assert m.path == cache / f"{name}.so" and m.variant == SPEC.uri
    assert build.verified_module(m.path)


def _truncate(so: Path, record: Path):
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])


def _flip_byte(so: Path, record: Path):
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))


def _drop_record(so: Path, record: Path):  # as if killed between publishing the .so and its record
    record.unlink()


@pytest.mark.parametrize("corrupt", [_truncate, _flip_byte, _drop_record], ids=["truncated", "bytes-differ", "no-record"])
def test_corrupt_cached_module_is_rebuilt(built_cache, name, tmp_path, corrupt):
    cache = copy_cache(built_cache, tmp_path / "cache")
    so, record = cache / f"{name}.so", cache / f"{name}.json"
    corrupt(so, record)
    assert build.verified_module(so) is None
    r = run_py(LOAD_SCRIPT, tmp_path, FLASHINFER_CAKE_CACHE_DIR=cache)
    assert r.returncode == 0, r.stderr  # a crash (e.g. -11) if the corrupt file had been loaded
    assert r.stdout == f"{so}\n{SPEC.uri}\n"
    assert f"flashinfer_cake: building {name}" in r.stderr
    if corrupt is not _drop_record:
        assert "ignoring corrupt module" in r.stderr
    assert build.verified_module(so) == so


PIP_TOOLKIT = os.environ.get("FLASHINFER_CAKE_TEST_PIP_TOOLKIT")  # .ci/run: the cu13 extra, `pip install --target`


@pytest.mark.skipif(not PIP_TOOLKIT, reason="FLASHINFER_CAKE_TEST_PIP_TOOLKIT names no `pip install --target` of "
                                            "pyproject.toml's cu13 extra (.ci/run makes one)")
def test_the_cu13_extra_builds_and_loads_a_variant_without_a_toolkit(tmp_path):
    """What pyproject.toml's cu13 extra installs (.ci/run: at CI's release), alone
    on the import path of a process in which no other nvcc comes before it (no FLASHINFER_CAKE_NVCC, CUDA_HOME or
    PATH entry), builds a whole variant (every translation unit, the static CUDA runtime linked), which loads and
    names itself."""
    [nvcc_version] = [d.version for d in importlib.metadata.distributions(name="nvidia-cuda-nvcc", path=[PIP_TOOLKIT])]
    code = """
    import json, sys
    from flashinfer_cake import jit
    from flashinfer_cake.jit import env
    from flashinfer_cake.jit.module import KernelModule
    assert [problems for top, problems in env.pip_toolkits()] == [[]], env.pip_toolkits()
    assert env.nvcc_path().is_relative_to(sys.argv[1]), env.nvcc_path()
    [path] = jit.prebuild([jit.variant_spec("fp32", "none", "sm_90a")], sys.argv[2]).values()
    print(json.dumps({"record": json.loads(path.with_suffix(".json").read_text()), "variant": KernelModule(path).variant}))
    """
    child = {k: v for k, v in child_env().items() if k not in ("FLASHINFER_CAKE_NVCC", "CUDA_HOME", "CUDA_PATH")}
    child.update(PYTHONPATH=os.pathsep.join(filter(None, [PIP_TOOLKIT, os.environ.get("PYTHONPATH")])),
                 PATH="/usr/bin:/bin", FLASHINFER_CAKE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-c", PREAMBLE + textwrap.dedent(code), PIP_TOOLKIT, str(tmp_path / "aot")],
                         cwd=tmp_path, env=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result["record"]["compiler"].startswith(PIP_TOOLKIT), result
    assert f"V{nvcc_version}" in result["record"]["compiler_version"], result
    assert result["variant"] == SPEC.uri


# --------------------------------------------------------------------------- loader order, AOT


def test_aot_dir_used_before_cache(built_cache, name, tmp_path, monkeypatch):
    aot = tmp_path / "aot"
    old = os.umask(0o002)  # a common user umask: the AOT dir made by prebuild must still be accepted
    try:
        env.output_dir(aot)  # how prebuild makes its output directory
    finally:
        os.umask(old)
    # The module as a prebuild publishes it (copied, not compiled again: test_cli's `build` compiles
    # every module for real into an empty directory, and CI has 2 cores).
    for suffix in (".so", ".json"):
        shutil.copy2(built_cache / f"{name}{suffix}", aot / f"{name}{suffix}")
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(aot))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(built_cache))
    forbid_processes(monkeypatch)
    built = jit.prebuild([SPEC], aot)  # already there: no build
    assert built == {SPEC: aot / f"{name}.so"} and build.verified_module(aot / f"{name}.so")
    assert jit.published(SPEC) == [aot / f"{name}.so", built_cache / f"{name}.so"]
    m = jit.load(SPEC)
    assert m.path == aot / f"{name}.so" and m.variant == SPEC.uri
    # The AOT module serves a process that may not compile, with an empty cache.
    monkeypatch.setattr(core, "_loaded", {})
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    assert jit.load(SPEC).path == aot / f"{name}.so"


def test_disable_jit_accepts_another_compilers_build(built_cache, name, tmp_path, monkeypatch):
    """With JIT disabled nothing is compiled, so a cached build by another nvcc is used; with a compiler, the first
    call compiles, and located() (what `flashinfer-cake env` reports) says so."""
    cache = copy_cache(built_cache, tmp_path / "cache")
    other = SPEC.module_prefix() + "0" * 8  # the same sources, another compiler's digest
    for ext in (".so", ".json"):
        (cache / f"{name}{ext}").rename(cache / f"{other}{ext}")
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    assert jit.located(SPEC) is None and jit.published(SPEC) == [cache / f"{other}.so"]
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    forbid_processes(monkeypatch)
    assert jit.located(SPEC) == cache / f"{other}.so"
    assert jit.load(SPEC).path == cache / f"{other}.so"


def test_several_compilers_builds_this_compilers_first_else_the_last_published(built_cache, name, tmp_path,
                                                                               monkeypatch):
    """A directory holding several compilers' builds of one spec (e.g. an AOT directory built again after a toolkit
    update) serves this compiler's build, else the one whose record was written last, whatever the digests'
    alphabetical order."""
    aot = copy_cache(built_cache, tmp_path / "aot")
    older, newer = (SPEC.module_prefix() + c * 8 for c in "0f")  # "0..." sorts first: the order must not decide
    now = time.time()
    for stem, age in ((older, 200), (newer, 100), (name, 300)):
        if stem != name:
            for ext in (".so", ".json"):
                shutil.copy2(aot / f"{name}{ext}", aot / f"{stem}{ext}")
        os.utime(aot / f"{stem}.json", (now - age, now - age))
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(aot))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "cache"))
    forbid_processes(monkeypatch)
    assert jit.located(SPEC) == aot / f"{name}.so"  # this compiler's, though written first
    assert build.find_published(aot, SPEC.module_prefix()) == aot / f"{newer}.so"  # no preference: the last
    for ext in (".so", ".json"):
        (aot / f"{name}{ext}").unlink()
    assert jit.located(SPEC) == aot / f"{newer}.so"
    (aot / f"{newer}.so").write_bytes(b"truncated")  # no longer matches its record: skipped
    assert jit.located(SPEC) == aot / f"{older}.so"
    # The JIT cache's fallback (nothing may be compiled) takes the same rule.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(aot))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    assert jit.located(SPEC) == aot / f"{older}.so"
    for ext in (".so", ".json"):
        shutil.copy(built_cache / f"{name}{ext}", aot / f"{name}{ext}")
    os.utime(aot / f"{name}.json", (0, 0))  # written first of all, still this compiler's
    assert jit.located(SPEC) == aot / f"{name}.so"


@pytest.mark.parametrize("kind", ["missing", "a-file", "relative"])
def test_aot_dir_that_is_not_a_directory_is_an_error(built_cache, tmp_path, monkeypatch, kind):
    """A mistyped FLASHINFER_CAKE_AOT_DIR is named (a relative one with the path it reached), not skipped for a
    cached build or a silent JIT build."""
    aot = tmp_path / "aot"
    if kind == "a-file":
        aot.write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", "aot" if kind == "relative" else str(aot))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(built_cache))  # holds the module: it would have loaded
    forbid_processes(monkeypatch)
    state = "is not a directory" if kind == "a-file" else "does not exist"
    shown = f"aot ({aot})" if kind == "relative" else aot
    for call in (jit.load, jit.located):
        with pytest.raises(RuntimeError, match=re.escape(f"FLASHINFER_CAKE_AOT_DIR={shown} {state}")) as e:
            call(SPEC)
        assert "flashinfer-cake build --out DIR" in str(e.value) and "unset it" in str(e.value)
    assert core._loaded == {}


@pytest.mark.parametrize("mode, accepted", [(0o775, True), (0o777, False)])
def test_shipped_aot_dir_may_be_group_writable(built_cache, name, tmp_path, monkeypatch, caplog, mode,
                                               accepted):
    """pip creates the package's own aot/ group-writable under umask 002: as trusted as the Python
    files beside it. A world-writable one is skipped with a warning (never loaded from)."""
    shipped = tmp_path / "pkg" / "aot"
    shipped.mkdir(parents=True)
    for ext in (".so", ".json"):
        shutil.copy2(built_cache / f"{name}{ext}", shipped)
    shipped.chmod(mode)
    monkeypatch.setattr(env, "PACKAGE_AOT_DIR", shipped)
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    forbid_processes(monkeypatch)
    monkeypatch.setattr(ctypes, "CDLL", ctypes.CDLL if accepted else (lambda *a, **k: pytest.fail(f"loaded {a}")))
    if accepted:
        assert jit.load(SPEC).path == shipped / f"{name}.so"
    else:
        with pytest.raises(RuntimeError, match="not prebuilt"):
            jit.load(SPEC)
        assert any("ignoring" in r.getMessage() and str(shipped) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("nvcc", ["found", "missing"])
def test_disable_jit_miss_is_a_clear_error(tmp_path, monkeypatch, nvcc):
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    if nvcc == "missing":
        monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(tmp_path / "no-nvcc"))
    forbid_processes(monkeypatch)
    with pytest.raises(RuntimeError) as e:
        jit.load(SPEC)
    msg = str(e.value)
    build = "flashinfer-cake build --weight fp32 --bias none --arch sm_90a"  # (SPEC's variant alone)
    for words in (SPEC.uri, "FLASHINFER_CAKE_DISABLE_JIT", f"`{build}` (into the JIT cache)",
                  f"`{build} --aot` (into the installed package)"):
        assert words in msg, msg
    assert published(tmp_path / "cache") == []


def test_disable_jit_miss_with_a_cache_path_that_cannot_be_made_gives_the_prebuild_advice(tmp_path, monkeypatch):
    """FLASHINFER_CAKE_DISABLE_JIT reads the cache only: one that does not exist (here under a file, so it never
    could) holds nothing; the error is the prebuild advice, not the path's, and nothing is created."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    forbid_processes(monkeypatch)
    with pytest.raises(RuntimeError, match=rf"{SPEC.uri} is not prebuilt .*FLASHINFER_CAKE_DISABLE_JIT is set"):
        jit.load(SPEC)


@pytest.mark.parametrize("which", ["aot-dir", "cache", "package-aot"])
def test_an_unreadable_directory_is_named_with_its_fix(tmp_path, monkeypatch, caplog, unreadable, which):
    """A prebuilt directory or a cache this process cannot read (chmod 000, a PermissionError on listing) is not
    passed over as if it held nothing: the error a call ends with names it and the fix; the package's own aot/ (a
    broken install, skipped as before) is one warning per process, and named in the not-prebuilt error."""
    directory = {"aot-dir": tmp_path / "aot", "cache": tmp_path / "cache", "package-aot": tmp_path / "pkg" / "aot"}[which]
    directory.mkdir(mode=0o700, parents=True)
    if which == "aot-dir":
        monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(directory))
    if which == "package-aot":
        monkeypatch.setattr(env, "PACKAGE_AOT_DIR", directory)
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    unreadable(directory)
    forbid_processes(monkeypatch)
    for _ in range(2):  # two first calls (the memo emptied): one warning
        monkeypatch.setattr(core, "_loaded", {})
        with pytest.raises(RuntimeError) as e:
            jit.load(SPEC)
        message = str(e.value)
        assert re.search(rf"{re.escape(str(directory))}(: it)? is not readable by this process \(Permission denied",
                         message), message
        mode = {"cache": "700", "aot-dir": "u+rx", "package-aot": "a+rx"}[which]
        assert f"`chmod {mode} {directory}`" in message, message
    warned = [r.getMessage() for r in caplog.records if str(directory) in r.getMessage()]
    assert len(warned) == (which == "package-aot"), warned


def _world_writable_cache(cache, aot):
    cache.chmod(0o777)
    return cache


def _group_writable_cache(cache, aot):
    cache.chmod(0o770)
    return cache


def _cache_of_other_user(cache, aot):
    if os.getuid() != 0:
        pytest.skip("needs root to chown")
    os.chown(cache, 4242, 4242)
    return cache


def _aot_of_other_user(cache, aot):  # prebuilt modules another user (a service account) built and owns
    if os.getuid() != 0:
        pytest.skip("needs root to chown")
    aot.mkdir()
    for f in cache.glob("causal_conv1d_w_*"):
        shutil.copy2(f, aot)
    os.chown(aot, 4242, 4242)
    return aot


def _world_writable_aot(cache, aot):
    aot.mkdir()
    for f in cache.glob("causal_conv1d_w_*"):
        shutil.copy2(f, aot)
    aot.chmod(0o777)
    return aot


def _shared_sticky_cache(cache, aot):  # like /tmp
    cache.chmod(0o1777)
    return cache


@pytest.mark.parametrize("unsafe, reason, fix", [
    (_world_writable_cache, "writable by other users (mode drwxrwxrwx)", "chmod go-w"),
    (_group_writable_cache, "writable by its group (mode drwxrwx---)", "chmod go-w"),
    (_cache_of_other_user, "owned by uid 4242, not by you", "a directory of your own"),
    (_shared_sticky_cache, "writable by other users (mode drwxrwxrwt)", "a directory of your own"),
    (_world_writable_aot, "writable by other users (mode drwxrwxrwx)", "chmod go-w"),
    (_aot_of_other_user, "owned by uid 4242, not by you", "copy its modules into a directory of your own (`cp -a`"),
], ids=["cache-0777", "cache-0770", "cache-other-uid", "cache-1777", "aot-0777", "aot-other-uid"])
def test_unsafe_directory_refused(built_cache, tmp_path, monkeypatch, unsafe, reason, fix):
    """Refused, saying which check failed and only a fix that is safe for that directory."""
    cache = copy_cache(built_cache, tmp_path / "cache")  # holds a valid module
    bad = unsafe(cache, tmp_path / "aot")
    if (tmp_path / "aot").exists():
        monkeypatch.setenv("FLASHINFER_CAKE_AOT_DIR", str(tmp_path / "aot"))
    forbid_processes(monkeypatch)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail(f"loaded code: {a}"))
    with pytest.raises(RuntimeError, match="refusing to load code from it") as e:
        jit.load(SPEC)
    message = str(e.value)
    assert f"{bad} is {reason}" in message and fix in message, message
    assert ("chmod" in message) == (fix == "chmod go-w"), message  # never a chmod that cannot help
    assert "or owned by uid" not in message  # the old message named a uid whatever the failed check
    assert core._loaded == {}


# ------------------------------------------------------------------------- bad toolchains, errors


@pytest.mark.parametrize("value, compiler", [("ccache g++", "g++"), ("sccache /usr/bin/c++", "/usr/bin/c++"),
                                             ("g++ -m64", "g++")])
def test_cxx_is_one_compiler_a_launcher_in_it_is_refused_saying_what_cxx_takes(monkeypatch, tmp_path, value, compiler):
    """CXX names one executable, as torch.utils.cpp_extension (2.13) takes it: a launcher (ccache) or flags in it are
    refused naming CXX, the value, the accepted form and the compiler to name; a path with a space is one."""
    monkeypatch.setenv("CXX", value)
    with pytest.raises(RuntimeError) as e:
        env.cxx_path()
    message = str(e.value)
    assert f"CXX={value!r} is" in message and "one C++ compiler executable" in message, message
    assert f"CXX={compiler}" in message and "torch.utils.cpp_extension" in message, message
    spaced = tmp_path / "my tools" / "g++"
    spaced.parent.mkdir()
    spaced.write_text("#!/bin/sh\n")
    spaced.chmod(0o755)
    monkeypatch.setenv("CXX", str(spaced))
    assert env.cxx_path() == spaced


def test_cxx_that_is_not_a_compiler_says_to_fix_or_unset_it(monkeypatch, tmp_path):
    """CXX naming nothing says to set it to the compiler or unset it (it said "install g++ or set CXX" to a user who
    had both); spaces around a name are not part of it; no compiler at all says to install one."""
    cc = tmp_path / "bin" / "c++"
    cc.parent.mkdir()
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    monkeypatch.setenv("PATH", str(cc.parent))
    monkeypatch.setenv("CXX", "nosuchcc")
    with pytest.raises(RuntimeError) as e:
        env.cxx_path()
    assert str(e.value) == ("CXX='nosuchcc' is not an executable (a name on PATH or a path): set it to the C++ compiler "
                            "of the torch binding, or unset it (c++ or g++ on PATH).")
    monkeypatch.setenv("CXX", "  c++ ")
    assert env.cxx_path() == cc
    monkeypatch.setenv("CXX", " ")
    assert env.cxx_path() == cc  # (blank: unset)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match=r"^No C\+\+ compiler found \(c\+\+ or g\+\+ on PATH\)\..*install g\+\+"):
        env.cxx_path()


@pytest.mark.parametrize("how", ["path", "cxx"])
def test_a_launchers_masquerade_link_builds_with_the_identity_of_the_compiler_it_runs(monkeypatch, tmp_path, how):
    """/usr/lib/ccache first on PATH makes c++ a link to ccache: the binding builds through it (ccache kept), and its
    build's identity (toolchain_digest) is the c++ ccache runs, the next one on PATH that is not a launcher, so
    upgrading the compiler rebuilds the binding. With no compiler behind the link (or CXX naming the launcher
    itself) the error names the link, the launcher and the fix; without CXX, g++ on PATH serves then."""
    masq, masq2, real, other = (tmp_path / d for d in ("ccache-bin", "sccache-bin", "bin", "other"))
    for d in (masq, masq2, real, other):
        d.mkdir()
    launcher = tmp_path / "ccache"
    for exe in (launcher, real / "c++", other / "g++"):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    (masq / "c++").symlink_to(launcher)
    (masq2 / "c++").symlink_to(launcher)  # a second masquerade link ahead of the compiler: skipped too
    monkeypatch.delenv("CXX", raising=False)
    if how == "cxx":
        monkeypatch.setenv("CXX", str(masq / "c++"))
    monkeypatch.setenv("PATH", os.pathsep.join(map(str, [masq, masq2, masq, real])))
    assert env.cxx_path() == masq / "c++"  # the build runs through the launcher
    assert env.compiler_behind(masq / "c++") == real / "c++"
    before = env.toolchain_digest(env.cxx_path())
    assert before == env.toolchain_digest(real / "c++")
    (real / "c++").write_text("#!/bin/sh\n# an upgraded compiler\n")
    assert env.toolchain_digest(env.cxx_path()) != before  # (the launcher's own binary did not change)
    monkeypatch.setenv("PATH", os.pathsep.join(map(str, [masq, masq2])))
    with pytest.raises(RuntimeError) as e:
        env.cxx_path()
    message = str(e.value)
    shown = f"CXX={str(masq / 'c++')!r}" if how == "cxx" else "c++ on PATH"
    assert f"{shown} is {masq / 'c++'}, a link to the compiler launcher ccache" in message, message
    assert "set CXX to the compiler itself" in message, message
    monkeypatch.setenv("PATH", os.pathsep.join(map(str, [masq, other])))
    if how == "path":
        assert env.cxx_path() == other / "g++"
    else:
        monkeypatch.setenv("CXX", str(launcher))
        with pytest.raises(RuntimeError, match=f"is {re.escape(str(launcher))}, the compiler launcher ccache itself"):
            env.cxx_path()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_lock_file_that_cannot_be_opened_is_an_error_not_a_wait(tmp_path):
    """filelock retries a lock file it cannot open for ever (a directory like /proc/self, where even root makes no
    file): hold_lock says it cannot build there (in a process of its own: the old wait must fail, not hang)."""
    r = run_py("from pathlib import Path\nfrom flashinfer_cake.jit import build\n"
               "with build.hold_lock(Path('/proc/self'), 'x', 'x'):\n    pass\n", tmp_path, timeout=60)
    assert r.returncode == 1 and "RuntimeError: flashinfer_cake: cannot build in /proc/self: No such file or directory " \
                                 "(/proc/self/x.lock)" in r.stderr, r.stderr


def test_the_lock_files_check_leaves_no_file(tmp_path):
    """The check after filelock's first 0.5 s (hold_lock; its wait for a held lock: test_concurrent_first_load_compiles_once) passes
    a lock file that is there, and one that is not without leaving one behind: filelock without flock (some NFS,
    Lustre and FUSE mounts) reads an empty lock file as held, for ever."""
    build._check_lock_file(tmp_path / "free.lock")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "held.lock").write_text("")
    build._check_lock_file(tmp_path / "held.lock")
    assert [p.name for p in tmp_path.iterdir()] == ["held.lock"]


@pytest.mark.parametrize("script, says", [
    ("echo 'gcc (Ubuntu 13.2.0-23ubuntu4) 13.2.0'",
     "{nvcc} is not CUDA's nvcc: `nvcc --version` says 'gcc (Ubuntu 13.2.0-23ubuntu4) 13.2.0', with no 'release X.Y'"),
    ("echo 'nvcc: error while loading shared libraries: libnvvm.so.4: cannot open shared object file' >&2\nexit 127",
     "{nvcc} does not run as nvcc (`nvcc --version` exited 127: nvcc: error while loading shared libraries: "
     "libnvvm.so.4: cannot open shared object file)"),
    ("", "{nvcc} does not run as nvcc (`nvcc --version` printed nothing)"),
], ids=["gcc", "broken", "silent"])
def test_a_program_that_is_not_a_working_nvcc_is_refused_before_the_build(script, says, tmp_path, monkeypatch):
    """FLASHINFER_CAKE_NVCC=/usr/bin/gcc (or any program whose --version names no CUDA release), or an nvcc that does
    not run, would fail mid-build: refused first, saying what it printed."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(f"#!/bin/sh\n{script}\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(nvcc))
    with pytest.raises(RuntimeError, match=re.escape(says.format(nvcc=nvcc))):
        jit.load(SPEC)
    assert published(tmp_path / "cache") == []


@pytest.mark.parametrize("kind", ["missing", "not-executable"])
def test_no_nvcc(tmp_path, monkeypatch, kind):
    nvcc = tmp_path / "nvcc"
    if kind == "not-executable":
        nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(nvcc))
    with pytest.raises(RuntimeError, match="FLASHINFER_CAKE_NVCC") as e:
        jit.load(SPEC)
    assert str(nvcc) in str(e.value)
    with pytest.raises(RuntimeError, match="FLASHINFER_CAKE_NVCC"):
        jit.prebuild([SPEC], tmp_path / "aot")


def test_nvcc_that_cannot_target_the_arch(tmp_path, monkeypatch):
    fatal = "nvcc fatal   : Unsupported gpu architecture 'compute_90a'"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'Cuda compilation tools, release 13.0, V13.0.88' "
                    f"&& exit 0\necho \"{fatal}\" >&2\nexit 1\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(nvcc))
    with pytest.raises(RuntimeError, match=re.escape(fatal)) as e:
        jit.load(SPEC)
    assert SPEC.uri in str(e.value)
    assert published(tmp_path / "cache") == []


def test_an_old_nvcc_of_cuda_home_names_the_wheels_that_can_build(only_test_nvcc, tmp_path, monkeypatch):
    """A cluster's CUDA 12.4 module sets CUDA_HOME, which comes before NVIDIA's wheels: the refusal names the wheels'
    nvcc to set, not the wheels to install."""
    old = fake_nvcc(tmp_path / "cuda-12.4")
    old.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-12.4"))
    top = make_cuda_wheels(tmp_path / "site", ONE_RELEASE)
    only_test_nvcc(tmp_path / "site")
    with pytest.raises(RuntimeError) as e:
        jit.load(SPEC)
    assert f"{old} is CUDA 12.4" in str(e.value) and f"set FLASHINFER_CAKE_NVCC={top / 'bin' / 'nvcc'}" in str(e.value)


def test_a_failed_build_names_another_compilers_cached_build(built_cache, name, tmp_path, monkeypatch):
    """A cluster's CUDA 12.4 nvcc cannot build the kernels; the cache holds a build by another nvcc (a shared cache):
    the refusal says FLASHINFER_CAKE_DISABLE_JIT=1 loads it, which it then does."""
    cache = copy_cache(built_cache, tmp_path / "cache")
    other = SPEC.module_prefix() + "0" * 8  # the same sources, another compiler's digest
    for ext in (".so", ".json"):
        (cache / f"{name}{ext}").rename(cache / f"{other}{ext}")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(nvcc))
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    with pytest.raises(RuntimeError) as e:
        jit.load(SPEC)
    assert f"{nvcc} is CUDA 12.4" in str(e.value), str(e.value)
    version = json.loads((cache / f"{other}.json").read_text())["compiler_version"]
    assert f"the cache holds another compiler's build of {SPEC.uri} ({cache / other}.so, by {version}); " \
           f"FLASHINFER_CAKE_DISABLE_JIT=1 loads it instead of building" in str(e.value), str(e.value)
    monkeypatch.setenv("FLASHINFER_CAKE_DISABLE_JIT", "1")
    assert jit.load(SPEC).path == cache / f"{other}.so"


@pytest.mark.parametrize("release, refused", [("12.4", True), ("12.8", False), ("13.0", False)])
def test_an_nvcc_older_than_the_kernels_need_is_named_before_the_build(only_test_nvcc, tmp_path, monkeypatch, release,
                                                                       refused):
    """An nvcc before 12.8 (a cluster's CUDA 12.4 module) is refused with its version and the fixes, before ninja
    runs it on flags it does not know; 12.8 and later go on to the build (this fake one then fails in it)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'Cuda compilation tools, release {release}, "
                    f"V{release}.1' && exit 0\necho 'nvcc fatal   : fake' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHINFER_CAKE_NVCC", str(nvcc))
    with pytest.raises(RuntimeError) as e:
        jit.load(SPEC)
    message = str(e.value)
    build_dir = tmp_path / "cache" / "build" / SPEC.module_name(env.toolchain_digest(nvcc))
    if refused:  # nothing written: no sources, no ninja file
        assert f"{nvcc} is CUDA {release} (Cuda compilation tools, release {release}" in message, message
        assert "need nvcc 12.8 or newer" in message and env.PIP_TOOLKIT_REQUIREMENT in message, message
        assert not build_dir.exists()
    else:
        assert "nvcc fatal   : fake" in message and "or newer" not in message, message
        assert (build_dir / "build.log").exists()
    assert published(tmp_path / "cache") == []


def test_a_python_without_its_headers_is_named_before_the_binding_builds(tmp_path):
    """The torch binding includes Python.h; a distribution's python3 without its -dev package gets that said,
    with the package to install, before any compiler runs."""
    from flashinfer_cake.jit.binding import binding_spec

    spec = binding_spec()
    no_headers = dataclasses.replace(spec, include_dirs=(spec.include_dirs[0], str(tmp_path / "include")))
    with pytest.raises(RuntimeError, match=r"needs Python's C headers \(Python\.h\), which are not in .*"
                                           rf"{re.escape(str(tmp_path / 'include'))}: install .*-dev") as e:
        jit.prebuild([no_headers], tmp_path / "out")
    assert not (tmp_path / "out" / "build" / "prebuild" / "build.log").exists(), str(e.value)


def test_a_failed_builds_message_is_its_failed_steps_without_ptxas_report():
    """A failed build's error shows ninja's FAILED steps with their command and compiler output, not the whole log
    (a full prebuild's is ~1 900 lines, three quarters ptxas's resource report); without a FAILED step, the last
    lines; capped, with the count of what is left out."""
    log = "\n".join(["[1/4] nvcc -c a.cu", "ptxas info    : 0 bytes gmem",
                     "ptxas info    : Function properties for _Z1kv", "    0 bytes stack frame, 0 bytes spill stores",
                     "ptxas info    : Used 96 registers", "[2/4] nvcc -c b.cu", "FAILED: b.o", "nvcc -c b.cu -o b.o",
                     'b.cu(3): error: identifier "x" is undefined', "1 error detected", "[3/4] nvcc -c c.cu",
                     "ptxas info    : Used 80 registers", "ninja: build stopped: subcommand failed."])
    assert build.failure_excerpt(log) == ('FAILED: b.o\nnvcc -c b.cu -o b.o\nb.cu(3): error: identifier "x" is '
                                          'undefined\n1 error detected')
    assert build.failure_excerpt("ptxas info    : Used 1 registers\nsomething\nninja: error: loading") == \
        "something\nninja: error: loading"
    many = "\n".join(["FAILED: b.o", *(f"warning {i}" for i in range(100)), "b.cu(9): error: late"])
    assert build.failure_excerpt(many) == "FAILED: b.o\nb.cu(9): error: late\n... (100 more lines)"
    plain = "\n".join(["FAILED: b.o", *(f"line {i}" for i in range(100))])
    assert build.failure_excerpt(plain) == "FAILED: b.o\n... (100 more lines)"


@pytest.mark.parametrize("status", [130, 1, 143])
def test_an_interrupted_build_says_so_in_one_line(tmp_path, monkeypatch, status):
    """ninja ended by Ctrl-C (status 130) is 'interrupted', one line, not a failure with its log; another status is a
    failure with the log's excerpt."""
    ninja = tmp_path / "ninja"
    ninja.write_text(f"#!/bin/sh\necho '[1/2] nvcc -c a.cu'\necho 'ninja: build stopped: interrupted by user.'\n"
                     f"exit {status}\n")
    ninja.chmod(0o755)
    monkeypatch.setattr(env, "ninja_path", lambda: str(ninja))
    with pytest.raises(RuntimeError) as e:
        build.run_ninja(tmp_path, "a module")
    log = tmp_path / "build.log"
    if status == 130:  # (ninja's status for SIGINT, SIGTERM and SIGHUP; 143 is a step's: a killed compiler)
        assert str(e.value) == (f"flashinfer_cake: building a module was interrupted (ninja exit 130); nothing of it "
                                f"was published (its output: {log})")
    else:
        assert str(e.value).startswith(f"flashinfer_cake: building a module failed (ninja exit {status}; the whole "
                                       f"output: {log}):\n[1/2] nvcc -c a.cu\n"), e.value
    assert log.read_text().endswith("interrupted by user.\n")


def test_ctrl_c_during_a_build_keeps_its_log_and_goes_on_as_an_interrupt(tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches this process too (KeyboardInterrupt while ninja's output is read): the output so far and the
    rest ninja prints are build.log, and the interrupt goes on (a library call is not turned into another error);
    the CLI says `interrupted` on one line, exit status 130."""
    ninja = tmp_path / "ninja"
    ninja.write_text("#!/bin/sh\necho '[1/3] build a.so'\necho 'ninja: build stopped: interrupted by user.'\nexit 130\n")
    ninja.chmod(0o755)
    monkeypatch.setattr(env, "ninja_path", lambda: str(ninja))

    def interrupt(*args):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build.run_ninja(tmp_path, "m", progress=interrupt)
    assert (tmp_path / "build.log").read_text() == "[1/3] build a.so\nninja: build stopped: interrupted by user.\n"
    from flashinfer_cake import cli
    monkeypatch.setattr(cli, "cmd_env", interrupt)
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)
    assert cli.main(["env"]) == 130 and capsys.readouterr().err == "flashinfer-cake: interrupted\n"


def test_a_long_build_says_how_far_it_is_between_its_artifacts(tmp_path, monkeypatch):
    """Between artifacts (which link at the end of a prebuild, after minutes on a few cores), a step that ends at
    least HEARTBEAT_S after the last line says how many of the steps are done."""
    ninja = tmp_path / "ninja"
    ninja.write_text("#!/bin/sh\n[ \"$NINJA_STATUS\" = '[%f/%t] ' ] || exit 3  # (a user's NINJA_STATUS is not read)\n"
                     "for i in 1 2 3; do echo \"[$i/4] nvcc -c $i.cu\"; sleep 0.3; done\necho '[4/4] build m.so'\n")
    monkeypatch.setenv("NINJA_STATUS", "%p ")
    ninja.chmod(0o755)
    monkeypatch.setattr(env, "ninja_path", lambda: str(ninja))
    monkeypatch.setattr(build, "HEARTBEAT_S", 0.2)
    beats, built = [], []
    build.run_ninja(tmp_path, "m", progress=lambda stem, done, start: built.append((stem, done)),
                    heartbeat=lambda step, steps, start: beats.append((step, steps)))
    assert built == [("m", 1)] and (2, 4) in beats and (3, 4) in beats and len(beats) <= 3, (built, beats)


def test_compile_error_carries_compiler_output(tmp_path, monkeypatch):
    broken = 'extern "C" int cake_variant() { return cake_undefined_symbol; }\n'
    with pytest.raises(RuntimeError) as e:
        jit.load(dataclasses.replace(SPEC, source=broken))
    assert re.search(r'error: identifier "cake_undefined_symbol" is undefined', str(e.value)), str(e.value)
    assert published(tmp_path / "cache") == []


def test_a_prebuild_elsewhere_copies_only_what_the_cache_verifies(tmp_path, monkeypatch):
    """prebuild into another directory (--out, --aot) takes the JIT cache's module of the same name when its
    bytes, read once, match its record (they are what is written, with the record and where it came from); a
    module whose bytes differ, or that is gone (a concurrent clear-cache), is compiled instead (False), and
    the cache is never its own source."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir(mode=0o700)
    out.mkdir()
    monkeypatch.setenv("FLASHINFER_CAKE_CACHE_DIR", str(cache))
    item = build.BuildItem(SPEC, "fake_module", Path("/nowhere/nvcc"))
    build.publish(b"module bytes", cache, item.name, {"uri": SPEC.uri, "compiler": "/nowhere/nvcc"})
    assert core._cache_to_copy_from(cache, None) is None and core._cache_to_copy_from(out, None) == cache
    (out / f".{item.name}.dead.so").write_bytes(b"a killed publish's temporary")
    lines = []
    assert core._copied_from_cache(item, cache, out, lines.append)
    assert (out / "fake_module.so").read_bytes() == b"module bytes" and build.verified_module(out / "fake_module.so")
    record = build.read_record(out / "fake_module.so")
    assert record["copied_from"] == str(cache / "fake_module.so") and record["compiler"] == "/nowhere/nvcc"
    assert lines == [f"copied {SPEC.uri} from the JIT cache ({cache / 'fake_module.so'})"]
    assert not list(out.glob(f".{item.name}.*"))
    (cache / "fake_module.so").write_bytes(b"other bytes")
    assert not core._copied_from_cache(item, cache, tmp_path / "out2", None)
    (cache / "fake_module.so").unlink()
    assert not core._copied_from_cache(item, cache, tmp_path / "out2", None)
    cache.chmod(0o777)  # a cache others can write to: the loader refuses it, so nothing is copied from it
    try:
        lines = []
        assert core._cache_to_copy_from(out, lines.append) is None
        assert lines and lines[0].startswith("note: nothing is copied from the JIT cache: ") and "FLASHINFER_CAKE_CACHE_DIR" in lines[0]
    finally:
        cache.chmod(0o700)
