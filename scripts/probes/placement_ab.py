"""tune.py's backward configs timed at the same random placements of x, dy and dx (NOTES_bwd session 74).
The backward's time back to back depends on where its buffers lie (bwd_placement.py, whose arena and placements
this uses), so an A/B on one allocation samples one placement: at one placement a config's ratio to another ranged
0.94-1.05 where its median over placements was 0.96-0.99 (r295). Here each of N placements (the first: all at offset
0) times every config, in a shuffled order, on the same buffers (medians of 15 per-call CUDA events back to back, one
document, FP32 taps + bias), with dx poisoned before each config and checked bitwise against the first config timed
there (a difference fails the run; dweight / dbias may differ by design: ITEM_TOKENS changes their summation order).
Prints per config min / median / max µs and the median over placements of its ratio to the first config listed.
Extra arguments go to tune.py (e.g. --inc NAME=DIR), but --flushed: each config is also timed with an L2 flush
before every call (bwd_placement.flushed_median_us), so that what each loses back to back (session 76: the
backward 15 µs at 65536x1024, torch's add 6) shows per config.
    python3 scripts/probes/placement_ab.py CONFIGS SxC[,SxC...] N [--flushed] [tune.py options]
    python3 scripts/probes/placement_ab.py 128/64/8/4,128/64/8/4/ITEM_TOKENS=512 8192x8192,16384x8192 16"""
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: tune
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune  # noqa: E402
from bwd_placement import arena, flushed_median_us, l2_scratch, median_us, random_pages, views  # noqa: E402


def report(shape, res, what):
    """Per config min / median / max µs, and the median over placements of its ratio to the first config."""
    for c, r in res.items():
        r = sorted(r)
        print(f"== {shape} {c}{what}: min {r[0]:.1f} median {statistics.median(r):.1f} max {r[-1]:.1f}")
    base = next(iter(res))
    for c in list(res)[1:]:
        d = sorted(y / x for x, y in zip(res[base], res[c]))
        print(f"== {shape} {c} / {base}{what}: min {d[0]:.3f} median {statistics.median(d):.3f} max {d[-1]:.3f}")


def main():
    configs, shapes, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rest = sys.argv[4:]
    flushed = "--flushed" in rest
    rest = [a for a in rest if a != "--flushed"]
    args = tune.parse_args(["--op", "bwd", "--configs", configs, "--build-dir", "/tmp/tb", *rest])
    mods = tune.build(args)
    scratch = l2_scratch() if flushed else None
    places, order_rng = random.Random(7), random.Random(8)  # the placements do not depend on the configs
    differs = []
    for shape in shapes.split(","):
        S, C = map(int, shape.split("x"))
        buf = arena(S, C)
        b = tune.buffers(S, C, 1, 0, args, k=1)
        b.xs, b.dys, b.ys = ([v] for v in views(buf, S, C, [0, 0, 0]))  # before the launchers: one may call at once
        calls = {c: tune.launcher(m, b, "bwd", c) for c, m in mods.items()}
        res = {c: [] for c in calls}
        res_fl = {c: [] for c in calls}
        for k in range(n):
            pages = [0, 0, 0] if k == 0 else random_pages(places)
            x, dy, dx = views(buf, S, C, pages)
            x.normal_()
            dy.normal_()
            b.xs[0], b.dys[0], b.ys[0] = x, dy, dx
            order = list(calls)
            order_rng.shuffle(order)
            ref = None
            for c in order:
                timings = [(res[c], median_us)] + ([(res_fl[c], lambda f: flushed_median_us(f, scratch))]
                                                    if flushed else [])
                for into, timing in timings:  # dx poisoned before each timing and checked after it
                    dx.fill_(float("nan"))
                    into.append(timing(lambda: calls[c](0)))
                    if ref is None:
                        ref = dx.clone()
                    elif not torch.equal(ref, dx):
                        differs.append(f"{shape} pages {pages}: {c}'s dx differs from {order[0]}'s")
            print(shape, pages[1:], " ".join(f"{res[c][-1]:7.1f}" for c in calls),
                  *(["flushed"] + [f"{res_fl[c][-1]:7.1f}" for c in calls] if flushed else []), flush=True)
        report(shape, res, "")
        if flushed:
            report(shape, res_fl, " flushed")
        buf = b = calls = x = dy = dx = ref = None
        torch.cuda.empty_cache()
    if differs:
        raise SystemExit("NOT BITWISE EQUAL:\n" + "\n".join(differs))


if __name__ == "__main__":
    main()
