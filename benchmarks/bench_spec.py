"""Speculative decoding (`--spec K`): decode tok/s, drafts and acceptance of each drafter beside
K = 0 on the same file and prompts, in one run.

Arms, each its own `strata-launch --serve` (the ranks of --gpus: `0` one rank on one card,
`0,0` two ranks on one card, `0,1` two cards), a warm-up request, then --repeats greedy requests
of --tokens new tokens each:
- `strata` (K = 0) on measured prompts, and `strata repeating prompt` (K = 0) on prompts that
  repeat a block of ids four times (a quoted document): the references;
- `strata self-draft`: `--spec K --draft-model` the target file itself. Every draft is the
  target's own token (acceptance 100%), so this is the mechanism's bound;
- `strata quantized draft` (with --draft): `--spec K --draft-model` the same geometry written at
  a lower quant (synthesised with the same seed: the same random stream, `q2_k` drafting for
  `q8_0`);
- `strata ngram`: `--spec K --draft ngram` on the repeating prompts.
Each speculative arm records its tok/s, the drafts made and accepted (the line protocol's STATS
drafted=/accepted=), K, its ratio to the K = 0 arm of its prompts, and whether its greedy tokens
are those of that arm (they must be). Synthetic weights cannot show a real model's acceptance:
the record states what was accepted, nothing more. The record of ../shared/RECORDS.md goes to
benchmarks/results/spec-<like>-<quant>-<date>-<HHMMSS>-<commit>.json.
llama.cpp's `llama-speculative` has no arm: the anchor build (.anchor/llamacpp-anchor.sh) makes
llama-bench only.

    python benchmarks/bench_spec.py --model q30-q8_0.gguf --draft q30-q2_k.gguf --gpus 0
    python benchmarks/bench_spec.py --model q30.gguf --gpus 0,0 --k 4
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    strata-dist synth tiny-q2.gguf --like tiny --quant q2_k --popularity zipf:1.0 --quiet
    python benchmarks/bench_spec.py --model tiny.gguf --draft tiny-q2.gguf --cpu --tokens 16 \\
        --repeats 1     # the harness, no GPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from records import (PeakMemory, env_prefix, fail, measured,  # noqa: E402
                     model_facts, prompt_ids, record_model, serve_session, Recorder)

MAX_K = 7   # --spec's bound (strata_dist/speculative.py MAX_SPEC)


def repeating_prompt(seed: int, vocab: int) -> list[int]:
    """A block of 24 ids said four times: what the n-gram drafter finds its continuations in."""
    return prompt_ids(24, seed, vocab) * 4


def launch_args(args) -> list[str]:
    ranks = args.gpus.split(",")
    devices = ["--cpu-ranks", str(len(ranks))] if args.cpu else ["--gpus", args.gpus]
    split = ["--layer-split", args.split] if args.split and len(ranks) > 1 else []
    return [*devices, *split, "--max-context", str(args.context), "--no-remote-auto"]


def run_arm(args, name: str, spec: list[str], prompts: list[list[int]], vocab: int) -> dict:
    """One launch: a warm-up, then one request of --tokens per prompt, all measured."""
    base = launch_args(args)
    with PeakMemory() as mem:
        s = serve_session(args.model, *base, *spec, timeout=1200)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)    # warm-up: graphs captured
            runs = [measured(s.gen(p, args.tokens, timeout=1800), f"{name} request {i + 1}")
                    for i, p in enumerate(prompts)]
        finally:
            s.close()
    gens = [int(r["done"][0]) for r in runs]
    # decode tok/s: each request's tokens after the first over its decode seconds (a request that
    # met end of text early made fewer: the K = 0 arm of its prompt made the same number)
    if min(float(r["done"][3]) for r in runs) <= 0 or min(gens) < 2:
        fail(f"{name}: a request decoded under 2 tokens or was timed at 0 ms: ask more --tokens")
    each = [round((g - 1) / (float(r["done"][3]) / 1e3), 2) for g, r in zip(gens, runs)]
    tok_s = statistics.median(each)
    counts = [next((st for st in r["stats"] if "drafted" in st), {}) for r in runs]
    ranks = args.gpus.split(",")
    arm = {"name": name, "gpus": len(set(ranks)), "ranks": len(ranks),
           "command": env_prefix() + "strata-launch --model M " + " ".join(base + spec)
           + " --serve",
           "decode_tok_s": tok_s, "new_tokens": min(gens), "tps_each": {"decode": each},
           "peak_gib": round(mem.gib, 2),
           "tokens_sha256": hashlib.sha256(json.dumps([r["tokens"] for r in runs]).encode())
           .hexdigest(),
           "_tokens": [r["tokens"] for r in runs]}
    if spec:
        drafted = sum(int(c.get("drafted", 0)) for c in counts)
        accepted = sum(int(c.get("accepted", 0)) for c in counts)
        arm.update(k=args.k, drafted=drafted, accepted=accepted,
                   acceptance=round(accepted / drafted, 4) if drafted else None)
    return arm


def against(arm: dict, reference: dict) -> dict:
    """The speculative arm beside its K = 0 arm: identical tokens, and the tok/s ratio."""
    arm["tokens_identical_to_k0"] = arm["_tokens"] == reference["_tokens"]
    arm["over_k0"] = round(arm["decode_tok_s"] / reference["decode_tok_s"], 3)
    return arm


def say(arm: dict) -> None:
    extra = ""
    if "k" in arm:
        extra = (f", K {arm['k']}: {arm['accepted']}/{arm['drafted']} drafts accepted, "
                 f"{arm['over_k0']:.2f}x K = 0, tokens identical: {arm['tokens_identical_to_k0']}")
    print(f"{arm['name']}: {arm['decode_tok_s']:.1f} tok/s decode{extra}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target file")
    ap.add_argument("--draft", default="",
                    help="a draft file of the same geometry at a lower quant (the quantized-draft "
                         "arm; none: no such arm)")
    ap.add_argument("--gpus", default="0",
                    help="the ranks' cards: 0 (one rank), 0,0 (two ranks on one card), 0,1")
    ap.add_argument("--split", default="", help="--layer-split with two ranks (default auto)")
    ap.add_argument("--k", type=int, default=4, help="--spec K of the speculative arms (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per measured request")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured requests per arm, each on a prompt of its own (median)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--context", type=int, default=1024, help="--max-context")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (the harness, no GPU)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.tokens < 2 or not 1 <= args.repeats <= 8 or not 1 <= args.k <= MAX_K:
        fail(f"--tokens {args.tokens} / --repeats {args.repeats} / --k {args.k}: at least 2 "
             f"tokens, 1 to 8 repeats, K in [1, {MAX_K}]")
    if args.draft and not os.path.isfile(args.draft):
        fail(f"--draft {args.draft}: no such file")
    facts = model_facts(args.model, args.popularity)
    recorder = Recorder("spec", facts, args.out)   # a tree no commit names is refused up front
    vocab = facts["vocab"]
    # prompts of their own (distinct first ids: no request RESUMEs another's prefix)
    plain = [prompt_ids(32, 2 + 61 * rep, vocab) for rep in range(args.repeats)]
    repeating = [repeating_prompt(5 + 61 * rep, vocab) for rep in range(args.repeats)]
    k = ["--spec", str(args.k)]

    ref = run_arm(args, "strata", [], plain, vocab)
    say(ref)
    ref_repeat = run_arm(args, "strata repeating prompt", [], repeating, vocab)
    say(ref_repeat)
    arms = [ref, ref_repeat]
    arms.append(against(run_arm(args, "strata self-draft", [*k, "--draft-model", args.model],
                                plain, vocab), ref))
    say(arms[-1])
    if args.draft:
        quant = against(run_arm(args, "strata quantized draft",
                                [*k, "--draft-model", args.draft], plain, vocab), ref)
        quant["draft_model"] = record_model(model_facts(args.draft, args.popularity))
        arms.append(quant)
        say(quant)
    arms.append(against(run_arm(args, "strata ngram", [*k, "--draft", "ngram"], repeating,
                                vocab), ref_repeat))
    say(arms[-1])
    for arm in arms:
        arm.pop("_tokens")
    path = recorder.save(arms)
    print(f"record: {path}")
    return 0 if all(a.get("tokens_identical_to_k0", True) for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
