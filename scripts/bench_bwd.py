#!/usr/bin/env python3
"""Backward benchmark of ``cake_causal_conv1d_train_backward`` against copy bandwidth and peers.

The backward's DRAM floor is x read + dy read + dx written = 6*S*C bytes (BF16; dweight/dbias
and the workspace are O(C)). One run measures, per shape, a device-to-device copy of 3*S*C bytes
(read + write = the same 6*S*C bytes of traffic: the ceiling), this package's raw backward
(preallocated dx/dweight/dbias and workspace, silu_grad_preactivation="bf16" unless --policy),
and every peer that imports. GB/s = 6*S*C / time; % of copy = copy time / our time (the same
convention as bench_fwd.py); peer cells: ours × = peer time / our time.

  ours-ag    this package's autograd entry ``cake_causal_conv1d``: forward once per input set,
             ``torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True)`` timed
  fla        fla 0.6 Triton ``causal_conv1d(..., activation="silu", cu_seqlens=,
             chunk_indices=)`` under autograd the same way (its backward recomputes the
             pre-activation with a forward launch, then runs the backward kernel and two sums;
             chunk indices are precomputed and saved by the forward, so the backward never syncs)
  fla-gluon  the same with fla's opt-in Gluon backend (FLA_CONV_GLUON=1; fused backward)
  dao        Dao's ``causal_conv1d_fn`` (channel-last, per-token seq_idx) under autograd, when
             installed
  eager      autograd of the reference expression of bench_fwd.py (float32 math, bf16 output)
  compile    the same expression under ``torch.compile`` (AOTAutograd's compiled backward;
             dynamic shapes by default, --compile-static for one static compile per shape)

Suite: S x C shapes x document mixes (1 doc, 16-64 random docs, max(1024, S//16) docs, 1-8-token
docs) x taps (FP32, BF16; bias dtype = taps dtype) x bias on/off. Ours runs on every combo, the
peers on the (FP32 taps, bias on) slice. Times are medians of per-call CUDA-event times, with
inputs rotated over enough copies that every timed call reads data that is not in L2. Ours is
checked against a float64 reference backward on every combo (outputs poisoned with NaN first),
the peers on the peer slice with a looser tolerance; a mismatch prints a WARNING, never aborts.
Small shapes also get the kernel time from a replayed CUDA graph (ours, and fla's raw
``causal_conv1d_bwd``), and the run ends with the host overhead of one eager call (the raw
backward, the forward, the autograd entry and the ``torch.ops.flashinfer_cake`` custom ops).

    python3 scripts/bench_bwd.py                  # full suite (< 4 min on an H200)
    python3 scripts/bench_bwd.py --quick          # a few combos
    python3 scripts/bench_bwd.py --shapes 4096x4096,16384x8192 --json out.json --no-peers

The last lines of stdout are a compact markdown table (peer slice) plus a summary; the detailed
tables come before it; ``--json`` gets everything. Reuses bench_fwd.py's helpers (imported from
the same folder), so both scripts time and format the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

FULL_SHAPES = [
    (4096, 4096), (16384, 8192), (32768, 8192), (65536, 2048),
    (32768, 4096), (8192, 2048), (1024, 8192), (131072, 4096),
]
QUICK_SHAPES = [(4096, 4096), (32768, 8192), (1024, 8192)]
MIXES = ("1", "rand", "many", "tiny")
# (taps dtype, bias on); bias dtype = taps dtype.
FULL_VARIANTS = [("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False)]
QUICK_VARIANTS = [("fp32", True), ("bf16", False)]
PEER_VARIANT = ("fp32", True)
# Order = order of the runs within a combo: the slow-to-start compile peer last.
ALL_PEERS = ("ours-ag", "fla", "fla-gluon", "dao", "eager", "compile")
GRAPH_PEERS = ("fla", "fla-gluon")  # raw backward function capturable in a CUDA graph
AUTOGRAD_PEERS = ALL_PEERS
LOOSE_PEERS = ("fla", "fla-gluon", "dao", "eager", "compile")  # other math: looser check
PEER_METHODS = {
    "ours-ag": "cake_causal_conv1d forward once per input set; timed: torch.autograd.grad(y, "
               "(x, weight, bias), dy, retain_graph=True)",
    "fla": "fla causal_conv1d(x[None], w, b, activation='silu', cu_seqlens=, chunk_indices=) "
           "forward once per input set (Triton; FLA_CONV_GLUON=0); timed: autograd.grad as above "
           "(recompute forward + backward kernel + dw/db sums); graph: raw causal_conv1d_bwd",
    "fla-gluon": "as fla with FLA_CONV_GLUON=1 (fused Gluon backward + dw/db reduction)",
    "dao": "causal_conv1d_fn(x channel-last [1, C, S], w, b, seq_idx=, activation='silu') "
           "forward once per input set; timed: autograd.grad as above",
    "eager": "bench_fwd.ref_expr (float32 math, bf16 out) under autograd; timed: autograd.grad",
    "compile": "torch.compile(bench_fwd.ref_expr) under autograd (AOTAutograd compiled "
               "backward); timed: autograd.grad",
}
LARGE_ELEMS = 32 * 2**20
POLICIES = ("bf16", "fp32")

# Filled by _lazy_imports(): torch and bench_fwd (so that --help works without torch).
torch = None
B = None


def _lazy_imports():
    global torch, B
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import torch as _torch
    import bench_fwd as _bench_fwd  # also puts the checkout on sys.path when not installed
    torch, B = _torch, _bench_fwd


def log(msg: str) -> None:
    B.log(msg)


def elapsed() -> float:
    return B.elapsed()


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.replace("×", "x").split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            s, c = part.split("x")
            out.append((int(s), int(c)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}; use SxC, e.g. 4096x4096")
    if not out:
        raise argparse.ArgumentTypeError("no shape given")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark cake_causal_conv1d_train_backward against copy bandwidth (a copy "
                    "of 3*S*C bytes = the backward's 6*S*C bytes of DRAM traffic) and peers "
                    "(our autograd entry, fla, fla gluon, Dao causal-conv1d, eager and "
                    "torch.compile autograd of the reference). The last lines of stdout are a "
                    "compact markdown table and a summary. Needs a CUDA GPU (exit code 2 "
                    "without one, unless --smoke-cpu).")
    p.add_argument("--quick", action="store_true",
                   help="reduced suite: 3 shapes, all 4 doc mixes, ours on (fp32, bias) and "
                        "(bf16, no bias), peers on (fp32, bias)")
    p.add_argument("--json", metavar="PATH", help="write every number and the environment here "
                   "(rewritten after each shape, so a crash keeps what was measured)")
    p.add_argument("--md", metavar="PATH", help="also write the detailed + compact tables here")
    p.add_argument("--shapes", type=parse_shapes, metavar="SxC,...",
                   help="override the shape list, e.g. 4096x4096,16384x8192")
    p.add_argument("--mixes", default=None,
                   help=f"comma list of doc mixes out of {','.join(MIXES)} (default: all)")
    p.add_argument("--variants", default=None,
                   help="comma list of taps/bias variants for ours, e.g. fp32+b,fp32,bf16+b,bf16 "
                        "(default: all four; --quick: fp32+b,bf16)")
    p.add_argument("--policy", choices=POLICIES, default="bf16",
                   help="silu_grad_preactivation of the timed backward (default bf16; both "
                        "policies run at the same speed)")
    p.add_argument("--no-peers", action="store_true", help="time only the copy and ours")
    p.add_argument("--peers", default=",".join(ALL_PEERS),
                   help="comma list of peers to try (default: all of them)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="GPU time aimed at per measurement (reps = target / est. time per call); "
                        "default 30, --quick 20")
    p.add_argument("--min-reps", type=int, default=10, help="(default 10)")
    p.add_argument("--max-reps", type=int, default=300, help="(default 300)")
    p.add_argument("--rot-mb", type=float, default=200.0,
                   help="rotate over k input/output sets with k*6*S*C >= this many MB (L2 is "
                        "~60 MB on an H200)")
    p.add_argument("--graph-max-elems", type=int, default=1 << 24,
                   help="CUDA-graph kernel timing for shapes with S*C <= this (default 16M "
                        "covers 1024x8192, 4096x4096, 8192x2048)")
    p.add_argument("--graph-calls", type=int, default=20,
                   help="backward calls per captured graph (default 20)")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    p.add_argument("--no-peer-graph", action="store_true",
                   help="skip CUDA-graph timings of the peers (fla, fla-gluon raw backward)")
    p.add_argument("--host-shape", type=parse_shapes, default=[(1024, 256)], metavar="SxC",
                   help="shape of the host-overhead loop (default 1024x256)")
    p.add_argument("--host-calls", type=int, default=2000, help="(default 2000)")
    p.add_argument("--no-host", action="store_true", help="skip the host-overhead loop")
    p.add_argument("--check", choices=("all", "shape", "none"), default="all",
                   help="check ours against the float64 reference backward on every combo, on "
                        "the first mix of each shape, or never (default all; peers are checked "
                        "on the peer slice unless none)")
    p.add_argument("--budget-s", type=float, default=195.0,
                   help="soft wall-clock budget: past it, peers and ours' second round are "
                        "skipped (recorded as such); 0 = no budget (default 195)")
    p.add_argument("--compile-static", action="store_true",
                   help="torch.compile the reference once per shape (static shapes) instead of "
                        "once with dynamic shapes (the default here: compiling forward + "
                        "backward per shape costs minutes)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="accepted for symmetry with bench_fwd.py: dynamic is the default here")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="plumbing test on a machine without a GPU: tiny shapes, host timers, no "
                        "graphs, ours replaced by a PyTorch stand-in; numbers are meaningless")
    a = p.parse_args(argv)
    if a.target_ms is None:
        a.target_ms = 20.0 if a.quick else 30.0
    if a.shapes is None:
        a.shapes = QUICK_SHAPES if a.quick else FULL_SHAPES
    a.mixes = tuple(m.strip() for m in a.mixes.split(",")) if a.mixes else MIXES
    for m in a.mixes:
        if m not in MIXES:
            p.error(f"unknown mix {m!r}; choose from {MIXES}")
    if a.variants:
        vs = []
        for v in a.variants.split(","):
            v = v.strip()
            taps, _, b = v.partition("+")
            if taps not in ("fp32", "bf16") or b not in ("", "b"):
                p.error(f"bad variant {v!r}; use fp32+b, fp32, bf16+b, bf16")
            vs.append((taps, b == "b"))
        a.variants = vs
    else:
        a.variants = QUICK_VARIANTS if a.quick else FULL_VARIANTS
    a.peers = () if a.no_peers else tuple(x.strip() for x in a.peers.split(",") if x.strip())
    for x in a.peers:
        if x not in ALL_PEERS:
            p.error(f"unknown peer {x!r}; choose from {ALL_PEERS}")
    for (S, C) in a.shapes:
        if S < 1 or C < 8 or C % 8:
            p.error(f"shape {S}x{C}: need S >= 1 and C a positive multiple of 8")
    return a


def variant_label(taps: str, bias: bool) -> str:
    return taps + ("+b" if bias else "")


# --------------------------------------------------------------------------------------------
# Reference backward and checks
# --------------------------------------------------------------------------------------------

def reference_bwd(x, w, cu, dy, b, policy: str, *, dtype=None, tolerances: bool = True) -> dict:
    """Gradients of the forward ``y = bf16(silu(a))``, ``a[t] = b + sum_k w[:, k] x[t-3+k]``
    (taps inside t's document), computed in ``dtype`` (float64 by default) on x's device.

    With policy "bf16", silu' is evaluated at a rounded to BF16 (the kernel's default). Returns
    dx (float32 [S, C]), dweight (dtype [C, 4]), dbias (dtype [C] or None) and, with
    ``tolerances``, elementwise tolerances for each (see ``check_grads``):

      tol_dx[s]   = 2^-7 |dx[s]| + sum_j |w_j| (2^-7 |g[t]| + 2^-8 |dy[t]| |a[t]|) over the taps
                    that reach s (bf16 rounding of dx, FP32 math, and one BF16 ulp of a)
      tol_dw[c,k] = 2^-7 |dw| + 2^-7 sqrt(sum_t (g x)^2)    (FP32 summation; a BF16 rounding of
      tol_db[c]   = 2^-7 |db| + 2^-7 sqrt(sum_t g^2)        the FP32 pre-activation that lands on
                                                            the other side of a midpoint than the
                                                            FP64 one changes one token's g)
    """
    dtype = dtype or torch.float64
    S, C = x.shape
    pos = B.positions(cu.to(device=x.device, dtype=torch.long), S)
    wd = w.to(dtype)
    xd = x.to(dtype)
    a = xd * wd[:, 3]
    for j in (1, 2, 3):
        if j >= S:
            break
        t = xd[:-j] * wd[:, 3 - j]
        t.masked_fill_(~(pos[j:] >= j).unsqueeze(1), 0.0)
        a[j:] += t
        del t
    if b is not None:
        a += b.to(dtype)
    ap = a.to(torch.bfloat16).to(dtype) if policy == "bf16" else a
    s = torch.sigmoid(ap)
    g = 1.0 - s  # silu'(a) = s (1 + a (1 - s))
    g.mul_(ap).add_(1.0).mul_(s)
    del s, ap
    dyd = dy.to(dtype)
    g.mul_(dyd)
    h = None
    if tolerances:  # per-token error weight; dyd's storage reused
        h = dyd.abs_().mul_(a.abs_())
        h.mul_(2.0 ** -8).add_(g.abs(), alpha=2.0 ** -7)
    del a, dyd
    db = g.sum(0) if b is not None else None
    db_ssq = g.square().sum(0) if (b is not None and tolerances) else None
    dw = torch.zeros(C, 4, device=x.device, dtype=dtype)
    dw_ssq = torch.zeros(C, 4, device=x.device, dtype=dtype)
    p = g * xd
    dw[:, 3] = p.sum(0)
    if tolerances:
        dw_ssq[:, 3] = p.square_().sum(0)
    del p
    dx = g * wd[:, 3]
    wabs = wd.abs()
    tol_dx = h * wabs[:, 3] if tolerances else None
    for j in (1, 2, 3):
        if j >= S:
            break
        keep = (pos[j:] >= j).unsqueeze(1)  # output t = s + j reaches back j tokens
        gm = g[j:].masked_fill(~keep, 0.0)
        p = gm * xd[:-j]
        dw[:, 3 - j] = p.sum(0)
        if tolerances:
            dw_ssq[:, 3 - j] = p.square_().sum(0)
        del p
        dx[:-j] += gm * wd[:, 3 - j]
        del gm
        if tolerances:
            hm = h[j:].masked_fill(~keep, 0.0)
            tol_dx[:-j] += hm * wabs[:, 3 - j]
            del hm
    del g, h, xd
    out = {"dx": dx.float(), "dweight": dw, "dbias": db}
    if tolerances:
        tol_dx.add_(dx.abs(), alpha=2.0 ** -7).add_(1e-6)
        out["tol_dx"] = tol_dx.float()
        out["tol_dweight"] = dw.abs() * 2.0 ** -7 + dw_ssq.sqrt() * 2.0 ** -7 + 1e-6
        if db is not None:
            out["tol_dbias"] = db.abs() * 2.0 ** -7 + db_ssq.sqrt() * 2.0 ** -7 + 1e-6
    del dx
    return out


def check_grads(got: dict, ref: dict, loose: bool = False) -> dict:
    """Compare dx/dweight/dbias with the reference: pass = finite, every element within the
    reference's tolerance (x8 when ``loose``: peers with other rounding, e.g. no BF16 rounding
    of the pre-activation), and relative L2 error < 1e-2 (5e-2 loose) per tensor."""
    f = 8.0 if loose else 1.0
    rel_max = 5e-2 if loose else 1e-2
    res: dict = {"loose": loose}
    ok = True
    for name in ("dx", "dweight", "dbias"):
        r = ref.get(name)
        if r is None:
            continue
        gt = got.get(name)
        if gt is None:
            res[name] = {"ok": False, "missing": True}
            ok = False
            continue
        try:
            gg = gt.detach().reshape(r.shape).to(r.dtype)
            finite = bool(torch.isfinite(gg).all())
            d = gg - r
            del gg
            err = d.abs()
            max_err = float(err.max()) if err.numel() else 0.0
            tol = ref["tol_" + name]
            nbad = int((err > tol * f).sum()) if err.numel() else 0
            del err
            rn = float(r.norm())
            dn = float(d.norm())
            del d
            rel = dn / rn if rn > 0 else dn
            okk = finite and nbad == 0 and rel < rel_max
            res[name] = {"ok": okk, "finite": finite, "max_abs_err": max_err,
                         "n_out_of_tol": nbad, "rel_l2_err": rel}
        except Exception as e:  # e.g. an unexpected shape from a peer: a failed check
            okk = False
            res[name] = {"ok": False, "error": B.fmt_err(e),
                         "got_shape": list(getattr(gt, "shape", []))}
        ok = ok and okk
    res["ok"] = ok
    res["max_abs_err"] = (res.get("dx") or {}).get("max_abs_err")
    return res


def _mismatch_text(chk: dict) -> str:
    parts = []
    for name in ("dx", "dweight", "dbias"):
        c = chk.get(name)
        if not c or c.get("ok"):
            continue
        if c.get("missing"):
            parts.append(f"{name} missing")
        elif c.get("error"):
            parts.append(f"{name}: check failed: {c['error']}")
        else:
            parts.append(f"{name}: max err {c['max_abs_err']:.3g}, rel {c['rel_l2_err']:.3g}, "
                         f"{c['n_out_of_tol']} out of tol, finite={c['finite']}")
    return "; ".join(parts)


def _standin_backward(x, weight, cu_seqlens, dy, *, bias=None, silu_grad_preactivation="bf16",
                      workspace=None, dx=None, dweight=None, dbias=None):
    """--smoke-cpu only: a PyTorch float32 stand-in with the backward's signature."""
    r = reference_bwd(x, weight, cu_seqlens, dy, bias, silu_grad_preactivation,
                      dtype=torch.float32, tolerances=False)
    dx = torch.empty_like(x) if dx is None else dx
    dweight = torch.empty_like(weight) if dweight is None else dweight
    dx.copy_(r["dx"])
    dweight.copy_(r["dweight"])
    if bias is None:
        return dx, dweight
    dbias = torch.empty_like(bias) if dbias is None else dbias
    dbias.copy_(r["dbias"])
    return dx, dweight, dbias


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------

class Impls:
    """Imports: ours, and every peer; absent ones recorded with the reason."""

    def __init__(self, args, dev):
        fmt_err = B.fmt_err
        self.absent: dict[str, str] = {}
        self.versions: dict[str, str | None] = {}
        self.ours = self.ours_ws = self.ours_ag = self.ours_fwd = self.ours_fwd_ws = None
        self.standin = False
        for attr, name, key in (
                ("ours", "cake_causal_conv1d_train_backward", "ours"),
                ("ours_ws", "cake_causal_conv1d_train_backward_workspace", "ours_workspace"),
                ("ours_ag", "cake_causal_conv1d", "ours-ag"),
                ("ours_fwd", "cake_causal_conv1d_train_forward", "ours_forward"),
                ("ours_fwd_ws", "cake_causal_conv1d_train_forward_workspace",
                 "ours_forward_workspace")):
            try:
                mod = __import__("flashinfer_cake", fromlist=[name])
                setattr(self, attr, getattr(mod, name))
            except Exception as e:
                self.absent[key] = fmt_err(e)
        if not dev.cuda:
            self.ours, self.ours_ws, self.standin = _standin_backward, None, True
            self.absent.pop("ours", None)
            self.absent["ours-ag"] = "skipped in --smoke-cpu"
        self.peers = list(args.peers)
        self.fla = self.fla_bwd = self.fla_ci = self.fla_gluon = None
        if any(p.startswith("fla") for p in self.peers):
            try:
                from fla.modules.causal_conv1d import causal_conv1d as fla_conv
                self.fla = fla_conv
                self.versions["fla"] = _dist_version("fla-core") or getattr(
                    sys.modules.get("fla"), "__version__", None)
                from fla.ops.utils import prepare_chunk_indices
                self.fla_ci = prepare_chunk_indices
                try:  # the raw backward (what autograd calls), for the CUDA-graph timing
                    from fla.modules.causal_conv1d import causal_conv1d_bwd
                    self.fla_bwd = causal_conv1d_bwd
                except Exception as e:
                    self.absent["fla_raw_bwd"] = fmt_err(e)
                gl = sys.modules.get("fla.modules.causal_conv1d.backends.gluon")
                if gl is None:
                    self.absent.setdefault(
                        "fla-gluon", "fla's Gluon backend not registered on this machine")
                else:
                    self.fla_gluon = gl
            except Exception as e:
                for p in ("fla", "fla-gluon"):
                    self.absent[p] = fmt_err(e)
        self.dao = None
        if "dao" in self.peers:
            try:
                from causal_conv1d import causal_conv1d_fn
                self.dao = causal_conv1d_fn
                self.versions["dao"] = _dist_version("causal-conv1d") or _dist_version(
                    "causal_conv1d")
            except Exception as e:
                self.absent["dao"] = fmt_err(e)
        self.compiled = None
        if "compile" in self.peers:
            if not dev.cuda:
                self.absent["compile"] = "skipped in --smoke-cpu"
            else:
                try:
                    import torch._dynamo as dynamo
                    for name in ("recompile_limit", "cache_size_limit",
                                 "accumulated_recompile_limit", "accumulated_cache_size_limit"):
                        if hasattr(dynamo.config, name):
                            setattr(dynamo.config, name, 256)
                    with contextlib.suppress(Exception):
                        # backward run repeatedly with retain_graph=True: no donated buffers
                        import torch._functorch.config as fconf
                        if hasattr(fconf, "donated_buffer"):
                            fconf.donated_buffer = False
                    self.compiled = torch.compile(B.ref_expr,
                                                  dynamic=not bool(args.compile_static))
                except Exception as e:
                    self.absent["compile"] = fmt_err(e)
        if not dev.cuda:
            for p in ("fla", "fla-gluon", "dao"):
                if p in self.peers:
                    self.absent.setdefault(p, "skipped in --smoke-cpu")
        if self.ours_ag is None:
            self.absent.setdefault("ours-ag", "cake_causal_conv1d not importable")
        self.peers = [p for p in self.peers if p not in self.absent]
        self.initial_peers = list(self.peers)  # table columns
        self.fail_streak: dict[str, int] = {}
        self.disabled: dict[str, str] = {}  # peer -> reason, after consecutive failures

    def available(self, name: str) -> bool:
        return name in self.peers

    def failed(self, name: str, why: str, limit: int = 2):
        n = self.fail_streak[name] = self.fail_streak.get(name, 0) + 1
        if n >= limit and name not in self.disabled:
            self.disabled[name] = f"skipped after {n} consecutive failures (last: {why[:150]})"
            B.log(f"peer {name}: {self.disabled[name]}")

    def succeeded(self, name: str):
        self.fail_streak[name] = 0


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


@contextlib.contextmanager
def fla_env(name: str | None):
    """fla: Gluon off (even when the user's environment turns it on); fla-gluon: opt in. fla
    reads these variables at every dispatch (autograd's backward thread included)."""
    if name not in ("fla", "fla-gluon"):
        yield
        return
    want = {"FLA_CONV_GLUON": "1"} if name == "fla-gluon" else {"FLA_CONV_GLUON": "0",
                                                               "FLA_GLUON": "0"}
    prev = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


def autograd_peer(impls: Impls, name: str, xs, dys, w, b, cu, ctx: dict, policy: str):
    """Forward once per input set under autograd; returns (call(i) -> grads tuple,
    as_dict(grads) -> {dx, dweight, dbias} in [S, C] / [C, 4] / [C], keep-alive list)."""
    S = xs[0].shape[0]
    k = len(xs)
    wg = _leaf(w)
    bg = _leaf(b)
    xgs = [_leaf(x) for x in xs]
    cu_long = ctx.setdefault("cu_long", cu.long())
    if name == "ours-ag":
        f = impls.ours_ag
        fwd = lambda i: f(xgs[i], wg, cu, bg, silu_grad_preactivation=policy)  # noqa: E731
        gos = dys
    elif name in ("fla", "fla-gluon"):
        if "fla_ci" not in ctx:
            ctx["fla_ci"] = impls.fla_ci(cu_long, 64)
        ci = ctx["fla_ci"]
        f = impls.fla

        def fwd(i):
            y, _ = f(xgs[i][None], wg, bg, activation="silu", cu_seqlens=cu_long,
                     chunk_indices=ci)
            return y
        gos = [dy[None] for dy in dys]
    elif name == "dao":
        if "seq_idx" not in ctx:
            t = torch.arange(S, device=cu.device)
            ctx["seq_idx"] = torch.searchsorted(cu_long[1:].contiguous(), t,
                                                right=True).to(torch.int32)[None]
        seq_idx = ctx["seq_idx"]
        if bg is not None and bg.dtype != w.dtype:
            bg = _leaf(b.to(w.dtype))
        f = impls.dao
        fwd = lambda i: f(xgs[i][None].transpose(1, 2), wg, bg, seq_idx=seq_idx,  # noqa: E731
                          activation="silu")
        gos = [dy[None].transpose(1, 2) for dy in dys]  # [1, C, S] channel-last, like y
    elif name in ("eager", "compile"):
        if "pos" not in ctx:
            ctx["pos"] = B.positions(cu_long, S)
        pos = ctx["pos"]
        f = impls.compiled if name == "compile" else B.ref_expr
        fwd = lambda i: f(xgs[i], wg, bg, pos)  # noqa: E731
        gos = dys
    else:
        raise ValueError(name)
    ys = [fwd(i) for i in range(k)]
    ins = [(xgs[i], wg) + ((bg,) if bg is not None else ()) for i in range(k)]

    def call(i):
        return torch.autograd.grad(ys[i], ins[i], gos[i], retain_graph=True)

    def as_dict(gr):
        return {"dx": gr[0], "dweight": gr[1], "dbias": gr[2] if len(gr) > 2 else None}
    return call, as_dict, [ys, ins, gos]


def fla_raw_call(impls: Impls, xs, dys, w, b, cu, ctx: dict):
    """fla's raw backward (what its autograd Function runs), for CUDA-graph capture."""
    cu_long = ctx.setdefault("cu_long", cu.long())
    if "fla_ci" not in ctx:
        ctx["fla_ci"] = impls.fla_ci(cu_long, 64)
    ci = ctx["fla_ci"]
    f = impls.fla_bwd
    x3 = [x[None] for x in xs]
    dy3 = [dy[None] for dy in dys]

    def call(i):
        return f(x=x3[i], dy=dy3[i], dht=None, weight=w, bias=b, residual=None,
                 initial_state=None, activation="silu", cu_seqlens=cu_long, chunk_indices=ci)

    def as_dict(out):
        return {"dx": out[0], "dweight": out[1], "dbias": out[2]}
    return call, as_dict


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = B.Dev(args.smoke_cpu)
        self.env = B.environment(self.dev)
        self.env["script"] = "bench_bwd.py"
        self.env["policy"] = args.policy
        self.impls = Impls(args, self.dev)
        self.res = {"env": self.env, "config": {}, "absent": self.impls.absent,
                    "versions": self.impls.versions, "ours_is_standin": self.impls.standin,
                    "disabled_peers": self.impls.disabled,
                    "floor": "x read + dy read + dx written = 6*S*C bytes; copy ceiling: a copy "
                             "of 3*S*C bytes (3*S*C read + 3*S*C written); pct_copy = 100 * "
                             "copy_ms / ms; gbps = 6*S*C / ms; ours_speedup = peer ms / ours ms",
                    "peer_methods": PEER_METHODS,
                    "copy_512MiB": None, "shapes": [], "rows": [], "host_overhead": None,
                    "warnings": [], "errors": [], "skipped": [], "summary": None, "timing": {}}
        cfg = {k: v for k, v in vars(args).items()}
        cfg["variants"] = [variant_label(*v) for v in args.variants]
        cfg["shapes"] = [f"{s}x{c}" for s, c in args.shapes]
        cfg["host_shape"] = "%dx%d" % tuple(args.host_shape[0])
        self.res["config"] = cfg
        self.budget_hit = False

    # ---- helpers
    def over_budget(self) -> bool:
        if self.args.budget_s and elapsed() > self.args.budget_s:
            if not self.budget_hit:
                self.budget_hit = True
                log(f"soft budget {self.args.budget_s:.0f}s passed: skipping peers and ours' "
                    "second round from here on")
            return True
        return False

    def warn(self, msg: str):
        self.res["warnings"].append(msg)
        print(f"WARNING: {msg}", flush=True)

    def write_json(self):
        if not self.args.json:
            return
        try:
            path = Path(self.args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(B.clean(self.res), indent=1))
            os.replace(tmp, path)
        except Exception as e:
            print(f"could not write {self.args.json}: {B.fmt_err(e)}", flush=True)

    def free(self):
        if self.dev.cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # ---- copy ceiling
    def copy_large(self, tag: str):
        n = 256 * 2**20 if self.dev.cuda else 2**20  # 512 MiB of bf16 (2 MiB in smoke)
        x = torch.randn(n, device=self.dev.device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        m = B.measure(self.dev, lambda i: y.copy_(x), 1, self.args,
                      reps=100 if self.dev.cuda else 5)
        nbytes = 2 * x.numel() * 2
        out = {"bytes": nbytes, "ms": m["ms"], "gbps": B.gbps(nbytes, m["ms"]), "reps": m["reps"]}
        self.res.setdefault("copy_512MiB_runs", []).append({"when": tag, **out})
        log(f"copy 512 MiB ({tag}): {out['ms']:.4f} ms, {out['gbps']:.0f} GB/s (read+write)")

    # ---- main loop
    def run(self):
        a, impls = self.args, self.impls
        log(f"torch {torch.__version__}, {self.env.get('gpu', 'CPU smoke')}, driver "
            f"{self.env.get('driver')}; ours: "
            f"{'CPU STAND-IN' if impls.standin else 'present' if impls.ours else 'ABSENT'}; "
            f"policy {a.policy}; peers: {', '.join(impls.peers) or 'none'}; absent: "
            f"{', '.join(f'{k} ({v[:80]})' for k, v in impls.absent.items()) or 'none'}")
        if impls.ours is None:
            self.warn(f"ours absent: {impls.absent.get('ours')}")
        torch.manual_seed(a.seed)
        try:
            self.copy_large("start")
        except Exception as e:
            self.res["errors"].append({"where": "copy_large", "error": B.fmt_err(e)})
        try:
            for (S, C) in a.shapes:
                try:
                    self.run_shape(S, C)
                except Exception as e:
                    msg = f"shape {S}x{C} aborted: {B.fmt_err(e)}"
                    self.res["errors"].append({"where": f"{S}x{C}", "error": msg,
                                               "traceback": traceback.format_exc()[-2000:]})
                    print(msg, flush=True)
                    traceback.print_exc()
                self.free()
                self.write_json()
            with contextlib.suppress(Exception):
                self.copy_large("end")
            if not a.no_host:
                self.host_overhead()
        except Exception as e:
            self.res["errors"].append({"where": "run", "error": B.fmt_err(e),
                                       "traceback": traceback.format_exc()[-2000:]})
            traceback.print_exc()
        runs = self.res.get("copy_512MiB_runs", [])
        if runs:
            self.res["copy_512MiB"] = {"gbps": max(r["gbps"] for r in runs),
                                       "gbps_runs": [r["gbps"] for r in runs]}
        try:
            self.res["summary"] = self.summary()
        except Exception as e:
            self.res["errors"].append({"where": "summary", "error": B.fmt_err(e)})
        self.res["timing"]["total_s"] = elapsed()
        self.write_json()
        self.report()
        self.write_json()

    def run_shape(self, S: int, C: int):
        a, dev, impls = self.args, self.dev, self.impls
        nb = 6 * S * C
        k = max(1, math.ceil(a.rot_mb * 1e6 / nb))
        n = S * C
        ncopy = 3 * n // 2  # bf16 elements: 3*S*C bytes read + 3*S*C bytes written
        # One buffer per set holds x then dy; the other dx (and room for the copy's target).
        srcs = [torch.randn(2 * n, device=dev.device, dtype=torch.bfloat16) for _ in range(k)]
        dsts = [torch.empty(ncopy, device=dev.device, dtype=torch.bfloat16) for _ in range(k)]
        xs = [s[:n].view(S, C) for s in srcs]
        dys = [s[n:].view(S, C) for s in srcs]
        dxs = [d[:n].view(S, C) for d in dsts]
        shp = {"S": S, "C": C, "bytes": nb, "k_rot": k}
        self.res["shapes"].append(shp)

        def copy(i):
            return dsts[i].copy_(srcs[i][:ncopy])
        c1 = B.measure(dev, copy, k, a)
        small = S * C <= a.graph_max_elems and dev.cuda and not a.no_graph
        if small:  # graph-replayed kernels are compared with a graph-replayed copy of the bytes
            try:
                cg, _ = B.measure_graph(dev, copy, k, a, a.graph_calls)
                cg.pop("_graph")
                shp["copy_graph_ms"] = cg["ms"]
            except Exception as e:
                shp["copy_graph_error"] = B.fmt_err(e)
        ws = None
        if impls.ours_ws is not None and impls.ours is not None:
            try:
                ws = impls.ours_ws(S, C, dev.device)
            except Exception as e:
                shp["workspace_error"] = B.fmt_err(e)
        w32 = torch.randn(C, 4, device=dev.device, dtype=torch.float32) * 0.5
        b32 = torch.randn(C, device=dev.device, dtype=torch.float32) * 0.5
        taps = {"fp32": (w32, b32), "bf16": (w32.to(torch.bfloat16), b32.to(torch.bfloat16))}
        # Per-set dweight/dbias outputs (tiny): a graph replay rewrites set 0's with set 0's sums.
        douts = {tp: ([torch.empty(C, 4, device=dev.device, dtype=wt.dtype) for _ in range(k)],
                      [torch.empty(C, device=dev.device, dtype=bt.dtype) for _ in range(k)])
                 for tp, (wt, bt) in taps.items()}
        gen = torch.Generator().manual_seed(a.seed * 1000003 + S * 31 + C)
        rows = []
        for mi, mix in enumerate(a.mixes):
            cu = B.make_cu(S, mix, gen).to(dev.device)
            ndocs = cu.numel() - 1
            ctx: dict = {}
            for (tp, has_b) in a.variants:
                w, bfull = taps[tp]
                b = bfull if has_b else None
                dws, dbs = douts[tp]
                if not has_b:
                    dbs = [None] * k
                row = {"S": S, "C": C, "mix": mix, "ndocs": ndocs, "taps": tp, "bias": has_b,
                       "bytes": nb, "ours": None, "ours_graph": None, "check": None,
                       "peers": {}}
                rows.append(row)
                self.res["rows"].append(row)
                do_check = a.check == "all" or (a.check == "shape" and mi == 0)
                is_peer = (tp, has_b) == PEER_VARIANT and not a.no_peers
                ref = None
                if do_check or (is_peer and a.check != "none"):
                    try:
                        ref = reference_bwd(xs[0], w, cu, dys[0], b, a.policy)
                    except Exception as e:
                        row["reference_error"] = B.fmt_err(e)
                        self.warn(f"reference backward failed on {S}x{C} {mix}: {B.fmt_err(e)}")
                        self.free()
                outs = (xs, dys, dxs, dws, dbs)
                self.run_ours(row, outs, w, b, cu, ws, k, ref if do_check else None, round_=1)
                if is_peer:
                    for name in a.peers:
                        self.run_peer(row, name, xs, dys, w, b, cu, ctx, k, ref, small)
                if row["ours"] is not None and not self.over_budget():
                    self.run_ours(row, outs, w, b, cu, ws, k, None, round_=2)
                if small:
                    self.run_ours_graph(row, outs, w, b, cu, ws, k, ref if do_check else None)
                del ref
                self.progress(row, c1["ms"])
            del ctx
        c2 = B.measure(dev, copy, k, a)
        samples = c1["samples"] + c2["samples"]
        shp["copy_ms"] = statistics.median(samples)
        shp["copy_ms_runs"] = [c1["ms"], c2["ms"]]
        shp["copy_gbps"] = B.gbps(nb, shp["copy_ms"])
        shp["copy_reps"] = len(samples)
        for row in rows:  # % of copy needs the copy of this shape: fill in now
            self.finish_row(row, shp["copy_ms"], shp.get("copy_graph_ms"))
        log(f"{S}x{C}: copy of 3·S·C bytes {B.fmt_ms(shp['copy_ms'])} ms = "
            f"{shp['copy_gbps']:.0f} GB/s (runs {B.fmt_ms(c1['ms'])}, {B.fmt_ms(c2['ms'])}), "
            f"k_rot={k}")

    def _ours_call(self, outs, w, b, cu, ws):
        f, pol = self.impls.ours, self.args.policy
        xs, dys, dxs, dws, dbs = outs

        def call(i):
            return f(xs[i], w, cu, dys[i], bias=b, silu_grad_preactivation=pol, workspace=ws,
                     dx=dxs[i], dweight=dws[i], dbias=dbs[i])
        return call

    def _poison(self, outs, i=0):
        xs, dys, dxs, dws, dbs = outs
        for t in (dxs[i], dws[i], dbs[i]):
            if t is not None:
                t.fill_(float("nan"))

    @staticmethod
    def _got(outs, i=0):
        xs, dys, dxs, dws, dbs = outs
        return {"dx": dxs[i], "dweight": dws[i], "dbias": dbs[i]}

    def run_ours(self, row, outs, w, b, cu, ws, k, ref, round_):
        impls, dev = self.impls, self.dev
        if impls.ours is None:
            return
        call = self._ours_call(outs, w, b, cu, ws)
        try:
            if ref is not None:
                self._poison(outs)
                t = time.perf_counter()
                ret = call(0)
                dev.sync()
                row["ours_first_call_s"] = time.perf_counter() - t
                chk = check_grads(self._got(outs), ref)
                xs, dys, dxs, dws, dbs = outs
                chk["returned_out"] = (
                    isinstance(ret, tuple) and len(ret) == (3 if b is not None else 2)
                    and ret[0].data_ptr() == dxs[0].data_ptr()
                    and ret[1].data_ptr() == dws[0].data_ptr())
                row["check"] = chk
                if not chk["ok"]:
                    self.warn(f"ours MISMATCH {row['S']}x{row['C']} {row['mix']}:{row['ndocs']} "
                              f"{variant_label(row['taps'], row['bias'])}: "
                              f"{_mismatch_text(chk)}")
                if not chk["returned_out"]:
                    self.warn(f"ours did not return the given dx/dweight on {row['S']}x{row['C']}")
            m = B.measure(dev, call, k, self.args)
        except Exception as e:
            row.setdefault("ours_errors", []).append(B.fmt_err(e))
            self.warn(f"ours FAILED {row['S']}x{row['C']} {row['mix']} "
                      f"{variant_label(row['taps'], row['bias'])}: {B.fmt_err(e)}")
            with contextlib.suppress(Exception):
                dev.sync()
            return
        if round_ == 1:
            row["ours"] = {"ms_r1": m["ms"], "reps_r1": m["reps"], "samples": m["samples"],
                           "ms": m["ms"], "min_ms": m["min_ms"]}
        elif row["ours"] is not None:
            o = row["ours"]
            o["ms_r2"], o["reps_r2"] = m["ms"], m["reps"]
            o["samples"] = o["samples"] + m["samples"]
            o["ms"] = statistics.median(o["samples"])
            o["min_ms"] = min(o["min_ms"], m["min_ms"])
            o["spread"] = abs(o["ms_r1"] - o["ms_r2"]) / min(o["ms_r1"], o["ms_r2"])

    def run_ours_graph(self, row, outs, w, b, cu, ws, k, ref):
        if self.impls.ours is None or row["ours"] is None:
            return
        call = self._ours_call(outs, w, b, cu, ws)
        try:
            g, _ = B.measure_graph(self.dev, call, k, self.args, self.args.graph_calls)
            graph = g.pop("_graph")
            if ref is not None:  # poison, replay once, the graph must have rewritten set 0
                self._poison(outs)
                graph.replay()
                torch.cuda.synchronize()
                g["check"] = check_grads(self._got(outs), ref)
                if not g["check"]["ok"]:
                    self.warn(f"ours graph-replay MISMATCH {row['S']}x{row['C']} {row['mix']} "
                              f"{variant_label(row['taps'], row['bias'])}: "
                              f"{_mismatch_text(g['check'])}")
            del graph
            row["ours_graph"] = g
        except Exception as e:
            row["ours_graph"] = {"error": B.fmt_err(e)}
            self.warn(f"ours graph FAILED {row['S']}x{row['C']} {row['mix']}: {B.fmt_err(e)}")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()

    def run_peer(self, row, name, xs, dys, w, b, cu, ctx, k, ref, small):
        impls = self.impls
        if not impls.available(name):
            row["peers"][name] = {"absent": impls.absent.get(name, "not requested")}
            return
        if name in impls.disabled:
            row["peers"][name] = {"skipped": impls.disabled[name]}
            return
        if self.over_budget():
            row["peers"][name] = {"skipped": "soft time budget"}
            self.res["skipped"].append(f"{name} {row['S']}x{row['C']} {row['mix']}")
            return
        rec: dict = {}
        row["peers"][name] = rec
        keep = None
        try:
            with fla_env(name):
                if name == "fla-gluon" and impls.fla_gluon is not None:
                    with contextlib.suppress(Exception):  # would fla pick Gluon for this call?
                        okv, why = impls.fla_gluon.causal_conv1d_bwd_verifier(
                            x=xs[0][None], dy=dys[0][None], dht=None, weight=w, bias=b,
                            cu_seqlens=ctx.setdefault("cu_long", cu.long()), chunk_size=64)
                        rec["gluon_bwd_accepted"] = bool(okv)
                        if not okv:
                            rec["gluon_bwd_rejected"] = str(why)
                t = time.perf_counter()
                call, as_dict, keep = autograd_peer(impls, name, xs, dys, w, b, cu, ctx,
                                                    self.args.policy)
                self.dev.sync()
                rec["setup_s"] = time.perf_counter() - t  # k forwards (+ compile)
                t = time.perf_counter()
                gr = call(0)  # first backward: autotune / compile happen here
                self.dev.sync()
                rec["first_call_s"] = time.perf_counter() - t
                if ref is not None:
                    rec["check"] = check_grads(as_dict(gr), ref, loose=name in LOOSE_PEERS)
                    if not rec["check"]["ok"]:
                        print(f"  peer {name} differs from the reference on {row['S']}x{row['C']}"
                              f" {row['mix']}: {_mismatch_text(rec['check'])}", flush=True)
                del gr
                m = B.measure(self.dev, call, k, self.args)
                rec.update({"ms": m["ms"], "reps": m["reps"], "min_ms": m["min_ms"]})
                impls.succeeded(name)
                del call, keep
                keep = None
                if (small and name in GRAPH_PEERS and not self.args.no_peer_graph
                        and impls.fla_bwd is not None):
                    self.run_peer_graph(rec, name, xs, dys, w, b, cu, ctx, k, ref)
        except Exception as e:
            rec["error"] = B.fmt_err(e)
            print(f"  peer {name} failed on {row['S']}x{row['C']} {row['mix']}: {rec['error']}",
                  flush=True)
            call = keep = None  # noqa: F841  (drop the autograd graphs before emptying the cache)
            self.free()
            impls.failed(name, rec["error"])

    def run_peer_graph(self, rec, name, xs, dys, w, b, cu, ctx, k, ref):
        try:
            call, as_dict = fla_raw_call(self.impls, xs, dys, w, b, cu, ctx)
            g, outs = B.measure_graph(self.dev, call, k, self.args, self.args.graph_calls)
            graph = g.pop("_graph")
            if ref is not None:
                outs[0][0].fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                g["check"] = check_grads(as_dict(outs[0]), ref, loose=True)
            del graph, outs
            g["what"] = "raw causal_conv1d_bwd (no autograd), graph-replayed"
            rec["graph"] = g
        except Exception as e:
            rec["graph"] = {"error": B.fmt_err(e)}
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()

    def finish_row(self, row, copy_ms, copy_graph_ms=None):
        nb = row["bytes"]
        row["copy_ms"] = copy_ms
        row["copy_graph_ms"] = copy_graph_ms
        o = row["ours"]
        if o:
            o.pop("samples", None)
            o["gbps"] = B.gbps(nb, o["ms"])
            o["pct_copy"] = 100 * copy_ms / o["ms"]
        g = row["ours_graph"]
        if g and "ms" in g:
            g["gbps"] = B.gbps(nb, g["ms"])
            g["pct_copy"] = 100 * (copy_graph_ms or copy_ms) / g["ms"]
        for name, p in row["peers"].items():
            if "ms" in p:
                p["gbps"] = B.gbps(nb, p["ms"])
                p["pct_copy"] = 100 * copy_ms / p["ms"]
                if o:
                    p["ours_speedup"] = p["ms"] / o["ms"]
            pg = p.get("graph")
            if pg and "ms" in pg:
                pg["gbps"] = B.gbps(nb, pg["ms"])
                pg["pct_copy"] = 100 * (copy_graph_ms or copy_ms) / pg["ms"]
                if g and "ms" in g:
                    pg["ours_graph_speedup"] = pg["ms"] / g["ms"]

    def progress(self, row, copy_ms):
        fmt_ms = B.fmt_ms
        o = row["ours"]
        s = (f"{row['S']}x{row['C']} {row['mix']}:{B.fmt_n(row['ndocs'])} "
             f"{variant_label(row['taps'], row['bias'])}: ours "
             f"{fmt_ms(o['ms']) if o else '-'} ms")
        if o:
            s += f" ~{100 * copy_ms / o['ms']:.0f}% of copy"
        if o and "spread" in o:
            s += f" (r1/r2 spread {100 * o['spread']:.1f}%)"
        g = row["ours_graph"]
        if g and "ms" in g:
            s += f", graph {fmt_ms(g['ms'])} ms/call"
        chk = row["check"]
        if chk:
            s += f", dx err {_e(chk.get('max_abs_err'))}{'' if chk['ok'] else ' MISMATCH'}"
        for name, p in row["peers"].items():
            if "ms" in p:
                s += f" | {name} {fmt_ms(p['ms'])}"
                if o:
                    s += f" ({p['ms'] / o['ms']:.2f}×)"
            elif "error" in p:
                s += f" | {name} ERR"
        log(s)

    # ---- host overhead
    def host_overhead(self):
        a, dev, impls = self.args, self.dev, self.impls
        fmt_err = B.fmt_err
        S, C = a.host_shape[0]
        x = torch.randn(S, C, device=dev.device, dtype=torch.bfloat16)
        dy = torch.randn(S, C, device=dev.device, dtype=torch.bfloat16)
        dx = torch.empty_like(x)
        y = torch.empty_like(x)
        w = torch.randn(C, 4, device=dev.device) * 0.5
        b = torch.randn(C, device=dev.device) * 0.5
        dw = torch.empty_like(w)
        db = torch.empty_like(b)
        gen = torch.Generator().manual_seed(a.seed + 7)
        cu = B.make_cu(S, "rand", gen).to(dev.device)
        res = {"S": S, "C": C, "ndocs": cu.numel() - 1, "calls": a.host_calls, "results": {},
               "policy": a.policy}
        self.res["host_overhead"] = res
        pol = a.policy
        cands = [("x.clone()", lambda: x.clone(), None)]
        if impls.ours is not None:
            f = impls.ours
            ws = None
            if impls.ours_ws is not None:
                with contextlib.suppress(Exception):
                    ws = impls.ours_ws(S, C, dev.device)
            cands.append(("bwd raw (defaults)", lambda: f(x, w, cu, dy, bias=b), None))
            cands.append(("bwd raw (dx=, dweight=, dbias=, workspace=)",
                          lambda: f(x, w, cu, dy, bias=b, silu_grad_preactivation=pol,
                                    workspace=ws, dx=dx, dweight=dw, dbias=db), None))
        if impls.ours_fwd is not None:
            ff = impls.ours_fwd
            cands.append(("fwd raw (defaults)", lambda: ff(x, w, cu, bias=b), None))
            fws = None
            if impls.ours_fwd_ws is not None:
                with contextlib.suppress(Exception):
                    fws = impls.ours_fwd_ws(S, C, dev.device)
            cands.append(("fwd raw (out=, workspace=)",
                          lambda: ff(x, w, cu, bias=b, out=y, workspace=fws), None))
        if impls.ours_ag is not None:
            ag = impls.ours_ag
            xg, wg, bg = _leaf(x), _leaf(w), _leaf(b)
            cands.append(("cake_causal_conv1d fwd (no input requires grad)",
                          lambda: ag(x, w, cu, b), None))
            cands.append(("cake_causal_conv1d fwd (x, weight, bias require grad)",
                          lambda: ag(xg, wg, cu, bg, silu_grad_preactivation=pol), None))
            with contextlib.suppress(ImportError):  # the Python autograd.Function (torch.compile's path)
                from flashinfer_cake import CakeCausalConv1dFunction as Fn
                cands.append(("CakeCausalConv1dFunction.apply fwd (x, weight, bias require grad)",
                              lambda: Fn.apply(xg, wg, cu, bg, pol), None))
        try:
            ops = torch.ops.flashinfer_cake
            op_f, op_b = ops.causal_conv1d_fwd, ops.causal_conv1d_bwd
            cands.append(("torch.ops.flashinfer_cake.causal_conv1d_fwd",
                          lambda: op_f(x, w, cu, b), None))
            cands.append(("torch.ops.flashinfer_cake.causal_conv1d_bwd",
                          lambda: op_b(x, w, cu, dy, b, pol), None))
        except Exception as e:
            res["results"]["torch.ops.flashinfer_cake"] = {"error": fmt_err(e)}
        # backward through autograd (graph retained): ours and the fla peers
        ag_names = [n for n in ("ours-ag", "fla", "fla-gluon")
                    if impls.available(n) and n not in impls.disabled]
        if self.over_budget():
            ag_names = [n for n in ag_names if n == "ours-ag"]
        keeps = []
        for name in ag_names:
            try:
                with fla_env(name):
                    call, _, keep = autograd_peer(impls, name, [x], [dy], w, b, cu, {}, pol)
                keeps.append(keep)
                cands.append((f"{name} bwd (autograd.grad, retained graph)",
                              (lambda c=call: c(0)), name))
            except Exception as e:
                res["results"][f"{name} bwd (autograd.grad, retained graph)"] = {
                    "error": fmt_err(e)}
        # the engine's own cost: autograd.grad through one native op on the same tensors
        xs_leaf = _leaf(x)
        ys_native = torch.nn.functional.silu(xs_leaf)
        cands.append(("torch silu bwd (autograd.grad, retained graph)",
                      lambda: torch.autograd.grad(ys_native, xs_leaf, dy, retain_graph=True), None))
        res["results"].update(dev.host_us_rounds(cands, a.host_calls, fla_env))
        del keeps
        r = res["results"]

        def med(key):
            v = r.get(key) or {}
            return v.get("median_us")
        derived = {}
        raw_f = med("fwd raw (defaults)")
        for key, label in (("torch.ops.flashinfer_cake.causal_conv1d_fwd",
                            "custom-op dispatch (fwd op - fwd raw)"),
                           ("cake_causal_conv1d fwd (no input requires grad)",
                            "autograd entry, no grad (- fwd raw)"),
                           ("cake_causal_conv1d fwd (x, weight, bias require grad)",
                            "autograd entry, grad (- fwd raw)")):
            if raw_f is not None and med(key) is not None:
                derived[label] = med(key) - raw_f
        raw_b = med("bwd raw (defaults)")
        if raw_b is not None and med("torch.ops.flashinfer_cake.causal_conv1d_bwd") is not None:
            derived["custom-op dispatch (bwd op - bwd raw)"] = (
                med("torch.ops.flashinfer_cake.causal_conv1d_bwd") - raw_b)
        res["derived_median_us"] = derived
        for name, v in r.items():
            log(f"host overhead {name}: {B.fmt_host(v)}")
        for label, v in derived.items():
            log(f"host overhead {label}: {v:+.1f} us/call (medians)")

    # ---- summary (no pass/fail thresholds: the backward has no stated goals here)
    def summary(self) -> dict:
        rows = [r for r in self.res["rows"] if r.get("copy_ms")]
        s: dict = {}

        def worst(items):
            return min(items, key=lambda t: t[0]) if items else None

        big = [(r["ours"]["pct_copy"], r) for r in rows
               if r["S"] * r["C"] >= LARGE_ELEMS and r["ours"] and "pct_copy" in r["ours"]]
        w = worst(big)
        s["pct_copy_large"] = None if w is None else {
            "worst_pct": w[0], "worst": _rid(w[1]),
            "median_pct": statistics.median([t[0] for t in big]), "n": len(big)}
        gr = [(r["ours_graph"]["pct_copy"], r) for r in rows
              if r["ours_graph"] and "pct_copy" in r["ours_graph"]]
        w = worst(gr)
        s["graph_pct_copy_small"] = None if w is None else {
            "worst_pct": w[0], "worst": _rid(w[1]),
            "median_pct": statistics.median([t[0] for t in gr]), "n": len(gr)}
        for peer in ALL_PEERS:
            sp = [(r["peers"][peer]["ours_speedup"], r) for r in rows
                  if r["S"] * r["C"] >= LARGE_ELEMS and peer in r["peers"]
                  and "ours_speedup" in r["peers"][peer]]
            w = worst(sp)
            if w is not None:
                s[f"speedup_vs_{peer}_large"] = {
                    "worst": w[0], "at": _rid(w[1]),
                    "median": statistics.median([t[0] for t in sp]), "n": len(sp)}
        ho = self.res.get("host_overhead") or {}
        hr = ho.get("results", {})
        s["host_median_us"] = {k: v["median_us"] for k, v in hr.items() if "median_us" in v}
        s["host_derived_median_us"] = ho.get("derived_median_us", {})
        chk = [r for r in self.res["rows"] if r.get("check")]
        gchk = [r for r in self.res["rows"] if r.get("ours_graph") and r["ours_graph"].get("check")]
        s["correct"] = {
            "pass": all(r["check"]["ok"] for r in chk)
            and all(r["ours_graph"]["check"]["ok"] for r in gchk)
            and not any(r.get("ours_errors") for r in self.res["rows"]),
            "checked": len(chk) + len(gchk),
            "mismatch": sum(not r["check"]["ok"] for r in chk)
            + sum(not r["ours_graph"]["check"]["ok"] for r in gchk),
            "ours_errors": sum(bool(r.get("ours_errors")) for r in self.res["rows"])}
        pm = []
        for r in self.res["rows"]:
            for name, p in r["peers"].items():
                if p.get("check") and not p["check"]["ok"]:
                    pm.append(f"{name} {_rid(r)}")
        s["peer_mismatch"] = pm
        return s

    # ---- tables
    def report(self):
        try:
            lines_d = self.detailed_tables()
        except Exception as e:
            lines_d = [f"(detailed tables failed: {B.fmt_err(e)})"]
        try:
            lines_c = self.compact_table()
        except Exception as e:
            lines_c = [f"(compact table failed: {B.fmt_err(e)})"]
        text_d = "\n".join(lines_d)
        text_c = "\n".join(lines_c)
        print("\n" + text_d, flush=True)
        print("\n" + text_c, flush=True)
        if self.args.md:
            try:
                Path(self.args.md).parent.mkdir(parents=True, exist_ok=True)
                Path(self.args.md).write_text(text_d + "\n\n" + text_c + "\n")
            except Exception as e:
                print(f"could not write {self.args.md}: {B.fmt_err(e)}", flush=True)

    def detailed_tables(self) -> list[str]:
        fmt_ms, fmt_pct, f0, xx = B.fmt_ms, B.fmt_pct, B._f0, B._x
        env = self.env
        L = [f"# bench_bwd {env['date_utc']} · {env.get('gpu', 'CPU smoke')} · driver "
             f"{env.get('driver')} · torch {env['torch']} (CUDA {env.get('torch_cuda')}) · "
             f"triton {env.get('triton')} · flashinfer_cake {env.get('flashinfer_cake')} "
             f"(git {env.get('git_head')}) · peers: "
             + ", ".join(f"{k} {v}" for k, v in self.impls.versions.items()), "",
             f"## Detailed: ours (backward, silu_grad_preactivation={self.args.policy}), "
             "every combo" + (" — CPU STAND-IN, numbers meaningless" if self.impls.standin
                              else ""),
             "",
             "| S×C | docs | taps | ms | GB/s | % copy | r1/r2 | graph ms | graph % | "
             "dx err | dw err | db err | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.res["rows"]:
            o, g, c = r["ours"], r["ours_graph"], r["check"]
            ok = "-"
            if c:
                ok = "yes" if c["ok"] else "**NO**"
                if g and g.get("check") and not g["check"]["ok"]:
                    ok += " (graph **NO**)"
            elif r.get("reference_error"):
                ok = "ref ERR"
            L.append(
                f"| {r['S']}×{r['C']} | {r['mix']}:{B.fmt_n(r['ndocs'])} | "
                f"{variant_label(r['taps'], r['bias'])} | "
                f"{fmt_ms(o['ms']) if o else 'ERR' if r.get('ours_errors') else '-'} | "
                f"{f0(o and o.get('gbps'))} | {fmt_pct(o and o.get('pct_copy'))} | "
                f"{B._spread(o)} | "
                f"{fmt_ms(g['ms']) if g and 'ms' in g else ('ERR' if g else '-')} | "
                f"{fmt_pct(g.get('pct_copy')) if g else '-'} | "
                f"{_cerr(c, 'dx')} | {_cerr(c, 'dweight')} | {_cerr(c, 'dbias')} | {ok} |")
        L += ["", "## Detailed: peers (FP32 taps, bias on; backward only, forward done once per "
                  "input set)", "",
              "| S×C | docs | peer | ms | GB/s | % copy | ours × | graph ms | graph % | "
              "ours × (graph) | dx err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.res["rows"]:
            for name, p in r["peers"].items():
                if "absent" in p:
                    continue
                pg = p.get("graph") or {}
                chk = p.get("check")
                note = p.get("error") or p.get("skipped") or ""
                if pg.get("error"):
                    note = (note + " graph: " + pg["error"]).strip()
                if chk and not chk["ok"]:
                    note = ("MISMATCH " + note).strip()
                if p.get("gluon_bwd_accepted") is False:
                    note = ("gluon rejected: " + str(p.get("gluon_bwd_rejected")) + " "
                            + note).strip()
                L.append(
                    f"| {r['S']}×{r['C']} | {r['mix']}:{B.fmt_n(r['ndocs'])} | {name} | "
                    f"{fmt_ms(p.get('ms'))} | {f0(p.get('gbps'))} | "
                    f"{fmt_pct(p.get('pct_copy'))} | {xx(p.get('ours_speedup'))} | "
                    f"{fmt_ms(pg.get('ms'))} | {fmt_pct(pg.get('pct_copy'))} | "
                    f"{xx(pg.get('ours_graph_speedup'))} | "
                    f"{_cerr(chk, 'dx')} | "
                    f"{note[:90]} |")
        L += ["", "## Copy ceiling per shape (3·S·C bytes copied = 6·S·C bytes of traffic, the "
                  "backward's floor)", "",
              "| S×C | traffic | k rot | copy ms | GB/s | graph copy ms |",
              "|---|---|---|---|---|---|"]
        for s in self.res["shapes"]:
            L.append(f"| {s['S']}×{s['C']} | {s['bytes'] / 1e6:.0f} MB | {s['k_rot']} | "
                     f"{fmt_ms(s.get('copy_ms'))} | {f0(s.get('copy_gbps'))} | "
                     f"{fmt_ms(s.get('copy_graph_ms'))} |")
        ho = self.res.get("host_overhead")
        if ho:
            L += ["", f"## Host overhead per eager call (S={ho['S']}, C={ho['C']}, "
                      f"{ho['ndocs']} docs, {ho['calls']} calls)", "",
                  "| call | median µs | rounds µs | mean µs | × x.clone() |", "|---|---|---|---|---|"]
            for name, r in ho["results"].items():
                L.append(B.host_row(name, r))
            for label, v in (ho.get("derived_median_us") or {}).items():
                L.append(f"| {label} | {v:+.1f} | | | |")
        if self.res["errors"]:
            L += ["", "Errors:"] + [f"- {e['error']}" for e in self.res["errors"]]
        return L

    def compact_table(self) -> list[str]:
        fmt_ms, fmt_pct, f0, xx = B.fmt_ms, B.fmt_pct, B._f0, B._x
        env = self.env
        cp = self.res.get("copy_512MiB") or {}
        peers = [p for p in ALL_PEERS if p in self.impls.initial_peers]
        L = [f"## bench_bwd {env['date_utc'][:16]} · {env.get('gpu', 'CPU smoke')} · driver "
             f"{env.get('driver')} · torch {env['torch']} · triton {env.get('triton')} · "
             f"policy {self.args.policy} · copy 512 MiB {f0(cp.get('gbps'))} GB/s "
             f"(runs {', '.join(f0(v) for v in cp.get('gbps_runs', []))})",
             "Peer slice (FP32 taps, bias on). ours: raw backward ms / % of a same-traffic copy "
             "(3·S·C bytes copied = the 6·S·C-byte floor); graph: graph-replayed kernels as % "
             "of a graph-replayed copy; peer cells: peer ms / ours ms × (peer % of copy), "
             "backward only; docs: mix:count."]
        if self.impls.standin:
            L[1] = "CPU SMOKE TEST with a PyTorch stand-in for ours: numbers are meaningless. " + L[1]
        hdr = "| S×C | docs | copy GB/s | ours ms | ours % | graph % |" + "".join(
            f" {p} |" for p in peers)
        L += [hdr, "|" + "---|" * (6 + len(peers))]
        shapes = {(s["S"], s["C"]): s for s in self.res["shapes"]}
        sel = [r for r in self.res["rows"] if (r["taps"], r["bias"]) == PEER_VARIANT]
        if not sel:  # e.g. --variants bf16: show what ran
            sel = self.res["rows"][:40]
            L[1] = L[1].replace("Peer slice (FP32 taps, bias on)", "First 40 combos (no peers)")
        for r in sel:
            o, g = r["ours"], r["ours_graph"]
            s = shapes.get((r["S"], r["C"]), {})
            cells = []
            for name in peers:
                p = r["peers"].get(name, {})
                if "ms" in p:
                    cells.append(f"{xx(p.get('ours_speedup'))} ({fmt_pct(p.get('pct_copy'))})"
                                 + ("!" if p.get("check") and not p["check"]["ok"] else ""))
                elif "error" in p:
                    cells.append("err")
                elif "skipped" in p:
                    cells.append("skip")
                else:
                    cells.append("-")
            L.append(f"| {r['S']}×{r['C']} | {r['mix']}:{B.fmt_n(r['ndocs'])} | "
                     f"{f0(s.get('copy_gbps'))} | {fmt_ms(o['ms']) if o else '-'} | "
                     f"{fmt_pct(o and o.get('pct_copy'))}"
                     f"{'' if not r['check'] or r['check']['ok'] else ' WRONG'} | "
                     f"{fmt_pct(g.get('pct_copy')) if g else '-'} |" + "".join(
                         f" {c} |" for c in cells))
        L.append("")
        L.append("ours over all taps/bias/mix combos, per shape: min–max % of copy "
                 "(graph min–max where timed)")
        parts = []
        for (S, C), s in shapes.items():
            rs = [r for r in self.res["rows"] if r["S"] == S and r["C"] == C and r["ours"]
                  and "pct_copy" in r["ours"]]
            if not rs:
                parts.append(f"{S}×{C}: -")
                continue
            pc = [r["ours"]["pct_copy"] for r in rs]
            txt = f"{S}×{C}: {min(pc):.0f}–{max(pc):.0f}%"
            gp = [r["ours_graph"]["pct_copy"] for r in rs
                  if r["ours_graph"] and "pct_copy" in r["ours_graph"]]
            if gp:
                txt += f" (g {min(gp):.0f}–{max(gp):.0f}%)"
            parts.append(txt)
        for i in range(0, len(parts), 4):
            L.append("  " + "; ".join(parts[i:i + 4]))
        ho = self.res.get("host_overhead") or {}
        hr = ho.get("results", {})
        if hr:
            short = {"x.clone()": "clone", "bwd raw (defaults)": "bwd",
                     "bwd raw (dx=, dweight=, dbias=, workspace=)": "bwd(out=)",
                     "fwd raw (defaults)": "fwd",
                     "cake_causal_conv1d fwd (x, weight, bias require grad)": "autograd fwd",
                     "ours-ag bwd (autograd.grad, retained graph)": "autograd bwd",
                     "torch.ops.flashinfer_cake.causal_conv1d_fwd": "op fwd",
                     "torch.ops.flashinfer_cake.causal_conv1d_bwd": "op bwd"}
            items = [f"{short.get(n, n)} {v['median_us']:.1f}" for n, v in hr.items()
                     if "median_us" in v and n in short]
            L.append("host µs/call (median of rounds): " + ", ".join(items))
            der = ho.get("derived_median_us") or {}
            if der:
                L.append("host deltas µs/call: " + ", ".join(f"{k} {v:+.1f}"
                                                           for k, v in der.items()))
        sm = self.res.get("summary") or {}
        sl = []
        v = sm.get("pct_copy_large")
        if v:
            sl.append(f"large (S·C ≥ 32M) worst {v['worst_pct']:.1f}% of copy at {v['worst']}, "
                      f"median {v['median_pct']:.1f}%")
        v = sm.get("graph_pct_copy_small")
        if v:
            sl.append(f"graph-replayed worst {v['worst_pct']:.1f}% at {v['worst']}")
        for peer in ALL_PEERS:
            v = sm.get(f"speedup_vs_{peer}_large")
            if v:
                sl.append(f"vs {peer} (large) worst {v['worst']:.2f}× at {v['at']}, "
                          f"median {v['median']:.2f}×")
        c = sm.get("correct")
        if c:
            sl.append(f"correct: {'PASS' if c['pass'] else 'FAIL'} ({c['checked']} checked, "
                      f"{c['mismatch']} mismatched, {c['ours_errors']} errors)")
        if sm.get("peer_mismatch"):
            sl.append(f"peers differing from the reference: {len(sm['peer_mismatch'])}")
        L.append("summary: " + "; ".join(sl))
        absent = {k: v for k, v in self.impls.absent.items()
                  if k not in ("ours_workspace", "ours_forward_workspace")}
        if absent:
            L.append("absent: " + "; ".join(f"{k} ({v[:70]})" for k, v in absent.items()))
        if self.res["skipped"]:
            L.append(f"skipped (soft budget): {len(self.res['skipped'])} peer timings")
        for name, why in self.impls.disabled.items():
            L.append(f"peer {name} {why}")
        w = self.res["warnings"]
        for m in w[:5]:
            L.append(f"WARNING: {m[:200]}")
        if len(w) > 5:
            L.append(f"WARNING: ... {len(w) - 5} more (see JSON)")
        if self.res["errors"]:
            L.append(f"ERRORS: {len(self.res['errors'])} (see detailed table / JSON)")
        L.append(f"total {elapsed():.0f}s" + (f"; JSON: {self.args.json}" if self.args.json
                                               else ""))
        return L


def _rid(r) -> str:
    return f"{r['S']}x{r['C']} {r['mix']}:{r['ndocs']} {variant_label(r['taps'], r['bias'])}"


def _e(v) -> str:
    return "-" if v is None else f"{v:.2g}"


def _cerr(c, name) -> str:
    if not c or name not in c:
        return "-"
    v = c[name]
    if v.get("missing"):
        return "missing"
    if v.get("error"):
        return "chk ERR"
    return _e(v.get("max_abs_err")) + ("" if v.get("ok") else "!")


def main(argv=None):
    args = parse_args(argv)
    _lazy_imports()
    if not args.smoke_cpu and not torch.cuda.is_available():
        print("bench_bwd.py: no CUDA device visible to torch (this benchmark needs a GPU; use "
              "--smoke-cpu to test the script's plumbing on a CPU)", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.smoke_cpu:
        args.shapes = [(256, 64), (100, 40)]
        args.rot_mb = 0.5
        args.target_ms = 2.0
        args.host_calls = min(args.host_calls, 200)
    Bench(args).run()


if __name__ == "__main__":
    main()
