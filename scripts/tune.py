#!/usr/bin/env python3
"""Measure tile geometries of the forward or the backward side by side (one GPU run, many builds).

Each config overrides the launcher's CAKE_FWD_* / CAKE_BWD_* defaults (threads, strip length,
ring rows (backward: of the routes above 4 channel lanes; NARROW_RING=N sets the warp-filled
2- and 4-lane routes'), min CTAs per SM, optionally the channels per thread (backward: 4 or 8; the forward
takes 8 only), then any NAME=VALUE for another CAKE_FWD_NAME / CAKE_BWD_NAME macro (refused if no header of the compiled
tree reads it); backward: ITEM_TOKENS=N
launches with token groups of N tokens instead of the plan's (whole strips, or at C > 32 from 256 tokens on a multiple of 16; the launcher's split of
the last wave and the last eighth, bwd_tail, apply to them; TAIL=0 turns both off); INC=NAME compiles the
headers of --inc NAME=DIR instead of this checkout's, e.g. an older commit's for an A/B in one run:
their C entries must take this checkout's arguments; the plan's even-run groups where they take them, else
whole strips, whose dweight / dbias are then compared with the configs of the same groups only) for one
variant (default fp32 taps + fp32 bias); all are built in parallel, then timed against a device
copy of the same DRAM bytes on each shape (forward: read x, write y; backward: read x and dy,
write dx), and against torch ops moving the op's bytes in its own pattern (buffers' floors: the
backward's x + dy, the forward's copy between row-strided slices): eager CUDA-event medians
over rotated inputs, and for shapes up to --graph-max-elems the kernel time from a replayed CUDA
graph (the eager figure of a kernel shorter than the ctypes launch is the launch's). Every config must give bitwise the same result as the first (the exit code
says if not: an experiment may time a config that computes something else): y, or dx, and with
states the final states or dinitial_states; dweight and dbias too where the config sums the same
partial rows (the same threads, strip length, channels per thread, ITEM_TOKENS and
SMALL_GRID_WARPS: another geometry adds in another fixed order). With --states each config also
runs with per-document states (forward: initial_states and final_states_out; backward:
initial_states and dfinal_states, giving dinitial_states), timed beside its stateless run.
Timing: --rounds rounds in varied orders (round_orders), each timing after --rest-ms of idle GPU
(default 500: back to back, what ran before moved the backward by up to 15 %; rested, a build and
its repeat read within 0.25 % at 32 M elements and more, r127 and r128), and optionally
--settle-ms of its own calls.

    python scripts/tune.py --op fwd --configs 128/16/8/4,128/16/12/4 [--variant bf16/none] [--json out.json]
    python scripts/tune.py --op fwd --states --configs 128/16/8/4,128/16/8/4/TL_MAX_C=32 --shapes 1048576x64x1
        (TL_MAX_C: the widest C of the token-lane route; TL_BLOCKS, TL_RING, TL_MIN_CTAS its geometry
         (TL_MIN_CTAS_STATELESS: the stateless kernel's, when it should differ);
         STATES_NARROW_ABOVE_C: with states, C above it up to 64 takes the 8-lane strip kernel, 64 = never;
         RING_SHORT_DOCS, SHORT_DOC_TOKENS: with states at C > 128, the ring of documents of at most that many
         tokens on average, whatever the config's ring field, which sets every other route's)
    python scripts/tune.py --op bwd --configs 128/64/8/4/4,128/64/8/4/8
        (the route at C % 256 == 0 has 8 channels per thread whatever VEC says (WideVec8: stateless,
         or with states and documents of STATES_VEC8_MIN_DOC_TOKENS tokens or more on average; only
         where its busiest SM carries at most 1/VEC8_BALANCE_DIV more than Wide's, 0: always; with
         VEC=8 it differs from Wide only in its CTAs per SM); WIDE_VEC8=0 turns it off, which rings of
         12 rows or CTAs of 256 threads need: its kernels would exceed 48 KiB of shared memory)
    python scripts/tune.py --op bwd --states --configs 128/64/8/4 [--shapes 8192x4096x1,8192x4096x1024]
    python scripts/tune.py --op bwd --configs 128/64/8/4,128/64/8/4/ITEM_TOKENS=512 --shapes 8192x4096x1
    python scripts/tune.py --op bwd --configs 128/64/8/4,128/64/8/4/DX_STREAMING=0
        (dx stored plainly instead of with st.global.cs; --op fwd: Y_STREAMING=0 for y)
    python scripts/tune.py --op fwd --configs 128/16/8/4 --shapes 524288x64x1,524288x64x1x128
        (a fourth field PAD: x, y / dx, dy as column slices of [S, C + PAD] buffers, row stride C + PAD)
    git archive main include | tar -x -C /tmp/main
    python scripts/tune.py --op fwd --inc main=/tmp/main/include --configs 128/16/8/4/INC=main,128/16/8/4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_harness import Dev, duration_ms, measure, measure_graph
from flashinfer_cake import _plan, jit

SHAPES = [(16384, 8192, 16), (65536, 2048, 32), (32768, 4096, 1024), (32768, 4096, 8192),
          (131072, 4096, 32), (1024, 8192, 4), (4096, 4096, 1), (8192, 2048, 512)]


def config_spec(op: str, cfg: str, variant: str, incs: dict[str, str]) -> jit.JitSpec:
    """The variant's kernel module with the config's -D overrides and include tree (its own uri and
    digest)."""
    threads, strip, ring, min_ctas, *rest = cfg.split("/")
    m = f"-DCAKE_{op.upper()}_"
    # before the package's -I; the tree's digest as a define, so that a module built from another
    # content of the same directory is not reused (--build-dir)
    inc = [f for kv in rest if kv.startswith("INC=") for f in (f"-I{incs[kv[4:]]}", f"-DCAKE_TUNE_INC_DIGEST={tree_digest(incs[kv[4:]])}")]
    extra = [f"{m}{kv}" for kv in rest if "=" in kv and not kv.startswith("INC=")]
    # A macro the tree never reads would build its default kernel and time it under this config's name.
    tree = Path(next((incs[kv[4:]] for kv in rest if kv.startswith("INC=")), jit.env.include_dir()))
    headers = "".join(f.read_text() for f in sorted(tree.rglob("*")) if f.suffix in (".cuh", ".h"))
    for flag in extra:
        name = flag[2:].split("=", 1)[0]
        if name != f"{m[2:]}ITEM_TOKENS" and name not in headers:  # ITEM_TOKENS: tune.py's own (item_tokens)
            raise SystemExit(f"--configs {cfg}: {name} appears in no header under {tree}, so it would change "
                             f"nothing; the {m[2:]}* options are the macros the headers define (#ifndef ... #define)")
    vec = [f"{m}VEC={v}" for v in rest if "=" not in v]
    spec = jit.variant_spec(*variant.split("/"), "sm_90a", split=not inc)  # an older tree may lack the route list
    defines = (*inc, f"{m}THREADS={threads}", f"{m}STRIP_LEN={strip}", f"{m}RING={ring}", f"{m}MIN_CTAS={min_ctas}", *vec, *extra)
    return dataclasses.replace(spec, uri=f"tune_{op}_{re.sub(r'[^0-9A-Za-z]+', '_', cfg)}", cflags=spec.cflags + defines)


@functools.lru_cache(maxsize=None)
def tree_digest(root: str) -> str:
    """A digest of every file's path, size and content under root (an --inc tree), through
    symbolic links to folders as the compiler follows them."""
    h = hashlib.sha256()
    files = sorted(Path(d, f) for d, _, names in os.walk(root, followlinks=True) for f in names)
    for path in files:
        data = path.read_bytes()
        h.update(os.fsencode(path.relative_to(root)) + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:16]


def resource_lines(build_log: str, spec: jit.JitSpec) -> list[str]:
    """ptxas's register / spill lines of one config's module, from the prebuild's log (its file
    names start with the module's prefix: uri and digest, so no other config's lines match)."""
    lines, mine = [], False
    for line in build_log.splitlines():
        if line.startswith("["):
            mine = f" {spec.module_prefix()}" in line
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


def settle(fn, k: int, ms: float) -> None:
    """Run fn back to back for ms of wall time before it is timed: a sustained figure, under the
    power cap the kernel itself may bring about (H200, r122: timed right after the copy the backward
    read 232 µs, right after another backward 240-246 µs, the copy 191.5 µs in every round; r123,
    settled 300 ms: 243-273 µs, with the power cap engaged at up to ~700 W and the SM clock at
    1515-1980 MHz). After the rest (--rest-ms) the cap needs a longer settle: r130, 2000 ms, read
    16384x8192 at 254.8 µs and its repeat 255.8, at up to 720 W and 1380-1980 MHz."""
    t, i = time.perf_counter(), 0
    while (time.perf_counter() - t) * 1e3 < ms:
        for _ in range(8):
            fn(i % k)
            i += 1
        torch.cuda.synchronize()


# A file every kernel module includes: an --inc tree without it would compile this checkout's headers.
INC_MARKER = "flashinfer_cake/causal_conv1d_bwd_launcher.cuh"


def build(args) -> dict:
    """Every config's kernel module, built in one parallel ninja run; prints their registers."""
    out = Path(args.build_dir) if args.build_dir else Path(tempfile.mkdtemp())
    # absolute: the compiler runs in the build directory, where a relative -I finds nothing and
    # the package's own headers would be compiled instead, silently
    incs = {name: str(Path(d).resolve()) for name, d in (kv.split("=", 1) for kv in args.inc)}
    for name, d in incs.items():
        if not (Path(d) / INC_MARKER).is_file():
            raise SystemExit(f"--inc {name}={d}: expected an include tree holding {INC_MARKER}, found none")
    for c in args.configs.split(","):
        for kv in c.split("/"):
            if kv.startswith("INC=") and kv[4:] not in incs:
                raise SystemExit(f"{c}: {kv} names no --inc (given: {', '.join(incs) or 'none'})")
    specs = {c: config_spec(args.op, c, args.variant, incs) for c in args.configs.split(",")}
    built = jit.prebuild(list(specs.values()), out, progress=print)
    log_path = out / "build" / "prebuild" / "build.log"  # the last build's there
    log = log_path.read_text() if log_path.exists() else ""
    for c, spec in specs.items():
        regs = resource_lines(log, spec)
        if not regs:
            print(c, "in", out, "without ptxas lines in this build's log (compiled by an earlier build there)")
            continue
        used = sorted({r.split("Used ")[1].split(",")[0] for r in regs if "Used" in r})
        spills = sorted({r.strip() for r in regs if "spill" in r and " 0 bytes spill stores" not in r})
        print(c, used, "spills:", spills or "none")
    return {c: jit.core.open_artifact(spec, built[spec]) for c, spec in specs.items()}


def buffers(S: int, C: int, docs: int, pad: int, args, k: int | None = None) -> argparse.Namespace:
    """Rotated inputs and outputs of one shape (k sets: by default 400 MB or more in all), the parameters, a
    random document mix, states, and a copy of the op's DRAM bytes (4 S C forward, 6 S C backward).
    pad > 0: x, y / dx and dy are column slices at column pad / 2 of [S, C + pad] buffers (row
    stride C + pad); the copy stays contiguous.
    floors: torch ops on the op's own tensors that move its bytes in its pattern, each config timed
    against them too. Backward: add, dx = x + dy (two reads for each write, where the copy has one;
    r120: 101-104 % of the copy's rate). Forward with pad (a multiple of 16): copy-str, y = x between the
    slices as 16-byte elements (one per row vector; torch's strided copy kernel, where the contiguous
    copy is its plain one)."""
    k = k or max(1, int(4e8 // (4 * S * C)) + 1)
    b = argparse.Namespace(S=S, C=C, docs=docs, pad=pad, k=k, item_tokens=_plan.plan_of(S, C).item_tokens)

    def rows(fill):
        t = fill(S, C + pad, device="cuda", dtype=torch.bfloat16)
        return t[:, pad // 2:pad // 2 + C] if pad else t
    b.xs = [rows(torch.randn) for _ in range(k)]
    b.ys = [rows(torch.empty) for _ in range(k)]
    b.dys = [rows(torch.randn) for _ in range(k)] if args.op == "bwd" else None
    b.dw, b.db = torch.empty(C, 4, device="cuda"), torch.empty(C, device="cuda")
    b.pws = torch.empty(-(-S // _plan.STRIP_LEN) * _plan.PARTIAL_ROWS * C + 1, device="cuda")  # any content; one-strip groups
    wdt, bdt = (torch.bfloat16 if d == "bf16" else torch.float32 for d in args.variant.split("/"))
    b.w, b.b = torch.randn(C, 4, device="cuda", dtype=wdt), torch.randn(C, device="cuda", dtype=bdt)  # b: unused by "none"
    cuts = torch.randperm(S - 1, device="cuda")[: docs - 1] + 1
    b.cu = torch.cat([torch.tensor([0, S], device="cuda"), cuts]).sort().values.int()
    b.ws = torch.zeros(2, dtype=torch.int32, device="cuda")
    b.init, b.fin = (torch.randn(docs, 3, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    b.fin_out = torch.empty_like(b.init)  # forward: final_states_out; backward: dinitial_states
    if args.op == "fwd":
        src = [torch.empty(S * C, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        dst = [torch.empty_like(t) for t in src]
        b.copy = lambda i: dst[i % k].copy_(src[i % k])
        v16 = lambda t: t.view(torch.complex128)  # noqa: E731
        aligned = pad and (pad // 2) % 8 == 0 and C % 8 == 0  # 16-byte elements need 16-byte slices
        b.floors = {"copy-str": lambda i: v16(b.ys[i % k]).copy_(v16(b.xs[i % k]))} if aligned else {}
    else:
        src = [torch.empty(3 * S * C // 2, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
        dst = [torch.empty_like(t) for t in src]
        b.copy = lambda i: dst[i % k].copy_(src[i % k])
        b.floors = {"add": lambda i: torch.add(b.xs[i % k], b.dys[i % k], out=b.ys[i % k])}
    return b


def whole_strips(tokens: int) -> int:
    """tokens rounded up to whole strips (at most the longest group)."""
    return min(-(-tokens // _plan.STRIP_LEN) * _plan.STRIP_LEN, _plan.MAX_ITEM_TOKENS)


def item_tokens(cfg: str, b: argparse.Namespace) -> int:
    """The config's ITEM_TOKENS, else the plan's (at least one strip, _plan.STRIP_LEN tokens: the
    workspace is sized for one-strip groups). The plan's even-run groups (multiples of
    _plan.RUN_GROUP_TOKENS) are the shipped geometry's: a config of other threads or strips gets them
    rounded up to whole strips (an INC= tree of the shipped geometry keeps them if its C entry takes
    them: launcher)."""
    kv = dict(kv.split("=", 1) for kv in cfg.split("/") if "=" in kv)
    threads, strip = cfg.split("/")[:2]
    shipped = threads == "128" and strip == str(_plan.STRIP_LEN)
    n = int(kv.get("ITEM_TOKENS", b.item_tokens if shipped else whole_strips(b.item_tokens)))
    if n < _plan.STRIP_LEN:
        raise SystemExit(f"{cfg}: ITEM_TOKENS must be at least {_plan.STRIP_LEN}, got {n}")
    return n


def launcher(m, b: argparse.Namespace, op: str, cfg: str):
    """call(i, states=False): one launch of module m (config cfg) on rotation i through its C entry (a failed
    call raises RuntimeError with the entry's message); call.item_tokens: the backward's token groups."""
    dev, S, C, k = torch.cuda.current_device(), b.S, b.C, b.k
    tokens = item_tokens(cfg, b) if op == "bwd" else 0
    bad_tokens = "item_tokens must be"  # the C entry's message for groups its routes cannot walk

    def call(i, states=False):
        stream = torch._C._cuda_getCurrentRawStream(dev)
        st = lambda t: t.data_ptr() if states else 0  # noqa: E731
        if op == "fwd":
            rc = m.causal_conv1d_fwd(x=b.xs[i % k].data_ptr(), y=b.ys[i % k].data_ptr(), weight=b.w.data_ptr(),
                                     bias=b.b.data_ptr(), cu_seqlens=b.cu.data_ptr(), workspace=b.ws.data_ptr(),
                                     initial_states=st(b.init), final_states=st(b.fin_out), S=S, C=C, x_row_stride=C + b.pad,
                                     y_row_stride=C + b.pad, num_docs=b.docs, device=dev, stream=stream)
        else:
            rc = m.causal_conv1d_bwd(x=b.xs[i % k].data_ptr(), dy=b.dys[i % k].data_ptr(), dx=b.ys[i % k].data_ptr(),
                                     weight=b.w.data_ptr(), bias=b.b.data_ptr(), cu_seqlens=b.cu.data_ptr(),
                                     initial_states=st(b.init), dfinal_states=st(b.fin), dinitial_states=st(b.fin_out),
                                     frag_info=0, workspace=b.pws.data_ptr(), workspace_bytes=b.pws.shape[0] * 4,
                                     dweight=b.dw.data_ptr(), dbias=b.db.data_ptr(), S=S, C=C, x_row_stride=C + b.pad,
                                     dy_row_stride=C + b.pad, dx_row_stride=C + b.pad, num_docs=b.docs, item_tokens=tokens,
                                     round_preact=1, device=dev, stream=stream)
        if rc != 0:
            raise RuntimeError(m.last_error_message())

    if op == "bwd" and "/INC=" in f"/{cfg}" and "ITEM_TOKENS=" not in cfg and tokens != whole_strips(tokens):
        # An older include tree's C entry may take whole strips only: the plan's even-run groups where it
        # takes them (the same groups as this tree's build), else whole strips, said so.
        try:
            call(0)
        except RuntimeError as e:
            if bad_tokens not in str(e):
                raise
            print(f"  {cfg}: its C entry takes whole strips only: {whole_strips(tokens)} tokens a group, not {tokens} "
                  "(its dweight / dbias sum in another order)")
            tokens = whole_strips(tokens)
    call.item_tokens = tokens  # the groups it launches: part of its summation order (time_shape)
    return call


def summation_order(cfg: str) -> tuple:
    """What fixes the backward's dweight / dbias bits: the config's geometry and the macros that pick
    routes of another strip length (not its ring, CTAs per SM or other macros)."""
    threads, strip, _ring, _min_ctas, *rest = cfg.split("/")
    vec = [v for v in rest if "=" not in v]
    order = [kv for kv in rest if kv.startswith(("ITEM_TOKENS=", "SMALL_GRID_WARPS=", "TAIL="))]
    return threads, strip, tuple(vec), tuple(order)


def round_orders(names: list, rounds: int) -> list[list]:
    """The timers' order in each round. Timed back to back, a timer's figure depended on the timer
    right before it (r126: the plan's second build, always after another backward, read 11 %
    slower than the first at 512 M elements by median, 8-10 % settled at 128 M; in r127 a
    backward read up to 15 % slower right after another backward than rested). Round 0 is the
    given order; each later round is, among the orders that read the names with a stride coprime
    with their count from some start, the one whose first timer is not the last one's (no timer
    twice in a row), then that makes the most (timer before, timer) pairs not timed yet (the pair
    across the rounds' boundary included), then that puts the most timers in a place not yet
    theirs (with a prime count of timers, the first stays first). Deterministic. The rest before
    each timing (--rest-ms) is what removed the effect (r127); the orders keep it from favouring
    one config when the rest is short or off. One timer: the same order every round."""
    n = len(names)
    if n < 2:
        return [list(names) for _ in range(rounds)]
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1]
    candidates = [[(start + j * s) % n for j in range(n)] for s in strides for start in range(n)]
    orders = [list(range(n))][:rounds]
    pairs = set(zip(range(n), range(1, n)))
    places = [{i} for i in range(n)]
    while len(orders) < rounds:
        last = orders[-1][-1]

        def score(order):
            new_pairs = len({(last, order[0]), *zip(order, order[1:])} - pairs)
            return (order[0] != last, new_pairs, sum(j not in places[t] for j, t in enumerate(order)))

        best = max(candidates, key=score)  # max keeps the first of equal scores: deterministic
        pairs |= {(last, best[0]), *zip(best, best[1:])}
        for j, t in enumerate(best):
            places[t].add(j)
        orders.append(best)
    return [[names[i] for i in order] for order in orders]


def time_shape(mods: dict, b: argparse.Namespace, args, differs: list) -> dict:
    """The copy, the floors and every config on one shape (with states too when asked); a config
    whose result is not bitwise the first config's (dweight and dbias: the first config of the same
    summation order's) is listed in differs. Timed by time_rounds, each figure the median of its
    rounds: timed once in order, a config's time depended on what ran before it (H200, r120-r122:
    the same build read up to 3 % apart at 128 M elements and 9 % at 512 M as the first and the
    last config, and 4-16 % apart between rounds right after the copy and right after another
    backward; the copy's time did not move)."""
    small = b.S * b.C <= args.graph_max_elems
    timers = {"copy": b.copy, **b.floors}
    tensors = ("y", "final_states") if args.op == "fwd" else ("dx", "dinitial_states", "dweight", "dbias")
    refs = {}
    for c, m in mods.items():
        call = launcher(m, b, args.op, c)
        for states in (False, True) if args.states else (False,):
            call(0, states=states)
            got = (b.ys[0].clone(), b.fin_out.clone() if states else None)
            ref = refs.setdefault(states, got)
            if args.op == "bwd":
                got += (b.dw.clone(), b.db.clone())
                ref += refs.setdefault((states, summation_order(c), call.item_tokens), got)[2:]
            bad = [n for n, r, g in zip(tensors, ref, got) if r is not None and not torch.equal(r, g)]
            if bad:
                differs.append(f"{b.S}x{b.C} d{b.docs}: {c}{' with states' if states else ''}: {', '.join(bad)} differ from the first")
            timers[c + (" states" if states else "")] = lambda i, call=call, states=states: call(i, states=states)
    runs = time_rounds(timers, b.k, small, args)
    row = {"S": b.S, "C": b.C, "docs": b.docs, "pad": b.pad, "floors": list(b.floors), "runs": runs}
    row.update({name: statistics.median(v) for name, v in runs.items()})
    return row


def time_rounds(timers: dict, k: int, small: bool, args) -> dict:
    """Every timer's figure in each of args.rounds rounds (round_orders), as {name: [ms, ...]}:
    after args.rest_ms of idle GPU (bench_harness's Dev.rest) and args.settle_ms of its own
    calls, the eager median, then (small shapes) its graph-replayed time right after."""
    runs = {}
    for order in round_orders(list(timers), args.rounds):
        for name in order:
            DEV.rest(args.rest_ms)  # before the settle (TIMING has no rest_ms: measure does not rest again)
            settle(timers[name], k, args.settle_ms)
            runs.setdefault(name, []).append(median_ms(timers[name], k))
            if small:  # the kernel's time alone: tune's ctypes launch can take longer than a small kernel
                runs.setdefault(name + " graph", []).append(graph_ms(timers[name], k))
    return runs


def row_text(row: dict, configs: list, op: str) -> str:
    gb = (4 if op == "fwd" else 6) * row["S"] * row["C"] / 1e6
    text = " ".join(f"{c}:{row[c] * 1e3:.1f}us({row['copy'] / row[c] * 100:.0f}%)" for c in configs)
    if "copy graph" in row:
        text += " | graph " + " ".join(
            f"{c}:{row[c + ' graph'] * 1e3:.1f}us({row['copy graph'] / row[c + ' graph'] * 100:.0f}%)" for c in configs)
        text += f" copy graph {row['copy graph'] * 1e3:.1f}us"
    for name in row["floors"]:  # each config's time over the floor's (buffers)
        g = " graph" if name + " graph" in row else ""
        floor, copy = row[name + g], row["copy" + g]
        text += f" | {name}{g} {floor * 1e3:.1f}us ({copy / floor * 100:.0f}% of copy's rate) " + " ".join(
            f"{c}:{row[c + g] / floor:.3f}x" for c in configs)
    if configs[0] + " states" in row:
        g = " graph" if configs[0] + " states graph" in row else ""  # states against stateless, graph-replayed if timed so
        text += f" | states{g} " + " ".join(
            f"{c}:{row[c + ' states' + g] * 1e3:.1f}us({row[c + ' states' + g] / row[c + g]:.3f}x)" for c in configs)
    return f"{row['S']}x{row['C']} d{row['docs']}{' pad' + str(row['pad']) if row['pad'] else ''} copy {row['copy'] * 1e3:.1f}us {gb / row['copy']:.0f}GB/s | {text}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("fwd", "bwd"), default="fwd", help="the forward or the backward's kernels")
    parser.add_argument("--configs", required=True, help="threads/strip/ring/min_ctas[/vec][/NAME=VALUE...],...")
    parser.add_argument("--variant", default="fp32/fp32", help="weight/bias dtypes, e.g. bf16/none")
    parser.add_argument("--states", action="store_true", help="also time each config with per-document states")
    parser.add_argument("--shapes", help="SxCxDOCS[xPAD],... (default: the tuning set; PAD: row-strided, see buffers)")
    parser.add_argument("--graph-max-elems", type=int, default=16 * 2**20,
                        help="also time shapes of S*C up to this many elements from replayed CUDA graphs (default 16M)")
    parser.add_argument("--inc", action="append", default=[], metavar="NAME=DIR",
                        help="an include tree a config compiles instead of this checkout's when it says INC=NAME")
    parser.add_argument("--rounds", type=int, default=3,
                        help="time every shape in this many rounds, each in another order (round_orders; default 3)")
    parser.add_argument("--rest-ms", type=duration_ms, default=500.0,
                        help="leave the GPU idle this long before each timing: every figure from the same idle state "
                        "(default %(default)s; 0: back to back, each timing under the power state the previous left; "
                        "keep it short: ~2 s after a run's last kernel the H200's SM clock fell to idle, r127)")
    parser.add_argument("--settle-ms", type=duration_ms, default=0.0,
                        help="run each call this long before timing it, after the rest: sustained figures (default 0; "
                        "see settle; after a 500 ms rest, 300 ms did not slow the backward on an H200, 2000 ms did: "
                        "r129, r130)")
    parser.add_argument("--json", help="write every shape's figures here (a list of rows)")
    parser.add_argument("--build-only", action="store_true", help="build the configs' modules, time nothing")
    parser.add_argument("--build-dir", help="build the configs' modules here, reusing those already built there "
                        "(default: a new temporary directory), e.g. to time one build in bursts and settled")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    return args


def main() -> None:
    args = parse_args()
    try:
        mods = build(args)
    except RuntimeError as e:  # a geometry the headers refuse is their static_assert, in the compiler's words
        raise SystemExit(f"tune.py: the configs' build failed:\n{e}") from None
    if args.build_only:
        return
    results, differs = [], []
    shapes = [tuple(int(v) for v in t.split("x")) for t in args.shapes.split(",")] if args.shapes else SHAPES
    for S, C, docs, *pad in shapes:
        row = time_shape(mods, buffers(S, C, docs, pad[0] if pad else 0, args), args, differs)
        results.append(row)
        print(row_text(row, list(mods), args.op), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if differs:
        raise SystemExit("NOT BITWISE EQUAL:\n" + "\n".join(differs))


if __name__ == "__main__":
    main()
