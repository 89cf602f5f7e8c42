"""The backward and the L2 it starts on (one document, FP32 taps + bias; medians of 40 per-call CUDA events, 3
rotated sets). Default run, on contiguous rows, column 64 of [S, C+128] and column 128 of [S, C+256]: the call
back to back, and after an L2 flush (a 256 MB write, then the flush's dirty lines written back by a 256 MB read).
"add" is torch.add(x, dy, out=dx) on the contiguous rows' sets: the same bytes on the same buffers, to tell
whether the time a call loses back to back (the previous call's dirty lines still in L2) is the backward's or any
such walk's (r301, H100: the add loses 6.1 µs back to back, the backward 15.0; NOTES_bwd session 76).
"next-copy" times a 64 MB copy right after each flushed call against the same copy after a flush: the excess is the
write-back of the dirty lines the call left in L2, a cost the flushed call's own time does not carry (session 76).
--dirty MB,...: after each flush, a write of that many MB (dirty lines, as a previous kernel leaves them), then the
backward and the add on the contiguous rows: how each call's time grows with the dirty lines it starts on.
--gap CYCLES,...: a spinning one-thread kernel (torch.cuda._sleep) before each call instead, L2 left as the previous
call left it: does a pause remove the back-to-back loss? (r306, a one-off script before this option, H100: no.)
--after: each of the backward and the add timed right after an untimed backward, add, or read (sums of x and dy: no
dirty lines) on the previous call's set (after its own kind it is the back-to-back setting), with flushed and
dirty-64 / 128-MB figures from the same run: is the backward's extra loss after a backward (session 76: 6-8 µs) what
a backward leaves (r310, H100: no, an add's residue costs as much), and is it the residue's dirty lines?
    python3 scripts/probes/bwd_l2_flush.py [out.json]     (session 69, r275 / r276: H100 only)
    python3 scripts/probes/bwd_l2_flush.py --shape 16384x4096 --dirty 0,4,8,16,32,64 out.json
    python3 scripts/probes/bwd_l2_flush.py --gap 200000,2000000
    python3 scripts/probes/bwd_l2_flush.py --after --shape 16384x4096"""
import argparse
import json
import sys
from pathlib import Path

import torch
import flashinfer_cake as fc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_placement import event_medians_us, l2_flush, l2_scratch  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("json", nargs="?", help="write the medians here")
p.add_argument("--shape", default="65536x1024", help="SxC (default %(default)s)")
mode = p.add_mutually_exclusive_group()  # each instead of the default run
mode.add_argument("--dirty", help="comma-separated MB (0-256) written after each flush")
mode.add_argument("--gap", help="comma-separated GPU cycles of a spinning one-thread kernel before each call")
mode.add_argument("--after", action="store_true", help="each call after either kind; flushed and dirty 64 MB beside")
args = p.parse_args()
S, C = (int(v) for v in args.shape.split("x"))
DIRTY_MAX_MB = 256
dirty_mbs = [int(v) for v in args.dirty.split(",")] if args.dirty else [64] if args.after else []
if any(not 0 <= mb <= DIRTY_MAX_MB for mb in dirty_mbs):
    p.error(f"--dirty: each value must be within 0..{DIRTY_MAX_MB} MB, got {args.dirty}")
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
w = torch.randn(C, 4, device=dev, generator=g) * 0.3
b = torch.randn(C, device=dev, generator=g) * 0.1
cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
scratch = l2_scratch()
ws = fc.cake_causal_conv1d_train_backward_workspace(S, C, dev)


def rows(pad, col):
    buf = torch.zeros(S, C + pad, device=dev, dtype=torch.bfloat16)
    v = buf[:, col:col + C]
    v.copy_(torch.randn(S, C, device=dev, generator=g))
    return v


def three_sets(pad, col):
    """Three (x, dy, dx) sets, rotated over so that no call finds its inputs in L2."""
    return [(rows(pad, col), rows(pad, col), rows(pad, col)) for _ in range(3)]


def bwd(x, dy, dx):
    fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx, workspace=ws)


def add(x, dy, dx):
    torch.add(x, dy, out=dx)


def read(x, dy, dx):
    """A predecessor that reads x and dy (what the add reads) and leaves no dirty lines."""
    x.sum()
    dy.sum()


def flush(i):
    l2_flush(scratch, i)


dirty = torch.empty(DIRTY_MAX_MB << 20, dtype=torch.uint8, device=dev) if dirty_mbs else None


def flush_and_dirty(mb):
    """before(i): a flush, then a write of mb MB (the dirty lines a previous kernel leaves)."""
    def before(i, n=mb << 20):
        flush(i)
        if n:
            dirty[:n].fill_(i & 255)
    return before


def series(sets, call, before=None, after=None):
    """Median µs of 40 calls (3 warm-up) over the rotated sets; before(i) runs untimed before each, after() is
    timed after each (its median returned too)."""
    return event_medians_us(lambda i: call(*sets[i % 3]), 40, before, after)


out = {"shape": args.shape}
kinds = (("backward", bwd), ("add", add))
if args.after:
    sets = three_sets(0, 0)
    for name, call in kinds:
        out[f"{name}/back-to-back"] = series(sets, call)[0]
        for prev_name, prev in kinds + (("read", read),):
            out[f"{name}/after {prev_name}"] = series(sets, call, lambda i, f=prev: f(*sets[(i - 1) % 3]))[0]
        out[f"{name}/flushed"] = series(sets, call, flush)[0]
        for mb in (64, 128):
            out[f"{name}/dirty {mb} MB"] = series(sets, call, flush_and_dirty(mb))[0]
elif args.gap:
    sets = three_sets(0, 0)
    for cycles in [0] + [int(v) for v in args.gap.split(",")]:
        idle = (lambda i, n=cycles: torch.cuda._sleep(n)) if cycles else None
        for name, call in kinds:
            out[f"{name}/gap {cycles} cycles"] = series(sets, call, idle)[0]
elif args.dirty:
    sets = three_sets(0, 0)
    for name, call in kinds:
        out[f"{name}/back-to-back"] = series(sets, call)[0]
    for mb in dirty_mbs:
        for name, call in kinds:
            out[f"{name}/dirty {mb} MB"] = series(sets, call, flush_and_dirty(mb))[0]
else:
    copy_src, copy_dst = (torch.empty(64 << 20, dtype=torch.uint8, device=dev) for _ in range(2))
    copy = lambda: copy_dst.copy_(copy_src)
    # the baseline: the copy after a flush (L2 then holds only the clean lines of the flush's read)
    out["flush/next-copy"] = series([()] * 3, lambda: None, flush, copy)[1]
    for layout, pad, col in (("contiguous", 0, 0), ("col64", 128, 64), ("col128", 256, 128)):
        sets = three_sets(pad, col)
        for name, call in [(layout, bwd)] + ([("add", add)] if layout == "contiguous" else []):
            out[f"{name}/back-to-back"] = series(sets, call)[0]
            out[f"{name}/flushed"], out[f"{name}/next-copy"] = series(sets, call, flush, copy)
for k, v in out.items():
    print(f"{k:28s} {v:8.1f} us" if isinstance(v, float) else f"{k:28s} {v}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
