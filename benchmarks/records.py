"""What every benchmark's record (benchmarks/results/, ../shared/RECORDS.md) is made of: the model
file's facts, the machine, the commit measured (computed here, never typed in), every compute
option in force, the device's peak memory while an arm runs, the prompts, llama.cpp's runs and the
file written (named by its time and commit, never overwritten).

The development side, before a GPU call whose copy of the tree has no usable .git:

    python benchmarks/records.py --archive      # writes .anchor/commit.json (carried with .anchor)
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# paths carried to a GPU machine beside the tree that are not the code measured (the llama.cpp
# source and build, wheels, prebuilt kernels) and the records a run writes: left out of the tree
# hash on both sides
NOT_CODE = ("/.anchor/", "/.whl/", "/.kcubins/", "/.cache/", "/.venv/", "/benchmarks/results/")
# kernels/__init__.py's variable naming prebuilt kernel binaries (read here from the environment
# a run's launches inherit; strata_dist.kernels is not imported, so no GPU package is needed)
CUBINS_ENV = "STRATA_KERNEL_CUBINS"


def fail(message: str):
    """One `error:` line and exit status 2 (the project's rule for bad input)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class PeakMemory:
    """The devices' peak memory in use while the block runs (NVML), in bytes above the start:
    `index`, one card or several (a list: their sum, sampled together; a card named twice, as
    two ranks sharing it, counts once). `mark()` starts a new window: `window_gib()` is the peak
    since the last mark, above the same start (one llama-bench test among several)."""

    def __init__(self, index: int | list[int] = 0, period_s: float = 0.02):
        self.indices = sorted(set(index if isinstance(index, (list, tuple)) else [index]))
        self.period_s = period_s
        self.peak = self.base = self.window = 0
        self._stop = threading.Event()

    def __enter__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            self._used = lambda: sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
        except Exception:          # no NVML (a CPU run): nothing to sample
            self._used = None
            return self
        self.base = self.peak = self.window = self._used()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.period_s):
            used = self._used()
            self.peak = max(self.peak, used)
            self.window = max(self.window, used)

    def mark(self) -> float:
        """The window's peak in GiB above the start, and a new window begun."""
        gib = (self.window - self.base) / 2**30
        self.window = self.base if self._used is None else self._used()
        return gib

    def __exit__(self, *exc):
        self._stop.set()
        if self._used is not None:
            self._t.join(timeout=1)

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 2**30


def nvml_available() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """n token ids below the specials, starting differently for every seed: the prompts a
    benchmark MEASURES (stride 7919)."""
    top = min(vocab - 8, 100_000)
    return [((i + seed) * 7919) % (top - 10) + 10 for i in range(n)]


def profile_prompt_ids(n: int, k: int, vocab: int) -> list[int]:
    """The k-th prompt a routing profile is recorded on: another stride (7927), so no two
    consecutive ids of it follow each other in any measured prompt (prompt_ids' steps are 7919
    modulo the same range): the cache is profiled on text none of the measured requests holds.
    assert_disjoint checks it on the prompts actually used."""
    top = min(vocab - 8, 100_000)
    return [((i + 613 * k) * 7927) % (top - 10) + 10 for i in range(n)]


def assert_disjoint(profile: list[list[int]], measured: list[list[int]]) -> None:
    """Refuse a run whose profile prompts share a pair of consecutive ids with a measured prompt
    (a measured request would then contain a piece of what the cache was ranked by)."""
    def pairs(prompts):
        return {(p[i], p[i + 1]) for p in prompts for i in range(len(p) - 1)}
    common = pairs(profile) & pairs(measured)
    if common:
        fail(f"the profile prompts share {len(common)} pairs of consecutive ids with the measured "
             f"prompts (e.g. {sorted(common)[0]}): the cache would be profiled on measured text")


def record_profile(model: str, n_prompts: int, vocab: int, out: str, device: str,
                   measured_prompts: list[list[int]]) -> None:
    """The routing profile the plans rank experts by (`strata-dist profile`), recorded on
    n_prompts prompts of 512 ids drawn apart from every prompt the run measures
    (`measured_prompts`; refused if they overlap)."""
    prompts = [profile_prompt_ids(512, k, vocab) for k in range(n_prompts)]
    assert_disjoint(prompts, measured_prompts)
    ids = os.path.join(os.path.dirname(out), "prompts.txt")
    with open(ids, "w") as f:
        for p in prompts:
            f.write(",".join(map(str, p)) + "\n")
    cmd = [sys.executable, "-m", "strata_dist.tools.cli", "profile", "--model", model,
           "--prompt-ids-file", ids, "--out", out, "--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        fail(f"strata-dist profile failed: {done.stderr.strip()[-1500:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)


def measured(r: dict, what: str) -> dict:
    """A measured request's reply, refused if it failed or RESUMEd a cached prefix (a figure of a
    prompt read in part is not the prompt's)."""
    if r["err"]:
        fail(f"strata-dist failed on {what}: {r['err']}")
    if r["resume"]:
        fail(f"{what} resumed at {r['resume']} (RESUME ≠ 0): it shares a prefix with an earlier "
             f"request, so its time is not a whole prompt's")
    return r


def full_decodes(session, prompts: list[list[int]], tokens: int, repeats: int,
                 options: str = "stats=1") -> tuple[list[dict], int]:
    """`repeats` measured requests of `tokens` new tokens each, on the first of `prompts` whose
    greedy tokens run that long: a request that stops at an end-of-text token before `tokens`
    (llama-bench's tg never stops) gives way to the next prompt. The replies, and how many
    prompts gave way; refused if `prompts` run out."""
    done, skipped = [], 0
    for i, ids in enumerate(prompts):
        r = measured(session.gen(ids, tokens, options, timeout=1800), f"decode request {i + 1}")
        if int(r["done"][0]) < tokens:
            skipped += 1
            continue
        done.append(r)
        if len(done) == repeats:
            return done, skipped
    fail(f"only {len(done)} of {len(prompts)} decode prompts ran {tokens} new tokens without "
         f"stopping (end of text): ask fewer --tokens")


def serve_session(model: str, *args: str, env: dict | None = None, timeout: float = 900,
                  cwd: str | None = None):
    """tests/launch_helpers.ServeSession, a launch that fails said in one error line; `cwd`: the
    tree whose code the launch runs (tree_arm.py), default the current directory's."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from launch_helpers import ServeSession
    try:
        return ServeSession(model, *args, env=env, timeout=timeout, cwd=cwd)
    except (EOFError, TimeoutError) as e:
        lines = [ln for ln in str(e).splitlines() if ln.startswith("error:")]
        fail(f"strata-launch {' '.join(args)}: "
             + (lines[-1].removeprefix("error: ") if lines else str(e)[-600:]))


def model_facts(path: str, popularity: str = "") -> dict:
    """The file measured: its name, quantisation, routing law (the synthetic file's own metadata,
    else `popularity` as the command line gave it; refused where they disagree or neither says),
    size, tensor count by GGML type and vocabulary."""
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.synth import parse_popularity
    if not os.path.isfile(path):
        fail(f"--model {path}: no such file")
    g = GGUFModel(path)
    name = str(g.metadata("general.name") or os.path.basename(path))
    gate = g.tensor("blk.0.ffn_gate_exps.weight")
    stored = str(g.metadata("strata.synth.popularity") or "")
    law = stored
    if popularity:
        try:
            given = str(parse_popularity(popularity))
        except ValueError:
            given = popularity      # a real file's law, as its measurement names it
        if stored and given != stored:
            fail(f"--popularity {popularity}: {path} was written with {stored}")
        law = stored or given
    if not law:
        fail(f"{path} does not say its routing law (strata.synth.popularity): pass --popularity")
    types: dict[str, int] = {}
    for t in g.tensors.values():
        types[t.ggml_type.name] = types.get(t.ggml_type.name, 0) + 1
    return {"like": name.removeprefix("strata synthetic "), "quant": file_type_name(g, gate),
            "shards": len(g.shard_paths), "popularity": law, "bytes": g.file_bytes,
            "types": dict(sorted(types.items())),
            "vocab": int(g.tensor("token_embd.weight").shape[0])}


def file_type_name(g, gate) -> str:
    """The file type a user would name the file by: the synth's --quant where the synth wrote it
    (q4_k and q4_k_m share general.file_type), else llama.cpp's general.file_type (q4_k_m, iq3_s
    ...), else the experts' block type for a file that says neither."""
    from gguf import LlamaFileType
    synth = g.metadata("strata.synth.quant")
    if synth:
        return str(synth)
    ftype = g.metadata("general.file_type")
    try:
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").lower()
    except (TypeError, ValueError):
        return gate.ggml_type.name.lower()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine() -> dict:
    out = {"cpu_cores": os.cpu_count(), "cpu": cpu_model()}
    if not out["cpu"]:
        del out["cpu"]
    try:
        import pynvml
        pynvml.nvmlInit()
        out["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                       for i in range(pynvml.nvmlDeviceGetCount())]
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        out["gpus"] = []
    return out


# Every compute option in force goes into a record, by the variable that sets it: the launch's
# ComputeOptions (protocol/compute_options.py, read by the one reader strata-launch uses) and the
# planner's PlanParams (strata_dist/plan/params.py). Read by strata_dist, no compute option
# (where files go, logging, credentials, how kernel binaries are built and found: the same
# kernels and paths either way); tests/test_compute_options.py checks that every other STRATA_
# variable strata_dist reads is in one of the two typed records.
NOT_COMPUTE = ("STRATA_CACHE_DIR", "STRATA_LOG", "STRATA_TOKEN", "STRATA_KERNEL_CUBINS",
               "STRATA_KERNEL_LINEINFO")


def compute_env_vars() -> dict:
    from protocol.compute_options import ENV_VARS
    return ENV_VARS


def plan_env_vars() -> dict:
    from strata_dist.plan.params import ENV_VARS
    return ENV_VARS


def options(env: dict | None = None) -> dict:
    """Every compute option in force (the environment, `env` winning), by its variable: the
    launch's compute options as strata-launch reads them (each variable's text for the value in
    force, defaults included) and the planner's parameters (the typed PlanParams). A value the
    launcher would refuse fails the run here, naming the variable."""
    from protocol.compute_options import env_text
    from strata_dist.compute_options import read_environment
    from strata_dist.plan.params import params_from_env
    merged = {**os.environ, **(env or {})}
    try:
        out = env_text(read_environment(merged))
        params = params_from_env(merged).to_dict()
    except ValueError as e:
        fail(str(e))
    for var, (field, _) in plan_env_vars().items():
        value = params[field]
        out[var] = ("" if value is None else str(int(value)) if isinstance(value, bool)
                    else str(value))
    return dict(sorted(out.items()))


def env_prefix(env: dict | None = None) -> str:
    """"K=V " for each compute variable set in the environment (or in `env`, which wins), to put
    before a command: a record then says which build and path its figure is of."""
    merged = {**os.environ, **(env or {})}
    names = list(compute_env_vars()) + list(plan_env_vars())
    return "".join(f"{k}={shlex.quote(merged[k])} " for k in names if merged.get(k))


# ---- the commit measured ------------------------------------------------------------------------
def local_excludes(root: str = ROOT) -> list[str]:
    """The patterns of <root>/.git/info/exclude: files git ignores here, which a copy of the tree
    made by git's rules leaves out too."""
    try:
        with open(os.path.join(root, ".git", "info", "exclude")) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError:
        return []


def tree_hash(root: str = ROOT, excludes: list[str] | None = None) -> str:
    """The git tree hash of the files under `root` as they are (tracked or not; .gitignore
    honoured, NOT_CODE left out), computed in a scratch repository so neither the real index nor a
    copy's stale .git takes part: the development side and a GPU machine's copy of the same files
    give the same hash (file modes left out: a copy need not keep the executable bits).
    `excludes`: more patterns (the development side's .git/info/exclude,
    default this tree's own). "" without git."""
    with tempfile.TemporaryDirectory() as scratch:
        exclude_file = os.path.join(scratch, "exclude")
        with open(exclude_file, "w") as f:
            f.write("\n".join(("/.git", *NOT_CODE, *(local_excludes(root) if excludes is None
                                                     else excludes))) + "\n")
        env = {"GIT_DIR": os.path.join(scratch, "git"), "GIT_WORK_TREE": root,
               "GIT_INDEX_FILE": os.path.join(scratch, "index")}
        try:
            add = ("-c", f"core.excludesFile={exclude_file}", "-c", "core.fileMode=false",
                   "add", "-A", ".")
            for args in (("init", "-q"), add, ("write-tree",)):
                done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root,
                                      timeout=120, env={**os.environ, **env})
                if done.returncode != 0:
                    return ""
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()


def describe(root: str = ROOT) -> str:
    """`git describe --always --dirty` of the tree at `root`; "" without a usable .git there
    (one of a directory above it does not count: it describes another tree)."""
    if not os.path.exists(os.path.join(root, ".git")):
        return ""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, cwd=root, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def archive(root: str = ROOT) -> dict:
    """What the development side writes before a GPU call (`--archive`): the describe and tree
    hash of the files it sends, in <root>/.anchor/commit.json."""
    excludes = local_excludes(root)
    info = {"commit": describe(root), "tree": tree_hash(root, excludes), "excludes": excludes}
    if not info["commit"] or not info["tree"]:
        fail(f"no usable git in {root} to describe the tree archived")
    path = os.path.join(root, ".anchor", "commit.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(info, f)
    return info


def commit_info(root: str = ROOT) -> dict:
    """The commit measured, computed: `git describe` of this tree where it names it exactly (a
    clean tree), else the development side's archive (.anchor/commit.json) when its tree hash is
    this tree's (`commit_source: archive`), else git's describe, -dirty and all, with the tree
    hash beside it. Refused where an archive names another tree and no git can name this one, or
    nothing can."""
    here = describe(root)
    if here and not here.endswith("-dirty"):
        return {"commit": here, "commit_source": "git"}
    archived_at = os.path.join(root, ".anchor", "commit.json")
    archived = None
    if os.path.exists(archived_at):
        with open(archived_at) as f:
            archived = json.load(f)
    tree = tree_hash(root, archived.get("excludes") if archived else None)
    if archived is not None and (not tree or archived.get("tree") == tree):
        # tree_checked false: no git here to hash the files with (the archive is taken on trust)
        return {"commit": archived["commit"], "commit_source": "archive",
                "tree": archived.get("tree", ""), "tree_checked": bool(tree)}
    if archived is not None:
        stale = (f"{archived_at} names tree {archived.get('tree')} ({archived.get('commit')}), "
                 f"but the files here are tree {tree}")
        if not here:
            fail(f"{stale}: run `python benchmarks/records.py --archive` just before the call")
        print(f"warning: {stale}; the record names git's {here} and that tree", file=sys.stderr)
    if here:
        return {"commit": here, "commit_source": "git", "tree": tree}
    fail(f"no usable .git in {root} and no {archived_at}: run `python benchmarks/records.py "
         f"--archive` on the development side before the call")


# ---- the plan's prediction, tokens against earlier records, the record --------------------------
def predicted_ms_per_token(model: str, launch_args: list[str], env: dict | None = None,
                           tree: str = ROOT) -> float | None:
    """The plan's own prediction of decode ms/token for a strata arm: `strata-launch --plan-only
    --json` with the arm's flags on this machine (the same inventory the arm plans on), so a
    record holds the prediction beside the measurement; `tree`: the tree whose planner predicts
    (an older tree's arm, tree_arm.py). None when planning fails (said why)."""
    argv = [sys.executable, "-m", "launcher.cli", "--model", os.path.abspath(model), *launch_args,
            "--plan-only", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=tree)
    if done.returncode != 0:
        print(f"plan-only failed: {done.stderr[-800:]}", flush=True)
        return None
    return round(float(json.loads(done.stdout)["predicted_ms_per_token"]), 3)


def record_model(facts: dict) -> dict:
    """The file a record measured, as its `model` field names it (model_facts less the vocabulary)."""
    return {k: facts[k] for k in ("like", "quant", "shards", "popularity", "bytes", "types") if k in facts}


def median_tps(n: int, times_ms: list[float], what: str = "a measured request"
               ) -> tuple[float, list[float]]:
    """n tokens over each time: the median tok/s and every repeat's. A time of 0 ms is refused
    (the head took the request's events in one burst, as on a loaded CPU: nothing was timed)."""
    if min(times_ms) <= 0:
        fail(f"{what} was timed at 0 ms (the head read its events in one burst): measure more "
             f"tokens")
    each = [round(n / (t / 1e3), 2) for t in times_ms]
    return round(statistics.median(each), 2), each


def tokens_against_records(bench: str, facts: dict, arm: str, sha: str,
                           results_dir: str = os.path.join(HERE, "results"),
                           like: dict | None = None) -> str:
    """A line saying whether arm `arm`'s greedy tokens (`sha`, their tokens_sha256) are those of
    the latest earlier record of the same bench, file and arm in `results_dir`, so a run shows at
    once whether a change moved a bit of the output. `like`: fields the earlier arm must hold
    with the same values (the request the tokens are of: tokens of another prompt differ
    without anything having changed)."""
    key = {k: v for k, v in record_model(facts).items() if k != "types"}
    best = None
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not (name.startswith(f"{bench}-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(results_dir, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        theirs = {k: v for k, v in record.get("model", {}).items() if k != "types"}
        if theirs != key:
            continue
        for a in record.get("arms", []):
            if a.get("name") == arm and a.get("tokens_sha256") and all(
                    a.get(k) == v for k, v in (like or {}).items()):
                when = record.get("date", "") + record.get("time", "")
                if best is None or when >= best[0]:
                    best = (when, name, a["tokens_sha256"], record.get("commit", "?"),
                            record.get("date", ""))
    if best is None:
        what = "".join(f", {k} {v}" for k, v in (like or {}).items())
        return f"{arm}: no earlier record of this file{what} to compare the tokens with"
    _, name, earlier, commit_, date = best
    verdict = ("the same tokens as" if earlier == sha
               else f"tokens DIFFER ({sha[:8]}… against {earlier[:8]}…) from")
    return f"{arm}: {verdict} {name} (commit {commit_}, {date})"


def device_arch() -> str:
    """The first card's compute capability as the kernels' binaries name it ("90"), from
    nvidia-smi; kernels/prebuild.py's default ("90", an H100 or H200) without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "90"
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode != 0 or not first or not re.fullmatch(r"\d+\.\d+", first[0].strip()):
        return "90"
    return first[0].strip().replace(".", "")


def kernels_built_by(nvrtc: bool = False, shape: str | None = None) -> str:
    """How a GPU launch of this tree builds its kernels: "prebuilt" where $STRATA_KERNEL_CUBINS
    holds kernels/prebuild.py's nvcc binary of every source at the launch's kernel shape (`shape`;
    None: the environment's), "nvrtc" where it holds none of them (CuPy compiles each source in
    the rank with -ftz=true appended, or reads its own earlier compile from its kernel cache),
    "mixed" between (kernels/__init__.py compiles what is missing). `nvrtc`: the launch is given
    no folder (bench_decode --nvrtc-arm). A user's ranks build with NVRTC unless they prebuild."""
    folder = os.environ.get(CUBINS_ENV)
    if nvrtc or not folder or not os.path.isdir(folder):
        return "nvrtc"
    from strata_dist.compute_options import read_environment
    from strata_dist.kernels import cubin_name, sources
    from strata_dist.kernels.abi import KernelShape
    defines = KernelShape.parse(read_environment().kernel_shape if shape is None
                                else shape).defines()
    arch = device_arch()
    names = [cubin_name(s.name, defines if s.name == "decode.cu" else (), arch)
             for s in sources()]
    there = sum(os.path.isfile(os.path.join(folder, n)) for n in names)
    return "prebuilt" if there == len(names) else "nvrtc" if there == 0 else "mixed"


class Recorder:
    """One run's record: its identity (commit, time, options, machine) taken when the run
    starts, so every save of the run (bench_prefill.py rewrites its own after each arm) is the
    same file; a file already there that this run did not write is never overwritten."""

    def __init__(self, bench: str, facts: dict, out_dir: str, tag: str = ""):
        now = datetime.datetime.now()
        self.head = {"bench": bench, "date": now.strftime("%Y-%m-%d"),
                     "time": now.strftime("%H:%M:%S"), **commit_info(), "options": options(),
                     "machine": machine(), "kernels_built_by": kernels_built_by(),
                     "model": record_model(facts)}
        if tag:
            self.head["tag"] = tag
        # ../shared/RECORDS.md's name; a tag (bench_tiers.py's `helper`) is a field, not a part
        name = "-".join((bench, facts["like"], facts["quant"], self.head["date"],
                         now.strftime("%H%M%S"), self.head["commit"]))
        self.path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(self.path):
            fail(f"{self.path} exists: a record is never overwritten")
        os.makedirs(out_dir, exist_ok=True)
        self.written = False

    def save(self, arms: list[dict], **extra) -> str:
        record = {**self.head, **extra, "arms": arms}
        mode = "w" if self.written else "x"      # "x": refused if the file exists
        try:
            with open(self.path, mode) as f:
                json.dump(record, f, indent=1)
                f.write("\n")
        except FileExistsError:
            fail(f"{self.path} exists: a record is never overwritten")
        self.written = True
        return self.path


if __name__ == "__main__":
    if sys.argv[1:] == ["--archive"]:
        print(json.dumps(archive()))
        sys.exit(0)
    fail(f"usage: python benchmarks/records.py --archive (got {' '.join(sys.argv[1:])})")
