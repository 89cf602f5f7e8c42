"""The ctypes view of a compiled module's exported C functions (see variant._SOURCE)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from .variant import ABI_VERSION

_c_void_p, _c_int, _c_int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class CompiledModule:
    """A loaded module. ``causal_conv1d_fwd`` and ``causal_conv1d_bwd`` are the raw ctypes
    functions, with device pointers and the stream as ints, returning a cudaError_t code (0 on
    success; the message is then in :meth:`last_error_message`):
    ``causal_conv1d_fwd(x, y, weight, bias, cu_seqlens, workspace, S, C, num_docs, device, stream)``
    ``causal_conv1d_bwd(x, dy, dx, weight, bias, cu_seqlens, workspace, workspace_bytes, dweight,
    dbias, S, C, num_docs, item_tokens, round_preact, device, stream)``."""

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
        fwd = lib.cake_causal_conv1d_fwd
        fwd.restype = _c_int
        fwd.argtypes = [_c_void_p] * 6 + [_c_int64] * 3 + [_c_int, _c_void_p]
        self.path = path
        self.variant = lib.cake_variant().decode()
        bwd = lib.cake_causal_conv1d_bwd
        bwd.restype = _c_int
        bwd.argtypes = [_c_void_p] * 7 + [_c_int64] + [_c_void_p] * 2 + [_c_int64] * 4 + [_c_int] * 2 + [_c_void_p]
        self.causal_conv1d_fwd = fwd
        self.causal_conv1d_bwd = bwd
        self._lib = lib

    def last_error_message(self) -> str:
        """Message of the last failed call on this thread."""
        return self._lib.cake_last_error_message().decode(errors="replace")
