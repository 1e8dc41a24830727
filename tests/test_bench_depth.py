"""`bench: depth`'s harness on a CPU rank: bench_depth.py's documented CPU example (the synthetic
file, then the bench at depths 0, 256 and 1,024 with --kv-resident 512) runs as written through a
real strata-launch --serve and writes a record that record_check.py accepts: one arm per depth,
each with its decode figure and, past depth 0, that prompt's; a depth past the file's trained
context or --max-context is refused in one error line before anything runs; the record checker
names what a depth record lacks. With $LLAMA_BENCH (a CPU llama-bench build the anchor describes),
llama.cpp's arms at the same depths too."""
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

BENCH = ROOT / "benchmarks" / "bench_depth.py"
ENV = {**os.environ,
       "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def bench(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-depth")
    commands = [c for c in documented_commands(BENCH)
                if "--cpu" in c.split() or c.startswith("strata-dist synth")]
    assert len(commands) == 2, commands
    out = ""
    for cmd in commands:
        if "bench_depth.py" in cmd:   # the file here, the script and its records module there
            cmd = cmd.replace("python benchmarks/", f"{sys.executable} {ROOT}/benchmarks/")
            cmd += f" --out {tmp / 'out'}"
        proc = subprocess.run(cmd, shell=True, cwd=tmp, env=ENV, capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
        out += proc.stdout
    [record] = list((tmp / "out").glob("depth-*.json"))
    return tmp, out, record


def test_the_cpu_run_writes_one_arm_per_depth(run):
    _, out, path = run
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["bench"] == "depth" and path.name.startswith("depth-tiny-q8_0-")
    arms = record["arms"]
    assert [(a["name"], a["depth"]) for a in arms] == [("strata", 0), ("strata", 256),
                                                       ("strata", 1024)]
    for a in arms:
        d = a["depth"]
        assert a["prompt_tokens"] == max(d, 1) and a["new_tokens"] == 16
        assert a["decode_tok_s"] > 0 and len(a["tps_each"]["decode"]) == 2
        # every request measured one after another: the launch's context holds the deepest
        assert a["max_context"] == 1024 + 16 and "--max-context 1040" in a["command"]
        assert "--kv-resident 512" in a["command"] and a["kv_resident"] == "512"
        assert a["predicted_ms_per_token"] > 0
        if d:
            assert set(a["prefill_tok_s"]) == {str(d)} and len(a["tps_each"][str(d)]) == 2
            assert f"the {d}-id prompt {a['prefill_tok_s'][str(d)]:.1f} tok/s" in out
        else:
            assert "prefill_tok_s" not in a
    # prompts of their own: the three depths' first requests decode different tokens
    assert len({a["tokens_sha256"] for a in arms}) == 3


def test_every_cell_resident_decodes_the_tokens_of_the_kv_resident_run(run):
    """The same depths with every cell resident (no --kv-resident) into the same --out: each
    depth's tokens are said to be those of the --kv-resident 512 record (the ring and the host
    cells read as the card would, on the CPU rank)."""
    tmp, _, first = run
    done = bench(["--model", "tiny.gguf", "--cpu", "--depths", "0,256,1024", "--tokens", "16",
                  "--repeats", "1", "--out", str(first.parent)], tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    same = [ln for ln in done.stdout.splitlines() if f"the same tokens as {first.name}" in ln]
    assert len(same) == 3, done.stdout
    second = next(p for p in first.parent.glob("depth-*.json") if p != first)
    arms = json.loads(second.read_text())["arms"]
    assert all("--kv-resident" not in a["command"] and a["kv_resident"] == "all" for a in arms)
    assert [a["tokens_sha256"] for a in arms] == [
        a["tokens_sha256"] for a in json.loads(first.read_text())["arms"]]
    second.unlink()        # the module's other tests read the one record


@pytest.mark.parametrize("args, said", [
    (["--depths", "0,8192"], "--depths 8192: a 8192-id prompt and --tokens 16 new tokens pass the "
                             "4096 positions tiny.gguf was trained for (give --max-context to go "
                             "past them)"),
    (["--depths", "0,2040", "--max-context", "2048"],
     "--depths 2040: a 2040-id prompt and --tokens 16 new tokens pass --max-context 2048"),
    (["--depths", "0,256", "--llama-prompts", "512"], "--llama-prompts 512: not a depth > 0"),
    (["--depths", "0,x"], "--depths 0,x: comma-separated whole numbers"),
])
def test_a_depth_the_run_cannot_hold_is_refused_in_one_line(run, args, said):
    tmp = run[0]
    done = bench(["--model", "tiny.gguf", "--cpu", "--tokens", "16", "--out",
                  str(tmp / "refused"), *args], tmp, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: {said}") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp / "refused").exists()


def test_strata_launchs_refusal_of_a_kv_resident_comes_back_in_one_line(run):
    """--kv-resident goes to strata-launch as given: below its floor, the launch's own words."""
    tmp = run[0]
    done = bench(["--model", "tiny.gguf", "--cpu", "--depths", "0,256", "--tokens", "16",
                  "--kv-resident", "8", "--out", str(tmp / "floor")], tmp, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: strata-launch ") and "--kv-resident 8 is below its floor" in last


def test_the_record_check_names_what_a_depth_record_lacks(run):
    path = run[2]
    record = json.loads(path.read_text())
    broken = copy.deepcopy(record)
    del broken["arms"][1]["prefill_tok_s"]
    broken["arms"][2]["depth"] = "1024"
    broken["arms"][0]["prompt_tokens"] = 32
    broken["arms"].append(copy.deepcopy(record["arms"][0]))
    broken["arms"].append({**copy.deepcopy(record["arms"][0]), "name": "llama.cpp"})
    said = check_record(broken, str(path))
    assert "arms[1].prefill_tok_s lacks the 256-id prompt's figure" in said
    assert "arms[2].depth '1024': a whole number >= 0" in said
    assert "arms[0].prompt_tokens 32 at depth 0: the prompt is the depth (one id at depth 0)" \
        in said
    assert "arms[3].a second strata arm at depth 0 (arms[0])" in said
    assert "llama.cpp arms at depths [0], strata's at [0, 256]: the same depths" in said
    del broken["arms"][0]["decode_tok_s"]
    assert "arms[0].decode_tok_s missing (the figure at depth 0)" in check_record(broken, str(path))


LLAMA_BENCH = os.environ.get("LLAMA_BENCH", "")


@pytest.mark.skipif(not LLAMA_BENCH, reason="$LLAMA_BENCH names no llama-bench build")
def test_llama_cpp_arms_at_the_same_depths(run):
    """With a real llama-bench: an arm per depth (`-d D -p 0 -n 128`, --repack 0 on the CPU) and
    the deepest prompt tuned over every -ub, the record complete."""
    tmp = run[0]
    out = tmp / "with-llama"
    done = bench(["--model", "tiny.gguf", "--cpu", "--depths", "0,512", "--tokens", "128",
                  "--repeats", "1", "--llama-bench", LLAMA_BENCH, "--out", str(out)], tmp,
                 timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("depth-*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    llama = [a for a in record["arms"] if a["name"] == "llama.cpp"]
    assert [a["depth"] for a in llama] == [0, 512]
    for a in llama:
        assert f"-d {a['depth']} -p 0 -n 128" in a["command"] and "--repack 0" in a["command"]
        assert a["new_tokens"] == 128 and a["decode_tok_s"] > 0
    assert "prefill_tok_s" not in llama[0]
    assert set(llama[1]["ubatch_sweep"]) == {"512", "1024", "2048", "4096"}
    assert "-p 512 -n 0" in llama[1]["prompt_command"]
    assert "strata / llama.cpp, depth 512: decode " in done.stdout


def test_must_show_gives_the_depth_parts_only_flags_bench_depth_takes(tmp_path):
    """must_show.sh's depth parts (off by default): the 2507 geometry's Q4_K file at depths 0,
    32K and 128K beside llama-bench, the 131,072-token prompt beside its tuned one, and a rank
    held to 16 GB with --kv-resident auto; every flag one bench_depth.py --help names."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "m")}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "must_show.sh"), "--parts",
                           "depth,depth_prompt,depth_resident", "--print"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    commands = [ln[2:].split() for ln in done.stdout.splitlines() if ln.startswith("+ ")]
    synth, *benches = commands
    assert "--like" in synth and synth[synth.index("--like") + 1] == "qwen3-30b-a3b-2507"
    assert synth[synth.index("--quant") + 1] == "q4_k"
    assert len(benches) == 3 and all("benchmarks/bench_depth.py" in c for c in benches)
    helps = subprocess.run([sys.executable, str(BENCH), "--help"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=60).stdout
    for c in benches:
        for flag in (w for w in c if w.startswith("--")):
            assert f"{flag} " in helps or f"{flag}\n" in helps, flag
    depth, prompt, held = (" ".join(c) for c in benches)
    assert "--depths 0,32768,131072" in depth and "--llama-bench" in depth
    assert "--depths 131072 --llama-prompts 131072" in prompt and "--llama-bench" in prompt
    assert "--vram-budget 16G --kv-resident auto" in held and "--llama-bench" not in held
