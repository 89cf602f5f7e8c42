"""The ctypes view of a kernel module's exported C functions (see variant._SOURCE)."""

from __future__ import annotations

import ctypes
from pathlib import Path


def _args_struct(name: str, fields: str) -> type[ctypes.Structure]:
    """The ctypes twin of an argument struct, from the field names the module exports."""
    names = fields.split()
    return type(name, (ctypes.Structure,), {"_fields_": [(f, ctypes.c_int64) for f in names],
                                            "_field_names": frozenset(names)})


class KernelModule:
    """A loaded kernel module. ``entry_addresses`` (fwd, bwd, cp, stream_is_capturing,
    last_error_message) are what the torch binding calls: the public path.
    :meth:`causal_conv1d_fwd` / :meth:`causal_conv1d_bwd` / :meth:`causal_conv1d_cp` call the entries from Python with every
    field of the entry's argument struct by keyword (device pointers and the stream as ints; the
    names and their meaning are in include/flashinfer_cake/causal_conv1d_contract.h), and return a
    cudaError_t code (0 on success; else :meth:`last_error_message` says why): for tools and
    tests."""

    def __init__(self, path: Path):
        try:
            lib = ctypes.CDLL(str(path))
            fwd, bwd, cp = lib.cake_causal_conv1d_fwd, lib.cake_causal_conv1d_bwd, lib.cake_causal_conv1d_cp
            capturing, message = lib.cake_stream_is_capturing, lib.cake_last_error_message
            variant, fwd_names, bwd_names = lib.cake_variant, lib.cake_fwd_arg_names, lib.cake_bwd_arg_names
            cp_names = lib.cake_cp_arg_names
        except (OSError, AttributeError) as e:  # not a module of this package's sources
            raise RuntimeError(f"flashinfer_cake: cannot load module {path}: {e}") from e
        for fn in (variant, fwd_names, bwd_names, cp_names, message):
            fn.restype, fn.argtypes = ctypes.c_char_p, []
        for fn in (fwd, bwd, cp, capturing):
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.path = path
        self.variant = variant().decode()
        self.fwd_args = _args_struct("FwdArgs", fwd_names().decode())
        self.bwd_args = _args_struct("BwdArgs", bwd_names().decode())
        self.cp_args = _args_struct("CpArgs", cp_names().decode())
        self.entry_addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (fwd, bwd, cp, capturing, message))
        self._fwd, self._bwd, self._cp, self._message = fwd, bwd, cp, message

    @staticmethod
    def _pack(struct: type[ctypes.Structure], kwargs: dict) -> ctypes.Structure:
        names = struct._field_names  # (a missing field would silently be 0)
        if kwargs.keys() != names:
            raise TypeError(f"{struct.__name__} takes exactly the fields {sorted(names)}, got {sorted(kwargs)}")
        return struct(**kwargs)

    def causal_conv1d_fwd(self, **kwargs) -> int:
        args = self._pack(self.fwd_args, kwargs)  # alive until the call returns
        return self._fwd(ctypes.addressof(args))

    def causal_conv1d_bwd(self, **kwargs) -> int:
        args = self._pack(self.bwd_args, kwargs)
        return self._bwd(ctypes.addressof(args))

    def causal_conv1d_cp(self, **kwargs) -> int:
        """A context-parallel pass (causal_conv1d_cp.cuh)."""
        args = self._pack(self.cp_args, kwargs)
        return self._cp(ctypes.addressof(args))

    def last_error_message(self) -> str:
        """Message of the last failed call on this thread."""
        return self._message().decode(errors="replace")
