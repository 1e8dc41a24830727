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
- `strata ngram`: `--spec K --draft ngram` on the repeating prompts;
- `strata mtp` (with --mtp): `--spec K --draft mtp`, the file's own multi-token-prediction block
  drafting (a qwen3next file with one, as `strata-dist synth --mtp` writes; a file without one is
  refused before anything runs), on the measured prompts.
Each speculative arm records its tok/s, the drafts made and accepted (the line protocol's STATS
drafted=/accepted=), K, its ratio to the K = 0 arm of its prompts, and whether its greedy tokens
are those of that arm (they must be). Synthetic weights cannot show a real model's acceptance:
the record states what was accepted, nothing more. The record of ../shared/RECORDS.md goes to
benchmarks/results/spec-<like>-<quant>-<date>-<HHMMSS>-<commit>.json.
Each arm carries the planner's prediction beside what it measured (`predicted`: strata-launch
--plan-only --json of its launch; a speculative arm's tok/s at the acceptance it measured, under
the planner's i.i.d. acceptance model, strata_dist/plan/speculation.py).
With --llama-speculative (and --draft), the `llama.cpp` arm: llama.cpp's `llama-speculative` on
the same pair of files (target, draft), greedy (--temp 0), --spec-draft-n-max K, --tokens new
tokens, once per measured prompt, given as text: the measured prompts are then their ids' text
tokenized again (for every arm), which llama.cpp reads as the same tokens (the arm says whether
its counts agree). Its printed "decoded N tokens in T seconds, speed: X t/s" (median) and
n_drafted / n_accept (summed) make the arm.
The anchor build makes llama-bench; must_show.sh's spec part builds llama-speculative after it.

    python benchmarks/bench_spec.py --model q30-q8_0.gguf --draft q30-q2_k.gguf --gpus 0
    python benchmarks/bench_spec.py --model q30.gguf --gpus 0,0 --k 4
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    strata-dist synth tiny-q2.gguf --like tiny --quant q2_k --popularity zipf:1.0 --quiet
    python benchmarks/bench_spec.py --model tiny.gguf --draft tiny-q2.gguf --cpu --tokens 16 \\
        --repeats 1     # the harness, no GPU
    python benchmarks/bench_spec.py --model q30-q8_0.gguf --draft q30-q2_k.gguf --gpus 0 \\
        --llama-speculative .anchor/llama.cpp/build/bin/llama-speculative
    python benchmarks/bench_spec.py --model next-mtp.gguf --mtp --gpus 0
    strata-dist synth tiny-next-mtp.gguf --like tiny-next --quant q8_0 --popularity zipf:1.0 \\
        --mtp --quiet
    python benchmarks/bench_spec.py --model tiny-next-mtp.gguf --mtp --cpu --tokens 16 \\
        --repeats 1     # the MTP arm's harness, no GPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, ".."))   # strata_dist, where no installed one comes first

from records import (PeakMemory, env_prefix, fail, measured,  # noqa: E402
                     model_facts, prompt_ids, record_model, serve_session, Recorder)
from llama_runs import llama_build, llama_wait  # noqa: E402
from strata_dist.plan.speculation import spec_tok_s  # noqa: E402

MAX_K = 7   # --spec's bound (strata_dist/sampling/speculative.py MAX_SPEC)


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


def predicted(args, spec: list[str]) -> dict:
    """The planner's prediction of an arm's launch (strata-launch --plan-only --json): K = 0's
    decode tok/s, and with --spec the window's and drafting's ms and tok/s at the acceptance
    rates it prints."""
    cmd = [sys.executable, "-m", "launcher.cli", "--model", args.model, *launch_args(args), *spec,
           "--plan-only", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        fail(f"the plan of {' '.join(spec) or 'K = 0'}: {done.stderr.strip()[-800:]}")
    plan = json.loads(done.stdout)
    out = {"k0_tok_s": round(1000.0 / plan["predicted_ms_per_token"], 2)}
    if "speculation" in plan:
        out.update(plan["speculation"])
    return out


def with_prediction(arm: dict, prediction: dict) -> dict:
    """The prediction beside the arm's measure: a speculative arm's tok/s at the acceptance it
    measured too (the i.i.d. acceptance model, strata_dist/plan/speculation.py)."""
    arm["predicted"] = prediction
    if "window_ms" in prediction and arm.get("acceptance") is not None:
        prediction["tok_s_at_measured_acceptance"] = round(spec_tok_s(
            arm["acceptance"], arm["k"], prediction["window_ms"], prediction["drafter_ms"]), 2)
    return arm


# llama-speculative's summary lines (examples/speculative in llama.cpp), after its log prefix
DECODED = re.compile(r"decoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds,\s+"
                     r"speed:\s+([\d.]+)\s+t/s")
ENCODED = re.compile(r"encoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds")
COUNTS = {key: re.compile(rf"(?:^|\s){key}\s*=\s*([\d.]+)(%?)\s*$", re.M)
          for key in ("n_draft", "n_predict", "n_drafted", "n_accept", "accept")}


def parse_speculative(text: str) -> dict:
    """llama-speculative's printed summary: tokens decoded, seconds and t/s, prompt tokens, K
    (n_draft), tokens drafted and accepted, and acceptance (its percent as a fraction); {} where
    it printed no "decoded" line."""
    m = DECODED.search(text)
    if m is None:
        return {}
    out = {"decoded": int(m.group(1)), "decode_s": float(m.group(2)), "tok_s": float(m.group(3))}
    e = ENCODED.search(text)
    if e is not None:
        out["prompt_tokens"] = int(e.group(1))
    for key, pattern in COUNTS.items():
        got = pattern.search(text)
        if got is not None:
            value = float(got.group(1))
            out[key] = round(value / 100, 6) if got.group(2) else int(value)
    return out


def llama_arm(args, prompts: list[list[int]]) -> dict:
    """llama.cpp's llama-speculative on --model and --draft, once per prompt (module doc)."""
    from strata_dist.gguf_file.tokenizer import GGUFTokenizer
    llama_wait(args.llama_speculative, args.llama_wait)
    tok = GGUFTokenizer.from_gguf(args.model)
    # a CPU build's repacked kernels may use instructions this host's kernel does not enable
    # (AMX tiles): the dry run reads the weights as stored
    device = ["--no-repack", "-t", str(os.cpu_count() or 1)] if args.cpu else \
        ["-ngl", "99", "-ngld", "99"]
    runs, commands = [], []
    with PeakMemory() as mem:
        for i, ids in enumerate(prompts):
            cmd = [args.llama_speculative, "-m", args.model, "-md", args.draft, *device,
                   "-c", str(args.context), "-n", str(args.tokens), "--temp", "0", "-s", "1",
                   "--spec-draft-n-max", str(args.k), "-p", tok.decode(ids)]
            commands.append(cmd)
            print("llama.cpp:", " ".join(cmd[:-2]), "-p <prompt>", flush=True)
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                                      timeout=1800)
            except subprocess.TimeoutExpired:
                fail(f"llama-speculative on prompt {i + 1} did not end within 1800 s")
            got = parse_speculative(done.stdout + "\n" + done.stderr)
            if done.returncode != 0 or not got:
                fail(f"llama-speculative exited {done.returncode} printing no summary: "
                     f"{(done.stdout + done.stderr)[-1200:]}")
            runs.append(got)
    drafted = sum(r.get("n_drafted", 0) for r in runs)
    accepted = sum(r.get("n_accept", 0) for r in runs)
    return {"name": "llama.cpp", "gpus": 0 if args.cpu else 1,
            "command": " ".join(["llama-speculative", *commands[0][1:-2], "-p", "PROMPT"]),
            "build": llama_build(args.llama_speculative), "k": args.k,
            "decode_tok_s": statistics.median(r["tok_s"] for r in runs),
            # -n asked; it decodes past it where a window's last accepted drafts overshoot
            "new_tokens": args.tokens, "decoded_each": [r["decoded"] for r in runs],
            "tps_each": {"decode": [r["tok_s"] for r in runs]},
            "prompt_tokens_each": [r.get("prompt_tokens") for r in runs],
            "prompt_basis": "the text of each measured prompt's ids, as the strata arms read it "
                            "(tokenized again here), tokenized by llama.cpp",
            "prompt_tokens_as_strata": [r.get("prompt_tokens") for r in runs]
            == [len(p) for p in prompts],
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "acceptance_each": [r.get("accept") for r in runs],
            "draft_model": record_model(model_facts(args.draft, args.popularity)),
            "peak_gib": round(mem.gib, 2)}


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
    ap.add_argument("--mtp", action="store_true",
                    help="one more arm: --draft mtp, the file's multi-token-prediction block")
    ap.add_argument("--k", type=int, default=4, help="--spec K of the speculative arms (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per measured request")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured requests per arm, each on a prompt of its own (median)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--context", type=int, default=1024, help="--max-context")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (the harness, no GPU)")
    ap.add_argument("--llama-speculative", default="",
                    help="path of llama.cpp's llama-speculative: its arm on --model and --draft")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-speculative to appear (a build in the "
                         "background)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.tokens < 2 or not 1 <= args.repeats <= 8 or not 1 <= args.k <= MAX_K:
        fail(f"--tokens {args.tokens} / --repeats {args.repeats} / --k {args.k}: at least 2 "
             f"tokens, 1 to 8 repeats, K in [1, {MAX_K}]")
    if args.draft and not os.path.isfile(args.draft):
        fail(f"--draft {args.draft}: no such file")
    if args.llama_speculative and not args.draft:
        fail(f"--llama-speculative {args.llama_speculative}: llama.cpp drafts with a draft file: "
             "give --draft")
    if args.llama_speculative and args.llama_wait <= 0 and not os.access(args.llama_speculative,
                                                                          os.X_OK):
        fail(f"--llama-speculative {args.llama_speculative}: not an executable file")
    if args.mtp:
        from strata_dist.sampling.mtp_draft import MtpError, mtp_layer
        try:
            mtp_layer(args.model)       # the block the drafter runs, else refused before any arm
        except (MtpError, ValueError) as e:
            fail(f"--mtp: {str(e).removeprefix('--draft mtp: ')}")
    facts = model_facts(args.model, args.popularity)
    recorder = Recorder("spec", facts, args.out)   # a tree no commit names is refused up front
    vocab = facts["vocab"]
    # prompts of their own (distinct first ids: no request RESUMEs another's prefix)
    plain = [prompt_ids(32, 2 + 61 * rep, vocab) for rep in range(args.repeats)]
    repeating = [repeating_prompt(5 + 61 * rep, vocab) for rep in range(args.repeats)]
    if args.llama_speculative:
        # llama-speculative reads text: every measured prompt becomes its ids' text tokenized
        # again, which is what llama.cpp reads (the arm says whether the counts agree)
        from strata_dist.gguf_file.tokenizer import GGUFTokenizer
        tok = GGUFTokenizer.from_gguf(args.model)
        plain = [tok.encode(tok.decode(p)) for p in plain]
    k = ["--spec", str(args.k)]

    def arm(name: str, spec: list[str], prompts: list[list[int]]) -> dict:
        return with_prediction(run_arm(args, name, spec, prompts, vocab), predicted(args, spec))

    ref = arm("strata", [], plain)
    say(ref)
    ref_repeat = arm("strata repeating prompt", [], repeating)
    say(ref_repeat)
    arms = [ref, ref_repeat]
    arms.append(against(arm("strata self-draft", [*k, "--draft-model", args.model], plain), ref))
    say(arms[-1])
    if args.draft:
        quant = against(arm("strata quantized draft", [*k, "--draft-model", args.draft], plain),
                        ref)
        quant["draft_model"] = record_model(model_facts(args.draft, args.popularity))
        arms.append(quant)
        say(quant)
    arms.append(against(arm("strata ngram", [*k, "--draft", "ngram"], repeating), ref_repeat))
    say(arms[-1])
    if args.mtp:
        arms.append(against(arm("strata mtp", [*k, "--draft", "mtp"], plain), ref))
        say(arms[-1])
    if args.llama_speculative:
        arms.append(llama_arm(args, plain))
        a = arms[-1]
        print(f"llama.cpp llama-speculative: {a['decode_tok_s']:.1f} tok/s decode, K {args.k}: "
              f"{a['accepted']}/{a['drafted']} drafts accepted", flush=True)
    for a in arms:
        a.pop("_tokens", None)
    path = recorder.save(arms)
    print(f"record: {path}")
    return 0 if all(a.get("tokens_identical_to_k0", True) for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
