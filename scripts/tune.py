#!/usr/bin/env python3
"""Measure tile geometries of the forward or the backward side by side (one GPU run, many builds).

Each config overrides the launcher's CAKE_FWD_* / CAKE_BWD_* defaults (threads, strip length,
ring rows, min CTAs per SM, optionally the channels per thread (backward: 4 or 8; the forward
takes 8 only), then any NAME=VALUE for another CAKE_FWD_NAME / CAKE_BWD_NAME macro) for one
variant (default fp32 taps + fp32 bias); all are built in parallel, then timed against a device
copy of the same DRAM bytes on each shape (forward: read x, write y; backward: read x and dy,
write dx): eager CUDA-event medians over rotated inputs, and for small shapes the kernel time from
a replayed CUDA graph. Every config must give bitwise the same result (the exit code says if not:
an experiment may time a config that computes something else). With --states each config also
runs with per-document states (forward: initial_states and final_states_out; backward:
initial_states and dfinal_states, giving dinitial_states), timed beside its stateless run.

    python scripts/tune.py --op fwd --configs 128/16/8/4,128/16/12/4 [--variant bf16/none] [--json out.json]
    python scripts/tune.py --op bwd --configs 128/64/8/4/4,128/64/8/4/8
    python scripts/tune.py --op bwd --states --configs 128/64/8/4 [--shapes 8192x4096x1,8192x4096x1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from pathlib import Path

import torch

from bench_harness import Dev, measure, measure_graph
from flashinfer_cake import _plan, jit

SHAPES = [(16384, 8192, 16), (65536, 2048, 32), (32768, 4096, 1024), (32768, 4096, 8192),
          (131072, 4096, 32), (1024, 8192, 4), (4096, 4096, 1), (8192, 2048, 512)]


def config_spec(op: str, cfg: str, variant: str) -> jit.JitSpec:
    """The variant's kernel module with the config's -D overrides (its own uri and digest)."""
    threads, strip, ring, min_ctas, *rest = cfg.split("/")
    m = f"-DCAKE_{op.upper()}_"
    extra = [f"{m}{kv}" for kv in rest if "=" in kv]
    vec = [f"{m}VEC={v}" for v in rest if "=" not in v]
    spec = jit.variant_spec(*variant.split("/"), "sm_90a")
    defines = (f"{m}THREADS={threads}", f"{m}STRIP_LEN={strip}", f"{m}RING={ring}", f"{m}MIN_CTAS={min_ctas}", *vec, *extra)
    return dataclasses.replace(spec, uri=f"tune_{op}_{re.sub(r'[^0-9A-Za-z]+', '_', cfg)}", cflags=spec.cflags + defines)


def resource_lines(build_log: str, uri: str) -> list[str]:
    """ptxas's register / spill lines of one config's module, from the prebuild's log."""
    lines, mine = [], False
    for line in build_log.splitlines():
        if line.startswith("["):
            mine = f" {uri}_" in line
        elif mine and ("Used" in line or "spill" in line):
            lines.append(line)
    return lines


# Timing is the benchmarks' (bench_harness): CUDA-event medians, graph replays of 20 calls.
TIMING = argparse.Namespace(target_ms=40.0, min_reps=20, max_reps=200, graph_calls=20)
DEV = Dev(smoke_cpu=False)


def median_ms(fn, k: int) -> float:
    return measure(DEV, fn, k, TIMING)["ms"]


def graph_ms(fn, k: int) -> float:
    return measure_graph(DEV, fn, k, TIMING)[0]["ms"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--configs", required=True, help="threads/strip/ring/min_ctas[/vec][/NAME=VALUE...],...")
    parser.add_argument("--variant", default="fp32/fp32", help="weight/bias dtypes, e.g. bf16/none")
    parser.add_argument("--states", action="store_true", help="also time each config with per-document states")
    parser.add_argument("--shapes", help="SxCxDOCS,... (default: the tuning set)")
    parser.add_argument("--json")
    args = parser.parse_args()
    configs = args.configs.split(",")
    out = Path(tempfile.mkdtemp())
    specs = {c: config_spec(args.op, c, args.variant) for c in configs}
    built = jit.prebuild(list(specs.values()), out, progress=print)  # one parallel ninja run
    mods = {c: jit.core.open_artifact(spec, built[spec]) for c, spec in specs.items()}
    log = (out / "build" / "prebuild" / "build.log").read_text()
    for c, spec in specs.items():
        regs = resource_lines(log, spec.uri)
        used = sorted({r.split("Used ")[1].split(",")[0] for r in regs if "Used" in r})
        spills = sorted({r.strip() for r in regs if "spill" in r and " 0 bytes spill stores" not in r})
        print(c, used, "spills:", spills or "none")
    results, differs = [], []
    dev = torch.cuda.current_device()
    shapes = [tuple(int(v) for v in t.split("x")) for t in args.shapes.split(",")] if args.shapes else SHAPES
    for S, C, docs in shapes:
        k = max(1, int(4e8 // (4 * S * C)) + 1)
        xs = [torch.randn(S, C, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        ys = [torch.empty_like(xs[0]) for _ in range(k)]
        dys = [torch.randn_like(xs[0]) for _ in range(k)] if args.op == "bwd" else None
        dw, db = torch.empty(C, 4, device="cuda"), torch.empty(C, device="cuda")
        item_tokens = _plan.item_tokens(S, C)
        pws = torch.empty(_plan.workspace_bytes(S, C) // 4 + 1, device="cuda")  # any content
        counters = torch.zeros(_plan.counter_bytes(S, C) // 4 + 1, dtype=torch.int32, device="cuda")  # left zero
        wdt, bdt = (torch.bfloat16 if d == "bf16" else torch.float32 for d in args.variant.split("/"))
        w = torch.randn(C, 4, device="cuda", dtype=wdt)
        b = torch.randn(C, device="cuda", dtype=bdt)  # unused by a "none" variant
        cuts = torch.randperm(S - 1, device="cuda")[: docs - 1] + 1
        cu = torch.cat([torch.tensor([0, S], device="cuda"), cuts]).sort().values.int()
        ws = torch.zeros(2, dtype=torch.int32, device="cuda")
        init, fin = (torch.randn(docs, 3, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fin_out = torch.empty_like(init)  # forward: final_states_out; backward: dinitial_states
        row = {"S": S, "C": C, "docs": docs}
        small = S * C <= 16 * 2**20
        # A copy moving the op's DRAM bytes: 4 S C (forward) or 6 S C (backward).
        if args.op == "fwd":
            copy = lambda i: ys[i % k].copy_(xs[i % k])  # noqa: E731
        else:
            src = [torch.empty(3 * S * C // 2, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
            dst = [torch.empty_like(t) for t in src]
            copy = lambda i: dst[i % k].copy_(src[i % k])  # noqa: E731
        row["copy"] = median_ms(copy, k)
        if small:
            row["copy_graph"] = graph_ms(copy, k)
        ref = ref_states = None
        for c, m in mods.items():
            def fwd(i, m=m, states=False):
                stream = torch._C._cuda_getCurrentRawStream(dev)
                st = lambda t: t.data_ptr() if states else 0  # noqa: E731
                if args.op == "fwd":
                    rc = m.causal_conv1d_fwd(x=xs[i % k].data_ptr(), y=ys[i % k].data_ptr(), weight=w.data_ptr(),
                                             bias=b.data_ptr(), cu_seqlens=cu.data_ptr(), workspace=ws.data_ptr(),
                                             initial_states=st(init), final_states=st(fin_out), S=S, C=C, x_row_stride=C,
                                             y_row_stride=C, num_docs=docs, device=dev, stream=stream)
                else:
                    rc = m.causal_conv1d_bwd(x=xs[i % k].data_ptr(), dy=dys[i % k].data_ptr(), dx=ys[i % k].data_ptr(),
                                             weight=w.data_ptr(), bias=b.data_ptr(), cu_seqlens=cu.data_ptr(),
                                             initial_states=st(init), dfinal_states=st(fin), dinitial_states=st(fin_out),
                                             workspace=pws.data_ptr(), workspace_bytes=pws.shape[0] * 4,
                                             counters=counters.data_ptr(), counters_bytes=counters.shape[0] * 4,
                                             dweight=dw.data_ptr(), dbias=db.data_ptr(), S=S, C=C, x_row_stride=C,
                                             dy_row_stride=C, dx_row_stride=C, num_docs=docs,
                                             item_tokens=item_tokens, round_preact=1, device=dev, stream=stream)
                assert rc == 0, m.last_error_message()
            fwd(0)
            if ref is None:
                ref = ys[0].clone()
            if not torch.equal(ys[0], ref):
                differs.append(f"{S}x{C} d{docs}: {c} differs from {configs[0]}")
            row[c] = median_ms(fwd, k)
            if small:
                row[c + " graph"] = graph_ms(fwd, k)
            if args.states:
                fwd(0, states=True)
                if ref_states is None:
                    ref_states = (ys[0].clone(), fin_out.clone())
                if not (torch.equal(ys[0], ref_states[0]) and torch.equal(fin_out, ref_states[1])):
                    differs.append(f"{S}x{C} d{docs}: {c} with states differs from {configs[0]}")
                row[c + " states"] = median_ms(lambda i, f=fwd: f(i, states=True), k)
        results.append(row)
        gb = (4 if args.op == "fwd" else 6) * S * C / 1e6
        cells = " ".join(f"{c}:{row[c] * 1e3:.1f}us({row['copy'] / row[c] * 100:.0f}%)" for c in configs)
        if small:
            cells += " | graph " + " ".join(
                f"{c}:{row[c + ' graph'] * 1e3:.1f}us({row['copy_graph'] / row[c + ' graph'] * 100:.0f}%)" for c in configs)
            cells += f" copy graph {row['copy_graph'] * 1e3:.1f}us"
        if args.states:
            cells += " | states " + " ".join(
                f"{c}:{row[c + ' states'] * 1e3:.1f}us({row[c + ' states'] / row[c]:.3f}x)" for c in configs)
        print(f"{S}x{C} d{docs} copy {row['copy'] * 1e3:.1f}us {gb / row['copy']:.0f}GB/s | {cells}", flush=True)
        del xs, ys
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if differs:
        raise SystemExit("NOT BITWISE EQUAL:\n" + "\n".join(differs))


if __name__ == "__main__":
    main()
