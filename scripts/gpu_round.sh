#!/usr/bin/env bash
# One whole round on a lent GPU machine (the device tool), results under $OUT:
# install + AOT build + full test suite (ci_gpu.sh), SASS and resource report, the benchmarks
# (bench_cp.py under torchrun when the machine has 2+ GPUs).
#   bash scripts/gpu_round.sh [tests|bench|cp|cp-bench] [--quick]      (carry .whl for the peers' wheels)
# The whole round takes over 10 minutes on one H200, and the tests phase alone did not fit one
# 600-second device call (2026-12-01: 88 % of the suite after 580 s, install and AOT build
# included): run it as two calls, e.g. CAKE_TEST_PATHS="tests/test_[a-c]*.py" and the rest
# (scripts/ci_gpu.sh takes the paths).
# cp, then cp-bench: the context-parallel round on a 2-GPU machine (nvidia-h200-x2), two device calls
# (each within the 600-second limit: every step's timeout is what is left of 570 s): the CP tests,
# the NCCL one first in a pytest call of its own (tests/test_cp_multi_gpu.py: a rank 150 s, its torchrun
# 180 s; the ranks' output and reports copied to $OUT), then bench_cp.py (--deadline-s: no shape starts
# once its time is nearly gone; the JSON is rewritten after each shape). Timeouts kill with -k: a hung
# collective fails, it does not eat the budget or leave ranks on the GPUs.
set -uo pipefail
phase=all
case "${1:-}" in tests|bench|cp|cp-bench) phase=$1; shift ;; esac
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cake_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export FLASHINFER_CAKE_CACHE_DIR=/tmp/cake_cache
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # the JIT / CLI tests build with it (else 2: test_cli took 336 s at 2 jobs, r251)
{ nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/machine.txt" 2>&1

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
left() { local l=$((570 - SECONDS)); echo $((l > 10 ? l : 10)); }  # seconds left of the call (a timeout's; never 0)
bench_cp() {
  local gpus; gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] || return 0
  # within the cp-bench call: what is left of it; in a whole round (longer than one call): 400 s
  local t=400; [ "$phase" = cp-bench ] && t=$(left)
  (cd scripts && timeout -k 10 "$t" python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" bench_cp.py \
     "$@" --deadline-s $((t - 120)) --json "$OUT/bench_cp.json" > "$OUT/bench_cp.log" 2>&1)
  grep -A120 "## bench_cp" "$OUT/bench_cp.log" || tail -20 "$OUT/bench_cp.log"
}
if [ "$phase" = cp ] || [ "$phase" = cp-bench ]; then
  python3 -m pip install --no-build-isolation --no-deps -q -e ".[test]" > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
  timeout -k 10 300 python3 -m flashinfer_cake build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
  if [ "$phase" = cp ]; then
    export CAKE_CP_LOG_DIR="$OUT"
    FLASHINFER_CAKE_REQUIRE_GPU=1 timeout -k 10 "$(left)" python3 -m pytest -q -p no:cacheprovider -rA \
      "tests/test_cp_multi_gpu.py::test_every_layout_mix_and_variant_over_nccl" > "$OUT/tests_cp_nccl.log" 2>&1
    tail -40 "$OUT/tests_cp_nccl.log"
    FLASHINFER_CAKE_REQUIRE_GPU=1 timeout -k 10 "$(left)" python3 -m pytest -q -p no:cacheprovider \
      tests/test_cp_multi_gpu.py tests/test_cp_gpu.py --deselect \
      "tests/test_cp_multi_gpu.py::test_every_layout_mix_and_variant_over_nccl" --junitxml="$OUT/junit_cp.xml" \
      > "$OUT/tests_cp.log" 2>&1; tail -15 "$OUT/tests_cp.log"
  else
    bench_cp "$@"
  fi
  exit 0
fi
if [ "$phase" != bench ]; then
  PIP_INSTALL_FLAGS="--no-build-isolation --no-deps -q" bash scripts/ci_gpu.sh -q --maxfail=20 -p no:cacheprovider --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1; tail -5 "$OUT/tests.log"
else
  python3 -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1
fi
[ "$phase" = tests ] && exit 0
python3 -m flashinfer_cake  # the CLI's default action: build what is needed, check, GB/s

# Evidence from the build: registers/spills per kernel, and the SASS of the main loop.
grep -h -A3 "Compiling entry function" flashinfer_cake/aot/build/prebuild/build.log > "$OUT/resource_usage.txt" 2>/dev/null
so=$(ls flashinfer_cake/aot/causal_conv1d_w_fp32_b_fp32_*.so | head -1)
cuobjdump --dump-sass "$so" > "$OUT/sass.txt" 2>&1

echo "global/async memory instructions in the SASS:"; grep -o "LDGSTS[.A-Z0-9]*\|LDG[.A-Z0-9]*\|STG[.A-Z0-9]*" "$OUT/sass.txt" | sort | uniq -c

python3 scripts/bench_fwd.py "$@" --json "$OUT/bench.json" --md "$OUT/bench.md" > "$OUT/bench.log" 2>&1
tail -30 "$OUT/bench.log"
python3 scripts/bench_bwd.py "$@" --json "$OUT/bench_bwd.json" --md "$OUT/bench_bwd.md" > "$OUT/bench_bwd.log" 2>&1
tail -30 "$OUT/bench_bwd.log"
python3 scripts/bench_states.py "$@" --json "$OUT/bench_states.json" --md "$OUT/bench_states.md" > "$OUT/bench_states.log" 2>&1
tail -12 "$OUT/bench_states.log"
bench_cp "$@"
