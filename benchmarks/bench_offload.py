"""Decode and prefill with experts off the card, beside llama.cpp at the same device memory, in one run.

A routing profile is recorded first (`strata-dist profile` over --profile-prompts prompts of
512 ids; the plan caches the hottest experts by it), then llama.cpp reads the file with
`-ncmoe N` (the experts of N layers in host memory, computed by the CPU) and its NVML peak is
taken. Then one GPU rank at `--vram-budget` (`match`: the budget whose peak is within 5% of
llama.cpp's, found in at most two runs), measured twice: the experts its cache lacks read in
place from pinned host memory by the decode graph's own kernels (STRATA_HOST_MAPPED=1), and
through the general path (each miss streamed to the device and computed by its own launches).
Like llama-bench's pp and tg tests, each arm times a --prefill-tokens prompt and, apart, --tokens
new tokens after a 16-id prompt. Prints tok/s, where each decode's expert computations ran, the
peak device memory of every arm and the ratios; the record of ../RECORDS.md goes to
benchmarks/results/offload-<like>-<quant>-<date>.json.

    python benchmarks/bench_offload.py --model q30.gguf --vram-budget match --prefill-tokens 4096 \
        --llama-bench .anchor/llama.cpp/build/bin/llama-bench --ncmoe 24
    python benchmarks/bench_offload.py --model tiny.gguf --cpu --vram-budget 165M --tokens 16
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from records import (PeakMemory, env_prefix, llama_bench, model_facts,  # noqa: E402
                     predicted_ms_per_token, prompt_ids, tokens_against_records, write_record)
from launch_helpers import ServeSession  # noqa: E402


def record_profile(args, vocab: int, out: str) -> None:
    """The routing profile the plans rank experts by, from prompts none of the arms reads."""
    ids = os.path.join(os.path.dirname(out), "prompts.txt")
    with open(ids, "w") as f:
        for k in range(args.profile_prompts):
            f.write(",".join(map(str, prompt_ids(512, 1000 + k, vocab))) + "\n")
    cmd = [sys.executable, "-m", "strata_dist.cli", "profile", "--model", args.model,
           "--prompt-ids-file", ids, "--out", out, "--device", "cpu" if args.cpu else "cuda:0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"strata-dist profile failed: {done.stderr[-2000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)


DECODE_PROMPT = 16      # ids before a decode measurement: llama-bench's tg test starts empty
PEAK_TOLERANCE = 0.05   # "equal device memory": NVML peaks within 5% (issue 16)
CONTEXT_GIB = 0.5       # a rank's peak above its budget (CUDA context, graphs), the first guess


def strata_arm(args, vocab: int, host_mapped: bool, profile: str, budget: str) -> dict:
    """One rank at `budget`: the --prefill-tokens prompt (one new token) timed for prefill, then
    a DECODE_PROMPT-id prompt and --tokens new ones timed for decode, as llama-bench's pp and tg
    tests are two runs; the hit/host split and the tokens are the decode request's."""
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"]
    cmd = ["--vram-budget", budget, "--max-context", str(args.context),
           "--expert-profile", profile, "--no-remote-auto"]
    env = {"STRATA_HOST_MAPPED": "1" if host_mapped else "0"}
    with PeakMemory() as mem:
        s = ServeSession(args.model, *devices, *cmd, env=env, timeout=1200)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)        # warm-up: graphs captured
            pre = s.gen(prompt_ids(args.prefill_tokens, 2, vocab), 1, timeout=1800)
            dec = s.gen(prompt_ids(DECODE_PROMPT, 3, vocab), args.tokens, "stats=1", timeout=1800)
            for r in (pre, dec):
                if r["err"]:
                    raise SystemExit(f"strata-dist failed: {r['err']}")
        finally:
            s.close()
    prompt_ms = float(pre["done"][2])
    gen, decode_ms = int(dec["done"][0]), float(dec["done"][3])
    tiers = {k: sum(int(st.get(k, 0)) for st in dec["stats"]) for k in ("hits", "remote", "host")}
    steps = sum(int(st.get("graph_steps", 0)) for st in dec["stats"])
    name = "strata" if host_mapped else "strata general path"
    return {"name": name, "gpus": 1,
            "command": env_prefix(env) + "strata-launch --model M " + " ".join(devices + cmd)
                       + " --serve",
            "decode_tok_s": round((gen - 1) / (decode_ms / 1e3), 2),
            "decode_prompt_tokens": DECODE_PROMPT, "new_tokens": args.tokens,
            "predicted_ms_per_token": predicted_ms_per_token(args.model, devices + cmd, env),
            "measured_ms_per_token": round(decode_ms / (gen - 1), 3),
            "prefill_tok_s": {str(args.prefill_tokens): round(args.prefill_tokens / (prompt_ms / 1e3), 1)},
            "peak_gib": round(mem.gib, 2),
            "vram_budget": budget, "tiers": tiers,
            "graph_steps_per_token": round(steps / max(1, gen - 1), 2),
            "tokens_sha256": hashlib.sha256(json.dumps(dec["tokens"]).encode()).hexdigest()}


def budget_text(gib: float) -> str:
    return f"{max(0.25, gib):.2f}G"


def matched_arm(args, vocab: int, profile: str, llama_peak: float) -> dict:
    """The host-mapped arm at a budget whose NVML peak is within PEAK_TOLERANCE of llama.cpp's:
    first the budget llama's peak less CONTEXT_GIB, then, if the peak missed, once more with the
    budget moved by the miss (the peak follows the budget byte for byte)."""
    budget = llama_peak - CONTEXT_GIB
    arm = strata_arm(args, vocab, True, profile, budget_text(budget))
    if abs(arm["peak_gib"] / llama_peak - 1) > PEAK_TOLERANCE * 0.8:
        print(f"peak {arm['peak_gib']:.2f} GiB against llama.cpp's {llama_peak:.2f}: budget "
              f"{budget_text(budget)} moved by {llama_peak - arm['peak_gib']:+.2f} GiB", flush=True)
        budget += llama_peak - arm["peak_gib"]
        arm = strata_arm(args, vocab, True, profile, budget_text(budget))
    return arm


def llama_arm(args) -> dict:
    rows, peak, command = llama_bench(
        [args.llama_bench, "-m", args.model, "-ngl", "99", "-fa", "1", "-ncmoe", str(args.ncmoe),
         "-p", str(args.prefill_tokens), "-n", str(args.tokens), "-r", "2", "-o", "json"])
    pp = next(r for r in rows if int(r["n_prompt"]) > 0)   # the prompt test's row
    tg = next(r for r in rows if int(r["n_gen"]) > 0)      # the generation test's
    return {"name": "llama.cpp", "gpus": 1, "command": command,
            "decode_tok_s": round(float(tg["avg_ts"]), 2),
            "prefill_tok_s": {str(args.prefill_tokens): round(float(pp["avg_ts"]), 1)},
            "peak_gib": round(peak, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--vram-budget", default="19G",
                    help="the rank's device budget, or `match`: the budget whose NVML peak is "
                         "within 5%% of llama.cpp's (needs --llama-bench)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per measured request")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="the measured prompt")
    ap.add_argument("--context", type=int, default=8192, help="--max-context")
    ap.add_argument("--profile-prompts", type=int, default=8, help="512-id prompts profiled first")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--ncmoe", type=int, default=24, help="llama.cpp's -ncmoe (layers' experts on the CPU)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.vram_budget == "match" and not args.llama_bench:
        ap.error("--vram-budget match needs --llama-bench (the peak it matches is llama.cpp's)")
    facts = model_facts(args.model)
    work = tempfile.mkdtemp(prefix="offload-")
    profile = os.path.join(work, "profile.json")
    record_profile(args, facts["vocab"], profile)
    llama = llama_arm(args) if args.llama_bench else None
    if args.vram_budget == "match":
        arms = [matched_arm(args, facts["vocab"], profile, llama["peak_gib"])]
    else:
        arms = [strata_arm(args, facts["vocab"], True, profile, args.vram_budget)]
    if not args.cpu:   # CPU ranks have no device graph: one arm is the whole comparison
        arms.append(strata_arm(args, facts["vocab"], False, profile, arms[0]["vram_budget"]))
    if llama:
        for arm in arms:
            arm["peak_vs_llama"] = round(arm["peak_gib"] / llama["peak_gib"], 3)
        arms.append(llama)
    for arm in arms:
        tiers = arm.get("tiers")
        where = ("; " + ", ".join(f"{k} {v}" for k, v in tiers.items())) if tiers else ""
        pre = next(iter(arm["prefill_tok_s"].values()))
        print(f"{arm['name']:20s}: {arm['decode_tok_s']:8.2f} tok/s decode, {pre:8.1f} tok/s "
              f"prefill, peak "
              f"{arm['peak_gib']:.1f} GiB{where}", flush=True)
    for arm in arms[1:]:
        key = str(args.prefill_tokens)
        print(f"strata / {arm['name']}: decode {arms[0]['decode_tok_s'] / arm['decode_tok_s']:.2f}x, "
              f"prefill {arms[0]['prefill_tok_s'][key] / arm['prefill_tok_s'][key]:.2f}x")
    for arm in arms:
        if arm.get("tokens_sha256"):
            print(tokens_against_records("offload", facts, arm["name"], arm["tokens_sha256"],
                                         like={k: arm[k] for k in ("decode_prompt_tokens",
                                                                   "new_tokens")}))
    path = write_record("offload", facts, arms, args.out)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
