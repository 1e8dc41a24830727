#!/usr/bin/env bash
# Nsight Compute over the kernels of one prompt chunk (profile_prefill.py --once on an 8-layer
# file): every launch replayed alone, its time, grid, registers, occupancy and SM / memory
# throughput, then a table by kernel name (launches, total and mean µs, share of the sum). The sum
# against profile_prefill's wall time says how much of a prompt is the device's and which kernels.
#   bash benchmarks/ncu_prefill.sh /tmp/m/q30_8l.gguf [tokens] [launches] > ncu_prefill.txt
set -euo pipefail
MODEL=$1; TOKENS=${2:-512}; LAUNCHES=${3:-2000}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found" >&2; exit 1; }
# ncu's report and the script's output share stdout, its messages stderr: rows of the report are
# the lines that start with a quote, wherever they went
CSV=${OUT:-/tmp}/ncu_prefill_$TOKENS.csv; LOG=${OUT:-/tmp}/ncu_prefill_$TOKENS.log
# Kernel replay failed on the first row kernel (moe_gate_up_rows_mma_q4_k, h200, 2026-12-02,
# "Failed to profile"); application replay re-runs the deterministic --once read per pass instead.
# Not yet run in this mode.
"$NCU" -c "$LAUNCHES" --replay-mode "${NCU_REPLAY:-application}" --csv --page raw --metrics \
gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,\
sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 benchmarks/profile_prefill.py --model "$MODEL" --tokens "$TOKENS" --once 2>"$LOG" \
  > "$CSV.all" || { echo "ncu failed:"; tail -20 "$LOG" "$CSV.all"; exit 1; }
cat "$CSV.all" "$LOG" | grep '^"' > "$CSV" || { echo "no kernel rows from ncu:"; tail -20 "$LOG" "$CSV.all"; exit 1; }
python3 - "$CSV" <<'PY'
import csv, sys
from collections import defaultdict
rows = list(csv.reader(open(sys.argv[1])))
head, data = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]   # rows[1]: units
col = {name: i for i, name in enumerate(head)}
def f(r, m):
    try:
        return float(r[col[m]].replace(",", ""))
    except (KeyError, ValueError):
        return float("nan")
by = defaultdict(list)
for r in data:
    by[r[col["Kernel Name"]][:60]].append(r)
total = sum(f(r, "gpu__time_duration.sum") for r in data) / 1e3
print(f"{len(data)} launches, {total:.1f} µs of kernel time")
print(f"{'kernel':60s} {'n':>4s} {'total µs':>9s} {'mean':>7s} {'share':>6s} {'grid':>7s} {'regs':>4s} "
      f"{'warps%':>6s} {'sm%':>5s} {'dram%':>5s}")
for name, rs in sorted(by.items(), key=lambda kv: -sum(f(r, "gpu__time_duration.sum") for r in kv[1])):
    t = sum(f(r, "gpu__time_duration.sum") for r in rs) / 1e3
    mean = lambda m: sum(f(r, m) for r in rs) / len(rs)
    print(f"{name:60s} {len(rs):4d} {t:9.1f} {t / len(rs):7.1f} {100 * t / total:5.1f}% "
          f"{mean('launch__grid_size'):7.0f} {mean('launch__registers_per_thread'):4.0f} "
          f"{mean('sm__warps_active.avg.pct_of_peak_sustained_active'):6.1f} "
          f"{mean('sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} "
          f"{mean('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}")
PY
