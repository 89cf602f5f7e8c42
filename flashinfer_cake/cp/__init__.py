"""Context parallelism (CP) for the packed conv over torch.distributed.

- :func:`cp_partition` (host, once per batch): which tokens of a packed global batch each rank of
  a CP group holds (contiguous, zigzag, zigzag per document, or explicit fragments).
- :func:`build_cp_context`: one rank's device tables of a partition (one asynchronous copy).
- :func:`cake_causal_conv1d_cp` / :func:`cake_causal_conv1d_cp_multi`: the conv of this rank's
  tokens with autograd, bitwise the single-GPU conv of the global batch restricted to them, the
  exchange overlapped with the kernels (through the group's backend: NCCL; gloo's CUDA
  collectives run in the tests too).
- :func:`halo_exchange` / :func:`halo_exchange_multi`: the fragments' initial states on their own,
  with autograd (for other ops; any backend, gloo included).
"""

from .conv import CPRecomputeHandle, cake_causal_conv1d_cp, cake_causal_conv1d_cp_multi
from .exchange import halo_exchange, halo_exchange_multi
from .partition import LAYOUTS, CPContext, CPPartition, build_cp_context, cp_partition

__all__ = ["LAYOUTS", "CPContext", "CPPartition", "CPRecomputeHandle", "build_cp_context", "cake_causal_conv1d_cp",
           "cake_causal_conv1d_cp_multi", "cp_partition", "halo_exchange", "halo_exchange_multi"]
