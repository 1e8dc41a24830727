"""--tree-arm of bench_decode.py and bench_prefill.py on CPU ranks (benchmarks/tree_arm.py): a
`git archive` of this worktree's HEAD is unpacked and run as one more strata arm of the same
record, named by the commit its tar header holds; its processes (the launcher and the ranks it
starts) run the archived tree's code, not this tree's; a tarball naming no commit is refused
before anything is measured; the record checker holds the arm's fields."""
from __future__ import annotations

import io
import json
import os
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from strata_dist.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from record_check import check_record  # noqa: E402


def _head() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        pytest.skip("no git repository here to archive")
    return done.stdout.strip()


@pytest.fixture(scope="module")
def archived(tmp_path_factory) -> tuple[Path, str]:
    """`git archive HEAD | xz` (compressed here with lzma: the same format) and HEAD's hash."""
    head = _head()
    tar = subprocess.run(["git", "archive", head], cwd=ROOT, capture_output=True, timeout=120,
                         check=True).stdout
    path = tmp_path_factory.mktemp("tree") / "before.tar.xz"
    path.write_bytes(lzma.compress(tar, preset=0))
    return path, head


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    return path


def _bench(script: str, model: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--model",
                           str(model), "--cpu", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def _record(out: Path) -> dict:
    [path] = out.glob("*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    return record


def test_decode_tree_arm_is_the_archived_commit(archived, model, tmp_path):
    tarball, head = archived
    done = _bench("bench_decode.py", model, tmp_path / "r", "--tokens", "8", "--repeats", "1",
                  "--tree-arm", str(tarball))
    assert done.returncode == 0, done.stderr[-3000:]
    [first, before] = _record(tmp_path / "r")["arms"]
    assert first["name"] == "strata" and "tree_commit" not in first
    assert before["name"] == f"strata {head[:7]}" and before["tree_commit"] == head
    assert before["tokens_identical_to_first_arm"] is True
    assert before["first_token_differing"] is None
    assert before["tokens_sha256"] == first["tokens_sha256"] and before["decode_tok_s"] > 0
    assert before["command"] == first["command"]           # the same launch, the older code
    ratio = first["decode_tok_s"] / before["decode_tok_s"]
    assert f"strata (this tree) / strata {head[:7]}: {ratio:.3f}x" in done.stdout


def test_prefill_tree_arm_is_the_archived_commit(archived, model, tmp_path):
    tarball, head = archived
    done = _bench("bench_prefill.py", model, tmp_path / "r", "--budget", "400M", "--prompts",
                  "64,128", "--chunk", "64", "--repeats", "1", "--only-loans-on",
                  "--tree-arm", str(tarball))
    assert done.returncode == 0, done.stderr[-3000:]
    [first, before] = _record(tmp_path / "r")["arms"]
    assert before["name"] == f"strata {head[:7]}" and before["tree_commit"] == head
    assert before["tokens_identical_to_first_arm"] is True
    assert before["first_token_differing"] is None
    assert set(before["prefill_tok_s"]) == {"64", "128"}
    for n in ("64", "128"):         # one ratio a prompt length
        # the summary line of the length (the last: each arm's own lines come first)
        [*_, line] = [ln for ln in done.stdout.splitlines()
                      if ln.strip().startswith(f"{n} tokens:")]
        assert f"strata (this tree) / strata {head[:7]}: " in line, line
    assert f"tree {head}: first tokens identical to this tree's" in done.stdout


def test_serve_tree_arm_is_the_archived_commit(archived, model, tmp_path):
    """bench_serve's older launch: its arms (one per N) name the commit and carry the after /
    before ratio of the same N."""
    tarball, head = archived
    done = _bench("bench_serve.py", model, tmp_path / "r", "--streams", "1,2", "--prompt-tokens",
                  "16", "--tokens", "4", "--launch-args", "--parallel 2", "--tree-arm",
                  str(tarball))
    assert done.returncode == 0, done.stderr[-3000:]
    arms = _record(tmp_path / "r")["arms"]
    assert [a["name"] for a in arms] == ["strata", "strata", f"strata {head[:7]}",
                                         f"strata {head[:7]}"]
    for first, before in zip(arms[:2], arms[2:]):
        assert before["tree_commit"] == head and before["streams"] == first["streams"]
        assert before["tokens_identical_to_first_arm"] is True
        assert before["tokens_sha256"] == first["tokens_sha256"]
        ratio = first["aggregate_tok_s"] / before["aggregate_tok_s"]
        assert f"strata (this tree) / strata {head[:7]} aggregate: {ratio:.3f}x" in done.stdout


def _rewritten(tarball: Path, out: Path, edits: dict) -> Path:
    """A copy of the archive (its pax header, so its commit, kept) with each file named in
    `edits` passed through its function (None: the file left out)."""
    with tarfile.open(tarball) as src:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT,
                          pax_headers=src.pax_headers) as dst:
            for member in src.getmembers():
                data = src.extractfile(member).read() if member.isfile() else None
                if member.name in edits:
                    data = edits[member.name](data)
                    if data is None:
                        continue
                    member.size = len(data)
                dst.addfile(member, None if data is None else io.BytesIO(data))
    out.write_bytes(buf.getvalue())
    return out


@pytest.mark.parametrize("planted", ["launcher/cli.py", "strata_dist/rank/main.py"])
def test_the_tree_arm_runs_the_archived_code(archived, model, tmp_path, planted):
    """The archive with one module made to exit at import: the launcher (`python -m` in the
    unpacked tree) and the rank it starts (the launcher's working directory inherited) each run
    the archived file, so the arm fails with the planted message."""
    tarball, _ = archived
    future = b"from __future__ import annotations\n"

    def plant(data: bytes) -> bytes:
        assert future in data
        return data.replace(future, future + b'raise SystemExit("error: planted in '
                            + planted.encode() + b'")\n', 1)
    _rewritten(tarball, tmp_path / "planted.tar", {planted: plant})
    done = _bench("bench_decode.py", model, tmp_path / "r", "--tokens", "4", "--repeats", "1",
                  "--tree-arm", str(tmp_path / "planted.tar"))
    assert done.returncode == 2 and f"planted in {planted}" in done.stderr, done.stderr[-3000:]


def test_a_tarball_naming_no_commit_is_refused_first(model, tmp_path):
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:          # a tar, but not git archive's: no comment
        info = tarfile.TarInfo("launcher/cli.py")
        tar.addfile(info, io.BytesIO(b""))
    for script, flags in (("bench_decode.py", ()), ("bench_prefill.py", ("--budget", "400M"))):
        done = _bench(script, model, tmp_path / "r", *flags, "--tree-arm", str(plain))
        assert done.returncode == 2 and done.stdout == "", done.stdout
        assert done.stderr.startswith(f"error: --tree-arm {plain}: its pax header names no commit")
        assert not (tmp_path / "r").exists()
    done = _bench("bench_decode.py", model, tmp_path / "r", "--tree-arm", str(tmp_path / "none"))
    assert done.returncode == 2 and "no such file" in done.stderr


def test_the_checker_holds_a_tree_arms_fields():
    from test_bench_records import _complete_record
    record, name = _complete_record()
    assert check_record(record, name) == []
    commit = "0123456789abcdef0123456789abcdef01234567"
    arm = {**record["arms"][0], "name": "strata 0123456", "tree_commit": commit,
           "tokens_identical_to_first_arm": True, "first_token_differing": None}
    record["arms"].append(arm)
    assert check_record(record, name) == []
    for change, said in (({"name": "strata"}, "the tree arm of"),
                         ({"tree_commit": "0123456"}, "is not a full commit hash"),
                         ({"tokens_identical_to_first_arm": None},
                          "tokens_identical_to_first_arm missing"),
                         ({"first_token_differing": "3"}, "a token index or null")):
        record["arms"][-1] = {**arm, **change}
        assert any(said in p for p in check_record(record, name)), change


def _must_show(tmp_path: Path, tree_arm: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_") and k != "TREE_ARM"}
    env.update(OUT=str(tmp_path / "out"), MODELS=str(tmp_path / "m"), PYTHONPATH=str(ROOT))
    if tree_arm is not None:
        env["TREE_ARM"] = tree_arm
    return subprocess.run(["bash", "benchmarks/must_show.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_must_show_gives_the_tree_arm_to_the_decode_and_q4_k_parts(archived, tmp_path):
    """$TREE_ARM adds --tree-arm to the decode_q8_0 and q4_k parts' bench_decode and
    bench_prefill runs and to nothing else; unset, no command has it; the CPU dry run of
    decode_q8_0 writes a record whose tree arm is the archived commit."""
    tarball, head = archived
    parts = ("--parts", "decode_q8_0,q4_k,offload_zipf1.0")
    plain = _must_show(tmp_path, None, "--print", *parts)
    assert plain.returncode == 0 and "--tree-arm" not in plain.stdout, plain.stderr
    done = _must_show(tmp_path, str(tarball), "--print", *parts)
    assert done.returncode == 0, done.stderr
    commands = [ln[2:] for ln in done.stdout.splitlines() if ln.startswith("+ ")]
    given = [c.split()[3] for c in commands if f"--tree-arm {tarball}" in c]
    assert given == ["benchmarks/bench_decode.py"] * 2 + ["benchmarks/bench_prefill.py"]
    # every command else as it was
    assert [c.replace(f" --tree-arm {tarball}", "") for c in commands] == [
        ln[2:] for ln in plain.stdout.splitlines() if ln.startswith("+ ")]
    missing = _must_show(tmp_path, str(tmp_path / "none.tar.xz"), "--cpu", "--parts",
                         "decode_q8_0")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert missing.stderr.startswith(f"error: TREE_ARM={tmp_path / 'none.tar.xz'}")
    ran = _must_show(tmp_path, str(tarball), "--cpu", "--parts", "decode_q8_0")
    assert ran.returncode == 0, ran.stdout[-3000:]
    [path] = (tmp_path / "out").glob("decode-tiny-q8_0-*.json")
    record = json.loads(path.read_text())
    assert [a.get("tree_commit") for a in record["arms"]] == [None, head]
    assert record["arms"][1]["tokens_identical_to_first_arm"] is True


def test_must_show_redesign_next_needs_and_gives_the_tree_arm(archived, tmp_path):
    """The qwen3next before/after part: refused without $TREE_ARM before anything runs; with it,
    the qwen3next file's synth, then bench_decode and bench_prefill each with --tree-arm and no
    llama.cpp arm."""
    tarball, _ = archived
    refused = _must_show(tmp_path, None, "--print", "--parts", "redesign_next")
    assert refused.returncode == 2 and "give TREE_ARM" in refused.stderr
    done = _must_show(tmp_path, str(tarball), "--print", "--parts", "redesign_next")
    assert done.returncode == 0, done.stderr
    commands = [ln[2:] for ln in done.stdout.splitlines() if ln.startswith("+ ")]
    assert [c.split()[3:5] for c in commands] == [
        ["-m", "launcher.tools"], ["benchmarks/bench_decode.py", "--model"],
        ["benchmarks/bench_prefill.py", "--model"]]
    assert "--like qwen3-next-80b-a3b" in commands[0]
    assert all(f"--tree-arm {tarball}" in c and "--llama-bench" not in c for c in commands[1:])


# The archive's kernels/prebuild.py with nvcc left out (the test checks who builds what, not
# nvcc): each binary is written as a file naming the prebuild.py that wrote it.
_MARKER_BUILD = b'''

def build(nvcc, name, defines, arch, out):      # planted by tests/test_bench_tree_arm.py
    target = out / cubin_name(name, defines, arch)
    if not target.is_file():
        target.write_text("built by " + __file__)
    return target


shutil.which = lambda name: name


if __name__ == "__main__":'''


def _older_tree_with_marker_prebuild(tarball: Path, out: Path, prebuild: bool = True) -> Path:
    """The archive with its decode.cu one comment longer (its binary's name, a hash of the
    source, then differs from this tree's) and its prebuild.py writing markers (or none)."""
    def marker(data: bytes) -> bytes:
        main = b'\n\nif __name__ == "__main__":'
        assert main in data
        return data.replace(main, _MARKER_BUILD, 1)
    return _rewritten(tarball, out, {
        "strata_dist/kernels/decode.cu": lambda data: data + b"// the older tree\n",
        "strata_dist/kernels/prebuild.py": marker if prebuild else lambda data: None})


def _this_trees_binaries(folder: Path, shape: str) -> list[Path]:
    """Empty files named as this tree's binaries at `shape` (what a session carries, built
    ahead); the check only looks for the names."""
    from tree_arm import cubin_names, device_arch
    paths = [folder / n for n in cubin_names(str(ROOT), {}, shape, device_arch())]
    for p in paths:
        p.write_bytes(b"")
    return paths


def test_the_tree_arm_builds_its_kernels_beside_this_trees(archived, tmp_path, monkeypatch,
                                                            capsys):
    """$STRATA_KERNEL_CUBINS naming a folder that holds this tree's binaries: the older tree's
    own prebuild.py (run from the unpacked tree) writes the older tree's binaries there at the
    default shape and $STRATA_KERNEL_SHAPE's, this tree's left as they were; its arm then loads
    nvcc's binaries as this tree's does (a Q8_0 decode's 0.965x was NVRTC's against nvcc's)."""
    from tree_arm import OlderTree, cubin_names, device_arch
    tarball, head = archived
    older = _older_tree_with_marker_prebuild(tarball, tmp_path / "older.tar")
    folder, shape = tmp_path / "cubins", "matvec_accs=16"
    folder.mkdir()
    ours = _this_trees_binaries(folder, "") + _this_trees_binaries(folder, shape)
    monkeypatch.setenv("STRATA_KERNEL_CUBINS", str(folder))
    monkeypatch.setenv("STRATA_KERNEL_SHAPE", shape)
    tree = OlderTree(str(older))
    assert f"tree arm {head[:7]}: building its kernels" in capsys.readouterr().out
    theirs = {n for s in ("", shape) for n in cubin_names(tree.dir, tree.env(), s, device_arch())}
    # the older decode.cu has other names; the other sources' binaries are this tree's
    assert theirs & {p.name for p in ours} == {p.name for p in ours if "decode-" not in p.name}
    built = {p.name: p.read_text() for p in folder.iterdir() if p.read_bytes()}
    wrote = f"built by {os.path.join(tree.dir, 'strata_dist', 'kernels', 'prebuild.py')}"
    assert set(built) == {n for n in theirs if n.startswith("decode-")} and len(built) == 2
    assert set(built.values()) == {wrote}
    assert all(p.read_bytes() == b"" for p in ours)


@pytest.mark.parametrize("case", ["this tree's binaries missing", "no prebuild.py"])
def test_a_tree_arm_that_would_compile_with_nvrtc_is_refused(archived, tmp_path, monkeypatch,
                                                             capsys, case):
    """Where either arm would compile its kernels with NVRTC while the other loads nvcc's
    binaries (this tree's not in the folder, or an older tree with no prebuild.py to build its
    own), the tree arm is refused before anything runs, saying which binaries and what to do."""
    from tree_arm import OlderTree
    tarball, head = archived
    older = _older_tree_with_marker_prebuild(tarball, tmp_path / "older.tar",
                                             prebuild=case != "no prebuild.py")
    folder = tmp_path / "cubins"
    folder.mkdir()
    if case == "no prebuild.py":
        _this_trees_binaries(folder, "")
    monkeypatch.setenv("STRATA_KERNEL_CUBINS", str(folder))
    monkeypatch.delenv("STRATA_KERNEL_SHAPE", raising=False)
    with pytest.raises(SystemExit) as stop:
        OlderTree(str(older))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --tree-arm: "), err
    if case == "no prebuild.py":
        assert f"commit {head[:7]} has no strata_dist/kernels/prebuild.py" in err
    else:
        assert "lacks this tree's decode-sm" in err and "strata_dist.kernels.prebuild --out" in err
        assert not any(folder.iterdir())            # refused before anything was built
    assert "nset $STRATA_KERNEL_CUBINS to measure both trees' NVRTC builds" in err


def test_without_a_cubins_folder_the_tree_arm_builds_nothing(archived, tmp_path, monkeypatch):
    """No $STRATA_KERNEL_CUBINS (or a name that is no folder, where kernels/__init__.py has
    both trees compile with NVRTC): nothing is built, even by an older tree that could not."""
    from tree_arm import OlderTree
    tarball, head = archived
    older = _older_tree_with_marker_prebuild(tarball, tmp_path / "older.tar", prebuild=False)
    monkeypatch.delenv("STRATA_KERNEL_CUBINS", raising=False)
    assert OlderTree(str(older)).commit == head
    monkeypatch.setenv("STRATA_KERNEL_CUBINS", str(tmp_path / "none"))
    assert OlderTree(str(older)).commit == head
    assert not (tmp_path / "none").exists()
