#!/usr/bin/env bash
# Everything the GPU machine is for, in one call (device time is scarce; a machine is given back
# soon after each call, so build, test and measure together):
#   1. llama.cpp's llama-bench built in the background (from .anchor/, prepared on the development machine)
#   2. the GPU tests (kernels against gguf-py and numpy, graph against eager, pipelines)
#   3. profile_decode.py on an 8-layer Qwen3-30B-A3B-geometry file per --profile-quants (default
#      q8_0; where a decode step's time goes),
#      and bench_attention.py (the attention kernel alone against the context length); with --tune,
#      tune_decode.py (the expert kernels' shapes on the same file; $TUNE_SHAPES, when set, the
#      shapes to measure), with --tune-only that alone; with --prefill-profile,
#      profile_prefill.py on the same file (512 and 4,096 tokens, row kernels and flash attention,
#      routed on the host and on the device); with --prefill-ncu, ncu_prefill.sh (every kernel of a
#      512-token chunk on that file under Nsight Compute, a table by kernel)
#   4. bench_decode.py on the synthetic Qwen3-30B-A3B at Q8_0 and Q4_K beside llama.cpp; with
#      --offload, bench_offload.py on the same file (half the experts off the card, host reads in
#      place against the general path and llama.cpp -ncmoe 24); records and logs go to $OUT
#      (copy the records into benchmarks/results/ afterwards); with --prefill, bench_prefill.py on the
#      same file, every expert resident, 512, 4096 and 16384 tokens, loans on/off, the row kernels
#      and device routing (the defaults) beside
#      llama.cpp
#   5. with --next, qwen3next: profile_decode.py and profile_prefill.py (4,096 tokens) on an
#      8-layer Qwen3-Next-80B-A3B-geometry Q4_K file (its decode graph, backends/next_decode.py;
#      its prompts' GDN and attention kernels), then bench_decode.py and bench_prefill.py (512 and
#      4,096 tokens) on the whole synthetic Qwen3-Next-80B-A3B Q4_K (about 45 GiB) beside llama.cpp
# Issue 42's "Must show" sequence (decode, resident prompt and offload on three routing laws
# against the tuned llama.cpp) is benchmarks/must_show.sh.
# Usage (from the repository root, wheels of the image's missing packages in .whl/, and
# optionally the kernel binaries built ahead in .kcubins/; the GPU machine's copy has no usable
# .git, so the development side runs `python benchmarks/records.py --archive` just before the
# call, carrying .anchor/, and every record names that archive's commit):
#   bash benchmarks/gpu_session.sh [--gpus 0|0,1] \
#       [--skip-tests] [--skip-profile] [--profile-quants q8_0,q4_k] [--tune] [--tune-only] [--prefill-profile] [--prefill-ncu] [--skip-attention] [--offload] [--prefill]
#       [--skip-decode] [--quants q8_0,q4_k] [--shape KERNEL_SHAPE] [--next] [--keep-going]
#       [--next-parts profile,decode,prefill]
# --next-parts runs some of --next's parts (the whole file is kept on the machine until the
# prefill part reads it: `--next-parts decode` then, in a call right after it on the machine
# kept warm, `--next-parts prefill`; a llama-bench built by the first call is used by the second;
# `synth` only writes the whole file, e.g. beside the tests while llama.cpp builds).
# $DECODE_PROFILE=0 leaves profile_decode.py out of the profile step; $PREFILL_PROFILE_MODES the
# routings --prefill-profile profiles (default "device host": on the device, then --host-routing)
# $NEXT_GDN_MODES: the STRATA_GDN_KERNELS values the 8-layer prompt profile runs (default rows)
# --keep-going runs the benchmarks after failed GPU tests (each arm's figures still say what the
# code does; read them beside gpu_tests.log). $GPU_TESTS: the test files to run (default: every
# GPU test file). $TEST_TIMEOUT bounds the tests (default 560 s),
# $PREFILL_PROMPTS the --prefill lengths (default 512,4096,16384), $PREFILL_ARGS adds
# bench_prefill.py flags (e.g. --array-prompt-steps), $OFFLOAD_PREFILL_TOKENS the --offload
# prompt (default 4096), $OFFLOAD_BUDGET its --vram-budget (default: match llama.cpp's peak)
# --shape exports STRATA_KERNEL_SHAPE for everything the call runs (the GPU tests and the strata
# arms alike), e.g. --shape int_gate_up=0,int_down=0 for the float expert path
set -uo pipefail
GPUS=0; TESTS=1; KEEP_GOING=0; NEXT_PARTS=profile,decode,prefill; QUANTS=q8_0,q4_k; PROFILE_QUANTS=q8_0; TUNE=0; TUNE_ONLY=0; ATTENTION=1; PREFILL_PROFILE=0; PREFILL_NCU=0; OFFLOAD=0; PROFILE=1; PREFILL=0; DECODE=1; NEXT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS=$2; shift 2 ;;
    --skip-tests) TESTS=0; shift ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --tune) TUNE=1; shift ;;
    --tune-only) TUNE=1; TUNE_ONLY=1; ATTENTION=0; shift ;;
    --skip-attention) ATTENTION=0; shift ;;
    --prefill-profile) PREFILL_PROFILE=1; shift ;;
    --prefill-ncu) PREFILL_NCU=1; shift ;;
    --offload) OFFLOAD=1; shift ;;
    --prefill) PREFILL=1; shift ;;
    --skip-decode) DECODE=0; shift ;;
    --next) NEXT=1; shift ;;
    --next-parts) NEXT=1; NEXT_PARTS=$2; shift 2 ;;
    --skip-profile) PROFILE=0; shift ;;
    --quants) QUANTS=$2; shift 2 ;;
    --profile-quants) PROFILE_QUANTS=$2; shift 2 ;;
    --shape) export STRATA_KERNEL_SHAPE=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/gpu-session}; mkdir -p "$OUT" /tmp/m
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONUNBUFFERED=1
# kernel binaries built ahead with nvcc (python -m strata_dist.kernels.prebuild --out .kcubins
# --shape ...), carried: no device time spent compiling them
[ -d .kcubins ] && export STRATA_KERNEL_CUBINS=$PWD/.kcubins
T0=$(date +%s); LB=.anchor/llama.cpp/build/bin/llama-bench
t() { echo "t=$(( $(date +%s) - T0 )) s: $*"; }
LLAMA=()
if [ -x "$LB" ]; then                 # built by an earlier call on this machine (kept warm)
  LLAMA=(--llama-bench "$LB")
elif [ -f .anchor/llamacpp-anchor.sh ]; then
  (cd .anchor && setsid bash llamacpp-anchor.sh build > "$OUT/llama_build.log" 2>&1 &)
  LLAMA=(--llama-bench "$LB" --llama-wait 300)
fi
if [ "$TESTS" = 1 ]; then
  ALL_TESTS=$(echo tests/test_gpu*.py)
  # shellcheck disable=SC2086  # $GPU_TESTS: file names, split on purpose
  timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -q ${GPU_TESTS:-$ALL_TESTS} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8
  if [ "${PIPESTATUS[0]}" != 0 ]; then
    [ "$KEEP_GOING" = 1 ] || { echo "GPU tests failed: no benchmarks of this code"; exit 1; }
    echo "GPU tests failed (--keep-going: the benchmarks run anyway)"
  fi
  t "gpu tests"
fi
if [ "$PROFILE" = 1 ]; then
for pq in ${PROFILE_QUANTS//,/ }; do
PQ=$pq python3 - <<'PY' 2>&1 | tr '\r' '\n' | tail -1
import dataclasses, os
from strata_dist.synth import GEOMETRIES, write_synthetic
g = dataclasses.replace(GEOMETRIES["qwen3-30b-a3b"], name="q30-8l", n_layer=8)
write_synthetic("/tmp/m/q30_8l.gguf", like=g, quant=os.environ["PQ"], popularity="zipf:1.0", seed=0)
PY
if [ "$TUNE_ONLY" = 0 ] && [ "${DECODE_PROFILE:-1}" = 1 ]; then
  timeout 90 python3 benchmarks/profile_decode.py --model /tmp/m/q30_8l.gguf --out "$OUT" 2>&1 \
    | tee "$OUT/profile_$pq.log" | tail -13
fi
if [ "$TUNE" = 1 ]; then
  timeout 300 python3 benchmarks/tune_decode.py --model /tmp/m/q30_8l.gguf \
    ${TUNE_SHAPES:+--shapes "$TUNE_SHAPES"} 2>&1 | tee "$OUT/tune_$pq.log" | tail -12
fi
if [ "$PREFILL_NCU" = 1 ]; then
  timeout 240 bash benchmarks/ncu_prefill.sh /tmp/m/q30_8l.gguf 512 2>&1 \
    | tee "$OUT/ncu_prefill_$pq.txt" | head -30
fi
if [ "$PREFILL_PROFILE" = 1 ]; then
  for n in 512 4096; do
    for mode in ${PREFILL_PROFILE_MODES:-device host}; do
      flag=(); [ "$mode" = host ] && flag=(--host-routing)
      timeout 90 python3 benchmarks/profile_prefill.py --model /tmp/m/q30_8l.gguf --tokens $n \
        "${flag[@]}" 2>&1 | tee "$OUT/profile_prefill_${pq}_${n}_$mode.log" | head -16
    done
  done
fi
rm -f /tmp/m/q30_8l.gguf
done
[ "$ATTENTION" = 0 ] || timeout 120 python3 benchmarks/bench_attention.py 2>&1 \
  | tee "$OUT/attention.log" | tail -10
t "profile"
fi
# the strata arms must not share the CPU with the llama.cpp build (the host side of each decode
# step slows down beside a parallel compile): each benchmark waits for it first
BUILD_WAITED=0
wait_llama() {
  [ ${#LLAMA[@]} -gt 0 ] && [ "$BUILD_WAITED" = 0 ] || return 0
  for _ in $(seq 420); do
    [ -x "$LB" ] && break
    # the build ended without it (no process left running the anchor script)
    grep -qs "llamacpp-anchor.sh" /proc/[0-9]*/cmdline || break
    sleep 1
  done
  BUILD_WAITED=1; t "llama.cpp build"
}
[ -z "$QUANTS" ] || wait_llama
for q in ${QUANTS//,/ }; do
  timeout 120 python3 -m launcher.tools synth /tmp/m/q30.gguf --like qwen3-30b-a3b --quant "$q" \
    --popularity zipf:1.0 2>&1 | tr '\r' '\n' | tail -1
  if [ "$DECODE" = 1 ]; then
  timeout 300 python3 benchmarks/bench_decode.py --model /tmp/m/q30.gguf --gpus "$GPUS" --tokens 128 \
    --out "$OUT" "${LLAMA[@]}" 2>&1 | tee "$OUT/bench_$q.log" | tail -6
  fi
  if [ "$PREFILL" = 1 ]; then
    LLAMA_PRE=(); [ -x "$LB" ] && LLAMA_PRE=(--llama-bench "$LB" --ncmoe 0)
    timeout 580 python3 benchmarks/bench_prefill.py --model /tmp/m/q30.gguf --budget 100G \
      --prompts "${PREFILL_PROMPTS:-512,4096,16384}" --chunk 4096 --out "$OUT" "${LLAMA_PRE[@]}" \
      ${PREFILL_ARGS:-} 2>&1 \
      | tee "$OUT/prefill_$q.log" | tail -8
  fi
  if [ "$OFFLOAD" = 1 ]; then
    # at llama.cpp's peak when it is there (bench_offload.py --vram-budget match), else 10.8G
    LLAMA_OFF=(--vram-budget "${OFFLOAD_BUDGET:-10.8G}")
    [ -x "$LB" ] && LLAMA_OFF=(--llama-bench "$LB" --ncmoe 24 --vram-budget "${OFFLOAD_BUDGET:-match}")
    timeout 580 python3 benchmarks/bench_offload.py --model /tmp/m/q30.gguf \
      --prefill-tokens "${OFFLOAD_PREFILL_TOKENS:-4096}" \
      --out "$OUT" "${LLAMA_OFF[@]}" 2>&1 | tee "$OUT/offload_$q.log" | tail -6
  fi
  rm -f /tmp/m/q30.gguf            # the one-GPU machine's disk holds one big file at a time
  t "bench $q"
done
has() { case ",$NEXT_PARTS," in *",$1,"*) return 0 ;; esac; return 1; }
if [ "$NEXT" = 1 ] && has profile; then
  python3 - <<'PY' 2>&1 | tr '\r' '\n' | tail -1
import dataclasses
from strata_dist.synth import NEXT_GEOMETRIES, write_synthetic
g = dataclasses.replace(NEXT_GEOMETRIES["qwen3-next-80b-a3b"], name="next-8l", n_layer=8)
write_synthetic("/tmp/m/next_8l.gguf", like=g, quant="q4_k", popularity="zipf:1.0", seed=0)
PY
  timeout 120 python3 benchmarks/profile_decode.py --model /tmp/m/next_8l.gguf --out "$OUT" 2>&1 \
    | tee "$OUT/profile_next.log" | tail -16
  for gdn in ${NEXT_GDN_MODES:-rows}; do
    STRATA_GDN_KERNELS=$gdn timeout 120 python3 benchmarks/profile_prefill.py \
      --model /tmp/m/next_8l.gguf --tokens 4096 2>&1 | tee "$OUT/profile_prefill_next_$gdn.log" | head -18
  done
  rm -f /tmp/m/next_8l.gguf
  t "profile next"
fi
if [ "$NEXT" = 1 ] && { has synth || has decode || has prefill; }; then
  # the whole file (about 45 GiB, 110 s to write) stays on the machine until the prefill part
  # has read it, so decode and prefill can be two calls on a machine kept warm
  [ -f /tmp/m/next.gguf ] || timeout 420 python3 -m launcher.tools synth /tmp/m/next.gguf \
    --like qwen3-next-80b-a3b --quant q4_k --popularity zipf:1.0 2>&1 | tr '\r' '\n' | tail -1
  if has decode; then
    wait_llama
    timeout 400 python3 benchmarks/bench_decode.py --model /tmp/m/next.gguf --gpus "$GPUS" \
      --tokens 128 --out "$OUT" "${LLAMA[@]}" 2>&1 | tee "$OUT/bench_next.log" | tail -6
  fi
  if has prefill; then
    wait_llama
    LLAMA_PRE=(); [ -x "$LB" ] && LLAMA_PRE=(--llama-bench "$LB" --ncmoe 0)
    # every pair resident at this budget: a loan would lend nothing, so no loans-off arm
    timeout 400 python3 benchmarks/bench_prefill.py --model /tmp/m/next.gguf --budget 100G \
      --prompts 512,4096 --chunk 4096 --only-loans-on --out "$OUT" "${LLAMA_PRE[@]}" 2>&1 \
      | tee "$OUT/prefill_next.log" | tail -8
    rm -f /tmp/m/next.gguf
  fi
  t "bench next"
fi
# a build still in flight (a call that ran no benchmark) is finished before the call returns, so
# the next call on the machine kept warm finds llama-bench built
wait_llama
