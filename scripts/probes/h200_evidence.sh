#!/usr/bin/env bash
# The H200 evidence owed since session 70 (NOTES_fwd session 72), one device call, results under $OUT:
# E5 (fwd_init_rows_preload.diff) and plain y stores against HEAD, the backward's streaming dx stores against plain
# ones, the stateful forward's per-reason stall table (ncu), the backward after an L2 flush (bwd_l2_flush.py), and
# bench_states' forward-with-states configuration for the README row.
# Eight files come back (the device returns eight at most): run.log (machine, install, build, ncu's and the flush
# probe's output), tune_e5.log / .json, tune_bwd_streaming.log, ncu_fwdst.csv, bwd_l2_flush.json, bench_states.log /
# .json.
#   bash scripts/probes/h200_evidence.sh          (refuses on another GPU: these figures are the H200's)
source "$(dirname "$0")/h200_common.sh"
# the modules ncu and the flush probe load, built before their timeouts start (about 50 s)
timeout -k 5 150 python3 -m flashinfer_cake build >> "$log" 2>&1 || { echo "build failed"; tail "$log"; exit 1; }
rm -rf /tmp/e5 && mkdir -p /tmp/e5 && cp -r include /tmp/e5/ &&
  patch -d /tmp/e5 -p1 -s < scripts/probes/fwd_init_rows_preload.diff || { echo "E5 patch failed"; exit 1; }
timeout -k 5 150 python3 scripts/tune.py --op fwd --states --rounds 2 --rest-ms 200 --build-dir /tmp/tb \
  --inc E5=/tmp/e5/include --configs 128/16/8/4,128/16/8/4/INC=E5,128/16/8/4/Y_STREAMING=0 \
  --shapes 65536x1024x4096,65536x1024x14564,8192x8192x1024,32768x1024x7282,65536x1024x1 \
  --json "$OUT/tune_e5.json" > "$OUT/tune_e5.log" 2>&1; echo "tune rc $?"; grep "copy" "$OUT/tune_e5.log"
# the streaming stores (session 73, H100 only) against plain ones on the H200: the backward's large shapes
timeout -k 5 120 python3 scripts/tune.py --op bwd --rounds 2 --rest-ms 200 --build-dir /tmp/tb \
  --configs 128/64/8/4,128/64/8/4/DX_STREAMING=0 --shapes 16384x8192x16,65536x2048x32,32768x4096x1024,8192x4096x1 \
  > "$OUT/tune_bwd_streaming.log" 2>&1; echo "tune bwd rc $?"; grep "copy" "$OUT/tune_bwd_streaming.log"
timeout -k 5 100 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:"causal_conv1d_fwd_kernel" \
  --section SpeedOfLight --section WarpStateStats --section Occupancy \
  --metrics "dram__bytes_read.sum,dram__bytes_write.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  --csv --page details python3 scripts/probes/ncu_cases.py fwdst > "$OUT/ncu_fwdst.csv" 2>> "$log"
echo "ncu rc $?"
timeout -k 5 90 python3 scripts/probes/bwd_l2_flush.py "$OUT/bwd_l2_flush.json" >> "$log" 2>&1
echo "flush rc $?"; tail -4 "$log"
# Past --budget-s the harness skips the peers, and fwd+st is one: the budget is what is left, less a margin.
budget=$(( $(left) - 60 )); [ "$budget" -ge 30 ] || budget=30
timeout -k 5 "$(left)" python3 scripts/bench_states.py --peers fwd+st --variants fp32+b --no-host --check shape \
  --budget-s "$budget" --json "$OUT/bench_states.json" > "$OUT/bench_states.log" 2>&1
echo "bench_states rc $?"; tail -25 "$OUT/bench_states.log"
