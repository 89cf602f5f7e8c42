#!/usr/bin/env python3
"""Measure tile geometries of the forward or the backward side by side (one GPU run, many builds).

Each config overrides the launcher's CAKE_FWD_* / CAKE_BWD_* defaults (threads, strip length,
ring rows, min CTAs per SM, optionally the channels per thread (backward: 4 or 8; the forward
takes 8 only), then any NAME=VALUE for another CAKE_FWD_NAME / CAKE_BWD_NAME macro) for one
variant (default fp32 taps + fp32 bias); all are built in parallel, then timed against a device
copy of the same DRAM bytes on each shape (forward: read x, write y; backward: read x and dy,
write dx): eager CUDA-event medians over rotated inputs, and for small shapes the kernel time from
a replayed CUDA graph. Every config must give bitwise the same result.

    python scripts/tune.py --op fwd --configs 128/16/8/4,128/16/12/4 [--variant bf16/none] [--json out.json]
    python scripts/tune.py --op bwd --configs 128/64/8/4/4,128/64/8/4/8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import tempfile
from pathlib import Path

import torch

from flashinfer_cake import jit
from flashinfer_cake.jit import env
from flashinfer_cake.jit.module import CompiledModule
from flashinfer_cake.jit.variant import VariantSpec

SHAPES = [(16384, 8192, 16), (65536, 2048, 32), (32768, 4096, 1024), (32768, 4096, 8192),
          (131072, 4096, 32), (1024, 8192, 4), (4096, 4096, 1), (8192, 2048, 512)]


def build(op: str, cfg: str, variant: str, out: Path) -> Path:
    threads, strip, ring, min_ctas, *rest = cfg.split("/")
    m = f"-DCAKE_{op.upper()}_"
    extra = [f"{m}{kv}" for kv in rest if "=" in kv]
    last = [v for v in rest if "=" not in v]
    spec = VariantSpec(*variant.split("/"), "sm_90a")
    src = out / f"tune_{op}_{cfg.replace('/', '_')}.cu"
    src.write_text(spec.source())
    so = src.with_suffix(".so")
    cmd = [str(env.require_nvcc()), *spec.nvcc_flags(), f"-I{env.include_dir()}", "-shared", str(src), "-o", str(so),
           f"{m}THREADS={threads}", f"{m}STRIP_LEN={strip}", f"{m}RING={ring}", f"{m}MIN_CTAS={min_ctas}",
           *([f"{m}VEC={last[0]}"] if last else []), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cfg}: {proc.stderr}")
    regs = [line for line in proc.stderr.splitlines() if "Used" in line or "spill" in line]
    return so, regs


def median_ms(fn, reps: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    for i in range(reps):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]


def graph_ms(fn, calls: int = 20, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return median_ms(lambda i: g.replay(), reps) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--configs", required=True, help="threads/strip/ring/min_ctas[/vec][/NAME=VALUE...],...")
    parser.add_argument("--variant", default="fp32/fp32", help="weight/bias dtypes, e.g. bf16/none")
    parser.add_argument("--json")
    args = parser.parse_args()
    configs = args.configs.split(",")
    out = Path(tempfile.mkdtemp())
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
        builds = dict(zip(configs, pool.map(lambda c: build(args.op, c, args.variant, out), configs)))
    mods = {c: CompiledModule(so) for c, (so, _) in builds.items()}
    for c, (_, regs) in builds.items():
        used = sorted({r.split("Used ")[1].split(",")[0] for r in regs if "Used" in r})
        spills = sorted({r.strip() for r in regs if "spill" in r and " 0 bytes spill stores" not in r})
        print(c, used, "spills:", spills or "none")
    results = []
    dev = torch.cuda.current_device()
    for S, C, docs in SHAPES:
        k = max(1, int(4e8 // (4 * S * C)) + 1)
        xs = [torch.randn(S, C, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        ys = [torch.empty_like(xs[0]) for _ in range(k)]
        dys = [torch.randn_like(xs[0]) for _ in range(k)] if args.op == "bwd" else None
        dw, db = torch.empty(C, 4, device="cuda"), torch.empty(C, device="cuda")
        item_tokens, ws_bytes = jit.load_binding().backward_plan(S, C)
        pws = torch.zeros(ws_bytes // 4 + 1, device="cuda")  # zero between launches
        wdt, bdt = (torch.bfloat16 if d == "bf16" else torch.float32 for d in args.variant.split("/"))
        w = torch.randn(C, 4, device="cuda", dtype=wdt)
        b = torch.randn(C, device="cuda", dtype=bdt)  # unused by a "none" variant
        cuts = torch.randperm(S - 1, device="cuda")[: docs - 1] + 1
        cu = torch.cat([torch.tensor([0, S], device="cuda"), cuts]).sort().values.int()
        ws = torch.zeros(2, dtype=torch.int32, device="cuda")
        row = {"S": S, "C": C, "docs": docs}
        small = S * C <= 16 * 2**20
        # A copy moving the op's DRAM bytes: 4 S C (forward) or 6 S C (backward).
        if args.op == "fwd":
            copy = lambda i: ys[i % k].copy_(xs[i % k])  # noqa: E731
        else:
            src = [torch.empty(3 * S * C // 2, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
            dst = [torch.empty_like(t) for t in src]
            copy = lambda i: dst[i % k].copy_(src[i % k])  # noqa: E731
        row["copy"] = median_ms(copy, 50)
        if small:
            row["copy_graph"] = graph_ms(copy)
        ref = None
        for c, m in mods.items():
            def fwd(i, m=m):
                stream = torch._C._cuda_getCurrentRawStream(dev)
                if args.op == "fwd":
                    rc = m.causal_conv1d_fwd(xs[i % k].data_ptr(), ys[i % k].data_ptr(), w.data_ptr(), b.data_ptr(),
                                             cu.data_ptr(), ws.data_ptr(), S, C, docs, dev, stream)
                else:
                    rc = m.causal_conv1d_bwd(xs[i % k].data_ptr(), dys[i % k].data_ptr(), ys[i % k].data_ptr(),
                                             w.data_ptr(), b.data_ptr(), cu.data_ptr(), pws.data_ptr(),
                                             pws.shape[0] * 4, dw.data_ptr(), db.data_ptr(), S, C, docs,
                                             item_tokens, 1, dev, stream)
                assert rc == 0, m.last_error_message()
            fwd(0)
            if ref is None:
                ref = ys[0].clone()
            assert torch.equal(ys[0], ref), f"{c} differs from {configs[0]}"
            row[c] = median_ms(fwd, 50)
            if small:
                row[c + " graph"] = graph_ms(fwd)
        results.append(row)
        gb = (4 if args.op == "fwd" else 6) * S * C / 1e6
        cells = " ".join(f"{c}:{row[c] * 1e3:.1f}us({row['copy'] / row[c] * 100:.0f}%)" for c in configs)
        if small:
            cells += " | graph " + " ".join(
                f"{c}:{row[c + ' graph'] * 1e3:.1f}us({row['copy_graph'] / row[c + ' graph'] * 100:.0f}%)" for c in configs)
            cells += f" copy graph {row['copy_graph'] * 1e3:.1f}us"
        print(f"{S}x{C} d{docs} copy {row['copy'] * 1e3:.1f}us {gb / row['copy']:.0f}GB/s | {cells}", flush=True)
        del xs, ys
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
