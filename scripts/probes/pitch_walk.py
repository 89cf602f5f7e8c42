"""Probe (NOTES_bwd session 63): does the backward's slice cost follow the row pitch in a plain
streaming walk, and does staggering the CTAs' walk remove it?

A Triton stand-in for the streaming backward's memory pattern (r234's grid at 65536x1024: 64 token
groups of 1024 rows x 4 channel tiles of 512 bytes, each CTA walking its rows in order, reading x and
dy, writing dx = x + dy) over x / dy / dx as column slices of [S, C + pad] (pitch (C + pad) * 2 bytes),
from column pad / 2, or 128 at pad 128 (tiles on 256-byte blocks).
`stagger` k: group g starts its walk at row (g * k) mod L and wraps (the same rows, another order),
so at any moment the CTAs' rows fall at other offsets. Median of CUDA-event timings.
    python3 scripts/probes/pitch_walk.py [--json out.json]
"""
import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def walk(x, dy, dx, pitch, L, stagger, BC: tl.constexpr, R: tl.constexpr):
    g, t = tl.program_id(0), tl.program_id(1)
    cols = t * BC + tl.arange(0, BC)
    start = (g * stagger) % L
    for i in tl.range(0, L, R, num_stages=4):
        r = g * L + (start + i) % L + tl.arange(0, R)
        offs = r[:, None].to(tl.int64) * pitch + cols[None, :]
        a = tl.load(x + offs)
        b = tl.load(dy + offs)
        tl.store(dx + offs, a + b)


def timed(fn, reps=40):
    for _ in range(5):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in evs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in evs)[reps // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    S, C, L, BC, R = 65536, 1024, 1024, 256, 4
    out = []
    # (pad, first column): column pad / 2 as r234 / r252 (at pad 128 the tiles sit 128 bytes off a 256-byte block),
    # and pad 128 at column 128 (the tiles on 256-byte blocks, as the library's rotation puts all but the first):
    # pitch 2 304 without the blocks' cost
    for pad, col in ((0, 0), (128, 64), (128, 128), (256, 128), (512, 256)):
        bufs = [torch.randn(S, C + pad, device="cuda").to(torch.bfloat16) for _ in range(3)]
        x, dy, dx = (b[:, col:col + C] for b in bufs)
        ref = (x.float() + dy.float()).to(torch.bfloat16)
        for stagger in (0, 4, 36, 132):
            dx.fill_(float("nan"))
            run = lambda: walk[(S // L, C // BC)](x, dy, dx, x.stride(0), L, stagger, BC=BC, R=R, num_warps=4)
            run()
            torch.cuda.synchronize()
            assert torch.equal(dx, ref), (pad, stagger)
            us = timed(run)
            out.append(dict(pad=pad, column=col, pitch_bytes=(C + pad) * 2, stagger=stagger, us=round(us, 1)))
            print(f"pad {pad:4d} (pitch {(C + pad) * 2} B) column {col:3d} stagger {stagger:4d}: {us:7.1f} us",
                  flush=True)
        del bufs, x, dy, dx, ref
    copy_src = torch.empty(S * C * 3 // 2, dtype=torch.bfloat16, device="cuda")
    copy_dst = torch.empty_like(copy_src)  # 6 S C bytes, the walk's
    print(f"copy of the same bytes: {timed(lambda: copy_dst.copy_(copy_src)):.1f} us")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
