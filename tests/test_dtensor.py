"""cake_causal_conv1d on DTensors (tensor parallelism over channels), 2 gloo ranks. On the CPU the custom ops'
kernels are registered from the FP64 reference (the kernels are CUDA-only): the sharding rules and the autograd
path, the same on GPUs, against the reference of the unsharded batch. On a GPU (both ranks on one) the kernels
themselves, against the plain call on the unsharded tensors, with no collective on CUDA tensors: where gloo
scattered (distribute_tensor) and all-gathered (full_tensor) them, both ranks died with SIGSEGV (torch 2.11, H200,
2026-12-05; its broadcast of them did not; pytorch#152645 is a crash of its all-gather on CUDA tensors), and NCCL
takes one GPU per rank. So every rank builds the same global tensors from one seed and distributes them
without a scatter (src_data_rank=None), and each rank compares its own shards with its slices of the result."""

from __future__ import annotations

import textwrap

import pytest
import torch

from test_cp import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from flashinfer_cake import cake_causal_conv1d
    from flashinfer_cake.reference import causal_conv1d_backward_reference, causal_conv1d_reference
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["CP_TEST_STORE"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = json.loads(sys.argv[1])

    device = cfg["device"]
    if device == "cpu":  # the ops' CPU kernels for this test: the reference, rounded to the kernels' output dtypes
        @torch.library.register_kernel("flashinfer_cake::causal_conv1d_fwd", "cpu")
        def _(x, weight, cu, bias, init, return_final_states):
            y, final = causal_conv1d_reference(x, weight, cu, bias, initial_states=init, return_final_states=True)
            return y.to(x.dtype), final.to(x.dtype) if return_final_states else x.new_empty(0)

        @torch.library.register_kernel("flashinfer_cake::causal_conv1d_bwd", "cpu")
        def _(x, weight, cu, dy, bias, init, dfinal, policy):
            dx, dw, db, *dinit = causal_conv1d_backward_reference(x, weight, cu, dy, bias, initial_states=init,
                                                                  dfinal_states=dfinal, silu_grad_preactivation=policy)
            return (dx.to(x.dtype), dw.to(weight.dtype), x.new_empty(0) if bias is None else db.to(bias.dtype),
                    dinit[0].to(init.dtype) if dinit else x.new_empty(0))
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU

    mesh = init_device_mesh(device, (world,))
    g = torch.Generator().manual_seed(cfg["seed"])  # the same global batch on every rank
    cu = torch.tensor(cfg["cu"], dtype=torch.int32, device=device)
    S, C, N = cfg["cu"][-1], cfg["C"], len(cfg["cu"]) - 1
    x = torch.randn(S, C, generator=g).bfloat16().to(device)
    w, b = torch.randn(C, 4, generator=g).to(device), torch.randn(C, generator=g).bfloat16().to(device)
    init = torch.randn(N, 3, C, generator=g).bfloat16().to(device)
    dy, dfinal = (t.bfloat16().to(device) for t in (torch.randn(S, C, generator=g), torch.randn(N, 3, C, generator=g)))
    place = {"channels": ([Shard(1)], [Shard(0)], [Shard(2)]), "replicated": ([Replicate()],) * 3,
             "tokens": ([Shard(0)], [Replicate()], [Replicate()])}[cfg["placement"]]
    def dist_t(t, p):  # every rank holds the same t: its shard of it, no scatter
        return distribute_tensor(t, mesh, p, src_data_rank=None)
    xd, wd, bd = (dist_t(t.clone(), p).requires_grad_() for t, p in ((x, place[0]), (w, place[1]), (b, place[1])))
    initd = dist_t(init.clone(), place[2]).requires_grad_()
    cu_arg = cu if cfg["plain_cu"] else DTensor.from_local(cu, mesh, [Replicate()], run_check=False)
    y, final = cake_causal_conv1d(xd, wd, cu_arg, bias=bd, initial_states=initd, return_final_states=True)
    dyd, dfinald = dist_t(dy, place[0]), dist_t(dfinal, place[2])
    torch.autograd.backward([y, final], [dyd, dfinald])
    got = {"y": y, "final": final, "dx": xd.grad, "dweight": wd.grad, "dbias": bd.grad, "dinit": initd.grad}
    if device == "cpu":
        y_want, final_want = causal_conv1d_reference(x, w, cu, b, initial_states=init, return_final_states=True)
        dx, dw, db, dinit = causal_conv1d_backward_reference(x, w, cu, dy, b, initial_states=init, dfinal_states=dfinal)
        want = {"y": y_want.bfloat16(), "final": final_want.bfloat16(), "dx": dx.bfloat16(), "dweight": dw.float(),
                "dbias": db.bfloat16(), "dinit": dinit.bfloat16()}
    else:  # the plain call on the unsharded tensors
        xs, ws, bs, inits = (t.clone().requires_grad_() for t in (x, w, b, init))
        y_want, final_want = cake_causal_conv1d(xs, ws, cu, bias=bs, initial_states=inits, return_final_states=True)
        torch.autograd.backward([y_want, final_want], [dy, dfinal])
        want = {"y": y_want, "final": final_want, "dx": xs.grad, "dweight": ws.grad, "dbias": bs.grad, "dinit": inits.grad}
    def mine(t, placements):  # this rank's part of the global t under a 1-D mesh's placement
        p = placements[0]
        return t.chunk(world, dim=p.dim)[rank] if isinstance(p, Shard) else t
    local = {k: (v.to_local(), mine(want[k], v.placements)) for k, v in got.items()}
    def close(a, b):  # FP32 summation order: 2^-18 per token, far below one term (magnitude ~1: a missing or doubled
        # token fails), and for a BF16 result one rounding of either sum (2^-7 of it)
        rounding = 2.0**-7 if a.dtype == torch.bfloat16 else 0.0
        a, b = a.double(), b.double()
        return bool(((a - b).abs() <= 2.0**-18 * S + rounding * b.abs()).all())
    print(json.dumps({"rank": rank,
                      "placements": {k: [str(p) for p in v.placements] for k, v in got.items()},
                      "equal": {k: a.shape == b.shape and torch.equal(a, b) for k, (a, b) in local.items()},
                      # a channel's dweight / dbias sum in the order of the route its C picks: FP32 summation order
                      "close": {k: a.shape == b.shape and close(a, b) for k, (a, b) in local.items()}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (test_cp.py's workers say why)
""")


# The outputs' placements the sharding rules give (str of a placement: "S(dim)", "R"). A depthwise conv is
# channel-local: channel shards stay channel shards, gradients too.
PLACEMENTS = {"channels": {"y": "S(1)", "final": "S(2)", "dx": "S(1)", "dweight": "S(0)", "dbias": "S(0)", "dinit": "S(2)"},
              "replicated": {k: "R" for k in ("y", "final", "dx", "dweight", "dbias", "dinit")}}


def placements_of(result) -> dict[str, str]:
    return {k: "".join(v) for k, v in result["placements"].items()}


@pytest.mark.parametrize("placement, plain_cu, want", [
    ("channels", True, PLACEMENTS["channels"]),
    ("replicated", False, PLACEMENTS["replicated"]),
    # tokens sharded (context parallelism's job, flashinfer_cake.cp): DTensor gathers them first, the result is exact
    ("tokens", True, None),
])
def test_dtensor_placements_give_the_unsharded_result(placement, plain_cu, want, tmp_path):
    """y, the final states and every gradient equal the reference of the unsharded batch (the CPU kernels are the
    reference, so bitwise), with the placements the sharding rules give; a plain cu_seqlens is taken as replicated."""
    cfg = {"seed": 7, "cu": [0, 1, 4, 4, 13, 30], "C": 32, "placement": placement, "plain_cu": plain_cu,
           "device": "cpu"}
    for result in run_ranks(2, cfg, str(tmp_path / "store"), timeout=120, worker=_WORKER):
        assert all(result["equal"].values()) and all(result["close"].values()), result
        if want is not None:
            assert placements_of(result) == want, result


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["channels", "replicated"])
def test_dtensor_placements_on_a_gpu_give_the_plain_calls_result(placement, tmp_path):
    """The kernels through DTensors (2 ranks on one GPU, gloo) against the plain call on the unsharded tensors: y,
    the final states, dx and dinitial_states bitwise (each channel computed alone); dweight and dbias bitwise when
    replicated, as channel shards within FP32 summation order (2^-18 per token) and one BF16 rounding of dbias (a
    rank's channel count may pick another route, which sums in another fixed order); the placements the CPU test
    checks. (Token shards make DTensor all-gather CUDA
    tensors across the ranks: gloo's all-gather of them crashed here and NCCL needs a GPU per rank, so the CPU
    test covers that rule.)"""
    cfg = {"seed": 11, "cu": [0, 1, 4, 4, 13, 3000, 3001, 4100], "C": 256, "placement": placement, "plain_cu": True,
           "device": "cuda"}
    for result in run_ranks(2, cfg, str(tmp_path / "store"), timeout=300, worker=_WORKER):
        exact = ("y", "final", "dx", "dinit") if placement == "channels" else tuple(result["equal"])
        assert all(result["equal"][k] for k in exact) and all(result["close"].values()), result
        assert placements_of(result) == PLACEMENTS[placement], result
