"""Decode after the workload's routing moved, with the adaptive cache on and off (issue 49,
`bench: adapt`).

A synthetic file routes by token, not by context (strata_dist/synth): a phase is a set of prompts
drawn from its own few token ids (phase one's from the lower half of the vocabulary, phase two's
from the upper half, --distinct ids each), so the two phases route to different experts where
their ids do, and each request's greedy continuation routes as its tokens do. Arms, one after the
other, on the same file, devices and budget:

  strata phase one   phase one's requests, with --expert-profile-out: the routing profile
                     learnt while serving (written at its clean shutdown)
  strata adapt off   phase two's requests on the cache the plan fills from that profile, which
                     stays as filled
  strata adapt on    the same with --adapt-every T --adapt-swaps S

Each arm runs --requests requests of --prompt-tokens ids and --tokens new tokens (greedy). Its
decode_tok_s is the median of its requests' after the first (the first is where an adaptive
cache starts to move; its own figure is `first_decode_tok_s`), its hit rate (the share of expert
computations its stage caches made) is recorded per request, `hit_rate_before` the first
request's and `hit_rate_after` the mean of the last two. The record gives `adapt_on_over_off`
(decode tok/s, on over off, the same record) and whether the on arm's tokens are the off arm's
(CPU ranks compute every expert with the same kernels: a difference there exits 1; on a GPU a
pair the host computes in decode rounds differently, so it is recorded, not enforced).

One rank, no helper tier (--no-remote-auto): the budget's room past the weights is the stage's
cache. The budget: --vram-budget, by default the device memory llama.cpp's weights take at `-ncmoe N`
(--ncmoe, 24: the file less the experts of N layers) plus --kv-mib for the session and scratch.

The record (../shared/RECORDS.md, `bench: adapt`) goes to
benchmarks/results/adapt-<like>-<quant>-<date>-<HHMMSS>-<commit>.json. Without --model the file
is synthesized first into --models (kept there for the next call; with --cpu a fresh folder).

    python benchmarks/bench_adapt.py --models /tmp/m       # one GPU: qwen3-30b-a3b, q4_k_m
    python benchmarks/bench_adapt.py --cpu                 # one CPU rank, the tiny file
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from records import PeakMemory, Recorder, env_prefix, fail, model_facts, serve_session  # noqa: E402

MIB = 1 << 20
GPU = {"like": "qwen3-30b-a3b", "quant": "q4_k_m", "popularity": "zipf:1.0", "requests": 6,
       "prompt_tokens": 256, "tokens": 128, "distinct": 64, "adapt_every": 64, "adapt_swaps": 64,
       "expert_cache": "auto"}
# the tiny geometry: 4 layers x 8 experts; a cache of 8 pairs leaves most to the host
CPU = {"like": "tiny", "quant": "q8_0", "popularity": "zipf:1.0", "requests": 4,
       "prompt_tokens": 48, "tokens": 24, "distinct": 6, "adapt_every": 16, "adapt_swaps": 4,
       "expert_cache": "8"}


def synthesized(args) -> str:
    path = os.path.join(args.models, f"adapt-{args.like}-{args.quant}.gguf")
    if os.path.isfile(path):
        return path
    os.makedirs(args.models, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.tools", "synth", path, "--like", args.like, "--quant",
           args.quant, "--popularity", args.popularity, "--quiet"]
    print("+ " + " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if done.returncode != 0 or not os.path.isfile(path):
        fail(f"synth failed: {done.stderr.strip()[-800:]}")
    return path


def phase_prompts(phase: int, args, vocab: int) -> list[list[int]]:
    """--requests prompts of --prompt-tokens ids, each drawn (seeded) from the phase's own
    --distinct ids: phase 1's below half the vocabulary, phase 2's above."""
    import numpy as np
    half = (vocab - 8) // 2
    lo, hi = (10, half) if phase == 1 else (half, vocab - 8)
    rng = np.random.default_rng(1000 + phase)
    ids = rng.choice(np.arange(lo, hi), size=min(args.distinct, hi - lo), replace=False)
    return [[int(t) for t in rng.choice(ids, size=args.prompt_tokens)]
            for _ in range(args.requests)]


def ncmoe_budget(model: str, ncmoe: int, kv_mib: int) -> str:
    """The device memory llama.cpp's weights take with -ncmoe N (the experts of N layers on the
    host): the file less those experts, plus kv_mib, as a --vram-budget."""
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.models import architecture_for
    g = GGUFModel(model)
    geo = architecture_for(g).read_geometry(g)
    host = sum(g.blob_bytes(layer) * geo.n_expert for layer in range(min(ncmoe, geo.n_layers)))
    return f"{(g.file_bytes - host) // MIB + kv_mib}M"


def run_arm(args, name: str, prompts: list[list[int]], extra: list[str]) -> dict:
    """One launch and its requests, each with the ranks' counters."""
    flags = [*args.devices, "--max-context", str(args.prompt_tokens + args.tokens + 64), *extra]
    print(f"== {name}: strata-launch {' '.join(flags)}", flush=True)
    replies = []
    with PeakMemory(0) as mem:
        s = serve_session(args.model, *flags, timeout=1800)
        try:
            for i, ids in enumerate(prompts):
                r = s.gen(ids, args.tokens, "stats=1", timeout=1800)
                if r["err"]:
                    fail(f"{name}: request {i + 1} failed: {r['err']}")
                replies.append(r)
        finally:
            code = s.close(timeout=120)
        if code != 0:
            fail(f"{name}: strata-launch exited {code}: {s.err()[-600:]}")
    decode, hit_rates, tiers = [], [], {"hits": 0, "remote": 0, "host": 0}
    for r in replies:
        gen, ms = int(r["done"][0]), float(r["done"][3])
        if gen < 2 or ms <= 0:
            fail(f"{name}: {gen} tokens in {ms} ms of decode: nothing timed")
        decode.append(round((gen - 1) / (ms / 1e3), 2))
        got = {k: sum(int(st.get(k, 0)) for st in r["stats"]) for k in tiers}
        hit_rates.append(round(got["hits"] / max(1, sum(got.values())), 4))
        tiers = {k: tiers[k] + got[k] for k in tiers}
    tokens = [r["tokens"] for r in replies]
    return {"name": name, "gpus": 0 if args.cpu else 1,
            "command": env_prefix() + "strata-launch --model M " + " ".join(flags) + " --serve",
            "requests": len(replies), "new_tokens": min(int(r["done"][0]) for r in replies),
            "decode_tok_s": statistics.median(decode[1:]), "first_decode_tok_s": decode[0],
            "tps_each": {"decode": decode}, "hit_rates": hit_rates,
            "hit_rate_before": hit_rates[0], "hit_rate_after": round(statistics.mean(
                hit_rates[-2:]), 4), "tiers": tiers, "peak_gib": round(mem.gib, 2),
            "vram_budget": args.vram_budget, "tokens": tokens,
            "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="the file (default: synthesized into --models)")
    ap.add_argument("--models", default="", help="where the synthesized file goes (default "
                                                 "/tmp/m; --cpu: a new folder)")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank and the tiny geometry")
    ap.add_argument("--like", help="the synthesized geometry (GPU: qwen3-30b-a3b)")
    ap.add_argument("--quant", help="its quantisation (GPU: q4_k_m)")
    ap.add_argument("--popularity", help="its routing law (default zipf:1.0)")
    ap.add_argument("--vram-budget", default=None, help="the rank's budget (GPU default: -ncmoe "
                                                         "--ncmoe's device memory + --kv-mib)")
    ap.add_argument("--ncmoe", type=int, default=24, help="llama.cpp's -ncmoe the budget matches")
    ap.add_argument("--kv-mib", type=int, default=1024, help="MiB over the weights (session, "
                                                              "scratch)")
    ap.add_argument("--expert-cache", help="--expert-cache of every arm (GPU: auto)")
    ap.add_argument("--requests", type=int, help="requests per phase (at least 3)")
    ap.add_argument("--prompt-tokens", type=int, help="ids per prompt")
    ap.add_argument("--tokens", type=int, help="new tokens per request")
    ap.add_argument("--distinct", type=int, help="distinct ids a phase's prompts draw from")
    ap.add_argument("--adapt-every", type=int, help="the on arm's --adapt-every")
    ap.add_argument("--adapt-swaps", type=int, help="the on arm's --adapt-swaps")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    for k, v in (CPU if args.cpu else GPU).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.requests < 3 or args.tokens < 2 or args.prompt_tokens < 1 or args.distinct < 1:
        fail(f"--requests {args.requests} (>= 3), --tokens {args.tokens} (>= 2), --prompt-tokens "
             f"{args.prompt_tokens} and --distinct {args.distinct} (>= 1)")
    if args.adapt_every < 1 or args.adapt_swaps < 1:
        fail(f"--adapt-every {args.adapt_every} / --adapt-swaps {args.adapt_swaps}: the on arm "
             f"adapts (both >= 1)")
    args.models = args.models or (tempfile.mkdtemp(prefix="adapt-") if args.cpu else "/tmp/m")
    args.model = args.model or synthesized(args)
    facts = model_facts(args.model, args.popularity)
    if not args.cpu and args.vram_budget is None:
        args.vram_budget = ncmoe_budget(args.model, args.ncmoe, args.kv_mib)
    # one rank, no helper tier: what the budget leaves past the weights is the stage's cache (a
    # helper tier on the stage's own card is read in place by a GPU decode graph and never swaps)
    args.devices = [*(["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"]), "--no-remote-auto"]
    if args.vram_budget:
        args.devices += ["--vram-budget", args.vram_budget]
    if args.expert_cache != "auto":
        args.devices += ["--expert-cache", args.expert_cache]
    recorder = Recorder("adapt", facts, args.out)
    profile = os.path.join(tempfile.mkdtemp(prefix="adapt-"), "phase1.json")
    one, two = phase_prompts(1, args, facts["vocab"]), phase_prompts(2, args, facts["vocab"])
    first = run_arm(args, "strata phase one", one, ["--expert-profile-out", profile])
    if not os.path.isfile(profile):
        fail(f"phase one wrote no profile at {profile}")
    learnt = ["--expert-profile", profile]
    off = run_arm(args, "strata adapt off", two, learnt)
    on = run_arm(args, "strata adapt on", two, [*learnt, "--adapt-every", str(args.adapt_every),
                                                "--adapt-swaps", str(args.adapt_swaps)])
    on["tokens_identical_to_adapt_off"] = on["tokens"] == off["tokens"]
    arms = [first, off, on]
    for a in arms:
        a.pop("tokens")
        print(f"{a['name']:17s}: decode {a['decode_tok_s']:8.2f} tok/s (first request "
              f"{a['first_decode_tok_s']:.2f}), hit rate {a['hit_rate_before']:.3f} -> "
              f"{a['hit_rate_after']:.3f}, experts hit {a['tiers']['hits']} helper "
              f"{a['tiers']['remote']} host {a['tiers']['host']}, peak {a['peak_gib']:.2f} GiB",
              flush=True)
    ratio = round(on["decode_tok_s"] / off["decode_tok_s"], 3)
    print(f"adapt on / off, phase two decode: {ratio}x; tokens identical: "
          f"{on['tokens_identical_to_adapt_off']}")
    print(f"record: {recorder.save(arms, adapt_on_over_off=ratio, ncmoe=args.ncmoe)}")
    if args.cpu and not on["tokens_identical_to_adapt_off"]:
        print("error: the adaptive cache changed the tokens on CPU ranks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
