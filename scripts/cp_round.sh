#!/usr/bin/env bash
# The context-parallel round on a lent machine with 2+ GPUs (device kind nvidia-h200-x2), in one
# call, results under $OUT: install, build, the CP tests (one-GPU simulated ranks and the torchrun
# test over every GPU), then bench_cp.py under torchrun. NVLink multicast stays off in every
# process; every step has a timeout (a hung collective fails, it does not eat the budget).
#   bash scripts/cp_round.sh [--quick]      (carry .whl: fla's CP conv is the peer)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/cake_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export FLASHINFER_CAKE_CACHE_DIR=/tmp/cake_cache
python3 -m pip install --no-build-isolation --no-deps -q -e ".[test]" > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -m flashinfer_cake build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
FLASHINFER_CAKE_REQUIRE_GPU=1 timeout 300 python3 -m pytest tests/test_cp_gpu.py tests/test_cp_multi_gpu.py -q \
  -p no:cacheprovider --junitxml="$OUT/junit_cp.xml" > "$OUT/tests_cp.log" 2>&1; tail -15 "$OUT/tests_cp.log"
gpus=$(nvidia-smi -L | wc -l)
(cd scripts && timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" bench_cp.py "$@" \
   --json "$OUT/bench_cp.json" > "$OUT/bench_cp.log" 2>&1); grep -A40 "## bench_cp" "$OUT/bench_cp.log" || tail -20 "$OUT/bench_cp.log"
