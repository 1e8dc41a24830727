"""The seed-rig replay's harness on CPU ranks: bench_seedrig.py --cpu synthesizes the tiny
qwen3next file in two shards, runs the one-rank arm and the three four-rank arms (seed budgets,
--layer-split with --stage-gpus rank:0,rank:1 and explicit tiers on ranks 2 and 3, plan-sized
tiers, auto) through real strata-launch --serve processes, and writes a `bench: seedrig` record
that record_check.py accepts; the four-rank arms give the one-rank arm's tokens. rank:N names a
rank of a card several ranks share (the seed rig on one card)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from record_check import check_record  # noqa: E402

from launcher.cli import UsageError, build_parser, layout_args  # noqa: E402
from launcher.spawn import RankSpec  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seedrig")
    proc = subprocess.run([sys.executable, "benchmarks/bench_seedrig.py", "--cpu", "--models",
                           str(tmp / "m"), "--out", str(tmp / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = list((tmp / "out").glob("seedrig-*.json"))
    assert len(records) == 1, records
    return proc, records[0], tmp / "m"


def test_the_cpu_replay_writes_a_complete_record(run):
    proc, path, models = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["bench"] == "seedrig" and record["model"]["like"] == "tiny-next"
    assert record["model"]["quant"] == "iq3_s" and record["model"]["shards"] == 2
    assert sorted(p.name for p in models.iterdir()) == [
        "seedrig-tiny-next-iq3_s-00001-of-00002.gguf", "seedrig-tiny-next-iq3_s-00002-of-00002.gguf"]
    names = [a["name"] for a in record["arms"]]
    assert names == ["strata", "strata seed rig split", "strata seed rig split full tiers",
                     "strata seed rig auto"]
    one, split, full, auto = record["arms"]
    assert "--cpu-ranks 1" in one["command"] and one["plan"]["every_pair_held"]
    for a in (split, full, auto):
        assert "--cpu-ranks 4 --vram-budget 170M,170M,180M,180M" in a["command"]
        assert a["ranks"] == 4 and a["new_tokens"] == 16
        assert a["prefill_tok_s"]["256"] > 0 and a["decode_tok_s"] > 0
        # the identity rule holds on CPU ranks, and the tokens are the one rank's
        assert a["identity_rule_applies"] is True and a["tokens_identical_to_1gpu"] is True
        assert a["tokens_sha256"] == one["tokens_sha256"]
        assert [r["free_mib"] for r in a["plan"]["ranks"]] == [170.0, 170.0, 180.0, 180.0]
    # the seeds' layout: stages on ranks 0 and 1 split at 5 of 8 (30 of 48), tiers on 2 and 3
    assert split["plan"]["stages"] == [[0, 0, 5], [1, 5, 8]]
    assert "--stage-gpus rank:0,rank:1 --expert-cache-device rank:2=1,rank:3=1" in split["command"]
    roles = {r["rank"]: r["role"] for r in split["plan"]["ranks"]}
    assert roles[2] == roles[3] == "helper (explicit)"
    assert any("--expert-cache-device rank:2=1" in n for n in split["plan"]["notes"])
    assert full["plan"]["stages"] == [[0, 0, 5], [1, 5, 8]]
    assert "--expert-cache-device" not in full["command"]
    # what each card holds, printed as the plan table, with the refusals' numbers in the notes
    assert "helper (explicit)" in "\n".join(split["plan_table"])
    assert "cannot lend a 256-token chunk: it needs 278 slots, its cache has 10" in proc.stdout
    assert proc.stdout.count("tokens = one rank: True") == 3


def test_the_checker_refuses_a_seedrig_record_without_its_plan_or_identity(run):
    _, path, _ = run
    record = json.loads(path.read_text())
    damaged = copy.deepcopy(record)
    del damaged["arms"][1]["plan"]["chunk"]
    del damaged["arms"][2]["tokens_identical_to_1gpu"]
    del damaged["arms"][3]["plan"]["ranks"][2]["cache_mib"]   # rank 2 runs the auto arm's stage
    assert check_record(damaged, str(path)) == [
        "arms[1].plan.chunk missing", "arms[2].tokens_identical_to_1gpu missing",
        "arms[3].plan.ranks[2].cache_mib missing"]


def layout(*flags: str) -> dict:
    args = build_parser().parse_args(["--model", "m.gguf", "--gpus", "0,0,0,0", *flags])
    specs = [RankSpec(i, "cuda:0", 0, b) for i, b in enumerate(["12G", "12G", "16G", "16G"])]
    return layout_args(args, specs, [30])


def test_rank_refs_pick_ranks_of_one_card():
    out = layout("--stage-gpus", "rank:0,rank:1", "--expert-cache-device", "rank:2=3500,rank:3=3500")
    assert out["stage_gpus"] == ["0", "1"]
    assert [(t.ref, t.shown, t.budget_bytes >> 20) for t in out["helper_tiers"]] == [
        ("2", "rank:2", 3500), ("3", "rank:3", 3500)]
    # a GPU index still means every rank on that card: GPU 1 is not listed, GPU 0 runs four
    with pytest.raises(Exception, match=r"--stage-gpus 0,1: GPU 1 is not in --gpus 0,0,0,0"):
        layout("--stage-gpus", "0,1")
    with pytest.raises(UsageError, match=r"--stage-gpus rank:0,rank:4: 'rank:4': this launch "
                                         r"runs ranks 0 to 3"):
        layout("--stage-gpus", "rank:0,rank:4")


def test_a_rank_ref_past_the_ranks_exits_2_naming_it(run):
    _, _, models = run
    model = str(models / "seedrig-tiny-next-iq3_s-00001-of-00002.gguf")
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "4", "--plan-only", "--layer-split", "5", "--stage-gpus", "rank:0,rank:1",
                           "--expert-cache-device", "rank:7=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --expert-cache-device rank:7=1: 'rank:7': this launch runs ranks 0 to 3")
