"""The JIT: the package's compiled artifacts, described by :class:`JitSpec` and built, cached and
loaded by one pipeline (:mod:`.core`): the kernel modules (one per variant of the CUDA templates
in include/, loaded with ctypes) and the torch binding that calls them (:mod:`.binding`).

Installed as ``flashinfer_cake.jit`` (the sources live in the top-level ``jit/`` directory).
"""

from .binding import binding_spec, load_binding
from .core import JitSpec, built_for, load, located, lookup, prebuild, published
from .variant import all_variants, variant_spec

__all__ = ["JitSpec", "all_variants", "binding_spec", "built_for", "load", "load_binding", "located", "lookup", "prebuild",
           "published", "variant_spec"]
