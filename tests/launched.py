"""Which kernels a call launched, read from the CUDA profiler's demangled kernel names (the routes,
kernel choices and any kernel of torch's are not visible otherwise)."""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile


def launched_kernels(call) -> list[str]:
    """The names of the CUDA kernels call() launches, one per launch."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def launched_bwd_kernel(call) -> str:
    """The name of the one streaming backward kernel call() launches (the reduction passes are
    another kernel, causal_conv1d_bwd_reduce_kernel)."""
    names = [n for n in launched_kernels(call) if "causal_conv1d_bwd_kernel" in n]
    assert len(names) == 1, names
    return names[0]


def launched_route(call) -> tuple[int, ...]:
    """(channels per thread, channel lanes, threads, strip length) of the streaming backward kernel
    call() launches (BwdTraits<kVec, kLanesC, kThreads, kStripLen, ...>)."""
    name = launched_bwd_kernel(call)
    m = re.search(r"BwdTraits<\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),", name)
    assert m, name
    return tuple(int(v) for v in m.groups())
