"""Prefill tok/s with prompt loans on and off, beside llama.cpp's, side by side in one run.

Each arm launches strata-dist on one GPU with the same VRAM budget (`--vram-budget`), reads a
warm-up prompt of each length, then --repeats prompts of each length (one new token each) and
prints the median prompt tok/s (every repeat kept in the record's `tps_each`; the repeats are read
back to back after the warm-up, so each carries the refill of the loan the prompt before it
borrowed: a stage refills after the last chunk, on its stream, after the prompt's figure is taken;
a repeat that RESUMEs a cached prefix is refused), the stage cache (expert slots), how the chunk's
experts were computed, the loan's peak and overflow, and the device's peak memory in use (NVML,
sampled every 20 ms). With --llama-bench the same file is read by llama.cpp's llama-bench with
`-ncmoe N` (the experts of the first N layers stay in host memory), tuned: every `-ub` of
--ubatches (512, 1024, 2048, 4096; `-b` the largest), and where N > 0 with the weights both mmap'd
and read into memory (`-mmp 0`, or `-lm none` where the build's --load-mode replaced it); its best
per prompt length is the arm's figure and the ratio printed, every test kept (`ubatch_sweep`,
`sweep`). With --profile-prompts N a routing profile is recorded first on N prompts of 512 ids
drawn apart from every measured prompt (checked), and the plans rank experts by it (a budget that
holds part of the experts). The strata arms run the GPU defaults: the row kernels of
ops/moe.py, kernels/prefill_attention.cu, each chunk routed and grouped on the
device. With --host-routing one more arm routes on the host
(STRATA_DEVICE_ROUTING=0), with --general-path one more takes the general path
(STRATA_GROUPED_EXPERTS=0 STRATA_FLASH_PREFILL=0: per-expert dequantize and GEMMs), with
--array-prompt-steps one more runs a chunk's RMSNorms, q/k norm + RoPE + K/V write and expert
combine as array operations (STRATA_FUSED_PROMPT_OPS=0) instead of kernels/prompt_ops.cu's.
With --two-stages 0,1 one more arm runs two stage ranks, one a card (each at --budget): the
head sends every chunk at once, so stage 0 reads chunk c+1 while stage 1 reads chunk c; its first
new tokens are compared with the one-card arm's (`tokens_identical_to_1gpu`). `0,0` puts both
stages on one card (the pipeline's tokens and overhead, not its speed-up; the two budgets must
fit on it together, e.g. 60G on an H200, or strata-launch refuses them).
With --tree-arm TARBALL (`git archive <commit> | xz`) one more arm runs the first arm's launch
with that older tree's code (benchmarks/tree_arm.py): its commit (`tree_commit`), figures and
first tokens against the first arm's in the same record, and "strata (this tree) / strata
<commit>" printed for each prompt length.
The record of ../shared/RECORDS.md goes to
benchmarks/results/prefill-<like>-<quant>-<date>-<HHMMSS>-<commit>.json (rewritten after each arm,
so a run cut short keeps the arms it finished); `--popularity` names the routing law of a file that
does not store it.

    python benchmarks/bench_prefill.py --model q30.gguf --budget 21G --prompts 4096,16384 \\
        --chunk 4096 --llama-bench .anchor/llama.cpp/build/bin/llama-bench --ncmoe 24 \\
        --profile-prompts 8
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    python benchmarks/bench_prefill.py --model tiny.gguf --cpu --budget 400M --prompts 256 --chunk 64
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama_runs import (llama_arm as tuned_llama_arm, llama_mmap_flags,  # noqa: E402
                        llama_sweep, llama_wait)
from records import (PeakMemory, Recorder, env_prefix, fail, measured,  # noqa: E402
                     median_tps, model_facts, prompt_ids, record_profile, serve_session)
from tree_arm import OlderTree, compare_tokens  # noqa: E402

PROMPT_TIMING = ("median of --repeats prompts read back to back after a warm-up of the same "
                 "length: each carries the refill of the loan before it")


def warm_up_prompt(n: int, vocab: int) -> list[int]:
    return prompt_ids(n, 7 * n + 1, vocab)


def repeat_prompt(n: int, rep: int, vocab: int) -> list[int]:
    return prompt_ids(n, n + 104_729 * rep, vocab)


def measured_prompts(args, vocab: int) -> list[list[int]]:
    """Every prompt the arms read: the warm-ups and the measured repeats."""
    return [p for n in args.prompts
            for p in [warm_up_prompt(n, vocab)] + [repeat_prompt(n, rep, vocab)
                                                  for rep in range(args.repeats)]]


def strata_arm(args, loans: bool, env: dict | None = None, devices: list[str] | None = None,
               split: list[str] = (), tree: OlderTree | None = None) -> dict:
    """One launch reading every prompt length (a warm-up of each first): one GPU by default,
    `devices` and `split` for stages on several ranks; `tree`: run by that older tree's code
    (--tree-arm). Records the first new token of every prompt (the tokens the arms compare)."""
    devices = devices or (["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"])
    extra = [*split] + ([] if loans else ["--no-prompt-loans"])
    ctx = max(args.prompts) + 64
    from strata_dist.gguf_file.reader import GGUFModel
    vocab = int(GGUFModel(args.model).tensor("token_embd.weight").shape[0])
    flags = [*devices, "--vram-budget", args.budget, "--max-context", str(ctx), "--prefill",
             str(args.chunk), "--no-remote-auto", *extra,
             *(["--expert-profile", args.profile] if args.profile else [])]
    cards = [] if args.cpu else sorted({int(g) for g in devices[1].split(",")})
    with PeakMemory(cards or 0) as mem:
        s = serve_session(args.model, *flags, timeout=900, cwd=tree.dir if tree else None,
                          env={**(env or {}), **(tree.env() if tree else {})} or None)
        try:
            info = s.info_fields()[0]
            stage = next(f for f in s.info_fields() if "rank" in f)
            # warm-up: a prompt of every measured length first, so no figure carries what a
            # process does once per shape (kernel loads, the pool's first growth to that size)
            for n in args.prompts:
                s.gen(warm_up_prompt(n, vocab), 1, timeout=900)
            out = {"slots": info["expert_slots"], "loan_mib": stage.get("loan_mib", "0"), "runs": {},
                   "command": env_prefix(env) + "strata-launch --model M " + " ".join(flags)
                   + " --serve", "cards": len(cards), "tokens": []}
            for n in args.prompts:
                # --repeats prompts of their own (no prefix in common with the last one: the
                # whole is read each time); the median, since one short prompt is noisy
                times, stats = [], []
                for rep in range(args.repeats):
                    r = measured(s.gen(repeat_prompt(n, rep, vocab), 1, "stats=1",
                                       timeout=900), f"the {n}-token prompt {rep + 1}")
                    times.append(float(r["done"][2]))
                    out["tokens"] += r["tokens"]
                    stats.append(r["stats"][0] if r["stats"] else {})
                tps, each = median_tps(n, times)
                st = stats[min(range(len(each)), key=lambda i: abs(each[i] - tps))]
                st["loan_peak_bytes"] = next(iter(s.stats().values())).get("loan_peak_bytes", 0)
                out["runs"][n] = {"tps": tps, "stats": st, "tps_each": each}
        finally:
            s.close()
    out["peak_gib"] = mem.gib
    return out


def llama_arm(args) -> dict:
    """llama.cpp tuned: every -ub of --ubatches, and with experts in host memory (-ncmoe > 0)
    the weights mmap'd and not; each prompt length at its best."""
    llama_wait(args.llama_bench, args.llama_wait)
    base = ["-m", args.model, "-ngl", "99", "-fa", "1", "-ncmoe", str(args.ncmoe)]
    mmap = llama_mmap_flags(args.llama_bench) if args.ncmoe > 0 else None
    tests = llama_sweep(args.llama_bench, base, args.prompts, 0,
                        args.llama_repeats or args.repeats, mmap, args.ubatches)
    arm = tuned_llama_arm(args.llama_bench, tests, args.prompts, 0)
    arm["runs"] = {n: {"tps": arm["prefill_tok_s"][str(n)], "tps_each": arm["tps_each"][str(n)]}
                   for n in args.prompts}
    return arm


ARM_NAMES = {"loans on": "strata", "loans off": "strata loans off",
             "host routing": "strata host routing", "general path": "strata general path",
             "array steps": "strata array prompt steps", "llama.cpp": "llama.cpp"}


def arm_name(key: str, r: dict) -> str:
    """The record's name of an arm: two stages on two cards are `strata` with gpus 2, as
    ../RECORDS.md names them; two stages sharing one card are a variant of the one-card arm; the
    older tree's arm is `strata <its short commit>`."""
    if key == "tree arm":
        return r["tree"].fields()["name"]
    if key != "two stages":
        return ARM_NAMES[key]
    return "strata" if r["cards"] > 1 else "strata two stages"


def save(args, recorder: Recorder, results: dict) -> str:
    """The record of the arms measured so far (rewritten after each, so a run cut short by a
    time limit still leaves the arms it finished)."""
    arms = []
    for k, r in results.items():
        if k == "llama.cpp":
            arms.append({key: v for key, v in r.items() if key != "runs"})
            continue
        arm = {"name": arm_name(k, r), "gpus": r.get("cards", 1), "command": r["command"],
               "prefill_tok_s": {str(n): round(run["tps"], 1) for n, run in r["runs"].items()},
               "tps_each": {str(n): run["tps_each"] for n, run in r["runs"].items()},
               "new_tokens": 1, "prompt_timing": PROMPT_TIMING,
               "peak_gib": round(r["peak_gib"], 2), "vram_budget": args.budget}
        if k == "two stages" and "loans on" in results:
            arm["tokens_identical_to_1gpu"] = r["tokens"] == results["loans on"]["tokens"]
        if k == "tree arm":
            arm.update(r["tree"].fields())
            compare_tokens(arm, r["tokens"], results["loans on"]["tokens"])
        arms.append(arm)
    return recorder.save(arms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", required=True, help="the stage's VRAM budget (e.g. 21G)")
    ap.add_argument("--prompts", default="4096,16384")
    ap.add_argument("--chunk", type=int, default=4096, help="the prompt chunk of both arms")
    ap.add_argument("--cpu", action="store_true", help="a CPU rank (no GPU needed)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--ncmoe", type=int, default=24, help="llama.cpp: layers whose experts stay on the CPU")
    ap.add_argument("--repeats", type=int, default=3,
                    help="prompts of each length an arm reads (the median is reported)")
    ap.add_argument("--ubatches", default="512,1024,2048,4096",
                    help="llama.cpp: the micro-batches (-ub) swept; its best is the figure")
    ap.add_argument("--llama-repeats", type=int, default=0,
                    help="llama-bench -r (default --repeats; its sweep runs every test that often)")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-bench to appear (a build in the background)")
    ap.add_argument("--profile-prompts", type=int, default=0,
                    help="512-id prompts a routing profile is recorded on first (0: none, the "
                         "plan ranks experts uniformly)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--only-loans-on", action="store_true",
                    help="no loans-off arm (a stage whose cache holds every pair lends nothing)")
    ap.add_argument("--host-routing", action="store_true",
                    help="one more arm: loans on, STRATA_DEVICE_ROUTING=0")
    ap.add_argument("--general-path", action="store_true",
                    help="one more arm: loans on, STRATA_GROUPED_EXPERTS=0 STRATA_FLASH_PREFILL=0")
    ap.add_argument("--array-prompt-steps", action="store_true",
                    help="one more arm: loans on, STRATA_FUSED_PROMPT_OPS=0")
    ap.add_argument("--two-stages", default="", metavar="GPUS",
                    help="one more arm: two stage ranks on these cards (0,1; 0,0 shares one card), "
                         "each at --budget, chunks pipelined through them; its first tokens are "
                         "compared with the one-card arm's")
    ap.add_argument("--two-stage-split", default="auto",
                    help="the two-stage arm's --layer-split (default auto)")
    ap.add_argument("--tree-arm", default="", metavar="TARBALL",
                    help="one more arm, run exactly as the first (loans on) by an older tree of "
                         "this project: TARBALL is `git archive <commit>` (plain or | xz), whose "
                         "commit the arm names (tree_commit); its first tokens are compared with "
                         "the first arm's")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    args = ap.parse_args()
    try:
        args.prompts = [int(x) for x in args.prompts.split(",")]
        args.ubatches = [int(x) for x in args.ubatches.split(",")]
    except ValueError:
        fail(f"--prompts {args.prompts} / --ubatches {args.ubatches}: comma-separated numbers")
    if min(args.prompts) < 1 or args.repeats < 1 or args.chunk < 1:
        fail(f"--prompts {args.prompts}, --repeats {args.repeats}, --chunk {args.chunk}: each "
             f"at least 1")
    results, facts = {}, model_facts(args.model, args.popularity)
    # the older tree unpacked (its commit read) before anything is measured: a tarball naming no
    # commit is refused now
    older = OlderTree(args.tree_arm) if args.tree_arm else None
    recorder = Recorder("prefill", facts, args.out)     # a tree no commit names: refused now
    args.profile = ""
    if args.profile_prompts > 0:
        args.profile = os.path.join(tempfile.mkdtemp(prefix="prefill-"), "profile.json")
        record_profile(args.model, args.profile_prompts, facts["vocab"], args.profile,
                       "cpu" if args.cpu else "cuda:0", measured_prompts(args, facts["vocab"]))
    variants = [("loans on", True, None)] + ([] if args.only_loans_on
                                             else [("loans off", False, None)])
    if args.host_routing:
        variants.append(("host routing", True, {"STRATA_DEVICE_ROUTING": "0"}))
    if args.general_path:
        variants.append(("general path", True, {"STRATA_GROUPED_EXPERTS": "0",
                                                "STRATA_FLASH_PREFILL": "0"}))
    if args.array_prompt_steps:
        variants.append(("array steps", True, {"STRATA_FUSED_PROMPT_OPS": "0"}))
    if args.two_stages:
        variants.append(("two stages", True, None))
    if older is not None:
        variants.append(("tree arm", True, None))     # the first arm's launch, the older code
    for name, loans, env in variants:
        t0 = time.perf_counter()
        two = (["--cpu-ranks", "2"] if args.cpu else ["--gpus", args.two_stages])
        if name == "two stages":
            r = strata_arm(args, loans, env, two, ["--layer-split", args.two_stage_split])
        else:
            r = strata_arm(args, loans, env, tree=older if name == "tree arm" else None)
        results[name] = r
        if name == "tree arm":
            r["tree"] = older
        print(f"{name:9s}: expert_slots={r['slots']} loan={r['loan_mib']} MiB peak device memory "
              f"{r['peak_gib']:.1f} GiB ({time.perf_counter() - t0:.0f} s)", flush=True)
        for n, run in r["runs"].items():
            st = run["stats"]
            tiers = {k: int(st.get(k, 0)) for k in ("hits", "host")}
            total = max(1, sum(tiers.values()))
            print(f"  {n:6d} tokens: {run['tps']:8.1f} tok/s prefill (each {run['tps_each']}); "
                  f"hits {tiers['hits'] / total:.1%}, "
                  f"streamed {st.get('streamed', 0)} blobs, "
                  f"{st.get('prompt_layers_on_device', 0)} layers grouped on the device, loan peak "
                  f"{int(st.get('loan_peak_bytes', 0)) / 2**20:.0f} MiB, overflow "
                  f"{int(st.get('loan_overflow_bytes', 0)) / 2**20:.0f} MiB", flush=True)
        save(args, recorder, results)
    if args.llama_bench:
        r = results["llama.cpp"] = llama_arm(args)
        save(args, recorder, results)
        print(f"llama.cpp {r['build']} -ncmoe {args.ncmoe}: peak device memory "
              f"{r['peak_gib']:.1f} GiB; -ub sweep {r['ubatch_sweep']}")
        for n, run in r["runs"].items():
            print(f"  {n:6d} tokens: {run['tps']:8.1f} tok/s prefill (best: "
                  f"{r['best'][str(n)]})")
    for n in args.prompts:
        on = results["loans on"]["runs"][n]["tps"]
        parts = []
        if "loans off" in results:
            parts.append(f"loans on / off {on / results['loans off']['runs'][n]['tps']:.2f}x")
        for arm in ("host routing", "general path", "array steps", "two stages"):
            if arm in results:
                parts.append(f"{arm} / loans on {results[arm]['runs'][n]['tps'] / on:.2f}x")
        if "tree arm" in results:
            parts.append(older.ratio_line(on, results["tree arm"]["runs"][n]["tps"]))
        if "llama.cpp" in results and n in results["llama.cpp"]["runs"]:
            theirs = results["llama.cpp"]["runs"][n]["tps"]
            for arm in ("loans on", "loans off", "host routing", "general path", "array steps",
                        "two stages"):
                if arm in results:
                    parts.append(f"{arm} / llama.cpp {results[arm]['runs'][n]['tps'] / theirs:.2f}x")
        print(f"{n:6d} tokens: " + "; ".join(parts))
    if "two stages" in results:
        same = results["two stages"]["tokens"] == results["loans on"]["tokens"]
        print(f"two stages: first tokens {'identical to' if same else 'DIFFER from'} one card's")
    if "tree arm" in results:
        same = results["tree arm"]["tokens"] == results["loans on"]["tokens"]
        print(f"tree {older.commit}: first tokens "
              f"{'identical to' if same else 'DIFFER from'} this tree's")
    print(f"record: {save(args, recorder, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
