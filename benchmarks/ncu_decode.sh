#!/usr/bin/env bash
# Nsight Compute on the first two layers of a decode step (the kernels of profile_decode.py's
# 8-layer file, each replayed alone by ncu): time, DRAM bytes and throughput, occupancy,
# registers and the warps' stall reasons, to say why a kernel is slower than its bytes.
#   bash benchmarks/ncu_decode.sh /tmp/m/q30_8l.gguf [kernel regex] [launches] > ncu.txt
# With a kernel regex, the full set of sections for those kernels and, per SASS instruction,
# where the warps stalled ($OUT/ncu_source.csv; the kernels are built with -lineinfo). The
# profile's own record goes to $OUT (default /tmp), not benchmarks/results: ncu's replays skew it.
set -euo pipefail
MODEL=$1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found" >&2; exit 1; }
if [ $# -lt 2 ]; then
  "$NCU" --kernel-name regex:'^(matvec|attn_decode|moe_|qk_norm|argmax|embed)' -c 16 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --print-summary none \
    python3 benchmarks/profile_decode.py --model "$MODEL" --steps 4 --out "${OUT:-/tmp}"
  exit
fi
REP=${OUT:-/tmp}/ncu_report
STRATA_KERNEL_LINEINFO=1 "$NCU" --kernel-name regex:"$2" -c "${3:-2}" --set full -f -o "$REP" \
  python3 benchmarks/profile_decode.py --model "$MODEL" --steps 4 --out "${OUT:-/tmp}" > /dev/null
"$NCU" -i "$REP.ncu-rep" --page details --print-summary none
"$NCU" -i "$REP.ncu-rep" --page source --print-source sass --csv > "${OUT:-/tmp}/ncu_source.csv"
