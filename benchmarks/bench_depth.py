"""Decode tok/s far into a context (`bench: depth`): strata beside llama.cpp's `llama-bench -d`, on
the same file, one arm per engine and depth, in one run.

The strata side is one `strata-launch --serve` (one rank, --gpus or --cpu; `--max-context` the
largest depth plus --tokens unless given; --kv-resident and --kv-type passed through). It reads a
warm-up request (the decode graph is captured there) and a warm-up prompt of every depth (what a
process does once per shape is in no figure), then for each depth D, --repeats requests: a prompt
of D ids of its own (none RESUMEs an earlier prefix; depth 0 is a one-id prompt), then --tokens
new tokens, greedy. Its arm at D says the median decode tok/s (the tokens after the first over the
decode seconds: they are read at positions D+1 .. D+N-1), and for D > 0 the median prompt tok/s
(`prefill_tok_s[D]`: D over the seconds the prompt took), the device's peak memory while that
depth ran and the plan's prediction. A prompt whose greedy tokens hit end of text before --tokens
gives way to the next (llama-bench's tg never stops).

With --llama-bench, llama.cpp reads the same file: for each depth `llama-bench -ngl 99 -fa 1 -p 0
-n N -d D` (one process per depth; its -ub and -b the largest of --ubatches, which only fills the
depth faster: a one-token step reads the same cache), and for each depth of --llama-prompts a
D-token prompt (`-p D -n 0`) tuned over every -ub of --ubatches (-b the largest), its best the
figure, every test kept (`ubatch_sweep`, `sweep`). --kv-type T is `-ctk T -ctv T` there. With
--cpu the llama.cpp side runs with `--repack 0` (a CPU build's repacked kernels may use
instructions this host does not enable). Every arm carries `depth`; the ratios are printed per
depth. A depth past --max-context (or, without it, past the context the file was trained for) is
refused with one error line before anything runs. Each strata arm's greedy tokens (of its first
request) are compared with the latest earlier record of the same file, depth and prompt, in --out
and in benchmarks/results (a run with --kv-resident against one with every cell resident). The
record of ../shared/RECORDS.md goes to
benchmarks/results/depth-<like>-<quant>-<date>-<HHMMSS>-<commit>.json (rewritten after each
engine, so a run cut short keeps what it finished); `--popularity` names the routing law of a
file that does not store it.

    python benchmarks/bench_depth.py --model q30-2507.gguf --gpus 0 \\
        --depths 0,32768,131072 --llama-bench .anchor/llama.cpp/build/bin/llama-bench
    python benchmarks/bench_depth.py --model q30-2507.gguf --gpus 0 --depths 0,131072 \\
        --kv-resident auto --vram-budget 16G --llama-prompts none
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    python benchmarks/bench_depth.py --model tiny.gguf --cpu --depths 0,256,1024 \\
        --tokens 16 --repeats 2 --kv-resident 512     # the harness, no GPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(HERE, ".."))   # strata_dist, where no installed one comes first

from llama_runs import UBATCHES, llama_arm as tuned_llama_arm, llama_sweep, llama_wait  # noqa: E402
from records import (PeakMemory, Recorder, env_prefix, fail, full_decodes,  # noqa: E402
                     median_tps, model_facts, predicted_ms_per_token, prompt_ids,
                     serve_session, tokens_against_records)


class Prompts:
    """Every prompt of the run, each starting at an id no other one starts at (seed stride 61:
    prompt_ids' first id is 7919 x seed modulo a range no multiple of 61 divides), so no request
    RESUMEs a cached prefix. A measured prompt's seed is fixed by its depth's place in --depths and
    its own in the depth's list (not by --repeats): two runs of the same --depths read the same
    first prompt at each depth, so their tokens compare (`prompt_sha256` says which)."""

    PER_DEPTH = 24         # measured prompts a depth may use (3 x --repeats at most)

    def __init__(self, vocab: int):
        self.vocab = vocab

    def _ids(self, n: int, index: int) -> list[int]:
        return prompt_ids(max(n, 1), 2 + 61 * index, self.vocab)

    def warm_up(self, place: int, n: int) -> list[int]:
        return self._ids(n, place)

    def measured(self, place: int, n: int, count: int) -> list[list[int]]:
        return [self._ids(n, 100 + self.PER_DEPTH * place + i) for i in range(count)]


def context_limit(args, trained: int) -> int:
    """The cells the run may use: --max-context where given, else the file's trained context;
    a depth whose prompt and --tokens pass it is refused (one error line)."""
    limit = args.max_context or trained
    for d in args.depths:
        if max(d, 1) + args.tokens > limit:
            said = (f"--max-context {args.max_context}" if args.max_context else
                    f"the {trained} positions {os.path.basename(args.model)} was trained for "
                    f"(give --max-context to go past them)")
            fail(f"--depths {d}: a {max(d, 1)}-id prompt and --tokens {args.tokens} new tokens "
                 f"pass {said}")
    return limit


def launch_flags(args) -> list[str]:
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", args.gpus]
    cells = args.max_context or max(max(d, 1) for d in args.depths) + args.tokens
    flags = [*devices, "--max-context", str(cells), "--no-remote-auto"]
    for flag, value in (("--kv-type", args.kv_type), ("--kv-resident", args.kv_resident),
                        ("--vram-budget", args.vram_budget), ("--prefill", args.prefill)):
        if value:
            flags += [flag, value]
    return flags


def strata_arms(args, vocab: int) -> list[dict]:
    """One launch, every depth: an arm each (module doc)."""
    flags = launch_flags(args)
    command = env_prefix() + "strata-launch --model M " + " ".join(flags) + " --serve"
    predicted = predicted_ms_per_token(os.path.abspath(args.model), flags)   # run from the root
    prompts = Prompts(vocab)
    arms = []
    cards = [] if args.cpu else sorted({int(g) for g in args.gpus.split(",")})
    with PeakMemory(cards or 0) as mem:
        s = serve_session(args.model, *flags, timeout=1800)
        try:
            s.gen(prompts.warm_up(0, 32), 16, timeout=900)      # warm-up: graphs captured
            for place, d in enumerate(args.depths):             # warm-up: each depth's shapes
                if d > 0:
                    s.gen(prompts.warm_up(1 + place, d), 2, timeout=3600)
            for place, d in enumerate(args.depths):
                mem.mark()
                offered = prompts.measured(place, d, 3 * args.repeats)
                runs, skipped = full_decodes(s, offered, args.tokens, args.repeats)
                for r in runs:
                    if int(r["done"][1]) != max(d, 1):
                        fail(f"depth {d}: the launch read {r['done'][1]} prompt ids, not "
                             f"{max(d, 1)}")
                tok_s, each = median_tps(args.tokens - 1, [float(r["done"][3]) for r in runs],
                                         f"a decode at depth {d}")
                arm = {"name": "strata", "gpus": len(cards), "depth": d,
                       "prompt_tokens": max(d, 1), "command": command,
                       "decode_tok_s": tok_s, "new_tokens": min(int(r["done"][0]) for r in runs),
                       "tps_each": {"decode": each}, "decode_prompts_stopped_early": skipped,
                       "max_context": int(flags[flags.index("--max-context") + 1]),
                       "kv_type": args.kv_type or "default",
                       "kv_resident": args.kv_resident or "all",
                       "predicted_ms_per_token": predicted,
                       "measured_ms_per_token": round(1e3 / tok_s, 3),
                       "tokens_sha256": hashlib.sha256(json.dumps(runs[0]["tokens"]).encode())
                       .hexdigest(),
                       # the request the tokens are of: the first prompt offered at this depth
                       "prompt_sha256": hashlib.sha256(json.dumps(offered[0]).encode())
                       .hexdigest()}
                if d > 0:
                    prompt, prompt_each = median_tps(d, [float(r["done"][2]) for r in runs],
                                                     f"the {d}-id prompt")
                    arm["prefill_tok_s"] = {str(d): prompt}
                    arm["tps_each"][str(d)] = prompt_each
                arm["peak_gib"] = round(mem.mark(), 2)
                arms.append(arm)
                print(f"strata depth {d}: {tok_s:.1f} tok/s decode (each {each})"
                      + (f", the {d}-id prompt {arm['prefill_tok_s'][str(d)]:.1f} tok/s"
                         if d > 0 else "") + f", peak {arm['peak_gib']:.1f} GiB", flush=True)
        finally:
            s.close()
    return arms


def llama_arms(args) -> list[dict]:
    """llama-bench at every depth (module doc): an arm per depth, its decode at that depth and,
    for the depths of --llama-prompts, that long a prompt at its best -ub."""
    llama_wait(args.llama_bench, args.llama_wait)
    base = ["-m", args.model, "-ngl", "99", "-fa", "1"]
    if args.kv_type:
        base += ["-ctk", args.kv_type, "-ctv", args.kv_type]
    if args.cpu:
        base += ["--repack", "0"]
    repeats = args.llama_repeats or args.repeats
    prompt_tests = (llama_sweep(args.llama_bench, base, args.llama_prompts, 0, repeats,
                                ubatches=args.ubatches) if args.llama_prompts else [])
    arms = []
    for d in args.depths:
        decode = llama_sweep(args.llama_bench, [*base, "-d", str(d)], [], args.tokens, repeats,
                             ubatches=(max(args.ubatches),))
        prompts = [d] if d in args.llama_prompts else []
        arm = tuned_llama_arm(args.llama_bench, decode + [t for t in prompt_tests
                                                         if t["n_prompt"] in prompts],
                              prompts, args.tokens)
        arm.update(depth=d, gpus=0 if args.cpu else 1, command=arm["decode_best"]["command"])
        if prompts:
            arm["prompt_command"] = arm["best"][str(d)]["command"]
        arms.append(arm)
        print(f"llama.cpp depth {d}: {arm['decode_tok_s']:.1f} tok/s decode"
              + (f", the {d}-token prompt {arm['prefill_tok_s'][str(d)]:.1f} tok/s (best -ub "
                 f"{arm['best'][str(d)]['ubatch']})" if prompts else ""), flush=True)
    return arms


def numbers(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x != ""]
    except ValueError:
        fail(f"{flag} {text}: comma-separated whole numbers")
    if not values or min(values) < 0 or len(set(values)) != len(values):
        fail(f"{flag} {text}: distinct numbers >= 0")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="0,32768,131072",
                    help="the prompt lengths decode is measured after (llama-bench -d)")
    ap.add_argument("--tokens", type=int, default=128,
                    help="new tokens per measured request (llama-bench -n the same)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured requests per depth (the median is the figure)")
    ap.add_argument("--gpus", default="0", help="the card of the one strata rank")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--max-context", type=int, default=0,
                    help="strata's --max-context (default: the largest depth + --tokens, within "
                         "the file's trained context); a depth past it is refused")
    ap.add_argument("--kv-type", default="", help="strata --kv-type; llama.cpp -ctk/-ctv the same")
    ap.add_argument("--kv-resident", default="", metavar="N|auto",
                    help="strata --kv-resident (default: every cell resident)")
    ap.add_argument("--vram-budget", default="", help="strata --vram-budget of the rank")
    ap.add_argument("--prefill", default="", help="strata --prefill (default auto)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--llama-prompts", default="",
                    help="depths whose prompt llama.cpp reads too, tuned over --ubatches "
                         "(default: the largest depth; none: no prompt figure)")
    ap.add_argument("--ubatches", default=",".join(map(str, UBATCHES)),
                    help="llama.cpp: the micro-batches (-ub) its prompts are swept over")
    ap.add_argument("--llama-repeats", type=int, default=0,
                    help="llama-bench -r (default --repeats)")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-bench to appear (a build in the background)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    args.depths = numbers(args.depths, "--depths")
    args.ubatches = numbers(args.ubatches, "--ubatches")
    if min(args.ubatches) < 1:
        fail(f"--ubatches {args.ubatches}: each at least 1")
    if args.llama_prompts == "none":
        args.llama_prompts = []
    elif args.llama_prompts:
        args.llama_prompts = numbers(args.llama_prompts, "--llama-prompts")
        outside = [d for d in args.llama_prompts if d not in args.depths or d == 0]
        if outside:
            fail(f"--llama-prompts {outside[0]}: not a depth > 0 of --depths {args.depths}")
    else:
        args.llama_prompts = [max(args.depths)] if max(args.depths) > 0 else []
    if len(args.depths) > 16:
        fail(f"--depths {args.depths}: at most 16 depths a run")
    if args.tokens < 2 or not 1 <= args.repeats <= 8 or args.llama_repeats < 0:
        fail(f"--tokens {args.tokens} / --repeats {args.repeats} / --llama-repeats "
             f"{args.llama_repeats}: at least 2 tokens, 1 to 8 repeats")
    if args.max_context < 0:
        fail(f"--max-context {args.max_context}: a number of cells > 0")
    if args.llama_bench and args.llama_wait <= 0 and not os.access(args.llama_bench, os.X_OK):
        fail(f"--llama-bench {args.llama_bench}: not an executable file")
    facts = model_facts(args.model, args.popularity)
    from strata_dist.models import architecture_for, open_checked
    gguf = open_checked(args.model)
    context_limit(args, architecture_for(gguf).read_geometry(gguf).trained_context)
    recorder = Recorder("depth", facts, args.out)    # a tree no commit names: refused now
    arms = strata_arms(args, facts["vocab"])
    # the tokens against the latest earlier record of this file and depth: in --out (an earlier
    # part of the same call) and in benchmarks/results (the records kept), e.g. a run with
    # --kv-resident against one with every cell resident
    folders = dict.fromkeys((os.path.abspath(args.out), os.path.join(HERE, "results")))
    for arm in arms:
        said = [tokens_against_records("depth", facts, "strata", arm["tokens_sha256"], folder,
                                       like={"depth": arm["depth"],
                                             "prompt_sha256": arm["prompt_sha256"]})
                for folder in folders]
        found = [line for line in said if "no earlier record" not in line]
        print("\n".join(found or said[:1]), flush=True)
    recorder.save(arms)
    if args.llama_bench:
        theirs = llama_arms(args)
        for ours, ll in zip(list(arms), theirs):      # the same depths, in the same order
            arms.append(ll)
            line = f"depth {ours['depth']}: decode {ours['decode_tok_s'] / ll['decode_tok_s']:.2f}x"
            d = str(ours["depth"])
            if d in ll.get("prefill_tok_s", {}):
                line += (f", the {d}-token prompt "
                         f"{ours['prefill_tok_s'][d] / ll['prefill_tok_s'][d]:.2f}x")
            print(f"strata / llama.cpp, {line}", flush=True)
    print(f"record: {recorder.save(arms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
