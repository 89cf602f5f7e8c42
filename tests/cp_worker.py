"""One rank of tests/test_cp_multi_gpu.py (run by torchrun): every layout x document mix x variant
x SiLU' policy through cake_causal_conv1d_cp, checked against the single-GPU run of the global
batch (computed by every rank): y and dx bitwise, the all-reduced dweight/dbias
within FP32 summation order; then multi, the recompute handle under checkpoint, and (NCCL) the
capture and replay of a two-layer training step (y and the gradients); then the cases a one-rank
group cannot reach: the standalone halo exchanges across ranks, a group other than the default
one, a rank that holds no token, and verify=True contexts (the same ValueError on every rank where
the partitions differ). Writes its failures (a list of strings) to <out>/rank<r>.json; exit 0
when it ran to the end, 1 at once on an exception (after writing it: torchrun then stops the
peers, which may be waiting in a collective). NVLink multicast stays off (NO_MULTICAST, set before
the process group starts), and a rank that runs past WORKER_LIMIT_S dumps its stacks and exits
(a hang inside a replayed graph is invisible to NCCL's watchdog).

    cp_worker.py OUT_DIR [nccl|gloo]

nccl: one GPU per rank. gloo: every rank on the first GPU, the exchanges through gloo's CUDA
collectives (host copies), so the multi-rank path runs on a single GPU too; no graph capture
(gloo's collectives cannot be captured)."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from cp_by_hand import halo_rows, random_fragments  # noqa: E402
from test_cp_gpu import MIXES, assert_partials_sum_to, global_cu, inputs, make_partition, single_gpu  # noqa: E402
from test_cp_multi_gpu import NO_MULTICAST, WORKER_LIMIT_S  # noqa: E402

from flashinfer_cake.cp import (  # noqa: E402
    CPRecomputeHandle,
    build_cp_context,
    cake_causal_conv1d_cp,
    cake_causal_conv1d_cp_multi,
    cp_partition,
    halo_exchange,
    halo_exchange_multi,
)

BF16, F32 = torch.bfloat16, torch.float32
VARIANTS = [(w, b) for w in (F32, BF16) for b in (None, F32, BF16)]


def case(rank, P, layout, mix, wd, bd, policy, seed, group=None, part=None, verify=False) -> list[str]:
    """The failures of one case on this rank (``part``: a partition of the case's batch, else the
    layout's; ``group``: the CP group, else the default one; ``verify``: the context's). Every
    collective runs whatever the checks find (a rank that skipped one would pair the next case's
    exchange with a peer's gradient gather)."""
    rng = random.Random(seed)  # the same on every rank: the same batch and partition
    S, C = 997, 136
    lengths = MIXES[mix](S, rng)
    part = part(lengths, rng) if part else make_partition(lengths, P, layout, rng)
    ctx = build_cp_context(part, group or dist.group.WORLD, rank, "cuda", verify=verify)
    x, dy, w, b = inputs(S, C, wd, bd, seed)
    cu = torch.tensor(global_cu(lengths), dtype=torch.int32, device="cuda")
    y_ref, dx_ref, dw_ref, db_ref = single_gpu(x, w, b, cu, dy, policy)
    idx = torch.tensor(part.global_tokens(rank), dtype=torch.long, device="cuda")
    xl, wl = x[idx].requires_grad_(), w.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    y = cake_causal_conv1d_cp(xl, wl, ctx, bl, silu_grad_preactivation=policy)
    y.backward(dy[idx])
    failures = [what for what, ok in (("y differs", torch.equal(y, y_ref[idx])),
                                      ("dx differs", xl.grad is not None and torch.equal(xl.grad, dx_ref[idx])))
                if not ok]
    for name, leaf, ref in (("dweight", wl, dw_ref), ("dbias", bl, db_ref)):
        if leaf is None:
            continue
        grad = leaf.grad
        if grad is None:  # the contract: every rank's partial, zeros without tokens (gathered anyway: in step)
            failures.append(f"{name}: no gradient on this rank")
            grad = torch.zeros_like(leaf)
        dtype = leaf.dtype
        parts = [torch.empty_like(grad) for _ in range(P)]
        dist.all_gather(parts, grad, group=group)
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
        y = cake_causal_conv1d_cp(cake_causal_conv1d_cp(xin, w1, ctx), w2, ctx)
        y.backward(dyin)
        return y.detach()

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
        y_static = step()
    static = (y_static, xin.grad, w1.grad, w2.grad)
    for seed in (1, 2):
        fresh(seed)
        graph.replay()
        got = [t.clone() for t in static]
        xe = xin.detach().clone().requires_grad_()
        we1, we2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
        ye = cake_causal_conv1d_cp(cake_causal_conv1d_cp(xe, we1, ctx), we2, ctx)
        ye.backward(dyin)
        if not all(torch.equal(a, c) for a, c in zip(got, (ye.detach(), xe.grad, we1.grad, we2.grad))):
            failures.append(f"graph replay {seed} differs from eager (y, dx, dw1, dw2)")
    return failures


def exchanges(rank, P, device="cuda") -> list[str]:
    """halo_exchange / halo_exchange_multi across the ranks (FP64, integer-valued: every sum exact):
    each rank's halos, and each rank's gradient of its rows summed over every rank's halo gradient,
    equal the global batch's (its single-process autograd). (``device``: "cpu" where tests/test_cp.py
    runs it over gloo on the host, so the reference is checked in CI.)"""
    failures = []
    for n, fn in enumerate(("single", "multi")):
        rng = random.Random(7 + n)
        S = 600
        lengths = MIXES["short"](S, rng)
        part = make_partition(lengths, P, "fragments", rng)
        ctx = build_cp_context(part, dist.group.WORLD, rank, device)
        g = torch.Generator(device=device).manual_seed(11 + n)  # the same global tensors on every rank
        widths = (24,) if fn == "single" else (24, 8, 40)
        xg = [torch.randint(-8, 8, (S, c), device=device, generator=g).double().requires_grad_() for c in widths]
        dstates = [[torch.randint(-8, 8, (len(part.fragments[r]), 3, c), device=device, generator=g).double()
                    for c in widths] for r in range(P)]
        ref = [halo_rows(part, x) for x in xg]  # [tensor][rank]
        grads_ref = torch.autograd.grad([h for per in ref for h in per],
                                        xg, [dstates[r][i] for i in range(len(widths)) for r in range(P)])
        idx = torch.tensor(part.global_tokens(rank), dtype=torch.long, device=device)
        xl = [x.detach()[idx].clone().requires_grad_() for x in xg]
        states = [halo_exchange(xl[0], ctx)] if fn == "single" else halo_exchange_multi(xl, ctx)
        grads = torch.autograd.grad(states, xl, dstates[rank])
        for i in range(len(widths)):
            if not torch.equal(states[i], ref[i][rank]):
                failures.append(f"halo_exchange {fn}: tensor {i}'s halos differ")
            if not torch.equal(grads[i], grads_ref[i][idx]):
                failures.append(f"halo_exchange {fn}: tensor {i}'s gradient differs")
    return failures


def other_groups(rank, P) -> list[str]:
    """A CP group that is not the default one (its own communicator), and a rank with no token."""
    group = dist.new_group(list(range(P)))  # every rank calls it, in the same order
    failures = [f"new group: {f}" for f in case(rank, P, "zigzag", "random", F32, F32, "bf16", seed=501, group=group)]
    # the last rank holds nothing; the others hold every document's pieces (any order)
    def no_tokens_on_the_last(lengths, rng):
        frags = random_fragments(lengths, P - 1, rng) + [[]]
        return cp_partition(global_cu(lengths), P, fragments=frags)
    failures += [f"empty rank: {f}" for f in case(rank, P, "fragments", "short", BF16, None, "fp32", seed=502,
                                                  part=no_tokens_on_the_last)]
    return failures


def verified(rank, P) -> list[str]:
    """verify=True over the group: the same partition builds and runs; partitions that differ on one
    rank are the same ValueError on every rank (no rank left in a collective)."""
    failures = [f"verify: {f}" for f in case(rank, P, "zigzag", "random", F32, None, "bf16", seed=601, verify=True)]
    lengths = [300, 200, 100 + (rank == P - 1)]  # the last rank plans one more token
    part = cp_partition(global_cu(lengths), P, "contiguous")
    try:
        build_cp_context(part, dist.group.WORLD, rank, "cuda", verify=True)
        failures.append("verify: partitions that differ were not refused")
    except ValueError as e:
        if "planned different partitions" not in str(e):
            failures.append(f"verify: unexpected message: {e}")
    part = cp_partition(global_cu([300, 200, 100]), P, "contiguous")
    ctx = build_cp_context(part, dist.group.WORLD, rank, "cuda", verify=True)
    # rank 0 asks for the other SiLU' policy: the exchange's sizes stay the same, so a library that stopped
    # refusing would give a wrong result, not a hang
    x, w = torch.randn(part.local_tokens(rank), 64, device="cuda").to(BF16), torch.randn(64, 4, device="cuda")
    try:
        cake_causal_conv1d_cp(x, w, ctx, silu_grad_preactivation="fp32" if rank == 0 else "bf16")
        failures.append("verify: calls that differ were not refused")
    except ValueError as e:
        if "made different calls" not in str(e):
            failures.append(f"verify: unexpected message: {e}")
    return failures


def main() -> int:
    os.environ.update(NO_MULTICAST)
    faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
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

    def report():
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"cases": n, "failures": failures}, f)

    try:
        for layout in ("contiguous", "zigzag", "zigzag_per_document", "fragments"):
            for mix in MIXES:
                for wd, bd in VARIANTS:
                    for policy in ("bf16", "fp32"):
                        n += 1
                        failures += [f"{layout}/{mix}/{wd}/{bd}/{policy}: {f}"
                                     for f in case(rank, P, layout, mix, wd, bd, policy, seed=n)]
        failures += [f"multi/recompute/graph: {f}" for f in multi_recompute_graph(rank, P, backend == "nccl")]
        failures += exchanges(rank, P) + other_groups(rank, P) + verified(rank, P)
    except Exception:  # noqa: BLE001 - not a failed check: this rank stops now, torchrun stops the others
        failures.append(traceback.format_exc())
        report()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    report()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
