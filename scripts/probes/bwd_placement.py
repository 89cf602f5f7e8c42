"""Does the backward's time depend on where x, dy and dx lie relative to each other? (session 74)
bench_states read 16384x4096's contiguous backward bimodal (0.152 / 0.159 ms, H100 r289) between mixes
that differ only in their buffers. Here x, dy and dx are carved out of one arena at random offsets
(multiples of 4 KB below 16 MB past their back-to-back places), and each placement times the backward
(FP32 taps + bias, one document) and torch.add(x, dy, out=dx) over the same three buffers, medians of
per-call CUDA events back to back; and two Triton stand-ins for the memory pattern (dx = x + dy in
512-byte tiles of 256 channels, 4 rows a step): "runs" walks it as the backward's long walks do (a
token group of 1024 rows per channel tile, 4 runs of 256 rows walked at once, so the rows in flight lie
256 rows apart), "front" walks the same rows in 16-row pieces dealt round robin (the rows in flight
are one contiguous front).
    python3 scripts/probes/bwd_placement.py [out.json] [configs per shape]"""
import json, random, statistics, sys
import torch
import triton
import triton.language as tl
import flashinfer_cake as fc

dev = "cuda"
CONFIGS = int(sys.argv[2]) if len(sys.argv) > 2 else 48
SPAN = 16 << 20  # bytes of room past each buffer
rng = random.Random(0)


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


def median_us(fn, calls=15, skip=3):
    ev = []
    for _ in range(calls + skip):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        ev.append((e0, e1))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(z) * 1e3 for a, z in ev[skip:])


out = {"device": torch.cuda.get_device_name(), "rows": []}
for S, C in ((16384, 4096), (65536, 1024), (8192, 8192), (32768, 2048)):
    n = S * C
    arena = torch.empty(3 * (n * 2 + SPAN), dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(S)
    w = torch.randn(C, 4, device=dev, generator=g) * 0.3
    b = torch.randn(C, device=dev, generator=g) * 0.1
    cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
    ws = fc.cake_causal_conv1d_train_backward_workspace(S, C, dev)
    for k in range(CONFIGS):
        offs = [0] + [rng.randrange(0, SPAN, 4096) for _ in range(2)] if k else [0, 0, 0]
        views = []
        for i, o in enumerate(offs):
            start = i * (n * 2 + SPAN) + o
            views.append(arena[start:start + 2 * n].view(torch.bfloat16).view(S, C))
        x, dy, dx = views
        x.normal_(generator=g)
        dy.normal_(generator=g)
        bwd = median_us(lambda: fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx, workspace=ws))
        add = median_us(lambda: torch.add(x, dy, out=dx))
        row = {"shape": f"{S}x{C}", "va": [v.data_ptr() for v in views], "bwd_us": bwd, "add_us": add}
        for name, front in (("runs", False), ("front", True)):
            fn = stand_in(x, dy, dx, front)
            if k == 0:
                dx.fill_(float("nan"))
                fn()
                assert torch.allclose(dx.float(), x.float() + dy.float(), rtol=1e-2, atol=1e-2), name
            row[f"{name}_us"] = median_us(fn)
        out["rows"].append(row)
        print(f"{S}x{C} dy-x {(row['va'][1] - row['va'][0]) % (64 << 20):>9d} dx-x "
              f"{(row['va'][2] - row['va'][0]) % (64 << 20):>9d}  bwd {bwd:7.1f}  add {add:7.1f}  "
              f"runs {row['runs_us']:7.1f}  front {row['front_us']:7.1f}", flush=True)
    del arena, views, x, dy, dx
    torch.cuda.empty_cache()
    rs = [r for r in out["rows"] if r["shape"] == f"{S}x{C}"]
    for key in ("bwd_us", "add_us", "runs_us", "front_us"):
        v = sorted(r[key] for r in rs)
        print(f"== {S}x{C} {key}: min {v[0]:.1f} median {statistics.median(v):.1f} max {v[-1]:.1f}", flush=True)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
