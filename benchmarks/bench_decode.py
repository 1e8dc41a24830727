"""Decode tok/s of strata-dist beside llama.cpp's, on the same file, side by side in one run.

Each strata arm launches `strata-launch --serve` (one rank per listed GPU), reads a warm-up request
(the decode graph is captured there), then --repeats greedy requests of --tokens new tokens each,
every one after a prompt of its own (a request that RESUMEs a cached prefix is refused), and prints
the median decode tok/s (tokens after the first / decode seconds; every repeat is kept in
`tps_each`), the share of steps that ran as a device graph, and the device's peak memory. A prompt
whose greedy tokens hit end of text before --tokens gives way to the next (llama-bench's tg never
stops): the record's `new_tokens` is what each measured request generated. With two GPUs it also
checks the tokens against the one-GPU arm and measures the hand-off of one decode row between the
two cards (bench_transport.py's median). With --llama-bench, llama.cpp's `llama-bench -ngl 99 -fa 1
-p 0 -n N` reads the same file (its version string and every flag recorded) and the ratio is
printed. With --unsplit WHOLE (--model a split file's first shard, WHOLE the same file in one
piece) one strata launch on WHOLE reads one request first, and the strata arm says whether the
split file's greedy tokens are its own (`tokens_identical_to_unsplit`). With --tree-arm TARBALL
(`git archive <commit> | xz`) one more arm runs the first arm's launch with that older tree's
code (benchmarks/tree_arm.py): its commit (`tree_commit`), tok/s and tokens against the first
arm's in the same record, and "strata (this tree) / strata <commit>" printed. With --nvrtc-arm one
more arm's rank compiles every kernel with CuPy's NVRTC into an empty kernel cache, where the first
arm loads kernels/prebuild.py's nvcc binaries when $STRATA_KERNEL_CUBINS names them: the same
sources built by the two compilers, in one record (each strata arm says `kernels_built_by`). The record of
../shared/RECORDS.md goes to
benchmarks/results/decode-<like>-<quant>-<date>-<HHMMSS>-<commit>.json (records.py computes the
commit). `--popularity` names the routing law of a file that does not store it (a synthetic file
does).

    python benchmarks/bench_decode.py --model q30.gguf --gpus 0 \\
        --llama-bench .anchor/llama.cpp/build/bin/llama-bench
    python benchmarks/bench_decode.py --model q30.gguf --gpus 0,1 --split 24
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    git archive 1234abc | xz > /tmp/before.tar.xz
    python benchmarks/bench_decode.py --model q30.gguf --gpus 0 --tree-arm /tmp/before.tar.xz
    python benchmarks/bench_decode.py --model tiny.gguf --cpu --tokens 16     # the harness, no GPU
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from llama_runs import llama_arm as tuned_llama_arm, llama_sweep, llama_wait  # noqa: E402
from records import (ROOT, CUBINS_ENV, PeakMemory, env_prefix, fail, full_decodes,  # noqa: E402
                     kernels_built_by,
                     median_tps, model_facts, predicted_ms_per_token, prompt_ids, serve_session,
                     tokens_against_records, Recorder)
from tree_arm import OlderTree, compare_tokens, tokens_said  # noqa: E402


def strata_arm(args, gpus: str, split: str, vocab: int, model: str = "",
               repeats: int = 0, kernel_shape: str | None = None,
               tree: OlderTree | None = None, nvrtc: bool = False) -> dict:
    """One strata launch on `model` (default --model) reading `repeats` (default --repeats)
    measured requests; its first request's tokens kept (`_tokens`, `tokens_sha256`).
    `kernel_shape` (not None): the launch's STRATA_KERNEL_SHAPE, whatever this process's is.
    `tree`: the launch runs that older tree's code (--tree-arm). `nvrtc`: the launch compiles
    every kernel with CuPy's NVRTC into an empty kernel cache (no prebuilt binaries), as a
    machine nobody prebuilt for does (--nvrtc-arm)."""
    env = None if kernel_shape is None else {"STRATA_KERNEL_SHAPE": kernel_shape}
    built_by = None if args.cpu else kernels_built_by(nvrtc, kernel_shape)
    if nvrtc:
        cache = tempfile.mkdtemp(prefix="strata-nvrtc-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        env = {**(env or {}), CUBINS_ENV: "", "CUPY_CACHE_DIR": cache}
    cwd = None if tree is None else tree.dir
    model, repeats = model or args.model, repeats or args.repeats
    devices = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", gpus]
    cmd = ["--layer-split", split, "--max-context", str(args.context), "--no-remote-auto"]
    n_gpus = len(gpus.split(","))
    with PeakMemory() as mem:
        s = serve_session(model, *devices, *cmd, timeout=1200, cwd=cwd,
                          env={**(env or {}), **(tree.env() if tree else {})} or None)
        try:
            s.gen(prompt_ids(32, 1, vocab), 16, timeout=900)         # warm-up: graphs captured
            # a prompt of its own each: its first id (its seed's, distinct modulo any
            # vocabulary's id range) is no earlier request's, so none RESUMEs a prefix
            runs, skipped = full_decodes(s, [prompt_ids(32, 2 + 61 * rep, vocab)
                                             for rep in range(3 * args.repeats)],
                                         args.tokens, repeats)
        finally:
            s.close()
    gens = [int(r["done"][0]) for r in runs]
    # decode tok/s: the tokens after the first over the decode seconds, each repeat (every
    # request generated --tokens: the same count over each time)
    tok_s, each = median_tps(args.tokens - 1, [float(r["done"][3]) for r in runs], "a decode")
    r = runs[0]
    steps = sum(int(st.get("graph_steps", 0)) for st in r["stats"])
    command = env_prefix(env) + "strata-launch --model M " + " ".join(devices + cmd) + " --serve"
    return {"name": "strata", "gpus": n_gpus, "command": command,
            "decode_tok_s": tok_s, "new_tokens": min(gens), "tps_each": {"decode": each},
            "decode_prompts_stopped_early": skipped,
            "peak_gib": round(mem.gib, 2),
            "predicted_ms_per_token": predicted_ms_per_token(
                model, devices + cmd, tree.env() if tree else None, cwd or ROOT),
            "measured_ms_per_token": round(1e3 / tok_s, 3),
            "tokens_sha256": hashlib.sha256(json.dumps(r["tokens"]).encode()).hexdigest(),
            "graph_steps_per_stage": steps / max(1, n_gpus) / max(1, gens[0] - 1),
            "_tokens": r["tokens"], "kernels_built_by": built_by,
            **({} if kernel_shape is None else {"kernel_shape": kernel_shape}),
            **({} if tree is None else tree.fields())}


def handoff_us(devices: str) -> float | None:
    """The median one-way hand-off of one decode row between two cards (bench_transport.py)."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "bench_transport.py"), "--devices",
                           devices, "--json"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"bench_transport.py failed: {done.stderr[-800:]}", flush=True)
        return None
    return float(json.loads(done.stdout.strip().splitlines()[-1])["decode_row_median_us"])


def llama_arm(args) -> dict:
    """llama-bench's tg test of --tokens on the whole file on the card (its -ub plays no part in
    one-token steps: llama-bench's own -ub and -b)."""
    llama_wait(args.llama_bench, args.llama_wait)     # a llama.cpp build may still be running
    tests = llama_sweep(args.llama_bench, ["-m", args.model, "-ngl", "99", "-fa", "1"], [],
                        args.tokens, args.repeats, ubatches=())
    arm = tuned_llama_arm(args.llama_bench, tests, [], args.tokens)
    for key in ("sweep", "decode_best"):     # one test: its figures are the arm's own
        arm.pop(key, None)
    return arm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0", help="0 (one arm) or 0,1 (a 1-GPU and a 2-GPU arm)")
    ap.add_argument("--split", default="", help="--layer-split of the 2-GPU arm (default auto)")
    ap.add_argument("--tokens", type=int, default=128,
                    help="new tokens per measured request (llama-bench -n the same)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured requests (the median is the figure; llama-bench -r the same)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--context", type=int, default=1024, help="--max-context")
    ap.add_argument("--cpu", action="store_true", help="one CPU rank (the harness, no GPU)")
    ap.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-bench to appear (a build in the background)")
    ap.add_argument("--unsplit", default="", metavar="GGUF",
                    help="--model is a split file and this the same file in one piece: its "
                         "greedy tokens are read first (one strata launch, one request) and the "
                         "strata arm's tokens_identical_to_unsplit says whether they equal the "
                         "split file's")
    ap.add_argument("--nvrtc-arm", action="store_true",
                    help="one more 1-GPU strata arm whose rank compiles every kernel with NVRTC "
                         "into an empty CuPy kernel cache ($STRATA_KERNEL_CUBINS cleared): the "
                         "binaries of a machine nobody prebuilt for, beside the first arm's")
    ap.add_argument("--shape-arm", action="append", default=[], metavar="SHAPE",
                    help="one more 1-GPU strata arm built with STRATA_KERNEL_SHAPE=SHAPE "
                         "(repeatable): its tok/s beside the first arm's in one record, and "
                         "whether its tokens equal the first arm's")
    ap.add_argument("--tree-arm", default="", metavar="TARBALL",
                    help="one more strata arm, run exactly as the first by an older tree of this "
                         "project: TARBALL is `git archive <commit>` (plain or | xz), whose commit "
                         "the arm names (tree_commit); its tok/s beside the first arm's in one "
                         "record, and whether its tokens equal the first arm's")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.tokens < 2 or not 1 <= args.repeats <= 8:
        fail(f"--tokens {args.tokens} / --repeats {args.repeats}: at least 2 tokens, 1 to 8 "
             f"repeats")
    for shape in args.shape_arm:
        from strata_dist.kernels.abi import KernelShape
        try:
            KernelShape.parse(shape)
        except (TypeError, ValueError) as e:
            fail(f"--shape-arm {shape!r}: {e}")
    facts = model_facts(args.model, args.popularity)
    # the older tree unpacked (and its commit read) before anything is measured: a tarball that
    # names no commit is refused now
    older = OlderTree(args.tree_arm) if args.tree_arm else None
    if args.unsplit:
        whole = model_facts(args.unsplit, args.popularity)
        if facts["shards"] < 2 or whole["shards"] != 1 or any(
                whole[k] != facts[k] for k in ("like", "quant", "popularity", "types")):
            fail(f"--unsplit {args.unsplit}: {whole['like']} {whole['quant']} in "
                 f"{whole['shards']} shard(s) is not --model {args.model} "
                 f"({facts['like']} {facts['quant']} in {facts['shards']} shards) in one piece")
    # the record's identity (commit, time, options, machine) now: a tree no commit can be named
    # for is refused before anything is measured
    recorder = Recorder("decode", facts, args.out)
    arms = []

    def keep(arm: dict) -> None:
        """The arm into the record, rewritten now: a later arm that fails or times out (an older
        tree's, llama.cpp's) leaves the arms measured before it on disk."""
        arms.append(arm)
        recorder.save([{k: (round(v, 2) if k == "decode_tok_s" else v) for k, v in a.items()
                        if k != "_tokens"} for a in arms])

    gpus = args.gpus.split(",")
    unsplit = (strata_arm(args, gpus[0], "auto", facts["vocab"], args.unsplit, 1)
               if args.unsplit else None)
    one = strata_arm(args, gpus[0], "auto", facts["vocab"])
    keep(one)
    if unsplit is not None:
        # the first measured request of each launch: the same prompt (the same ids, the same
        # greedy tokens up to where one file's output first departs from the other's)
        one["tokens_identical_to_unsplit"] = one["_tokens"] == unsplit["_tokens"]
        one["unsplit_tokens_sha256"] = unsplit["tokens_sha256"]
        print(f"strata: the {facts['shards']}-shard file's tokens "
              f"{'are identical to' if one['tokens_identical_to_unsplit'] else 'DIFFER from'} "
              f"the unsplit file's ({os.path.basename(args.unsplit)})", flush=True)
    print(f"strata 1 GPU: {one['decode_tok_s']:.1f} tok/s decode, graph steps/stage/token "
          f"{one['graph_steps_per_stage']:.2f}, peak {one['peak_gib']:.1f} GiB", flush=True)
    # the same launch again, its kernels built otherwise: by NVRTC, or at another kernel shape
    others = ([("kernels compiled by NVRTC", {"nvrtc": True})] if args.nvrtc_arm else []) + \
        [(f"STRATA_KERNEL_SHAPE={shape}", {"kernel_shape": shape}) for shape in args.shape_arm]
    for label, build in others:
        built = strata_arm(args, gpus[0], "auto", facts["vocab"], **build)
        compare_tokens(built, built["_tokens"], one["_tokens"])
        keep(built)
        print(f"strata 1 GPU, {label}: {built['decode_tok_s']:.1f} tok/s decode "
              f"({built['decode_tok_s'] / one['decode_tok_s']:.3f}x the first arm, whose kernels: "
              f"{one['kernels_built_by']}), {tokens_said(built)}", flush=True)
    if older is not None:
        # the first arm again, run by the older tree: the same launch, the same requests
        before = strata_arm(args, gpus[0], "auto", facts["vocab"], tree=older)
        compare_tokens(before, before["_tokens"], one["_tokens"])
        keep(before)
        print(f"strata 1 GPU, tree {older.commit}: {before['decode_tok_s']:.1f} tok/s decode, "
              f"{tokens_said(before)}", flush=True)
        print(older.ratio_line(one["decode_tok_s"], before["decode_tok_s"]), flush=True)
    if len(gpus) > 1 and not args.cpu:
        two = strata_arm(args, ",".join(gpus[:2]), args.split or "auto", facts["vocab"])
        two["tokens_identical_to_1gpu"] = two["_tokens"] == one["_tokens"]
        us = handoff_us(",".join(gpus[:2]))
        if us is not None:
            two["handoff_us"] = round(us, 1)
        keep(two)
        print(f"strata 2 GPUs: {two['decode_tok_s']:.1f} tok/s decode, tokens identical to 1 GPU: "
              f"{two['tokens_identical_to_1gpu']}, hand-off {two.get('handoff_us')} us", flush=True)
    if args.llama_bench:
        ll = llama_arm(args)
        keep(ll)
        print(f"llama.cpp {ll['build']}: {ll['decode_tok_s']:.1f} tok/s decode", flush=True)
        for arm in arms[:-1]:
            # each strata arm named as the record names it (a shape or an older tree's arm is
            # not this tree's default build)
            what = (f" {arm['name'].removeprefix('strata ')}" if "tree_commit" in arm
                    else f" STRATA_KERNEL_SHAPE={arm['kernel_shape']}" if "kernel_shape" in arm
                    else f" (kernels by {arm['kernels_built_by']})" if arm is not one
                    else "")
            print(f"strata{what} {arm['gpus']} GPU(s) / llama.cpp 1 GPU: "
                  f"{arm['decode_tok_s'] / ll['decode_tok_s']:.2f}x", flush=True)
    for arm in arms:
        arm.pop("_tokens", None)
        arm["decode_tok_s"] = round(arm["decode_tok_s"], 2)
    # against the latest record's first arm of as many tokens (a shape arm or a longer run's
    # tokens are other tokens without anything having changed)
    print(tokens_against_records("decode", facts, "strata", one["tokens_sha256"],
                                 like={"new_tokens": one["new_tokens"], "kernel_shape": None,
                                       "tree_commit": None}), flush=True)
    path = recorder.save(arms)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
