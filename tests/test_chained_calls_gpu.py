"""GPU tests of calls that read what the call before them wrote (sm_90; skipped without one).

Every forward and backward kernel is launched with programmatic dependent launch: it may be
scheduled while the stream's previous kernel still runs, and waits for that kernel's end before
its first global access. A chain of calls, each reading the previous call's output (y as the next
x, final states as the next initial states, dx as the next dy), with copies, fills and torch
kernels between some of them, must give bitwise what the same chain gives with the device
synchronized after every call; eagerly and replayed from a CUDA graph, on one-wave and multi-wave
grids of every kernel (the strip and token-lane forwards, the wide and narrow backward routes and
the reduce passes). Outputs are NaN-poisoned, so a read before the write lands fails. The first
backward's dy is the last forward's y, and a last forward takes the last backward's dweight and
dbias as its weight and bias (as a forward reads what an optimizer step just wrote): a kernel that
did not wait would read them unwritten.
"""

from __future__ import annotations

import pytest
import torch

from flashinfer_cake import cake_causal_conv1d_train_backward as bwd, cake_causal_conv1d_train_forward as fwd

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
STEPS = 6


def same_bits(a, b):
    """Bitwise equality that also holds for NaN (BF16 or FP32)."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def make_case(S, C, seed):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    x = torch.randn(S, C, device=DEV, generator=g).to(BF16)
    w = 0.5 * torch.randn(C, 4, device=DEV, generator=g)
    b = 0.5 * torch.randn(C, device=DEV, generator=g)
    cuts = torch.randperm(S - 1, generator=torch.Generator().manual_seed(seed))[:7] + 1
    cu = torch.cat([torch.tensor([0, S]), cuts]).sort().values.to(torch.int32).to(DEV)
    h0 = torch.randn(cu.numel() - 1, 3, C, device=DEV, generator=g).to(BF16)
    return x, w, b, cu, h0


class Chain:
    """STEPS forwards (y -> next x, final states -> next initial states) then STEPS backwards
    (the last y as the first dy, then dx -> next dy), then a forward of the last dx with the last
    dweight and dbias as weight and bias, into buffers made up front (poisoned before each run);
    with `sync`, the device is synchronized after every call. Between steps: a
    device-to-device copy, a fill and a torch kernel, so our kernels also follow ones that are not
    ours."""

    def __init__(self, x, w, b, cu, h0):
        self.x, self.w, self.b, self.cu, self.h0 = x, w, b, cu, h0
        self.ys = [torch.empty_like(x) for _ in range(STEPS)]
        self.finals = [torch.empty_like(h0) for _ in range(STEPS)]
        self.dxs = [torch.empty_like(x) for _ in range(STEPS)]
        self.dws = [torch.empty_like(w) for _ in range(STEPS)]
        self.dbs = [torch.empty_like(b) for _ in range(STEPS)]
        self.y_last = torch.empty_like(x)
        self.copy = torch.empty_like(x)
        self.scratch = torch.empty_like(x)

    def outputs(self):
        return self.ys + self.finals + self.dxs + self.dws + self.dbs + [self.y_last, self.copy]

    def poison(self):
        for t in self.outputs():
            t.fill_(float("nan"))

    def run(self, sync=False):
        def step():
            if sync:
                torch.cuda.synchronize()

        a, h = self.x, self.h0
        for i in range(STEPS):
            fwd(a, self.w, self.cu, bias=self.b, initial_states=h, final_states_out=self.finals[i], out=self.ys[i])
            step()
            a, h = self.ys[i], self.finals[i]
            if i == 1:  # a copy (a memcpy) between two forwards
                self.copy.copy_(a)
                a = self.copy
                step()
            if i == 2:  # a torch kernel between two forwards, writing memory our next call does not read
                self.scratch.fill_(1.0)
                step()
        d = self.ys[-1]  # written by the call just before
        for i in range(STEPS):
            xi = self.ys[-2] if i == 0 else self.ys[i - 1]
            bwd(xi, self.w, self.cu, d, bias=self.b, dx=self.dxs[i], dweight=self.dws[i], dbias=self.dbs[i])
            step()
            d = self.dxs[i]
            if i == 2:
                self.scratch.mul_(2.0)
                step()
        fwd(d, self.dws[-1], self.cu, bias=self.dbs[-1], out=self.y_last)  # right after the reduce's last pass
        step()


# The strip forward and wide backward on one wave and many; the token-lane forward with the 128-
# and 64-channel backward routes; the token-lane forward at C = 16 with the warp-filled backward.
@pytest.mark.parametrize("S, C", [(1024, 4096), (40000, 2048), (65536, 128), (131072, 64), (262144, 16)],
                         ids=["one_wave", "multi_wave", "c128", "c64", "c16"])
def test_chained_calls_read_what_the_call_before_wrote(S, C):
    case = make_case(S, C, seed=S + C)
    want = Chain(*case)
    want.poison()
    want.run(sync=True)
    torch.cuda.synchronize()
    for t in want.outputs():
        assert not torch.isnan(t.float()).any(), "the synchronized chain left an output unwritten"

    got = Chain(*case)
    for attempt in range(3):  # a race shows up on some runs only
        got.poison()
        got.run()
        torch.cuda.synchronize()
        for k, (g, r) in enumerate(zip(got.outputs(), want.outputs())):
            assert same_bits(g, r), f"eager run {attempt}: output {k} of the chain differs from the synchronized chain"

    # the same chain captured once and replayed
    graphed = Chain(*case)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graphed.run()  # warm-up (modules loaded, buffers kept) before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.run()
    torch.cuda.synchronize()
    for attempt in range(3):
        graphed.poison()
        graph.replay()
        torch.cuda.synchronize()
        for k, (g, r) in enumerate(zip(graphed.outputs(), want.outputs())):
            assert same_bits(g, r), f"graph replay {attempt}: output {k} of the chain differs from the synchronized chain"
