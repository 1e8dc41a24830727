"""Every documented example command of every benchmarks/*.py (its docstring) that runs without a
GPU runs as written, as a newcomer would paste it, and every record it writes holds
../shared/RECORDS.md's fields. The commands run in a copy of the tree with no .git beside an
archive of it (.anchor/commit.json, as the development side writes before a GPU call), so the
records say `commit_source: archive` and name the commit the archive does."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from record_check import check_record  # noqa: E402
from records import describe, tree_hash  # noqa: E402

# scripts whose every example needs a CUDA device (each times kernels on the card) and why
GPU_ONLY = {"bench_attention.py", "bench_prompt_attention.py", "bench_rows.py",
            "profile_decode.py", "profile_prefill.py", "tune_decode.py"}
# the development side's commands: records.py describes the real tree's git (which the copy lacks);
# monitor_screenshot.py draws docs/images/monitor.png (a minute of load and a browser, no record)
DEV_SIDE = {"records.py", "monitor_screenshot.py"}
# modules the scripts import, with no command of their own (--tree-arm's examples are
# bench_decode.py's and bench_prefill.py's; a CPU run of it needs a git archive: test_bench_tree_arm)
LIBRARIES = {"llama_runs.py", "tree_arm.py"}
# the scripts whose CPU examples write records
RECORDING = {"bench_decode.py", "bench_prefill.py", "bench_offload.py", "bench_tiers.py",
             "bench_seedrig.py", "bench_adapt.py", "bench_serve.py", "bench_spec.py"}


def documented_commands(path: Path) -> list[str]:
    """The example commands of a script's docstring: its lines that start a command (`python
    benchmarks/`, `strata-dist synth`), continued over trailing backslashes; a `[...]` part is
    optional and left out; a trailing `# ...` is a comment."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    out, current = [], None
    for line in doc.splitlines():
        text = line.strip()
        if current is not None:
            current += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                out.append(current)
                current = None
            continue
        if text.startswith(("python benchmarks/", "strata-dist synth")):
            if text.endswith("\\"):
                current = text.rstrip("\\").strip()
            else:
                out.append(text)
    cleaned = []
    for cmd in out:
        cmd = re.sub(r"\s+#\s.*$", "", cmd)
        cmd = re.sub(r"\s*\[[^\]]*\]", "", cmd)
        cleaned.append(" ".join(cmd.split()))
    return cleaned


# scripts that use no device at all (the planner, the records)
NO_DEVICE = {"bench_plan.py", "mark_legacy.py", "record_check.py"}


def runs_without_gpu(script: str, cmd: str) -> bool:
    return ("--cpu" in cmd.split() or "--device cpu" in cmd or cmd.startswith("strata-dist synth")
            or script in NO_DEVICE)


def cpu_examples() -> list[tuple[str, str]]:
    """(script, command) of every CPU example, in the order of the scripts that write records
    first (record_check.py, which checks them, last)."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name in GPU_ONLY | DEV_SIDE:
            continue
        found += [(path.name, c) for c in documented_commands(path)
                  if runs_without_gpu(path.name, c)]
    return sorted(found, key=lambda sc: sc[0] == "record_check.py")


def test_every_script_documents_a_cpu_example_or_is_gpu_only():
    """A script that runs without a GPU shows how (so the test below runs it); a GPU-only one is
    named above. A new script is one or the other."""
    for path in sorted(BENCH.glob("*.py")):
        commands = documented_commands(path)
        if path.name in GPU_ONLY:
            assert commands and not any("--cpu" in c.split() for c in commands), path.name
        elif path.name not in DEV_SIDE | LIBRARIES:
            assert any(runs_without_gpu(path.name, c) for c in commands), (path.name, commands)
    assert {s for s, _ in cpu_examples()} >= RECORDING


@pytest.fixture(scope="module")
def archived_copy(tmp_path_factory) -> Path:
    """The tree as a GPU call gets it: the files (benchmarks/results' records left out), no .git,
    the archive the development side wrote of them."""
    copy = tmp_path_factory.mktemp("copy")
    shutil.copytree(BENCH, copy / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    (copy / "tests").symlink_to(ROOT / "tests")
    shutil.copy(ROOT / ".gitignore", copy / ".gitignore")
    (copy / ".anchor").mkdir()
    commit = describe(str(ROOT))
    (copy / ".anchor" / "commit.json").write_text(json.dumps(
        {"commit": commit, "tree": tree_hash(str(copy), []), "excludes": []}))
    return copy


def test_documented_cpu_examples_run_and_write_complete_records(archived_copy):
    copy = archived_copy
    env = {**os.environ,
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ran = []
    for script, cmd in cpu_examples():
        before = set((copy / "benchmarks" / "results").glob("*.json"))
        done = subprocess.run(cmd, shell=True, cwd=copy, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (cmd, done.stdout[-1500:], done.stderr[-3000:])
        new = set((copy / "benchmarks" / "results").glob("*.json")) - before
        if script in RECORDING and not cmd.startswith("strata-dist synth"):
            assert len(new) == 1, (cmd, new)
            [path] = new
            record = json.loads(path.read_text())
            assert check_record(record, str(path)) == [], (cmd, check_record(record, str(path)))
            archived = json.loads((copy / ".anchor" / "commit.json").read_text())
            assert record["commit_source"] == "archive" and record["commit"] == archived["commit"]
            assert record["tree"] == archived["tree"] and record["tree_checked"] is True
        ran.append(script)
    assert set(ran) >= RECORDING | {"bench_plan.py", "bench_transport.py", "bench_handoff.py"}
    assert ran[-1] == "record_check.py"


def test_must_show_script_parses_and_gives_only_flags_its_commands_take(tmp_path):
    """benchmarks/must_show.sh (the GPU run of issue 42's "Must show"): bash parses it, and every
    flag of every benchmark command it prints for the GPU run is one that script's --help names
    (its CPU dry run, `--cpu`, runs the same commands on CPU ranks: see its header)."""
    script = BENCH / "must_show.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "m")}
    done = subprocess.run(["bash", str(script), "--print"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    commands = [ln[2:].split() for ln in done.stdout.splitlines() if ln.startswith("+ ")]
    benches = [c for c in commands if any(w.startswith("benchmarks/bench_") for w in c)]
    assert len(benches) == 6        # decode x2, the resident prompt, offload x3
    laws = [c[c.index("--popularity") + 1] for c in commands if "--popularity" in c]
    assert sorted(set(laws)) == ["uniform", "zipf:0.5", "zipf:1.0"]
    helps = {}
    for c in benches:
        path = next(w for w in c if w.startswith("benchmarks/bench_"))
        if path not in helps:
            helps[path] = subprocess.run([sys.executable, path, "--help"], cwd=ROOT,
                                         capture_output=True, text=True, timeout=60).stdout
        for flag in (w for w in c[c.index(path) + 1:] if w.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}[\s,=]", helps[path]), (path, flag)
    assert done.stderr == "" and "unknown" not in done.stdout
    bad = subprocess.run(["bash", str(script), "--parts", "nonesuch"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --parts: unknown part nonesuch")
