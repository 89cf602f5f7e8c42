"""The context-parallel conv over several ranks (torchrun): tests/cp_worker.py on every GPU over
NCCL (skipped with fewer than 2 GPUs), and 2 or 3 ranks sharing one GPU over gloo; each rank's
checks collected here. NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and its
peers), and each run has a timeout: a hung collective fails the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Time limits, nested: a rank (cp_worker.py) dumps its stacks and exits after WORKER_LIMIT_S; torchrun
# and every rank are killed after RANKS_LIMIT_S (r47: 192 cases per rank took 40 s on one H200);
# scripts/gpu_round.sh's cp phase gives each pytest call more. CAKE_CP_LOG_DIR (optional): where each
# run's torchrun output and rank reports are copied, whatever the outcome (the round sets it to $OUT).
WORKER_LIMIT_S, RANKS_LIMIT_S, BUILD_LIMIT_S = 150, 180, 300


REPO = Path(__file__).resolve().parents[1]


def run_ranks(tmp_path: Path, ranks: int, backend: str) -> None:
    """cp_worker.py on `ranks` processes (torchrun), each rank's report checked."""
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # every module built before the ranks start (a cold cache would build in each, past the timeouts)
    subprocess.run([sys.executable, "-m", "flashinfer_cake", "build"], env=env, check=True, timeout=BUILD_LIMIT_S,
                   capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(Path(__file__).with_name("cp_worker.py")), str(tmp_path), backend]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=RANKS_LIMIT_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank
        _, stderr = proc.communicate()
        timed_out = True
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    if log_dir := os.environ.get("CAKE_CP_LOG_DIR"):
        where = Path(log_dir) / f"cp_ranks_{backend}_{ranks}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "torchrun_stderr.txt").write_text(stderr)
        for p in tmp_path.glob("rank*.json"):
            (where / p.name).write_text(p.read_text())
    # a rank that raised wrote its traceback before exiting: show it before torchrun's noise
    raised = "\n".join(f for rep in reports for f in rep["failures"])[-5000:]
    assert not timed_out, f"the ranks did not finish in {RANKS_LIMIT_S} s (a hung collective?): {raised}{stderr[-3000:]}"
    assert proc.returncode == 0, raised + stderr[-3000:]
    assert len(reports) == ranks
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert all(rep["cases"] == 4 * 4 * 6 * 2 for rep in reports)


def test_every_layout_mix_and_variant_over_nccl(tmp_path: Path):
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs, found {gpus}")
    run_ranks(tmp_path, min(gpus, 4), "nccl")


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_layout_mix_and_variant_over_gloo_on_one_gpu(tmp_path: Path, ranks: int):
    """The same cases with every rank on one GPU and gloo's CUDA collectives: the multi-rank
    exchange of the C++ path (real all_to_alls between processes) where only one GPU is at hand,
    with an odd rank count too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    run_ranks(tmp_path, ranks, "gloo")
