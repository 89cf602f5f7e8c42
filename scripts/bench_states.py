#!/usr/bin/env python3
"""Issue 15's per-document conv states and row-strided views against the stateless contiguous calls.

Ours is bench_fwd's call (contiguous, no states); the harness's peer slot carries the configurations
(fp32 taps with bias): fwd+st (initial_states, final_states_out: 4·S·C + 2·num_docs·3·C·2 bytes), fwd-str
(x, out: column slices at column 64 of NaN-padded [S, C + 128] buffers; 4·S·C), copy-str (torch's copy from the
x slice into the out slice as 16-byte elements: what the same sectors cost a copy, fwd-str's floor; 4·S·C), bwd (contiguous, no
states: 6·S·C as bench_bwd counts), bwd+st (initial_states, dfinal_states -> dinitial_states: 6·S·C +
3·num_docs·3·C·2) and bwd-str (x, dy, dx slices; 6·S·C). % of copy: the shape's copy scaled to each one's bytes;
time_ratio (the tables' ×): its time / its direction's stateless contiguous time; fwd-str's over_copy_str: its time /
copy-str's. Checked against the
FP64 reference (final states exactly), the strided ones bitwise against the contiguous kernel: a
mismatch or an error fails the "correct" goal.

    python3 scripts/bench_states.py                  # S·C = 32 M and 64 M, C = 1024..8192, every mix
    python3 scripts/bench_states.py --quick --json out.json
"""

from __future__ import annotations

import statistics

import torch

from bench_harness import (FULL_SHAPES, PEER_VARIANT, QUICK_SHAPES, Bench, Goal, Timed, cake, check_tensors, leaf,
                           main, poison, reference, row_id)

SHAPES = [(32768, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (65536, 1024), (32768, 2048), (16384, 4096),
          (8192, 8192)]
QUICK, PAD, F32 = [(32768, 1024), (8192, 4096), (8192, 8192)], 128, torch.float32


def standin_forward(x, weight, cu, *, bias=None, initial_states=None, final_states_out=None, out=None, workspace=None):
    """--smoke-cpu: the FP32 reference behind our forward's signature."""
    y, fin = reference.causal_conv1d_reference(x, weight, cu, bias, initial_states=initial_states,
                                               return_final_states=True, dtype=F32)
    if final_states_out is not None:
        final_states_out.copy_(fin)
    return y.to(torch.bfloat16) if out is None else out.copy_(y)


def standin_backward(x, weight, cu, dy, *, bias=None, initial_states=None, dfinal_states=None,
                     silu_grad_preactivation="bf16", workspace=None, dx=None, dweight=None, dbias=None,
                     dinitial_states=None):
    """--smoke-cpu: the FP32 reference behind our backward's signature."""
    grads = reference.causal_conv1d_backward_reference(x, weight, cu, dy, bias, initial_states=initial_states,
                                                       dfinal_states=dfinal_states, dtype=F32,
                                                       silu_grad_preactivation=silu_grad_preactivation)
    return tuple(g.to(like.dtype) if out is None else out.copy_(g) for g, out, like in
                 zip(grads, (dx, dweight, dbias, dinitial_states), (x, weight, bias, initial_states)) if g is not None)


def bwd_reference(x, w, cu, dy, b, pol, h0=None, dhn=None) -> dict:
    """The FP64 backward and bench_bwd's tolerances (see tolerances() there) with the taps reading
    initial rows: dx, dinit 2^-7 |ref| + sum over the taps reading the row of |w| (2^-7 |g| + 2^-8
    |dy a|); dweight, dbias 2^-7 |ref| + 2^-7 sqrt(sum_t (g · what the tap read)^2)."""
    pre = reference.causal_conv1d_preactivation_reference
    grads = reference.causal_conv1d_backward_reference(x, w, cu, dy, b, initial_states=h0, dfinal_states=dhn,
                                                       silu_grad_preactivation=pol)
    ref = {n: t for n, t in zip(("out", "dweight", "dbias", "dinit"), grads) if t is not None}
    a = pre(x, w, cu, b, initial_states=h0)
    g = torch.ops.aten.silu_backward(dy.double(), a.to(torch.bfloat16).double() if pol == "bf16" else a)
    h = dy.double().abs_().mul_(a.abs_()).mul_(2.0**-8).add_(g.abs(), alpha=2.0**-7).float()
    xl, hl = leaf(torch.zeros_like(x, dtype=F32)), leaf(None if h0 is None else torch.zeros_like(h0, dtype=F32))
    sums = torch.autograd.grad(pre(xl, w.abs(), cu, initial_states=hl, dtype=F32), [xl] + [hl] * (h0 is not None), h)
    tol = {n: ref[n].abs() * 2.0**-7 + s.double() + 1e-6 for n, s in zip(("out", "dinit"), sums)}
    g2, wl, sq = g.square_(), leaf(w.float()), lambda t: None if t is None else t.float().square()
    ssq_w, = torch.autograd.grad(pre(sq(x), wl, cu, initial_states=sq(h0), dtype=F32), wl, g2.float())
    tol["dweight"] = ref["dweight"].abs() * 2.0**-7 + ssq_w.double().sqrt() * 2.0**-7 + 1e-6
    if b is not None:
        tol["dbias"] = ref["dbias"].abs() * 2.0**-7 + g2.sum(0).sqrt() * 2.0**-7 + 1e-6
    return {**ref, "tol": tol}


class StatesBench(Bench):
    NAME = "bench_states"
    DESCRIPTION = ("Benchmark issue 15's conv states and row-strided views: forward and backward with states and on "
                   "column slices against the stateless contiguous calls (time ratio, % of copy). Default shapes: "
                   "S*C = 32 M and 64 M, C = 1024..8192 (--quick: 3); the configurations run on fp32+b.")
    BYTES, INPUTS, OUTPUTS = 4, ("x", "dy"), ("y", "dx")  # the copy of 4*S*C bytes, scaled per configuration
    WORKSPACE, FLA_MODES = "cake_causal_conv1d_train_forward_workspace", {}
    PEERS, CHECK_COLUMNS = ("fwd+st", "fwd-str", "copy-str", "bwd", "bwd+st", "bwd-str"), {"out": "y/dx err"}
    GOALS = (Goal("fwd+st_pct_copy_large>=90", "pct:fwd+st", 90), Goal("fwd_pct_copy_large>=90", "pct_copy", 90),
             *(Goal(f"{c}_time_ratio_large<=1.03", f"speedup:{c}", 1.03) for c in ("bwd+st", "fwd-str", "bwd-str")),
             Goal("bwd_pct_copy_large>=80", "pct:bwd", 80), Goal("fwd+st_time_ratio_large", "speedup:fwd+st"),
             Goal("fwd-str_over_copy-str_large", "over_copy_str:fwd-str"),
             Goal("bwd+st_pct_copy_large", "pct:bwd+st"))
    BUDGET_S = 0.0  # none: past a budget the harness skips peers, here the configurations
    OURS_LABEL, HEADER_EXTRA = "forward, contiguous, no states", " · policy {policy}"
    METHOD = ("ours: forward with out=, workspace=; peers: the configurations, pct_copy = 100 * copy_ms * bytes / "
              "(4*S*C) / ms, time_ratio (= ours_speedup) = ms / ms of ours (fwd-*) or of bwd (bwd-*)")
    NOTE = ("ours: stateless contiguous forward ms / % of copy; configuration cells: time / its direction's stateless "
            "contiguous time × (% of a copy of its bytes); docs: mix:count.")
    PEER_NOTE = "; ours × = time / the direction's stateless contiguous time"

    @classmethod
    def add_arguments(cls, p):
        p.add_argument("--policy", choices=("bf16", "fp32"), default="bf16", help="the backward's "
                       "silu_grad_preactivation (default bf16)")
        p.set_defaults(variants="fp32+b")  # the harness runs peers (the configurations) on fp32+b only

    def __init__(self, args):
        args.shapes = SHAPES if args.shapes is FULL_SHAPES else QUICK if args.shapes is QUICK_SHAPES else args.shapes
        super().__init__(args)
        self.env["policy"] = args.policy
        self.forward = self.pick("cake_causal_conv1d_train_forward", standin_forward)
        self.backward = self.pick("cake_causal_conv1d_train_backward", standin_backward)
        self.peers.names = self.peers.names if self.forward else []

    def sets(self, case, name: str, strided: bool = False) -> list:
        """case.sets[name], strided copies of it (columns 64.. of NaN-filled [S, C + 128]: rows start
        128-byte aligned, as a slice at a multiple of 64 channels does), or states."""
        if name in ("h0", "dhn"):  # k random BF16 [num_docs, 3, C] per case, the reference's set 0 included
            if name not in case.cache:
                shape, dev = (case.cu.numel() - 1, 3, case.C), case.cu.device
                case.cache[name] = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(case.k)]
            return case.cache[name]
        pad = lambda t: torch.full((case.S, case.C + PAD), float("nan"), dtype=t.dtype, device=t.device)
        return [pad(t)[:, PAD // 2:PAD // 2 + case.C].copy_(t) for t in case.sets[name]] if strided else case.sets[name]

    def ours(self, case):
        f, xs, ys, w, b, cu, ws = self.forward, case.sets["x"], case.sets["y"], case.w, case.b, case.cu, case.ws
        return f and Timed(lambda i: f(xs[i], w, cu, bias=b, out=ys[i], workspace=ws),
                           lambda y: {"cfg": "fwd", "out": y}, poison=(ys[0],))

    def peer(self, name, case):
        """Configuration `name` on set i (the stateless ones exactly bench_fwd's / bench_bwd's call), set 0's
        outputs NaN-poisoned for the harness's checked first call."""
        w, b, cu, k, st, strided = case.w, case.b, case.cu, case.k, "+st" in name, name.endswith("-str")
        xs, h0 = self.sets(case, "x", strided), self.sets(case, "h0") if st else [None] * k
        new = [torch.empty_like(h) for h in h0] if st else [None] * k  # final states or dinitial_states
        if name == "copy-str":
            ys = self.sets(case, "y", strided)
            v16 = lambda t: t.view(torch.complex128)  # noqa: E731  16-byte elements: one per row vector
            timed = Timed(lambda i: (v16(ys[i]).copy_(v16(xs[i])), ys[i])[1], lambda o: {"cfg": name, "out": o},
                          poison=(ys[0],))
        elif name.startswith("fwd"):
            f, ys, ws = self.forward, self.sets(case, "y", strided), case.ws
            kw = [dict(initial_states=h0[i], final_states_out=new[i]) if st else {} for i in range(k)]
            timed = Timed(lambda i: (f(xs[i], w, cu, bias=b, out=ys[i], workspace=ws, **kw[i]), new[i]),
                          lambda o: {"cfg": name, "out": o[0], "final": o[1]}, poison=(ys[0], new[0]))
        else:
            g, pol, dhn = self.backward, self.args.policy, self.sets(case, "dhn") if st else [None] * k
            if not self.standin and "bwd_ws" not in case.cache:
                case.cache["bwd_ws"] = cake.cake_causal_conv1d_train_backward_workspace(case.S, case.C, cu.device)
            dys, dxs, ws = self.sets(case, "dy", strided), self.sets(case, "dx", strided), case.cache.get("bwd_ws")
            dws, dbs = [torch.empty_like(w) for _ in h0], [None if b is None else torch.empty_like(b) for _ in h0]
            kw = [dict(initial_states=h0[i], dfinal_states=dhn[i], dinitial_states=new[i]) if st else {}
                  for i in range(k)]
            keys = ("out", "dweight") + ("dbias",) * (b is not None) + ("dinit",) * st
            timed = Timed(lambda i: g(xs[i], w, cu, dys[i], bias=b, silu_grad_preactivation=pol, workspace=ws,
                                      dx=dxs[i], dweight=dws[i], dbias=dbs[i], **kw[i]),
                          lambda o: {"cfg": name, **dict(zip(keys, o))}, poison=(dxs[0], dws[0], dbs[0], new[0]))
        poison(timed.poison)
        return timed

    def reference(self, case):
        """{configuration: {tensor: FP64 reference, "tol": {tensor: tolerance}}}; for the strided ones the
        contiguous kernel's results with tolerance 0 (bitwise)."""
        x, dy, w, b, cu, pol = case.sets["x"][0], case.sets["dy"][0], case.w, case.b, case.cu, self.args.policy
        h0, dhn = (lambda: self.sets(case, "h0")[0]), (lambda: self.sets(case, "dhn")[0])

        def fwd(h=None):  # bench_fwd's tolerance; the final states exactly
            y, fin = reference.causal_conv1d_reference(x, w, cu, b, initial_states=h, return_final_states=True)
            tol = {"out": y.abs() * 2.0**-7 + 1e-3, **({} if h is None else {"final": 0.0})}
            return {"out": y, "final": fin, "tol": tol}

        def exact(outs):
            ref = dict(zip(("out", "dweight", "dbias"), outs))
            return {**ref, "tol": dict.fromkeys(ref, 0.0)}
        make = {"fwd+st": lambda: fwd(h0()), "bwd": lambda: bwd_reference(x, w, cu, dy, b, pol),
                "copy-str": lambda: exact((x,)),
                "bwd+st": lambda: bwd_reference(x, w, cu, dy, b, pol, h0(), dhn()),
                "fwd-str": lambda: exact((self.forward(x, w, cu, bias=b),)),
                "bwd-str": lambda: exact(self.backward(x, w, cu, dy, bias=b, silu_grad_preactivation=pol))}
        peers = self.peers.names if (case.taps, b is not None) == PEER_VARIANT else ()
        return {"fwd": fwd(), **{n: make[n]() for n in peers}}

    def check(self, got, ref, loose):
        """Within the tolerances of ref[got["cfg"]], relative L2 error < 1e-2."""
        return check_tensors(got, ref[got["cfg"]], ref[got["cfg"]]["tol"], rel_max=1e-2)

    def finish_row(self, row, copy_ms, copy_graph_ms):
        """Each configuration's bytes, GB/s, % of the copy scaled to its bytes, and time_ratio (= ours_speedup,
        the tables' ×): its time / the stateless contiguous time of its direction."""
        super().finish_row(row, copy_ms, copy_graph_ms)
        S, C, nd = row["S"], row["C"], row["ndocs"]
        for name, p in row["peers"].items():
            bwd = name.startswith("bwd")
            base = (row["peers"].get("bwd") if bwd else row["ours"]) or {}
            p["bytes"] = (6 if bwd else 4) * S * C + ("+st" in name) * (3 if bwd else 2) * nd * 3 * C * 2
            ok = "ms" in p and "ms" in base and name != "bwd"
            p["time_ratio"] = p["ours_speedup"] = p["ms"] / base["ms"] if ok else None
            if name == "fwd-str":  # against the copy of the same slices
                floor = row["peers"].get("copy-str", {}).get("ms")
                p["over_copy_str"] = p["ms"] / floor if floor and "ms" in p else None
            if "ms" in p:
                p["gbps"] = p["bytes"] / p["ms"] / 1e6
                p["pct_copy"] = 100 * copy_ms * p["bytes"] / row["bytes"] / p["ms"]  # the copy scaled to its bytes

    def goal_result(self, goal, rows):
        """pct:<configuration> (worst the lowest, pass >= need); speedup:<configuration>, its time_ratio
        (worst the highest, pass <= need); over_copy_str:fwd-str (worst the highest); the harness's for ours."""
        kind, _, name = goal.metric.partition(":")
        if kind not in ("pct", "speedup", "over_copy_str"):
            return super().goal_result(goal, rows)
        key, hi = {"pct": ("pct_copy", False), "speedup": ("time_ratio", True)}.get(kind, (kind, True))
        vals = [(v, r) for r in rows if goal.covers(r) and (v := r["peers"].get(name, {}).get(key)) is not None]
        if not vals:
            return None
        worst, at = (max if hi else min)(vals, key=lambda t: t[0])
        out = {"metric": goal.metric, "worst": worst, "at": row_id(at), "n": len(vals),
               "median": statistics.median(v for v, _ in vals)}
        return out if goal.need is None else {**out, "pass": worst <= goal.need if hi else worst >= goal.need}

    def summarize(self):
        """The harness's goals, "correct" counting the configurations' checks and errors and reference errors."""
        super().summarize()
        c, rows = self.res["goals"]["correct"], self.res["rows"]
        chk = [p["check"] for r in rows for p in r["peers"].values() if p.get("check")]
        c["checked"], c["mismatch"] = c["checked"] + len(chk), c["mismatch"] + sum(not x["ok"] for x in chk)
        c["ours_errors"] += sum("error" in p for r in rows for p in r["peers"].values()) + sum(
            "reference_error" in r for r in rows)
        c["pass"] = not c["mismatch"] and not c["ours_errors"]

    def host_candidates(self, case):
        timed = [("fwd", self.ours(case))] + [(n, self.peer(n, case)) for n in self.peers.names] if self.forward else []
        return [(n, lambda t=t: t.call(0), None) for n, t in timed]


if __name__ == "__main__":
    main(StatesBench)
