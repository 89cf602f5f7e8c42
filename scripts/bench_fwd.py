#!/usr/bin/env python3
"""Forward benchmark of ``cake_causal_conv1d_train_forward`` against copy bandwidth and peers.

One run measures, per shape, a device-to-device copy of the same bytes (the ceiling: x read +
y written = 4*S*C bytes), this package's forward, and every peer that imports:

  fla+ci     fla 0.6 Triton ``causal_conv1d`` with ``chunk_indices`` precomputed (no host sync)
  fla        the same without ``chunk_indices`` and with fla's tensor cache off: it builds the
             chunk indices (a host sync) on every call, as with a fresh cu_seqlens each step
  fla-gluon  fla's opt-in Gluon forward (FLA_CONV_GLUON=1), ``chunk_indices`` precomputed
  dao        Dao's ``causal_conv1d_fn`` (channel-last, per-token seq_idx), when installed
  compile    ``torch.compile`` of the reference expression (float32 math, bf16 output)
  eager      the same expression in eager PyTorch

Suite: S x C shapes x document mixes (1 doc, 16-64 random docs, max(1024, S//16) docs, 1-8-token
docs) x taps (FP32, BF16; bias dtype = taps dtype) x bias on/off. Ours runs on every combo, the
peers on the (FP32 taps, bias on) slice. Times are medians of per-call CUDA-event times, with
inputs rotated over enough copies that every timed call reads data that is not in L2. Ours is
checked against the float64 reference on every combo (output poisoned with NaN first); a
mismatch prints a WARNING row. Small shapes also get the kernel time from a replayed CUDA graph,
and the run ends with the host overhead of one eager call.

    python3 scripts/bench_fwd.py                  # full suite (~4 min on an H200)
    python3 scripts/bench_fwd.py --quick          # a few combos
    python3 scripts/bench_fwd.py --shapes 4096x4096,16384x8192 --json out.json --no-peers

The last lines of stdout are a compact markdown table (peer slice) plus the issue-4 goals; the
detailed tables come before it; ``--json`` gets everything.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:  # an installed flashinfer_cake wins; else the checkout this script lives in
    import importlib.util as _ilu
    if _ilu.find_spec("flashinfer_cake") is None:
        sys.path.insert(0, str(REPO))
except Exception:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

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
ALL_PEERS = ("fla+ci", "fla", "fla-gluon", "dao", "compile", "eager")
GRAPH_PEERS = ("fla+ci", "fla-gluon", "dao")  # peers whose call can be captured in a graph
LARGE_ELEMS = 32 * 2**20  # issue 4: >= 90 % of copy for S*C >= 32M
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.replace("×", "x").split(","):
        part = part.strip().lower()
        if not part:
            continue
        s, c = part.split("x")
        out.append((int(s), int(c)))
    if not out:
        raise argparse.ArgumentTypeError("no shape given")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark cake_causal_conv1d_train_forward against copy bandwidth and "
                    "peers (fla, Dao causal-conv1d, torch.compile, eager). The last lines of "
                    "stdout are a compact markdown table and the issue-4 goals.")
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
    p.add_argument("--no-peers", action="store_true", help="time only the copy and ours")
    p.add_argument("--peers", default=",".join(ALL_PEERS),
                   help="comma list of peers to try (default: all of them)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="GPU time aimed at per measurement (reps = target / est. time per call); "
                        "default 40, --quick 25")
    p.add_argument("--min-reps", type=int, default=10, help="(default 10)")
    p.add_argument("--max-reps", type=int, default=400, help="(default 400)")
    p.add_argument("--rot-mb", type=float, default=200.0,
                   help="rotate over k input/output copies with k*4*S*C >= this many MB (L2 is "
                        "~60 MB on an H200)")
    p.add_argument("--graph-max-elems", type=int, default=1 << 24,
                   help="CUDA-graph kernel timing for shapes with S*C <= this (default 16M "
                        "covers 1024x8192, 4096x4096, 8192x2048)")
    p.add_argument("--graph-calls", type=int, default=20, help="forward calls per captured graph (default 20)")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    p.add_argument("--no-peer-graph", action="store_true",
                   help="skip CUDA-graph timings of the peers (fla+ci, fla-gluon, dao)")
    p.add_argument("--host-shape", type=parse_shapes, default=[(1024, 256)], metavar="SxC",
                   help="shape of the host-overhead loop (default 1024x256)")
    p.add_argument("--host-calls", type=int, default=2000, help="(default 2000)")
    p.add_argument("--no-host", action="store_true", help="skip the host-overhead loop")
    p.add_argument("--check", choices=("all", "shape", "none"), default="all",
                   help="check ours against the float64 reference on every combo, on the first "
                        "combo of each shape, or never (default all)")
    p.add_argument("--budget-s", type=float, default=225.0,
                   help="soft wall-clock budget: past it, peers and ours' second round are "
                        "skipped (recorded as such); 0 = no budget (default 225)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="torch.compile(dynamic=True) once instead of one static compile per shape")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="plumbing test on a machine without a GPU: tiny shapes, host timers, no "
                        "graphs; numbers are meaningless")
    a = p.parse_args(argv)
    if a.target_ms is None:
        a.target_ms = 25.0 if a.quick else 40.0
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
    return a


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

def fmt_ms(ms):
    if ms is None:
        return "-"
    return f"{ms:.4f}" if ms < 1 else f"{ms:.3f}"


def fmt_n(n: int) -> str:
    if n >= 10000:
        return f"{n / 1000:.0f}k"
    return str(n)


def fmt_pct(p):
    return "-" if p is None else f"{p:.0f}%"


def fmt_err(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s[:300]


def fmt_host(r: dict) -> str:
    """One result of Dev.host_us_rounds, for the log."""
    if "median_us" not in r:
        return str(r.get("error"))
    ratio = "" if r.get("vs_first") is None else f", {r['vs_first']:.2f}x the first call's"
    return (f"median {r['median_us']:.1f} us/call (rounds {min(r['rounds_us']):.1f}-{max(r['rounds_us']):.1f}), "
            f"mean {r['mean_us']:.1f}{ratio}")


def host_row(name: str, r: dict) -> str:
    """One result of Dev.host_us_rounds as a markdown row (median, rounds, mean, vs first)."""
    if "median_us" not in r:
        return f"| {name} | ERR | {str(r.get('error', ''))[:80]} | | |"
    ratio = "" if r.get("vs_first") is None else f"{r['vs_first']:.2f}"
    return (f"| {name} | {r['median_us']:.1f} | {min(r['rounds_us']):.1f}–{max(r['rounds_us']):.1f} | "
            f"{r['mean_us']:.1f} | {ratio} |")


def gbps(nbytes: float, ms) -> float | None:
    if not ms:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def shape_label(S: int, C: int) -> str:
    return f"{S}x{C}"


def variant_label(taps: str, bias: bool) -> str:
    return taps + ("+b" if bias else "")


def clean(obj):
    """JSON-safe: NaN/inf -> None, tuples -> lists, unknown -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


# --------------------------------------------------------------------------------------------
# Device abstraction: CUDA events on a GPU, host clock for the CPU smoke test
# --------------------------------------------------------------------------------------------

class Dev:
    def __init__(self, smoke_cpu: bool):
        self.cuda = not smoke_cpu
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def host_us(self, fn, calls: int, batches: int = 10) -> dict:
        """Host time of one call of fn in µs (median, mean, p10 over every call), free of GPU
        back-pressure: once the launch queue is full each launch waits for the GPU, and a plain
        loop times the GPU instead (the backward's two small kernels outlast its host path). So
        each batch of calls queues behind a spin kernel that outlasts it, in batches short enough
        never to fill the queue (about a thousand pending launches)."""
        for _ in range(50):
            fn()
        self.sync()
        per = []
        per_batch = max(1, calls // batches)
        for _ in range(batches):
            if self.cuda:
                torch.cuda._sleep(int(per_batch * 40e-6 * 2e9))  # ~40 µs per call at ~2 GHz
            for _ in range(per_batch):
                t = time.perf_counter()
                fn()
                per.append(time.perf_counter() - t)
            self.sync()
        per.sort()
        return {"median_us": 1e6 * statistics.median(per), "mean_us": 1e6 * sum(per) / len(per),
                "p10_us": 1e6 * per[len(per) // 10], "calls": len(per), "batches": batches}

    def host_us_rounds(self, cands, calls: int, context, rounds: int = 5) -> dict:
        """host_us of every candidate, name -> result, for (name, fn, env) triples, in `rounds`
        interleaved rounds of calls / rounds calls each: the host's speed drifts during a run
        (x.clone() took 7.9 to 11.5 µs within one process on the H200 host), and interleaving
        moves every candidate alike. A result holds median_us (median over the rounds of each
        round's median), mean_us (over every call), min_round_us, rounds_us and vs_first (median
        over the rounds of the round's median / the first candidate's), or error: a candidate
        that raises leaves the rounds. context(env) is entered around a candidate's calls."""
        acc = {name: {"rounds_us": [], "total_s": 0.0, "calls": 0, "ratios": []} for name, _, _ in cands}
        for _ in range(rounds):
            first = None
            for i, (name, fn, env) in enumerate(cands):
                a = acc[name]
                if "error" in a:
                    continue
                try:
                    with context(env):
                        r = self.host_us(fn, max(2, calls // rounds), batches=2)
                except Exception as e:
                    acc[name] = {"error": fmt_err(e)}
                    with contextlib.suppress(Exception):
                        self.sync()
                    continue
                a["rounds_us"].append(r["median_us"])
                a["total_s"] += r["mean_us"] * r["calls"]
                a["calls"] += r["calls"]
                if i == 0:
                    first = r["median_us"]
                elif first:
                    a["ratios"].append(r["median_us"] / first)
        out = {}
        for name, a in acc.items():
            if "error" in a:
                out[name] = a
                continue
            out[name] = {"median_us": statistics.median(a["rounds_us"]), "mean_us": a["total_s"] / a["calls"],
                         "min_round_us": min(a["rounds_us"]), "rounds_us": a["rounds_us"], "calls": a["calls"],
                         "vs_first": statistics.median(a["ratios"]) if a["ratios"] else None}
        return out

    def time_reps(self, fn, nrot: int, reps: int, start: int = 0) -> list[float]:
        """Per-call times in ms of fn(i), i cycling over the nrot input copies."""
        if not self.cuda:
            out = []
            for r in range(reps):
                t = time.perf_counter()
                fn((start + r) % nrot)
                out.append((time.perf_counter() - t) * 1e3)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        torch.cuda.synchronize()
        for r in range(reps):
            s, e = ev[r]
            s.record()
            fn((start + r) % nrot)
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]


def reps_for(est_ms: float, args) -> int:
    if est_ms <= 0:
        return args.max_reps
    return int(min(args.max_reps, max(args.min_reps, math.ceil(args.target_ms / est_ms))))


def measure(dev: Dev, fn, nrot: int, args, *, warm: int = 3, reps: int | None = None,
            start: int = 0) -> dict:
    """Warm up (first call may compile/autotune: timed separately), then median of many reps."""
    t = time.perf_counter()
    fn(start % nrot)
    dev.sync()
    first_s = time.perf_counter() - t
    est = dev.time_reps(fn, nrot, warm, start=start + 1)
    n = reps if reps is not None else reps_for(statistics.median(est), args)
    times = dev.time_reps(fn, nrot, n, start=start + 1 + warm)
    return {"ms": statistics.median(times), "reps": n, "first_call_s": first_s,
            "min_ms": min(times), "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
            "samples": times}


def measure_graph(dev: Dev, call, nrot: int, args, ncalls: int) -> tuple[dict, list]:
    """Capture ncalls calls (cycling over the nrot copies) into one CUDA graph; time replays.

    Returns the timing (ms per call) and the list of outputs the graph writes (outs[j] is the
    output of call j, i.e. of copy j % nrot).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in range(3):
            call(j % nrot)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(g):
        for j in range(ncalls):
            outs.append(call(j % nrot))  # keep every output alive: each call owns its buffer
    torch.cuda.synchronize()
    rep = measure(dev, lambda i: g.replay(), 1, args, warm=2)
    per = {k: (v / ncalls if k in ("ms", "min_ms", "p90_ms") else v) for k, v in rep.items()
           if k != "samples"}
    per["calls_per_graph"] = ncalls
    per["_graph"] = g
    return per, outs


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def make_cu(S: int, mix: str, gen: torch.Generator) -> torch.Tensor:
    """int32 prefix sums (CPU) for one document mix."""
    if mix == "1" or S <= 1:
        cuts = torch.tensor([], dtype=torch.long)
    elif mix in ("rand", "many"):
        if mix == "rand":
            n = int(torch.randint(16, 65, (1,), generator=gen))
        else:
            n = max(1024, S // 16)
        n = max(1, min(n, S))
        cuts = torch.randperm(S - 1, generator=gen)[: n - 1] + 1
        cuts, _ = torch.sort(cuts)
    elif mix == "tiny":
        lens = torch.randint(1, 9, (S // 4 + 8,), generator=gen)
        ends = torch.cumsum(lens, 0)
        cuts = ends[ends < S]
    else:
        raise ValueError(mix)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), cuts.long(),
                    torch.tensor([S], dtype=torch.long)])
    return cu.to(torch.int32)


def positions(cu_long: torch.Tensor, S: int) -> torch.Tensor:
    t = torch.arange(S, device=cu_long.device)
    doc = torch.searchsorted(cu_long, t, right=True) - 1
    return t - cu_long[doc.clamp(min=0)]


def ref_expr(x, w, b, pos):
    """Compact reference: float32 math, bf16 output (the torch.compile / eager peers)."""
    xf = x.float()
    acc = xf * w[:, 3]
    for k in (1, 2, 3):
        sh = torch.nn.functional.pad(xf[:-k], (0, 0, k, 0))
        acc = acc + torch.where((pos >= k).unsqueeze(1), sh, 0.0) * w[:, 3 - k]
    if b is not None:
        acc = acc + b
    return torch.nn.functional.silu(acc).to(torch.bfloat16)


def reference64(ref_fn, x, w, cu, b):
    if ref_fn is not None:
        return ref_fn(x, w, cu, b, dtype=torch.float64)
    S = x.shape[0]
    pos = positions(cu.long(), S)
    x64 = x.double()
    acc = x64 * w.double()[:, 3]
    for k in (1, 2, 3):
        sh = torch.nn.functional.pad(x64[:-k], (0, 0, k, 0)) if k < S else torch.zeros_like(x64)
        acc = acc + torch.where((pos >= k).unsqueeze(1), sh, 0.0) * w.double()[:, 3 - k]
    if b is not None:
        acc = acc + b.double()
    return torch.nn.functional.silu(acc)


def check_out(out_sc: torch.Tensor, ref: torch.Tensor) -> dict:
    """Compare a [S, C] bf16 output with the float64 reference.

    Pass: finite everywhere, |out - ref| <= 2^-7 |ref| + 1e-3 elementwise (one bf16 ulp plus
    float32 rounding), and ||out - ref|| / ||ref|| < 1e-2.
    """
    o = out_sc.double()
    finite = bool(torch.isfinite(o).all())
    d = o - ref
    err = d.abs()
    max_err = float(err.max()) if err.numel() else 0.0
    nbad = int((err > ref.abs() * 2.0**-7 + 1e-3).sum()) if err.numel() else 0
    rn = float(ref.norm())
    rel = float(d.norm()) / rn if rn > 0 else float(d.norm())
    ok = finite and nbad == 0 and rel < 1e-2
    return {"ok": ok, "finite": finite, "max_abs_err": max_err, "n_out_of_tol": nbad,
            "rel_l2_err": rel}


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

def run_cmd(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:
        return None


def environment(dev: Dev) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "python": sys.version.split()[0],
        "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "argv": sys.argv,
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = None
        env["triton_error"] = fmt_err(e)
    try:
        import flashinfer_cake._version as v
        env["flashinfer_cake"] = v.__version__
        env["flashinfer_cake_path"] = str(Path(v.__file__).parent)
    except Exception:
        env["flashinfer_cake"] = None
    env["git_head"] = run_cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    if dev.cuda:
        p = torch.cuda.get_device_properties(0)
        env.update({
            "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "sm_count": p.multi_processor_count,
            "gpu_mem_gib": round(p.total_memory / 2**30, 1),
            "l2_bytes": getattr(p, "L2_cache_size", None),
        })
        try:
            env["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
        except Exception:
            pass
        q = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,"
                     "clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu",
                     "--format=csv,noheader"])
        keys = ["smi_name", "driver", "clock_sm", "clock_mem", "clock_max_sm",
                "clock_max_mem", "power_limit", "temp_c"]
        if not q:
            q = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version",
                         "--format=csv,noheader"])
            keys = keys[:2]
        if q:
            f = [s.strip() for s in q.splitlines()[0].split(",")]
            env.update(dict(zip(keys, f)))
        else:
            env["driver"] = None
    return env


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------

class Impls:
    """Imports: ours, reference, and every peer; absent ones recorded with the reason."""

    def __init__(self, args, dev: Dev):
        self.absent: dict[str, str] = {}
        self.versions: dict[str, str | None] = {}
        self.ours = self.ours_ws = None
        try:
            from flashinfer_cake import cake_causal_conv1d_train_forward as f
            self.ours = f
        except Exception as e:
            self.absent["ours"] = fmt_err(e)
        try:
            from flashinfer_cake import cake_causal_conv1d_train_forward_workspace as fw
            self.ours_ws = fw
        except Exception as e:
            self.absent["ours_workspace"] = fmt_err(e)
        self.ref = None
        try:
            from flashinfer_cake.reference import causal_conv1d_reference
            self.ref = causal_conv1d_reference
        except Exception as e:
            self.absent["reference"] = fmt_err(e) + " (using the script's own float64 expr)"
        self.peers = [p for p in args.peers]
        self.fla = self.fla_utils = self.fla_ci = None
        if any(p.startswith("fla") for p in self.peers):
            try:
                from fla.modules.causal_conv1d import causal_conv1d as fla_conv
                import fla.utils as fla_utils
                self.fla, self.fla_utils = fla_conv, fla_utils
                self.versions["fla"] = _dist_version("fla-core") or getattr(
                    sys.modules.get("fla"), "__version__", None)
                try:
                    from fla.ops.utils import prepare_chunk_indices
                    self.fla_ci = prepare_chunk_indices
                except Exception as e:
                    for p in ("fla+ci", "fla-gluon"):
                        self.absent[p] = "no fla.ops.utils.prepare_chunk_indices: " + fmt_err(e)
                if "fla.modules.causal_conv1d.backends.gluon" not in sys.modules:
                    self.absent.setdefault(
                        "fla-gluon", "fla's Gluon backend not registered on this machine")
            except Exception as e:
                for p in ("fla+ci", "fla", "fla-gluon"):
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
                    self.compiled = torch.compile(ref_expr, dynamic=bool(args.compile_dynamic))
                except Exception as e:
                    self.absent["compile"] = fmt_err(e)
        if dev.cuda is False:
            for p in ("fla+ci", "fla", "fla-gluon", "dao"):
                if p in self.peers:
                    self.absent.setdefault(p, "skipped in --smoke-cpu")
        self.peers = [p for p in self.peers if p not in self.absent]

    def available(self, name: str) -> bool:
        return name in self.peers


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


@contextlib.contextmanager
def fla_env(impls: Impls, name: str):
    """fla: tensor cache off (chunk indices rebuilt, host sync, each call); fla-gluon: opt in."""
    if name == "fla":
        prev = getattr(impls.fla_utils, "FLA_DISABLE_TENSOR_CACHE", False)
        impls.fla_utils.FLA_DISABLE_TENSOR_CACHE = True
        try:
            yield
        finally:
            impls.fla_utils.FLA_DISABLE_TENSOR_CACHE = prev
    elif name == "fla-gluon":
        prev = os.environ.get("FLA_CONV_GLUON")
        os.environ["FLA_CONV_GLUON"] = "1"
        try:
            yield
        finally:
            if prev is None:
                os.environ.pop("FLA_CONV_GLUON", None)
            else:
                os.environ["FLA_CONV_GLUON"] = prev
    else:
        yield


def peer_call(impls: Impls, name: str, xs, w, b, cu, ctx: dict):
    """(call(i) -> output, to_sc(output) -> [S, C] view) for one peer on one combo."""
    S = xs[0].shape[0]
    if name in ("fla+ci", "fla", "fla-gluon"):
        if "cu_long" not in ctx:
            ctx["cu_long"] = cu.long()
        cu_long = ctx["cu_long"]
        ci = None
        if name != "fla":
            if "fla_ci" not in ctx:
                ctx["fla_ci"] = impls.fla_ci(cu_long, 64)
            ci = ctx["fla_ci"]
        f = impls.fla

        def call(i):
            y, _ = f(xs[i][None], w, b, activation="silu", cu_seqlens=cu_long, chunk_indices=ci)
            return y
        return call, lambda y: y[0]
    if name == "dao":
        if "seq_idx" not in ctx:
            cu_long = ctx.setdefault("cu_long", cu.long())
            t = torch.arange(S, device=cu.device)
            ctx["seq_idx"] = torch.searchsorted(cu_long[1:].contiguous(), t,
                                                right=True).to(torch.int32)[None]
        seq_idx = ctx["seq_idx"]
        f = impls.dao
        bb = None if b is None else b.to(w.dtype)

        def call(i):
            return f(xs[i][None].transpose(1, 2), w, bb, seq_idx=seq_idx, activation="silu")
        return call, lambda y: y[0].transpose(0, 1)
    if name in ("compile", "eager"):
        if "pos" not in ctx:
            ctx["pos"] = positions(ctx.setdefault("cu_long", cu.long()), S)
        pos = ctx["pos"]
        f = impls.compiled if name == "compile" else ref_expr

        def call(i):
            return f(xs[i], w, b, pos)
        return call, lambda y: y
    raise ValueError(name)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = Dev(args.smoke_cpu)
        if self.dev.cuda and not torch.cuda.is_available():
            sys.exit("bench_fwd.py: no CUDA device visible to torch (use --smoke-cpu to test the "
                     "script's plumbing on a CPU)")
        self.env = environment(self.dev)
        self.impls = Impls(args, self.dev)
        self.res = {"env": self.env, "config": {}, "absent": self.impls.absent,
                    "versions": self.impls.versions, "copy_512MiB": None, "shapes": [],
                    "rows": [], "host_overhead": None, "warnings": [], "errors": [],
                    "skipped": [], "goals": None, "timing": {}}
        cfg = {k: v for k, v in vars(args).items()}
        cfg["variants"] = [variant_label(*v) for v in args.variants]
        cfg["shapes"] = [shape_label(*s) for s in args.shapes]
        cfg["host_shape"] = shape_label(*args.host_shape[0])
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
            tmp.write_text(json.dumps(clean(self.res), indent=1))
            os.replace(tmp, path)
        except Exception as e:
            print(f"could not write {self.args.json}: {fmt_err(e)}", flush=True)

    # ---- copy ceiling
    def copy_large(self, tag: str):
        n = 256 * 2**20 if self.dev.cuda else 2**20  # 512 MiB of bf16 (2 MiB in smoke)
        x = torch.randn(n, device=self.dev.device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        m = measure(self.dev, lambda i: y.copy_(x), 1, self.args, reps=100 if self.dev.cuda
                    else 5)
        nbytes = 2 * x.numel() * 2
        out = {"bytes": nbytes, "ms": m["ms"], "gbps": gbps(nbytes, m["ms"]), "reps": m["reps"]}
        del x, y
        self.res.setdefault("copy_512MiB_runs", []).append({"when": tag, **out})
        log(f"copy 512 MiB ({tag}): {out['ms']:.4f} ms, {out['gbps']:.0f} GB/s (read+write)")

    # ---- main loop
    def run(self):
        a, dev, impls = self.args, self.dev, self.impls
        log(f"torch {torch.__version__}, {self.env.get('gpu', 'CPU smoke')}, driver "
            f"{self.env.get('driver')}; ours: {'present' if impls.ours else 'ABSENT'}; peers: "
            f"{', '.join(impls.peers) or 'none'}; absent: "
            f"{', '.join(f'{k} ({v[:80]})' for k, v in impls.absent.items()) or 'none'}")
        if impls.ours is None:
            self.warn(f"ours absent: {impls.absent.get('ours')}")
        torch.manual_seed(a.seed)
        self.copy_large("start")
        try:
            for (S, C) in a.shapes:
                try:
                    self.run_shape(S, C)
                except Exception as e:
                    msg = f"shape {S}x{C} aborted: {fmt_err(e)}"
                    self.res["errors"].append({"where": f"{S}x{C}", "error": msg,
                                               "traceback": traceback.format_exc()[-2000:]})
                    print(msg, flush=True)
                    traceback.print_exc()
                if dev.cuda:
                    torch.cuda.empty_cache()
                self.write_json()
            self.copy_large("end")
            if not a.no_host:
                self.host_overhead()
        except Exception as e:
            self.res["errors"].append({"where": "run", "error": fmt_err(e),
                                       "traceback": traceback.format_exc()[-2000:]})
            traceback.print_exc()
        runs = self.res.get("copy_512MiB_runs", [])
        if runs:
            self.res["copy_512MiB"] = {"gbps": max(r["gbps"] for r in runs),
                                       "gbps_runs": [r["gbps"] for r in runs]}
        self.res["goals"] = self.goals()
        self.res["timing"]["total_s"] = elapsed()
        self.write_json()
        self.report()
        self.write_json()

    def run_shape(self, S: int, C: int):
        a, dev, impls = self.args, self.dev, self.impls
        nb = 4 * S * C
        k = max(1, math.ceil(a.rot_mb * 1e6 / nb))
        xs = [torch.randn(S, C, device=dev.device, dtype=torch.bfloat16) for _ in range(k)]
        ys = [torch.empty_like(x) for x in xs]
        shp = {"S": S, "C": C, "bytes": nb, "k_rot": k}
        self.res["shapes"].append(shp)
        c1 = measure(dev, lambda i: ys[i].copy_(xs[i]), k, a)
        small = S * C <= a.graph_max_elems and dev.cuda and not a.no_graph
        if small:  # graph-replayed kernels are compared with a graph-replayed copy of the bytes
            cg, _ = measure_graph(dev, lambda i: ys[i].copy_(xs[i]), k, a, a.graph_calls)
            cg.pop("_graph")
            shp["copy_graph_ms"] = cg["ms"]
        ws = None
        if impls.ours_ws is not None and impls.ours is not None:
            try:
                ws = impls.ours_ws(S, C, dev.device)
            except Exception as e:
                shp["workspace_error"] = fmt_err(e)
        w32 = torch.randn(C, 4, device=dev.device, dtype=torch.float32) * 0.5
        b32 = torch.randn(C, device=dev.device, dtype=torch.float32) * 0.5
        taps = {"fp32": (w32, b32), "bf16": (w32.to(torch.bfloat16), b32.to(torch.bfloat16))}
        gen = torch.Generator().manual_seed(a.seed * 1000003 + S * 31 + C)
        rows = []
        for mi, mix in enumerate(a.mixes):
            cu = make_cu(S, mix, gen).to(dev.device)
            ndocs = cu.numel() - 1
            ctx: dict = {}
            for (tp, has_b) in a.variants:
                w, bfull = taps[tp]
                b = bfull if has_b else None
                row = {"S": S, "C": C, "mix": mix, "ndocs": ndocs, "taps": tp, "bias": has_b,
                       "bytes": nb, "ours": None, "ours_graph": None, "check": None,
                       "peers": {}}
                rows.append(row)
                self.res["rows"].append(row)
                do_check = a.check == "all" or (a.check == "shape" and mi == 0)
                is_peer = (tp, has_b) == PEER_VARIANT and not a.no_peers
                ref = reference64(impls.ref, xs[0], w, cu, b) if (do_check or is_peer) else None
                self.run_ours(row, xs, ys, w, b, cu, ws, k, ref, do_check, round_=1)
                if is_peer:
                    for name in a.peers:
                        self.run_peer(row, name, xs, w, b, cu, ctx, k, ref, small)
                if row["ours"] is not None and not self.over_budget():
                    self.run_ours(row, xs, ys, w, b, cu, ws, k, None, False, round_=2)
                if small:
                    self.run_ours_graph(row, xs, ys, w, b, cu, ws, k, ref)
                del ref
                self.progress(row, c1["ms"])
            del ctx
        c2 = measure(dev, lambda i: ys[i].copy_(xs[i]), k, a)
        samples = c1["samples"] + c2["samples"]
        shp["copy_ms"] = statistics.median(samples)
        shp["copy_ms_runs"] = [c1["ms"], c2["ms"]]
        shp["copy_gbps"] = gbps(nb, shp["copy_ms"])
        shp["copy_reps"] = len(samples)
        for row in rows:  # % of copy needs the copy of this shape: fill in now
            self.finish_row(row, shp["copy_ms"], shp.get("copy_graph_ms"))
        log(f"{S}x{C}: copy {fmt_ms(shp['copy_ms'])} ms = {shp['copy_gbps']:.0f} GB/s "
            f"(runs {fmt_ms(c1['ms'])}, {fmt_ms(c2['ms'])}), k_rot={k}")
        del xs, ys

    def run_ours(self, row, xs, ys, w, b, cu, ws, k, ref, do_check, round_):
        impls, dev = self.impls, self.dev
        if impls.ours is None:
            return
        f = impls.ours

        def call(i):
            return f(xs[i], w, cu, bias=b, out=ys[i], workspace=ws)
        try:
            if do_check and ref is not None:
                ys[0].fill_(float("nan"))
                t = time.perf_counter()
                y = call(0)
                dev.sync()
                row["ours_first_call_s"] = time.perf_counter() - t
                chk = check_out(ys[0], ref)
                chk["returned_out"] = y is not None and y.data_ptr() == ys[0].data_ptr()
                row["check"] = chk
                if not chk["ok"]:
                    self.warn(f"ours MISMATCH {row['S']}x{row['C']} {row['mix']}:{row['ndocs']} "
                              f"{variant_label(row['taps'], row['bias'])}: max err "
                              f"{chk['max_abs_err']:.3g}, rel {chk['rel_l2_err']:.3g}, "
                              f"{chk['n_out_of_tol']} out of tol, finite={chk['finite']}")
            m = measure(dev, call, k, self.args)
        except Exception as e:
            row.setdefault("ours_errors", []).append(fmt_err(e))
            self.warn(f"ours FAILED {row['S']}x{row['C']} {row['mix']} "
                      f"{variant_label(row['taps'], row['bias'])}: {fmt_err(e)}")
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

    def run_ours_graph(self, row, xs, ys, w, b, cu, ws, k, ref):
        impls = self.impls
        if impls.ours is None or row["ours"] is None:
            return
        f = impls.ours

        def call(i):
            return f(xs[i], w, cu, bias=b, out=ys[i], workspace=ws)
        try:
            g, _ = measure_graph(self.dev, call, k, self.args, self.args.graph_calls)
            graph = g.pop("_graph")
            if ref is not None:  # poison, replay once, the graph must have rewritten ys[0]
                ys[0].fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                g["check"] = check_out(ys[0], ref)
                if not g["check"]["ok"]:
                    self.warn(f"ours graph-replay MISMATCH {row['S']}x{row['C']} {row['mix']} "
                              f"{variant_label(row['taps'], row['bias'])}: "
                              f"max err {g['check']['max_abs_err']:.3g}")
            del graph
            row["ours_graph"] = g
        except Exception as e:
            row["ours_graph"] = {"error": fmt_err(e)}
            self.warn(f"ours graph FAILED {row['S']}x{row['C']} {row['mix']}: {fmt_err(e)}")
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()

    def run_peer(self, row, name, xs, w, b, cu, ctx, k, ref, small):
        impls = self.impls
        if not impls.available(name):
            row["peers"][name] = {"absent": impls.absent.get(name, "not requested")}
            return
        if self.over_budget():
            row["peers"][name] = {"skipped": "soft time budget"}
            self.res["skipped"].append(f"{name} {row['S']}x{row['C']} {row['mix']}")
            return
        rec: dict = {}
        row["peers"][name] = rec
        try:
            call, to_sc = peer_call(impls, name, xs, w, b, cu, ctx)
            with fla_env(impls, name):
                t = time.perf_counter()
                y = call(0)  # first call: autotune / compile happen here
                self.dev.sync()
                rec["first_call_s"] = time.perf_counter() - t
                if ref is not None:
                    rec["check"] = check_out(to_sc(y), ref)
                del y
                m = measure(self.dev, call, k, self.args)
                rec.update({"ms": m["ms"], "reps": m["reps"], "min_ms": m["min_ms"]})
                if small and name in GRAPH_PEERS and not self.args.no_peer_graph:
                    try:
                        g, outs = measure_graph(self.dev, call, k, self.args,
                                                self.args.graph_calls)
                        graph = g.pop("_graph")
                        if ref is not None:
                            outs[0].fill_(float("nan"))
                            graph.replay()
                            torch.cuda.synchronize()
                            g["check"] = check_out(to_sc(outs[0]), ref)
                        del graph, outs
                        rec["graph"] = g
                    except Exception as e:
                        rec["graph"] = {"error": fmt_err(e)}
                        with contextlib.suppress(Exception):
                            torch.cuda.synchronize()
        except Exception as e:
            rec["error"] = fmt_err(e)
            print(f"  peer {name} failed on {row['S']}x{row['C']} {row['mix']}: {rec['error']}",
                  flush=True)
            with contextlib.suppress(Exception):
                self.dev.sync()

    def finish_row(self, row, copy_ms, copy_graph_ms=None):
        nb = row["bytes"]
        row["copy_ms"] = copy_ms
        row["copy_graph_ms"] = copy_graph_ms
        o = row["ours"]
        if o:
            o.pop("samples", None)
            o["gbps"] = gbps(nb, o["ms"])
            o["pct_copy"] = 100 * copy_ms / o["ms"]
        g = row["ours_graph"]
        if g and "ms" in g:
            g["gbps"] = gbps(nb, g["ms"])
            g["pct_copy"] = 100 * (copy_graph_ms or copy_ms) / g["ms"]
        for name, p in row["peers"].items():
            if "ms" in p:
                p["gbps"] = gbps(nb, p["ms"])
                p["pct_copy"] = 100 * copy_ms / p["ms"]
                if o:
                    p["ours_speedup"] = p["ms"] / o["ms"]
            pg = p.get("graph")
            if pg and "ms" in pg:
                pg["gbps"] = gbps(nb, pg["ms"])
                pg["pct_copy"] = 100 * (copy_graph_ms or copy_ms) / pg["ms"]
                if g and "ms" in g:
                    pg["ours_graph_speedup"] = pg["ms"] / g["ms"]

    def progress(self, row, copy_ms):
        o = row["ours"]
        s = (f"{row['S']}x{row['C']} {row['mix']}:{fmt_n(row['ndocs'])} "
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
            s += f", err {chk['max_abs_err']:.2g}{'' if chk['ok'] else ' MISMATCH'}"
        for name, p in row["peers"].items():
            if "ms" in p:
                s += f" | {name} {fmt_ms(p['ms'])}"
            elif "error" in p:
                s += f" | {name} ERR"
        log(s)

    # ---- host overhead
    def host_overhead(self):
        a, dev, impls = self.args, self.dev, self.impls
        S, C = a.host_shape[0]
        x = torch.randn(S, C, device=dev.device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        w = torch.randn(C, 4, device=dev.device) * 0.5
        b = torch.randn(C, device=dev.device) * 0.5
        gen = torch.Generator().manual_seed(a.seed + 7)
        cu = make_cu(S, "rand", gen).to(dev.device)
        res = {"S": S, "C": C, "ndocs": cu.numel() - 1, "calls": a.host_calls, "results": {}}
        self.res["host_overhead"] = res
        cands = [("x.clone()", lambda: x.clone(), None)]
        if impls.ours is not None:
            f = impls.ours
            ws = None
            with contextlib.suppress(Exception):
                ws = impls.ours_ws(S, C, dev.device)
            cands.append(("ours (defaults)", lambda: f(x, w, cu, bias=b), None))
            cands.append(("ours (out=, workspace=)",
                          lambda: f(x, w, cu, bias=b, out=y, workspace=ws), None))
        if not self.over_budget():
            ctx: dict = {}
            for name in ("fla+ci", "fla-gluon", "fla", "dao"):
                if impls.available(name):
                    try:
                        call, _ = peer_call(impls, name, [x], w, b, cu, ctx)
                        cands.append((name, (lambda c=call: c(0)), name))
                    except Exception as e:
                        res["results"][name] = {"error": fmt_err(e)}
        res["results"].update(dev.host_us_rounds(
            cands, a.host_calls, lambda env: fla_env(impls, env) if env else contextlib.nullcontext()))
        for name, r in res["results"].items():
            log(f"host overhead {name}: {fmt_host(r)}")

    # ---- goals of issue 4
    def goals(self) -> dict:
        rows = [r for r in self.res["rows"] if r.get("copy_ms")]
        g: dict = {}

        def worst(items):
            return min(items, key=lambda t: t[0]) if items else None

        big = [(r["ours"]["pct_copy"], r) for r in rows
               if r["S"] * r["C"] >= LARGE_ELEMS and r["ours"]]
        w = worst(big)
        g["pct_copy_large>=90"] = None if w is None else {
            "pass": w[0] >= 90, "worst_pct": w[0], "worst": _rid(w[1]), "n": len(big)}
        mid = [(r["ours_graph"]["pct_copy"], r) for r in rows
               if 4 * 2**20 <= r["S"] * r["C"] <= 8 * 2**20 and r["ours_graph"]
               and "pct_copy" in r["ours_graph"]]
        w = worst(mid)
        g["graph_pct_copy_4to8M>=70"] = None if w is None else {
            "pass": w[0] >= 70, "worst_pct": w[0], "worst": _rid(w[1]), "n": len(mid)}
        for peer, need in (("fla+ci", 1.45), ("fla", 1.45), ("dao", 1.8)):
            sp = [(r["peers"][peer]["ours_speedup"], r) for r in rows
                  if r["S"] * r["C"] >= LARGE_ELEMS and peer in r["peers"]
                  and "ours_speedup" in r["peers"][peer]]
            w = worst(sp)
            g[f"speedup_vs_{peer}_large>={need}"] = None if w is None else {
                "pass": w[0] >= need, "worst": w[0], "at": _rid(w[1]), "n": len(sp)}
        ho = (self.res.get("host_overhead") or {}).get("results", {})
        r = ho.get("ours (defaults)")
        g["host_overhead_us<=10"] = None if not r or "median_us" not in r else {
            "pass": r["median_us"] <= 10, "median_us": r["median_us"]}
        chk = [r for r in self.res["rows"] if r.get("check")]
        g["correct"] = {"pass": all(r["check"]["ok"] for r in chk) and not any(
            r.get("ours_errors") for r in self.res["rows"]), "checked": len(chk),
            "mismatch": sum(not r["check"]["ok"] for r in chk)}
        return g

    # ---- tables
    def report(self):
        lines_d = self.detailed_tables()
        lines_c = self.compact_table()
        text_d = "\n".join(lines_d)
        text_c = "\n".join(lines_c)
        print("\n" + text_d, flush=True)
        print("\n" + text_c, flush=True)
        if self.args.md:
            with contextlib.suppress(Exception):
                Path(self.args.md).write_text(text_d + "\n\n" + text_c + "\n")

    def detailed_tables(self) -> list[str]:
        L = ["## Detailed: ours, every combo",
             "",
             "| S×C | docs | taps | ms | GB/s | % copy | r1/r2 | graph ms | graph % | "
             "max err | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.res["rows"]:
            o, g, c = r["ours"], r["ours_graph"], r["check"]
            L.append(
                f"| {r['S']}×{r['C']} | {r['mix']}:{fmt_n(r['ndocs'])} | "
                f"{variant_label(r['taps'], r['bias'])} | "
                f"{fmt_ms(o['ms']) if o else 'ERR' if r.get('ours_errors') else '-'} | "
                f"{_f0(o and o.get('gbps'))} | {fmt_pct(o and o.get('pct_copy'))} | "
                f"{_spread(o)} | "
                f"{fmt_ms(g['ms']) if g and 'ms' in g else ('ERR' if g else '-')} | "
                f"{fmt_pct(g.get('pct_copy')) if g else '-'} | "
                f"{_maxerr(c)} | "
                f"{('yes' if c['ok'] else '**NO**') if c else '-'} |")
        L += ["", "## Detailed: peers (FP32 taps, bias on)", "",
              "| S×C | docs | peer | ms | GB/s | % copy | ours × | graph ms | graph % | "
              "ours × (graph) | err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.res["rows"]:
            for name, p in r["peers"].items():
                if "absent" in p:
                    continue
                pg = p.get("graph") or {}
                chk = p.get("check")
                note = p.get("error") or p.get("skipped") or p.get("absent") or ""
                if pg.get("error"):
                    note = (note + " graph: " + pg["error"]).strip()
                if chk and not chk["ok"]:
                    note = ("MISMATCH " + note).strip()
                L.append(
                    f"| {r['S']}×{r['C']} | {r['mix']}:{fmt_n(r['ndocs'])} | {name} | "
                    f"{fmt_ms(p.get('ms'))} | {_f0(p.get('gbps'))} | "
                    f"{fmt_pct(p.get('pct_copy'))} | {_x(p.get('ours_speedup'))} | "
                    f"{fmt_ms(pg.get('ms'))} | {fmt_pct(pg.get('pct_copy'))} | "
                    f"{_x(pg.get('ours_graph_speedup'))} | "
                    f"{_maxerr(chk)} | "
                    f"{note[:90]} |")
        L += ["", "## Copy ceiling per shape (x.copy into bf16 y: 4·S·C bytes)", "",
              "| S×C | bytes | k rot | copy ms | GB/s |", "|---|---|---|---|---|"]
        for s in self.res["shapes"]:
            L.append(f"| {s['S']}×{s['C']} | {s['bytes'] / 1e6:.0f} MB | {s['k_rot']} | "
                     f"{fmt_ms(s.get('copy_ms'))} | {_f0(s.get('copy_gbps'))} |")
        ho = self.res.get("host_overhead")
        if ho:
            L += ["", f"## Host overhead per eager call (S={ho['S']}, C={ho['C']}, "
                      f"{ho['ndocs']} docs, {ho['calls']} calls)", "",
                  "| call | median µs | rounds µs | mean µs | × x.clone() |", "|---|---|---|---|---|"]
            for name, r in ho["results"].items():
                L.append(host_row(name, r))
        if self.res["errors"]:
            L += ["", "Errors:"] + [f"- {e['error']}" for e in self.res["errors"]]
        return L

    def compact_table(self) -> list[str]:
        env = self.env
        cp = self.res.get("copy_512MiB") or {}
        peers = [p for p in ALL_PEERS if self.impls.available(p)]
        L = [f"## bench_fwd {env['date_utc'][:16]} · {env.get('gpu', 'CPU smoke')} · driver "
             f"{env.get('driver')} · torch {env['torch']} · triton {env.get('triton')} · "
             f"copy 512 MiB {_f0(cp.get('gbps'))} GB/s "
             f"(runs {', '.join(_f0(v) for v in cp.get('gbps_runs', []))})",
             "Peer slice (FP32 taps, bias on). ours: ms / % of same-shape copy; graph: the "
             "graph-replayed kernel as % of a graph-replayed copy of the same bytes; peer cells: ours speedup × (peer % of copy); "
             "docs: mix:count."]
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
                    cells.append(f"{_x(p.get('ours_speedup'))} ({fmt_pct(p.get('pct_copy'))})"
                                 + ("!" if p.get("check") and not p["check"]["ok"] else ""))
                elif "error" in p:
                    cells.append("err")
                elif "skipped" in p:
                    cells.append("skip")
                else:
                    cells.append("-")
            L.append(f"| {r['S']}×{r['C']} | {r['mix']}:{fmt_n(r['ndocs'])} | "
                     f"{_f0(s.get('copy_gbps'))} | {fmt_ms(o['ms']) if o else '-'} | "
                     f"{fmt_pct(o and o.get('pct_copy'))}"
                     f"{'' if not r['check'] or r['check']['ok'] else ' WRONG'} | "
                     f"{fmt_pct(g.get('pct_copy')) if g else '-'} |" + "".join(
                         f" {c} |" for c in cells))
        # every combo of ours, summarized per shape
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
        ho = (self.res.get("host_overhead") or {}).get("results", {})
        if ho:
            L.append("host µs/call (median): " + ", ".join(
                f"{n} {r['median_us']:.1f}" if "median_us" in r else f"{n} err"
                for n, r in ho.items()))
        goals = self.res.get("goals") or {}
        gl = []
        for name, v in goals.items():
            if v is None:
                gl.append(f"{name}: n/a")
                continue
            mark = "PASS" if v["pass"] else "FAIL"
            detail = ""
            if "worst_pct" in v:
                detail = f" worst {v['worst_pct']:.1f}% at {v['worst']}"
            elif "worst" in v:
                detail = f" worst {v['worst']:.2f}× at {v['at']}"
            elif "median_us" in v:
                detail = f" {v['median_us']:.1f} µs"
            elif "checked" in v:
                detail = f" {v['checked']} checked, {v['mismatch']} mismatched"
            gl.append(f"{name}: {mark}{detail}")
        L.append("goals (issue 4): " + "; ".join(gl))
        absent = {k: v for k, v in self.impls.absent.items() if k != "ours_workspace"}
        if absent:
            L.append("absent: " + "; ".join(f"{k} ({v[:70]})" for k, v in absent.items()))
        if self.res["skipped"]:
            L.append(f"skipped (soft budget): {len(self.res['skipped'])} peer timings")
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


def _spread(o) -> str:
    return f"{100 * o['spread']:.1f}%" if o and "spread" in o else "-"


def _maxerr(c) -> str:
    return f"{c['max_abs_err']:.2g}" if c else "-"


def _f0(v):
    return "-" if v is None else f"{v:.0f}"


def _x(v):
    return "-" if v is None else f"{v:.2f}×"


def main(argv=None):
    args = parse_args(argv)
    if args.smoke_cpu:
        args.shapes = [(256, 64), (100, 40)]
        args.rot_mb = 0.5
        args.target_ms = 2.0
        args.host_calls = min(args.host_calls, 200)
    Bench(args).run()


if __name__ == "__main__":
    main()
