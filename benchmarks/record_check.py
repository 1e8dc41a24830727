"""The checker of ../shared/RECORDS.md: what a record under benchmarks/results/ lacks of the
format's fields (tests/test_bench_records.py runs it on every record; gpu_session.sh on the records
of its run before they are copied back).

    python benchmarks/record_check.py benchmarks/results/*.json
"""
from __future__ import annotations

import json
import os
import re
import sys

from llama_runs import UBATCHES

# Records from this date on name the llama.cpp each llama.cpp arm ran (`source`: the source
# archive's sha256 and package version and the vendored commit, or a git build's commit); the
# records before it said only llama.cpp's version line ("commit unknown" for the anchor's build)
# and stay valid as written (a record is never edited)
SOURCE_REQUIRED_FROM = "2026-12-06"
ANCHOR_SOURCE = ("package", "package_version", "archive", "archive_sha256", "vendored_commit")

NAME = re.compile(r"^(?P<bench>[a-z]+)-(?P<rest>.+)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<hms>\d{6})-"
                  r"(?P<commit>[^\s/]+)\.json$")


def check_record(record: dict, filename: str) -> list[str]:
    """What a record lacks of ../shared/RECORDS.md's fields, one line each (empty: complete). A
    record marked `"legacy": true` is older than the format and is not held to it."""
    if record.get("legacy") is True:
        return []
    bad = []

    def need(obj, key, where, kind=None):
        if not isinstance(obj, dict) or key not in obj:
            bad.append(f"{where}{key} missing")
            return None
        if kind is not None and not isinstance(obj[key], kind):
            bad.append(f"{where}{key} is {type(obj[key]).__name__}, not {kind}")
            return None
        return obj[key]

    for key, kind in (("bench", str), ("date", str), ("time", str), ("commit", str),
                      ("commit_source", str), ("options", dict), ("machine", dict),
                      ("model", dict), ("arms", list)):
        need(record, key, "", kind)
    if record.get("commit_source") not in (None, "git", "archive"):
        bad.append(f"commit_source {record['commit_source']!r}: git or archive")
    if isinstance(record.get("options"), dict) and not any(
            k.startswith("STRATA_") for k in record["options"]):
        bad.append("options name no STRATA_ option")
    m = record.get("machine") or {}
    need(m, "gpus", "machine.", list)
    need(m, "cpu_cores", "machine.", int)
    need(m, "cpu", "machine.", str)
    model = record.get("model") or {}
    for key, kind in (("like", str), ("quant", str), ("popularity", str), ("bytes", int),
                      ("types", dict)):
        need(model, key, "model.", kind)
    if model.get("popularity") == "":
        bad.append("model.popularity is empty")
    match = NAME.match(os.path.basename(filename))
    if not match:
        bad.append(f"file name {os.path.basename(filename)!r} is not "
                   f"<bench>-<like>-<quant>-<date>-<HHMMSS>-<commit>.json")
    else:
        expect = (f"{record.get('bench')}-{model.get('like')}-{model.get('quant')}-"
                  f"{record.get('date')}-{str(record.get('time', '')).replace(':', '')}-"
                  f"{record.get('commit')}.json")
        if os.path.basename(filename) != expect:
            bad.append(f"file name {os.path.basename(filename)!r}: the record's fields say "
                       f"{expect!r}")
    arms = record.get("arms") or []
    if isinstance(record.get("arms"), list) and not arms:
        bad.append("arms is empty")
    llama_new = None
    for i, arm in enumerate(arms if isinstance(arms, list) else []):
        where = f"arms[{i}]."
        name = need(arm, "name", where, str) or ""
        need(arm, "gpus", where, int)
        need(arm, "command", where, str)
        if name != "llama.cpp" and name != "strata" and not name.startswith("strata "):
            bad.append(f"{where}name {name!r}: strata, strata <variant> or llama.cpp")
        if "tree_commit" in arm:
            bad += tree_arm_lacks(arm, where)
        if "decode_tok_s" in arm:
            need(arm, "new_tokens", where, int)
            need(arm, "tps_each", where, dict)
        if "prefill_tok_s" in arm:
            each = need(arm, "tps_each", where, dict) or {}
            for n in arm["prefill_tok_s"]:
                if n not in each:
                    bad.append(f"{where}tps_each lacks the {n}-token prompt's repeats")
        if name == "llama.cpp":
            need(arm, "build", where, str)
            if str(record.get("date", "")) >= SOURCE_REQUIRED_FROM:
                bad += source_lacks(arm, where)
            if "prefill_tok_s" in arm:
                sweep = need(arm, "ubatch_sweep", where, dict) or {}
                missing = [u for u in map(str, UBATCHES) if u not in sweep]
                if missing:
                    bad.append(f"{where}ubatch_sweep lacks -ub {', '.join(missing)}")
            if record.get("bench") == "offload" and "mmap_sweep" not in arm:
                bad.append(f"{where}mmap_sweep missing (the offload arm tries -mmp 0 beside mmap)")
            if "decode_tok_s" in arm:
                llama_new = arm.get("new_tokens")
                if isinstance(llama_new, int) and llama_new < 128:
                    bad.append(f"{where}new_tokens {llama_new}: llama.cpp decodes -n >= 128")
    if record.get("bench") == "seedrig":
        bad += seedrig_lacks(arms if isinstance(arms, list) else [])
    if record.get("bench") == "adapt":
        bad += adapt_lacks(record, arms if isinstance(arms, list) else [])
    if record.get("bench") == "serve":
        bad += serve_lacks(arms if isinstance(arms, list) else [])
    if record.get("bench") == "spec":
        bad += spec_lacks(arms if isinstance(arms, list) else [])
    if record.get("bench") == "depth":
        bad += depth_lacks(arms if isinstance(arms, list) else [])
    if isinstance(llama_new, int):
        for i, arm in enumerate(arms):
            if arm.get("name") != "llama.cpp" and isinstance(arm.get("new_tokens"), int) \
                    and "decode_tok_s" in arm and arm["new_tokens"] < llama_new:
                bad.append(f"arms[{i}].new_tokens {arm['new_tokens']}: fewer than llama.cpp's "
                           f"{llama_new}")
    return bad


def tree_arm_lacks(arm: dict, where: str) -> list[str]:
    """An older tree's arm (--tree-arm, benchmarks/tree_arm.py): the full commit it ran, named
    in the arm's name by its short form, and its tokens against the first arm's."""
    commit = str(arm["tree_commit"])
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return [f"{where}tree_commit {arm['tree_commit']!r} is not a full commit hash"]
    bad = []
    if arm.get("name") != f"strata {commit[:7]}":
        bad.append(f"{where}name {arm.get('name')!r}: the tree arm of {commit} is "
                   f"'strata {commit[:7]}'")
    if not isinstance(arm.get("tokens_identical_to_first_arm"), bool):
        bad.append(f"{where}tokens_identical_to_first_arm missing")
    differing = arm.get("first_token_differing", "")
    if differing is not None and (not isinstance(differing, int) or isinstance(differing, bool)):
        bad.append(f"{where}first_token_differing {differing!r}: a token index or null")
    return bad


def source_lacks(arm: dict, where: str) -> list[str]:
    """A llama.cpp arm's `source`: the anchor's description (every ANCHOR_SOURCE field, the
    sha256 64 hex digits, the commit 40) or a git build's commit; what it lacks, one line each."""
    source = arm.get("source")
    if not isinstance(source, dict):
        return [f"{where}source missing (which llama.cpp ran: benchmarks/llamacpp-anchor.sh's "
                f"description or a git build's commit)"]
    if "commit" in source and "archive_sha256" not in source:
        ok = re.fullmatch(r"[0-9a-f]{7,40}", str(source["commit"]))
        return [] if ok else [f"{where}source.commit {source['commit']!r} is not a commit"]
    bad = [f"{where}source.{k} missing" for k in ANCHOR_SOURCE if not source.get(k)]
    if source.get("archive_sha256") and not re.fullmatch(r"[0-9a-f]{64}",
                                                         str(source["archive_sha256"])):
        bad.append(f"{where}source.archive_sha256 {source['archive_sha256']!r} is not a sha256")
    if source.get("vendored_commit") and not re.fullmatch(r"[0-9a-f]{40}",
                                                          str(source["vendored_commit"])):
        bad.append(f"{where}source.vendored_commit {source['vendored_commit']!r} is not a commit")
    return bad


SPEC_ARMS = ("strata", "strata self-draft", "strata ngram")   # the quantized draft: optional
SPEC_ARM = ("k", "drafted", "accepted", "tokens_identical_to_k0", "over_k0")
SPEC_LLAMA = ("k", "drafted", "accepted", "acceptance", "draft_model")   # llama-speculative


def spec_lacks(arms: list) -> list[str]:
    """bench_spec.py's fields: its K = 0 arm and a self-draft and ngram arm at least; each
    speculative arm (one with K) its drafts, acceptance, K and identity with its K = 0 arm; a
    llama.cpp arm (llama-speculative) its K, drafts, acceptance and draft file."""
    names = [a.get("name") for a in arms if isinstance(a, dict)]
    bad = [f"arms lack {n!r}" for n in SPEC_ARMS if n not in names]
    for i, arm in enumerate(arms):
        if isinstance(arm, dict) and arm.get("name") == "llama.cpp":
            bad += [f"arms[{i}].{k} missing" for k in SPEC_LLAMA if k not in arm]
        elif isinstance(arm, dict) and arm.get("name") not in ("strata",
                                                                "strata repeating prompt"):
            bad += [f"arms[{i}].{k} missing" for k in SPEC_ARM if k not in arm]
            if not isinstance(arm.get("tokens_identical_to_k0", False), bool):
                bad.append(f"arms[{i}].tokens_identical_to_k0 is not a bool")
    return bad


DEPTH_STRATA = (("prompt_tokens", int), ("max_context", int), ("kv_type", str),
                ("kv_resident", str), ("tokens_sha256", str), ("prompt_sha256", str))


def depth_lacks(arms: list) -> list[str]:
    """bench_depth.py's fields: every arm its depth and decode figure, one arm per engine and
    depth; a strata arm its prompt (depth 0: one id), context, K/V options and tokens, and past
    depth 0 that prompt's figure; llama.cpp arms, where there are any, at the strata arms'
    depths."""
    bad, seen = [], {}
    for i, arm in enumerate(arms):
        if not isinstance(arm, dict):
            continue
        where, depth = f"arms[{i}].", arm.get("depth")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            bad.append(f"{where}depth {depth!r}: a whole number >= 0")
            continue
        if "decode_tok_s" not in arm:
            bad.append(f"{where}decode_tok_s missing (the figure at depth {depth})")
        key = (arm.get("name"), depth)
        if key in seen:
            bad.append(f"{where}a second {key[0]} arm at depth {depth} (arms[{seen[key]}])")
        seen[key] = i
        if not str(arm.get("name", "")).startswith("strata"):
            continue
        for field, kind in DEPTH_STRATA:
            if not isinstance(arm.get(field), kind) or isinstance(arm.get(field), bool):
                bad.append(f"{where}{field} missing")
        if isinstance(arm.get("prompt_tokens"), int) and arm["prompt_tokens"] != max(depth, 1):
            bad.append(f"{where}prompt_tokens {arm['prompt_tokens']} at depth {depth}: the "
                       f"prompt is the depth (one id at depth 0)")
        if depth > 0 and str(depth) not in (arm.get("prefill_tok_s") or {}):
            bad.append(f"{where}prefill_tok_s lacks the {depth}-id prompt's figure")
        if isinstance(arm.get("max_context"), int) and isinstance(arm.get("new_tokens"), int) \
                and max(depth, 1) + arm["new_tokens"] > arm["max_context"]:
            bad.append(f"{where}depth {depth} + {arm['new_tokens']} new tokens pass max_context "
                       f"{arm['max_context']}")
    ours = {d for (name, d) in seen if str(name).startswith("strata")}
    theirs = {d for (name, d) in seen if name == "llama.cpp"}
    if not ours:
        bad.append("arms lack a strata arm")
    if theirs and theirs != ours:
        bad.append(f"llama.cpp arms at depths {sorted(theirs)}, strata's at {sorted(ours)}: "
                   f"the same depths")
    return bad


ADAPT_ARMS = ("strata phase one", "strata adapt off", "strata adapt on")
ADAPT_ARM = ("decode_tok_s", "first_decode_tok_s", "hit_rates", "hit_rate_before", "hit_rate_after",
             "tiers", "tokens_sha256")


def adapt_lacks(record: dict, arms: list) -> list[str]:
    """bench_adapt.py's fields: its three arms in order, each with its decode and hit-rate
    figures; the on arm's identity with the off arm; the on/off ratio of the record."""
    bad = []
    names = [a.get("name") for a in arms if isinstance(a, dict)]
    if names != list(ADAPT_ARMS):
        bad.append(f"arms {names}: expected {list(ADAPT_ARMS)}")
    for i, arm in enumerate(arms):
        if isinstance(arm, dict):
            bad += [f"arms[{i}].{k} missing" for k in ADAPT_ARM if k not in arm]
    if len(arms) == 3 and not isinstance(arms[2].get("tokens_identical_to_adapt_off"), bool):
        bad.append("arms[2].tokens_identical_to_adapt_off missing")
    if not isinstance(record.get("adapt_on_over_off"), (int, float)):
        bad.append("adapt_on_over_off missing")
    return bad


SERVE_ARM = (("streams", int), ("prompt_tokens", int), ("new_tokens", int),
             ("aggregate_tok_s", (int, float)), ("end_to_end_tok_s", (int, float)),
             ("ttft_p50_ms", (int, float)), ("ttft_p99_ms", (int, float)),
             ("itl_p50_ms", (int, float)))
SERVE_STRATA = (("itl_p99_ms", (int, float)), ("ttft_ms_each", list), ("send_order", list),
                ("tokens_identical_to_alone", bool), ("tokens_sha256", str))


def serve_lacks(arms: list) -> list[str]:
    """bench_serve.py's fields: every arm's stream count, lengths and figures; a strata arm's
    every stream's first-token time, its send order and its tokens against each prompt alone;
    a llama.cpp arm's micro-batch sweep; every arm of the same lengths (the same requests)."""
    bad = []
    for i, arm in enumerate(arms):
        if not isinstance(arm, dict):
            continue
        where = f"arms[{i}]."
        own = SERVE_ARM + (SERVE_STRATA if str(arm.get("name", "")).startswith("strata") else
                           (("ubatch_sweep", dict),))
        for key, kind in own:
            if key not in arm:
                bad.append(f"{where}{key} missing")
            elif not isinstance(arm[key], kind) or isinstance(arm[key], bool) and kind is not bool:
                bad.append(f"{where}{key} is {type(arm[key]).__name__}")
        each = arm.get("ttft_ms_each")
        if isinstance(each, list) and isinstance(arm.get("streams"), int) \
                and len(each) != arm["streams"]:
            bad.append(f"{where}ttft_ms_each has {len(each)} streams' figures, not "
                       f"{arm['streams']}")
    lengths = {(a.get("prompt_tokens"), a.get("new_tokens")) for a in arms if isinstance(a, dict)}
    if len(lengths) > 1:
        bad.append(f"arms of different lengths (prompt_tokens, new_tokens): {sorted(lengths)}")
    return bad


SEEDRIG_PLAN = ("stages", "ranks", "expert_slots", "chunk", "chunk_auto", "every_pair_held", "notes")
SEEDRIG_RANK = ("rank", "free_mib", "role", "left_mib")
SEEDRIG_STAGE = ("layers", "weights_mib", "session_mib", "reserve_mib", "loan_mib", "cache_mib",
                 "cache_slots")


def seedrig_lacks(arms: list) -> list[str]:
    """bench_seedrig.py's fields: every arm's plan by rank (what each holds, its slots, the
    chunk), its prompt and decode figures; every arm after the one-rank reference its identity."""
    bad = []
    for i, arm in enumerate(arms):
        where = f"arms[{i}]."
        if not isinstance(arm, dict):
            continue
        for key in ("prefill_tok_s", "decode_tok_s", "tiers", "tokens_sha256"):
            if key not in arm:
                bad.append(f"{where}{key} missing")
        if i and not isinstance(arm.get("tokens_identical_to_1gpu"), bool):
            bad.append(f"{where}tokens_identical_to_1gpu missing")
        if i and not isinstance(arm.get("identity_rule_applies"), bool):
            bad.append(f"{where}identity_rule_applies missing")
        plan = arm.get("plan")
        if not isinstance(plan, dict):
            bad.append(f"{where}plan missing")
            continue
        bad += [f"{where}plan.{k} missing" for k in SEEDRIG_PLAN if k not in plan]
        for r in plan.get("ranks") or []:
            keys = SEEDRIG_RANK + (SEEDRIG_STAGE if "stage" in str(r.get("role", "")) else ())
            bad += [f"{where}plan.ranks[{r.get('rank')}].{k} missing" for k in keys if k not in r]
    return bad


def check_files(paths: list[str]) -> int:
    """Print what each record lacks; the number of records that lack something."""
    failed = 0
    for path in paths:
        try:
            with open(path) as f:
                problems = check_record(json.load(f), path)
        except (OSError, ValueError) as e:
            problems = [f"not a readable JSON record ({e})"]
        for line in problems:
            print(f"{path}: {line}")
        failed += bool(problems)
    return failed


if __name__ == "__main__":
    sys.exit(1 if check_files(sys.argv[1:]) else 0)
