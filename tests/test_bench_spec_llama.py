"""bench_spec.py's llama.cpp arm (llama-speculative on the same target and draft files).

- llama-speculative's printed summary is read from a real run's output (a CPU build of llama.cpp
  on the tiny q8_0 file drafting for itself; CI has no llama.cpp, so the output is kept here);
- with $LLAMA_SPECULATIVE naming a build, the bench's CPU run makes the arm from it for real;
- bad flags are one error line; must_show.sh's spec_quant part builds and passes the binary."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_spec import parse_speculative  # noqa: E402
from record_check import check_record  # noqa: E402

LLAMA = os.environ.get("LLAMA_SPECULATIVE", "")

# the standard error of `llama-speculative -m tiny.gguf -md tiny.gguf --no-repack -t 2 -c 1024
# -n 24 --temp 0 -s 1 --spec-draft-n-max 4 -p "The quick brown fox"` (a CPU build of llama.cpp,
# the tiny q8_0 file drafting for itself: every draft accepted), as it printed it
SELF_DRAFT_OUTPUT = """\
0.00.045.874 I cmn          init: llama threadpool init, n_threads = 2
0.00.664.782 I cmn          init: llama threadpool init, n_threads = 2
0.01.386.106 I encoded   14 tokens in    0.001 seconds, speed: 10479.042 t/s
0.01.386.107 I decoded   26 tokens in    0.698 seconds, speed:   37.258 t/s
0.01.386.107 I 
0.01.386.107 I n_draft   = 4
0.01.386.107 I n_predict = 26
0.01.386.107 I n_drafted = 20
0.01.386.107 I n_accept  = 20
0.01.386.108 I accept    = 100.000%
0.01.386.108 I 
0.01.386.108 I draft:

0.01.386.128 I 
0.01.386.129 I target:

0.01.386.137 I common_perf_print:    sampling time =       0.24 ms
0.01.386.138 I common_perf_print:    samplers time =       0.18 ms /    26 tokens
0.01.386.140 I common_perf_print:        load time =     611.11 ms
0.01.386.141 I common_perf_print: prompt eval time =     362.20 ms /    39 tokens (    9.29 ms per token,   107.67 tokens per second)
0.01.386.143 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.01.386.143 I common_perf_print:       total time =     731.43 ms /    40 tokens
0.01.386.144 I common_perf_print: unaccounted time =     368.98 ms /  50.4 %      (total - sampling - prompt eval - eval) / (total)
0.01.386.144 I common_perf_print:    graphs reused =          4
"""


def test_the_speculative_summary_is_read_from_its_output():
    assert parse_speculative(SELF_DRAFT_OUTPUT) == {
        "decoded": 26, "decode_s": 0.698, "tok_s": 37.258, "prompt_tokens": 14, "n_draft": 4,
        "n_predict": 26, "n_drafted": 20, "n_accept": 20, "accept": 1.0}
    # a draft of another quant, none accepted; nothing decoded: no summary
    other = (SELF_DRAFT_OUTPUT.replace("n_accept  = 20", "n_accept  = 0")
             .replace("accept    = 100.000%", "accept    = 0.000%"))
    got = parse_speculative(other)
    assert got["n_accept"] == 0 and got["accept"] == 0.0 and got["n_drafted"] == 20
    assert parse_speculative(SELF_DRAFT_OUTPUT.replace("decoded", "read")) == {}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    d = tmp_path_factory.mktemp("bench-spec-llama")
    write_synthetic(str(d / "tiny.gguf"), like="tiny", quant="q8_0", popularity="zipf:1.0")
    write_synthetic(str(d / "tiny-q2.gguf"), like="tiny", quant="q2_k", popularity="zipf:1.0")
    return d


def _bench(files: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_spec.py"),
                           "--model", "tiny.gguf", *args], cwd=files, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_llama_flags_are_one_error_line(files):
    for args, says in ((["--llama-speculative", "/bin/true"],
                        "error: --llama-speculative /bin/true: llama.cpp drafts with a draft "
                        "file: give --draft"),
                       (["--draft", "tiny-q2.gguf", "--llama-speculative", "none"],
                        "error: --llama-speculative none: not an executable file")):
        done = _bench(files, "--cpu", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.strip().splitlines() == [says]


@pytest.mark.skipif(not LLAMA, reason="$LLAMA_SPECULATIVE names no llama-speculative build")
def test_the_llama_arm_comes_from_a_real_llama_speculative_run(files):
    done = _bench(files, "--draft", "tiny-q2.gguf", "--cpu", "--tokens", "128", "--repeats", "1",
                  "--llama-speculative", LLAMA, "--out", "out", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [path] = (files / "out").glob("spec-tiny-q8_0-*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    llama = record["arms"][-1]
    assert llama["name"] == "llama.cpp" and llama["k"] == 4
    assert "-m tiny.gguf -md tiny-q2.gguf" in llama["command"]
    assert "-n 128 --temp 0" in llama["command"] and "--spec-draft-n-max 4" in llama["command"]
    assert llama["drafted"] > 0 and 0 <= llama["accepted"] <= llama["drafted"]
    assert llama["acceptance"] == round(llama["accepted"] / llama["drafted"], 4)
    assert llama["decode_tok_s"] == llama["tps_each"]["decode"][0] > 0
    assert llama["prompt_tokens_as_strata"] is True     # the same prompt, token for token
    assert llama["draft_model"]["quant"] == "q2_k"
    broken = copy.deepcopy(record)
    del broken["arms"][-1]["drafted"]
    assert check_record(broken, str(path)) == [f"arms[{len(record['arms']) - 1}].drafted missing"]


def test_must_show_spec_parts_give_the_commands(tmp_path):
    """must_show.sh --parts spec,spec_two_ranks,spec_quant: the serve file through one rank and
    two on one card, and the q8_0/q2_k pair beside llama-speculative built after the anchor;
    every flag one that bench_spec.py --help names."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "m")}
    done = subprocess.run(["bash", "benchmarks/must_show.sh", "--print", "--parts",
                           "spec,spec_two_ranks,spec_quant"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    benches = [ln[2:].split() for ln in done.stdout.splitlines()
               if ln.startswith("+ ") and "benchmarks/bench_spec.py" in ln]
    assert len(benches) == 3
    one, two, quant = benches
    assert one[one.index("--gpus") + 1] == "0" and two[two.index("--gpus") + 1] == "0,0"
    assert "--llama-speculative" not in one + two and "--draft" not in one + two
    assert quant[quant.index("--llama-speculative") + 1] == \
        ".anchor/llama.cpp/build/bin/llama-speculative"
    assert quant[quant.index("--model") + 1].endswith("must_spec_q8_0_zipf1.gguf")
    assert quant[quant.index("--draft") + 1].endswith("must_spec_q2_k_zipf1.gguf")
    synth = [ln for ln in done.stdout.splitlines() if ln.startswith("+ ") and " synth " in ln]
    assert any("--quant q2_k" in s for s in synth) and any("--quant q8_0" in s for s in synth)
    helps = subprocess.run([sys.executable, "benchmarks/bench_spec.py", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout
    for c in benches:
        for flag in (w for w in c if w.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", helps), flag
