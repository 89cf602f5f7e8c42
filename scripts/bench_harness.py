"""The benchmark harness of flashinfer_cake: a benchmark is a `Bench` subclass that states its
inputs, its call, its bytes, its goals and its table columns (scripts/bench_fwd.py, bench_bwd.py).

Per S x C shape a run times a device-to-device copy of the op's bytes (the ceiling, before and
after the shape's combos), ours on every document mix x taps/bias variant (two rounds) and the
peers on one variant: medians of per-call CUDA-event times, inputs rotated over k sets whose
bytes exceed L2 (~60 MB on an H200) so that no timed call reads data left in L2. Small shapes
add CUDA-graph replays; results are checked against flashinfer_cake.reference in FP64, outputs
NaN-poisoned first; a 512 MiB copy and the host time of eager calls (`Dev.host_us_rounds`) close
the run. The peers (fla, fla-gluon, Dao, torch.compile, eager) are adapted in `Peers`. The last
lines of stdout are a compact table and the goals; --json gets everything (rewritten after each
shape, so that a crash keeps what was measured); --smoke-cpu runs the plumbing on a CPU.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

try:  # the package under test; without it the copy and the peers are still timed
    import flashinfer_cake as cake
    from flashinfer_cake import reference
    CAKE_ERROR = None
except Exception as e:  # noqa: BLE001
    cake = reference = None
    CAKE_ERROR = f"{type(e).__name__}: {e}"

REPO = Path(__file__).resolve().parents[1]
# Rows of 8 to 128 channels at S >= 1 M (the narrow-row goals of issue 17).
NARROW_SHAPES = [(1048576, 128), (1048576, 64), (1048576, 16), (2097152, 8)]
# 16384x4352: Mamba2's xBC width (d_inner 4096 + 2 x 128), whose grid does not fill whole waves the way the
# power-of-two shapes' do (the backward plan's wave choice, NOTES_bwd session 39).
FULL_SHAPES = [(4096, 4096), (16384, 8192), (32768, 8192), (65536, 2048),
               (32768, 4096), (8192, 2048), (1024, 8192), (131072, 4096), (16384, 4352), *NARROW_SHAPES]
QUICK_SHAPES = [(4096, 4096), (32768, 8192), (1024, 8192)]
MIXES = ("1", "rand", "many", "tiny")
# (taps dtype, bias on); the bias has the taps' dtype. Peers run on PEER_VARIANT only.
FULL_VARIANTS = [("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False)]
QUICK_VARIANTS = [("fp32", True), ("bf16", False)]
PEER_VARIANT = ("fp32", True)
# NVLink multicast off in every process of a multi-GPU run (the lent machines' rule; NCCL reads these
# when a communicator starts). tests/test_cp_multi_gpu.py sets the same for its ranks.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LARGE_ELEMS = 32 * 2**20  # the goals' "large" shapes: S*C >= 32 M
WIDE_C = (256, math.inf)  # the goals' "wide" rows; NARROW_SHAPES have goals of their own
# fla peer -> (chunk indices precomputed, fla's tensor cache off, FLA_CONV_GLUON)
FLA_MODES = {"fla+ci": (True, False, "0"), "fla": (False, True, "0"), "fla-gluon": (True, False, "1")}
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def fmt_ms(ms) -> str:
    return "-" if ms is None else f"{ms:.4f}" if ms < 1 else f"{ms:.3f}"


def fmt_n(n: int) -> str:
    return f"{n / 1000:.0f}k" if n >= 10000 else str(n)


def fmt(v, spec: str = ".0f") -> str:
    """v by spec, a trailing "%" or "×" printed as a unit; "-" for None."""
    return "-" if v is None else f"{v:{spec.rstrip('%×')}}{spec[len(spec.rstrip('%×')):]}"


def fmt_err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def variant_label(taps: str, bias: bool) -> str:
    return taps + ("+b" if bias else "")


def row_id(r: dict) -> str:
    return f"{r['S']}x{r['C']} {r['mix']}:{r['ndocs']} {variant_label(r['taps'], r['bias'])}"


def clean(obj):
    """JSON-safe: NaN/inf -> None, tuples -> lists, anything else unknown -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, str)) else str(obj)


def tensors(out) -> list:
    """The tensors of a call's output (a tensor, or nested tuples/lists with Nones)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    return []


def poison(out) -> None:
    """NaN into every floating-point tensor of `out`: a call must rewrite all of it to pass."""
    for t in tensors(out):
        if t.is_floating_point():
            t.fill_(float("nan"))


def dist_version(name: str) -> str | None:
    from importlib.metadata import version
    with contextlib.suppress(Exception):
        return version(name)
    return None


# ---- Arguments

def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip().lower() for p in text.replace("×", "x").split(","))):
        try:
            s, c = part.split("x")
            out.append((int(s), int(c)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}; use SxC, e.g. 4096x4096") from None
    if not out:
        raise argparse.ArgumentTypeError("no shape given")
    return out


def duration_ms(text: str) -> float:
    """An argparse type: a finite number of milliseconds, at least 0 (--rest-ms, --settle-ms)."""
    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds, got {text!r}") from None
    if not 0 <= ms < math.inf:  # nan fails too
        raise argparse.ArgumentTypeError(f"expected a finite number of at least 0, got {text}")
    return ms


def comma_list(choices):
    """An argparse type: a comma list of some of `choices`, as a tuple."""
    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        for x in items:
            if x not in choices:
                raise argparse.ArgumentTypeError(f"unknown {x!r}; choose from {','.join(choices)}")
        return items
    return parse


def add_common_arguments(p: argparse.ArgumentParser, bench) -> None:
    arg, variants = p.add_argument, [variant_label(*v) for v in FULL_VARIANTS]
    arg("--quick", action="store_true", help="3 shapes, all doc mixes, ours on fp32+b and bf16, peers on fp32+b")
    arg("--json", metavar="PATH", help="every number and the environment (rewritten after each shape)")
    arg("--md", metavar="PATH", help="the detailed and compact tables")
    arg("--shapes", type=parse_shapes, metavar="SxC,...", help="the shapes, e.g. 4096x4096,16384x8192")
    arg("--mixes", type=comma_list(MIXES), default=MIXES, help=f"doc mixes out of {','.join(MIXES)} (default: all)")
    arg("--variants", type=comma_list(variants), help=f"taps/bias variants for ours out of {','.join(variants)} "
        "(default: all; --quick: fp32+b,bf16)")
    arg("--no-peers", action="store_true", help="time only the copy and ours")
    arg("--peers", type=comma_list(bench.PEERS), default=bench.PEERS, help=f"out of {','.join(bench.PEERS)}")
    arg("--target-ms", type=float, help=f"GPU time per measurement (default {bench.TARGET_MS[0]:g}, --quick "
        f"{bench.TARGET_MS[1]:g}): reps = target / the estimated time per call, within --min-reps..--max-reps")
    arg("--min-reps", type=int, default=10, help="(default %(default)s)")
    arg("--max-reps", type=int, default=bench.MAX_REPS, help="(default %(default)s)")
    arg("--rot-mb", type=float, default=200.0, help="rotate over k input/output sets of together >= this many MB "
        "(default %(default)s; L2 is ~60 MB on an H200)")
    arg("--rest-ms", type=duration_ms, default=0.0, help="leave the GPU idle this long before each measurement, so that "
        "none runs under the power state the previous one left (default %(default)s: back to back; tune.py rests 500)")
    arg("--graph-max-elems", type=int, default=1 << 24, help="CUDA-graph timings for S*C <= this (default 16M: "
        "1024x8192, 4096x4096, 8192x2048)")
    arg("--graph-calls", type=int, default=20, help="calls per captured graph (default %(default)s)")
    arg("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    arg("--no-peer-graph", action="store_true", help=f"skip those of the peers ({', '.join(bench.GRAPH_PEERS)})")
    arg("--host-shape", type=parse_shapes, default=[(1024, 256)], metavar="SxC", help="(default 1024x256)")
    arg("--host-calls", type=int, default=2000, help="calls per host-overhead candidate (default %(default)s)")
    arg("--no-host", action="store_true", help="skip the host-overhead rounds")
    arg("--check", choices=("all", "shape", "none"), default="all", help="check ours against the FP64 reference on "
        "every combo, the first mix of each shape, or never (default all; peers on the peer slice unless none)")
    arg("--budget-s", type=float, default=bench.BUDGET_S, help="soft wall-clock budget: past it, peers and ours' "
        "second round are skipped; 0 = none (default %(default)s)")
    arg("--compile-dynamic", action="store_true", default=bench.COMPILE_DYNAMIC,
        help=f"torch.compile the reference once, dynamic shapes (default: {bench.COMPILE_DYNAMIC})")
    arg("--compile-static", dest="compile_dynamic", action="store_false", help="... once per shape")
    arg("--seed", type=int, default=0, help="(default %(default)s)")
    arg("--smoke-cpu", action="store_true", help="plumbing test without a GPU: tiny shapes, host timers, no graphs, "
        "the reference standing in for ours; numbers are meaningless")


def parse_args(bench, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=bench.DESCRIPTION)
    add_common_arguments(p, bench)
    bench.add_arguments(p)
    a = p.parse_args(argv)
    if a.target_ms is None:
        a.target_ms = bench.TARGET_MS[1] if a.quick else bench.TARGET_MS[0]
    a.shapes = a.shapes or (QUICK_SHAPES if a.quick else FULL_SHAPES)
    labels = {variant_label(*v): v for v in FULL_VARIANTS}
    a.variants = [labels[v] for v in a.variants] if a.variants else QUICK_VARIANTS if a.quick else FULL_VARIANTS
    a.peers = () if a.no_peers else a.peers
    for S, C in a.shapes:
        if S < 1 or C < 8 or C % 8:
            p.error(f"shape {S}x{C}: need S >= 1 and C a positive multiple of 8")
    if a.smoke_cpu:  # plumbing only: as little work as runs every path, on one thread (no stalls on a busy CPU)
        a.shapes, a.rot_mb, a.target_ms, a.min_reps, a.max_reps = [(256, 64), (100, 40)], 0.5, 2.0, 3, 10
        a.host_shape, a.host_calls = [(256, 64)], min(a.host_calls, 50)
        torch.set_num_threads(1)
    return a


# ---- Timing: CUDA events on a GPU, the host clock in --smoke-cpu

class Dev:
    def __init__(self, smoke_cpu: bool):
        self.cuda = not smoke_cpu
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def rest(self, ms: float) -> None:
        """Leave the GPU idle for ms once its work is done, so that a timing starts from the same
        idle state whatever ran before it (the measured effect: scripts/tune.py's docstring)."""
        if ms > 0:
            self.sync()
            time.sleep(ms / 1e3)

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
        """host_us of each (name, fn, env) candidate in `rounds` interleaved rounds (the host's
        speed drifts: x.clone() took 7.9 to 11.5 µs in one process on the H200 host). A result:
        median_us (of the round medians), mean_us, min_round_us, rounds_us, vs_first (median of
        round median / the first candidate's), or error (it raised). context(env) wraps calls."""
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
        """Per-call times in ms of fn(i), i cycling over the nrot input sets."""
        if not self.cuda:
            out = []
            for r in range(reps):
                t = time.perf_counter()
                fn((start + r) % nrot)
                out.append((time.perf_counter() - t) * 1e3)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        torch.cuda.synchronize()
        for r, (s, e) in enumerate(ev):
            s.record()
            fn((start + r) % nrot)
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]


def measure(dev: Dev, fn, nrot: int, args, *, warm: int = 3, reps: int | None = None, start: int = 0) -> dict:
    """After args.rest_ms of idle GPU (if the namespace has it, Dev.rest), warm up (the first call
    may compile or autotune: timed apart), then the median of many reps, as many as fit
    args.target_ms (within min_reps..max_reps)."""
    dev.rest(getattr(args, "rest_ms", 0.0))
    t = time.perf_counter()
    fn(start % nrot)
    dev.sync()
    first_s = time.perf_counter() - t
    est = statistics.median(dev.time_reps(fn, nrot, warm, start=start + 1))
    if reps is None:
        reps = args.max_reps if est <= 0 else min(args.max_reps, max(args.min_reps, math.ceil(args.target_ms / est)))
    times = dev.time_reps(fn, nrot, reps, start=start + 1 + warm)
    return {"ms": statistics.median(times), "reps": reps, "first_call_s": first_s, "min_ms": min(times),
            "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))], "samples": times}


def measure_graph(dev: Dev, call, nrot: int, args) -> tuple[dict, list, Any]:
    """Capture args.graph_calls calls (cycling over the nrot sets) in one CUDA graph and time its
    replays. Returns the timing per call, the outputs of the calls (outs[j]: call j's, kept alive
    since each call owns its buffers) and the graph."""
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
        for j in range(args.graph_calls):
            outs.append(call(j % nrot))
    torch.cuda.synchronize()
    rep = measure(dev, lambda i: g.replay(), 1, args, warm=2)
    per = {k: v / args.graph_calls if k in ("ms", "min_ms", "p90_ms") else v for k, v in rep.items() if k != "samples"}
    per["calls_per_graph"] = args.graph_calls
    return per, outs, g


# ---- Inputs, checks, environment

def make_cu(S: int, mix: str, gen: torch.Generator) -> torch.Tensor:
    """int32 cu_seqlens (CPU) of one document mix: 1 document, 16-64 random ones,
    max(1024, S/16) random ones, or 1-8-token documents."""
    if mix == "1" or S <= 1:
        cuts = torch.tensor([], dtype=torch.long)
    elif mix in ("rand", "many"):
        n = int(torch.randint(16, 65, (1,), generator=gen)) if mix == "rand" else max(1024, S // 16)
        cuts = torch.sort(torch.randperm(S - 1, generator=gen)[: max(1, min(n, S)) - 1] + 1).values
    elif mix == "tiny":
        ends = torch.cumsum(torch.randint(1, 9, (S // 4 + 8,), generator=gen), 0)
        cuts = ends[ends < S]
    else:
        raise ValueError(mix)
    return torch.cat([torch.zeros(1, dtype=torch.long), cuts.long(), torch.tensor([S])]).to(torch.int32)


def check_tensors(got: dict, ref: dict, tol: dict, rel_max: float) -> dict:
    """Compare got[name] with ref[name] for every name of tol: pass = finite, |got - ref| <=
    tol elementwise, and ||got - ref|| / ||ref|| < rel_max. A missing tensor fails."""
    res = {}
    for name, t in tol.items():
        r, g = ref[name], got.get(name)
        try:
            if g is None:
                raise ValueError("missing")
            d = g.detach().reshape(r.shape).to(r.dtype) - r
            finite = bool(torch.isfinite(d).all())
            err = d.abs()
            nbad = int((err > t).sum())
            max_err = float(err.max()) if err.numel() else 0.0
            rn, dn = float(r.norm()), float(d.norm())
            rel = dn / rn if rn > 0 else dn
            res[name] = {"ok": finite and nbad == 0 and rel < rel_max, "finite": finite,
                         "max_abs_err": max_err, "n_out_of_tol": nbad, "rel_l2_err": rel}
        except Exception as e:  # e.g. a peer's output of another shape: a failed check
            res[name] = {"ok": False, "error": fmt_err(e)}
    first = res[next(iter(tol))]
    return {"ok": all(c["ok"] for c in res.values()), "max_abs_err": first.get("max_abs_err"), **res}


def mismatch_text(chk: dict) -> str:
    return "; ".join(
        f"{n}: {c['error']}" if "error" in c else f"{n}: max err {c['max_abs_err']:.3g}, rel "
        f"{c['rel_l2_err']:.3g}, {c['n_out_of_tol']} out of tol, finite={c['finite']}"
        for n, c in chk.items() if isinstance(c, dict) and not c["ok"])


def run_cmd(cmd: list[str]) -> str | None:
    with contextlib.suppress(Exception):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        return r.stdout.strip() if r.returncode == 0 else None
    return None


def git_head() -> str | None:
    """The checkout's short HEAD, "+dirty" when tracked files differ from it (then the numbers are not
    that commit's)."""
    head = run_cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    if head and run_cmd(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]):
        head += "+dirty"
    return head


def environment(dev: Dev, script: str) -> dict:
    """Date, host, versions, git head, and the GPU with its driver and clocks."""
    env = {"script": script, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "python": sys.version.split()[0], "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "argv": sys.argv,
           "triton": dist_version("triton"), "flashinfer_cake": getattr(cake, "__version__", None),
           "flashinfer_cake_path": str(Path(cake.__file__).parent) if cake else None,
           "git_head": git_head()}
    if not dev.cuda:
        return env
    p = torch.cuda.get_device_properties(0)
    env.update({"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "sm_count": p.multi_processor_count, "gpu_mem_gib": round(p.total_memory / 2**30, 1),
                "l2_bytes": getattr(p, "L2_cache_size", None)})
    with contextlib.suppress(Exception):
        env["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
    keys = ["smi_name", "driver", "clock_sm", "clock_mem", "clock_max_sm", "clock_max_mem", "power_limit", "temp_c"]
    q = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                 "clocks.max.mem,power.limit,temperature.gpu", "--format=csv,noheader"])
    env.update(dict(zip(keys, (s.strip() for s in q.splitlines()[0].split(",")))) if q else {"driver": None})
    return env


# ---- Peers

def reference_bf16(x, weight, cu_seqlens, bias=None):
    """The reference in FP32 math with a BF16 result: what the compile and eager peers run."""
    return reference.causal_conv1d_reference(x, weight, cu_seqlens, bias, dtype=torch.float32).to(torch.bfloat16)


def leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


@dataclass
class PeerForward:
    """A peer's forward in our convention: fn(x [S, C]) -> its output; to_sc(output) -> [S, C];
    from_sc(dy [S, C]) -> dy in the output's layout."""
    fn: Callable
    to_sc: Callable = lambda y: y
    from_sc: Callable = lambda dy: dy


@dataclass
class Timed:
    """One timed thing: call(i) runs it on input set i and returns its output; got(output) is
    what the check compares; poison: the outputs of set 0 to NaN-fill before a checked call;
    notes: recorded with its results."""
    call: Callable
    got: Callable = lambda out: out
    poison: tuple = ()
    notes: dict = field(default_factory=dict)


def grads_dict(grads) -> dict:
    """(dx, dweight[, dbias]) -> the dict the backward's check compares."""
    return {"dx": grads[0], "dweight": grads[1], "dbias": grads[2] if len(grads) > 2 else None}


def autograd_backward(make_forward, xs, dys, w, b) -> Timed:
    """A forward once per input set under autograd (make_forward(weight, bias) -> PeerForward);
    timed: torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True), the backward only."""
    wg, bg = leaf(w), leaf(b)
    fwd = make_forward(wg, bg)
    ins = [(leaf(x), wg) + ((bg,) if bg is not None else ()) for x in xs]
    ys = [fwd.fn(i[0]) for i in ins]
    gos = [fwd.from_sc(dy) for dy in dys]
    return Timed(lambda i: torch.autograd.grad(ys[i], ins[i], gos[i], retain_graph=True), grads_dict)


class Peers:
    """The peers a run asked for, imported once (absent ones recorded with the reason), and
    adapters giving each our convention: x [S, C], weight [C, 4], cu_seqlens int32."""

    def __init__(self, names, smoke: bool, compile_dynamic: bool, fla_modes: dict):
        self.absent: dict[str, str] = {}
        self.versions: dict[str, str | None] = {}
        self.fla_modes = {n: m for n, m in fla_modes.items() if n in names}
        self.fla = self.fla_utils = self.fla_ci = self.fla_bwd = self.gluon = self.dao = self.compiled = None
        self.compile_dynamic = compile_dynamic
        for n in names:
            if reference is None and n in ("compile", "eager"):
                self.absent[n] = "flashinfer_cake.reference: " + CAKE_ERROR
            elif smoke and (n in self.fla_modes or n in ("dao", "compile")):
                self.absent[n] = "skipped in --smoke-cpu"
        if self.fla_modes and not smoke:
            self._import_fla()
        if "dao" in names and not smoke:
            try:
                from causal_conv1d import causal_conv1d_fn
                self.dao, self.versions["dao"] = causal_conv1d_fn, dist_version("causal-conv1d")
            except Exception as e:
                self.absent["dao"] = fmt_err(e)
        if "compile" in names and "compile" not in self.absent:
            self._compile()
        self.names = [n for n in names if n not in self.absent]
        self.fail_streak: dict[str, int] = {}
        self.disabled: dict[str, str] = {}  # peer -> why, after consecutive failures

    def _import_fla(self):
        try:
            import fla.utils
            from fla.modules.causal_conv1d import causal_conv1d
        except Exception as e:
            self.absent.update({n: fmt_err(e) for n in self.fla_modes})
            return
        self.fla, self.fla_utils = causal_conv1d, fla.utils
        self.versions["fla"] = dist_version("fla-core") or getattr(sys.modules.get("fla"), "__version__", None)
        try:
            from fla.ops.utils import prepare_chunk_indices
            self.fla_ci = prepare_chunk_indices
        except Exception as e:
            self.absent.update({n: "no fla.ops.utils.prepare_chunk_indices: " + fmt_err(e)
                                for n, (ci, _, _) in self.fla_modes.items() if ci})
        with contextlib.suppress(Exception):  # the raw backward, for CUDA-graph capture
            from fla.modules.causal_conv1d import causal_conv1d_bwd
            self.fla_bwd = causal_conv1d_bwd
        self.gluon = sys.modules.get("fla.modules.causal_conv1d.backends.gluon")
        for n, (_, _, gluon) in self.fla_modes.items():
            if gluon == "1" and self.gluon is None:
                self.absent.setdefault(n, "fla's Gluon backend not registered on this machine")

    def _compile(self):
        try:
            import torch._dynamo as dynamo
            for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit"):  # one compile per shape (or more): past torch's limits
                if hasattr(dynamo.config, name):
                    setattr(dynamo.config, name, 256)
            with contextlib.suppress(Exception):  # a backward replayed on one retained graph: no donated buffers
                import torch._functorch.config as functorch_config
                functorch_config.donated_buffer = False
            self.compiled = torch.compile(reference_bf16, dynamic=self.compile_dynamic)
        except Exception as e:
            self.absent["compile"] = fmt_err(e)

    def failed(self, name: str, why: str, limit: int = 2):
        n = self.fail_streak[name] = self.fail_streak.get(name, 0) + 1
        if n >= limit and name not in self.disabled:
            self.disabled[name] = f"skipped after {n} consecutive failures (last: {why[:150]})"
            log(f"peer {name}: {self.disabled[name]}")

    @contextlib.contextmanager
    def env(self, name):
        """fla's switches for peer `name` (none for the others): Gluon on for fla-gluon, off for
        the others even where the user's environment turns it on (fla reads FLA_CONV_GLUON at
        every dispatch, autograd's backward thread included); the tensor cache off for fla."""
        mode = self.fla_modes.get(name)
        if mode is None or self.fla_utils is None:
            yield
            return
        want = {"FLA_CONV_GLUON": "1"} if mode[2] == "1" else {"FLA_CONV_GLUON": "0", "FLA_GLUON": "0"}
        prev = {k: os.environ.get(k) for k in want}
        prev_cache = getattr(self.fla_utils, "FLA_DISABLE_TENSOR_CACHE", False)
        os.environ.update(want)
        self.fla_utils.FLA_DISABLE_TENSOR_CACHE = mode[1] or prev_cache
        try:
            yield
        finally:
            self.fla_utils.FLA_DISABLE_TENSOR_CACHE = prev_cache
            os.environ.update({k: v for k, v in prev.items() if v is not None})
            for k in (k for k, v in prev.items() if v is None):
                os.environ.pop(k)

    def chunk_indices(self, cu, cache):
        cu_long = cache.setdefault("cu_long", cu.long())
        if "fla_ci" not in cache:
            cache["fla_ci"] = self.fla_ci(cu_long, 64)
        return cu_long, cache["fla_ci"]

    def forward(self, name, w, b, cu, S, cache) -> PeerForward:
        """Peer `name`'s forward on S tokens; `cache` (one per cu_seqlens) keeps what the peers
        derive from cu_seqlens."""
        if name in self.fla_modes:
            cu_long, ci = self.chunk_indices(cu, cache) if self.fla_modes[name][0] else (cu.long(), None)
            f = self.fla
            return PeerForward(lambda x: f(x[None], w, b, activation="silu", cu_seqlens=cu_long, chunk_indices=ci)[0],
                               lambda y: y[0], lambda dy: dy[None])
        if name == "dao":  # channel-last [1, C, S], a document index per token
            if "seq_idx" not in cache:
                t = torch.arange(S, device=cu.device)
                cache["seq_idx"] = torch.searchsorted(cu.long()[1:].contiguous(), t, right=True).to(torch.int32)[None]
            f, seq_idx, bb = self.dao, cache["seq_idx"], b if b is None or b.dtype == w.dtype else b.to(w.dtype)
            return PeerForward(lambda x: f(x[None].transpose(1, 2), w, bb, seq_idx=seq_idx, activation="silu"),
                               lambda y: y[0].transpose(0, 1), lambda dy: dy[None].transpose(1, 2))
        if name in ("compile", "eager"):
            if name == "compile" and not self.compile_dynamic:
                torch._dynamo.maybe_mark_dynamic(cu, 0)  # one static compile per shape, whatever the mix
            f = self.compiled if name == "compile" else reference_bf16
            return PeerForward(lambda x: f(x, w, cu, b))
        raise ValueError(f"no adapter for peer {name!r}")

    def fla_raw_backward(self, xs, dys, w, b, cu, cache) -> Timed:
        """fla's raw backward (what its autograd Function runs), capturable in a CUDA graph."""
        if self.fla_bwd is None:
            raise RuntimeError("fla.modules.causal_conv1d.causal_conv1d_bwd not importable")
        cu_long, ci = self.chunk_indices(cu, cache)
        f, x3, dy3 = self.fla_bwd, [x[None] for x in xs], [dy[None] for dy in dys]
        return Timed(lambda i: f(x=x3[i], dy=dy3[i], dht=None, weight=w, bias=b, residual=None, initial_state=None,
                                 activation="silu", cu_seqlens=cu_long, chunk_indices=ci),
                     grads_dict, notes={"what": "raw causal_conv1d_bwd (no autograd), graph-replayed"})

    def gluon_backward_verdict(self, x, dy, w, b, cu, cache) -> dict:
        """Whether fla would run its Gluon backward on these arguments (and why not)."""
        with contextlib.suppress(Exception):
            ok, why = self.gluon.causal_conv1d_bwd_verifier(x=x[None], dy=dy[None], dht=None, weight=w, bias=b,
                                                            cu_seqlens=cache.setdefault("cu_long", cu.long()),
                                                            chunk_size=64)
            return {"gluon_bwd_accepted": bool(ok), **({} if ok else {"gluon_bwd_rejected": str(why)})}
        return {}


# ---- The run

@dataclass
class Goal:
    """A goal: the worst and the median of `metric` over the rows with S*C in `elems` and C in
    `channels`, passing when the worst is >= need ("host:<call>": its median µs, passing when <=
    need; need None: reported)."""
    name: str
    metric: str  # "pct_copy", "graph_pct_copy", "speedup:<peer>" or "host:<call>"
    need: float | None = None
    elems: tuple = (LARGE_ELEMS, math.inf)
    channels: tuple = WIDE_C

    def covers(self, row: dict) -> bool:
        elems, channels = row["S"] * row["C"], row["C"]
        return self.elems[0] <= elems <= self.elems[1] and self.channels[0] <= channels <= self.channels[1]


def metric_value(metric: str, row: dict):
    kind, _, peer = metric.partition(":")
    if kind == "speedup":
        return row["peers"].get(peer, {}).get("ours_speedup")
    return (row["ours" if kind == "pct_copy" else "ours_graph"] or {}).get("pct_copy")


def goal_text(name: str, v) -> str:
    if v is None:
        return f"{name}: n/a"
    mark = ("PASS " if v["pass"] else "FAIL ") if "pass" in v else ""
    if "median_us" in v:
        return f"{name}: {mark}{v['median_us']:.1f} µs"
    if "checked" in v:
        return f"{name}: {mark}{v['checked']} checked, {v['mismatch']} mismatched, {v['ours_errors']} errors"
    spec = ".2f×" if v["metric"].startswith("speedup") else ".1f%"
    return f"{name}: {mark}worst {fmt(v['worst'], spec)} at {v['at']}, median {fmt(v['median'], spec)} (n {v['n']})"


def md_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_head(*cols) -> list[str]:
    return [md_row(*cols), "|---" * len(cols) + "|"]


def row_cells(r: dict) -> tuple[str, str]:
    """The S×C and docs cells of a row."""
    return f"{r['S']}×{r['C']}", f"{r['mix']}:{fmt_n(r['ndocs'])}"


def host_row(name: str, r: dict) -> str:
    """A result of Dev.host_us_rounds as a markdown row: median, rounds, mean, × the first call."""
    if "median_us" not in r:
        return md_row(name, "ERR", str(r.get("error", ""))[:80], "", "")
    return md_row(name, f"{r['median_us']:.1f}", f"{min(r['rounds_us']):.1f}–{max(r['rounds_us']):.1f}",
                  f"{r['mean_us']:.1f}", fmt(r["vs_first"], ".2f"))


def peer_cell(p: dict) -> str:
    """A peer in the compact table: our speedup × (its % of copy), "!" where it differs from the reference."""
    if "ms" not in p:
        return "err" if "error" in p else "skip" if "skipped" in p else "-"
    return (f"{fmt(p.get('ours_speedup'), '.2f×')} ({fmt(p.get('pct_copy'), '.0f%')})"
            + ("!" if p.get("check") and not p["check"]["ok"] else ""))


def check_cell(chk, name: str) -> str:
    c = (chk or {}).get(name)
    if not c:
        return "-"
    return "chk ERR" if "error" in c else f"{c['max_abs_err']:.2g}" + ("" if c["ok"] else "!")


@dataclass
class Case:
    """One combination: a shape's rotated sets, one cu_seqlens, one taps/bias variant."""
    S: int
    C: int
    k: int
    sets: dict  # tensor name -> k views [S, C]: the inputs random, the outputs uninitialized
    ws: Any  # our workspace for the shape (None: the call's default)
    mix: str
    cu: torch.Tensor
    taps: str
    w: torch.Tensor
    b: torch.Tensor | None
    cache: dict  # one per cu_seqlens: what the peers derive from it


class Bench:
    """One benchmark run. A subclass states what differs: the class attributes below and
    ours(case) -> Timed or None (absent), reference(case) -> {name: FP64 tensor, ...},
    check(got, ref, loose) -> check_tensors(...)'s dict, host_candidates(case) -> the host rounds'
    (name, fn, peer env or None) after x.clone(); and peer, peer_graph where the defaults do not fit."""
    NAME, DESCRIPTION = "bench", ""
    BYTES = 4  # DRAM bytes the op must move per element of [S, C]; the copy ceiling moves as many
    INPUTS, OUTPUTS = ("x",), ("y",)  # BF16 [S, C] inputs (random) and outputs, one of each per rotated set
    WORKSPACE: str | None = None  # public name of our workspace factory
    PEERS, FLA_MODES = (), FLA_MODES
    GRAPH_PEERS: tuple = ()  # peers whose peer_graph call is graph-replayed on small shapes
    LOOSE_PEERS: tuple = ()  # peers checked with a looser tolerance (another rounding)
    HOST_PEERS, HOST_PEER_SUFFIX = (), ""  # peers whose timed call joins the host rounds; their label's end
    HOST_SHORT: dict = {}  # host call -> short name for the compact table (empty: every call)
    HOST_DELTAS: dict = {}  # label -> (call a, call b), by short name: the median of a minus b's
    CHECK_COLUMNS: dict = {}  # checked tensor -> its column in the detailed tables
    GOALS: tuple = ()
    # GPU ms per measurement (full suite, --quick), --max-reps, --budget-s, --compile-dynamic
    TARGET_MS, MAX_REPS, BUDGET_S, COMPILE_DYNAMIC = (40.0, 25.0), 400, 225.0, False
    OURS_LABEL = HEADER_EXTRA = ""  # the tables' words for ours and for the run (str.format with the args)
    METHOD = NOTE = PEER_NOTE = ""  # the JSON's account of what is timed; the compact and peer tables' legends

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        """Options of this benchmark only."""

    def peer(self, name: str, case: Case) -> Timed:
        """The peer's forward on set i."""
        fwd = self.peers.forward(name, case.w, case.b, case.cu, case.S, case.cache)
        xs = case.sets["x"]
        return Timed(lambda i: fwd.fn(xs[i]), fwd.to_sc)

    def peer_graph(self, name: str, case: Case) -> Timed:
        return self.peer(name, case)

    def __init__(self, args):
        self.args = args
        self.dev = Dev(args.smoke_cpu)
        self.env = environment(self.dev, self.NAME)
        self.peers = Peers(args.peers, args.smoke_cpu, args.compile_dynamic, self.FLA_MODES)
        self.standin = self.budget_hit = False
        self.ours_label = self.OURS_LABEL.format(**vars(args))
        cfg = dict(vars(args), variants=[variant_label(*v) for v in args.variants],
                   shapes=[f"{s}x{c}" for s, c in args.shapes], host_shape="%dx%d" % args.host_shape[0])
        self.res = {"env": self.env, "config": cfg, "method": self.METHOD, "absent": self.peers.absent,
                    "versions": self.peers.versions, "disabled_peers": self.peers.disabled, "ours_is_standin": False,
                    "copy_512MiB": None, "copy_512MiB_runs": [], "shapes": [], "rows": [], "host_overhead": None,
                    "warnings": [], "errors": [], "skipped": [], "goals": None, "peer_mismatch": [], "timing": {}}

    def pick(self, public_name: str, standin: Callable):
        """Our function `public_name`; in --smoke-cpu `standin` (the kernels need a GPU); None
        when flashinfer_cake does not import."""
        if self.args.smoke_cpu and reference is not None:
            self.standin = self.res["ours_is_standin"] = True
            return standin
        if cake is None:
            self.peers.absent["ours"] = CAKE_ERROR
            return None
        return getattr(cake, public_name)

    def warn(self, msg: str):
        self.res["warnings"].append(msg)
        print(f"WARNING: {msg}", flush=True)

    def over_budget(self) -> bool:
        if not self.args.budget_s or elapsed() <= self.args.budget_s:
            return False
        if not self.budget_hit:
            self.budget_hit = True
            log(f"soft budget {self.args.budget_s:.0f}s passed: skipping peers and ours' second round from here on")
        return True

    def free(self):
        if self.dev.cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def guarded(self, where: str, fn, *args):
        """fn(*args); an exception is recorded and printed, and the run goes on."""
        try:
            fn(*args)
        except Exception as e:
            msg = f"{where} aborted: {fmt_err(e)}"
            self.res["errors"].append({"where": where, "error": msg, "traceback": traceback.format_exc()[-2000:]})
            print(msg, flush=True)
            traceback.print_exc()
            self.free()

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

    def run(self):
        a, absent = self.args, self.peers.absent
        state = "CPU STAND-IN" if self.standin else "ABSENT" if "ours" in absent else "present"
        log(f"torch {torch.__version__}, {self.env.get('gpu', 'CPU smoke')}, driver {self.env.get('driver')}; "
            f"ours ({self.ours_label}): {state}; peers: {', '.join(self.peers.names) or 'none'}; absent: "
            f"{', '.join(f'{k} ({v[:80]})' for k, v in absent.items()) or 'none'}")
        if "ours" in absent:
            self.warn(f"ours absent: {absent['ours']}")
        torch.manual_seed(a.seed)
        self.guarded("copy 512 MiB", self.copy_large, "start")
        for S, C in a.shapes:
            self.guarded(f"shape {S}x{C}", self.run_shape, S, C)
            self.free()
            self.write_json()
        self.guarded("copy 512 MiB", self.copy_large, "end")
        if not a.no_host:
            self.guarded("host overhead", self.host_overhead)
        runs = [r["gbps"] for r in self.res["copy_512MiB_runs"]]
        self.res["copy_512MiB"] = {"gbps": max(runs), "gbps_runs": runs} if runs else None
        self.guarded("goals", self.summarize)
        self.res["timing"]["total_s"] = elapsed()
        self.write_json()
        self.report()
        self.write_json()

    def copy_large(self, when: str):
        n = 256 * 2**20 if self.dev.cuda else 2**20  # 512 MiB of BF16 (2 MiB in --smoke-cpu)
        x = torch.randn(n, device=self.dev.device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        m = measure(self.dev, lambda i: y.copy_(x), 1, self.args, reps=100 if self.dev.cuda else 5)
        out = {"when": when, "bytes": 4 * n, "ms": m["ms"], "gbps": 4 * n / m["ms"] / 1e6, "reps": m["reps"]}
        self.res["copy_512MiB_runs"].append(out)
        log(f"copy 512 MiB ({when}): {out['ms']:.4f} ms, {out['gbps']:.0f} GB/s (read+write)")

    def alloc(self, S: int, C: int, k: int, shp: dict) -> tuple[dict, Callable, dict]:
        """Everything of a shape: Case fields (k rotated sets of [S, C] views, the workspace),
        copy(i) moving the op's bytes within set i's buffers, and the taps (weight, bias) per dtype."""
        n, dev, bf16 = S * C, self.dev.device, torch.bfloat16
        ncopy = self.BYTES * n // 4  # BF16 elements: read + written = BYTES * S * C bytes
        srcs = [torch.randn(len(self.INPUTS) * n, device=dev, dtype=bf16) for _ in range(k)]
        dsts = [torch.empty(max(len(self.OUTPUTS) * n, ncopy), device=dev, dtype=bf16) for _ in range(k)]
        sets = {name: [buf[j * n:(j + 1) * n].view(S, C) for buf in bufs]
                for names, bufs in ((self.INPUTS, srcs), (self.OUTPUTS, dsts)) for j, name in enumerate(names)}
        w32, b32 = torch.randn(C, 4, device=dev) * 0.5, torch.randn(C, device=dev) * 0.5
        taps = {"fp32": (w32, b32), "bf16": (w32.to(bf16), b32.to(bf16))}
        ws = None
        try:
            if not (self.standin or cake is None or self.WORKSPACE is None):
                ws = getattr(cake, self.WORKSPACE)(S, C, dev)
        except Exception as e:
            shp["workspace_error"] = fmt_err(e)
        base = {"S": S, "C": C, "k": k, "sets": sets, "ws": ws}
        return base, lambda i: dsts[i][:ncopy].copy_(srcs[i][:ncopy]), taps

    def run_shape(self, S: int, C: int):
        a, dev = self.args, self.dev
        nbytes = self.BYTES * S * C
        k = max(1, math.ceil(a.rot_mb * 1e6 / nbytes))
        shp = {"S": S, "C": C, "bytes": nbytes, "k_rot": k}
        self.res["shapes"].append(shp)
        base, copy, taps = self.alloc(S, C, k, shp)
        c1 = measure(dev, copy, k, a)
        small = S * C <= a.graph_max_elems and dev.cuda and not a.no_graph
        if small:  # graph-replayed kernels are compared with a graph-replayed copy of the bytes
            try:
                shp["copy_graph_ms"] = measure_graph(dev, copy, k, a)[0]["ms"]
            except Exception as e:
                shp["copy_graph_error"] = fmt_err(e)
        gen = torch.Generator().manual_seed(a.seed * 1000003 + S * 31 + C)
        rows = []
        for mi, mix in enumerate(a.mixes):
            cu, cache = make_cu(S, mix, gen).to(dev.device), {}
            for tp, has_b in a.variants:
                w, b = taps[tp]
                case = Case(**base, mix=mix, cu=cu, taps=tp, w=w, b=b if has_b else None, cache=cache)
                rows.append(self.run_case(case, mi == 0, small, c1["ms"]))
        c2 = measure(dev, copy, k, a)
        samples = c1["samples"] + c2["samples"]
        shp.update(copy_ms=statistics.median(samples), copy_ms_runs=[c1["ms"], c2["ms"]], copy_reps=len(samples))
        shp["copy_gbps"] = nbytes / shp["copy_ms"] / 1e6
        for row in rows:  # % of copy needs this shape's copy: filled in now
            self.finish_row(row, shp["copy_ms"], shp.get("copy_graph_ms"))
        log(f"{S}x{C}: copy of {self.BYTES // 2}·S·C bytes {fmt_ms(shp['copy_ms'])} ms = {shp['copy_gbps']:.0f} "
            f"GB/s (runs {fmt_ms(c1['ms'])}, {fmt_ms(c2['ms'])}), k_rot={k}")

    def run_case(self, case: Case, first_mix: bool, small: bool, copy_ms: float) -> dict:
        a = self.args
        row = {"S": case.S, "C": case.C, "mix": case.mix, "ndocs": case.cu.numel() - 1, "taps": case.taps,
               "bias": case.b is not None, "bytes": self.BYTES * case.S * case.C, "ours": None,
               "ours_graph": None, "check": None, "peers": {}}
        self.res["rows"].append(row)
        do_check = a.check == "all" or (a.check == "shape" and first_mix)
        is_peer = (case.taps, row["bias"]) == PEER_VARIANT and bool(a.peers)
        ref = None
        if reference is not None and (do_check or (is_peer and a.check != "none")):
            try:
                ref = self.reference(case)
            except Exception as e:
                row["reference_error"] = fmt_err(e)
                self.warn(f"reference failed on {row_id(row)}: {fmt_err(e)}")
                self.free()
        self.run_ours(row, case, ref if do_check else None, round_=1)
        for name in a.peers if is_peer else ():
            self.run_peer(row, name, case, ref, small)
        if row["ours"] is not None and not self.over_budget():
            self.run_ours(row, case, None, round_=2)
        if small:
            self.run_ours_graph(row, case, ref if do_check else None)
        del ref
        self.progress(row, copy_ms)
        return row

    def run_ours(self, row: dict, case: Case, ref, round_: int):
        timed = self.ours(case)
        if timed is None:
            return
        try:
            if ref is not None:
                self.checked_first_call(row, timed, ref)
            m = measure(self.dev, timed.call, case.k, self.args)
        except Exception as e:
            row.setdefault("ours_errors", []).append(fmt_err(e))
            self.warn(f"ours FAILED {row_id(row)}: {fmt_err(e)}")
            self.free()
            return
        o = row["ours"] = row["ours"] or {"samples": []}  # round 2 joins round 1's samples
        o[f"ms_r{round_}"], o[f"reps_r{round_}"], o["samples"] = m["ms"], m["reps"], o["samples"] + m["samples"]
        o["ms"], o["min_ms"] = statistics.median(o["samples"]), min(o["samples"])
        if round_ == 2:
            o["spread"] = abs(o["ms_r1"] - o["ms_r2"]) / min(o["ms_r1"], o["ms_r2"])

    def checked_first_call(self, row: dict, timed: Timed, ref: dict):
        """NaN into set 0's outputs, one call, the check (a mismatch warns, never aborts)."""
        poison(timed.poison)
        t = time.perf_counter()
        out = timed.call(0)
        self.dev.sync()
        row["ours_first_call_s"] = time.perf_counter() - t
        chk = row["check"] = self.check(timed.got(out), ref, False)
        chk["returned_out"] = [p.data_ptr() for p in tensors(out)] == [p.data_ptr() for p in tensors(timed.poison)]
        if not chk["ok"]:
            self.warn(f"ours MISMATCH {row_id(row)}: {mismatch_text(chk)}")
        if not chk["returned_out"]:
            self.warn(f"ours did not return the given outputs on {row_id(row)}")

    def graph_timing(self, timed: Timed, case: Case, ref, loose: bool) -> dict:
        """timed.call replayed from a CUDA graph; with ref: NaN into call 0's outputs, one replay,
        the check (the replay must rewrite them)."""
        try:
            g, outs, graph = measure_graph(self.dev, timed.call, case.k, self.args)
            if ref is not None:
                poison(outs[0])
                graph.replay()
                torch.cuda.synchronize()
                g["check"] = self.check(timed.got(outs[0]), ref, loose)
            return {**g, **timed.notes}
        except Exception as e:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            return {"error": fmt_err(e)}

    def run_ours_graph(self, row: dict, case: Case, ref):
        timed = self.ours(case)
        if timed is None or row["ours"] is None:
            return
        g = row["ours_graph"] = self.graph_timing(timed, case, ref, False)
        if "error" in g:
            self.warn(f"ours graph FAILED {row_id(row)}: {g['error']}")
        elif g.get("check") and not g["check"]["ok"]:
            self.warn(f"ours graph-replay MISMATCH {row_id(row)}: {mismatch_text(g['check'])}")

    def run_peer(self, row: dict, name: str, case: Case, ref, small: bool):
        if name not in self.peers.names:
            row["peers"][name] = {"absent": self.peers.absent.get(name, "not requested")}
            return
        if name in self.peers.disabled or self.over_budget():
            row["peers"][name] = {"skipped": self.peers.disabled.get(name, "soft time budget")}
            self.res["skipped"] += [] if name in self.peers.disabled else [f"{name} {row_id(row)}"]
            return
        rec = row["peers"][name] = {}
        try:
            with self.peers.env(name):
                self.time_peer(row, name, case, ref)
                self.peers.fail_streak[name] = 0
                if small and name in self.GRAPH_PEERS and not self.args.no_peer_graph:
                    rec["graph"] = self.graph_timing(self.peer_graph(name, case), case, ref, name in self.LOOSE_PEERS)
        except Exception as e:
            rec["error"] = fmt_err(e)
            print(f"  peer {name} failed on {row_id(row)}: {rec['error']}", flush=True)
            self.free()
            self.peers.failed(name, rec["error"])

    def time_peer(self, row: dict, name: str, case: Case, ref):
        rec = row["peers"][name]
        t = time.perf_counter()
        timed = self.peer(name, case)  # the autograd peers run their forwards (and compile) here
        self.dev.sync()
        rec["setup_s"] = time.perf_counter() - t
        rec.update(timed.notes)
        t = time.perf_counter()
        out = timed.call(0)  # the first call: autotune / compile happen here
        self.dev.sync()
        rec["first_call_s"] = time.perf_counter() - t
        if ref is not None:
            rec["check"] = self.check(timed.got(out), ref, name in self.LOOSE_PEERS)
            if not rec["check"]["ok"]:
                print(f"  peer {name} differs from the reference on {row_id(row)}: {mismatch_text(rec['check'])}",
                      flush=True)
        del out
        m = measure(self.dev, timed.call, case.k, self.args)
        rec.update(ms=m["ms"], reps=m["reps"], min_ms=m["min_ms"])

    def finish_row(self, row: dict, copy_ms: float, copy_graph_ms):
        """GB/s, % of copy and speedups of a row, now that its shape's copy is measured."""
        nb, o, g = row["bytes"], row["ours"], row["ours_graph"]
        row["copy_ms"], row["copy_graph_ms"] = copy_ms, copy_graph_ms
        if o:
            o.pop("samples", None)
        for rec, ref_copy in [(o, copy_ms), (g, copy_graph_ms or copy_ms)] + [
                (p, copy_ms) for p in row["peers"].values()] + [
                (p.get("graph"), copy_graph_ms or copy_ms) for p in row["peers"].values()]:
            if rec and "ms" in rec:
                rec["gbps"], rec["pct_copy"] = nb / rec["ms"] / 1e6, 100 * ref_copy / rec["ms"]
        for p in row["peers"].values():
            if "ms" in p and o:
                p["ours_speedup"] = p["ms"] / o["ms"]
            if "ms" in (p.get("graph") or {}) and g and "ms" in g:
                p["graph"]["ours_graph_speedup"] = p["graph"]["ms"] / g["ms"]

    def progress(self, row: dict, copy_ms: float):
        o, g, chk = row["ours"], row["ours_graph"], row["check"]
        s = f"{row['S']}x{row['C']} {row['mix']}:{fmt_n(row['ndocs'])} {variant_label(row['taps'], row['bias'])}: ours "
        s += f"{fmt_ms(o['ms'])} ms ~{100 * copy_ms / o['ms']:.0f}% of copy" if o else "- ms"
        if o and "spread" in o:
            s += f" (r1/r2 spread {100 * o['spread']:.1f}%)"
        if g and "ms" in g:
            s += f", graph {fmt_ms(g['ms'])} ms/call"
        if chk:
            name, col = next(iter(self.CHECK_COLUMNS.items()))
            s += f", {col} {check_cell(chk, name)}{'' if chk['ok'] else ' MISMATCH'}"
        for name, p in row["peers"].items():
            if "ms" in p:
                s += f" | {name} {fmt_ms(p['ms'])}" + (f" ({p['ms'] / o['ms']:.2f}×)" if o else "")
            elif "error" in p:
                s += f" | {name} ERR"
        log(s)

    def host_overhead(self):
        """Host µs per eager call at --host-shape, in interleaved rounds (Dev.host_us_rounds)."""
        a = self.args
        S, C = a.host_shape[0]
        base, _, taps = self.alloc(S, C, 1, {})
        cu = make_cu(S, "rand", torch.Generator().manual_seed(a.seed + 7)).to(self.dev.device)
        case = Case(**base, mix="rand", cu=cu, taps="fp32", w=taps["fp32"][0], b=taps["fp32"][1], cache={})
        res = self.res["host_overhead"] = {"S": S, "C": C, "ndocs": cu.numel() - 1, "calls": a.host_calls,
                                           "results": {}}
        x = case.sets["x"][0]
        cands = [("x.clone()", lambda: x.clone(), None)] + self.host_candidates(case)
        for name in self.HOST_PEERS:  # past the budget, ours only
            if name in self.peers.names and name not in self.peers.disabled and (
                    name.startswith("ours") or not self.over_budget()):
                try:
                    with self.peers.env(name):
                        timed = self.peer(name, case)
                    cands.append((name + self.HOST_PEER_SUFFIX, lambda t=timed: t.call(0), name))
                except Exception as e:
                    res["results"][name + self.HOST_PEER_SUFFIX] = {"error": fmt_err(e)}
        res["results"].update(self.dev.host_us_rounds(cands, a.host_calls, self.peers.env))
        med = {self.HOST_SHORT.get(k, k): v["median_us"] for k, v in res["results"].items() if "median_us" in v}
        res["derived_median_us"] = {label: med[hi] - med[lo] for label, (hi, lo) in self.HOST_DELTAS.items()
                                    if hi in med and lo in med}
        for name, r in res["results"].items():  # median µs, rounds' range, mean, × x.clone()
            log(f"host overhead {host_row(name, r)}")
        for label, v in res["derived_median_us"].items():
            log(f"host overhead {label}: {v:+.1f} us/call (medians)")

    def summarize(self):
        rows, all_rows = [r for r in self.res["rows"] if r.get("copy_ms")], self.res["rows"]
        goals = {g.name: self.goal_result(g, rows) for g in self.GOALS}
        chk = [r["check"] for r in all_rows if r["check"]] + [
            r["ours_graph"]["check"] for r in all_rows if (r["ours_graph"] or {}).get("check")]
        errors = sum(bool(r.get("ours_errors")) for r in all_rows)
        goals["correct"] = {"pass": all(c["ok"] for c in chk) and not errors, "checked": len(chk),
                            "mismatch": sum(not c["ok"] for c in chk), "ours_errors": errors}
        self.res["goals"] = goals
        self.res["peer_mismatch"] = [f"{n} {row_id(r)}" for r in all_rows for n, p in r["peers"].items()
                                     if p.get("check") and not p["check"]["ok"]]

    def goal_result(self, goal: Goal, rows: list):
        """The goal's figures; with a verdict ("pass") where it has a need and the timings are a GPU's
        (--smoke-cpu's host timers of a stand-in judge nothing)."""
        judged = goal.need is not None and not self.args.smoke_cpu
        if goal.metric.startswith("host:"):
            r = ((self.res["host_overhead"] or {}).get("results") or {}).get(goal.metric[5:], {})
            if "median_us" not in r:
                return None
            return {"median_us": r["median_us"], **({"pass": r["median_us"] <= goal.need} if judged else {})}
        vals = [(v, r) for r in rows if goal.covers(r) and (v := metric_value(goal.metric, r)) is not None]
        if not vals:
            return None
        worst = min(vals, key=lambda t: t[0])
        out = {"metric": goal.metric, "worst": worst[0], "at": row_id(worst[1]),
               "median": statistics.median(v for v, _ in vals), "n": len(vals)}
        return {**out, "pass": worst[0] >= goal.need} if judged else out

    # ---- tables
    def report(self):
        texts = []
        for part in (self.detailed_tables, self.compact_table):
            try:
                texts.append("\n".join(part()))
            except Exception as e:
                texts.append(f"({part.__name__} failed: {fmt_err(e)})")
            print("\n" + texts[-1], flush=True)
        if self.args.md:
            try:
                Path(self.args.md).parent.mkdir(parents=True, exist_ok=True)
                Path(self.args.md).write_text("\n\n".join(texts) + "\n")
            except Exception as e:
                print(f"could not write {self.args.md}: {fmt_err(e)}", flush=True)

    def detailed_tables(self) -> list[str]:
        env, cols = self.env, list(self.CHECK_COLUMNS)
        L = [f"# {self.NAME} {env['date_utc']} · {env.get('gpu', 'CPU smoke')} · driver {env.get('driver')} · torch "
             f"{env['torch']} (CUDA {env.get('torch_cuda')}) · triton {env.get('triton')} · flashinfer_cake "
             f"{env.get('flashinfer_cake')} (git {env.get('git_head')}) · peers: "
             + ", ".join(f"{k} {v}" for k, v in self.peers.versions.items()), "",
             f"## Detailed: ours ({self.ours_label}), every combo"
             + (" — CPU STAND-IN, numbers meaningless" if self.standin else ""), ""]
        L += md_head("S×C", "docs", "taps", "ms", "GB/s", "% copy", "r1/r2", "graph ms", "graph %",
                     *self.CHECK_COLUMNS.values(), "ok")
        for r in self.res["rows"]:
            o, g, c = r["ours"] or {}, r["ours_graph"] or {}, r["check"]
            ok = ("yes" if c["ok"] else "**NO**") if c else "ref ERR" if r.get("reference_error") else "-"
            ok += " (graph **NO**)" if g.get("check") and not g["check"]["ok"] else ""
            L.append(md_row(*row_cells(r), variant_label(r["taps"], r["bias"]),
                            fmt_ms(o["ms"]) if o else "ERR" if r.get("ours_errors") else "-", fmt(o.get("gbps")),
                            fmt(o.get("pct_copy"), ".0f%"), fmt(100 * o["spread"] if "spread" in o else None, ".1f%"),
                            fmt_ms(g["ms"]) if "ms" in g else "ERR" if g else "-", fmt(g.get("pct_copy"), ".0f%"),
                            *(check_cell(c, n) for n in cols), ok))
        return L + self.detailed_peers() + self.detailed_copy_host()

    def detailed_peers(self) -> list[str]:
        name0, col0 = next(iter(self.CHECK_COLUMNS.items()))
        L = ["", f"## Detailed: peers ({variant_label(*PEER_VARIANT)}{self.PEER_NOTE})", ""] + md_head(
            "S×C", "docs", "peer", "ms", "GB/s", "% copy", "ours ×", "graph ms", "graph %", "ours × (graph)", col0,
            "note")
        for r in self.res["rows"]:
            for name, p in r["peers"].items():
                if "absent" in p:
                    continue
                pg, chk = p.get("graph") or {}, p.get("check")
                note = " ".join(filter(None, (
                    "MISMATCH" if chk and not chk["ok"] else "",
                    f"gluon rejected: {p.get('gluon_bwd_rejected')}" if p.get("gluon_bwd_accepted") is False else "",
                    p.get("error") or p.get("skipped"), pg.get("error") and "graph: " + pg["error"])))
                L.append(md_row(*row_cells(r), name, fmt_ms(p.get("ms")), fmt(p.get("gbps")),
                                fmt(p.get("pct_copy"), ".0f%"), fmt(p.get("ours_speedup"), ".2f×"),
                                fmt_ms(pg.get("ms")), fmt(pg.get("pct_copy"), ".0f%"),
                                fmt(pg.get("ours_graph_speedup"), ".2f×"), check_cell(chk, name0), note[:90]))
        return L

    def detailed_copy_host(self) -> list[str]:
        L = ["", f"## Copy ceiling per shape ({self.BYTES // 2}·S·C bytes copied = {self.BYTES}·S·C bytes of "
                 "traffic, the op's floor)", ""] + md_head("S×C", "traffic", "k rot", "copy ms", "GB/s", "graph ms")
        L += [md_row(f"{s['S']}×{s['C']}", f"{s['bytes'] / 1e6:.0f} MB", s["k_rot"], fmt_ms(s.get("copy_ms")),
                     fmt(s.get("copy_gbps")), fmt_ms(s.get("copy_graph_ms"))) for s in self.res["shapes"]]
        ho = self.res["host_overhead"]
        if ho:
            L += ["", f"## Host overhead per eager call (S={ho['S']}, C={ho['C']}, {ho['ndocs']} docs, {ho['calls']} "
                      "calls)", ""] + md_head("call", "median µs", "rounds µs", "mean µs", "× x.clone()")
            L += [host_row(name, r) for name, r in ho["results"].items()]
            L += [md_row(label, f"{v:+.1f}", "", "", "") for label, v in ho["derived_median_us"].items()]
        return L + (["", "Errors:"] + [f"- {e['error']}" for e in self.res["errors"]] if self.res["errors"] else [])

    def compact_table(self) -> list[str]:
        env, cp, peers = self.env, self.res["copy_512MiB"] or {}, self.peers.names
        sel, what = [r for r in self.res["rows"] if (r["taps"], r["bias"]) == PEER_VARIANT], "Peer slice (fp32+b)"
        if not sel:  # e.g. --variants bf16: show what ran
            sel, what = self.res["rows"][:40], "First 40 combos (no peers)"
        L = [f"## {self.NAME} {env['date_utc'][:16]} · {env.get('gpu', 'CPU smoke')} · driver {env.get('driver')} · "
             f"torch {env['torch']} · triton {env.get('triton')}{self.HEADER_EXTRA.format(**vars(self.args))} · copy "
             f"512 MiB {fmt(cp.get('gbps'))} GB/s (runs {', '.join(fmt(v) for v in cp.get('gbps_runs', []))})",
             ("CPU SMOKE TEST with a reference stand-in for ours: numbers are meaningless. " if self.standin else "")
             + f"{what}. {self.NOTE}"] + md_head("S×C", "docs", "copy GB/s", "ours ms", "ours %", "graph %", *peers)
        shapes = {(s["S"], s["C"]): s for s in self.res["shapes"]}
        for r in sel:
            o, g, chk = r["ours"] or {}, r["ours_graph"] or {}, r["check"]
            L.append(md_row(*row_cells(r), fmt(shapes.get((r["S"], r["C"]), {}).get("copy_gbps")), fmt_ms(o.get("ms")),
                            fmt(o.get("pct_copy"), ".0f%") + ("" if not chk or chk["ok"] else " WRONG"),
                            fmt(g.get("pct_copy"), ".0f%"), *(peer_cell(r["peers"].get(n, {})) for n in peers)))
        return L + self.per_shape_lines(shapes) + self.trailer_lines()

    def per_shape_lines(self, shapes: dict) -> list[str]:
        parts = []
        for S, C in shapes:
            rs = [r for r in self.res["rows"] if (r["S"], r["C"]) == (S, C) and (r["ours"] or {}).get("pct_copy")]
            pc = [r["ours"]["pct_copy"] for r in rs]
            gp = [r["ours_graph"]["pct_copy"] for r in rs if (r["ours_graph"] or {}).get("pct_copy")]
            parts.append(f"{S}×{C}: " + (f"{min(pc):.0f}–{max(pc):.0f}%" if pc else "-")
                         + (f" (g {min(gp):.0f}–{max(gp):.0f}%)" if gp else ""))
        return ["", "ours over all taps/bias/mix combos, per shape: min–max % of copy (graph min–max where timed)"
                ] + ["  " + "; ".join(parts[i:i + 4]) for i in range(0, len(parts), 4)]

    def trailer_lines(self) -> list[str]:
        L, ho = [], self.res["host_overhead"] or {}
        hr = {n: v for n, v in ho.get("results", {}).items() if not self.HOST_SHORT or n in self.HOST_SHORT}
        if hr:
            L.append("host µs/call (median of rounds): " + ", ".join(
                f"{self.HOST_SHORT.get(n, n)} " + fmt(v.get("median_us"), ".1f") for n, v in hr.items()))
        if ho.get("derived_median_us"):
            L.append("host deltas µs/call: " + ", ".join(f"{k} {v:+.1f}" for k, v in ho["derived_median_us"].items()))
        L.append("goals" + " (timings not judged: --smoke-cpu)" * self.args.smoke_cpu + ": " +
                 "; ".join(goal_text(k, v) for k, v in (self.res["goals"] or {}).items()))
        if self.res["peer_mismatch"]:
            L.append(f"peers differing from the reference: {len(self.res['peer_mismatch'])}")
        absent = {k: v for k, v in self.peers.absent.items() if k in self.PEERS or k == "ours"}
        if absent:
            L.append("absent: " + "; ".join(f"{k} ({v[:70]})" for k, v in absent.items()))
        if self.res["skipped"]:
            L.append(f"skipped (soft budget): {len(self.res['skipped'])} peer timings")
        L += [f"peer {name} {why}" for name, why in self.peers.disabled.items()]
        w = self.res["warnings"]
        L += [f"WARNING: {m[:200]}" for m in w[:5]] + [f"WARNING: ... {len(w) - 5} more (see JSON)"] * (len(w) > 5)
        if self.res["errors"]:
            L.append(f"ERRORS: {len(self.res['errors'])} (see detailed table / JSON)")
        return L + [f"total {elapsed():.0f}s" + (f"; JSON: {self.args.json}" if self.args.json else "")]

# A benchmark's line when torch sees no GPU (then it exits 2).
NO_GPU = "no CUDA device visible to torch"


def main(bench_cls, argv=None):
    args = parse_args(bench_cls, argv)
    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"{bench_cls.NAME}: {NO_GPU} (this benchmark needs a GPU; use --smoke-cpu to "
              "test the script's plumbing on a CPU)", file=sys.stderr, flush=True)
        sys.exit(2)
    bench_cls(args).run()


if __name__ == "__main__":  # a module the benchmarks import, not one of them
    asked = sys.argv[1:] in ([], ["-h"], ["--help"])
    print(__doc__.strip() + "\n\nRun a benchmark: scripts/bench_fwd.py, bench_bwd.py or bench_states.py (--help: its "
          "options).", file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
