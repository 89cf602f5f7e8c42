"""flashinfer_cake: JIT-compiled CUDA kernels for packed (varlen) causal conv1d + SiLU in training."""

from ._version import __version__
from .autograd import CakeCausalConv1dFunction, cake_causal_conv1d
from .cake_causal_conv1d_train import (
    cake_causal_conv1d_train_backward,
    cake_causal_conv1d_train_backward_workspace,
    cake_causal_conv1d_train_backward_workspace_bytes,
    cake_causal_conv1d_train_forward,
    cake_causal_conv1d_train_forward_workspace,
    cake_causal_conv1d_train_forward_workspace_bytes,
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
    "is_cake_causal_conv1d_train_supported",
]
