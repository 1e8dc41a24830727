"""llama.cpp, the tuned peer of every benchmark (../shared/RECORDS.md): llama-bench over every
micro-batch (`-ub` 512, 1024, 2048, 4096; `-b` the largest) and, where experts stay in host memory,
with the weights mmap'd and not; its best figures, every test kept, its version string, its source
(llama_source) and flags."""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

from records import PeakMemory, fail

UBATCHES = (512, 1024, 2048, 4096)


def llama_wait(path: str, seconds: float) -> None:
    """Wait for a llama-bench a build in the background is still making (bounded)."""
    deadline = time.monotonic() + seconds
    while not os.access(path, os.X_OK) and time.monotonic() < deadline:
        time.sleep(5)
    if not os.access(path, os.X_OK):
        fail(f"--llama-bench {path}: not an executable file")
    llama_source(path, llama_build(path))    # a llama.cpp no record could name: refused now


def llama_build(path: str) -> str:
    """llama.cpp's version string, as `llama-bench --version` prints it."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("version")), lines[0] if lines else "")


# the commit a llama.cpp version line names: "version: 0.5.0-dev (build 0, commit 0c1e570)" or
# the older "version: 4567 (0c1e570)"; "commit unknown" (a tree without git metadata) names none
VERSION_COMMIT = re.compile(r"\((?:build \d+, commit )?([0-9a-f]{7,40})\)")
SOURCE_FILE = "llama-source.json"


def llama_source(path: str, build: str) -> dict:
    """Which llama.cpp `path` (a llama-bench or llama-batched-bench) is, as a record names it: the
    description that benchmarks/llamacpp-anchor.sh put into the tree it built from (the source
    archive's name and sha256, the package version, the vendored llama.cpp commit), found in the
    tree that holds build/bin/; else, for a build from a git checkout, the commit its version line
    `build` names. Refused, before its figures are taken, where neither names it (a record would
    then hold a figure of an unknown llama.cpp)."""
    named = VERSION_COMMIT.search(build)
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(3):                     # bin/, build/, the tree: the tree's own description
        candidate = os.path.join(folder, SOURCE_FILE)
        if os.path.isfile(candidate):
            with open(candidate) as f:
                source = json.load(f)
            pinned = str(source.get("vendored_commit", ""))
            if not pinned or not source.get("archive_sha256"):
                fail(f"{candidate} names no vendored_commit or archive_sha256: run "
                     f"benchmarks/llamacpp-anchor.sh prepare again")
            if named and not pinned.startswith(named.group(1)):
                fail(f"{path} says {build!r}, but {candidate} describes llama.cpp {pinned[:7]}: "
                     f"the binary was not built from that tree")
            return source
        folder = os.path.dirname(folder)
    if named:
        return {"commit": named.group(1), "from": "its version line"}
    fail(f"{path} says {build!r} and no {SOURCE_FILE} in the tree it was built from names its "
         f"source: build it with benchmarks/llamacpp-anchor.sh (prepare, then build), or from a "
         f"llama.cpp git checkout")


def llama_mmap_flags(path: str) -> dict[str, list[str]]:
    """The flags that load the weights mmap'd (pageable) and not (read into memory): `-mmp 1/0`
    in builds that have it, `-lm mmap/none` in those whose --load-mode replaced it."""
    done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    text = done.stdout + done.stderr
    if re.search(r"(^|\s)-mmp[,\s]", text):
        return {"on": ["-mmp", "1"], "off": ["-mmp", "0"]}
    if "--load-mode" in text:
        return {"on": ["-lm", "mmap"], "off": ["-lm", "none"]}
    fail(f"{path} --help names neither -mmp nor --load-mode")


def test_command(cmd: list[str], row: dict) -> str:
    """The command that runs one test of a sweep alone: the invocation with this test's -ub and
    prompt or generation length in place of the lists (llama-bench runs each combination of its
    lists on its own, so the figure is this command's)."""
    out, i = ["llama-bench"], 1
    own = {"-ub": str(row["n_ubatch"]), "-p": str(row["n_prompt"]), "-n": str(row["n_gen"])}
    while i < len(cmd):
        out.append(cmd[i])
        if cmd[i] in own and i + 1 < len(cmd):
            out.append(own[cmd[i]])
            i += 1
        i += 1
    return " ".join(out)


def llama_sweep(path: str, base: list[str], prompts: list[int], gen: int, repeats: int,
                mmap: dict[str, list[str]] | None = None, ubatches=UBATCHES) -> list[dict]:
    """llama-bench over every -ub of `ubatches` (-b the largest, so -b >= -ub), once per load
    mode of `mmap` (None: the default only; `ubatches` empty: llama-bench's own -ub and -b): one
    process per mode, its tests read one by one
    (-o jsonl), each with the device's peak while it ran. Every test as a dict: its flags
    (`command`), the mode, -ub, n_prompt/n_gen, avg and every repeat's tok/s, peak_gib."""
    tests = []
    for mode, flags in (mmap or {"default": []}).items():
        sizes = ["-ub", ",".join(map(str, ubatches)), "-b", str(max(ubatches))] if ubatches else []
        cmd = [path, *base, "-p", ",".join(map(str, prompts)) if prompts else "0",
               "-n", str(gen), "-r", str(repeats), *sizes, *flags, "-o", "jsonl"]
        print("llama.cpp:", " ".join(cmd), flush=True)
        with PeakMemory() as mem:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            err: list[str] = []
            threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
            timer = threading.Timer(3600, proc.kill)    # bounded: a hung llama-bench is killed
            timer.start()
            try:
                for line in proc.stdout:
                    if not line.startswith("{"):
                        continue
                    row = json.loads(line)
                    tests.append({
                        "command": test_command(cmd, row), "mmap": mode,
                        "ubatch": int(row["n_ubatch"]), "batch": int(row["n_batch"]),
                        "n_prompt": int(row["n_prompt"]), "n_gen": int(row["n_gen"]),
                        "tps": round(float(row["avg_ts"]), 2),
                        "tps_each": [round(float(x), 2) for x in row.get("samples_ts", [])],
                        "peak_gib": round(mem.mark(), 2),
                        "build": f"{row.get('build_number', '')} ({row.get('build_commit', '')})"})
                proc.wait(timeout=60)
            finally:
                timer.cancel()
        if proc.returncode != 0:
            fail(f"llama-bench exited {proc.returncode}: {''.join(err)[-1500:]}")
    return tests


def llama_arm(path: str, tests: list[dict], prompts: list[int], gen: int) -> dict:
    """The tuned peer's arm from a sweep: each prompt length at its best test, decode at its best,
    `ubatch_sweep` (-ub -> prompt length -> tok/s, the best load mode's), peak_gib the largest
    peak among the tests whose figures the arm quotes, `command` that of the first quoted test
    (each best's own in `best` / `decode_best`, every test's in `sweep`)."""
    build = llama_build(path)
    arm: dict = {"name": "llama.cpp", "gpus": 1, "build": build,
                 "source": llama_source(path, build),
                 "build_rows": tests[0]["build"] if tests else ""}
    pp = [t for t in tests if t["n_prompt"] > 0]
    tg = [t for t in tests if t["n_gen"] > 0]
    used = []
    if pp:
        arm["prefill_tok_s"], arm["tps_each"], best_of = {}, {}, {}
        for n in prompts:
            best = max((t for t in pp if t["n_prompt"] == n), key=lambda t: t["tps"])
            arm["prefill_tok_s"][str(n)] = best["tps"]
            arm["tps_each"][str(n)] = best["tps_each"]
            best_of[str(n)] = {"ubatch": best["ubatch"], "batch": best["batch"],
                               "mmap": best["mmap"], "command": best["command"]}
            used.append(best)
        arm["best"] = best_of
        mode = used[-1]["mmap"]
        arm["ubatch_sweep"] = {str(u): {str(t["n_prompt"]): t["tps"] for t in pp
                                        if t["ubatch"] == u and t["mmap"] == mode}
                               for u in sorted({t["ubatch"] for t in pp})}
        modes = sorted({t["mmap"] for t in pp})
        if len(modes) > 1:
            arm["mmap_sweep"] = {m: {str(n): max(t["tps"] for t in pp if t["mmap"] == m
                                                 and t["n_prompt"] == n) for n in prompts}
                                 for m in modes}
    if tg:
        best = max(tg, key=lambda t: t["tps"])
        arm["decode_tok_s"], arm["new_tokens"] = best["tps"], gen
        arm["tps_each"] = {**arm.get("tps_each", {}), "decode": best["tps_each"]}
        arm["decode_best"] = {"ubatch": best["ubatch"], "mmap": best["mmap"],
                              "command": best["command"]}
        used.append(best)
    arm["command"] = (used[0] if used else tests[0])["command"]
    arm["peak_gib"] = max(t["peak_gib"] for t in used) if used else 0.0
    arm["sweep"] = tests
    return arm


