"""One rank of tests/test_cp_multi_gpu.py (run by torchrun): every layout x document mix x variant
x SiLU' policy through cake_causal_conv1d_cp, checked against the single-GPU run of the global
batch (computed by every rank): y and dx bitwise, the all-reduced dweight/dbias
within FP32 summation order; then multi, the recompute handle under checkpoint, and (NCCL) the
capture and replay of a two-layer training step. Writes its failures (a list of strings) to
<out>/rank<r>.json; exit 0 when it ran to the end.

    cp_worker.py OUT_DIR [nccl|gloo]

nccl: one GPU per rank. gloo: every rank on the first GPU, the exchanges through gloo's CUDA
collectives (host copies), so the multi-rank path runs on a single GPU too; no graph capture
(gloo's collectives cannot be captured)."""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from test_cp_gpu import MIXES, assert_partials_sum_to, global_cu, inputs, make_partition, single_gpu  # noqa: E402

from flashinfer_cake.cp import CPRecomputeHandle, build_cp_context, cake_causal_conv1d_cp, cake_causal_conv1d_cp_multi  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
VARIANTS = [(w, b) for w in (F32, BF16) for b in (None, F32, BF16)]


def case(rank, P, layout, mix, wd, bd, policy, seed) -> list[str]:
    """The failures of one case on this rank. Every collective runs whatever the checks find (a
    rank that skipped one would pair the next case's exchange with a peer's gradient gather)."""
    rng = random.Random(seed)  # the same on every rank: the same batch and partition
    S, C = 997, 136
    lengths = MIXES[mix](S, rng)
    part = make_partition(lengths, P, layout, rng)
    ctx = build_cp_context(part, dist.group.WORLD, rank, "cuda")
    x, dy, w, b = inputs(S, C, wd, bd, seed)
    cu = torch.tensor(global_cu(lengths), dtype=torch.int32, device="cuda")
    y_ref, dx_ref, dw_ref, db_ref = single_gpu(x, w, b, cu, dy, policy)
    idx = torch.tensor(part.global_tokens(rank), dtype=torch.long, device="cuda")
    xl, wl = x[idx].requires_grad_(), w.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xl, wl, ctx, bl, silu_grad_preactivation=policy)
    y.backward(dy[idx])
    failures = [what for what, ok in (("y differs", torch.equal(y, y_ref[idx])),
                                      ("dx differs", torch.equal(xl.grad, dx_ref[idx]))) if not ok]
    for name, grad, ref, dtype in (("dweight", wl.grad, dw_ref, w.dtype),
                                   ("dbias", None if b is None else bl.grad, db_ref, None if b is None else b.dtype)):
        if grad is None:
            continue
        parts = [torch.empty_like(grad) for _ in range(P)]
        dist.all_gather(parts, grad)
        try:
            assert_partials_sum_to(parts, ref, dtype, S)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    return failures


def multi_recompute_graph(rank, P, capture: bool):
    rng = random.Random(99)
    S = 800
    lengths = MIXES["short"](S, rng)
    part = make_partition(lengths, P, "fragments", rng)
    ctx = build_cp_context(part, dist.group.WORLD, rank, "cuda")
    idx = torch.tensor(part.global_tokens(rank), dtype=torch.long, device="cuda")
    T = idx.numel()
    g = torch.Generator(device="cuda").manual_seed(3)  # parameters first: the same on every rank
    shapes = [(64, F32, None), (32, BF16, BF16), (96, F32, F32)]
    ws = [torch.randn(c, 4, device="cuda", generator=g).to(wd) for c, wd, _ in shapes]
    bs = [None if bd is None else torch.randn(c, device="cuda", generator=g).to(bd) for c, _, bd in shapes]
    C = 64
    w1 = (0.5 * torch.randn(C, 4, device="cuda", generator=g)).requires_grad_()
    w2 = (0.5 * torch.randn(C, 4, device="cuda", generator=g)).requires_grad_()
    g.manual_seed(4 + rank)
    xs = [torch.randn(T, c, device="cuda", generator=g).to(BF16) for c, _, _ in shapes]
    dys = [torch.randn(T, c, device="cuda", generator=g).to(BF16) for c, _, _ in shapes]

    def run(mode):
        lx = [t.clone().requires_grad_() for t in xs]
        if mode == "multi":
            ys = cake_causal_conv1d_cp_multi(lx, ws, ctx, bs)
        elif mode == "separate":
            ys = [cake_causal_conv1d_cp(a, c, ctx, d) for a, c, d in zip(lx, ws, bs)]
        else:  # checkpointed: the recomputations exchange nothing (the backward's exchanges remain)
            hs = [CPRecomputeHandle() for _ in xs]
            fn = lambda a, i: cake_causal_conv1d_cp(a, ws[i], ctx, bs[i], recompute_handle=hs[i])  # noqa: E731
            ys = [torch.utils.checkpoint.checkpoint(fn, a, i, use_reentrant=False) for i, a in enumerate(lx)]
        torch.autograd.backward(ys, dys)
        return [y.detach() for y in ys] + [t.grad for t in lx]

    failures = []
    ref = run("separate")
    for mode in ("multi", "ckpt"):
        if not all(torch.equal(a, c) for a, c in zip(run(mode), ref)):
            failures.append(f"{mode} differs from separate calls")

    if not capture:
        return failures
    # capture and replay of a two-layer step
    xin = torch.empty(T, C, device="cuda", dtype=BF16, requires_grad=True)
    dyin = torch.empty(T, C, device="cuda", dtype=BF16)

    def step():
        cake_causal_conv1d_cp(cake_causal_conv1d_cp(xin, w1, ctx), w2, ctx).backward(dyin)

    def fresh(seed):
        gg = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
        with torch.no_grad():
            xin.copy_(torch.randn(T, C, device="cuda", generator=gg))
            dyin.copy_(torch.randn(T, C, device="cuda", generator=gg))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fresh(0)
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in (xin, w1, w2):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static = (xin.grad, w1.grad, w2.grad)
    for seed in (1, 2):
        fresh(seed)
        graph.replay()
        got = [t.clone() for t in static]
        xe = xin.detach().clone().requires_grad_()
        we1, we2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
        cake_causal_conv1d_cp(cake_causal_conv1d_cp(xe, we1, ctx), we2, ctx).backward(dyin)
        if not all(torch.equal(a, c) for a, c in zip(got, (xe.grad, we1.grad, we2.grad))):
            failures.append(f"graph replay {seed} differs from eager")
    return failures


def main() -> int:
    out_dir, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "nccl")
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=timeout)
    failures, n = [], 0
    try:  # an exception (not a failed check) ends the run: the peers then fail on the process group's timeout
        for layout in ("contiguous", "zigzag", "zigzag_per_document", "fragments"):
            for mix in MIXES:
                for wd, bd in VARIANTS:
                    for policy in ("bf16", "fp32"):
                        n += 1
                        failures += [f"{layout}/{mix}/{wd}/{bd}/{policy}: {f}"
                                     for f in case(rank, P, layout, mix, wd, bd, policy, seed=n)]
        failures += [f"multi/recompute/graph: {f}" for f in multi_recompute_graph(rank, P, backend == "nccl")]
    except Exception:  # noqa: BLE001
        failures.append(traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"cases": n, "failures": failures}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
