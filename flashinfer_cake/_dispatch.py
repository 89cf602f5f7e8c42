"""How a public call reaches a kernel: the torch binding, and the kernel module of the call's
variant (weight dtype, bias dtype, arch) registered with it on that device's first call.

A call asks the binding first (:data:`binding`, once loaded): it checks the arguments natively and
launches, or declines. A declined call (a bad argument, a variant not registered yet, or a binding
not loaded yet) goes through the Python rules (flashinfer_cake._checks), which raise the precise
error before anything is built, then :func:`binding_for`, then the binding again."""

from __future__ import annotations

import torch

from . import jit
from ._checks import PARAM_DTYPES, arch_of

# The loaded torch binding; None until a call has needed it (loading may build it).
binding = None


def binding_for(device: int, weight: torch.Tensor, bias: torch.Tensor | None):
    """The torch binding with the kernel module of weight's and bias's dtypes registered for
    ``device``; loads (building when needed) both."""
    global binding
    bias_dtype = None if bias is None else bias.dtype
    spec = jit.variant_spec(PARAM_DTYPES[weight.dtype], "none" if bias is None else PARAM_DTYPES[bias_dtype],
                            arch_of(device))
    module = jit.load(spec)
    loaded = jit.load_binding()
    loaded.register_kernel_module(device, weight.dtype, bias_dtype, *module.entry_addresses)
    binding = loaded
    return loaded


def declined_error(fn: str) -> RuntimeError:
    """The binding declined arguments that pass every Python rule: the two have drifted."""
    return RuntimeError(f"{fn}: internal error: the torch binding declined arguments that pass every check "
                        "(please report it, with the arguments' dtypes, shapes and devices)")
