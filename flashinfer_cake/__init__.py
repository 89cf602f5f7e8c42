"""flashinfer_cake: JIT-compiled CUDA kernels for packed (varlen) causal conv1d + SiLU in training.

- ``cake_causal_conv1d(x, weight, cu_seqlens, bias=None, *, initial_states=None, return_final_states=False, ...)``:
  the training call (autograd, torch.compile, CUDA graphs). x BF16 ``[S, C]`` (documents packed along S,
  ``cu_seqlens`` int32 ``[num_docs + 1]``), weight ``[C, 4]`` (not nn.Conv1d's ``[C, 1, 4]``).
- ``cake_causal_conv1d_train_forward`` / ``_backward``: the raw kernels, no autograd (outputs and workspaces
  optional arguments, for preallocated buffers).
- ``check_cu_seqlens(cu_seqlens, num_tokens=None)``: an opt-in host check of cu_seqlens content (the kernels
  never read it on the host).
- ``flashinfer_cake.cp``: context parallelism over torch.distributed.
- ``flashinfer_cake.reference``: the same op in pure PyTorch on any device, unrounded (FP64 by default; the
  tests' reference).
- ``flashinfer-cake`` (the command): check this machine, prebuild the modules, clear the cache.
"""

from ._version import __version__
from .autograd import CakeCausalConv1dFunction, cake_causal_conv1d
from .cake_causal_conv1d_train import (
    cake_causal_conv1d_train_backward,
    cake_causal_conv1d_train_backward_workspace,
    cake_causal_conv1d_train_backward_workspace_bytes,
    cake_causal_conv1d_train_forward,
    cake_causal_conv1d_train_forward_workspace,
    cake_causal_conv1d_train_forward_workspace_bytes,
    check_cu_seqlens,
    is_cake_causal_conv1d_train_supported,
)

__all__ = [
    "__version__",
    "CakeCausalConv1dFunction",
    "cake_causal_conv1d",
    "cake_causal_conv1d_train_backward",
    "cake_causal_conv1d_train_backward_workspace",
    "cake_causal_conv1d_train_backward_workspace_bytes",
    "cake_causal_conv1d_train_forward",
    "cake_causal_conv1d_train_forward_workspace",
    "cake_causal_conv1d_train_forward_workspace_bytes",
    "check_cu_seqlens",
    "is_cake_causal_conv1d_train_supported",
]
