"""Decode with experts off the card, beside llama.cpp at about the same device memory, in one run.

A routing profile is recorded first (`strata-dist profile` over --profile-prompts prompts of
512 ids; the plan caches the hottest experts by it). Then one GPU rank with `--vram-budget` (the
default caches about half the experts of the synthetic Qwen3-30B-A3B Q8_0 file), measured twice: the experts its cache lacks read in place from pinned
host memory by the decode graph's own kernels (STRATA_HOST_MAPPED=1), and through the general
path (each miss streamed to the device and computed by its own launches); each arm reads a
--prefill-tokens prompt and decodes --tokens. llama.cpp reads the same file with `-ncmoe N` (the
experts of N layers in host memory, computed by the CPU). Prints tok/s, where each expert
computation ran, the peak device memory of every arm and the ratios;
the record of ../RECORDS.md goes to benchmarks/results/offload-<like>-<quant>-<date>.json.

    python benchmarks/bench_offload.py --model q30.gguf --vram-budget 10G --prefill-tokens 1024 \\
        --llama-bench .anchor/llama.cpp/build/bin/llama-bench --ncmoe 24
    python benchmarks/bench_offload.py --model tiny.gguf --cpu --vram-budget 2M --tokens 16
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


def strata_arm(args, vocab: int, host_mapped: bool, profile: str) -> dict:
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"]
    cmd = ["--vram-budget", args.vram_budget, "--max-context", str(args.context),
           "--expert-profile", profile, "--no-remote-auto"]
    env = {"STRATA_HOST_MAPPED": "1" if host_mapped else "0"}
    with PeakMemory() as mem:
        s = ServeSession(args.model, *devices, *cmd, env=env, timeout=1200)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)        # warm-up: graphs captured
            r = s.gen(prompt_ids(args.prefill_tokens, 2, vocab), args.tokens, "stats=1",
                      timeout=1800)
            if r["err"]:
                raise SystemExit(f"strata-dist failed: {r['err']}")
        finally:
            s.close()
    gen, prompt_ms, decode_ms = int(r["done"][0]), float(r["done"][2]), float(r["done"][3])
    tiers = {k: sum(int(st.get(k, 0)) for st in r["stats"]) for k in ("hits", "remote", "host")}
    steps = sum(int(st.get("graph_steps", 0)) for st in r["stats"])
    name = "strata" if host_mapped else "strata general path"
    return {"name": name, "gpus": 1,
            "command": env_prefix(env) + "strata-launch --model M " + " ".join(devices + cmd)
                       + " --serve",
            "decode_tok_s": round((gen - 1) / (decode_ms / 1e3), 2),
            "predicted_ms_per_token": predicted_ms_per_token(args.model, devices + cmd, env),
            "measured_ms_per_token": round(decode_ms / (gen - 1), 3),
            "prefill_tok_s": {str(args.prefill_tokens): round(args.prefill_tokens / (prompt_ms / 1e3), 1)},
            "peak_gib": round(mem.gib, 2),
            "vram_budget": args.vram_budget, "tiers": tiers,
            "graph_steps_per_token": round(steps / max(1, gen - 1), 2),
            "tokens_sha256": hashlib.sha256(json.dumps(r["tokens"]).encode()).hexdigest()}


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
    ap.add_argument("--vram-budget", default="19G", help="the rank's device budget")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per measured request")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="the measured prompt")
    ap.add_argument("--context", type=int, default=8192, help="--max-context")
    ap.add_argument("--profile-prompts", type=int, default=8, help="512-id prompts profiled first")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--ncmoe", type=int, default=24, help="llama.cpp's -ncmoe (layers' experts on the CPU)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    facts = model_facts(args.model)
    work = tempfile.mkdtemp(prefix="offload-")
    profile = os.path.join(work, "profile.json")
    record_profile(args, facts["vocab"], profile)
    arms = [strata_arm(args, facts["vocab"], True, profile)]
    if not args.cpu:   # CPU ranks have no device graph: one arm is the whole comparison
        arms.append(strata_arm(args, facts["vocab"], False, profile))
    if args.llama_bench:
        arms.append(llama_arm(args))
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
            print(tokens_against_records("offload", facts, arm["name"], arm["tokens_sha256"]))
    path = write_record("offload", facts, arms, args.out)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
