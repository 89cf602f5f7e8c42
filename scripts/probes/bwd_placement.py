"""Does the backward's time depend on where x, dy and dx lie? (NOTES_bwd session 74)
bench_states read 16384x4096's contiguous backward bimodal (0.152 / 0.159 ms, H100 r289) between mixes that
differ only in their buffers. Here x, dy and dx are views into one arena, each in its own slot (slots 2 S C + 16 MB
bytes apart; with --slice, 2 S (C + 2 COL) + 16 MB); x sits at its slot's start, dy and dx at random 4 KB-page
offsets below 16 MB into theirs (the first placement: all at offset 0). These are virtual offsets: the DRAM sees
physical addresses, mapped in 2 MB pages.
Per placement, medians of 15 per-call CUDA events back to back on the same buffers (µs) of:
- the backward (FP32 taps + bias, one document);
- torch.add(x, dy, out=dx): the same bytes;
- two Triton stand-ins of dx = x + dy in the backward's 512-byte tiles (256 channels, 4 rows a step), one warp a
  program, every program in flight at once: "runs" walks 256-row runs (as each strip of the backward's long walks
  does), "front" the same rows in 16-row pieces dealt round robin (the rows in flight: one contiguous front).
    python3 scripts/probes/bwd_placement.py [--configs N] [--json out.json]      (r292 / r293)
    python3 scripts/probes/bwd_placement.py --move dx --configs 32 --shapes 16384x4096   (r294: dx's offset only,
        below 2 MB; --move dy likewise; the backward alone)
    python3 scripts/probes/bwd_placement.py --at 2590 1675 --shapes 16384x4096     (one placement, dy's and dx's
        offsets in pages, the backward alone: to run under ncu)
    python3 scripts/probes/bwd_placement.py --slice 64 --configs 16    (issue 15's slices: per placement, the backward
        on contiguous x, dy, dx and on column slices at column 64 of [S, C + 128] rows starting at the same offsets,
        checked bitwise equal; the median over placements of the slice / contiguous ratio; r301 ran --configs 12)
scripts/probes/placement_ab.py times tune.py's configs over such placements."""
import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import flashinfer_cake as fc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
from bench_harness import Dev, measure  # noqa: E402

SPAN = 16 << 20  # bytes of room past each buffer's slot
POISON = 0x7FC1  # a BF16 NaN's bits: the slice check's fill of dx's rows
PAGE = 4096
DEV = Dev(smoke_cpu=False)


def arena(S: int, C: int, pitch: int | None = None) -> torch.Tensor:
    """Three slots, each room for an [S, pitch] BF16 buffer (pitch: C if None) and SPAN bytes past it."""
    return torch.empty(3 * (2 * S * (pitch or C) + SPAN), dtype=torch.uint8, device="cuda")


def views(buf: torch.Tensor, S: int, C: int, pages: list[int], pitch: int | None = None,
          col: int = 0) -> list[torch.Tensor]:
    """x, dy, dx as [S, C] BF16 views of buf, each pages[i] 4 KB pages into its slot: contiguous, or (pitch given)
    columns col..col + C of [S, pitch] rows."""
    pitch = pitch or C
    slot = buf.numel() // 3  # the arena's, so that contiguous views and slices of one placement start together
    return [buf[i * slot + p * PAGE:i * slot + p * PAGE + 2 * S * pitch].view(torch.bfloat16).view(S, pitch)
            [:, col:col + C] for i, p in enumerate(pages)]


def random_pages(rng: random.Random, move: str = "dy,dx", below: int = SPAN) -> list[int]:
    """Page offsets of x (always 0), dy and dx: random below `below` bytes for the buffers named in move."""
    return [0] + [rng.randrange(below // PAGE) if name in move.split(",") else 0 for name in ("dy", "dx")]


def median_us(fn) -> float:
    """Median of 15 per-call CUDA events back to back, after 3 warm calls."""
    return measure(DEV, lambda i: fn(), 1, argparse.Namespace(), warm=3, reps=15)["ms"] * 1e3


def l2_scratch() -> torch.Tensor:
    """The flush's buffer: 256 MB, over five times the H100's and H200's 50 MB of L2."""
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def l2_flush(scratch: torch.Tensor, i: int) -> None:
    """Leave L2 clean: a write of scratch, then a read that writes those dirty lines back."""
    scratch.fill_(i & 255)
    scratch.sum(dtype=torch.int32)


def event_medians_us(call, n: int, before=None, after=None, warm: int = 3) -> tuple[float, float | None]:
    """call(i) timed by a CUDA-event pair, warm + n times; before(i) runs untimed ahead of each, after() is timed
    right after each. Medians (µs) over the last n of call's times and of after's (None without after). Its own loop:
    bench_harness's Dev.time_reps times back to back only, with nothing untimed or timed apart between the calls."""
    def pair(fn, *a):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(*a)
        e1.record()
        return e0, e1

    times, afters = [], []
    for i in range(warm + n):
        if before:
            before(i)
        times.append(pair(call, i))
        if after:
            afters.append(pair(after))
    torch.cuda.synchronize()
    med = lambda pairs: statistics.median(a.elapsed_time(z) * 1e3 for a, z in pairs[warm:])
    return med(times), (med(afters) if after else None)


def flushed_median_us(fn, scratch: torch.Tensor) -> float:
    """Median of 15 per-call CUDA events, each call after an L2 flush (3 warm calls first)."""
    return event_medians_us(lambda i: fn(), 15, lambda i: l2_flush(scratch, i))[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16384x4096,65536x1024,8192x8192,32768x2048")
    p.add_argument("--configs", type=int, default=48, help="placements per shape (the first: all at offset 0)")
    p.add_argument("--move", help="dy or dx: only that buffer moves, below 2 MB; the backward alone")
    p.add_argument("--at", type=int, nargs=2, metavar=("DY_PAGES", "DX_PAGES"), help="one placement, the backward alone")
    p.add_argument("--slice", type=int, metavar="COL", help="the backward on contiguous buffers and on column slices "
                   "at COL of [S, C + 2 COL] rows at the same offsets (alone)")
    p.add_argument("--json")
    args = p.parse_args()
    rng = random.Random(0)
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    if args.slice is not None and (args.slice <= 0 or args.slice % 8):
        p.error(f"--slice: a positive multiple of 8 channels (16-byte rows), got {args.slice}")
    pitch = lambda C: C + 2 * args.slice if args.slice else None  # noqa: E731
    for S, C in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
        buf = arena(S, C, pitch(C))
        g = torch.Generator(device="cuda").manual_seed(S)
        w = torch.randn(C, 4, device="cuda", generator=g) * 0.3
        b = torch.randn(C, device="cuda", generator=g) * 0.1
        cu = torch.tensor([0, S], device="cuda", dtype=torch.int32)
        ws = fc.cake_causal_conv1d_train_backward_workspace(S, C, "cuda")
        fn = None
        placements = ([[0, *args.at]] if args.at else
                      [[0, 0, 0]] + [random_pages(rng, args.move or "dy,dx", 2 << 20 if args.move else SPAN)
                                     for _ in range(args.configs - 1)])
        for k, pages in enumerate(placements):
            x, dy, dx = views(buf, S, C, pages)
            x.normal_(generator=g)
            dy.normal_(generator=g)
            dx.fill_(float("nan"))
            row = {"shape": f"{S}x{C}", "pages": pages,
                   "bwd_us": median_us(lambda: fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx,
                                                                                     workspace=ws))}
            if args.slice:
                ref, xv, dyv = dx.view(torch.int16).clone(), x.clone(), dy.clone()
                dx_rows = views(buf, S, pitch(C), pages)[2]  # dx's whole [S, C + 2 COL] rows: the padding is checked
                x, dy, dx = views(buf, S, C, pages, pitch(C), args.slice)
                x.copy_(xv)
                dy.copy_(dyv)
                dx_rows.view(torch.int16).fill_(POISON)
                row["slice_us"] = median_us(lambda: fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx,
                                                                                          workspace=ws))
                pad = torch.cat([dx_rows[:, :args.slice], dx_rows[:, args.slice + C:]], 1).view(torch.int16)
                if not torch.equal(dx.view(torch.int16), ref) or not bool((pad == POISON).all()):
                    raise SystemExit(f"{S}x{C} pages {pages}: the slices' dx differs from the contiguous dx, or the "
                                     f"columns around the slice were written")
                ref = xv = dyv = dx_rows = pad = None
            elif not (args.move or args.at):
                row["add_us"] = median_us(lambda: torch.add(x, dy, out=dx))
                for name, front in (("runs", False), ("front", True)):
                    fn = stand_in(x, dy, dx, front)
                    if k == 0:
                        dx.fill_(float("nan"))
                        fn()
                        assert torch.allclose(dx.float(), x.float() + dy.float(), rtol=1e-2, atol=1e-2), name
                    row[f"{name}_us"] = median_us(fn)
            out["rows"].append(row)
            print(f"{S}x{C} dy {pages[1]:4d} dx {pages[2]:4d} pages  " +
                  "  ".join(f"{key[:-3]} {v:7.1f}" for key, v in row.items() if key.endswith("_us")), flush=True)
        rs = [r for r in out["rows"] if r["shape"] == f"{S}x{C}"]
        for key in (k for k in rs[0] if k.endswith("_us")):
            v = sorted(r[key] for r in rs)
            print(f"== {S}x{C} {key}: min {v[0]:.1f} median {statistics.median(v):.1f} max {v[-1]:.1f}", flush=True)
        if args.slice:
            d = sorted(r["slice_us"] / r["bwd_us"] for r in rs)
            print(f"== {S}x{C} slice / contiguous: min {d[0]:.3f} median {statistics.median(d):.3f} max {d[-1]:.3f}",
                  flush=True)
        buf = x = dy = dx = fn = None  # the stand-in's closure holds the views too
        torch.cuda.empty_cache()
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


@triton.jit
def walk(x, dy, dx, C, NPROG, RUN: tl.constexpr, PIECE: tl.constexpr, FRONT: tl.constexpr, BC: tl.constexpr,
         R: tl.constexpr):
    j, t = tl.program_id(0), tl.program_id(1)
    cols = t * BC + tl.arange(0, BC)
    for i in tl.range(0, RUN, R, num_stages=4):
        if FRONT:
            row0 = ((i // PIECE) * NPROG + j) * PIECE + i % PIECE
        else:
            row0 = j * RUN + i
        offs = (row0 + tl.arange(0, R))[:, None].to(tl.int64) * C + cols[None, :]
        tl.store(dx + offs, tl.load(x + offs) + tl.load(dy + offs))


def stand_in(x, dy, dx, front):
    S, C = x.shape
    run = 256
    return lambda: walk[(S // run, C // 256)](x, dy, dx, C, S // run, RUN=run, PIECE=16, FRONT=front, BC=256, R=4,
                                              num_warps=1)


if __name__ == "__main__":
    main()
