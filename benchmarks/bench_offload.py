"""Decode and prefill with experts off the card, beside llama.cpp at the same device memory, in one run.

A routing profile is recorded first (`strata-dist profile` over --profile-prompts prompts of 512
ids drawn apart from every prompt the run measures: no measured request holds a piece of them;
checked), then llama.cpp reads the file with `-ncmoe N` (the experts of N layers in host memory,
computed by the CPU): tuned, at every `-ub` of 512, 1024, 2048 and 4096 (`-b` 4096) and with the
weights both mmap'd (its default) and read into memory (`-mmp 0`, or `-lm none` where the build's
--load-mode replaced it); its best prompt and best decode are the arm's figures, every test kept in
the record (`ubatch_sweep`, `mmap_sweep`, `sweep`), its NVML peak that of the tests it quotes. Then
one GPU rank at `--vram-budget` (`match`: the budget whose peak is within 5% of llama.cpp's, found
in at most two runs; needs NVML), measured twice: the experts its cache lacks read in place from
pinned host memory by the decode graph's own kernels (STRATA_HOST_MAPPED=1), and through the
general path (each miss streamed to the device and computed by its own launches). Like
llama-bench's pp and tg tests, each arm times --prefill-tokens prompts and, apart, --tokens new
tokens after a 16-id prompt, each --repeats times (a decode prompt whose greedy tokens hit end of
text before --tokens gives way to the next: llama-bench's tg never stops). The prompt figure is the
median of its repeats, read back to back after a warm-up prompt of the same length: each measured
prompt then carries the refill of the loan the prompt before it borrowed (a stage refills after the
last chunk, on its stream, after the prompt's figure is taken). A measured request that RESUMEs a
cached prefix is refused. Prints tok/s, where each decode's expert
computations ran, the peak device memory of every arm and the ratios; the record of
../shared/RECORDS.md goes to
benchmarks/results/offload-<like>-<quant>-<date>-<HHMMSS>-<commit>.json, its `model.popularity` the
file's routing law (--popularity for a file that does not store it).

    python benchmarks/bench_offload.py --model q30.gguf --vram-budget match --prefill-tokens 4096 \\
        --llama-bench .anchor/llama.cpp/build/bin/llama-bench --ncmoe 24
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    python benchmarks/bench_offload.py --model tiny.gguf --cpu --vram-budget 200M --tokens 16 \\
        --prefill-tokens 256 --context 512
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from llama_runs import (llama_arm as tuned_llama_arm, llama_mmap_flags,  # noqa: E402
                        llama_sweep, llama_wait)
from records import (PeakMemory, env_prefix, fail, full_decodes, measured,  # noqa: E402
                     median_tps, model_facts, nvml_available, predicted_ms_per_token,
                     prompt_ids, record_profile, serve_session, tokens_against_records,
                     Recorder)

DECODE_PROMPT = 16      # ids before a decode measurement: llama-bench's tg test starts empty
PEAK_TOLERANCE = 0.05   # "equal device memory": NVML peaks within 5% (issue 16)
CONTEXT_GIB = 0.5       # a rank's peak above its budget (CUDA context, graphs), the first guess
PROMPT_TIMING = ("median of --repeats prompts read back to back after a warm-up of the same "
                 "length: each carries the refill of the loan before it")


def run_prompts(args, vocab: int) -> dict[str, list[list[int]]]:
    """Every prompt an arm reads, by what it is for: the warm-ups, the measured prompts (the
    prompt test's and the decode test's), each of its own (no prefix in common)."""
    # seeds distinct modulo any vocabulary's id range (a prompt's first id is its seed's): no
    # request starts as the one before it did, so none RESUMEs a prefix
    n = args.prefill_tokens
    return {"warm": [prompt_ids(32, 1, vocab), prompt_ids(n, 5, vocab)],
            "prefill": [prompt_ids(n, 2 + 61 * rep, vocab) for rep in range(args.repeats)],
            "decode": [prompt_ids(DECODE_PROMPT, 3 + 61 * rep, vocab)
                       for rep in range(3 * args.repeats)]}


def strata_arm(args, vocab: int, host_mapped: bool, profile: str, budget: str) -> dict:
    """One rank at `budget`: the --prefill-tokens prompts (one new token each) timed for
    prefill, then DECODE_PROMPT-id prompts and --tokens new ones each timed for decode, as
    llama-bench's pp and tg tests are two runs; the hit/host split and the tokens are the first
    decode request's."""
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"]
    cmd = ["--vram-budget", budget, "--max-context", str(args.context),
           "--expert-profile", profile, "--no-remote-auto"]
    env = {"STRATA_HOST_MAPPED": "1" if host_mapped else "0"}
    prompts = run_prompts(args, vocab)
    with PeakMemory() as mem:
        s = serve_session(args.model, *devices, *cmd, env=env, timeout=1200)
        try:
            s.gen(prompts["warm"][0], 16, timeout=900)             # warm-up: graphs captured
            s.gen(prompts["warm"][1], 1, timeout=1800)             # a prompt of the measured length
            pre = [measured(s.gen(p, 1, timeout=1800), f"prompt {i + 1}")
                   for i, p in enumerate(prompts["prefill"])]
            dec, skipped = full_decodes(s, prompts["decode"], args.tokens, args.repeats)
        finally:
            s.close()
    gens = [int(r["done"][0]) for r in dec]
    prompt_tps, prompt_each = median_tps(args.prefill_tokens, [float(r["done"][2]) for r in pre],
                                         "a prompt")
    decode_tps, decode_each = median_tps(args.tokens - 1, [float(r["done"][3]) for r in dec],
                                         "a decode")
    first = dec[0]
    tiers = {k: sum(int(st.get(k, 0)) for st in first["stats"]) for k in ("hits", "remote", "host")}
    steps = sum(int(st.get("graph_steps", 0)) for st in first["stats"])
    name = "strata" if host_mapped else "strata general path"
    key = str(args.prefill_tokens)
    return {"name": name, "gpus": 0 if args.cpu else 1,
            "command": env_prefix(env) + "strata-launch --model M " + " ".join(devices + cmd)
                       + " --serve",
            "decode_tok_s": decode_tps,
            "decode_prompt_tokens": DECODE_PROMPT, "new_tokens": min(gens),
            "decode_prompts_stopped_early": skipped,
            "predicted_ms_per_token": predicted_ms_per_token(args.model, devices + cmd, env),
            "measured_ms_per_token": round(1e3 / decode_tps, 3),
            "prefill_tok_s": {key: prompt_tps},
            "tps_each": {key: prompt_each, "decode": decode_each},
            "prompt_timing": PROMPT_TIMING,
            "peak_gib": round(mem.gib, 2),
            "vram_budget": budget, "tiers": tiers,
            "graph_steps_per_token": round(steps / max(1, gens[0] - 1), 2),
            "tokens_sha256": hashlib.sha256(json.dumps(first["tokens"]).encode()).hexdigest()}


def budget_text(gib: float) -> str:
    return f"{max(0.25, gib):.2f}G"


def matched_arm(args, vocab: int, profile: str, llama_peak: float) -> dict:
    """The host-mapped arm at a budget whose NVML peak is within PEAK_TOLERANCE of llama.cpp's:
    first the budget llama's peak less CONTEXT_GIB, then, if the peak missed, once more with the
    budget moved by the miss (the peak follows the budget byte for byte)."""
    if llama_peak <= 0:
        fail("llama.cpp's peak device memory is 0 (NVML saw none): nothing to match")
    budget = llama_peak - CONTEXT_GIB
    arm = strata_arm(args, vocab, True, profile, budget_text(budget))
    if abs(arm["peak_gib"] / llama_peak - 1) > PEAK_TOLERANCE * 0.8:
        print(f"peak {arm['peak_gib']:.2f} GiB against llama.cpp's {llama_peak:.2f}: budget "
              f"{budget_text(budget)} moved by {llama_peak - arm['peak_gib']:+.2f} GiB", flush=True)
        budget += llama_peak - arm["peak_gib"]
        arm = strata_arm(args, vocab, True, profile, budget_text(budget))
    return arm


def llama_arm(args) -> dict:
    """llama.cpp tuned: every -ub, weights mmap'd and not (a separate process each load mode);
    the arm quotes its best prompt and its best decode."""
    llama_wait(args.llama_bench, args.llama_wait)
    base = ["-m", args.model, "-ngl", "99", "-fa", "1", "-ncmoe", str(args.ncmoe)]
    tests = llama_sweep(args.llama_bench, base, [args.prefill_tokens], args.tokens,
                        args.llama_repeats or args.repeats, llama_mmap_flags(args.llama_bench))
    return tuned_llama_arm(args.llama_bench, tests, [args.prefill_tokens], args.tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--vram-budget", default="19G",
                    help="the rank's device budget, or `match`: the budget whose NVML peak is "
                         "within 5%% of llama.cpp's (needs --llama-bench and NVML)")
    ap.add_argument("--tokens", type=int, default=128,
                    help="new tokens per measured request (llama-bench -n the same)")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="the measured prompt")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured prompts and decode requests each (the median is the figure; "
                         "llama-bench -r the same)")
    ap.add_argument("--context", type=int, default=8192, help="--max-context")
    ap.add_argument("--profile-prompts", type=int, default=8, help="512-id prompts profiled first")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--llama-repeats", type=int, default=0,
                    help="llama-bench -r (default --repeats; its sweep runs every test that often)")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-bench to appear (a build in the background)")
    ap.add_argument("--ncmoe", type=int, default=24, help="llama.cpp's -ncmoe (layers' experts on the CPU)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.vram_budget == "match" and not args.llama_bench:
        fail("--vram-budget match needs --llama-bench (the peak it matches is llama.cpp's)")
    if args.vram_budget == "match" and not nvml_available():
        fail("--vram-budget match needs NVML (the peaks it matches are NVML's) and none answers "
             "here: give a budget, e.g. --vram-budget 10G")
    if args.tokens < 2 or not 1 <= args.repeats <= 8 or args.prefill_tokens < 1:
        fail(f"--tokens {args.tokens} / --repeats {args.repeats} / --prefill-tokens "
             f"{args.prefill_tokens}: at least 2 tokens, 1 to 8 repeats and a 1-token prompt")
    if args.context < args.prefill_tokens + 1:
        fail(f"--context {args.context}: the --prefill-tokens {args.prefill_tokens} prompt and "
             f"its token do not fit")
    facts = model_facts(args.model, args.popularity)
    # the record's identity (commit, time, options, machine) now: a tree no commit can be named
    # for is refused before anything is measured
    recorder = Recorder("offload", facts, args.out)
    profile = os.path.join(tempfile.mkdtemp(prefix="offload-"), "profile.json")
    prompts = run_prompts(args, facts["vocab"])
    record_profile(args.model, args.profile_prompts, facts["vocab"], profile,
                   "cpu" if args.cpu else "cuda:0", [p for ps in prompts.values() for p in ps])
    llama = llama_arm(args) if args.llama_bench else None
    if args.vram_budget == "match":
        arms = [matched_arm(args, facts["vocab"], profile, llama["peak_gib"])]
    else:
        arms = [strata_arm(args, facts["vocab"], True, profile, args.vram_budget)]
    if not args.cpu:   # CPU ranks have no device graph: one arm is the whole comparison
        arms.append(strata_arm(args, facts["vocab"], False, profile, arms[0]["vram_budget"]))
    if llama:
        for arm in arms:
            if llama["peak_gib"] > 0:     # no NVML (a CPU run): no peaks to compare
                arm["peak_vs_llama"] = round(arm["peak_gib"] / llama["peak_gib"], 3)
        arms.append(llama)
    key = str(args.prefill_tokens)
    for arm in arms:
        tiers = arm.get("tiers")
        where = ("; " + ", ".join(f"{k} {v}" for k, v in tiers.items())) if tiers else ""
        print(f"{arm['name']:20s}: {arm['decode_tok_s']:8.2f} tok/s decode, "
              f"{arm['prefill_tok_s'][key]:8.1f} tok/s prefill (each {arm['tps_each'][key]}), "
              f"peak {arm['peak_gib']:.1f} GiB{where}", flush=True)
    if llama:
        print(f"llama.cpp {llama['build']}: best prompt at {llama['best'][key]}, best decode at "
              f"{llama['decode_best']}; -ub sweep {llama['ubatch_sweep']}", flush=True)
    for arm in arms[1:]:
        print(f"strata / {arm['name']} ({facts['popularity']}): decode "
              f"{arms[0]['decode_tok_s'] / arm['decode_tok_s']:.2f}x, "
              f"prefill {arms[0]['prefill_tok_s'][key] / arm['prefill_tok_s'][key]:.2f}x")
    for arm in arms:
        if arm.get("tokens_sha256"):
            print(tokens_against_records("offload", facts, arm["name"], arm["tokens_sha256"],
                                         like={k: arm[k] for k in ("decode_prompt_tokens",
                                                                   "new_tokens")}))
    path = recorder.save(arms)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
