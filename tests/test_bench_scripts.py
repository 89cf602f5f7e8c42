"""The benchmark scripts' plumbing on a CPU: ``--smoke-cpu`` runs every path of the harness (tiny
shapes, host timers, the reference standing in for our kernels) and must end with its tables."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_tune_rests_before_every_timing(monkeypatch):
    tune = _tune(monkeypatch)
    events = []
    monkeypatch.setattr(tune.torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(tune.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(tune, "settle", lambda fn, k, ms: events.append(("settle", ms)))
    monkeypatch.setattr(tune, "median_ms", lambda fn, k: events.append(("time", fn())) or 1.0)
    monkeypatch.setattr(tune, "graph_ms", lambda fn, k: events.append(("graph", fn())) or 0.5)
    timers = {name: (lambda name=name: name) for name in ("copy", "a", "b")}
    args = tune.parse_args(["--configs", "x", "--rounds", "2", "--rest-ms", "250", "--settle-ms", "7"])
    runs = tune.time_rounds(timers, 1, True, args)
    assert runs == {name: [1.0, 1.0] for name in timers} | {f"{name} graph": [0.5, 0.5] for name in timers}
    per_timing = [events[i:i + 5] for i in range(0, len(events), 5)]
    assert len(per_timing) == 6 and all(
        e[:3] == ["sync", ("sleep", 0.25), ("settle", 7.0)] and e[3][0] == "time" and e[4] == ("graph", e[3][1])
        for e in per_timing), events
    events.clear()
    tune.time_rounds(timers, 1, False, tune.parse_args(["--configs", "x", "--rest-ms", "0"]))
    assert events and all(e[0] in ("settle", "time") for e in events), events  # no rest asked: none taken


@pytest.mark.parametrize("flag", ["--rounds=0", "--rest-ms=-1", "--settle-ms=-5"])
def test_tune_rejects_bad_timing_options(monkeypatch, capsys, flag):
    tune = _tune(monkeypatch)
    with pytest.raises(SystemExit) as e:
        tune.parse_args(["--configs", "128/64/8/4", flag])
    assert e.value.code == 2 and f"{flag.split('=')[0]}: expected at least" in capsys.readouterr().err
