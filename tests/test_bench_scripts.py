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


def test_tune_rounds_vary_each_timers_place_and_predecessor(monkeypatch):
    # tune.py times its configs in rounds; a timer's figure depended on what ran right before it
    # (r126), so each round must take every timer once, and over 3 rounds each must follow at least
    # two different timers (the first round's order, merely rotated, kept every predecessor).
    monkeypatch.syspath_prepend(str(SCRIPTS))
    tune = importlib.import_module("tune")
    for n in range(1, 10):
        names = [f"t{i}" for i in range(n)]
        rounds = [tune.round_order(names, r) for r in range(3)]
        assert all(sorted(order) == names for order in rounds), rounds
        for name in names if n > 1 else ():
            before = {order[order.index(name) - 1] if order.index(name) else None for order in rounds}
            assert len(before) >= 2, (n, name, rounds)


@pytest.mark.parametrize("flag", ["--rounds=0", "--rest-ms=-1", "--settle-ms=-5"])
def test_tune_rejects_bad_timing_options(flag):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "tune.py"), "--op", "bwd", "--configs", "128/64/8/4", flag],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and flag.split("=")[0] in proc.stderr, proc.stderr
