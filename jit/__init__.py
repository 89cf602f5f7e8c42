"""The JIT: variants of the CUDA templates in include/, built with ninja, cached, loaded by ctypes.

Installed as ``flashinfer_cake.jit`` (the sources live in the top-level ``jit/`` directory).
"""

from .core import load, prebuild, published_modules
from .variant import VariantSpec, all_variants

__all__ = ["VariantSpec", "all_variants", "load", "prebuild", "published_modules"]
