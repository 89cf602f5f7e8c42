#!/usr/bin/env python3
"""Per-rank time of the context-parallel conv (flashinfer_cake.cp) against the single-GPU kernel
on the same local shard and against fla's causal_conv1d_cp (fla-core 0.6), under torchrun.

For each shape (T tokens per rank x C channels x D documents in the global batch of P·T tokens,
contiguous layout, FP32 taps with bias, seed shared by the ranks): the forward and the
forward+backward (autograd, dy given) of
  single: cake_causal_conv1d on the rank's shard alone (its fragments as documents: no exchange),
  cp:     cake_causal_conv1d_cp (the exchange, the head and tail passes),
  fla:    fla.modules.causal_conv1d.cp.causal_conv1d_cp (triton backend, activation="silu"),
eager (median of CUDA-event times per call, every rank the same reps) and, for ours, graph-replayed
(host time removed). cp overhead = cp - single. Every rank checks its cp y and dx bitwise against
the single-GPU run of the global batch (computed on every rank) before timing. Rank 0 prints every
rank's row and the slowest rank's times (the group's step waits for it: in the contiguous layout
rank 0's fragments never continue a document, the others' do), and rewrites --json after each
shape. NVLink multicast is off in every rank (NO_MULTICAST, set before NCCL starts); a collective
that hangs fails after 120 s.
Two passes: ours on every shape, then fla on the same shapes, so a peer that fails or hangs on one
rank (its collectives then mismatch) costs fla's figures only; fla stops on every rank once any
rank's call failed. --deadline-s: no shape starts after that many seconds (the ranks agree on the
slowest one's clock), so a device call's limit leaves the table and the JSON of what ran.

    torchrun --nproc-per-node 2 scripts/bench_cp.py [--quick] [--deadline-s S] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench_harness import NO_GPU, NO_MULTICAST, Dev, environment, fmt_err, log

import flashinfer_cake as cake
from flashinfer_cake import cp

FULL = [(t, c, d) for t in (4096, 16384, 65536) for c in (2048, 4096, 8192) for d in (1, 16, 1024)]
QUICK = [(4096, 4096, 16), (16384, 4096, 1), (16384, 4096, 1024), (65536, 2048, 16)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK)} shapes instead of {len(FULL)}")
    p.add_argument("--shapes", help="TxCxD,... (tokens per rank x channels x documents)")
    p.add_argument("--reps", type=int, default=40, help="timed calls per measurement (the same on every rank)")
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--deadline-s", type=float, default=float("inf"), help="start no shape after this many seconds")
    p.add_argument("--json", help="results (rank 0)")
    return p.parse_args(argv)


def lengths_of(total: int, docs: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(docs - 1))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def timed(dev: Dev, fn, reps: int) -> float:
    """Median ms per call; every rank runs the same calls (they meet in the collectives)."""
    for _ in range(3):
        fn()
    dev.sync()
    dist.barrier()
    return statistics.median(dev.time_reps(lambda i: fn(), 1, reps))


def graph_timed(dev: Dev, make_fn, calls: int, reps: int) -> float:
    """Median ms per call of make_fn()'s calls replayed from one graph (make_fn makes its leaf
    tensors on the capture's side stream: autograd keeps a leaf's stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn = make_fn()
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return timed(dev, g.replay, reps) / calls


def fla_cp_forward(group, cu_global):
    from fla.modules.causal_conv1d.cp import causal_conv1d_cp
    from fla.ops.cp import build_cp_context as fla_context
    ctx = fla_context(cu_global, group, conv1d_kernel_size=4, cu_seqlens_cpu=cu_global.cpu())
    return lambda x, w, b: causal_conv1d_cp(x.unsqueeze(0), w, b, activation="silu", cp_context=ctx)


def setup(dev, T, C, D, rank, P, group) -> argparse.Namespace:
    """One shape's global batch (the same on every rank), partition, context and this rank's shard."""
    rng = random.Random(T * 7 + C * 13 + D)
    lengths = lengths_of(P * T, D, rng)
    cu_global = [0]
    for n in lengths:
        cu_global.append(cu_global[-1] + n)
    s = argparse.Namespace(T=T, C=C, D=D, cu_global=cu_global)
    s.part = cp.cp_partition(cu_global, P, "contiguous")
    s.ctx = cp.build_cp_context(s.part, group, rank, dev.device)
    gen = torch.Generator(device="cuda").manual_seed(1234 + T + C + D)
    s.x_global = torch.randn(P * T, C, device="cuda", generator=gen).to(torch.bfloat16)
    s.dy_global = torch.randn(P * T, C, device="cuda", generator=gen).to(torch.bfloat16)
    s.w = (0.5 * torch.randn(C, 4, device="cuda", generator=gen)).requires_grad_()
    s.b = (0.5 * torch.randn(C, device="cuda", generator=gen)).requires_grad_()
    s.idx = torch.tensor(s.part.global_tokens(rank), device="cuda")
    s.x = s.x_global[s.idx].requires_grad_()
    s.dy = s.dy_global[s.idx]
    s.cu_dev = torch.tensor(cu_global, dtype=torch.int32, device="cuda")
    return s


def run_ours(dev, args, s: argparse.Namespace, rank: int) -> dict:
    """This rank's row of one shape: the bitwise check, then single and cp, eager and graph-replayed."""
    ctx, x, w, b, dy, idx = s.ctx, s.x, s.w, s.b, s.dy, s.idx
    row = {"T": s.T, "C": s.C, "docs": s.D, "rank": rank, "fragments": ctx.num_fragments}

    # correctness first: bitwise vs the single-GPU global run
    xg = s.x_global.clone().requires_grad_()
    yg = cake.cake_causal_conv1d(xg, w, s.cu_dev, b)
    dxg, = torch.autograd.grad(yg, xg, s.dy_global)
    xc = x.detach().clone().requires_grad_()
    y = cp.cake_causal_conv1d_cp(xc, w, ctx, b)
    dx, = torch.autograd.grad(y, xc, dy)
    row["bitwise"] = bool(torch.equal(y, yg.detach()[idx]) and torch.equal(dx, dxg[idx]))

    # forward (no grad) and forward + backward (autograd.grad: nothing accumulates into leaves)
    def calls(leaves):
        xl, wl, bl = leaves
        return {"single_fwd": lambda: cake.cake_causal_conv1d(xl.detach(), wl.detach(), ctx.cu_seqlens, bl.detach()),
                "single_step": lambda: torch.autograd.grad(cake.cake_causal_conv1d(xl, wl, ctx.cu_seqlens, bl),
                                                           leaves, dy),
                "cp_fwd": lambda: cp.cake_causal_conv1d_cp(xl.detach(), wl.detach(), ctx, bl.detach()),
                "cp_step": lambda: torch.autograd.grad(cp.cake_causal_conv1d_cp(xl, wl, ctx, bl), leaves, dy)}

    def fresh_leaves():
        return tuple(t.detach().clone().requires_grad_() for t in (x, w, b))

    eager = calls((x, w, b))
    for name in eager:
        row[name + "_ms"] = timed(dev, eager[name], args.reps)
        row[name + "_graph_ms"] = graph_timed(dev, lambda: calls(fresh_leaves())[name], args.graph_calls, args.reps)
    return add_derived(row)


def run_fla(dev, args, s: argparse.Namespace, group) -> dict:
    """fla's forward and forward+backward times on this rank's shard, or its error."""
    x, w, b, dy = s.x, s.w, s.b, s.dy
    try:
        fwd = fla_cp_forward(group, s.cu_dev)

        def fla_step():
            return torch.autograd.grad(fwd(x, w, b), (x, w, b), dy.unsqueeze(0))

        return {"fla_fwd_ms": timed(dev, lambda: fwd(x.detach(), w.detach(), b.detach()), args.reps),
                "fla_step_ms": timed(dev, fla_step, args.reps)}
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return {"fla_error": fmt_err(e)}


def add_derived(row: dict) -> dict:
    """The CP overhead (cp - single, µs) and the speed-up over fla of a row's times."""
    for k in ("fwd", "step"):
        row[f"overhead_{k}_us"] = 1e3 * (row[f"cp_{k}_ms"] - row[f"single_{k}_ms"])
        row[f"overhead_{k}_graph_us"] = 1e3 * (row[f"cp_{k}_graph_ms"] - row[f"single_{k}_graph_ms"])
        if f"fla_{k}_ms" in row:
            row[f"vs_fla_{k}"] = row[f"fla_{k}_ms"] / row[f"cp_{k}_ms"]
    return row


def slowest(ranks: list[dict]) -> dict:
    """The group's row: each time the slowest rank's (fla's only where every rank has it)."""
    row = {k: ranks[0][k] for k in ("T", "C", "docs")}
    row["rank"] = "max"
    row["fragments"] = max(r["fragments"] for r in ranks)
    row["bitwise"] = all(r["bitwise"] for r in ranks)
    for k in ranks[0]:
        if k.endswith("_ms") and all(k in r for r in ranks):
            row[k] = max(r[k] for r in ranks)
    return add_derived(row)


def table(rows) -> list[str]:
    out = ["| T/rank × C | docs | rank | bitwise | single fwd | cp fwd | +µs (graph) | fla fwd | × fla | single f+b | "
           "cp f+b | +µs (graph) | fla f+b | × fla |", "|" + "---|" * 14]
    for r in rows:
        f = lambda k: f"{r[k]:.4f}" if k in r else "-"  # noqa: E731
        x = lambda k: f"{r[k]:.2f}×" if k in r else "-"  # noqa: E731
        out.append(f"| {r['T']}×{r['C']} | {r['docs']} | {r['rank']} | {'yes' if r['bitwise'] else 'NO'} | "
                   f"{f('single_fwd_ms')} | "
                   f"{f('cp_fwd_ms')} | {r['overhead_fwd_us']:+.1f} ({r['overhead_fwd_graph_us']:+.1f}) | "
                   f"{f('fla_fwd_ms')} | {x('vs_fla_fwd')} | {f('single_step_ms')} | {f('cp_step_ms')} | "
                   f"{r['overhead_step_us']:+.1f} ({r['overhead_step_graph_us']:+.1f}) | {f('fla_step_ms')} | "
                   f"{x('vs_fla_step')} |")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(NO_MULTICAST)
    rank, P = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():  # torch.cuda.set_device's own error names neither
        why = (f"{NO_GPU} (this benchmark needs a GPU per rank)" if not torch.cuda.device_count()
               else f"rank {rank} is LOCAL_RANK {local}, but torch sees {torch.cuda.device_count()} CUDA device(s) "
               "(one GPU per rank: torchrun --nproc-per-node at most the GPUs of the machine)")
        print(f"bench_cp.py: {why}", file=sys.stderr, flush=True)
        return 2
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    dev, group = Dev(False), dist.group.WORLD
    fla_ok = not args.no_fla
    if fla_ok:
        try:
            import fla.modules.causal_conv1d.cp  # noqa: F401
        except Exception as e:  # noqa: BLE001
            fla_ok = False
            if rank == 0:
                log(f"fla absent: {fmt_err(e)}")
    shapes = QUICK if args.quick else FULL
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    env = environment(dev, "bench_cp.py") if rank == 0 else None
    start, clock = time.monotonic(), [0.0]  # clock: the slowest rank's seconds at the last gather
    by_shape = {}  # (T, C, D) -> every rank's row

    def gather(row: dict) -> list[dict]:
        row["elapsed_s"] = time.monotonic() - start
        ranks = [None] * P
        dist.all_gather_object(ranks, row)
        clock[0] = max(r["elapsed_s"] for r in ranks)
        return ranks

    def save():
        if rank == 0 and args.json:  # after each shape: a later hang keeps what ran
            rows = [r for ranks in by_shape.values() for r in (*ranks, slowest(ranks))]
            with open(args.json, "w") as f:
                json.dump({"env": env, "world_size": P, "rows": rows}, f, indent=1)

    def out_of_time() -> bool:  # the same answer on every rank: the gathered clocks
        return clock[0] > args.deadline_s

    for T, C, D in shapes:
        if out_of_time():
            break
        ranks = gather(run_ours(dev, args, setup(dev, T, C, D, rank, P, group), rank))
        by_shape[T, C, D] = ranks
        if rank == 0:
            for r in ranks:
                log(f"{T}x{C} docs {D} rank {r['rank']}: " + ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                    if k not in ("T", "C", "docs", "rank")))
        save()
    for (T, C, D), ranks in by_shape.items():  # fla's pass, on the shapes ours ran
        if not fla_ok or out_of_time():
            break
        fla_rows = gather(run_fla(dev, args, setup(dev, T, C, D, rank, P, group), group))
        if any("fla_error" in f for f in fla_rows):
            fla_ok = False  # on every rank alike
            if rank == 0:
                log(f"fla stopped at {T}x{C} docs {D}: " + "; ".join(f.get("fla_error", "ok") for f in fla_rows))
        for r, f in zip(ranks, fla_rows):
            f.pop("elapsed_s", None)
            r.update(f)
            add_derived(r)
        save()
    rows = [r for ranks in by_shape.values() for r in (*ranks, slowest(ranks))]
    if rank == 0:
        print("\n".join([f"## bench_cp · {P} ranks · {torch.cuda.get_device_name()}", *table(rows)]))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
