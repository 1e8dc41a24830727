"""bench_spec.py's `--draft mtp` arm on a CPU rank: its documented MTP example (a tiny qwen3next
file written with one multi-token-prediction block, then the bench with --mtp) runs as written
through real strata-launch --serve processes and writes a record that record_check.py accepts,
whose `strata mtp` arm drafted with the file's block at K = 4, decoded the K = 0 arm's greedy
tokens and carries its counts and the planner's prediction; a file without a block is refused in
one error line before any arm runs."""
from __future__ import annotations

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

BENCH = ROOT / "benchmarks" / "bench_spec.py"
ENV = {**os.environ,
       "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-spec-mtp")
    commands = [c for c in documented_commands(BENCH)
                if ("--cpu" in c.split() or c.startswith("strata-dist synth"))
                and "--mtp" in c.split()]
    assert len(commands) == 2, commands
    out = ""
    for cmd in commands:
        if "bench_spec.py" in cmd:
            cmd = cmd.replace("python benchmarks/", f"{sys.executable} {ROOT}/benchmarks/")
            cmd += f" --out {tmp / 'out'}"
        proc = subprocess.run(cmd, shell=True, cwd=tmp, env=ENV, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
        out += proc.stdout
    [record] = list((tmp / "out").glob("spec-*.json"))
    return tmp, out, record


def test_the_mtp_arm_drafts_with_the_files_block_and_keeps_the_tokens(run):
    _, out, path = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["model"]["like"] == "tiny-next"
    arms = {a["name"]: a for a in record["arms"]}
    assert list(arms) == ["strata", "strata repeating prompt", "strata self-draft",
                          "strata ngram", "strata mtp"]
    mtp = arms["strata mtp"]
    assert "--spec 4 --draft mtp" in mtp["command"] and mtp["k"] == 4
    assert mtp["tokens_identical_to_k0"] is True and mtp["new_tokens"] == 16
    # the block drafted on every window (its drafts are the line protocol's counts)
    assert mtp["drafted"] > 0 and 0 <= mtp["accepted"] <= mtp["drafted"]
    assert mtp["acceptance"] == round(mtp["accepted"] / mtp["drafted"], 4)
    assert mtp["over_k0"] == round(mtp["decode_tok_s"] / arms["strata"]["decode_tok_s"], 3)
    assert mtp["predicted"]["drafter"] == "mtp" and mtp["predicted"]["k"] == 4
    assert mtp["predicted"]["drafter_ms"] > 0          # the block's own steps, priced
    assert f"strata mtp: {mtp['decode_tok_s']:.1f} tok/s decode, K 4: " \
           f"{mtp['accepted']}/{mtp['drafted']} drafts accepted" in out


@pytest.mark.parametrize("like, said", [
    ("tiny", "error: --mtp: tiny.gguf is a qwen3moe model; the MTP drafter runs the "
             "multi-token-prediction block of qwen3next files"),
    ("tiny-next", "error: --mtp: tiny.gguf has no multi-token-prediction block"),
])
def test_a_file_without_a_block_is_refused_before_any_arm(tmp_path, like, said):
    subprocess.run(["strata-dist", "synth", "tiny.gguf", "--like", like, "--quant", "q8_0",
                    "--popularity", "zipf:1.0", "--quiet"], cwd=tmp_path, env=ENV, check=True,
                   capture_output=True, timeout=60)
    done = subprocess.run([sys.executable, str(BENCH), "--model", "tiny.gguf", "--mtp", "--cpu",
                           "--out", str(tmp_path / "out")], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "out").exists()
