"""Decode tok/s of strata-dist beside llama.cpp's, on the same file, side by side in one run.

Each strata arm launches `strata-launch --serve` (one rank per listed GPU), reads a warm-up
request (the decode graph is captured there), then one greedy request of --tokens new tokens, and
prints decode tok/s (tokens after the first / decode seconds), the share of steps that ran as a
device graph, and the device's peak memory. With two GPUs it also checks the tokens against the
one-GPU arm and measures the hand-off of one decode row between the two cards
(bench_transport.py's median). With --llama-bench, llama.cpp's `llama-bench -ngl 99 -fa 1 -n N`
reads the same file and the ratio is printed. The record of ../RECORDS.md goes to
benchmarks/results/decode-<like>-<quant>-<date>.json.

    python benchmarks/bench_decode.py --model q30.gguf --gpus 0 \\
        --llama-bench .anchor/llama.cpp/build/bin/llama-bench
    python benchmarks/bench_decode.py --model q30.gguf --gpus 0,1 --split 24
    python benchmarks/bench_decode.py --model tiny.gguf --cpu --tokens 16     # the harness, no GPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from records import (PeakMemory, env_prefix, llama_bench, model_facts,  # noqa: E402
                     predicted_ms_per_token, prompt_ids, tokens_against_records, write_record)
from launch_helpers import ServeSession  # noqa: E402


def strata_arm(args, gpus: str, split: str, vocab: int) -> dict:
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", gpus]
    cmd = ["--layer-split", split, "--max-context", str(args.context), "--no-remote-auto"]
    n_gpus = len(gpus.split(","))
    with PeakMemory() as mem:
        s = ServeSession(args.model, *devices, *cmd, timeout=1200)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)         # warm-up: graphs captured
            r = s.gen(prompt_ids(32, 2, vocab), args.tokens, "stats=1", timeout=900)
            if r["err"]:
                raise SystemExit(f"strata-dist failed: {r['err']}")
            gen, decode_ms = int(r["done"][0]), float(r["done"][3])
            steps = sum(int(st.get("graph_steps", 0)) for st in r["stats"])
        finally:
            s.close()
    command = env_prefix() + "strata-launch --model M " + " ".join(devices + cmd) + " --serve"
    tok_s = (gen - 1) / (decode_ms / 1e3)
    return {"name": "strata", "gpus": n_gpus, "command": command,
            "decode_tok_s": tok_s, "peak_gib": round(mem.gib, 2),
            "predicted_ms_per_token": predicted_ms_per_token(args.model, devices + cmd),
            "measured_ms_per_token": round(1e3 / tok_s, 3),
            "tokens_sha256": hashlib.sha256(json.dumps(r["tokens"]).encode()).hexdigest(),
            "graph_steps_per_stage": steps / max(1, n_gpus) / max(1, gen - 1),
            "_tokens": r["tokens"]}


def handoff_us(devices: str) -> float | None:
    """The median one-way hand-off of one decode row between two cards (bench_transport.py)."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "bench_transport.py"), "--devices",
                           devices, "--json"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"bench_transport.py failed: {done.stderr[-800:]}", flush=True)
        return None
    return float(json.loads(done.stdout.strip().splitlines()[-1])["decode_row_median_us"])


def llama_arm(args) -> dict:
    deadline = time.monotonic() + args.llama_wait     # a llama.cpp build may still be running
    while not os.access(args.llama_bench, os.X_OK) and time.monotonic() < deadline:
        time.sleep(5)
    rows, peak, command = llama_bench([args.llama_bench, "-m", args.model, "-ngl", "99", "-fa",
                                       "1", "-p", "0", "-n", str(args.tokens), "-r", "2",
                                       "-o", "json"])
    return {"name": "llama.cpp", "gpus": 1, "command": command,
            "decode_tok_s": float(rows[0]["avg_ts"]), "peak_gib": round(peak, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0", help="0 (one arm) or 0,1 (a 1-GPU and a 2-GPU arm)")
    ap.add_argument("--split", default="", help="--layer-split of the 2-GPU arm (default auto)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per measured request")
    ap.add_argument("--context", type=int, default=1024, help="--max-context")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-bench to appear (a build in the background)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    facts = model_facts(args.model)
    arms = []
    gpus = args.gpus.split(",")
    one = strata_arm(args, gpus[0], "auto", facts["vocab"])
    arms.append(one)
    print(f"strata 1 GPU: {one['decode_tok_s']:.1f} tok/s decode, graph steps/stage/token "
          f"{one['graph_steps_per_stage']:.2f}, peak {one['peak_gib']:.1f} GiB", flush=True)
    if len(gpus) > 1 and not args.cpu:
        two = strata_arm(args, ",".join(gpus[:2]), args.split or "auto", facts["vocab"])
        two["tokens_identical_to_1gpu"] = two["_tokens"] == one["_tokens"]
        us = handoff_us(",".join(gpus[:2]))
        if us is not None:
            two["handoff_us"] = round(us, 1)
        arms.append(two)
        print(f"strata 2 GPUs: {two['decode_tok_s']:.1f} tok/s decode, tokens identical to 1 GPU: "
              f"{two['tokens_identical_to_1gpu']}, hand-off {two.get('handoff_us')} us", flush=True)
    if args.llama_bench:
        ll = llama_arm(args)
        arms.append(ll)
        print(f"llama.cpp: {ll['decode_tok_s']:.1f} tok/s decode", flush=True)
        for arm in arms[:-1]:
            print(f"strata {arm['gpus']} GPU(s) / llama.cpp 1 GPU: "
                  f"{arm['decode_tok_s'] / ll['decode_tok_s']:.2f}x", flush=True)
    for arm in arms:
        arm.pop("_tokens", None)
        arm["decode_tok_s"] = round(arm["decode_tok_s"], 2)
    print(tokens_against_records("decode", facts, "strata", one["tokens_sha256"]), flush=True)
    path = write_record("decode", facts, arms, args.out)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
