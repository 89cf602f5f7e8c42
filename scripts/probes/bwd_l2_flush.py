"""Backward on contiguous rows, column 64 of [S, C+128], column 128 of [S, C+256] (65536x1024, one
document): per-call CUDA-event time back to back, and after an L2 flush (a 256 MB write, then the
flush's dirty lines written back by a 256 MB read) between calls. Medians of 40 calls, 3 rotated sets.
"add" is torch.add(x, dy, out=dx) on the contiguous rows' sets: the same bytes on the same buffers, to tell
whether the time a call loses back to back (the previous call's dirty lines still in L2) is the backward's or any
such walk's (r301, H100: the add loses 6.1 µs back to back, the backward 15.0; NOTES_bwd session 76).
    python3 scripts/probes/bwd_l2_flush.py [out.json]     (session 69, r275 / r276: H100 only)"""
import json, statistics, sys
import torch
import flashinfer_cake as fc

S, C = 65536, 1024
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
w = torch.randn(C, 4, device=dev, generator=g) * 0.3
b = torch.randn(C, device=dev, generator=g) * 0.1
cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)


def rows(pad, col):
    buf = torch.zeros(S, C + pad, device=dev, dtype=torch.bfloat16)
    v = buf[:, col:col + C]
    v.copy_(torch.randn(S, C, device=dev, generator=g))
    return v


out = {}
ws = fc.cake_causal_conv1d_train_backward_workspace(S, C, dev)


def bwd(x, dy, dx):
    fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx, workspace=ws)


def add(x, dy, dx):
    torch.add(x, dy, out=dx)


for layout, pad, col in (("contiguous", 0, 0), ("col64", 128, 64), ("col128", 256, 128)):
    sets = [(rows(pad, col), rows(pad, col), rows(pad, col)) for _ in range(3)]
    for name, call, flush in [(layout, bwd, False), (layout, bwd, True)] + (
            [("add", add, False), ("add", add, True)] if layout == "contiguous" else []):
        times = []
        for i in range(43):
            x, dy, dx = sets[i % 3]
            if flush:
                scratch.fill_(i & 255)
                scratch.sum(dtype=torch.int32)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            call(x, dy, dx)
            e1.record()
            times.append((e0, e1))
        torch.cuda.synchronize()
        us = [a.elapsed_time(z) * 1e3 for a, z in times[3:]]
        out[f"{name}/{'flushed' if flush else 'back-to-back'}"] = statistics.median(us)
for k, v in out.items():
    print(f"{k:28s} {v:8.1f} us")
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
