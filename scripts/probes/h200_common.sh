# Sourced by the H200 round scripts (h200_evidence.sh, h200_followup.sh): the shared setup. It moves to the checkout's
# root, sets OUT, the JIT cache and left() (seconds left of a 600-second device call), writes the GPU's name to
# $OUT/run.log, refuses any GPU but an H200 (these figures are the H200's), and installs the package if it is not.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cake_out}; mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export FLASHINFER_CAKE_CACHE_DIR=/tmp/cake_cache MAX_JOBS=${MAX_JOBS:-$(nproc)}
left() { local l=$((570 - SECONDS)); echo $((l > 10 ? l : 10)); }
log="$OUT/run.log"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; date; } > "$log" 2>&1; cat "$log"
grep -q H200 "$log" || { echo "not an H200: nothing run"; exit 2; }
python3 -c "import flashinfer_cake" 2>/dev/null ||
  python3 -m pip install --no-build-isolation --no-deps -q -e ".[test]" >> "$log" 2>&1 || { tail "$log"; exit 1; }
