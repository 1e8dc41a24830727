"""The benchmark harness on CPU ranks: bench_decode.py --cpu runs a real strata-launch --serve (and
one more per --shape-arm build) and
writes a record (../shared/RECORDS.md's fields) whose strata arm holds the plan's predicted
ms/token beside the measured one; bench_prefill.py --cpu writes one arm per variant;
bench_tiers.py --cpu one arm per tier arrangement. Every record under benchmarks/results/ holds
the format's fields (or is marked legacy), the commit is computed (git, or the archive of a copy
without .git), a record is never overwritten, a measured request that RESUMEs is refused, and the
routing profile's prompts are none of the measured ones."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strata_dist.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import records  # noqa: E402
from record_check import check_record  # noqa: E402
from records import model_facts, tokens_against_records  # noqa: E402


def test_decode_record_holds_prediction_beside_measurement(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    env = {**os.environ, "STRATA_KERNEL_SHAPE": "int_down=1"}
    env.pop("STRATA_KERNEL_CUBINS", None)
    expected = records.commit_info()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--model",
                           str(model), "--cpu", "--tokens", "16", "--out", str(out),
                           "--shape-arm", "int_gate_up=0,int_down=0", "--nvrtc-arm"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("decode-tiny-f32-*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    assert record["kernels_built_by"] == "nvrtc"       # no $STRATA_KERNEL_CUBINS here
    # the commit is git's own of this tree, never typed in; the file is named by it
    assert record["bench"] == "decode" and record["commit"] == expected["commit"]
    assert record["commit_source"] == "git" and path.name.endswith(f"-{expected['commit']}.json")
    assert record["options"]["STRATA_KERNEL_SHAPE"] == "int_down=1"
    assert record["options"]["STRATA_DECODE_GRAPH"] == "1"      # a default, in force
    assert record["model"]["popularity"] == "zipf:1" and record["model"]["types"]["F32"] > 0
    assert record["model"]["like"] == "tiny" and record["model"]["quant"] == "f32"
    [arm, compiled, built] = record["arms"]
    # --nvrtc-arm: one more launch of the same build (on CPU ranks no kernel is compiled)
    assert compiled["tokens_identical_to_first_arm"] is True and compiled["new_tokens"] == 16
    assert compiled["kernels_built_by"] is None and arm["kernels_built_by"] is None
    # --shape-arm: a second launch of its own build, named in its command and its own field
    assert built["kernel_shape"] == "int_gate_up=0,int_down=0" and "kernel_shape" not in arm
    assert built["command"].startswith("STRATA_KERNEL_SHAPE=int_gate_up=0,int_down=0 strata-launch ")
    assert built["tokens_identical_to_first_arm"] is True and built["new_tokens"] == 16
    assert built["first_token_differing"] is None
    assert arm["name"] == "strata" and arm["gpus"] == 1 and arm["new_tokens"] == 16
    assert len(arm["tps_each"]["decode"]) == 3
    # the command names the environment that picks the build and path measured
    assert arm["command"].startswith("STRATA_KERNEL_SHAPE=int_down=1 strata-launch "), arm
    assert arm["predicted_ms_per_token"] > 0
    assert abs(arm["measured_ms_per_token"] * arm["decode_tok_s"] - 1e3) < 1.0
    assert len(arm["tokens_sha256"]) == 64
    # the next run of the same file says whether its tokens are the record's
    facts = model_facts(str(model))
    same = tokens_against_records("decode", facts, "strata", arm["tokens_sha256"], str(out))
    assert same.startswith("strata: the same tokens as decode-tiny-f32-")
    assert expected["commit"] in same
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
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    return record, done.stdout


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
    env = dict(os.environ)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--model", str(model),
           "--cpu", "--vram-budget", "165M", "--tokens", "16", "--prefill-tokens", "64",
           "--profile-prompts", "1", "--context", "256", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("offload-tiny-q8_0-*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    [arm] = record["arms"]
    assert arm["name"] == "strata" and arm["vram_budget"] == "165M"
    assert arm["decode_prompt_tokens"] == 16 and arm["new_tokens"] == 16
    assert set(arm["prefill_tok_s"]) == {"64"} and arm["prefill_tok_s"]["64"] > 0
    # the prompt figure is the median of its repeats, each kept
    assert len(arm["tps_each"]["64"]) == 3 and "back to back" in arm["prompt_timing"]
    assert arm["prefill_tok_s"]["64"] == sorted(arm["tps_each"]["64"])[1]
    assert arm["decode_tok_s"] > 0 and sum(arm["tiers"].values()) > 0
    assert "no earlier record of this file, decode_prompt_tokens 16, new_tokens 16" in done.stdout
    facts = model_facts(str(model))
    like = {"decode_prompt_tokens": 16, "new_tokens": 16}
    same = tokens_against_records("offload", facts, "strata", arm["tokens_sha256"], str(out), like)
    assert same.startswith("strata: the same tokens as offload-tiny-q8_0-"), same
    other = tokens_against_records("offload", facts, "strata", arm["tokens_sha256"], str(out),
                                   {**like, "new_tokens": 17})
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
    [path] = out.glob("offload-tiny-q8_0-*.json")
    record = json.loads(path.read_text())
    assert record["bench"] == "offload" and record["tag"] == "helper"
    assert check_record(record, str(path)) == []
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


def test_every_record_in_results_holds_the_format():
    """Every record under benchmarks/results/ (a file with `arms`; kernels/' own figures are not
    records) has each field ../shared/RECORDS.md requires, or says it is older (`legacy`)."""
    paths = sorted((ROOT / "benchmarks" / "results").rglob("*.json"))
    assert paths
    checked = 0
    for path in paths:
        record = json.loads(path.read_text())
        if not isinstance(record.get("arms"), list):
            continue
        checked += 1
        assert check_record(record, str(path)) == [], path.name
    assert checked >= 40


def _complete_record() -> tuple[dict, str]:
    """A record as the benchmarks write it now: a strata arm and a tuned llama.cpp arm."""
    record = {"bench": "offload", "date": "2026-12-05", "time": "07:00:01",
              "commit": "abc1234-dirty", "commit_source": "archive",
              "options": {"STRATA_PDL": "1"},
              "machine": {"gpus": ["NVIDIA H100"], "driver": "580", "cpu_cores": 16,
                          "cpu": "AMD EPYC"},
              "model": {"like": "qwen3-30b-a3b", "quant": "q4_k", "popularity": "uniform",
                        "bytes": 1, "types": {"Q4_K": 1}},
              "arms": [{"name": "strata", "gpus": 1, "command": "strata-launch ...",
                        "decode_tok_s": 1.0, "new_tokens": 128, "prefill_tok_s": {"4096": 1.0},
                        "tps_each": {"4096": [1.0], "decode": [1.0]}},
                       {"name": "llama.cpp", "gpus": 1, "command": "llama-bench ...",
                        "build": "version: 1 (x)", "decode_tok_s": 1.0, "new_tokens": 128,
                        "prefill_tok_s": {"4096": 1.0}, "tps_each": {"4096": [1.0]},
                        "ubatch_sweep": {u: {"4096": 1.0} for u in ("512", "1024", "2048", "4096")},
                        "mmap_sweep": {"on": {"4096": 1.0}, "off": {"4096": 1.0}}}]}
    return record, "offload-qwen3-30b-a3b-q4_k-2026-12-05-070001-abc1234-dirty.json"


@pytest.mark.parametrize("where, key", [
    ((), "time"), ((), "commit"), ((), "commit_source"), ((), "options"),
    (("machine",), "gpus"), (("machine",), "cpu"), (("model",), "popularity"),
    (("model",), "types"), (("arms", 0), "new_tokens"), (("arms", 0), "tps_each"),
    (("arms", 1), "build"), (("arms", 1), "ubatch_sweep"), (("arms", 1), "mmap_sweep")])
def test_checker_names_a_missing_field(where, key):
    record, name = _complete_record()
    assert check_record(record, name) == []
    obj = record
    for step in where:
        obj = obj[step]
    del obj[key]
    problems = check_record(record, name)
    assert problems and any(key in p for p in problems), problems
    assert check_record({**record, "legacy": True}, name) == []     # older than the format


def test_checker_holds_the_tuned_anchor_and_the_name():
    record, name = _complete_record()
    del record["arms"][1]["ubatch_sweep"]["4096"]
    assert any("-ub 4096" in p for p in check_record(record, name))
    record, name = _complete_record()
    record["arms"][1]["new_tokens"] = 64                      # llama.cpp decodes -n >= 128
    assert any("-n >= 128" in p for p in check_record(record, name))
    record, name = _complete_record()
    record["arms"][0]["new_tokens"] = 100                     # strata generates at least as many
    assert any("fewer than llama.cpp's" in p for p in check_record(record, name))
    record, name = _complete_record()
    assert any("file name" in p for p in check_record(record, name.replace("070001", "070002")))


def test_a_record_is_never_overwritten(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="uniform", seed=0)
    facts = model_facts(str(model))
    first = records.Recorder("decode", facts, str(tmp_path))
    path = Path(first.save([{"name": "strata", "gpus": 0, "command": "x"}]))
    assert path.name.startswith("decode-tiny-q8_0-") and facts["popularity"] == "uniform"
    second = records.Recorder.__new__(records.Recorder)      # the same name, another run
    second.__dict__.update(first.__dict__, written=False)
    before = path.read_text()
    with pytest.raises(SystemExit) as e:
        second.save([])
    assert e.value.code == 2 and path.read_text() == before


def test_commit_of_a_copy_without_git_is_its_archive(tmp_path):
    """The development side archives its tree (describe and tree hash); a copy of the same files
    without .git names that commit, `commit_source: archive`; a copy whose files differ from the
    archive's is refused."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("x = 1\n")
    def git(*a):
        subprocess.run(["git", *a], cwd=tree, check=True, capture_output=True, timeout=60)
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    git("add", "a.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "y")
    assert records.commit_info(str(tree))["commit_source"] == "git"
    (tree / "a.py").write_text("x = 2\n")                   # a change not committed: -dirty
    (tree / "b.py").write_text("y = 2\n")                   # a file not tracked: in the copy too
    info = records.archive(str(tree))
    assert info["commit"].endswith("-dirty") and len(info["tree"]) == 40
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns(".git"))
    got = records.commit_info(str(copy))
    assert got == {"commit": info["commit"], "commit_source": "archive", "tree": info["tree"],
                   "tree_checked": True}
    (copy / "a.py").write_text("x = 3\n")
    with pytest.raises(SystemExit) as e:
        records.commit_info(str(copy))
    assert e.value.code == 2


def test_a_measured_request_that_resumes_is_refused(tmp_path):
    """records.measured, which every measured request of bench_decode, bench_offload and
    bench_prefill passes: a request reading a prefix the session holds (RESUME n > 0) is
    refused; a fresh one is not."""
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="uniform", seed=0)
    s = records.serve_session(str(model), "--cpu-ranks", "1", "--vram-budget", "400M",
                              "--max-context", "256", timeout=120)
    try:
        ids = records.prompt_ids(32, 1, 512)
        assert records.measured(s.gen(ids, 2, timeout=60), "first")["resume"] in (None, 0)
        again = s.gen(ids + records.prompt_ids(8, 9, 512), 2, timeout=60)
        assert again["resume"]
        with pytest.raises(SystemExit) as e:
            records.measured(again, "second")
        assert e.value.code == 2
    finally:
        s.close()


@pytest.mark.parametrize("vocab", [512, 151_936])
def test_profile_prompts_are_none_of_the_measured(vocab):
    """The profile's prompts share no two consecutive ids with any measured prompt; the old
    profile prompts (a slice of the measured prompt's progression) are refused."""
    measured = [records.prompt_ids(n, seed, vocab) for n, seed in
                [(4096, 2), (4096, 63), (16, 3), (32, 1), (512, 7 * 512 + 1), (16384, 16384)]]
    profile = [records.profile_prompt_ids(512, k, vocab) for k in range(8)]
    records.assert_disjoint(profile, measured)
    with pytest.raises(SystemExit):
        records.assert_disjoint([records.prompt_ids(512, 1000 + k, vocab) for k in range(8)],
                                measured)


@pytest.mark.skipif(records.nvml_available(), reason="NVML answers here")
def test_vram_budget_match_without_nvml_is_one_error_line(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"),
                           "--model", str(model), "--cpu", "--vram-budget", "match",
                           "--llama-bench", sys.executable], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --vram-budget match needs NVML (the peaks it matches are NVML's) and none "
        "answers here: give a budget, e.g. --vram-budget 10G"]


def test_model_facts_name_the_file_type_and_every_shard(tmp_path):
    """A record names the file as its user does: the file type (q4_k_m, not its experts' Q4_K),
    the shard count and the bytes of every shard (the first shard's size was the whole model's)."""
    whole = write_synthetic(str(tmp_path / "m.gguf"), like="tiny", quant="q4_k_m",
                            popularity="zipf:1.0", seed=0)
    split = write_synthetic(str(tmp_path / "s.gguf"), like="tiny", quant="q4_k_m",
                            popularity="zipf:1.0", seed=0, split_max_size=200_000)
    assert len(split.shards) >= 2
    one, many = model_facts(str(whole.path)), model_facts(str(split.shards[0]))
    assert one["quant"] == many["quant"] == "q4_k_m"
    assert one["shards"] == 1 and many["shards"] == len(split.shards)
    assert many["bytes"] == sum(os.path.getsize(p) for p in split.shards) > os.path.getsize(split.shards[0])
    assert one["types"] == many["types"]


def _source_archive(tmp_path) -> tuple[Path, str]:
    """A source archive laid out as llama-cpp-python's on the package index: PKG-INFO, a vendored
    llama.cpp tree without git metadata, and the package's own .git whose HEAD pins the vendored
    commit as a gitlink (what benchmarks/llamacpp-anchor.sh reads). The archive and that commit."""
    pkg = tmp_path / "sdist" / "llama_cpp_python-9.8.7"
    (pkg / "vendor" / "llama.cpp").mkdir(parents=True)
    (pkg / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (pkg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.8.7\n")
    pinned = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    def git(*a):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=pkg,
                       check=True, capture_output=True, timeout=60)
    git("init", "-q")
    git("update-index", "--add", "--cacheinfo", f"160000,{pinned},vendor/llama.cpp")
    git("commit", "-q", "-m", "bump")
    archive = tmp_path / "llama_cpp_python-9.8.7.tar.gz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(pkg.parent), pkg.name], check=True,
                   timeout=60)
    return archive, pinned


def test_the_anchor_names_the_llama_cpp_it_builds(tmp_path):
    """benchmarks/llamacpp-anchor.sh prepare describes the source archive (its sha256, the package
    version, the llama.cpp commit its git metadata pins); unpack puts the description into the
    tree built from it, where llama_runs.llama_source finds it from the binary's path and a
    record takes it. A version line that names another commit, or a build no description or
    version line names, is refused."""
    import hashlib
    from llama_runs import llama_source
    archive, pinned = _source_archive(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=project, check=True, timeout=60)
    script = ROOT / "benchmarks" / "llamacpp-anchor.sh"
    done = subprocess.run(["bash", str(script), "prepare", str(archive)], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    described = json.loads((project / ".anchor" / "llama-source.json").read_text())
    assert described == {
        "package": "llama-cpp-python", "package_version": "9.8.7",
        "archive": archive.name, "archive_sha256": hashlib.sha256(archive.read_bytes()).hexdigest(),
        "vendored": "vendor/llama.cpp", "vendored_commit": pinned, "repacked": "llama.tar.xz",
        "repacked_sha256": hashlib.sha256(
            (project / ".anchor" / "llama.tar.xz").read_bytes()).hexdigest()}
    assert "/.anchor/" in (project / ".git" / "info" / "exclude").read_text()
    done = subprocess.run(["bash", str(project / ".anchor" / "llamacpp-anchor.sh"), "unpack"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tree = project / ".anchor" / "llama.cpp"
    assert (tree / "CMakeLists.txt").is_file()
    binary = str(tree / "build" / "bin" / "llama-bench")
    assert llama_source(binary, "version: 0.5.0-dev (build 0, commit 0c1e570)") == described
    assert llama_source(binary, "version: 0.5.0-dev (build 0, commit unknown)") == described
    with pytest.raises(SystemExit) as e:         # built from another tree than the one described
        llama_source(binary, "version: 0.5.0-dev (build 0, commit 1234567)")
    assert e.value.code == 2
    elsewhere = str(tmp_path / "other" / "build" / "bin" / "llama-bench")
    assert llama_source(elsewhere, "version: 4567 (abcdef1)") == {
        "commit": "abcdef1", "from": "its version line"}
    with pytest.raises(SystemExit) as e:         # nothing names it
        llama_source(elsewhere, "version: 0.5.0-dev (build 0, commit unknown)")
    assert e.value.code == 2
    # the record checker takes the description as a llama.cpp arm's source
    record, name = _complete_record()
    record["arms"][1]["source"] = described
    assert check_record(record, name) == []


def test_checker_holds_new_records_to_name_their_llama_cpp():
    """From SOURCE_REQUIRED_FROM on, a llama.cpp arm names its source (the anchor's description,
    or a git build's commit); the records before it (version line only) stay valid as written."""
    from record_check import SOURCE_REQUIRED_FROM
    record, name = _complete_record()
    assert record["date"] < SOURCE_REQUIRED_FROM and check_record(record, name) == []
    new_name = name.replace(record["date"], SOURCE_REQUIRED_FROM)
    record["date"] = SOURCE_REQUIRED_FROM
    assert any("arms[1].source missing" in p for p in check_record(record, new_name))
    anchor = {"package": "llama-cpp-python", "package_version": "0.3.36",
              "archive": "llama_cpp_python-0.3.36.tar.gz", "archive_sha256": "8" * 64,
              "vendored": "vendor/llama.cpp", "vendored_commit": "0" * 40}
    record["arms"][1]["source"] = anchor
    assert check_record(record, new_name) == []
    record["arms"][1]["source"] = {"commit": "abcdef1", "from": "its version line"}
    assert check_record(record, new_name) == []
    for key, value, said in (("archive_sha256", "", "source.archive_sha256 missing"),
                             ("archive_sha256", "x" * 64, "is not a sha256"),
                             ("vendored_commit", "unknown", "is not a commit"),
                             ("package_version", None, "source.package_version missing")):
        record["arms"][1]["source"] = {**anchor, key: value}
        assert any(said in p for p in check_record(record, new_name)), (key, value)


LLAMA_BENCH = os.environ.get("LLAMA_BENCH", "")


@pytest.mark.skipif(not LLAMA_BENCH, reason="$LLAMA_BENCH names no llama-bench build")
def test_a_real_llama_arm_names_its_source(tmp_path):
    """bench_decode.py --cpu beside a real llama-bench ($LLAMA_BENCH, e.g. the anchor's
    `build --cpu`): its arm carries the description of the tree it was built from, or the
    commit its version line names, and the record checker holds it to that."""
    from llama_runs import llama_build, llama_source
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    out = tmp_path / "records"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--model",
                           str(model), "--cpu", "--tokens", "128", "--repeats", "1",
                           "--llama-bench", LLAMA_BENCH, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = out.glob("decode-tiny-f32-*.json")
    record = json.loads(path.read_text())
    [llama] = [a for a in record["arms"] if a["name"] == "llama.cpp"]
    assert llama["source"] == llama_source(LLAMA_BENCH, llama_build(LLAMA_BENCH))
    assert llama["build"] == llama_build(LLAMA_BENCH) and "commit unknown" not in llama["build"]
    from record_check import SOURCE_REQUIRED_FROM
    record["date"] = SOURCE_REQUIRED_FROM            # held as the records from then on are
    assert not [p for p in check_record(record, str(path)) if "source" in p]


def test_first_difference_names_where_two_token_lists_part():
    """bench_decode's --shape-arm and --tree-arm arms (and bench_prefill's --tree-arm arm)
    record where their greedy tokens leave the first arm's."""
    from tree_arm import first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([7], [8]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2          # one list ended early


def test_kernels_built_by_names_the_binaries_a_gpu_launch_loads(tmp_path, monkeypatch):
    """Records (and bench_decode's arms) say which compiler built their kernels: nvcc's prebuilt
    binaries where $STRATA_KERNEL_CUBINS holds this tree's binary of every source at the launch's
    shape, NVRTC's where it holds none (or in the --nvrtc-arm), "mixed" between."""
    import strata_dist.kernels
    from records import CUBINS_ENV, kernels_built_by
    from tree_arm import cubin_names, device_arch
    assert CUBINS_ENV == strata_dist.kernels.CUBINS_ENV
    monkeypatch.delenv("STRATA_KERNEL_SHAPE", raising=False)
    monkeypatch.setenv("STRATA_KERNEL_CUBINS", str(tmp_path))
    assert kernels_built_by() == "nvrtc"                     # a folder of none of them
    names = cubin_names(str(ROOT), {}, "", device_arch())
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert kernels_built_by() == "prebuilt" and kernels_built_by(nvrtc=True) == "nvrtc"
    assert kernels_built_by(shape="matvec_accs=16") == "mixed"      # its decode.cu not built
    (tmp_path / names[-1]).unlink()
    assert kernels_built_by() == "mixed"
    monkeypatch.setenv("STRATA_KERNEL_CUBINS", str(tmp_path / "absent"))
    assert kernels_built_by() == "nvrtc"
    monkeypatch.delenv("STRATA_KERNEL_CUBINS")
    assert kernels_built_by() == "nvrtc"
