#!/usr/bin/env bash
# The second H200 call, on the machine scripts/probes/h200_evidence.sh warmed (its ~570 s leave no room for these):
# the 512-token groups against the plan over placements (NOTES_bwd session 74), issue 15's slices over placements
# and the backward after either kind of call (session 76; both measured on an H100 only). Five files come back under
# $OUT: run.log, ab512.log, slice.log, after_65536x1024.json, after_16384x4096.json. About 250 s after the build.
#   bash scripts/probes/h200_followup.sh          (refuses on another GPU: these figures are the H200's)
source "$(dirname "$0")/h200_common.sh"
timeout -k 5 "$(left)" python3 scripts/probes/placement_ab.py 128/64/8/4,128/64/8/4/ITEM_TOKENS=512 \
  8192x8192,16384x8192,65536x2048,32768x4096,32768x8192,65536x1024,12288x8192,24576x4096,49152x2048 16 \
  > "$OUT/ab512.log" 2>&1
echo "placement_ab rc $? ${SECONDS}s" | tee -a "$log"; grep "/ 128" "$OUT/ab512.log"
timeout -k 5 "$(left)" python3 scripts/probes/bwd_placement.py --slice 64 --configs 12 \
  --shapes 16384x4096,65536x1024,8192x8192,32768x2048 > "$OUT/slice.log" 2>&1
echo "slice rc $? ${SECONDS}s" | tee -a "$log"; grep "slice / contiguous" "$OUT/slice.log"
for sh in 65536x1024 16384x4096; do
  timeout -k 5 "$(left)" python3 scripts/probes/bwd_l2_flush.py --after --shape $sh "$OUT/after_$sh.json" >> "$log" 2>&1
  echo "after $sh rc $? ${SECONDS}s" | tee -a "$log"
done
tail -24 "$log"
