"""The seed rig's four-card configuration replayed on one card (issue 44, item 3).

The seed rig is two 12 GB and two 16 GB cards; its seeds serve a qwen3next file of the 80B-A3B
geometry at IQ3_S, in two shards, with `--layer-split 30`, the stages on the 12 GB cards and a
3500 MiB expert cache on each 16 GB card. Here the four cards are four ranks on one card
(`--gpus 0,0,0,0`), each held to its card's memory by `--vram-budget 12G,12G,16G,16G`; `rank:N`
names one of the ranks that share the card. Arms, one after the other, on the same file:

  strata                   one rank, every expert resident: the reference tokens
  strata seed rig split    four ranks at the seed budgets, --layer-split 30, stages on ranks 0
                           and 1, explicit helper tiers on ranks 2 and 3 (the seeds' flags)
  strata seed rig split full tiers   the same, the helper tiers sized by the plan (what ranks 2
                           and 3 have left: every pair on the card where it fits)
  strata seed rig auto     four ranks at the seed budgets, --layer-split auto

Each arm reads one --prompt-tokens prompt and generates --tokens tokens (greedy) in one request,
after a short warm-up request. Its plan (`strata-launch --plan-only` with the arm's flags on this
machine: what each rank holds, weights / session / reserve / loan / cache / helper / left, its
expert slots, the prompt chunk it lends, and the plan's notes, each refusal with both numbers)
goes into the record beside each rank's device memory in use after the request (NVML, by
process, where it answers), prompt and decode tok/s, where the expert computations ran, the
card's NVML peak and whether the tokens are the one-rank arm's. The identity rule is the seeds':
with the same experts on the GPU a split gives the tokens of one card. The one-rank arm holds
every pair, so an arm is held to it where its plan puts every pair on the card too (a stage
cache or a helper tier; a pair outside both is computed by the host in decode, which rounds
differently); on CPU ranks every arm computes every expert with the same kernels, so the rule
always applies. The script exits 1 (after writing the record) when an arm the rule applies to
differs.

The record (../shared/RECORDS.md, `bench: seedrig`) goes to
benchmarks/results/seedrig-<like>-<quant>-<date>-<HHMMSS>-<commit>.json. Without --model the file
is synthesized first into --models (kept there for the next call; with --cpu a fresh folder).

    python benchmarks/bench_seedrig.py --models /tmp/m      # the GPU replay, about 5 min + synth
    python benchmarks/bench_seedrig.py --cpu                # CPU ranks, the tiny qwen3next file
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from records import (PeakMemory, env_prefix, fail, model_facts, prompt_ids,  # noqa: E402
                     record_profile, serve_session, Recorder)

MIB = 1 << 20
WARM_PROMPT = 32     # ids of the warm-up request (graphs captured), its own prompt
# the seed rig, as its seeds run it; the CPU dry run keeps its shape at the tiny geometry's sizes
# (8 layers: the split at 5 of 8 as 30 of 48; --expert-cache 10 leaves pairs for the helper tiers)
GPU = {"like": "qwen3-next-80b-a3b", "budgets": "12G,12G,16G,16G", "split": "30", "tier_mib": 3500,
       "prompt_tokens": 16384, "tokens": 256, "shard": "20G", "profile_prompts": 4,
       "expert_cache": "auto"}
CPU = {"like": "tiny-next", "budgets": "170M,170M,180M,180M", "split": "5", "tier_mib": 1,
       "prompt_tokens": 256, "tokens": 16, "shard": "250K", "profile_prompts": 1,
       "expert_cache": "10"}


def synthesized(args) -> str:
    """The file's first shard: synthesized into --models unless an earlier call left it."""
    base = os.path.join(args.models, f"seedrig-{args.like}-iq3_s.gguf")
    first = base.removesuffix(".gguf") + "-00001-of-00002.gguf"
    if os.path.isfile(first):
        return first
    os.makedirs(args.models, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.tools", "synth", base, "--like", args.like, "--quant",
           "iq3_s", "--popularity", "zipf:1.0", "--split-max-size", args.shard, "--quiet"]
    print("+ " + " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if done.returncode != 0:
        fail(f"synth failed: {done.stderr.strip()[-800:]}")
    if not os.path.isfile(first):
        fail(f"synth --split-max-size {args.shard} did not write two shards ({first} missing): "
             f"{done.stdout.strip()[-300:]}")
    return first


def arms_flags(args) -> list[tuple[str, list[str]]]:
    """Each arm's name and launch flags (devices, budgets, layout), as the seeds' words say."""
    one = ["--cpu-ranks", "1"] if args.cpu else ["--gpus", "0"]
    four = ["--cpu-ranks", "4"] if args.cpu else ["--gpus", "0,0,0,0"]
    rig = [*four, "--vram-budget", args.budgets]
    if args.expert_cache != "auto":
        rig += ["--expert-cache", args.expert_cache]
    tiers = f"rank:2={args.tier_mib},rank:3={args.tier_mib}"
    split = [*rig, "--layer-split", args.split, "--stage-gpus", "rank:0,rank:1"]
    return [("strata", [*one, "--no-remote-auto"]),   # its budget: the whole card (or CPU default)
            ("strata seed rig split", [*split, "--expert-cache-device", tiers]),
            ("strata seed rig split full tiers", split),
            ("strata seed rig auto", [*rig, "--layer-split", "auto"])]


def plan_of(model: str, flags: list[str]) -> tuple[dict, str]:
    """The arm's plan on this machine (`--plan-only`, with the arm's flags): a summary by rank and
    the table as printed (its notes say why: what each stage could not lend, with both numbers)."""
    from strata_dist.plan import Plan
    argv = [sys.executable, "-m", "launcher.cli", "--model", model, *flags, "--plan-only"]
    done = [subprocess.run(argv + extra, capture_output=True, text=True, timeout=600, cwd=ROOT)
            for extra in (["--json"], [])]
    for d in done:
        if d.returncode != 0:
            fail(f"strata-launch {' '.join(flags)} --plan-only: {d.stderr.strip()[-600:]}")
    plan = Plan.from_json(done[0].stdout)
    ranks = []
    for dev in plan.devices:
        st, h = plan.stage_on(dev), plan.helper_on(dev)
        live = h is not None and not h.skipped
        row = {"rank": dev.index, "free_mib": round(dev.free_bytes / MIB, 1),
               "role": " + ".join(([f"stage {st.stage}"] if st else [])
                                  + (["helper (explicit)" if h.explicit else "helper"] if live else []))
               or "idle",
               "left_mib": round(plan.left_bytes(dev) / MIB, 1)}
        if st:
            row.update(layers=[st.lb, st.le], weights_mib=round(st.weights_bytes / MIB, 1),
                       session_mib=round(st.session_bytes / MIB, 1),
                       reserve_mib=round(st.reserve_bytes / MIB, 1),
                       loan_mib=round(st.loan_bytes / MIB, 1), loan_slots=st.loan_slots,
                       own_prompt_mib=round(st.own_prompt_bytes / MIB, 1),
                       cache_mib=round(st.cache_bytes / MIB, 1), cache_slots=st.cache_slots)
        if live:
            row.update(helper_mib=round(h.bytes / MIB, 1), helper_slots=len(h.pairs))
        ranks.append(row)
    summary = {"stages": [[st.device.index, st.lb, st.le] for st in plan.stages], "ranks": ranks,
               "expert_slots": plan.expert_slots, "expert_slots_stages": plan.expert_slots_stages,
               "expert_slots_primary": plan.expert_slots_primary,
               "chunk": plan.prompt_chunk, "chunk_auto": plan.prompt_chunk_auto,
               "coverage_all": round(plan.coverage_all, 4),
               # every pair the model has sits in a stage cache or a helper tier (on the card)
               "every_pair_held": plan.coverage_all >= 1 - 1e-9,
               "predicted_ms_per_token": round(plan.predicted_ms_per_token, 3),
               "method": plan.method, "notes": list(plan.notes)}
    return summary, done[1].stdout.rstrip()


def rank_used_mib(session) -> dict[str, float]:
    """Each rank's device memory in use now, by rank number (NVML's per-process figure on card 0,
    matched to the rank processes by pid). Empty where NVML answers no such figure (no GPU, or
    a container whose process ids NVML does not see): the field is then left out."""
    from launch_helpers import rank_pids
    rank_of = {}
    for pid in rank_pids(session):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            rank_of[pid] = argv[argv.index("--rank") + 1]
        except (OSError, ValueError, IndexError):
            continue
    try:
        import pynvml
        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:      # no NVML (a CPU run)
        return {}
    return {rank_of[p.pid]: round(p.usedGpuMemory / MIB, 1) for p in procs
            if p.pid in rank_of and isinstance(p.usedGpuMemory, int)}


def run_arm(args, name: str, flags: list[str], vocab: int) -> dict:
    """One launch: the warm-up request, then the measured one (the prompt and --tokens new tokens,
    greedy, with the ranks' counters)."""
    flags = [*flags, "--max-context", str(args.context), *args.profile_flags]
    plan, table = plan_of(args.model, flags)
    print(f"== {name}: strata-launch {' '.join(flags)}\n{table}", flush=True)
    with PeakMemory(0) as mem:
        s = serve_session(args.model, *flags, timeout=1800)
        try:
            warm = s.gen(prompt_ids(WARM_PROMPT, 1, vocab), 8, timeout=900)
            if warm["err"]:
                fail(f"{name}: the warm-up request failed: {warm['err']}")
            out = s.gen(prompt_ids(args.prompt_tokens, 7, vocab), args.tokens, "stats=1",
                        timeout=3600)
            used = {} if args.cpu else rank_used_mib(s)
        finally:
            s.close()
    if out["err"]:
        fail(f"{name}: the measured request failed: {out['err']}")
    if out["resume"]:
        fail(f"{name}: the measured prompt resumed at {out['resume']}: not a whole prompt's time")
    gen, prompt_ms, decode_ms = int(out["done"][0]), float(out["done"][2]), float(out["done"][3])
    if prompt_ms <= 0 or decode_ms <= 0 or gen < 2:
        fail(f"{name}: {gen} tokens in {prompt_ms} + {decode_ms} ms: nothing timed")
    prefill = round(args.prompt_tokens / (prompt_ms / 1e3), 2)
    decode = round((gen - 1) / (decode_ms / 1e3), 2)
    tiers = {k: sum(int(st.get(k, 0)) for st in out["stats"]) for k in ("hits", "remote", "host")}
    key = str(args.prompt_tokens)
    return {"name": name, "gpus": 0 if args.cpu else 1, "ranks": len(plan["ranks"]),
            "command": env_prefix() + "strata-launch --model M " + " ".join(flags) + " --serve",
            "prompt_tokens": args.prompt_tokens, "prefill_tok_s": {key: prefill},
            "decode_tok_s": decode, "new_tokens": gen,
            "tps_each": {key: [prefill], "decode": [decode]},
            "peak_gib": round(mem.gib, 2),
            "vram_budget": args.budgets if "--vram-budget" in flags else None,
            "tiers": tiers, "plan": plan,
            **({"rank_used_mib_after": used} if used else {}),
            "plan_table": table.splitlines(), "tokens": out["tokens"],
            "tokens_sha256": hashlib.sha256(json.dumps(out["tokens"]).encode()).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="the file's first shard (default: synthesized)")
    ap.add_argument("--models", default="",
                    help="where the synthesized file goes (default /tmp/m; --cpu: a new folder)")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU ranks and the tiny qwen3next geometry (the harness, no GPU)")
    ap.add_argument("--budgets", help="the four ranks' --vram-budget (seed rig: 12G,12G,16G,16G)")
    ap.add_argument("--split", help="the split arm's --layer-split (seeds: 30)")
    ap.add_argument("--tier-mib", type=int, help="each explicit helper tier (seeds: 3500)")
    ap.add_argument("--expert-cache", help="the four-rank arms' --expert-cache (default auto)")
    ap.add_argument("--prompt-tokens", type=int, help="the measured prompt (GPU: 16384)")
    ap.add_argument("--tokens", type=int, help="new tokens of the measured request (GPU: 256)")
    ap.add_argument("--profile-prompts", type=int,
                    help="512-id prompts the routing profile is recorded on (0: no profile)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    for k, v in (CPU if args.cpu else GPU).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.tokens < 2 or args.prompt_tokens < 1:
        fail(f"--tokens {args.tokens} / --prompt-tokens {args.prompt_tokens}: at least 2 new "
             f"tokens after a 1-token prompt")
    if len(args.budgets.split(",")) != 4:
        fail(f"--budgets {args.budgets}: the seed rig has four cards, one budget each")
    args.context = args.prompt_tokens + args.tokens + 64
    args.models = args.models or (tempfile.mkdtemp(prefix="seedrig-") if args.cpu else "/tmp/m")
    args.model = args.model or synthesized(args)
    facts = model_facts(args.model)
    if facts["shards"] != 2:
        print(f"note: {args.model} has {facts['shards']} shard(s); the seeds' file has two")
    recorder = Recorder("seedrig", facts, args.out)
    args.profile_flags = []
    if args.profile_prompts:
        profile = os.path.join(tempfile.mkdtemp(prefix="seedrig-"), "profile.json")
        record_profile(args.model, args.profile_prompts, facts["vocab"], profile,
                       "cpu" if args.cpu else "cuda:0",
                       [prompt_ids(WARM_PROMPT, 1, facts["vocab"]),
                        prompt_ids(args.prompt_tokens, 7, facts["vocab"])])
        args.profile_flags = ["--expert-profile", profile]
    arms = [run_arm(args, name, flags, facts["vocab"]) for name, flags in arms_flags(args)]
    reference = arms[0].pop("tokens")
    broken = []
    for a in arms[1:]:
        a["tokens_identical_to_1gpu"] = a.pop("tokens") == reference
        # the seeds' rule: the same experts on the GPU, here every pair in both arms (a pair
        # outside every cache and tier is computed by the host in decode), or CPU ranks
        a["identity_rule_applies"] = args.cpu or (a["plan"]["every_pair_held"]
                                                  and arms[0]["plan"]["every_pair_held"])
        if a["identity_rule_applies"] and not a["tokens_identical_to_1gpu"]:
            broken.append(a["name"])
    for a in arms:
        p, t = a["plan"], a["tiers"]
        print(f"{a['name']:22s}: prompt {a['prefill_tok_s'][str(args.prompt_tokens)]:9.1f} tok/s, "
              f"decode {a['decode_tok_s']:7.2f} tok/s ({a['new_tokens']} tokens), stages "
              f"{p['stages']}, expert slots {p['expert_slots']}, chunk {p['chunk']}"
              f"{' (auto)' if p['chunk_auto'] else ''}, experts hit {t['hits']} helper "
              f"{t['remote']} host {t['host']}, peak {a['peak_gib']:.2f} GiB"
              + ("" if a is arms[0] else f", tokens = one rank: {a['tokens_identical_to_1gpu']}"
                 + ("" if a["identity_rule_applies"] else " (not every pair on the card: the "
                    "identity rule does not apply)")), flush=True)
    print(f"record: {recorder.save(arms, identity_rule='the same experts on the GPU')}")
    if broken:
        print(f"error: tokens differ from the one-rank arm's in {', '.join(broken)}, where the "
              f"identity rule applies", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
