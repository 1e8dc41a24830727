"""`bench: serve`'s harness on CPU ranks: bench_serve.py --cpu starts a real strata-launch --port,
sends concurrent streaming requests with a real HTTP client, checks each stream's tokens against
its prompt alone and writes a record that record_check.py accepts. Its figures are checked
against numpy's percentile and against the streams' own times; llama-batched-bench's table is
parsed from the text llama.cpp prints (and, where $LLAMA_BATCHED_BENCH names a build, from a real
run of it on the same file: without one, that arm is not run here)."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import parse_batched_table, percentile, served_at_once, union_seconds  # noqa: E402
from record_check import check_record  # noqa: E402

LLAMA = os.environ.get("LLAMA_BATCHED_BENCH", "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    tmp = tmp_path_factory.mktemp("bench-serve")
    model = tmp / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    argv = [sys.executable, "benchmarks/bench_serve.py", "--model", str(model), "--cpu",
            "--streams", "1,3", "--prompt-tokens", "40", "--tokens", "12", "--seed", "5",
            "--out", str(tmp / "out")]
    if LLAMA:
        argv += ["--llama-batched-bench", LLAMA, "--ubatches", "32,64"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [path] = (tmp / "out").glob("serve-tiny-q8_0-*.json")
    return proc, path


def test_the_cpu_run_writes_a_complete_record(run):
    proc, path = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["bench"] == "serve" and record["model"]["like"] == "tiny"
    strata = [a for a in record["arms"] if a["name"] == "strata"]
    assert [a["streams"] for a in strata] == [1, 3]
    for a in strata:
        n = a["streams"]
        assert a["gpus"] == 0 and a["ranks"] == 1
        assert a["prompt_tokens"] == 40 and a["new_tokens"] == 12
        assert "--cpu-ranks 1" in a["command"] and "--port 0" in a["command"]
        # every stream's greedy tokens are its prompt's alone, in a random send order
        assert a["tokens_identical_to_alone"] is True and a["streams_differing"] == []
        # what the server did with them, from /v1/status: no --parallel, one at a time
        assert (a["parallel"], a["batched_steps"], a["mean_requests_per_step"]) == (1, 0, None)
        assert sorted(a["send_order"]) == list(range(n)) and len(a["ttft_ms_each"]) == n
        assert sorted(a["arrival_order"]) == list(range(n))
        assert min(a["ttft_ms_each"]) <= a["ttft_p50_ms"] <= a["ttft_p99_ms"] \
            <= max(a["ttft_ms_each"])
        assert a["ttft_p99_ms"] == pytest.approx(np.percentile(a["ttft_ms_each"], 99), abs=0.02)
        assert 0 <= a["itl_p50_ms"] <= a["itl_p99_ms"]
        # decode over the decoding seconds is at least the end-to-end rate (whose seconds hold
        # every prompt and whose tokens hold every first token too: at most N more)
        assert a["aggregate_tok_s"] > 0 and a["end_to_end_tok_s"] > 0
        wall_ms = a["wall_s"] * 1e3
        assert a["end_to_end_tok_s"] == pytest.approx(n * 12 / a["wall_s"], rel=0.02)
        assert max(a["ttft_ms_each"]) <= wall_ms + 1
    assert "3 streams / 1: aggregate decode" in proc.stdout
    if not LLAMA:
        assert "llama.cpp: no --llama-batched-bench given, its arms left out" in proc.stdout
        assert [a["name"] for a in record["arms"]] == ["strata", "strata"]


@pytest.mark.skipif(not LLAMA, reason="$LLAMA_BATCHED_BENCH names no llama-batched-bench build")
def test_the_llama_arms_come_from_a_real_batched_bench_run(run):
    _, path = run
    record = json.loads(path.read_text())
    llama = [a for a in record["arms"] if a["name"] == "llama.cpp"]
    assert [a["streams"] for a in llama] == [1, 3]
    for a in llama:
        assert set(a["ubatch_sweep"]) == {"32", "64"}
        assert "-npp 40 -ntg 12 -npl 1,3" in a["command"] and "-ngl 99 -fa 1" in a["command"]
        best = a["ubatch_sweep"][str(a["best"]["decode"]["ubatch"])]
        assert a["aggregate_tok_s"] == max(u["s_tg_tok_s"] for u in a["ubatch_sweep"].values())
        assert a["itl_p50_ms"] == round(best["t_tg_s"] / 12 * 1e3, 3)
        assert a["ttft_p50_ms"] == a["ttft_p99_ms"]


def test_the_record_check_names_what_a_serve_record_lacks(run):
    _, path = run
    record = json.loads(path.read_text())
    broken = copy.deepcopy(record)
    del broken["arms"][0]["ttft_p99_ms"], broken["arms"][1]["tokens_identical_to_alone"]
    broken["arms"][1]["ttft_ms_each"] = broken["arms"][1]["ttft_ms_each"][:2]
    broken["arms"][1]["new_tokens"] = 11
    assert check_record(broken, str(path)) == [
        "arms[0].ttft_p99_ms missing",
        "arms[1].tokens_identical_to_alone missing",
        "arms[1].ttft_ms_each has 2 streams' figures, not 3",
        "arms of different lengths (prompt_tokens, new_tokens): [(40, 11), (40, 12)]"]
    # a llama.cpp arm names its source (required of records from record_check's
    # SOURCE_REQUIRED_FROM on, so the check holds whatever the date); only its sweep is missing
    llama = {"name": "llama.cpp", "gpus": 1, "command": "llama-batched-bench", "build": "b1",
             "source": {"commit": "0c1e570"},
             **{k: record["arms"][0][k] for k in ("streams", "prompt_tokens", "new_tokens",
                                                  "aggregate_tok_s", "end_to_end_tok_s",
                                                  "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")}}
    record["arms"].append(llama)
    assert check_record(record, str(path)) == [f"arms[{len(record['arms']) - 1}].ubatch_sweep "
                                               f"missing"]


def test_what_the_server_did_is_read_from_its_status_around_an_arm():
    """--parallel's counters before and after an arm: its steps and their mean requests, the
    lone requests' loops and their hand backs."""
    before = {"parallel": 4, "batched_steps": 10, "batched_requests": 12, "lone_loops": 2,
              "hand_backs": 1}
    after = {"parallel": 4, "batched_steps": 40, "batched_requests": 102, "lone_loops": 5,
             "hand_backs": 3}
    assert served_at_once(before, after) == {"parallel": 4, "batched_steps": 30,
                                             "mean_requests_per_step": 3.0, "lone_loops": 3,
                                             "hand_backs": 2}
    assert served_at_once({}, {"waiting": 0}) == {"parallel": 1, "batched_steps": 0,
                                                  "mean_requests_per_step": None,
                                                  "lone_loops": 0, "hand_backs": 0}


def test_percentile_and_union_of_intervals():
    values = list(np.random.default_rng(3).exponential(10.0, size=37))
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6)]) == pytest.approx(3.0)
    assert union_seconds([(5.0, 6.0), (0.0, 1.0)]) == pytest.approx(2.0)


# llama-batched-bench's own standard output (the llama.cpp the anchor builds, a CPU build, on
# the tiny q8_0 file: -c 156 -b 64 -ub 32 -npp 40 -ntg 12 -npl 1,3): a row per N
BATCHED_OUTPUT = """
llama_batched_bench: n_kv_max = 768, n_batch = 64, n_ubatch = 32, flash_attn = 1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = 99, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    40 |     12 |    1 |     52 |    0.002 | 17873.10 |    0.002 |  5923.00 |    0.004 | 12195.12 |
|    40 |     12 |    3 |    156 |    0.005 | 23019.38 |    0.004 |  9795.92 |    0.009 | 17551.76 |

"""


def test_the_batched_bench_table_is_read_row_by_row():
    rows = parse_batched_table(BATCHED_OUTPUT)
    assert [(r["pp"], r["tg"], r["streams"], r["n_kv"]) for r in rows] == [(40, 12, 1, 52),
                                                                        (40, 12, 3, 156)]
    assert rows[1]["t_pp_s"] == 0.005 and rows[1]["s_pp_tok_s"] == 23019.38
    assert rows[1]["t_tg_s"] == 0.004 and rows[1]["s_tg_tok_s"] == 9795.92
    assert rows[1]["t_s"] == 0.009 and rows[1]["s_tok_s"] == 17551.76
    assert parse_batched_table(BATCHED_OUTPUT.replace("|    40 |     12 |    3 |", "|")) == rows[:1]


def test_bad_arguments_are_one_error_line(tmp_path):
    for args, says in ((["--streams", "0,4"], "error: --streams 0,4: each at least 1"),
                       (["--streams", "a"], "error: --streams a: comma-separated whole numbers"),
                       (["--tokens", "1"], "error: --prompt-tokens 512 (>= 1), --tokens 1 (>= 2"),
                       (["--gpus", "x"], "error: --gpus x: comma-separated GPU indices"),
                       (["--llama-batched-bench", str(tmp_path / "none")],
                        f"error: --llama-batched-bench {tmp_path / 'none'}: not an executable")):
        proc = subprocess.run([sys.executable, "benchmarks/bench_serve.py", "--model",
                               str(tmp_path / "m.gguf"), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(says), (args, proc.stderr)


def test_must_show_serve_parts_give_the_gpu_commands(tmp_path):
    """must_show.sh --parts serve,serve_two_ranks (off by default): the one-card run beside
    llama-batched-bench (built beside the anchor) and the two-rank run, every flag one that
    bench_serve.py --help names."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "m")}
    done = subprocess.run(["bash", "benchmarks/must_show.sh", "--print", "--parts",
                           "serve,serve_two_ranks"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    benches = [ln[2:].split() for ln in done.stdout.splitlines()
               if ln.startswith("+ ") and "benchmarks/bench_serve.py" in ln]
    assert len(benches) == 2
    one, two = benches
    assert one[one.index("--gpus") + 1] == "0" and two[two.index("--gpus") + 1] == "0,0"
    assert one[one.index("--llama-batched-bench") + 1] == \
        ".anchor/llama.cpp/build/bin/llama-batched-bench"
    assert "--llama-batched-bench" not in two
    synth = [ln for ln in done.stdout.splitlines() if ln.startswith("+ ") and " synth " in ln]
    assert synth and all("--like qwen3-30b-a3b --quant q4_k_m" in s for s in synth)
    helps = subprocess.run([sys.executable, "benchmarks/bench_serve.py", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout
    for c in benches:
        for flag in (w for w in c if w.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", helps), flag
