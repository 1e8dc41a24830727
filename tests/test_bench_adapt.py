"""`bench: adapt`'s harness on a CPU rank: bench_adapt.py --cpu synthesizes the tiny file, learns
phase one's profile while serving it (--expert-profile-out), runs phase two with the adaptive cache
off and on through real strata-launch --serve processes, and writes a record that record_check.py
accepts; the on arm's tokens are the off arm's and its cache hits more of phase two."""
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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-adapt")
    proc = subprocess.run([sys.executable, "benchmarks/bench_adapt.py", "--cpu", "--models",
                           str(tmp / "m"), "--out", str(tmp / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = list((tmp / "out").glob("adapt-*.json"))
    assert len(records) == 1, records
    return proc, records[0]


def test_the_cpu_run_writes_a_complete_record(run):
    proc, path = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["bench"] == "adapt" and record["model"]["like"] == "tiny"
    assert record["model"]["popularity"] == "zipf:1"
    first, off, on = record["arms"]
    assert "--expert-profile-out" in first["command"]
    assert "--expert-profile" in off["command"] and "--adapt-every" not in off["command"]
    assert "--adapt-every 16 --adapt-swaps 4" in on["command"]
    for a in record["arms"]:
        assert a["requests"] == 4 and a["new_tokens"] == 24 and len(a["hit_rates"]) == 4
        assert a["decode_tok_s"] > 0 and a["tiers"]["remote"] == 0     # no helper tier
    # phase two starts on the same cache either way (from phase one's learnt profile) ...
    assert on["hit_rate_before"] == off["hit_rate_before"]
    # ... which phase one's requests did not fill with what phase two routes to
    assert off["hit_rate_before"] > first["hit_rate_before"]
    # adapting, the cache holds more of phase two by its end; the tokens do not change
    assert on["hit_rate_after"] > off["hit_rate_after"] + 0.05
    assert on["tokens_identical_to_adapt_off"] is True and on["tokens_sha256"] == off["tokens_sha256"]
    assert record["adapt_on_over_off"] == round(on["decode_tok_s"] / off["decode_tok_s"], 3)
    assert "adapt on / off, phase two decode" in proc.stdout


def test_the_record_check_names_what_an_adapt_record_lacks(run):
    _, path = run
    record = json.loads(path.read_text())
    broken = copy.deepcopy(record)
    del broken["arms"][2]["tokens_identical_to_adapt_off"], broken["adapt_on_over_off"]
    del broken["arms"][1]["hit_rate_after"]
    assert check_record(broken, str(path)) == ["arms[1].hit_rate_after missing",
                                               "arms[2].tokens_identical_to_adapt_off missing",
                                               "adapt_on_over_off missing"]
    broken["arms"] = broken["arms"][1:]
    assert "expected ['strata phase one', 'strata adapt off', 'strata adapt on']" in \
        check_record(broken, str(path))[0]


def test_a_bad_argument_is_one_error_line():
    proc = subprocess.run([sys.executable, "benchmarks/bench_adapt.py", "--cpu", "--requests",
                           "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --requests 2 (>= 3)")
