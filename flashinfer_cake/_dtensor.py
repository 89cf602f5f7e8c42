"""DTensor inputs to cake_causal_conv1d (tensor parallelism, e.g. a Mamba2 / GDN layer whose channels
are sharded across a mesh): the custom ops' sharding rules. A depthwise conv is channel-local, so
channel-sharded operands (x and dy on their last dim, weight and bias on dim 0, states on dim 2)
compute each rank's channels from its own shards; replicated operands compute everything
everywhere. Any other placement (x sharded over tokens: that is context parallelism,
flashinfer_cake.cp) is redistributed by DTensor to one of these first, so the result is always
the unsharded one. Registered when a DTensor first reaches the ops, not at import
(torch.distributed.tensor is a heavy import, and absent from builds without torch.distributed)."""

from __future__ import annotations

import functools

import torch


def is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@functools.cache
def register_sharding_rules() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def spec(t, placement):  # an absent optional tensor takes no placement
        return None if t is None else placement

    @register_sharding(torch.ops.flashinfer_cake.causal_conv1d_fwd.default)
    def _(x, weight, cu_seqlens, bias, initial_states, return_final_states):
        rows, channels = Replicate(), Shard(len(x.shape) - 1)
        every = ([rows, rows], [rows, rows, rows, spec(bias, rows), spec(initial_states, rows), None])
        sharded = ([channels, Shard(2) if return_final_states else rows],  # (no final states: an empty tensor)
                   [channels, Shard(0), rows, spec(bias, Shard(0)), spec(initial_states, Shard(2)), None])
        return [every, sharded]

    @register_sharding(torch.ops.flashinfer_cake.causal_conv1d_bwd.default)
    def _(x, weight, cu_seqlens, dy, bias, initial_states, dfinal_states, silu_grad_preactivation):
        rows, channels = Replicate(), Shard(len(x.shape) - 1)
        every = ([rows] * 4, [rows, rows, rows, rows, spec(bias, rows), spec(initial_states, rows),
                              spec(dfinal_states, rows), None])
        sharded = ([channels, Shard(0), rows if bias is None else Shard(0), rows if initial_states is None else Shard(2)],
                   [channels, Shard(0), rows, channels, spec(bias, Shard(0)), spec(initial_states, Shard(2)),
                    spec(dfinal_states, Shard(2)), None])
        return [every, sharded]


def replicated_cu_seqlens(x, cu_seqlens):
    """For a DTensor x: the sharding rules registered, and a plain cu_seqlens (every rank holds the
    same batch description) made a replicated DTensor on x's mesh, as the ops take no mix of
    DTensors and tensors. Anything else as it is."""
    if not is_dtensor(x):
        return cu_seqlens
    register_sharding_rules()
    if not isinstance(cu_seqlens, torch.Tensor) or is_dtensor(cu_seqlens):
        return cu_seqlens
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(cu_seqlens, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
