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

import logging
import threading
import time

import filelock

from . import env
from .build import build_variants, find_published, verified_module
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
                module = CompiledModule(_find_or_build(spec))
                _loaded[spec] = module
    return module


def _disabled_error(spec: VariantSpec, where: str) -> RuntimeError:
    return RuntimeError(
        f"flashinfer_cake: module {spec.uri} is not prebuilt ({where}) and "
        f"FLASHINFER_CAKE_DISABLE_JIT is set. Prebuild it with `flashinfer-cake build` or "
        f"`python scripts/aot_build.py --out DIR` and point FLASHINFER_CAKE_AOT_DIR at DIR, "
        f"or unset FLASHINFER_CAKE_DISABLE_JIT."
    )


def _find_or_build(spec: VariantSpec):
    prefix = spec.module_prefix()
    for directory in env.aot_dirs():
        path = find_published(directory, prefix)
        if path is not None:
            return path
    cache = env.cache_dir()
    searched = f"searched {[str(d) for d in env.aot_dirs()] + [str(cache)]}"
    nvcc = env.nvcc_path()
    if nvcc is None:  # no compiler: a cached build by any compiler will do
        path = find_published(cache, prefix)
        if path is not None:
            return path
        if env.jit_disabled():
            raise _disabled_error(spec, searched)
        env.require_nvcc()  # raises, naming FLASHINFER_CAKE_NVCC / CUDA_HOME
    name = spec.module_name(env.toolchain_digest(nvcc))
    target = cache / f"{name}.so"
    if verified_module(target):
        return target
    if env.jit_disabled():
        raise _disabled_error(spec, searched)
    with filelock.FileLock(str(cache / f"{name}.lock")):
        if verified_module(target):  # another process built it while we waited
            return target
        logger.info("flashinfer_cake: building %s", name)
        start = time.perf_counter()
        build_variants([spec], cache, cache / "build" / name, nvcc)
        logger.info("flashinfer_cake: built %s in %.1f s", name, time.perf_counter() - start)
    if not verified_module(target):
        raise RuntimeError(f"flashinfer_cake: built {target} but cannot verify it")
    return target
