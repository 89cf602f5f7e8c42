"""The environment of the JIT and CLI tests' builds and child processes (test_jit, test_cli)."""

from __future__ import annotations

import os

# Variables a test sets itself; FLASHINFER_CAKE_NVCC / CUDA_HOME (which compiler CI uses) are kept.
ISOLATED_VARS = ("FLASHINFER_CAKE_CACHE_DIR", "FLASHINFER_CAKE_AOT_DIR", "FLASHINFER_CAKE_DISABLE_JIT",
                 "FLASHINFER_CAKE_CUDA_ARCH_LIST")
# The builds' compile jobs: 2 (CI's cores) unless the runner sets MAX_JOBS (a GPU machine's 16 cores:
# test_cli's build fixture took 336 s at 2 jobs there, r251).
MAX_JOBS = os.environ.get("MAX_JOBS") or "2"


def child_env(**overrides) -> dict[str, str]:
    """This process's environment without ISOLATED_VARS, with the tests' MAX_JOBS, then overrides."""
    e = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    e["MAX_JOBS"] = MAX_JOBS
    e.update({k: str(v) for k, v in overrides.items()})
    return e
