#!/usr/bin/env bash
# Issue 42's "Must show", in one command on the GPU machine: on the synthetic Qwen3-30B-A3B,
#   decode   Q8_0 and Q4_K (zipf:1.0), strata beside llama.cpp -n 128, one record each
#   prompt   Q4_K resident, 512 / 4,096 / 16,384 tokens, beside llama.cpp tuned over -ub 512..4096
#   offload  Q4_K at llama.cpp's own device memory (-ncmoe 24, tuned over -ub and mmap on/off) on
#            three files of one geometry: uniform, zipf:0.5, zipf:1.0; decode and a 4,096-token prompt
# every record written by the benchmark itself into $OUT, then checked (benchmarks/record_check.py).
#
# The development side first (the GPU copy has no usable .git; the records name this archive):
#   bash benchmarks/llamacpp-anchor.sh prepare           # .anchor/llama.tar.xz, llama-source.json (once)
#   python benchmarks/records.py --archive               # .anchor/commit.json, just before the call
# then one device call, carry [".anchor"] (and .whl/.kcubins where used):
#   bash benchmarks/must_show.sh                         # everything, about 30 min of device time
#   bash benchmarks/must_show.sh --parts decode_q8_0,q4_k      # ... or in parts under 10 min each,
#   bash benchmarks/must_show.sh --parts offload_zipf1.0       # the machine kept warm between calls
# (a later call on the warm machine carries [".anchor/llama-source.json", ".anchor/commit.json"]
# at least: the device tool keeps what a call built, such as .anchor/llama.cpp/build, but not the
# carried files a call does not carry again; .whl needs carrying only while /tmp/site lacks it)
#   bash benchmarks/must_show.sh --parts offload_uniform,offload_zipf0.5
# Parts (in this order when several), timed on an H100 on 2026-12-06: decode_q8_0 (274 s on a fresh
# machine, the llama.cpp build and the synth included), q4_k (decode + resident prompt, 120 s),
# offload_zipf1.0 (~205 s: it reuses q4_k's file), offload_uniform and offload_zipf0.5 (~250-285 s
# each with their synth; the llama.cpp sweep is 2 load modes x 4 micro-batches): the five in about
# 19 min of one lease. A llama-bench built by an earlier call on the warm machine is reused; the
# first call builds it (beside the first file's synthesis; the benchmarks wait for it).
# seedrig (off by default: its own call, about 8 min: the synth of the 80B-A3B IQ3_S file, ~33 GiB
# in two shards, ~3 min, then bench_seedrig.py ~5 min): issue 44's seed rig on one card, four ranks
# at 12/12/16/16 GB beside one resident rank, a 16,384-token prompt and 256 tokens; it needs no
# llama.cpp (no .anchor/llama.tar.xz for a call of this part alone).
#   bash benchmarks/must_show.sh --parts seedrig
# adapt (off by default, its own call, about 8 min: the synth of the Q4_K_M file then
# bench_adapt.py's three arms): issue 49's adaptive cache after the routing moved, one rank at
# llama.cpp -ncmoe 24's device memory; no llama.cpp either.
#   bash benchmarks/must_show.sh --parts adapt
# serve (off by default, its own call: the synth of the Q4_K_M-recipe file, ~3 min, beside the
# llama.cpp build, then bench_serve.py: 1, 4, 16 and 32 concurrent streams of 512-token prompts and
# 128 new tokens through strata-launch --port, then llama.cpp's llama-batched-bench on the same file
# over 4 micro-batches): issue 45's many streams on one card. On a fresh machine close to
# the 10-minute limit (the build, ~6 min, is the longest part; timed on a warm
# H100 with the file and the build there on 2026-12-06: 118 s, the synth ~50 s more); the record is
# rewritten after each arm, so a call cut short keeps the arms it finished. serve_two_ranks (its
# own call, strata alone, ~5 min with the synth): the same streams through two ranks on the one
# card (--gpus 0,0). The anchor build makes llama-bench only: for serve, llama-batched-bench is
# built after it in the same background job (cmake --build .anchor/llama.cpp/build --target
# llama-batched-bench; a machine that has llama-bench builds only that target).
#   bash benchmarks/must_show.sh --parts serve
#   bash benchmarks/must_show.sh --parts serve_two_ranks
# spec, spec_two_ranks, spec_quant (off by default, each its own call; estimated, not yet timed):
# issue 46's speculative decoding, bench_spec.py. spec: the Q4_K_M-recipe file (the serve parts'
# file) on one card, K = 0 beside the self-draft (--draft-model the file itself) and the n-gram
# drafter; spec_two_ranks the same through two ranks on the one card (--gpus 0,0); spec_quant:
# the q8_0 file drafted by the q2_k file of the same geometry and seed, beside llama.cpp's
# llama-speculative on the same pair (built after llama-bench in the same background job, as
# llama-batched-bench is for serve; the two files, ~43 GiB, are the only ones kept).
#   bash benchmarks/must_show.sh --parts spec
#   bash benchmarks/must_show.sh --parts spec_two_ranks
#   bash benchmarks/must_show.sh --parts spec_quant
# depth, depth_prompt, depth_resident (off by default, each its own call; estimated, not yet timed):
# issue 47's decode far into a context, bench_depth.py, on the Q4_K file of the 2507 release's
# geometry (Qwen3-30B-A3B trained to 262,144 positions; its synth ~3 min, kept for the three parts).
# depth: strata beside llama-bench -d at depths 0 / 32,768 / 131,072, 128 tokens, two repeats
# (~7 min where llama-bench is built, e.g. after the q4_k part on the warm machine; on a fresh
# machine the build, ~5 min, runs beside the synth and may push it past 10 min). depth_prompt: one
# 131,072-token prompt beside llama-bench -p 131072 tuned over -ub 512..4096 (-r 1; llama.cpp's
# warm-up reads the whole prompt too: ~8 min, llama-bench built). depth_resident: strata alone at
# the same depths on a rank held to 16 GB (--vram-budget 16G --kv-resident auto), its tokens
# compared with the depth part's record of the same file (~5 min). Issue 47's qwen3next case
# (--max-context 262144 --kv-type q8_0 --kv-resident auto) has no part yet: its kernels (the
# `_q8` and `_q8_ring` builds, 2026-12-06) passed their GPU tests on an H100 that day
# (tests/test_gpu_kv_q8.py, two comparisons re-grounded since); a part is the next step.
#   bash benchmarks/must_show.sh --parts depth
#   bash benchmarks/must_show.sh --parts depth_prompt
#   bash benchmarks/must_show.sh --parts depth_resident
# redesign_next (off by default, its own call, strata alone; estimated, not yet timed: the synth
# ~5 min, then two arms each of decode and of 512/4,096-token prompts): issue 52's before/after
# on the qwen3next 80B-A3B file at Q4_K, this tree beside $TREE_ARM's (required), e.g.
#   git archive f13c4ab | xz > .anchor/before.tar.xz      # on the development side
#   TREE_ARM=.anchor/before.tar.xz bash benchmarks/must_show.sh --parts redesign_next
# spec_mtp (off by default, its own call, strata alone; estimated, not yet timed): bench_spec.py
# --mtp on the qwen3next 80B-A3B geometry at Q4_K written with one multi-token-prediction block
# (synth --mtp, ~46 GiB, ~5 min), K = 0 beside the self-draft, n-gram and MTP drafters: ~9 min;
# an H200 (the self-draft arm holds the file twice). The MTP block drafts on the general path.
#   bash benchmarks/must_show.sh --parts spec_mtp
# ftype_<type> (off by default, each its own call; estimated, not yet timed): issues 43 and 44's
# records per llama.cpp file type, one file a part, Qwen3-30B-A3B geometry, every expert resident:
# the synth writes the file with llama-quant's per-tensor types (`--quant <type>`), then
# bench_decode.py (strata beside llama-bench -n 128, 3 repeats) and bench_prefill.py (one
# 4,096-token prompt, 2 repeats, beside llama-bench tuned over -ub 512..4096); each record's
# model.quant is the file type's name. <type>: q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k, q8_0 (issue 43),
# iq3_s, iq4_xs, iq2_xxs (issue 44). About 3 min of synth (q8_0's 32 GiB the longest) + ~1.5 min
# decode + ~2.5 min prompt: ~7 min each with llama-bench built (run one after the q4_k part, or
# expect the first call's build, ~5 min, beside the synth). The q4_k_m file is kept for:
# ftype_q4_k_m_split3 (its own call, ~6 min after ftype_q4_k_m on the warm machine, ~9 min
# without it): the same q4_k_m file written again in three shards (--split-max-size a third of its
# bytes and 5%), its decode record (model.shards 3) beside llama-bench on the split file, and
# tokens_identical_to_unsplit: its greedy tokens against one launch on the unsplit file.
# ftype_q4_k_m_split3_prompt (its own call, ~3 min after ftype_q4_k_m_split3, whose files stay on
# the warm machine until a later part's synth): the 4,096-token prompt of the ftype parts on the
# 3-shard file, beside the tuned llama-bench on it.
#   bash benchmarks/must_show.sh --parts ftype_q4_k_m
#   bash benchmarks/must_show.sh --parts ftype_q4_k_m_split3
#   bash benchmarks/must_show.sh --parts ftype_q4_k_m_split3_prompt
#   bash benchmarks/must_show.sh --parts ftype_q5_k_m     # ... one call each: ftype_q6_k,
#   ftype_q3_k_m, ftype_q2_k, ftype_q8_0, ftype_iq3_s, ftype_iq4_xs, ftype_iq2_xxs
# Then copy $OUT/*.json into benchmarks/results/ as they are (never renamed or edited).
#
# $TREE_ARM (unset: nothing changes): a `git archive <commit> | xz` tarball of an older tree of this
# project; the decode_q8_0 and q4_k parts' bench_decode.py and bench_prefill.py runs, and the
# ftype_<type> parts' bench_decode.py, then take `--tree-arm $TREE_ARM`: one more strata arm each,
# the first arm's launch run by that tree's code (benchmarks/tree_arm.py), so "after / before"
# (issue 52) is a ratio of two arms of one record. Put the tarball under .anchor (carried, and no
# part of the tree hash) on the development side:
#   git archive 1234abc | xz > .anchor/before.tar.xz
#   TREE_ARM=.anchor/before.tar.xz bash benchmarks/must_show.sh --parts decode_q8_0,q4_k
#   TREE_ARM=.anchor/before.tar.xz bash benchmarks/must_show.sh --parts ftype_q3_k_m
# Each of those runs gets one strata arm longer (estimated, not yet timed; an older tree whose
# kernel sources differ finds no prebuilt cubin of its own in .kcubins and compiles with NVRTC).
#
# --cpu: the same sequence on CPU ranks and the tiny geometry (small sizes), a dry run of every
# command and flag this script gives (no GPU; $LLAMA_BENCH names a llama-bench to run, e.g. a CPU
# build, else the llama.cpp arms are left out; $LLAMA_BATCHED_BENCH the same for the serve part,
# $LLAMA_SPECULATIVE for spec_quant).
# --print: the commands only.
# $OUT (default /tmp/must-show) gets the records and a log per command.
set -uo pipefail
# llama.cpp's file types the ftype_<type> parts write and measure (issues 43 and 44)
FTYPES="q4_k_m q5_k_m q6_k q3_k_m q2_k q8_0 iq3_s iq4_xs iq2_xxs"
PARTS=decode_q8_0,q4_k,offload_zipf1.0,offload_uniform,offload_zipf0.5; CPU=0; PRINT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --parts) PARTS=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --print) PRINT=1; shift ;;
    *) echo "error: unknown argument $1 (--parts P,.. | --cpu | --print)" >&2; exit 2 ;;
  esac
done
for p in ${PARTS//,/ }; do
  case "$p" in decode_q8_0|q4_k|offload_zipf1.0|offload_uniform|offload_zipf0.5|seedrig|adapt|serve|serve_two_ranks|spec|spec_two_ranks|spec_quant|depth|depth_prompt|depth_resident|spec_mtp|ftype_q4_k_m_split3|ftype_q4_k_m_split3_prompt|redesign_next) ;;
    ftype_*) case " $FTYPES " in *" ${p#ftype_} "*) ;;
      *) echo "error: --parts: unknown part $p (file types: $FTYPES)" >&2; exit 2 ;; esac ;;
    *) echo "error: --parts: unknown part $p" >&2; exit 2 ;; esac
done
has() { case ",$PARTS," in *",$1,"*) return 0 ;; esac; return 1; }
OUT=${OUT:-/tmp/must-show}; M=${MODELS:-/tmp/m}; mkdir -p "$OUT" "$M"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
[ -d .kcubins ] && export STRATA_KERNEL_CUBINS=$PWD/.kcubins
# the older tree's arm of the decode_q8_0, q4_k and ftype_<type> parts (the header's $TREE_ARM)
TREE=()
if [ -n "${TREE_ARM:-}" ]; then
  if [ "$PRINT" = 0 ] && [ ! -f "$TREE_ARM" ]; then
    echo "error: TREE_ARM=$TREE_ARM: no such file (a git archive tarball of the older tree)" >&2; exit 2
  fi
  TREE=(--tree-arm "$TREE_ARM")
fi
if has redesign_next && [ ${#TREE[@]} = 0 ]; then
  echo "error: --parts redesign_next measures this tree beside an older one: give TREE_ARM" >&2; exit 2
fi
# the commit every record will name, said now (a stale archive is refused before any device time)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import records; print('measuring', records.commit_info())" || exit 2
T0=$(date +%s); t() { echo "t=$(( $(date +%s) - T0 )) s: $*"; }

if [ "$CPU" = 1 ]; then
  LIKE=tiny; LB=${LLAMA_BENCH:-}
  DECODE=(--cpu --tokens 128); PROMPTS=(--cpu --budget 400M --prompts 128,256 --chunk 64)
  OFFLOAD=(--cpu --vram-budget 200M --tokens 128 --prefill-tokens 256 --context 512 --ncmoe 2)
  RESIDENT_NCMOE=(--ncmoe 0)
else
  LIKE=qwen3-30b-a3b; LB=.anchor/llama.cpp/build/bin/llama-bench
  DECODE=(--gpus 0 --tokens 128)
  PROMPTS=(--budget 60G --prompts 512,4096,16384 --chunk 4096)   # every pair resident (H100 or H200)
  # --vram-budget match: the strata rank's NVML peak within 5% of llama.cpp's best tests'
  OFFLOAD=(--vram-budget match --tokens 128 --prefill-tokens 4096 --ncmoe 24 --llama-repeats 2)
  RESIDENT_NCMOE=(--ncmoe 0)
fi
# the file-type parts' prompt: one 4,096-token length, every pair resident (the CPU dry run: 256)
if [ "$CPU" = 1 ]; then FTYPE_PROMPTS=(--cpu --budget 400M --prompts 256 --chunk 64 --repeats 1)
else FTYPE_PROMPTS=(--budget 60G --prompts 4096 --chunk 4096 --repeats 2); fi
# the seed rig replay: the qwen3next file of the seeds' geometry (CPU: the tiny one), two shards
if [ "$CPU" = 1 ]; then SEED_LIKE=tiny-next; SEED_SHARD=250K; SEEDRIG=(--cpu)
else SEED_LIKE=qwen3-next-80b-a3b; SEED_SHARD=20G; SEEDRIG=(); fi
# the parts without llama-bench: the seed rig, the adaptive cache, the streams (the serve part
# runs llama-batched-bench instead, LBB below), speculative decoding (spec_quant runs
# llama-speculative, LSP below)
ALONE=1; for p in ${PARTS//,/ }; do case "$p" in seedrig|adapt|serve|serve_two_ranks|spec|spec_two_ranks|spec_quant|depth_resident|spec_mtp|redesign_next) ;; *) ALONE=0 ;; esac; done
[ "$ALONE" = 1 ] && LB=
# the streams' file: the Q4_K_M recipe (the CPU dry run: q8_0, the tiny geometry, short requests)
LBB=""
if [ "$CPU" = 1 ]; then
  SERVE_QUANT=q8_0; SERVE_ONE=(--cpu); SERVE_TWO=(--cpu --cpu-ranks 2)
  SERVE_SIZES=(--streams 1,2,4 --prompt-tokens 64 --tokens 16 --ubatches 64,128)
  has serve && LBB=${LLAMA_BATCHED_BENCH:-}
else
  SERVE_QUANT=q4_k_m; SERVE_ONE=(--gpus 0); SERVE_TWO=(--gpus 0,0); SERVE_SIZES=()
  has serve && LBB=.anchor/llama.cpp/build/bin/llama-batched-bench
fi
# speculative decoding: the serve parts' file (self-draft, n-gram), and a q8_0 target with its
# q2_k draft (the CPU dry run: the tiny geometry, 128 tokens, one prompt an arm)
LSP=""
if [ "$CPU" = 1 ]; then
  SPEC_ONE=(--cpu); SPEC_TWO=(--cpu --gpus 0,0); SPEC_SIZES=(--tokens 128 --repeats 1)
  has spec_quant && LSP=${LLAMA_SPECULATIVE:-}
else
  SPEC_ONE=(--gpus 0); SPEC_TWO=(--gpus 0,0); SPEC_SIZES=()
  has spec_quant && LSP=.anchor/llama.cpp/build/bin/llama-speculative
fi
# decode at depth: the 2507 geometry (trained to 262,144 positions) at Q4_K (the CPU dry run: the
# tiny geometry at q8_0, depths to 1,024, one repeat)
if [ "$CPU" = 1 ]; then
  DEPTH_LIKE=tiny; DEPTH_QUANT=q8_0; DEPTH_ONE=(--cpu); DEPTH_REPEATS=1
  DEPTHS=(--depths 0,256,1024); DEEPEST=1024; DEPTH_HELD=(--kv-resident 512)
else
  DEPTH_LIKE=qwen3-30b-a3b-2507; DEPTH_QUANT=q4_k; DEPTH_ONE=(--gpus 0); DEPTH_REPEATS=2
  DEPTHS=(--depths 0,32768,131072); DEEPEST=131072; DEPTH_HELD=(--vram-budget 16G --kv-resident auto)
fi
# the adaptive cache's file: the Q4_K_M recipe (the CPU dry run: q8_0, the tiny geometry)
if [ "$CPU" = 1 ]; then ADAPT_QUANT=q8_0; ADAPT=(--cpu); else ADAPT_QUANT=q4_k_m; ADAPT=(); fi
# the background build of llama.cpp's tools: llama-bench (the anchor script) where it is not
# there yet, then llama-batched-bench where the serve part asks for it and llama-speculative where
# spec_quant does (one job, so the benchmarks' wait for the build waits for all)
BUILDING=0
start_anchor_build() {
  [ "$BUILDING" = 1 ] && return 0
  local then="" targets=""
  [ -n "$LBB" ] && targets="$targets llama-batched-bench"
  [ -n "$LSP" ] && targets="$targets llama-speculative"
  [ -n "$targets" ] && then="; cmake --build llama.cpp/build -j \"\$(nproc)\" --target$targets >> llama.cpp/build.log 2>&1"
  (cd .anchor && setsid bash -c "[ -x llama.cpp/build/bin/llama-bench ] || bash llamacpp-anchor.sh build$then" \
    > "$OUT/llama_build.log" 2>&1 &)
  BUILDING=1
}
# every llama.cpp arm names its source (.anchor/llama-source.json, copied into the tree built):
# a run that could not name it is refused before any device time
if [ -n "$LB$LBB" ] && [ "$CPU" = 0 ] && [ "$PRINT" = 0 ] && [ ! -f .anchor/llama-source.json ]; then
  echo "error: .anchor/llama-source.json missing: run bash benchmarks/llamacpp-anchor.sh prepare here first" >&2; exit 2
fi
LLAMA=()
if [ -n "$LB" ]; then
  if [ -x "$LB" ]; then LLAMA=(--llama-bench "$LB")
  elif [ "$PRINT" = 1 ]; then LLAMA=(--llama-bench "$LB" --llama-wait 60)   # as a first call gives
  elif [ "$CPU" = 0 ] && [ -f .anchor/llamacpp-anchor.sh ]; then
    start_anchor_build
    LLAMA=(--llama-bench "$LB" --llama-wait 60)
  else
    echo "error: no llama-bench at $LB and no .anchor/llamacpp-anchor.sh to build one" >&2; exit 2
  fi
fi
[ "$CPU" = 0 ] && [ ${#LLAMA[@]} = 0 ] && [ "$ALONE" = 0 ] && { echo "error: the GPU run needs llama.cpp (.anchor)" >&2; exit 2; }
# llama-batched-bench (the serve part): built after llama-bench by the same background job, or
# alone where llama-bench is there already
LLAMA_BATCHED=()
if [ -n "$LBB" ]; then
  if [ -x "$LBB" ]; then LLAMA_BATCHED=(--llama-batched-bench "$LBB")
  elif [ "$PRINT" = 1 ]; then LLAMA_BATCHED=(--llama-batched-bench "$LBB" --llama-wait 600)
  elif [ "$CPU" = 0 ] && [ -f .anchor/llamacpp-anchor.sh ]; then
    start_anchor_build
    LLAMA_BATCHED=(--llama-batched-bench "$LBB" --llama-wait 600)
  else
    echo "error: no llama-batched-bench at $LBB and no .anchor/llamacpp-anchor.sh to build one" >&2; exit 2
  fi
fi
# llama-speculative (spec_quant): built as llama-batched-bench is
LLAMA_SPEC=()
if [ -n "$LSP" ]; then
  if [ -x "$LSP" ]; then LLAMA_SPEC=(--llama-speculative "$LSP")
  elif [ "$PRINT" = 1 ]; then LLAMA_SPEC=(--llama-speculative "$LSP" --llama-wait 600)
  elif [ "$CPU" = 0 ] && [ -f .anchor/llamacpp-anchor.sh ]; then
    start_anchor_build
    LLAMA_SPEC=(--llama-speculative "$LSP" --llama-wait 600)
  else
    echo "error: no llama-speculative at $LSP and no .anchor/llamacpp-anchor.sh to build one" >&2; exit 2
  fi
fi

# the strata arms must not share the CPU with the llama.cpp build (the host side of each decode
# step slows down beside a parallel compile): every benchmark waits for it first
wait_llama() {
  [ "$PRINT" = 1 ] && return 0
  for _ in $(seq 900); do
    { [ -z "$LB" ] || [ -x "$LB" ]; } && { [ -z "$LBB" ] || [ -x "$LBB" ]; } \
      && { [ -z "$LSP" ] || [ -x "$LSP" ]; } && return 0
    grep -qs "llamacpp-anchor.sh" /proc/[0-9]*/cmdline || return 0   # the build ended without it
    sleep 1
  done
}
FAILED=0
run() {   # run NAME CMD...: the command, its log in $OUT/NAME.log, its tail here
  local name=$1; shift
  echo "+ $*"
  [ "$PRINT" = 1 ] && return 0
  case "$name" in synth_*) ;; *) wait_llama ;; esac
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -8 "$OUT/$name.log"
  [ $rc = 0 ] || { echo "FAILED ($rc): $name"; FAILED=1; }
  # every record and log so far in one archive, rewritten after each command: the device tool
  # brings back a limited number of files and empties $OUT at the next call, so a call cut short
  # (or one with many parts) still returns every record it wrote
  (cd "$OUT" && tar czf records.tgz --exclude=records.tgz -- *.json *.log 2>/dev/null)
  t "$name"
}
synth() {   # synth FILE QUANT LAW: the file, unless a call before this one left it
  [ -f "$1" ] && [ "$PRINT" = 0 ] && return 0
  run "synth_$(basename "$1" .gguf)" timeout 420 python3 -m launcher.tools synth "$1" --like "$LIKE" \
    --quant "$2" --popularity "$3" --quiet
}
# one big file at a time beside the next (the one-GPU machine's disk is 64 GiB; Q8_0 is ~32 GiB);
# keep_only FILE.. keeps those (spec_quant: a target and its draft; a FILE may be a pattern, as
# a split file's shards are)
keep_only() {
  [ "$PRINT" = 1 ] && return 0
  local g k keep
  for g in "$M"/must_*.gguf; do
    keep=0; for k in "$@"; do case "$g" in $k) keep=1 ;; esac; done
    [ "$keep" = 1 ] || rm -f "$g"
  done
}

if has decode_q8_0; then
  f=$M/must_q8_0_zipf1.gguf; keep_only "$f"; synth "$f" q8_0 zipf:1.0
  run decode_q8_0 timeout 580 python3 benchmarks/bench_decode.py --model "$f" "${DECODE[@]}" \
    "${TREE[@]}" --out "$OUT" "${LLAMA[@]}"
  keep_only none
fi
Q4=$M/must_q4_k_zipf1.gguf
if has q4_k; then
  keep_only "$Q4"; synth "$Q4" q4_k zipf:1.0
  run decode_q4_k timeout 580 python3 benchmarks/bench_decode.py --model "$Q4" "${DECODE[@]}" \
    "${TREE[@]}" --out "$OUT" "${LLAMA[@]}"
  # every pair resident at this budget: a loan would lend nothing, so no loans-off arm
  run prefill_q4_k timeout 580 python3 benchmarks/bench_prefill.py --model "$Q4" "${PROMPTS[@]}" \
    --only-loans-on "${RESIDENT_NCMOE[@]}" "${TREE[@]}" --out "$OUT" "${LLAMA[@]}"
fi
for law in zipf1.0 uniform zipf0.5; do
  has "offload_$law" || continue
  popularity=${law/zipf/zipf:}; f=$M/must_q4_k_$law.gguf; [ "$law" = zipf1.0 ] && f=$Q4
  keep_only "$f"; synth "$f" q4_k "$popularity"
  run "offload_$law" timeout 590 python3 benchmarks/bench_offload.py --model "$f" "${OFFLOAD[@]}" \
    --out "$OUT" "${LLAMA[@]}"
done
# issue 52's qwen3next before/after: the 80B-A3B geometry at Q4_K (~46 GiB; the CPU dry run:
# tiny-next at q8_0), decode and two prompt lengths, strata alone, $TREE_ARM's tree beside this one
if has redesign_next; then
  if [ "$CPU" = 1 ]; then NEXT_LIKE=tiny-next; NEXT_QUANT=q8_0; NEXT_PROMPTS=(--cpu --budget 400M --prompts 128 --chunk 64 --repeats 1)
  else NEXT_LIKE=qwen3-next-80b-a3b; NEXT_QUANT=q4_k; NEXT_PROMPTS=(--budget 70G --prompts 512,4096 --chunk 4096); fi
  f=$M/must_next_${NEXT_QUANT}_zipf1.gguf; keep_only "$f"
  if [ ! -f "$f" ] || [ "$PRINT" = 1 ]; then
    run synth_next timeout 580 python3 -m launcher.tools synth "$f" --like "$NEXT_LIKE" \
      --quant "$NEXT_QUANT" --popularity zipf:1.0 --quiet
  fi
  run decode_redesign_next timeout 580 python3 benchmarks/bench_decode.py --model "$f" \
    "${DECODE[@]}" "${TREE[@]}" --out "$OUT"
  run prefill_redesign_next timeout 580 python3 benchmarks/bench_prefill.py --model "$f" \
    "${NEXT_PROMPTS[@]}" --only-loans-on "${RESIDENT_NCMOE[@]}" "${TREE[@]}" --out "$OUT"
fi
if has seedrig; then
  keep_only none      # the 80B-A3B IQ3_S file is ~33 GiB: nothing else beside it
  f=$M/seedrig-$SEED_LIKE-iq3_s.gguf; first=${f%.gguf}-00001-of-00002.gguf
  if [ ! -f "$first" ] || [ "$PRINT" = 1 ]; then
    run synth_seedrig timeout 580 python3 -m launcher.tools synth "$f" --like "$SEED_LIKE" \
      --quant iq3_s --popularity zipf:1.0 --split-max-size "$SEED_SHARD" --quiet
  fi
  run seedrig timeout 590 python3 benchmarks/bench_seedrig.py --model "$first" "${SEEDRIG[@]}" \
    --out "$OUT"
fi
if has adapt; then
  f=$M/adapt-$LIKE-$ADAPT_QUANT.gguf; keep_only none; synth "$f" "$ADAPT_QUANT" zipf:1.0
  run adapt timeout 590 python3 benchmarks/bench_adapt.py --model "$f" "${ADAPT[@]}" --out "$OUT"
fi
SERVE_FILE=$M/must_${SERVE_QUANT}_zipf1.gguf
if has serve; then
  keep_only "$SERVE_FILE"; synth "$SERVE_FILE" "$SERVE_QUANT" zipf:1.0
  run serve timeout 590 python3 benchmarks/bench_serve.py --model "$SERVE_FILE" "${SERVE_ONE[@]}" \
    "${SERVE_SIZES[@]}" --out "$OUT" "${LLAMA_BATCHED[@]}"
fi
if has serve_two_ranks; then
  keep_only "$SERVE_FILE"; synth "$SERVE_FILE" "$SERVE_QUANT" zipf:1.0
  run serve_two_ranks timeout 590 python3 benchmarks/bench_serve.py --model "$SERVE_FILE" \
    "${SERVE_TWO[@]}" "${SERVE_SIZES[@]}" --out "$OUT"
fi
if has spec; then
  keep_only "$SERVE_FILE"; synth "$SERVE_FILE" "$SERVE_QUANT" zipf:1.0
  run spec timeout 590 python3 benchmarks/bench_spec.py --model "$SERVE_FILE" "${SPEC_ONE[@]}" \
    "${SPEC_SIZES[@]}" --out "$OUT"
fi
if has spec_two_ranks; then
  keep_only "$SERVE_FILE"; synth "$SERVE_FILE" "$SERVE_QUANT" zipf:1.0
  run spec_two_ranks timeout 590 python3 benchmarks/bench_spec.py --model "$SERVE_FILE" \
    "${SPEC_TWO[@]}" "${SPEC_SIZES[@]}" --out "$OUT"
fi
if has spec_quant; then
  target=$M/must_spec_q8_0_zipf1.gguf; draft=$M/must_spec_q2_k_zipf1.gguf
  keep_only "$target" "$draft"; synth "$target" q8_0 zipf:1.0; synth "$draft" q2_k zipf:1.0
  run spec_quant timeout 590 python3 benchmarks/bench_spec.py --model "$target" --draft "$draft" \
    "${SPEC_ONE[@]}" "${SPEC_SIZES[@]}" --out "$OUT" "${LLAMA_SPEC[@]}"
fi
if has spec_mtp; then
  if [ "$CPU" = 1 ]; then MTP_LIKE=tiny-next; MTP_QUANT=q8_0; else MTP_LIKE=qwen3-next-80b-a3b; MTP_QUANT=q4_k; fi
  f=$M/must_spec_mtp_${MTP_QUANT}.gguf; keep_only "$f"
  if [ ! -f "$f" ] || [ "$PRINT" = 1 ]; then
    run synth_spec_mtp timeout 480 python3 -m launcher.tools synth "$f" --like "$MTP_LIKE" \
      --quant "$MTP_QUANT" --popularity zipf:1.0 --mtp --quiet
  fi
  run spec_mtp timeout 590 python3 benchmarks/bench_spec.py --model "$f" --mtp "${SPEC_ONE[@]}" \
    "${SPEC_SIZES[@]}" --out "$OUT"
fi
DEPTH_FILE=$M/must_depth_${DEPTH_QUANT}_zipf1.gguf   # must_*: keep_only clears it for the next part
if has depth || has depth_prompt || has depth_resident; then
  keep_only "$DEPTH_FILE"
  if [ ! -f "$DEPTH_FILE" ] || [ "$PRINT" = 1 ]; then
    run synth_depth timeout 420 python3 -m launcher.tools synth "$DEPTH_FILE" --like "$DEPTH_LIKE" \
      --quant "$DEPTH_QUANT" --popularity zipf:1.0 --quiet
  fi
fi
if has depth; then
  run depth timeout 590 python3 benchmarks/bench_depth.py --model "$DEPTH_FILE" "${DEPTH_ONE[@]}" \
    --repeats "$DEPTH_REPEATS" "${DEPTHS[@]}" --llama-prompts none --out "$OUT" "${LLAMA[@]}"
fi
if has depth_prompt; then
  run depth_prompt timeout 590 python3 benchmarks/bench_depth.py --model "$DEPTH_FILE" \
    "${DEPTH_ONE[@]}" --repeats 1 --depths "$DEEPEST" --llama-prompts "$DEEPEST" --llama-repeats 1 \
    --out "$OUT" "${LLAMA[@]}"
fi
if has depth_resident; then
  run depth_resident timeout 590 python3 benchmarks/bench_depth.py --model "$DEPTH_FILE" \
    "${DEPTH_ONE[@]}" --repeats "$DEPTH_REPEATS" "${DEPTHS[@]}" "${DEPTH_HELD[@]}" --out "$OUT"
fi
# the file types: one file a part (the q4_k_m file is the serve parts' own, the q8_0 file the
# decode_q8_0 part's: the same synth command, kept on a warm machine for the next call)
for ft in $FTYPES; do
  has "ftype_$ft" || continue
  f=$M/must_${ft}_zipf1.gguf; keep_only "$f"; synth "$f" "$ft" zipf:1.0
  run "decode_ftype_$ft" timeout 580 python3 benchmarks/bench_decode.py --model "$f" "${DECODE[@]}" \
    --out "$OUT" "${LLAMA[@]}" "${TREE[@]}"
  # every pair resident at this budget: a loan would lend nothing, so no loans-off arm
  run "prefill_ftype_$ft" timeout 580 python3 benchmarks/bench_prefill.py --model "$f" \
    "${FTYPE_PROMPTS[@]}" --only-loans-on "${RESIDENT_NCMOE[@]}" --out "$OUT" "${LLAMA[@]}"
  [ "$ft" = q4_k_m ] || keep_only none     # q4_k_m: ftype_q4_k_m_split3 reads it unsplit
done
# the 3-shard q4_k_m file (and the file unsplit), kept for the next call's part
whole=$M/must_q4_k_m_zipf1.gguf; split=$M/must_q4_k_m_zipf1_split3.gguf
first=${split%.gguf}-00001-of-00003.gguf
if has ftype_q4_k_m_split3 || has ftype_q4_k_m_split3_prompt; then
  keep_only "$whole" "${split%.gguf}-0000[123]-of-00003.gguf"
  # the unsplit file: the decode's tokens compare with it, and the shards' size comes from it
  { has ftype_q4_k_m_split3 || [ ! -f "$first" ]; } && synth "$whole" q4_k_m zipf:1.0
  if [ ! -f "$first" ] || [ "$PRINT" = 1 ]; then
    # a third of the whole file's bytes and 5% more a shard: three shards (no tensor comes near
    # 5% of the file); --print, before any file: 7G, three shards of the ~18.6 GB file
    shard=7G; [ -f "$whole" ] && shard=$(( $(stat -c %s "$whole") / 3 * 105 / 100 ))
    run synth_q4_k_m_split3 timeout 420 python3 -m launcher.tools synth "$split" --like "$LIKE" \
      --quant q4_k_m --popularity zipf:1.0 --split-max-size "$shard" --quiet
  fi
fi
if has ftype_q4_k_m_split3; then
  run decode_ftype_q4_k_m_split3 timeout 590 python3 benchmarks/bench_decode.py --model "$first" \
    --unsplit "$whole" "${DECODE[@]}" --out "$OUT" "${LLAMA[@]}"
fi
if has ftype_q4_k_m_split3_prompt; then
  run prefill_ftype_q4_k_m_split3 timeout 580 python3 benchmarks/bench_prefill.py --model "$first" \
    "${FTYPE_PROMPTS[@]}" --only-loans-on "${RESIDENT_NCMOE[@]}" --out "$OUT" "${LLAMA[@]}"
fi
[ "$PRINT" = 1 ] && exit 0
# a build still in flight is finished before the call returns (the next call on the warm machine
# finds llama-bench built)
wait_llama
python3 benchmarks/record_check.py "$OUT"/*.json && echo "records complete: $(ls "$OUT"/*.json | wc -l)" || FAILED=1
exit $FAILED
