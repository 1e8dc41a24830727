"""What strata-launch's flags say about the devices and the layout: the ranks (--gpus /
--cpu-ranks and their --vram-budget), the split (--layer-split, --stage-gpus), the prompt chunk
(--prefill), the planner's tunables and explicit tiers (--expert-cache, --expert-cache-device),
and the devices the plan is made for (--inventory). Each bad value is a UsageError naming the flag
and its value (launcher/cli.py turns it into exit 2)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from protocol.bounded_read import MIB, read_capped
from strata_dist.devices import cpu_device, gpu_device, parse_size, parse_size_list
from strata_dist.models import architecture_for
from strata_dist.plan import Device, devices_from_json, params_from_env, split_shared_cards
from strata_dist.plan.explicit import parse_explicit_tiers, ranks_of_gpus
from strata_dist.plan.params import ENV_VARS, PlanParams

from .spawn import RankSpec

DEFAULT_CPU_BUDGET = "8G"
# an inventory file is read up to this (protocol/bounded_read.py): a few hundred bytes a device
INVENTORY_FILE_MAX = 4 * MIB


class UsageError(Exception):
    pass


def rank_specs(args) -> list[RankSpec]:
    if args.gpus is not None and args.cpu_ranks is not None:
        raise UsageError(f"--gpus {args.gpus} and --cpu-ranks {args.cpu_ranks} cannot be combined: "
                         "one rank kind per launch")
    if args.gpus is not None:
        try:
            gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
        except ValueError:
            raise UsageError(f"--gpus wants comma-separated indices, got '{args.gpus}'") from None
        if not gpus:
            raise UsageError("--gpus lists no GPU")
        budgets = _budgets(args.vram_budget, len(gpus), None)
        free = {g: gpu_device(g).free_bytes for g in sorted(set(gpus))}   # NVML answers first
        check_listed_gpus(gpus, budgets, free)
        return [RankSpec(i, "cuda:0", g, b) for i, (g, b) in enumerate(zip(gpus, budgets))]
    n = args.cpu_ranks if args.cpu_ranks is not None else 1
    if n < 1:
        raise UsageError(f"--cpu-ranks {n}: at least one rank is needed")
    budgets = _budgets(args.vram_budget, n, DEFAULT_CPU_BUDGET)
    return [RankSpec(i, "cpu", None, b) for i, b in enumerate(budgets)]


def check_listed_gpus(gpus: list[int], budgets: list[str | None], free: dict[int, int]) -> None:
    """A GPU listed k times runs k ranks that share it (a split tried on one card); the plan splits
    its free memory between them (plan.split_shared_cards: a rank's budget first, equal parts of
    the rest). Refused here, before any rank starts, when one card's budgets ask more than it has
    free."""
    for g, have in free.items():
        ranks = [i for i, x in enumerate(gpus) if x == g]
        if len(ranks) < 2:
            continue
        asked = sum(parse_size(budgets[i]) for i in ranks if budgets[i])
        if asked > have or (asked == have and not all(budgets[i] for i in ranks)):
            given = ",".join(budgets[i] or "(a share)" for i in ranks)
            raise UsageError(f"--vram-budget {given} for ranks {','.join(map(str, ranks))}, which "
                             f"share GPU {g}: {have / 2**30:.1f} GiB of it is free")


def _budgets(text: str | None, n: int, default: str | None) -> list[str | None]:
    if not text:
        return [default] * n
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        parse_size_list(text)
    except ValueError as e:
        raise UsageError(f"--vram-budget: {e}") from None
    if len(parts) == 1:
        return parts * n
    if len(parts) != n:
        raise UsageError(f"--vram-budget has {len(parts)} values for {n} ranks")
    return parts


def split_arg(text: str, n_devices: int) -> str | list[int]:
    if text == "auto":
        return "auto" if n_devices > 1 else "none"   # one device: nothing to split
    try:
        points = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise UsageError(f"--layer-split wants auto or K1,K2,…, got '{text}'") from None
    if n_devices < 2:
        raise UsageError(f"--layer-split {text} needs at least 2 devices; this launch has {n_devices}")
    return points


def prompt_chunk_arg(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--prefill wants auto or a number of tokens, got '{text}'") from None
    if value < 1:
        raise UsageError(f"--prefill {value}: a chunk needs at least one token")
    return value


def plan_params(args) -> PlanParams:
    base = PlanParams()
    if args.calibration:
        from strata_dist.tools.calibrate import CalibrationError, load_calibration
        try:
            measured = load_calibration(args.calibration)
        except CalibrationError as e:
            raise UsageError(str(e)) from None
        base = replace(base, **measured)
        overridden = {name for var, (name, _) in ENV_VARS.items() if os.environ.get(var, "").strip()}
        shown = ", ".join(f"{k} {v:g}" + (" (overridden by the environment)" if k in overridden
                                          else "") for k, v in measured.items())
        print(f"info: planner constants from calibration {args.calibration}: {shown}",
              file=sys.stderr)
    params = params_from_env(os.environ, base)
    if getattr(args, "parallel", None):
        params = replace(params, sessions=args.parallel)   # --parallel: a session each
    if args.no_remote_auto:
        params = replace(params, remote_auto=False)
    if args.no_prompt_loans:
        params = replace(params, prompt_loans=False)
    if getattr(args, "spec", 0):     # every stage keeps room for a verify window of K + 1 rows
        params = replace(params, verify_rows=args.spec + 1)
    if args.expert_cache != "auto":
        try:
            n = int(args.expert_cache)
        except ValueError:
            raise UsageError(f"--expert-cache wants auto, 0 or a number of pairs, got "
                             f"'{args.expert_cache}'") from None
        if n < 0:
            raise UsageError(f"--expert-cache {n}: a cache cannot hold fewer than 0 pairs")
        pinned = params.stage_cache_slots
        if pinned is not None and pinned != n:
            raise UsageError(f"--expert-cache {n} and STRATA_STAGE_CACHE_SLOTS={pinned} disagree")
        params = replace(params, stage_cache_slots=n)
        if n == 0:   # no resident experts anywhere: no helper tiers either
            params = replace(params, remote_auto=False)
    return params


def layout_args(args, specs: list[RankSpec], split) -> dict:
    """make_plan's stage_gpus and helper_tiers from --stage-gpus and --expert-cache-device, in the
    plan's device names (with --gpus, GPU indices become the rank numbers running them). Refused
    here, before any rank starts: a GPU not in --gpus, a malformed entry, split points that do not
    make one stage per --stage-gpus device."""
    try:
        tiers = parse_explicit_tiers(args.expert_cache_device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stages = None
    if args.stage_gpus is not None:
        stages = [x.strip() for x in args.stage_gpus.split(",") if x.strip()]
        if not stages:
            raise UsageError(f"--stage-gpus {args.stage_gpus!r} names no device")
        if not isinstance(split, str) and len(split) + 1 != len(stages):
            raise UsageError(f"--layer-split {args.layer_split} makes {len(split) + 1} stages; "
                             f"--stage-gpus {args.stage_gpus} names {len(stages)} device(s)")
    gpus = [s.visible_gpu for s in specs if s.visible_gpu is not None]
    if specs and not args.inventory:   # CPU ranks: gpus is empty, a device's index is its rank
        if stages is not None:
            stages = _rank_refs(stages, gpus, len(specs), f"--stage-gpus {args.stage_gpus}")
        tiers = tuple(replace(t, ref=_rank_refs([t.ref], gpus, len(specs), t.flag, one=True)[0],
                              shown=t.ref) for t in tiers)
    return {"stage_gpus": stages, "helper_tiers": tiers}


def _rank_refs(refs: list[str], gpus: list[int], n_ranks: int, flag: str,
               one: bool = False) -> list[str]:
    """GPU indices -> the ranks running them (ranks_of_gpus; CPU ranks: as given); `rank:N` names
    rank N itself, the one way to tell apart ranks that share a card (--gpus 0,0,0,0)."""
    out = []
    for ref in (r.strip() for r in refs):
        if not ref.startswith("rank:"):
            out += ranks_of_gpus([ref], gpus, flag, one) if gpus else [ref]
        elif ref[5:].isdigit() and int(ref[5:]) < n_ranks:
            out.append(str(int(ref[5:])))
        else:
            raise UsageError(f"{flag}: {ref!r}: this launch runs ranks 0 to {n_ranks - 1}")
    return out


def load_profile(args, gguf):
    if not args.expert_profile:
        print("warning: no --expert-profile: the plan ranks experts uniformly", file=sys.stderr)
        return None
    from strata_dist.tools.profile_io import load_profile as load
    g = architecture_for(gguf).read_geometry(gguf)
    return load(args.expert_profile, g.n_layers, g.n_expert)


def planning_devices(args, specs: list[RankSpec]) -> list[Device]:
    """The inventory for --plan-only: a file, or this machine's devices as the ranks would see them."""
    if args.inventory:
        try:
            return devices_from_json(json.loads(read_capped(args.inventory, INVENTORY_FILE_MAX,
                                                            "--inventory")))
        except OSError as e:
            raise UsageError(f"--inventory {args.inventory}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"--inventory {args.inventory}: not JSON ({e})") from None
        except RecursionError:
            raise UsageError(f"--inventory {args.inventory}: not an inventory (nested too "
                             "deep)") from None
    out = []
    for s in specs:
        budget = parse_size(s.vram_budget) if s.vram_budget else None
        d = cpu_device(budget) if s.device == "cpu" else gpu_device(s.visible_gpu, budget)
        out.append(Device(name=d.name, total_bytes=d.total_bytes, free_bytes=d.free_bytes,
                          mem_bandwidth_gbs=d.mem_bandwidth_gbs, index=s.index, card=d.uuid,
                          kind=d.kind))
    return split_shared_cards(out)


# ---- the run ---------------------------------------------------------------------------------------
