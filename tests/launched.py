"""Which backward kernel a call launched, read from the CUDA profiler's demangled kernel name (the
routes and kernel choices are not visible otherwise)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def launched_bwd_kernel(call) -> str:
    """The name of the one streaming backward kernel call() launches (the reduction passes are
    another kernel, causal_conv1d_bwd_reduce_kernel)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "causal_conv1d_bwd_kernel" in e.name]
    assert len(names) == 1, names
    return names[0]
