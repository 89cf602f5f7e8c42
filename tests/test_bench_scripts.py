"""The benchmark scripts' plumbing on a CPU: ``--smoke-cpu`` runs every path of the harness (tiny
shapes, host timers, the reference standing in for our kernels) and must end with its tables."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script", ["bench_fwd.py", "bench_bwd.py", "bench_states.py"])
def test_smoke_cpu_prints_its_tables(script, tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--smoke-cpu", "--json", str(out_json),
                           "--md", str(out_md)], capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    name = script[:-3]
    assert f"## {name} " in out and "| S×C | docs | copy GB/s | ours ms | ours % | graph % |" in out, out[-3000:]
    # the stand-in ran on every combo and the checks against the FP64 reference passed
    assert re.search(r"correct: PASS [1-9]\d* checked, 0 mismatched, 0 errors", out), out[-3000:]
    # the stand-in's host timings judge no goal: no verdict on one (a FAIL there read as a real failure)
    [goals] = [line for line in out.splitlines() if line.startswith("goals")]
    assert goals.startswith("goals (timings not judged: --smoke-cpu): ") and "FAIL" not in goals, goals
    assert goals.count("PASS") == 1, goals  # the check against the FP64 reference's alone
    assert out.rstrip().splitlines()[-1].startswith("total ")
    res = json.loads(out_json.read_text())
    assert res["ours_is_standin"] and res["rows"] and all(r["ours"]["ms"] > 0 for r in res["rows"])
    assert res["host_overhead"]["results"]["x.clone()"]["median_us"] > 0
    assert f"## {name} " in out_md.read_text()
    if name == "bench_states":  # every configuration timed, checked and put against its contiguous call
        for r in res["rows"]:
            assert set(r["peers"]) == {"fwd+st", "fwd-str", "copy-str", "bwd", "bwd+st", "bwd-str"}, r["peers"]
            assert all(p["check"]["ok"] and p["ms"] > 0 and p["pct_copy"] > 0 for p in r["peers"].values())
            assert all(p["time_ratio"] > 0 for n, p in r["peers"].items() if n != "bwd")
            assert r["peers"]["fwd-str"]["over_copy_str"] > 0


@pytest.mark.parametrize("script", ["bench_fwd.py", "bench_bwd.py", "bench_states.py"])
def test_help_lists_the_ci_options(script):
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    for option in ("--quick", "--no-peers", "--json", "--md", "--shapes", "--mixes", "--variants", "--peers"):
        assert option in proc.stdout


@pytest.mark.parametrize("script, first_words", [("tune.py", "Measure tile geometries"),
                                                  ("bench_harness.py", "The benchmark harness of flashinfer_cake")])
def test_help_says_what_the_script_is(script, first_words):
    """--help of the tuning script and of the harness module (which the benchmarks import) says what
    it is: its docstring (the harness printed nothing until 2026-12-07)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and first_words in proc.stdout, proc.stdout[:2000] + proc.stderr[-2000:]


@pytest.mark.parametrize("script", ["bench_fwd.py", "bench_bwd.py", "bench_states.py", "bench_cp.py"])
def test_without_a_gpu_a_benchmark_says_so(script):
    """Exit 2 with one line that says what is missing, not torch's traceback (bench_cp.py: from
    torch.cuda.set_device until 2026-12-07)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--quick"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no CUDA device visible to torch" in proc.stderr, proc.stderr


def _tune(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("tune")


def test_tune_rounds_vary_what_runs_before_each_timer(monkeypatch):
    # Timed back to back, a timer's figure depended on the timer right before it (r126): each round
    # takes every timer once, no timer runs twice in a row (across the rounds' boundaries too), and
    # over 3 rounds each follows at least two different timers.
    tune = _tune(monkeypatch)
    for n in range(2, 10):
        names = [f"t{i}" for i in range(n)]
        rounds = tune.round_orders(names, 3)
        assert len(rounds) == 3 and all(sorted(order) == sorted(names) for order in rounds), rounds
        chain = [name for order in rounds for name in order]
        assert all(a != b for a, b in zip(chain, chain[1:])), rounds
        before = {name: {a for a, b in zip(chain, chain[1:]) if b == name} for name in names}
        assert n == 2 or min(map(len, before.values())) >= 2, (n, rounds)
        assert tune.round_orders(names, 3) == rounds  # deterministic
        assert len(tune.round_orders(names, 7)) == 7 and tune.round_orders(names, 7)[:3] == rounds


def test_tune_rests_before_every_timing(monkeypatch):
    tune = _tune(monkeypatch)
    events = []
    monkeypatch.setattr(tune.torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(tune.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(tune, "settle", lambda fn, k, ms: events.append(("settle", fn(0), k, ms)))
    monkeypatch.setattr(tune, "median_ms", lambda fn, k: events.append(("time", fn(0), k)) or 1.0)
    monkeypatch.setattr(tune, "graph_ms", lambda fn, k: events.append(("graph", fn(0), k)) or 0.5)
    timers = {name: (lambda i, name=name: name) for name in ("copy", "a", "b", "c")}
    args = tune.parse_args(["--configs", "x", "--rounds", "2", "--rest-ms", "250", "--settle-ms", "7"])
    runs = tune.time_rounds(timers, 5, True, args)
    assert runs == {name: [1.0, 1.0] for name in timers} | {f"{name} graph": [0.5, 0.5] for name in timers}
    per_timing = [events[i:i + 5] for i in range(0, len(events), 5)]
    chain = [name for order in tune.round_orders(list(timers), 2) for name in order]
    assert per_timing == [["sync", ("sleep", 0.25), ("settle", name, 5, 7.0), ("time", name, 5), ("graph", name, 5)]
                          for name in chain], events
    events.clear()
    tune.time_rounds(timers, 5, False, tune.parse_args(["--configs", "x", "--rest-ms", "0"]))
    assert events and all(e[0] in ("settle", "time") for e in events), events  # no rest asked: none taken


def test_tune_include_trees(monkeypatch, tmp_path):
    # An --inc tree's content is part of its configs' build flags (a module built from other content
    # is never reused from --build-dir), links to folders included; a tree without the kernels'
    # headers is refused (the compiler would silently take this checkout's).
    tune = _tune(monkeypatch)
    tree = tmp_path / "inc"
    (tree / "flashinfer_cake").mkdir(parents=True)
    (tree / tune.INC_MARKER).write_text("// launcher")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "extra.cuh").write_text("a")
    (tree / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    flags = lambda: tune.config_spec("bwd", "128/64/8/4/INC=t", "fp32/fp32", {"t": str(tree)}).cflags  # noqa: E731
    before = flags()
    assert f"-I{tree}" in before and any(f.startswith("-DCAKE_TUNE_INC_DIGEST=") for f in before)
    tune.tree_digest.cache_clear()
    (tmp_path / "elsewhere" / "extra.cuh").write_text("b")
    assert flags() != before
    args = tune.parse_args(["--op", "bwd", "--configs", "128/64/8/4/INC=t", "--inc", f"t={tmp_path}"])
    with pytest.raises(SystemExit, match="expected an include tree holding"):
        tune.build(args)


def test_tune_refuses_a_macro_no_header_reads(monkeypatch, tmp_path):
    # A NAME=VALUE that no header of the compiled tree reads would build the default kernel and time it
    # as the config (a removed or misspelled option): refused, naming the macro. ITEM_TOKENS is tune.py's.
    tune = _tune(monkeypatch)
    with pytest.raises(SystemExit, match="CAKE_BWD_NO_SUCH_OPTION appears in no header"):
        tune.config_spec("bwd", "128/64/8/4/NO_SUCH_OPTION=1", "fp32/fp32", {})
    assert "-DCAKE_BWD_TAIL=0" in tune.config_spec("bwd", "128/64/8/4/TAIL=0", "fp32/fp32", {}).cflags
    assert "-DCAKE_BWD_ITEM_TOKENS=512" in tune.config_spec("bwd", "128/64/8/4/ITEM_TOKENS=512", "fp32/fp32", {}).cflags
    tree = tmp_path / "inc"
    (tree / "flashinfer_cake").mkdir(parents=True)
    (tree / "flashinfer_cake" / "k.cuh").write_text("#ifndef CAKE_BWD_NO_SUCH_OPTION\n#define CAKE_BWD_NO_SUCH_OPTION 0\n#endif")
    flags = tune.config_spec("bwd", "128/64/8/4/INC=t/NO_SUCH_OPTION=1", "fp32/fp32", {"t": str(tree)}).cflags
    assert "-DCAKE_BWD_NO_SUCH_OPTION=1" in flags  # an INC= tree's own headers are the ones searched


def test_tune_register_lines_are_the_configs_own(monkeypatch):
    tune = _tune(monkeypatch)
    mine = tune.config_spec("bwd", "128/64/8/4", "fp32/fp32", {})
    other = tune.config_spec("bwd", "128/64/8/4/TAIL=0", "fp32/fp32", {})
    log = "\n".join([f"[1/3] compile {mine.module_prefix()}ab.cu.o", "ptxas info    : Used 110 registers",
                     f"[2/3] compile {other.module_prefix()}ab.cu.o", "ptxas info    : Used 99 registers",
                     f"[3/3] build {mine.module_prefix()}ab.so"])
    assert tune.resource_lines(log, mine) == ["ptxas info    : Used 110 registers"]
    assert tune.resource_lines(log, other) == ["ptxas info    : Used 99 registers"]


def test_tune_item_tokens_per_config(monkeypatch):
    # The plan's even-run groups (544 tokens at 16384x4352, not whole strips) go to the shipped geometry
    # (an INC= tree's too, if its C entry takes them: the launcher's trial call); another geometry gets
    # them rounded up to whole 64-token strips; ITEM_TOKENS wins over both.
    tune = _tune(monkeypatch)
    from flashinfer_cake import _plan
    b = argparse.Namespace(item_tokens=_plan.plan_of(16384, 4352).item_tokens)
    assert b.item_tokens == 544
    assert tune.item_tokens("128/64/8/4", b) == 544
    assert tune.item_tokens("128/64/8/4/8", b) == 544  # VEC: the same geometry
    assert tune.item_tokens("256/64/8/4", b) == tune.item_tokens("128/32/8/4", b) == 576
    assert tune.item_tokens("128/64/8/4/INC=main", b) == 544
    assert tune.item_tokens("128/64/8/4/ITEM_TOKENS=768", b) == tune.item_tokens("256/64/8/4/ITEM_TOKENS=768", b) == 768


def test_tune_include_tree_without_even_runs_gets_whole_strips(monkeypatch):
    """An INC= tree whose C entry rejects the plan's even-run groups (an include from before them) gets whole
    strips after one trial call; a tree that takes them keeps them; any other error of the C entry is raised."""
    tune = _tune(monkeypatch)
    monkeypatch.setattr(tune.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tune.torch._C, "_cuda_getCurrentRawStream", lambda dev: 0, raising=False)
    t = tune.torch.zeros(1)
    b = argparse.Namespace(S=16384, C=4352, k=1, pad=0, docs=1, item_tokens=544, xs=[t], dys=[t], ys=[t], w=t, b=t,
                           cu=t, init=t, fin=t, fin_out=t, pws=t, dw=t, db=t)

    class Entry:  # the C entry's calling convention: rc, then last_error_message()
        def __init__(self, error):
            self.error, self.tokens, self.message = error, [], ""

        def causal_conv1d_bwd(self, item_tokens, **_):
            self.tokens.append(item_tokens)
            self.message = self.error(item_tokens)
            return 1 if self.message else 0

        def last_error_message(self):
            return self.message

    whole_strips_only = Entry(lambda n: "item_tokens must be a positive multiple of 64, got %d" % n if n % 64 else "")
    takes_runs = Entry(lambda n: "")
    old_call = tune.launcher(whole_strips_only, b, "bwd", "128/64/8/4/INC=old")
    new_call = tune.launcher(takes_runs, b, "bwd", "128/64/8/4/INC=new")
    old_call(1)
    new_call(1)
    assert (old_call.item_tokens, new_call.item_tokens) == (576, 544)  # time_shape's summation-order key
    assert whole_strips_only.tokens == [544, 576] and takes_runs.tokens == [544, 544]
    with pytest.raises(RuntimeError, match="workspace"):
        tune.launcher(Entry(lambda n: "workspace: expected at least 1 bytes"), b, "bwd", "128/64/8/4/INC=x")


@pytest.mark.parametrize("flag", ["--rounds=0", "--rest-ms=-1", "--settle-ms=-5", "--rest-ms=nan", "--settle-ms=inf"])
def test_tune_rejects_bad_timing_options(monkeypatch, capsys, flag):
    tune = _tune(monkeypatch)
    with pytest.raises(SystemExit) as e:
        tune.parse_args(["--configs", "128/64/8/4", flag])
    assert e.value.code == 2 and f"{flag.split('=')[0]}: expected" in capsys.readouterr().err


def test_the_check_against_the_reference_fails_what_differs(monkeypatch):
    """The benchmarks' check (check_tensors): --smoke-cpu's stand-in is the reference itself, so its PASS says
    nothing of whether the check can fail; here one element past its tolerance, a non-finite one, a missing
    tensor, another shape and a small error everywhere (each within tolerance, over the relative bound) fail."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    harness = importlib.import_module("bench_harness")
    g = torch.Generator().manual_seed(0)
    ref = {"y": torch.randn(64, 16, generator=g, dtype=torch.float64),
           "dw": torch.randn(16, 4, generator=g, dtype=torch.float64) * 0.05}
    tol = {"y": 0.05, "dw": 1e-3}

    def check(**got):
        return harness.check_tensors({"y": ref["y"].bfloat16(), "dw": ref["dw"].float(), **got}, ref, tol, 0.01)

    assert check()["ok"]
    y = ref["y"].bfloat16()
    y[7, 3] += 0.25
    assert not check(y=y)["ok"] and check(y=y)["y"]["n_out_of_tol"] == 1
    y = ref["y"].bfloat16()
    y[0, 0] = float("nan")
    assert not check(y=y)["ok"] and not check(y=y)["y"]["finite"]
    dw = ref["dw"].float() + 9e-4  # within the elementwise tolerance, not the relative one (~2 % of |dw|)
    assert not check(dw=dw)["ok"] and check(dw=dw)["dw"]["n_out_of_tol"] == 0
    assert not harness.check_tensors({"y": ref["y"]}, ref, tol, 0.01)["ok"]  # dw missing
    assert not check(y=ref["y"][:32])["ok"]  # another shape
    assert "y: max err" in harness.mismatch_text(check(y=y + 1))


def test_bench_harness_rests_before_a_measurement(monkeypatch):
    # --rest-ms of the benchmarks (and tune.py's rest, through the same Dev.rest): the idle time
    # comes before the measurement's first call, once, and not at all when 0.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    harness = importlib.import_module("bench_harness")
    events = []
    monkeypatch.setattr(harness.time, "sleep", lambda s: events.append(("sleep", s)))
    dev = harness.Dev(smoke_cpu=True)
    args = argparse.Namespace(rest_ms=3.0, target_ms=0.01, min_reps=2, max_reps=3)
    res = harness.measure(dev, lambda i: events.append("call"), 1, args)
    assert events[0] == ("sleep", 0.003) and events.count(("sleep", 0.003)) == 1 and res["reps"] >= 2, events
    events.clear()
    harness.measure(dev, lambda i: events.append("call"), 1, argparse.Namespace(rest_ms=0.0, target_ms=0.01,
                                                                                 min_reps=2, max_reps=3))
    assert events and set(events) == {"call"}, events
    with pytest.raises(SystemExit):
        harness.parse_args(importlib.import_module("bench_bwd").BackwardBench, ["--rest-ms=-1"])


@pytest.mark.parametrize("status, expected", [("", "abc1234"), (" M include/x.cuh", "abc1234+dirty"), (None, "abc1234")])
def test_bench_git_head_says_when_the_tree_is_not_the_commit(monkeypatch, status, expected):
    # The benchmarks' JSON and Markdown name the commit they ran; a tree with uncommitted changes to
    # tracked files is marked, so its figures are not read as that commit's.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    harness = importlib.import_module("bench_harness")
    monkeypatch.setattr(harness, "run_cmd", lambda cmd: "abc1234" if "rev-parse" in cmd else status)
    assert harness.git_head() == expected


def test_bench_cp_reports_every_rank_and_the_slowest(monkeypatch):
    """bench_cp's rows: each rank's, then the group's (each time the slowest rank's; fla's only where
    every rank has it), with the overhead and the speed-up over fla computed from those times."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench_cp = importlib.import_module("bench_cp")
    names = [f"{who}_{k}{g}_ms" for who in ("single", "cp") for k in ("fwd", "step") for g in ("", "_graph")]

    def rank_row(rank, base, fla):
        row = {"T": 4096, "C": 2048, "docs": 16, "rank": rank, "fragments": 1 + rank, "bitwise": True,
               **{n: base + i / 10 for i, n in enumerate(names)}}
        if fla:
            row.update(fla_fwd_ms=5.0, fla_step_ms=9.0)
        return bench_cp.add_derived(row)

    ranks = [rank_row(0, 1.0, True), rank_row(1, 2.0, True)]
    group = bench_cp.slowest(ranks)
    assert group["rank"] == "max" and group["fragments"] == 2 and group["bitwise"]
    assert all(group[n] == ranks[1][n] for n in names)
    assert group["overhead_fwd_us"] == pytest.approx(1e3 * (ranks[1]["cp_fwd_ms"] - ranks[1]["single_fwd_ms"]))
    assert group["vs_fla_step"] == pytest.approx(9.0 / ranks[1]["cp_step_ms"])
    ranks[0]["bitwise"] = False
    del ranks[1]["fla_fwd_ms"]
    group = bench_cp.slowest(ranks)
    assert not group["bitwise"] and "fla_fwd_ms" not in group and "vs_fla_fwd" not in group
    lines = bench_cp.table([*ranks, group])
    assert len(lines) == 5 and all(line.count("|") == 15 for line in lines)
    assert "| 4096×2048 | 16 | max | NO |" in lines[-1]


def test_bench_cp_main_two_passes_and_deadline(monkeypatch, tmp_path):
    """bench_cp's driver with its GPU parts stubbed (2 ranks simulated in one process): ours on every
    shape, then fla's pass on the same shapes, stopped on every rank by one rank's fla error; the JSON
    holds every rank's rows and the slowest's; --deadline-s starts no shape once a rank's clock is past
    it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench_cp = importlib.import_module("bench_cp")
    P, clock = 2, {"t": 0.0}
    names = [f"{who}_{k}{g}_ms" for who in ("single", "cp") for k in ("fwd", "step") for g in ("", "_graph")]

    class Dist:  # every collective sees this rank's row and a peer's copy of it (rank 1, 10 % slower)
        group = argparse.Namespace(WORLD="world")

        @staticmethod
        def all_gather_object(out, obj):
            peer = {k: v * 1.1 if k.endswith("_ms") else v for k, v in obj.items()}
            if "rank" in peer:
                peer["rank"] = 1
            if obj.get("fla_fail_on_peer"):
                peer = {"fla_error": "boom", "elapsed_s": obj["elapsed_s"]}
            out[:] = [dict(obj), peer]

        init_process_group = barrier = destroy_process_group = staticmethod(lambda *a, **k: None)

    def run_ours(dev, args, s, rank):
        clock["t"] += 10.0
        return bench_cp.add_derived({"T": s.T, "C": s.C, "docs": s.D, "rank": rank, "fragments": 1, "bitwise": True,
                                     **{n: 1.0 + i for i, n in enumerate(names)}})

    def run_fla(dev, args, s, group):
        clock["t"] += 10.0
        return {"fla_fwd_ms": 20.0, "fla_step_ms": 40.0, "fla_fail_on_peer": s.D == 16}

    monkeypatch.setattr(bench_cp, "dist", Dist)
    monkeypatch.setattr(bench_cp, "Dev", lambda smoke: argparse.Namespace(device="cuda"))
    monkeypatch.setattr(bench_cp, "environment", lambda dev, name: {})
    monkeypatch.setattr(bench_cp, "setup", lambda dev, T, C, D, rank, P, group: argparse.Namespace(T=T, C=C, D=D))
    monkeypatch.setattr(bench_cp, "run_ours", run_ours)
    monkeypatch.setattr(bench_cp, "run_fla", run_fla)
    monkeypatch.setattr(bench_cp.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(bench_cp.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(bench_cp.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench_cp.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench_cp.torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(bench_cp.torch, "device", lambda *a: None)
    for name in ("fla", "fla.modules", "fla.modules.causal_conv1d", "fla.modules.causal_conv1d.cp"):
        monkeypatch.setitem(sys.modules, name, argparse.Namespace())  # "fla is installed"
    monkeypatch.setenv("WORLD_SIZE", str(P))
    out = tmp_path / "cp.json"
    shapes = "4096x2048x1,4096x2048x16,4096x2048x1024"
    assert bench_cp.main(["--shapes", shapes, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["docs"], r["rank"]) for r in rows] == [(d, k) for d in (1, 16, 1024) for k in (0, 1, "max")]
    by = {(r["docs"], r["rank"]): r for r in rows}
    assert by[1, "max"]["fla_step_ms"] == 44.0 and by[1, "max"]["vs_fla_step"] > 0  # the slower rank's
    assert by[16, 1]["fla_error"] == "boom" and "fla_fwd_ms" not in by[16, "max"]  # one rank failed
    assert not any("fla_fwd_ms" in by[1024, k] or "fla_error" in by[1024, k] for k in (0, 1))  # fla stopped
    clock["t"] = 0.0
    assert bench_cp.main(["--shapes", shapes, "--json", str(out), "--deadline-s", "15"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["docs"] for r in rows}) == [1, 16] and not any("fla_fwd_ms" in r for r in rows)  # none after 15 s
    clock["t"] = 0.0  # ours at 10, 20, 30 s; fla's first shape at 40 s, then past the deadline
    assert bench_cp.main(["--shapes", shapes, "--json", str(out), "--deadline-s", "35"]) == 0
    by = {(r["docs"], r["rank"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(by) == 9 and "fla_fwd_ms" in by[1, 0] and not any("fla_fwd_ms" in by[d, 0] for d in (16, 1024))


def test_sass_loops_finds_the_loops(monkeypatch):
    # cuobjdump's layout: nested loops, a forward branch, a self-branch after EXIT, a divergence fallback
    # (after EXIT, jumping back), and a kernel that two translation units built identically.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    sass_loops = importlib.import_module("sass_loops")
    body = [
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */",
        "        /*0010*/                   FFMA R2, R2, R3, R4 ;      /* 0x0 */",
        "        /*0020*/              @!P0 FFMA.FTZ R2, R2, R3, R4 ;      /* 0x0 */",
        "        /*0030*/                   MUFU.EX2 R5, R2 ;      /* 0x0 */",
        "        /*0040*/               @P1 BRA 0x10 ;      /* 0x0 */",
        "        /*0050*/                   IADD3 R6, R6, 0x1, RZ ;      /* 0x0 */",
        "        /*0060*/              @!P2 BRA P1, 0x80 ;      /* 0x0 */",
        "        /*0070*/               @P3 BRA 0x0 ;      /* 0x0 */",
        "        /*0080*/              @!P4 EXIT ;      /* 0x0 */",
        "        /*0090*/                   EXIT ;      /* 0x0 */",
        "        /*00a0*/                   BRA 0xa0 ;      /* 0x0 */",
        "        /*00b0*/                   WARPSYNC.ALL ;      /* 0x0 */",
        "        /*00c0*/                   BRA 0x50 ;      /* 0x0 */",
    ]
    listing = "\n".join(["\t\tFunction : _Z6kernelv", *body, "\t\tFunction : _Z5otherv",
                         "        /*0000*/                   EXIT ;      /* 0x0 */", "\t\tFunction : _Z6kernelv", *body])
    functions = sass_loops.functions(listing)
    assert [(name, copies, len(i)) for name, copies, i in functions] == [("_Z6kernelv", 2, 13), ("_Z5otherv", 1, 1)]
    instructions = functions[0][2]
    outer, inner = sass_loops.loops(instructions)
    assert (outer.start, outer.end, outer.count, outer.depth) == (0x0, 0x70, 8, 0)
    assert (inner.start, inner.end, inner.count, inner.depth) == (0x10, 0x40, 4, 1)
    assert inner.opcodes == {"FFMA": 2, "MUFU": 1, "BRA": 1}
    [outer_only] = sass_loops.loops(instructions, min_size=5)
    assert (outer_only.start, outer_only.count, outer_only.depth) == (0x0, 8, 0)
