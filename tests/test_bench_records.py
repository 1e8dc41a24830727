"""The benchmark harness on CPU ranks: bench_decode.py --cpu runs a real strata-launch --serve and
writes a record (../RECORDS.md's fields) whose strata arm holds the plan's predicted ms/token
beside the measured one; bench_prefill.py --cpu writes one arm per variant; bench_tiers.py --cpu
one arm per tier arrangement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata_dist.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[1]


def test_decode_record_holds_prediction_beside_measurement(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    env = {**os.environ, "STRATA_COMMIT": "abc1234", "STRATA_KERNEL_SHAPE": "int_down=1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--model",
                           str(model), "--cpu", "--tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("decode-tiny-f32-*.json")
    record = json.loads(path.read_text())
    assert record["bench"] == "decode" and record["commit"] == "abc1234"
    assert record["model"]["like"] == "tiny" and record["model"]["quant"] == "f32"
    [arm] = record["arms"]
    assert arm["name"] == "strata" and arm["gpus"] == 1
    # the command names the environment that picks the build and path measured
    assert arm["command"].startswith("STRATA_KERNEL_SHAPE=int_down=1 strata-launch "), arm
    assert arm["predicted_ms_per_token"] > 0
    assert abs(arm["measured_ms_per_token"] * arm["decode_tok_s"] - 1e3) < 1.0
    assert len(arm["tokens_sha256"]) == 64
    # the next run of the same file says whether its tokens are the record's
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from records import model_facts, tokens_against_records
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    facts = model_facts(str(model))
    same = tokens_against_records("decode", facts, "strata", arm["tokens_sha256"], str(out))
    assert same.startswith("strata: the same tokens as decode-tiny-f32-") and "abc1234" in same
    other = tokens_against_records("decode", facts, "strata", "0" * 64, str(out))
    assert "tokens DIFFER (00000000… against" in other
    assert "no earlier record" in tokens_against_records("decode", {**facts, "bytes": 1}, "strata",
                                                         arm["tokens_sha256"], str(out))


def _prefill_record(tmp_path, *flags) -> tuple[dict, str]:
    """bench_prefill.py --cpu on the tiny Q8_0 file (128-token prompts in chunks of 64) with
    `flags`: its record and its stdout."""
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_prefill.py"),
                           "--model", str(model), "--cpu", "--budget", "400M", "--prompts", "128",
                           "--chunk", "64", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("prefill-tiny-q8_0-*.json")
    return json.loads(path.read_text()), done.stdout


def test_prefill_record_names_every_arm(tmp_path):
    """bench_prefill.py --cpu: loans on and off, routing on the host, the general path, the
    array prompt steps (environment switches a CPU rank ignores: the harness, not the speed), one
    record with an arm each, named as ../RECORDS.md asks."""
    record, stdout = _prefill_record(tmp_path, "--host-routing", "--general-path",
                                     "--array-prompt-steps")
    assert "general path / loans on" in stdout
    assert record["bench"] == "prefill"
    assert [a["name"] for a in record["arms"]] == [
        "strata", "strata loans off", "strata host routing", "strata general path",
        "strata array prompt steps"]
    assert all(a["prefill_tok_s"]["128"] > 0 for a in record["arms"])
    commands = {a["name"]: a["command"] for a in record["arms"]}
    assert commands["strata"].startswith("strata-launch --model M --cpu-ranks 1 --vram-budget 400M")
    assert commands["strata loans off"].endswith("--no-prompt-loans --serve")
    assert commands["strata general path"].startswith(
        "STRATA_GROUPED_EXPERTS=0 STRATA_FLASH_PREFILL=0 strata-launch"), commands
    assert commands["strata array prompt steps"].startswith("STRATA_FUSED_PROMPT_OPS=0 strata-launch")


def test_prefill_record_of_loans_on_alone(tmp_path):
    """--only-loans-on: one arm, and the record holds it."""
    record, _ = _prefill_record(tmp_path, "--only-loans-on", "--repeats", "2")
    assert [a["name"] for a in record["arms"]] == ["strata"]


def test_prefill_record_of_two_stages_compares_their_tokens(tmp_path):
    """--two-stages: one more arm, two stage ranks reading the same prompts in pipelined
    chunks; its first tokens are the one-rank arm's (CPU ranks: `strata two stages`, gpus 0)."""
    record, stdout = _prefill_record(tmp_path, "--only-loans-on", "--repeats", "2",
                                     "--two-stages", "0,1")
    assert [a["name"] for a in record["arms"]] == ["strata", "strata two stages"]
    two = record["arms"][1]
    assert two["tokens_identical_to_1gpu"] is True and two["prefill_tok_s"]["128"] > 0
    assert "--cpu-ranks 2" in two["command"] and "--layer-split auto" in two["command"]
    assert "two stages: first tokens identical to one card's" in stdout


def test_offload_record_times_prefill_and_decode_apart(tmp_path):
    """bench_offload.py --cpu: a routing profile first, then the arm's prompt and decode as two
    requests (llama-bench's pp and tg); the record says which request its tokens are of, and a
    later run compares its tokens only with an earlier arm of the same request."""
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    env = {**os.environ, "STRATA_COMMIT": "def5678"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--model", str(model),
           "--cpu", "--vram-budget", "165M", "--tokens", "6", "--prefill-tokens", "64",
           "--profile-prompts", "1", "--context", "256", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("offload-tiny-q8_0-*.json")
    [arm] = json.loads(path.read_text())["arms"]
    assert arm["name"] == "strata" and arm["vram_budget"] == "165M"
    assert arm["decode_prompt_tokens"] == 16 and arm["new_tokens"] == 6
    assert set(arm["prefill_tok_s"]) == {"64"} and arm["prefill_tok_s"]["64"] > 0
    assert arm["decode_tok_s"] > 0 and sum(arm["tiers"].values()) > 0
    assert "no earlier record of this file, decode_prompt_tokens 16, new_tokens 6" in done.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from records import model_facts, tokens_against_records
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    facts = model_facts(str(model))
    like = {"decode_prompt_tokens": 16, "new_tokens": 6}
    same = tokens_against_records("offload", facts, "strata", arm["tokens_sha256"], str(out), like)
    assert same.startswith("strata: the same tokens as offload-tiny-q8_0-"), same
    other = tokens_against_records("offload", facts, "strata", arm["tokens_sha256"], str(out),
                                   {**like, "new_tokens": 7})
    assert "no earlier record" in other
    refused = subprocess.run(cmd[:-2] + ["--vram-budget", "match"], capture_output=True,
                             text=True, timeout=120, env=env, cwd=ROOT)
    assert refused.returncode == 2 and "--llama-bench" in refused.stderr


def test_tiers_record_moves_host_misses_to_the_helper_tier(tmp_path):
    """bench_tiers.py --cpu: two stage ranks, the second's leftover a helper tier holding the
    first's hottest misses. Every arm gives the one-rank arm's tokens; the helper arm computes
    per token exactly the expert computations the no-helper arm takes from the host, less
    those it leaves there (the same cache hits in both); the plan prices the tier."""
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tiers.py"),
                           "--model", str(model), "--cpu", "--budgets", "99940K,210M",
                           "--resident-budget", "400M", "--split", "2", "--tokens", "12",
                           "--profile-prompts", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("offload-tiny-q8_0-*-helper.json")
    record = json.loads(path.read_text())
    assert record["bench"] == "offload"
    arms = {a["name"]: a for a in record["arms"]}
    assert list(arms) == ["strata", "strata resident", "strata helper tier", "strata no helper tier"]
    assert all(a["tokens_identical_to_1gpu"] for a in record["arms"][1:])
    per_token = 4 * 2    # the tiny geometry: 4 layers, top-2
    for a in record["arms"]:
        assert sum(a["tiers_per_token"].values()) == pytest.approx(per_token, abs=0.02), a
        assert a["predicted_ms_per_token"] > 0 and a["new_tokens"] == 12
    on, off = arms["strata helper tier"]["tiers_per_token"], arms["strata no helper tier"]["tiers_per_token"]
    assert on["remote"] > 0 and off["remote"] == 0 and on["hits"] == off["hits"] < per_token
    assert on["remote"] + on["host"] == pytest.approx(off["host"], abs=0.02)
    assert "--no-remote-auto" in arms["strata no helper tier"]["command"]
    assert "helper_read_us" in arms["strata helper tier"]
    assert "helper tier / no helper tier:" in done.stdout
