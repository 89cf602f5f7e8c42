#!/usr/bin/env python3
"""Backward benchmark of ``cake_causal_conv1d_train_backward`` against copy bandwidth and peers.

Bytes: x and dy read + dx written = 6*S*C (BF16), the floor (dweight, dbias and the workspace are
O(C)); the copy ceiling copies 3*S*C bytes. Ours: the raw backward with dx/dweight/dbias and the
workspace given, silu_grad_preactivation="bf16" unless --policy. The peers are timed on their
backward only (a forward per input set, then ``torch.autograd.grad(y, (x, weight, bias), dy,
retain_graph=True)``): ours-ag (our autograd entry ``cake_causal_conv1d``), fla (fla's Triton
``causal_conv1d`` with precomputed chunk indices: its backward recomputes the pre-activation, runs
its backward kernel and two sums), fla-gluon (its fused Gluon backward), dao (when installed),
eager and compile (the FP32 reference; torch.compile with dynamic shapes unless
--compile-static). Suite as bench_fwd.py's; the peers are checked with a looser tolerance. Small
shapes: graph replays of ours and of fla's raw ``causal_conv1d_bwd``. Host: the raw backward and
forward, the autograd entry, the custom ops, autograd.grad through ours-ag, fla, fla-gluon and
torch's silu. Goals: >= 80 % of copy at S*C >= 32 M (C >= 256), >= 1.3x fla; the narrow rows at
S >= 1 M (issue 17): C = 128 >= 85 %, C = 64 >= 75 %, C <= 16 >= 50 %.

    python3 scripts/bench_bwd.py                  # full suite (< 4 min on an H200)
    python3 scripts/bench_bwd.py --quick --no-peers --json out.json
"""

from __future__ import annotations

import math

import torch

from bench_harness import (CAKE_ERROR, FLA_MODES, Bench, Goal, PeerForward, Timed, autograd_backward, cake,
                           check_tensors, grads_dict, leaf, main, reference)


def standin_backward(x, weight, cu_seqlens, dy, *, bias=None, silu_grad_preactivation="bf16", workspace=None,
                     dx=None, dweight=None, dbias=None):
    """--smoke-cpu: the FP32 reference behind our backward's signature."""
    grads = reference.causal_conv1d_backward_reference(
        x, weight, cu_seqlens, dy, bias, silu_grad_preactivation=silu_grad_preactivation, dtype=torch.float32)
    return tuple(g.to(like.dtype) if out is None else out.copy_(g)
                 for g, out, like in zip(grads, (dx, dweight, dbias), (x, weight, bias)) if g is not None)


def tolerances(x, w, cu, dy, b, policy: str, dx, dweight, dbias) -> dict:
    """Elementwise tolerances of (dx, dweight, dbias) against the FP64 reference, with a the
    pre-activation and g = dy * silu'(a rounded as `policy` says):

      dx[s]         2^-7 |dx[s]| + sum_j |w_j| (2^-7 |g[t]| + 2^-8 |dy[t] a[t]|) over the taps
                    t = s + j reading s (dx's BF16 rounding, FP32 math, and one BF16 ulp of a:
                    the kernel's FP32 a may round to the other side of a midpoint)
      dweight[c,k]  2^-7 |dweight| + 2^-7 sqrt(sum_t (g x)^2)    (FP32 sums; one token's g off)
      dbias[c]      2^-7 |dbias| + 2^-7 sqrt(sum_t g^2)

    The sums over taps are vector-Jacobian products of the reference pre-activation (linear in x
    and in the taps), so the conv math stays in flashinfer_cake.reference."""
    pre = reference.causal_conv1d_preactivation_reference
    a = pre(x, w, cu, b)
    g = torch.ops.aten.silu_backward(dy.double(), a.to(torch.bfloat16).double() if policy == "bf16" else a)
    h = dy.double().abs_().mul_(a.abs_()).mul_(2.0**-8).add_(g.abs(), alpha=2.0**-7)
    del a
    xl, wl = leaf(torch.zeros_like(x, dtype=torch.float32)), leaf(w.float())
    tap_sum, = torch.autograd.grad(pre(xl, w.abs(), cu, dtype=torch.float32), xl, h.float())
    del h
    g2 = g.square_()
    ssq_w, = torch.autograd.grad(pre(x.float().square(), wl, cu, dtype=torch.float32), wl, g2.float())
    tol = {"dx": tap_sum.add_(dx.abs().float(), alpha=2.0**-7).add_(1e-6),
           "dweight": dweight.abs() * 2.0**-7 + ssq_w.double().sqrt() * 2.0**-7 + 1e-6}
    if dbias is not None:
        tol["dbias"] = dbias.abs() * 2.0**-7 + g2.sum(0).sqrt() * 2.0**-7 + 1e-6
    return tol


TRAINING_CALL = "cake_causal_conv1d fwd (x a recorded op's output; weight, bias accumulators held)"
CLONE_RECORDED = "x.clone(), x a recorded op's output (torch's own node, no AccumulateGrad built)"


class BackwardBench(Bench):
    NAME = "bench_bwd"
    DESCRIPTION = ("Benchmark cake_causal_conv1d_train_backward against copy bandwidth (a copy of 3*S*C bytes = the "
                   "backward's 6*S*C bytes of DRAM traffic) and peers. The last lines of stdout are a compact markdown "
                   "table and the goals. Needs a CUDA GPU (exit code 2 without one, unless --smoke-cpu).")
    BYTES = 6  # x and dy read, dx written
    INPUTS, OUTPUTS = ("x", "dy"), ("dx",)
    WORKSPACE = "cake_causal_conv1d_train_backward_workspace"
    # The order of the runs within a combo: the slow-to-start compile peer last.
    PEERS = ("ours-ag", "fla", "fla-gluon", "dao", "eager", "compile")
    FLA_MODES = {"fla": FLA_MODES["fla+ci"], "fla-gluon": FLA_MODES["fla-gluon"]}
    GRAPH_PEERS = ("fla", "fla-gluon")  # their raw backward
    LOOSE_PEERS = ("fla", "fla-gluon", "dao", "eager", "compile")  # another rounding
    HOST_PEERS, HOST_PEER_SUFFIX = ("ours-ag", "fla", "fla-gluon"), " bwd (autograd.grad, retained graph)"
    HOST_SHORT = {"x.clone()": "clone", "bwd raw (defaults)": "bwd", "bwd raw (dx=, dweight=, dbias=, workspace=)":
                  "bwd(out=)", "fwd raw (defaults)": "fwd", "cake_causal_conv1d fwd (no input requires grad)":
                  "autograd fwd (no grad)", "cake_causal_conv1d fwd (x, weight, bias require grad)": "autograd fwd",
                  "ours-ag bwd (autograd.grad, retained graph)": "autograd bwd", "torch.ops.flashinfer_cake."
                  "causal_conv1d_fwd": "op fwd", "torch.ops.flashinfer_cake.causal_conv1d_bwd": "op bwd",
                  "x.clone(), x a leaf requiring grad (torch's own node)": "clone (grad)", TRAINING_CALL: "autograd fwd "
                  "(training)", CLONE_RECORDED: "clone (grad, recorded x)"}
    HOST_DELTAS = {"custom-op dispatch (fwd op - fwd raw)": ("op fwd", "fwd"),  # what the op and autograd add
                   "autograd entry, no grad (- fwd raw)": ("autograd fwd (no grad)", "fwd"),
                   "autograd entry, grad (- fwd raw)": ("autograd fwd", "fwd"),
                   "custom-op dispatch (bwd op - bwd raw)": ("op bwd", "bwd")}
    CHECK_COLUMNS = {"dx": "dx err", "dweight": "dw err", "dbias": "db err"}
    GOALS = (Goal("pct_copy_large>=80", "pct_copy", 80), Goal("speedup_vs_fla_large>=1.3", "speedup:fla", 1.3),
             Goal("graph_pct_copy_small", "graph_pct_copy", None, (0, math.inf)),
             Goal("pct_copy_C128>=85", "pct_copy", 85, (0, math.inf), (128, 128)),
             Goal("pct_copy_C64>=75", "pct_copy", 75, (0, math.inf), (64, 64)),
             Goal("pct_copy_C<=16>=50", "pct_copy", 50, (0, math.inf), (0, 16)),
             Goal("graph_pct_copy_C<=16", "graph_pct_copy", None, (0, math.inf), (0, 16)),
             *(Goal(f"speedup_vs_{p}_large", f"speedup:{p}") for p in ("ours-ag", "fla-gluon", "dao", "eager",
                                                                        "compile")))
    TARGET_MS, MAX_REPS, BUDGET_S, COMPILE_DYNAMIC = (30.0, 20.0), 300, 195.0, True
    METHOD = ("ours: raw backward with dx=, dweight=, dbias=, workspace=; peers: forward once per input set, timed "
              "torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True); peer graphs: fla's raw "
              "causal_conv1d_bwd. pct_copy = 100 * copy_ms / ms, the copy moving 3*S*C bytes; gbps = 6*S*C / ms")
    NOTE = ("ours: raw backward ms / % of a same-traffic copy (3·S·C bytes copied = the 6·S·C-byte floor); graph: "
            "graph-replayed kernels as % of a graph-replayed copy; peer cells: peer ms / ours ms × (peer % of copy), "
            "backward only; docs: mix:count.")
    OURS_LABEL, HEADER_EXTRA = "backward, silu_grad_preactivation={policy}", " · policy {policy}"
    PEER_NOTE = "; backward only, forward done once per input set"

    @classmethod
    def add_arguments(cls, p):
        p.add_argument("--policy", choices=("bf16", "fp32"), default="bf16", help="silu_grad_preactivation of "
                       "the timed backward (default bf16; both policies run at the same speed)")

    def __init__(self, args):
        super().__init__(args)
        self.env["policy"] = args.policy
        self.backward = self.pick("cake_causal_conv1d_train_backward", standin_backward)
        if self.standin or cake is None:
            self.peers.absent["ours-ag"] = "skipped in --smoke-cpu" if self.standin else CAKE_ERROR
            self.peers.names = [n for n in self.peers.names if n != "ours-ag"]

    def ours(self, case):
        if self.backward is None:
            return None
        f, pol, xs, dys, dxs = self.backward, self.args.policy, case.sets["x"], case.sets["dy"], case.sets["dx"]
        w, b, cu, ws = case.w, case.b, case.cu, case.ws
        dws = [torch.empty_like(w) for _ in range(case.k)]  # per set: a graph replay rewrites set 0's
        dbs = [None if b is None else torch.empty_like(b) for _ in range(case.k)]
        return Timed(lambda i: f(xs[i], w, cu, dys[i], bias=b, silu_grad_preactivation=pol, workspace=ws, dx=dxs[i],
                                 dweight=dws[i], dbias=dbs[i]), grads_dict, poison=(dxs[0], dws[0], dbs[0]))

    def reference(self, case):
        x, dy, pol = case.sets["x"][0], case.sets["dy"][0], self.args.policy
        dx, dw, db = reference.causal_conv1d_backward_reference(x, case.w, case.cu, dy, case.b,
                                                                silu_grad_preactivation=pol)
        tol = tolerances(x, case.w, case.cu, dy, case.b, pol, dx, dw, db)
        return {"dx": dx.float(), "dweight": dw, "dbias": db, "tol": tol}

    def check(self, got, ref, loose):
        """Within the tolerances (x8 when loose), relative L2 error < 1e-2 (5e-2 loose) per tensor."""
        tol = {n: t * 8 for n, t in ref["tol"].items()} if loose else ref["tol"]
        return check_tensors(got, ref, tol, rel_max=5e-2 if loose else 1e-2)

    def peer(self, name, case):
        def make(w, b):  # the forward on the autograd leaves w, b
            if name != "ours-ag":
                return self.peers.forward(name, w, b, case.cu, case.S, case.cache)
            pol, cu = self.args.policy, case.cu
            return PeerForward(lambda x: cake.cake_causal_conv1d(x, w, cu, b, silu_grad_preactivation=pol))
        timed = autograd_backward(make, case.sets["x"], case.sets["dy"], case.w, case.b)
        if name == "fla-gluon":
            timed.notes = self.peers.gluon_backward_verdict(case.sets["x"][0], case.sets["dy"][0], case.w, case.b,
                                                            case.cu, case.cache)
        return timed

    def peer_graph(self, name, case):
        return self.peers.fla_raw_backward(case.sets["x"], case.sets["dy"], case.w, case.b, case.cu, case.cache)

    def host_candidates(self, case):
        """The raw backward and, on the same shape, the forward's entries: raw, autograd, custom ops."""
        f, pol, x, dy, dx, w, b, cu, ws = (self.backward, self.args.policy, case.sets["x"][0], case.sets["dy"][0],
                                           case.sets["dx"][0], case.w, case.b, case.cu, case.ws)
        y_silu = torch.nn.functional.silu(xl := leaf(x))  # the autograd engine's own cost, through one native op
        cands = [("torch silu bwd (autograd.grad, retained graph)",
                  lambda: torch.autograd.grad(y_silu, xl, dy, retain_graph=True), None)]
        if f is None:
            return cands
        dw, db = torch.empty_like(w), torch.empty_like(b)
        cands += [("bwd raw (defaults)", lambda: f(x, w, cu, dy, bias=b), None),
                  ("bwd raw (dx=, dweight=, dbias=, workspace=)", lambda: f(x, w, cu, dy, bias=b, workspace=ws, dx=dx,
                   dweight=dw, dbias=db, silu_grad_preactivation=pol), None)]
        if self.standin:
            return cands
        fwd, ag, fn, ops = (cake.cake_causal_conv1d_train_forward, cake.cake_causal_conv1d,
                            cake.CakeCausalConv1dFunction, torch.ops.flashinfer_cake)
        y, fws = torch.empty_like(x), cake.cake_causal_conv1d_train_forward_workspace(case.S, case.C, x.device)
        xg, wg, bg = leaf(x), leaf(w), leaf(b)
        # Training: x from a recorded op, the parameters' AccumulateGrad nodes held (as DDP/FSDP/Megatron do).
        xn, wt, bt = leaf(x) * 1, leaf(w), leaf(b)
        held = [t.view_as(t).grad_fn.next_functions[0][0] for t in (wt, bt)]
        return cands + [
            ("x.clone(), x a leaf requiring grad (torch's own node)", lambda: xg.clone(), None),
            (CLONE_RECORDED, lambda: xn.clone(), None),
            (TRAINING_CALL, lambda held=held: ag(xn, wt, cu, bt, silu_grad_preactivation=pol), None),
            ("fwd raw (defaults)", lambda: fwd(x, w, cu, bias=b), None),
            ("fwd raw (out=, workspace=)", lambda: fwd(x, w, cu, bias=b, out=y, workspace=fws), None),
            ("cake_causal_conv1d fwd (no input requires grad)", lambda: ag(x, w, cu, b), None),
            ("cake_causal_conv1d fwd (x, weight, bias require grad)",
             lambda: ag(xg, wg, cu, bg, silu_grad_preactivation=pol), None),
            ("CakeCausalConv1dFunction.apply fwd (x, weight, bias require grad)", lambda: fn.apply(xg, wg, cu, bg, None, False, pol),
             None),
            ("torch.ops.flashinfer_cake.causal_conv1d_fwd", lambda: ops.causal_conv1d_fwd(x, w, cu, b, None, False), None),
            ("torch.ops.flashinfer_cake.causal_conv1d_bwd", lambda: ops.causal_conv1d_bwd(x, w, cu, dy, b, None, None, pol), None)]

if __name__ == "__main__":
    main(BackwardBench)
