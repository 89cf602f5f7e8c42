"""The torch binding (``torch_binding.cpp``): the public functions' eager path in C++.

One CPython extension per torch build, beside the framework-free kernel modules: it reads the
tensors' metadata natively and calls a kernel module's C entry, which keeps an eager call within
the host budget (the ctypes path cost 11-14 µs). It includes torch's headers, so unlike a kernel
module it is tied to the torch (and Python) it was built for; its name carries both.

Contract of :func:`load_binding` (that of :func:`flashinfer_cake.jit.load`): the module already
loaded by this process; else one published in an AOT directory, then in the JIT cache; else a
build into the JIT cache under a file lock (re-checking the cache under it), unless
``FLASHINFER_CAKE_DISABLE_JIT`` is set. The steps before the build start no process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shlex
import sysconfig
import threading
from pathlib import Path

import torch

from . import env
from .build import build_once, find_published, publish, run_ninja, write_if_different
from .variant import templates_digest

SOURCE = Path(__file__).with_name("torch_binding.cpp")
_URI = "torch_binding"

_loaded = None
_loaded_lock = threading.Lock()


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def _flags() -> list[str]:
    return [
        "-O2",
        "-DNDEBUG",  # torch's debug-only asserts out of the inlined header code
        "-std=c++20",  # what torch's own extensions use
        "-fPIC",
        "-fvisibility=hidden",  # only PyInit__torch_binding is exported
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-w",  # torch's headers warn under -std=c++20 with some compilers; nothing of ours
    ]


def _includes() -> list[str]:
    torch_include = _torch_dir() / "include"
    return [str(env.include_dir()), str(torch_include), sysconfig.get_paths()["include"]]


def _ldflags() -> list[str]:
    lib = _torch_dir() / "lib"
    return [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]


def source_digest() -> str:
    """Hash of every input of the binary but the compiler: the source, the templates it includes,
    flags, and the torch and Python it is built for."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), templates_digest().encode(), "\0".join(_flags() + _ldflags()).encode(),
                 torch.__version__.encode(), str(torch.version.git_version).encode(),
                 str(sysconfig.get_config_var("EXT_SUFFIX")).encode()):
        h.update(part + b"\0")
    return h.hexdigest()


def module_prefix() -> str:
    """What every build of the binding for this torch, Python and source starts with."""
    return f"{_URI}_{source_digest()[:16]}_"


def _ninja_file(cxx: Path, so_name: str) -> str:
    flags = [*_flags(), *(f"-I{p}" for p in _includes())]
    return "\n".join([
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(str(cxx))}",
        f"flags = {' '.join(map(shlex.quote, flags))}",
        f"ldflags = {' '.join(map(shlex.quote, _ldflags()))}",
        "rule compile",
        "  command = $cxx $flags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $out",
        "rule link",
        "  command = $cxx -shared $in -o $out $ldflags",
        "  description = link $out",
        f"build {SOURCE.stem}.o: compile {SOURCE.name}",
        f"build {so_name}: link {SOURCE.stem}.o",
    ]) + "\n"


def build_binding(out_dir: Path | str | None = None, *, jobs: int | None = None, verbose: bool = False) -> Path:
    """Build the binding into ``out_dir`` (default: the JIT cache; or an AOT directory) unless a
    verified build of this compiler is there, under its file lock. Returns the module's path."""
    out_dir = env.cache_dir() if out_dir is None else Path(out_dir).absolute()
    out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)  # as prebuild(): aot_dirs() refuses group-writable
    cxx = env.cxx_path()
    name = f"{module_prefix()}{env.toolchain_digest(cxx)[:8]}"

    def build(build_dir: Path) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        write_if_different(build_dir / SOURCE.name, SOURCE.read_text())
        write_if_different(build_dir / "build.ninja", _ninja_file(cxx, f"{name}.so"))
        seconds = run_ninja(build_dir, _URI, jobs=jobs, verbose=verbose)
        record = {"variant": _URI, "torch": torch.__version__, "cxx": str(cxx), "build_seconds": round(seconds, 2)}
        publish(build_dir / f"{name}.so", out_dir, name, record)

    return build_once(out_dir, name, build)


def _import(path: Path):
    spec = importlib.util.spec_from_file_location("flashinfer_cake._torch_binding", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise RuntimeError(f"flashinfer_cake: cannot load the torch binding {path}: {e}") from e
    return module


def published_binding() -> Path | None:
    """The binding this process would load without building: in an AOT directory or the JIT
    cache, any compiler; None when there is none."""
    prefix = module_prefix()
    for directory in [*env.aot_dirs(), env.cache_dir()]:
        path = find_published(directory, prefix)
        if path is not None:
            return path
    return None


def _find_or_build():
    path = published_binding()
    if path is not None:
        return _import(path)
    prefix = module_prefix()
    if env.jit_disabled():
        raise RuntimeError(
            f"flashinfer_cake: the torch binding {prefix}* for torch {torch.__version__} is not prebuilt and "
            f"FLASHINFER_CAKE_DISABLE_JIT is set. Prebuild it with `flashinfer-cake build` (or "
            f"scripts/aot_build.py) under this torch, or unset FLASHINFER_CAKE_DISABLE_JIT."
        )
    return _import(build_binding())


def load_binding():
    """The loaded torch binding module (built on first use when needed)."""
    global _loaded
    if _loaded is None:
        with _loaded_lock:
            if _loaded is None:
                _loaded = _find_or_build()
    return _loaded
