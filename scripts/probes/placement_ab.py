"""tune.py's backward configs timed at the same random placements of x, dy and dx (session 74).
The backward's time back to back depends on where dx lies (bwd_placement.py), so an A/B on one allocation
samples one placement. Here each of N placements (offsets in one arena as in bwd_placement.py; the first
back to back) times every config in a shuffled order on the same buffers (medians of 15 per-call CUDA
events, one document), checks dx bitwise against the first config timed, and prints per config the
min / median / max and the per-placement ratio to the first config. Extra arguments go to tune.py.
    python3 scripts/probes/placement_ab.py CONFIGS SxC[,SxC...] N [tune.py options, e.g. --inc NAME=DIR]
    python3 scripts/probes/placement_ab.py 128/64/8/4,128/64/8/4/ITEM_TOKENS=512 8192x8192,16384x8192 16"""
import random, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
import tune

configs, shapes, N = sys.argv[1], sys.argv[2], int(sys.argv[3])
args = tune.parse_args(["--op", "bwd", "--configs", configs, "--build-dir", "/tmp/tb", *sys.argv[4:]])
mods = tune.build(args)
SPAN = 16 << 20
rng = random.Random(7)
for shape in shapes.split(","):
    S, C = map(int, shape.split("x"))
    n = S * C
    b = tune.buffers(S, C, 1, 0, args)
    b.xs = b.ys = b.dys = None
    torch.cuda.empty_cache()
    b.k = 1
    arena = torch.empty(3 * (n * 2 + SPAN), dtype=torch.uint8, device="cuda")
    calls = {c: tune.launcher(m, b, "bwd", c) for c, m in mods.items()}
    res = {c: [] for c in calls}
    for k in range(N):
        offs = [0, 0, 0] if k == 0 else [0, rng.randrange(0, SPAN, 4096), rng.randrange(0, SPAN, 4096)]
        v = [arena[i * (n * 2 + SPAN) + o:i * (n * 2 + SPAN) + o + 2 * n].view(torch.bfloat16).view(S, C) for i, o in enumerate(offs)]
        v[0].normal_(); v[1].normal_()
        b.xs, b.dys, b.ys = [v[0]], [v[1]], [v[2]]
        order = list(calls)
        rng.shuffle(order)
        ref = None
        for c in order:
            ev = []
            for i in range(18):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); calls[c](0); e1.record(); ev.append((e0, e1))
            torch.cuda.synchronize()
            res[c].append(statistics.median(a.elapsed_time(z) * 1e3 for a, z in ev[3:]))
            if ref is None:
                ref = v[2].clone()
            elif not torch.equal(ref, v[2]):
                print("DX DIFFERS", c)
        print(shape, offs[1] // 4096, offs[2] // 4096, " ".join(f"{res[c][-1]:7.1f}" for c in calls), flush=True)
    for c in calls:
        r = sorted(res[c])
        print(f"== {shape} {c}: min {r[0]:.1f} median {statistics.median(r):.1f} max {r[-1]:.1f}")
    base = list(calls)[0]
    for c in list(calls)[1:]:
        d = sorted(y / x for x, y in zip(res[base], res[c]))
        print(f"== {shape} {c} / {base}: min {d[0]:.3f} median {statistics.median(d):.3f} max {d[-1]:.3f}")
    del arena, v
    b = None
    torch.cuda.empty_cache()
