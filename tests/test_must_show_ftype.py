"""benchmarks/must_show.sh's file-type parts (issues 43 and 44's records per llama.cpp file type):
- `--print`: one synth per file type at the Qwen3-30B-A3B geometry with that `--quant`, its decode
  beside llama-bench and its 4,096-token prompt beside the tuned llama-bench, every flag one the
  benchmark's --help names; the 3-shard part writes the q4_k_m file again with --split-max-size
  and reads its tokens against the unsplit file (--unsplit);
- `--cpu` (the dry run on CPU ranks and the tiny geometry): ftype_iq3_s and ftype_q4_k_m_split3
  and ftype_q4_k_m_split3_prompt run end to end (the other seven types run the same commands with another --quant), every
  record complete per record_check, model.quant the file type's name, model.shards the shard
  count, and the split file's greedy tokens those of the same file unsplit."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from record_check import check_record  # noqa: E402

FTYPES = ["q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k", "q8_0", "iq3_s", "iq4_xs", "iq2_xxs"]
PARTS = ",".join([f"ftype_{t}" for t in FTYPES]
                 + ["ftype_q4_k_m_split3", "ftype_q4_k_m_split3_prompt"])


def must_show(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    env.update(OUT=str(tmp_path / "out"), MODELS=str(tmp_path / "m"), PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", "benchmarks/must_show.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_ftype_parts_give_each_file_type_its_synth_decode_and_prompt(tmp_path):
    done = must_show(tmp_path, "--print", "--parts", PARTS, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    commands = [ln[2:].split() for ln in done.stdout.splitlines() if ln.startswith("+ ")]
    synths = [c for c in commands if "synth" in c]
    decodes = [c for c in commands if "benchmarks/bench_decode.py" in c]
    prompts = [c for c in commands if "benchmarks/bench_prefill.py" in c]
    assert [value(c, "--quant") for c in synths] == FTYPES + ["q4_k_m", "q4_k_m"]
    assert {value(c, "--like") for c in synths} == {"qwen3-30b-a3b"}
    assert len(decodes) == len(prompts) == len(FTYPES) + 1
    for ftype, synth, decode, prompt in zip(FTYPES, synths, decodes, prompts):
        f = value(synth, "synth")
        assert value(decode, "--model") == f == value(prompt, "--model"), ftype
        assert f.endswith(f"must_{ftype}_zipf1.gguf")
        assert value(decode, "--tokens") == "128"
        assert value(prompt, "--prompts") == "4096" and value(prompt, "--ncmoe") == "0"
        assert "--llama-bench" in decode and "--llama-bench" in prompt
    split, split_decode = synths[-1], decodes[-1]
    assert value(split, "--split-max-size") and value(split, "synth").endswith("_split3.gguf")
    assert value(split_decode, "--model").endswith("_split3-00001-of-00003.gguf")
    assert value(split_decode, "--unsplit") == value(synths[-2], "synth")
    assert "--llama-bench" in split_decode
    split_prompt = prompts[-1]
    assert value(split_prompt, "--model") == value(split_decode, "--model")
    assert value(split_prompt, "--prompts") == "4096" and "--llama-bench" in split_prompt
    for path, benches in (("benchmarks/bench_decode.py", decodes),
                          ("benchmarks/bench_prefill.py", prompts)):
        helps = subprocess.run([sys.executable, path, "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60).stdout
        for c in benches:
            for flag in (w for w in c[c.index(path) + 1:] if w.startswith("--")):
                assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", helps), (path, flag)
    bad = must_show(tmp_path, "--print", "--parts", "ftype_q4_k", timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith(
        "error: --parts: unknown part ftype_q4_k (file types: q4_k_m")


def test_ftype_parts_cpu_dry_run_writes_each_file_types_records(tmp_path):
    done = must_show(tmp_path, "--cpu", "--parts",
                     "ftype_iq3_s,ftype_q4_k_m_split3,ftype_q4_k_m_split3_prompt", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    records = {}
    for path in sorted(glob.glob(str(tmp_path / "out" / "*.json"))):
        record = json.loads(Path(path).read_text())
        assert check_record(record, path) == [], path
        m = record["model"]
        records[(record["bench"], m["quant"], m["shards"])] = record
    assert sorted(records) == [("decode", "iq3_s", 1), ("decode", "q4_k_m", 3),
                               ("prefill", "iq3_s", 1), ("prefill", "q4_k_m", 3)]
    assert list(records[("prefill", "iq3_s", 1)]["arms"][0]["prefill_tok_s"]) == ["256"]
    split = records[("decode", "q4_k_m", 3)]["arms"][0]
    assert split["tokens_identical_to_unsplit"] is True
    assert split["unsplit_tokens_sha256"] == split["tokens_sha256"]
    assert "tokens are identical to the unsplit file's" in done.stdout
    # a file-type part's file is gone at its end (the device's disk holds one big file at a
    # time but for the q4_k_m file unsplit and in three shards, kept for the next call's part)
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "m" / "must_*.gguf"))) \
        == ["must_q4_k_m_zipf1.gguf"] + [f"must_q4_k_m_zipf1_split3-0000{i}-of-00003.gguf"
                                         for i in (1, 2, 3)]
