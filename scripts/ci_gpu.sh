#!/usr/bin/env bash
# What a GPU CI runner executes: install, prebuild every variant for this GPU's arch, then the
# whole test suite with FLASHINFER_CAKE_REQUIRE_GPU=1 (GPU tests fail instead of skipping when no
# usable GPU is found). PIP_INSTALL_FLAGS adds pip options (e.g. --no-build-isolation offline).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# shellcheck disable=SC2086
$PY -m pip install ${PIP_INSTALL_FLAGS:-} -e ".[test]"
arch=$($PY -c "import torch; from flashinfer_cake.jit.env import ARCH_OF_CAPABILITY as A; \
print(A[torch.cuda.get_device_capability()])")
$PY scripts/aot_build.py --arch "$arch"
# CAKE_TEST_PATHS: a part of the suite (paths or globs, e.g. "tests/test_[a-c]*.py"); default all.
# shellcheck disable=SC2086
FLASHINFER_CAKE_REQUIRE_GPU=1 $PY -m pytest ${CAKE_TEST_PATHS:-tests} -ra "$@"
