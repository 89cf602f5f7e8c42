"""Find or build a variant's module and load it.

Contract of :func:`load`: returns the loaded module of ``spec``, trying in order
  1. the modules already loaded by this process (no file access),
  2. the AOT directories (``FLASHINFER_CAKE_AOT_DIR``, then the one shipped in the package),
  3. the JIT cache (``FLASHINFER_CAKE_CACHE_DIR``),
  4. a build into the JIT cache, unless ``FLASHINFER_CAKE_DISABLE_JIT`` is set.
Steps 1-3 start no process. Step 4 holds a file lock per module and checks the cache again under
it, so concurrent first calls from many processes compile once. A module is loaded only when its
bytes match the record written after it (so a truncated or half-published file is rebuilt).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import filelock

from . import env
from .build import build_once, build_variants, find_published, set_aside, verified_module
from .module import CompiledModule
from .variant import VariantSpec

logger = logging.getLogger("flashinfer_cake.jit")

_loaded: dict[VariantSpec, CompiledModule] = {}
_loaded_lock = threading.Lock()


def load(spec: VariantSpec) -> CompiledModule:
    module = _loaded.get(spec)
    if module is None:
        with _loaded_lock:
            module = _loaded.get(spec)
            if module is None:
                module = _find_or_build(spec)
                _loaded[spec] = module
    return module


def _disabled_error(spec: VariantSpec, cache: Path) -> RuntimeError:
    searched = [str(d) for d in env.aot_dirs()] + [str(cache)]
    return RuntimeError(
        f"flashinfer_cake: module {spec.uri} is not prebuilt (searched {searched}) and "
        f"FLASHINFER_CAKE_DISABLE_JIT is set. Prebuild it with `flashinfer-cake build` or "
        f"`python scripts/aot_build.py --out DIR` and point FLASHINFER_CAKE_AOT_DIR at DIR, "
        f"or unset FLASHINFER_CAKE_DISABLE_JIT."
    )


def _find_or_build(spec: VariantSpec) -> CompiledModule:
    prefix = spec.module_prefix()
    for directory in env.aot_dirs():
        path = find_published(directory, prefix)
        if path is not None:
            try:
                return CompiledModule(path)
            except RuntimeError as e:  # e.g. built for another platform: the cache or JIT may do
                logger.warning("flashinfer_cake: skipping prebuilt %s: %s", path, e)
    return CompiledModule(_find_or_build_in_cache(spec, prefix))


def _find_or_build_in_cache(spec: VariantSpec, prefix: str) -> Path:
    cache = env.cache_dir()
    nvcc = env.nvcc_path()
    if nvcc is None or env.jit_disabled():  # nothing will be compiled: any compiler's build will do
        path = find_published(cache, prefix)
        if path is not None:
            return path
        if env.jit_disabled():
            raise _disabled_error(spec, cache)
        env.require_nvcc()  # raises, naming FLASHINFER_CAKE_NVCC / CUDA_HOME
    name = spec.module_name(env.toolchain_digest(nvcc))
    return build_once(cache, name, lambda build_dir: build_variants([spec], cache, build_dir, nvcc))


def prebuild(specs: list[VariantSpec], out_dir: Path | None = None, *, jobs: int | None = None,
             verbose: bool = False) -> dict[VariantSpec, Path]:
    """Build every spec of ``specs`` not yet published in ``out_dir`` (default: the JIT cache)
    in one parallel ninja run, and return where each module is. An AOT directory made this way
    is what FLASHINFER_CAKE_AOT_DIR (or the package's own ``aot/``) points the loader at."""
    nvcc = env.require_nvcc()
    out_dir = env.cache_dir() if out_dir is None else Path(out_dir).absolute()
    out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)  # aot_dirs() refuses group-writable
    toolchain = env.toolchain_digest(nvcc)
    names = sorted(s.module_name(toolchain) for s in specs)
    with contextlib.ExitStack() as locks:
        # One prebuild at a time in this directory (they share build/prebuild), holding the same
        # per-module locks as load(), in a fixed order: a concurrent first call waits for this
        # build instead of compiling the module again.
        locks.enter_context(filelock.FileLock(str(out_dir / "prebuild.lock")))
        for name in names:
            locks.enter_context(filelock.FileLock(str(out_dir / f"{name}.lock")))
        done = {s: out_dir / f"{s.module_name(toolchain)}.so" for s in specs}
        todo = [s for s, path in done.items() if not verified_module(path)]
        if todo:
            logger.info("flashinfer_cake: building %d module(s) into %s", len(todo), out_dir)
            start = time.perf_counter()
            build_dir = out_dir / "build" / "prebuild"
            set_aside(build_dir)
            done.update(build_variants(todo, out_dir, build_dir, nvcc, jobs=jobs, verbose=verbose))
            logger.info("flashinfer_cake: built %d module(s) in %.1f s", len(todo), time.perf_counter() - start)
    return done


def published_modules(spec: VariantSpec) -> list[Path]:
    """Every verified module of ``spec`` in the AOT directories and the JIT cache, any compiler."""
    found = []
    for directory in [*env.aot_dirs(), env.cache_dir()]:
        path = find_published(directory, spec.module_prefix())
        if path is not None:
            found.append(path)
    return found
