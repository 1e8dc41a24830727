"""Decode with a helper tier on and off, two stages on two cards, in one run (issue 16).

Two stage ranks split the layers at --split. Stage 0's budget caches part of its layers' experts;
stage 1's holds all of its own and leaves room that becomes a helper tier (its card's leftover),
which the plan fills with stage 0's hottest misses. Stage 0's decode graph then reads those pairs
in place from the other card (CUDA IPC) instead of from pinned host memory. A routing profile is
recorded first, so both caches and the tier hold the hottest pairs. Arms, one after the other:

  strata                  one card, every expert resident: the reference tokens
  strata resident         both cards, every expert resident: the decode with no miss at all
  strata helper tier      the budgets: hits, helper reads and host misses
  strata no helper tier   the same budgets, --no-remote-auto: the tier's pairs are host misses

Every arm decodes --tokens new tokens after the same 16-id prompt. Each records decode tok/s, the
plan's prediction beside the measured ms/token, where each expert computation ran (per token),
whether its tokens are the one-card arm's, and the cards' NVML peak. From the differences between
the arms, what one helper read and one host miss cost a token is derived (helper_read_us,
host_miss_us; both arms make the same cache hits). The record (../RECORDS.md, `bench: offload`)
goes to benchmarks/results/offload-<like>-<quant>-<date>-<HHMMSS>-<commit>.json, its `tag`
`helper`. The routing profile's prompts are drawn apart from every prompt an arm reads (checked);
`--popularity` names the routing law of a file that does not store it.

    python benchmarks/bench_tiers.py --model q30.gguf --gpus 0,1 --budgets 5G,14G --split 24
    python benchmarks/bench_tiers.py --model q30.gguf --gpus 0,0 ...   # both ranks on one card
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    python benchmarks/bench_tiers.py --model tiny.gguf --cpu --budgets 99940K,210M \
        --resident-budget 400M --split 2 --tokens 12 --profile-prompts 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from records import (PeakMemory, env_prefix, fail, model_facts,  # noqa: E402
                     predicted_ms_per_token, prompt_ids, record_profile, serve_session,
                     Recorder)

DECODE_PROMPT = 16   # ids before the measured decode (as bench_offload.py's)
RESIDENT = "60G"     # holds every expert of a Qwen3-30B-A3B-sized file; two fit on one H200


def arm(args, vocab: int, name: str, devices: list[str], budgets: str, extra: list[str]) -> dict:
    """One launch: a warm-up request (graphs captured, the helper's tier opened), the measured
    prompt read once alone, then the measured decode on it. The session keeps that prompt, so
    the measured request recomputes almost none of it and its counters are (nearly) the
    decode's alone: they are divided by the rows it computed (the prompt rows not reused, and
    one per new token after the first)."""
    flags = [*devices, "--vram-budget", budgets, "--max-context", "1024", "--prefill", "256",
             "--expert-profile", args.profile, *extra]
    cards = [] if args.cpu else sorted({int(g) for g in devices[1].split(",")})
    with PeakMemory(cards or 0) as mem:
        s = serve_session(args.model, *flags, timeout=1200)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)
            s.gen(prompt_ids(DECODE_PROMPT, 3, vocab), 1, timeout=900)
            out = s.gen(prompt_ids(DECODE_PROMPT, 3, vocab), args.tokens, "stats=1", timeout=1800)
            if out["err"]:
                fail(f"strata-dist failed in arm {name!r}: {out['err']}")
            info = s.info_fields()[0]
        finally:
            s.close()
    gen, decode_ms = int(out["done"][0]), float(out["done"][3])
    steps = gen - 1
    rows = DECODE_PROMPT - (out["resume"] or 0) + steps
    per_token = {k: round(sum(int(st.get(k, 0)) for st in out["stats"]) / rows, 2)
                 for k in ("hits", "remote", "host")}
    graph = sum(int(st.get("graph_steps", 0)) for st in out["stats"])
    return {"name": name, "gpus": len(cards) if cards else 0,
            "command": env_prefix() + "strata-launch --model M " + " ".join(flags) + " --serve",
            "decode_tok_s": round(steps / (decode_ms / 1e3), 2),
            "decode_prompt_tokens": DECODE_PROMPT, "new_tokens": gen,
            "tps_each": {"decode": [round(steps / (decode_ms / 1e3), 2)]},
            "predicted_ms_per_token": predicted_ms_per_token(args.model, flags),
            "measured_ms_per_token": round(decode_ms / steps, 3),
            "peak_gib": round(mem.gib, 2), "vram_budget": budgets,
            "expert_slots": int(info["expert_slots"]),
            "tiers_per_token": per_token,
            "graph_steps_per_token": round(graph / steps, 2),
            "tokens": out["tokens"],
            "tokens_sha256": hashlib.sha256(json.dumps(out["tokens"]).encode()).hexdigest()}


def derived_costs(resident: dict, on: dict, off: dict) -> dict:
    """What one host miss and one helper read add to a token, from three arms with the same
    split: `off` pays host misses where `resident` pays none; `on` pays fewer host misses and
    some helper reads. Each expert computation is priced by what it adds beyond a cache hit."""
    base = resident["measured_ms_per_token"]
    host_off = off["tiers_per_token"]["host"]
    if host_off <= 0:
        return {}
    miss_ms = (off["measured_ms_per_token"] - base) / host_off
    out = {"host_miss_us": round(miss_ms * 1e3, 2)}
    remote_on = on["tiers_per_token"]["remote"]
    if remote_on > 0:
        read_ms = (on["measured_ms_per_token"] - base - on["tiers_per_token"]["host"] * miss_ms) / remote_on
        out["helper_read_us"] = round(read_ms * 1e3, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0,1", help="the two stage ranks' cards (0,0: one card)")
    ap.add_argument("--cpu", action="store_true", help="two CPU ranks (the harness, no GPU)")
    ap.add_argument("--budgets", default="5G,14G",
                    help="the two stages' budgets: the first caches part of its layers' experts, "
                         "the second all of its own, its leftover the helper tier")
    ap.add_argument("--resident-budget", default=RESIDENT, help="a budget that holds every expert")
    ap.add_argument("--split", default=None, help="the second stage's first layer (default: half)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile-prompts", type=int, default=8, help="512-id prompts profiled first")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    args = ap.parse_args()
    facts = model_facts(args.model, args.popularity)
    # the record's identity (commit, time, options, machine) now: a tree no commit can be named
    # for is refused before anything is measured
    recorder = Recorder("offload", facts, args.out, tag="helper")
    from strata_dist.gguf_file.reader import GGUFModel
    split = args.split or str(int(GGUFModel(args.model).arch_metadata("block_count")) // 2)
    args.profile = os.path.join(tempfile.mkdtemp(prefix="tiers-"), "profile.json")
    record_profile(args.model, args.profile_prompts, facts["vocab"], args.profile,
                   "cpu" if args.cpu else "cuda:0",
                   [prompt_ids(32, 1, facts["vocab"]),
                    prompt_ids(DECODE_PROMPT, 3, facts["vocab"])])
    two = ["--cpu-ranks", "2"] if args.cpu else ["--gpus", args.gpus]
    one = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", args.gpus.split(",")[0]]
    split_flags = ["--layer-split", split, "--gpu-order", "as_given"]
    arms = [
        arm(args, facts["vocab"], "strata", one, args.resident_budget, ["--no-remote-auto"]),
        arm(args, facts["vocab"], "strata resident", two, args.resident_budget,
            [*split_flags, "--no-remote-auto"]),
        arm(args, facts["vocab"], "strata helper tier", two, args.budgets, split_flags),
        arm(args, facts["vocab"], "strata no helper tier", two, args.budgets,
            [*split_flags, "--no-remote-auto"]),
    ]
    reference = arms[0].pop("tokens")
    for a in arms[1:]:
        a["tokens_identical_to_1gpu"] = a.pop("tokens") == reference
    arms[2].update(derived_costs(arms[1], arms[2], arms[3]))
    for a in arms:
        t = a["tiers_per_token"]
        print(f"{a['name']:22s}: {a['decode_tok_s']:8.2f} tok/s, {a['measured_ms_per_token']:.3f} "
              f"ms/token (plan {a['predicted_ms_per_token']}), per token hits {t['hits']} "
              f"helper {t['remote']} host {t['host']}, graph steps/token "
              f"{a['graph_steps_per_token']}, peak {a['peak_gib']:.2f} GiB"
              + ("" if a["name"] == "strata" else f", tokens = 1 card: {a['tokens_identical_to_1gpu']}"),
              flush=True)
    on, off = arms[2], arms[3]
    print(f"helper tier / no helper tier: {on['decode_tok_s'] / off['decode_tok_s']:.2f}x decode")
    if "helper_read_us" in on:
        print(f"one helper read {on['helper_read_us']:.1f} us of a token, one host miss "
              f"{on['host_miss_us']:.1f} us")
    for a in (on, off):
        if a["predicted_ms_per_token"]:
            print(f"{a['name']}: measured / predicted {a['measured_ms_per_token'] / a['predicted_ms_per_token']:.2f}")
    print(f"record: {recorder.save(arms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
