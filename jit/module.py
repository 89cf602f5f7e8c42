"""The ctypes view of a compiled module's exported C functions (see variant._SOURCE)."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

from .variant import ABI_VERSION

_c_int = ctypes.c_int
# The launches' packed int64 arguments (see variant._SOURCE for the order).
_FWD_ARGS = struct.Struct("<11q")
_BWD_ARGS = struct.Struct("<17q")


class CompiledModule:
    """A loaded module. ``entry_addresses`` are what the torch binding calls (the public path).
    ``causal_conv1d_fwd`` and ``causal_conv1d_bwd`` are the raw ctypes
    functions (arguments packed into one int64 array on the way), with device pointers and the
    stream as ints, returning a cudaError_t code (0 on success; else the message is in
    :meth:`last_error_message`):
    ``causal_conv1d_fwd(x, y, weight, bias, cu_seqlens, workspace, S, C, num_docs, device, stream)``
    ``causal_conv1d_bwd(x, dy, dx, weight, bias, cu_seqlens, workspace, workspace_bytes, dweight,
    dbias, S, C, num_docs, item_tokens, round_preact, device, stream)``, for tools and tests."""

    def __init__(self, path: Path):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise RuntimeError(f"flashinfer_cake: cannot load module {path}: {e}") from e
        lib.cake_abi_version.restype = _c_int
        lib.cake_abi_version.argtypes = []
        abi = lib.cake_abi_version()
        if abi != ABI_VERSION:
            raise RuntimeError(f"flashinfer_cake: module {path} has ABI {abi}, expected {ABI_VERSION}")
        lib.cake_variant.restype = ctypes.c_char_p
        lib.cake_last_error_message.restype = ctypes.c_char_p
        fwd, bwd = lib.cake_causal_conv1d_fwd, lib.cake_causal_conv1d_bwd
        for fn in (fwd, bwd):
            fn.restype = _c_int
            fn.argtypes = [ctypes.c_char_p]
        lib.cake_stream_is_capturing.restype = _c_int
        lib.cake_stream_is_capturing.argtypes = [ctypes.c_void_p]
        pack_fwd, pack_bwd = _FWD_ARGS.pack, _BWD_ARGS.pack
        self.path = path
        self.variant = lib.cake_variant().decode()
        # What the torch binding calls: fwd, bwd, stream_is_capturing, last_error_message.
        self.entry_addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (
            fwd, bwd, lib.cake_stream_is_capturing, lib.cake_last_error_message))
        self.causal_conv1d_fwd = lambda *args: fwd(pack_fwd(*args))
        self.causal_conv1d_bwd = lambda *args: bwd(pack_bwd(*args))
        self._lib = lib

    def last_error_message(self) -> str:
        """Message of the last failed call on this thread."""
        return self._lib.cake_last_error_message().decode(errors="replace")
