#!/usr/bin/env bash
# Nsight Compute over one launch of each prompt expert kernel (bench_rows.py on a one-layer file):
# what its warps wait on (the stall reason of every cycle a warp did not issue, per issued
# instruction), its instruction count and pipe use, and the instruction mix. The row kernels at
# 512 tokens measured latency-bound (docs/BENCHMARKS.md, issue 15); this says on what.
#   bash benchmarks/ncu_rows.sh /tmp/m/q30_1l.gguf [tokens] > ncu_rows.txt
set -uo pipefail
MODEL=$1; TOKENS=${2:-512}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found" >&2; exit 1; }
METRICS=smsp__inst_executed.sum,smsp__cycles_active.avg
METRICS=$METRICS,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum
METRICS=$METRICS,smsp__inst_executed_pipe_lsu.sum
for reason in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait \
    not_selected selected lg_throttle dispatch_stall no_instruction branch_resolving membar \
    sleeping misc tex_throttle imc_miss drain; do
  METRICS=$METRICS,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
done
for kernel in moe_gate_up moe_down; do
  echo "== $kernel, $TOKENS rows"
  timeout 120 "$NCU" -k "regex:$kernel" -c 1 --metrics "$METRICS" --section InstructionStats \
    python3 "$(dirname "$0")/bench_rows.py" --model "$MODEL" --tokens "$TOKENS" --reps 1 2>&1 \
    | grep -vE "^==PROF==|^\s*$"
done
