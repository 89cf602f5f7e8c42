"""compute-sanitizer for the GPU tests: run a Python script under memcheck and require a clean
report (the script prints ``memcheck-script-done`` as its last act)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

needs_sanitizer = pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                                     reason="compute-sanitizer not on PATH")


def assert_memcheck_clean(script_text: str, tmp_path, timeout: float = 600) -> None:
    """``script_text`` under ``compute-sanitizer --tool memcheck``: it must finish, exit 0 and
    report 0 errors."""
    script = tmp_path / "memcheck_script.py"
    script.write_text(script_text)
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", sys.executable, str(script)],
        capture_output=True, text=True, timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "memcheck-script-done" in out
    assert re.search(r"ERROR SUMMARY: 0 errors", out), out[-4000:]
