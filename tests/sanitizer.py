"""compute-sanitizer for the GPU tests: run a Python script under one of its tools (memcheck:
out-of-bounds and misaligned accesses; synccheck: barriers and warp-synchronous intrinsics used
by threads that do not all reach them; racecheck: shared-memory accesses of different threads
not ordered by a barrier) and require a clean report (the script prints
``sanitizer-script-done`` as its last act)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

# (a GPU runner without the tool fails these tests, conftest.py's gpu_needs: it must not pass on skips)
needs_sanitizer = pytest.mark.gpu_needs(None if shutil.which("compute-sanitizer") else "compute-sanitizer not on PATH")


def assert_sanitizer_clean(script_text: str, tmp_path, *, tool: str = "memcheck", timeout: float = 600) -> None:
    """``script_text`` under ``compute-sanitizer --tool <tool>``: it must finish, exit 0 and
    report 0 errors."""
    script = tmp_path / f"{tool}_script.py"
    script.write_text(script_text)
    report = ["--racecheck-report", "all"] if tool == "racecheck" else []  # hazards and warnings
    # Without torch's caching allocator every tensor is a cudaMalloc of its own size: an access
    # past a tensor's end falls outside the allocation instead of into a cached block's slack.
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", tool, *report, "--error-exitcode", "99", sys.executable, str(script)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "sanitizer-script-done" in out
    summary = (r"RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)" if tool == "racecheck"
               else r"ERROR SUMMARY: 0 errors")
    assert re.search(summary, out), out[-4000:]
