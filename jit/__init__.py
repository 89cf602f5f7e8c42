"""The JIT: variants of the CUDA templates in include/, built with ninja, cached, loaded by ctypes;
and the torch binding that calls them (binding.py).

Installed as ``flashinfer_cake.jit`` (the sources live in the top-level ``jit/`` directory).
"""

from .binding import build_binding, load_binding, published_binding
from .core import load, prebuild, published_modules
from .variant import VariantSpec, all_variants

__all__ = ["VariantSpec", "all_variants", "build_binding", "load", "load_binding", "prebuild", "published_binding",
           "published_modules"]
