"""What every benchmark's record (benchmarks/results/, the format of docs/BENCHMARKS.md) is made
of: the model file's facts, the machine, the commit measured, the device's peak memory while an
arm runs, the prompts, and the file written."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


class PeakMemory:
    """The devices' peak memory in use while the block runs (NVML), in bytes above the start:
    `index`, one card or several (a list: their sum, sampled together; a card named twice, as
    two ranks sharing it, counts once)."""

    def __init__(self, index: int | list[int] = 0, period_s: float = 0.02):
        self.indices = sorted(set(index if isinstance(index, (list, tuple)) else [index]))
        self.period_s = period_s
        self.peak = self.base = 0
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
        self.base = self.peak = self._used()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self._used())

    def __exit__(self, *exc):
        self._stop.set()
        if self._used is not None:
            self._t.join(timeout=1)

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 2**30


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """n token ids below the specials, starting differently for every seed."""
    top = min(vocab - 8, 100_000)
    return [((i + seed) * 7919) % (top - 10) + 10 for i in range(n)]


def model_facts(path: str) -> dict:
    from strata_dist.gguf_model import GGUFModel
    g = GGUFModel(path)
    name = str(g.metadata("general.name") or os.path.basename(path))
    gate = g.tensor("blk.0.ffn_gate_exps.weight")
    return {"like": name.removeprefix("strata synthetic "), "quant": gate.ggml_type.name.lower(),
            "popularity": str(g.metadata("strata.synth.popularity") or ""),
            "bytes": os.path.getsize(path), "vocab": int(g.tensor("token_embd.weight").shape[0])}


def machine() -> dict:
    out = {"cpu_cores": os.cpu_count()}
    try:
        import pynvml
        pynvml.nvmlInit()
        out["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                       for i in range(pynvml.nvmlDeviceGetCount())]
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        out["gpus"] = []
    return out


# environment variables that change how the GPU path computes: a strata arm's command names
# those that are set
COMPUTE_ENV = ("STRATA_KERNEL_SHAPE", "STRATA_HOST_MAPPED", "STRATA_PDL", "STRATA_ATTN_HEADS",
               "STRATA_DECODE_AHEAD", "STRATA_FUSED_QK_NORM", "STRATA_DECODE_GRAPH",
               "STRATA_GROUPED_EXPERTS", "STRATA_ROWS_MMA", "STRATA_DEVICE_ROUTING",
               "STRATA_FLASH_PREFILL", "STRATA_FUSED_PROMPT_OPS", "STRATA_GDN_KERNELS")


def env_prefix(env: dict | None = None) -> str:
    """"K=V " for each of COMPUTE_ENV set in the environment (or in `env`, which wins), to put
    before a command: a record then says which build and path its figure is of."""
    import shlex
    merged = {**os.environ, **(env or {})}
    return "".join(f"{k}={shlex.quote(merged[k])} " for k in COMPUTE_ENV if merged.get(k))


def commit() -> str:
    """The commit measured: $STRATA_COMMIT when set (a copied tree whose git metadata is older
    than its files, as on the GPU machine, would otherwise name the wrong one), else git's."""
    if os.environ.get("STRATA_COMMIT"):
        return os.environ["STRATA_COMMIT"]
    try:
        # "-dirty" when the tree measured differs from that commit
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, cwd=HERE, timeout=10).stdout.strip()
    except OSError:
        return ""


def llama_bench(cmd: list[str]) -> tuple[list[dict], float, str]:
    """Run llama.cpp's llama-bench (`cmd`, with `-o json`): its result rows, the device's peak
    memory in GiB while it ran, and the command as a record names it."""
    print("llama.cpp:", " ".join(cmd), flush=True)
    with PeakMemory() as mem:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout), mem.gib, " ".join(["llama-bench"] + cmd[1:])


def predicted_ms_per_token(model: str, launch_args: list[str], env: dict | None = None
                           ) -> float | None:
    """The plan's own prediction of decode ms/token for a strata arm: `strata-launch --plan-only
    --json` with the arm's flags on this machine (the same inventory the arm plans on), so a
    record holds the prediction beside the measurement. None when planning fails (said why)."""
    argv = [sys.executable, "-m", "launcher.cli", "--model", model, *launch_args,
            "--plan-only", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=os.path.join(HERE, ".."))
    if done.returncode != 0:
        print(f"plan-only failed: {done.stderr[-800:]}", flush=True)
        return None
    return round(float(json.loads(done.stdout)["predicted_ms_per_token"]), 3)


def record_model(facts: dict) -> dict:
    """The file a record measured, as its `model` field names it (model_facts less the vocabulary)."""
    return {k: facts[k] for k in ("like", "quant", "popularity", "bytes")}


def tokens_against_records(bench: str, facts: dict, arm: str, sha: str,
                           results_dir: str = os.path.join(HERE, "results"),
                           like: dict | None = None) -> str:
    """A line saying whether arm `arm`'s greedy tokens (`sha`, their tokens_sha256) are those of
    the latest earlier record of the same bench, file and arm in `results_dir`, so a run shows at
    once whether a change moved a bit of the output. `like`: fields the earlier arm must hold
    with the same values (the request the tokens are of: tokens of another prompt differ
    without anything having changed)."""
    key = record_model(facts)
    best = None
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not (name.startswith(f"{bench}-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(results_dir, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("model") != key:
            continue
        for a in record.get("arms", []):
            if a.get("name") == arm and a.get("tokens_sha256") and all(
                    a.get(k) == v for k, v in (like or {}).items()):
                if best is None or record.get("date", "") >= best[0]:
                    best = (record.get("date", ""), name, a["tokens_sha256"],
                            record.get("commit", "?"))
    if best is None:
        what = "".join(f", {k} {v}" for k, v in (like or {}).items())
        return f"{arm}: no earlier record of this file{what} to compare the tokens with"
    date, name, earlier, commit_ = best
    verdict = ("the same tokens as" if earlier == sha
               else f"tokens DIFFER ({sha[:8]}… against {earlier[:8]}…) from")
    return f"{arm}: {verdict} {name} (commit {commit_}, {date})"


def write_record(bench: str, facts: dict, arms: list[dict], out_dir: str, tag: str = "") -> str:
    """benchmarks/results/<bench>-<like>-<quant>-<date>[-<tag>].json; returns its path. `tag`
    tells apart two benches writing records of one kind (bench_tiers.py's `helper` offload
    records beside bench_offload.py's)."""
    today = datetime.date.today().isoformat()
    record = {"bench": bench, "date": today, "commit": commit(), "machine": machine(),
              "model": record_model(facts), "arms": arms}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{bench}-{facts['like']}-{facts['quant']}-{today}"
                                 f"{'-' + tag if tag else ''}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path
