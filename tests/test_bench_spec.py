"""`bench: spec`'s harness on a CPU rank: bench_spec.py's documented CPU example (the two synthetic
files, then the bench) runs as written through real strata-launch --serve processes and writes a
record that record_check.py accepts: every speculative arm's greedy tokens are its K = 0 arm's,
the self-draft accepts every draft it makes, the counts are the line protocol's, and each arm
carries the planner's prediction beside its measure."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from record_check import check_record  # noqa: E402
from test_bench_examples import documented_commands  # noqa: E402
from strata_dist.plan.speculation import spec_tok_s  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-spec")
    env = {**os.environ,
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    commands = [c for c in documented_commands(ROOT / "benchmarks" / "bench_spec.py")
                if ("--cpu" in c.split() or c.startswith("strata-dist synth"))
                and "--mtp" not in c.split()]      # the MTP arm's: test_bench_spec_mtp.py
    assert len(commands) == 3, commands
    out = ""
    for cmd in commands:
        if "bench_spec.py" in cmd:   # the files here, the script and its records module there
            cmd = cmd.replace("python benchmarks/", f"{sys.executable} {ROOT}/benchmarks/")
            cmd += f" --out {tmp / 'out'}"
        proc = subprocess.run(cmd, shell=True, cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
        out += proc.stdout
    records = list((tmp / "out").glob("spec-*.json"))
    assert len(records) == 1, records
    return out, records[0]


def test_the_cpu_run_writes_a_complete_record(run):
    out, path = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["bench"] == "spec" and record["model"]["quant"] == "q8_0"
    arms = {a["name"]: a for a in record["arms"]}
    assert list(arms) == ["strata", "strata repeating prompt", "strata self-draft",
                          "strata quantized draft", "strata ngram"]
    for name in ("strata self-draft", "strata quantized draft", "strata ngram"):
        a = arms[name]
        assert a["k"] == 4 and "--spec 4" in a["command"], name
        assert a["tokens_identical_to_k0"] is True, name
        assert a["decode_tok_s"] > 0 and a["new_tokens"] == 16
        reference = arms["strata repeating prompt" if name == "strata ngram" else "strata"]
        assert a["over_k0"] == round(a["decode_tok_s"] / reference["decode_tok_s"], 3)
    self_draft = arms["strata self-draft"]
    assert self_draft["accepted"] == self_draft["drafted"] > 0 and self_draft["acceptance"] == 1
    assert arms["strata quantized draft"]["draft_model"]["quant"] == "q2_k"
    assert "--draft-model tiny-q2.gguf" in arms["strata quantized draft"]["command"]
    assert "--draft ngram" in arms["strata ngram"]["command"]
    assert f"{self_draft['accepted']}/{self_draft['drafted']} drafts accepted" in out


def test_each_arm_carries_the_planners_prediction(run):
    """Beside each arm's measure, its launch's plan (--plan-only --json): K = 0's tok/s, and a
    speculative arm's at 0.5/0.7/0.9 and at the acceptance it measured."""
    arms = {a["name"]: a for a in json.loads(run[1].read_text())["arms"]}
    k0 = arms["strata"]["predicted"]["k0_tok_s"]
    assert k0 > 0 and "window_ms" not in arms["strata"]["predicted"]
    for name in ("strata self-draft", "strata quantized draft", "strata ngram"):
        p, a = arms[name]["predicted"], arms[name]
        assert p["k"] == 4 and p["k0_tok_s"] == k0 and set(p["tok_s"]) == {"0.5", "0.7", "0.9"}
        assert p["tok_s_at_measured_acceptance"] == pytest.approx(
            spec_tok_s(a["acceptance"], 4, p["window_ms"], p["drafter_ms"]), abs=0.01)
    assert arms["strata self-draft"]["predicted"]["drafter_ms"] > 0      # the draft model's steps
    assert arms["strata ngram"]["predicted"]["drafter_ms"] == 0


def test_the_record_check_names_what_a_spec_record_lacks(run):
    _, path = run
    record = json.loads(path.read_text())
    broken = copy.deepcopy(record)
    del broken["arms"][2]["drafted"]
    broken["arms"][4]["tokens_identical_to_k0"] = "yes"
    broken["arms"] = [a for a in broken["arms"] if a["name"] != "strata ngram"] + [
        broken["arms"][4]]
    broken["arms"][-1]["name"] = "strata n-gram"
    said = check_record(broken, str(path))
    assert "arms lack 'strata ngram'" in said
    assert "arms[2].drafted missing" in said
    assert "arms[4].tokens_identical_to_k0 is not a bool" in said
