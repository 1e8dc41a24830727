"""Many streams at once: strata-launch --port serving N concurrent streams, beside llama.cpp's
llama-batched-bench on the same file with the same N and lengths, in one run.

The strata arms share one launch (`strata-launch --port 0`, one rank per listed GPU: `--gpus 0`,
or `--gpus 0,0` for two ranks on one card; `--cpu` for CPU ranks). After a warm-up request, every
prompt is first run ALONE, one request at a time (the reference tokens), then for each N of
--streams, N distinct prompts are sent at once by a real HTTP client (httpx, one streaming
/v1/completions request each, in a random order drawn from --seed): --prompt-tokens ids each,
--tokens new tokens, greedy (temperature 0), `ignore_eos` (every stream runs its whole length, as
llama.cpp's generation does) and `cache_prompt: false` (every request reads its whole prompt; a
reply whose usage names a cached token is refused). Per arm (one per N):

  ttft_p50_ms, ttft_p99_ms   from a request's send to its first token, over the N streams
  itl_p50_ms, itl_p99_ms     between consecutive tokens of a stream, over every stream's tokens
  aggregate_tok_s            decode tokens (each stream's tokens after its first) over the seconds
                             in which at least one stream was decoding (the union of each stream's
                             first-to-last-token interval): the rate of decode steps, as
                             llama-batched-bench's S_TG is
  end_to_end_tok_s           every new token over the seconds from the first send to the last token
  tokens_identical_to_alone  every stream's tokens are those of its prompt run alone

With --llama-batched-bench, llama.cpp reads the same file: `llama-batched-bench -ngl 99 -fa 1
-npp P -ntg T -npl N,.. -c <the largest N x (P + T)>`, once per micro-batch of --ubatches (`-b` the
largest), its table parsed; each N is an arm at its best (decode: the -ub with the highest S_TG,
its end-to-end rate from the same test; first token: the -ub with the shortest prompt phase), every
test kept in `ubatch_sweep`. batched-bench reads the N prompts as one batch and then decodes the N
streams in lockstep: every stream's first token waits for the whole prompt phase (ttft_p50 =
ttft_p99 = T_PP) and each of its steps gives every stream one token (itl_p50 = T_TG / T).

With --shape-arm SHAPE a second launch built with STRATA_KERNEL_SHAPE=SHAPE runs the same prompts
alone and the same N (its arms carry `kernel_shape`, `aggregate_vs_first_arm` and whether its
prompts alone gave the first launch's tokens): a kernel variant's serving figure in one record.
With --tree-arm TARBALL (a `git archive <commit> | xz` of an older tree, benchmarks/tree_arm.py)
one more launch is that tree's own launcher and ranks: an after / before figure at every N.

The record (../shared/RECORDS.md, `bench: serve`) goes to
benchmarks/results/serve-<like>-<quant>-<date>-<HHMMSS>-<commit>.json, rewritten after each arm.
The script exits 1, after writing it, when any stream's tokens differ from its prompt's alone.

    python benchmarks/bench_serve.py --model q30.gguf --gpus 0 \\
        --llama-batched-bench .anchor/llama.cpp/build/bin/llama-batched-bench
    python benchmarks/bench_serve.py --model q30.gguf --gpus 0,0     # two ranks on one card
    python benchmarks/bench_serve.py --model q30.gguf --streams 1,4,16 \
        --launch-args "--parallel 16" --shape-arm matvec_mma=1
    strata-dist synth tiny.gguf --like tiny --quant q8_0 --popularity zipf:1.0 --quiet
    python benchmarks/bench_serve.py --model tiny.gguf --cpu --streams 1,2 --prompt-tokens 32 --tokens 8
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import random
import re
import shlex
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from llama_runs import UBATCHES, llama_build, llama_source, llama_wait  # noqa: E402
from records import (PeakMemory, Recorder, env_prefix, fail, model_facts,  # noqa: E402
                     prompt_ids)
from tree_arm import OlderTree, first_difference  # noqa: E402

WARM_UP_SEED = 7
LISTENING = re.compile(r"listening on (http://\S+)")
REQUEST_TIMEOUT_S = 1800.0


def prompt_seed(i: int) -> int:
    """Prompt i's seed: 613 apart, more than a default prompt's length, so no two prompts share a
    run of ids."""
    return 1000 + 613 * i


class Server:
    """`strata-launch --port 0` with the arm's flags: its URL once it listens, ready once /health
    answers 200 (bounded); closed with a terminate, then a kill."""

    def __init__(self, model: str, flags: list[str], timeout: float, env: dict | None = None,
                 cwd: str = ROOT):
        import httpx
        argv = [sys.executable, "-m", "launcher.cli", "--model", model, "--port", "0", *flags]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=dict(os.environ, **(env or {})))
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        self.url = ""
        while not self.url:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.fail_launch("ended" if line is None else f"did not listen in {timeout:.0f} s")
            m = LISTENING.search(line or "")
            self.url = m.group(1) if m else ""
        with httpx.Client(timeout=10.0) as c:
            while True:
                if self.proc.poll() is not None:
                    self.fail_launch("ended")
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.fail_launch(f"not ready in {timeout:.0f} s")
                time.sleep(0.1)
            self.model_id = c.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def queue_status(self) -> dict:
        """/v1/status's queue: `parallel` (the sessions served at once; absent: one at a time)
        and, with --parallel, the batched steps and the requests they carried so far."""
        import httpx
        with httpx.Client(timeout=10.0) as c:
            return c.get(f"{self.url}/v1/status").json().get("queue") or {}

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def fail_launch(self, what: str):
        self.close()
        errors = [ln.strip() for ln in self.stderr if ln.startswith("error:")]
        fail(f"strata-launch {what}: " + (errors[-1].removeprefix("error: ") if errors
                                          else "".join(self.stderr)[-800:].strip()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def one_stream(client, url: str, body: dict) -> dict:
    """One streaming completion: when it was sent, each token's id and arrival time (a chunk's
    tokens arrive together), the cached prompt tokens its usage names, an error if any."""
    import httpx
    out = {"sent": time.perf_counter(), "arrivals": [], "tokens": [], "cached": None, "error": ""}
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    out["error"] = json.dumps(chunk["error"])[:300]
                    break
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    out["tokens"] += ids
                    out["arrivals"] += [now] * len(ids)
                if chunk.get("usage"):
                    out["cached"] = chunk["usage"].get("prompt_tokens_details", {}).get(
                        "cached_tokens", 0)
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_streams(server: Server, prompts: list[list[int]], tokens: int, order: list[int]
                ) -> list[dict]:
    """Every prompt as a streaming request of its own, all at once: the threads start in `order`
    (prompt indices); each waits at most REQUEST_TIMEOUT_S. The replies by prompt index."""
    import httpx
    results: list[dict | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0), limits=limits) as c:
        def go(i: int) -> None:
            results[i] = one_stream(c, server.url, {
                "model": server.model_id, "prompt": prompts[i], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "cache_prompt": False, "stream": True,
                "stream_options": {"include_usage": True}})
        threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in order]
        for t in threads:
            t.start()
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 60
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            fail(f"{sum(t.is_alive() for t in threads)} of {len(prompts)} streams did not end "
                 f"within {REQUEST_TIMEOUT_S:.0f} s")
    for i, r in enumerate(results):
        if r["error"]:
            fail(f"stream {i} of {len(prompts)}: {r['error']}")
        if len(r["tokens"]) != tokens:
            fail(f"stream {i} of {len(prompts)} gave {len(r['tokens'])} tokens, not {tokens}")
        if r["cached"] != 0:
            fail(f"stream {i} of {len(prompts)} reused {r['cached']} cached prompt tokens "
                 f"(cache_prompt false): its first token is not a whole prompt's")
    return results


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the two nearest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def stream_figures(results: list[dict]) -> dict:
    """The arm's figures from its streams (the module's docstring defines each)."""
    ttft = [(r["arrivals"][0] - r["sent"]) * 1e3 for r in results]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    decode_s = union_seconds([(r["arrivals"][0], r["arrivals"][-1]) for r in results])
    decode_tokens = sum(len(r["tokens"]) - 1 for r in results)
    wall_s = max(r["arrivals"][-1] for r in results) - min(r["sent"] for r in results)
    if decode_s <= 0 or not itl:
        fail("the streams' tokens arrived in one burst each (nothing to time): ask more --tokens")
    first_send = min(r["sent"] for r in results)
    return {"aggregate_tok_s": round(decode_tokens / decode_s, 2),
            "end_to_end_tok_s": round(sum(len(r["tokens"]) for r in results) / wall_s, 2),
            "ttft_p50_ms": round(percentile(ttft, 50), 2),
            "ttft_p99_ms": round(percentile(ttft, 99), 2),
            "itl_p50_ms": round(percentile(itl, 50), 3), "itl_p99_ms": round(percentile(itl, 99), 3),
            "ttft_ms_each": [round(x, 2) for x in ttft], "wall_s": round(wall_s, 3),
            "arrival_order": sorted(range(len(results)), key=lambda i: results[i]["sent"]),
            "sent_ms_after_first": [round((r["sent"] - first_send) * 1e3, 2) for r in results]}


def sha(token_lists: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()


def strata_flags(args) -> list[str]:
    devices = ["--cpu-ranks", str(args.cpu_ranks)] if args.cpu else ["--gpus", args.gpus]
    return [*devices, "--max-context", str(args.prompt_tokens + args.tokens + 16),
            "--no-remote-auto", "--queue-size", str(max(64, max(args.streams))),
            *shlex.split(args.launch_args)]


def strata_arms(args, vocab: int, save, kernel_shape: str | None = None, tree=None
                ) -> tuple[list[dict], bool, list[list[int]]]:
    """One launch; every prompt alone first, then one arm per N of --streams (each saved as it
    ends). The arms, whether every stream's tokens were its prompt's alone, and each prompt's
    tokens alone. `kernel_shape` (not None): the launch's STRATA_KERNEL_SHAPE, whatever this
    process's is (--shape-arm). `tree` (tree_arm.OlderTree): the launch is that older tree's code
    (--tree-arm)."""
    env = None if kernel_shape is None else {"STRATA_KERNEL_SHAPE": kernel_shape}
    if tree is not None:
        env = {**(env or {}), **tree.env()}
    flags = strata_flags(args)
    ranks = args.cpu_ranks if args.cpu else len(args.gpus.split(","))
    cards = [] if args.cpu else sorted({int(g) for g in args.gpus.split(",")})
    name = "strata" if ranks == max(1, len(cards)) else f"strata {ranks} ranks"
    command = env_prefix(env) + "strata-launch --model M --port 0 " + " ".join(flags)
    prompts = [prompt_ids(args.prompt_tokens, prompt_seed(i), vocab)
               for i in range(max(args.streams))]
    arms, all_same = [], True
    with PeakMemory(cards or 0) as mem:
        t0 = time.perf_counter()
        server = Server(os.path.abspath(args.model), flags, timeout=args.load_timeout, env=env,
                        cwd=ROOT if tree is None else tree.dir)
        try:
            print(f"{name}: ready in {time.perf_counter() - t0:.0f} s ({command})", flush=True)
            run_streams(server, [prompt_ids(args.prompt_tokens, WARM_UP_SEED, vocab)],
                        args.tokens, [0])           # warm-up: graphs captured, pools grown
            alone = [run_streams(server, [p], args.tokens, [0])[0] for p in prompts]
            ttft = [(r["arrivals"][0] - r["sent"]) * 1e3 for r in alone]
            print(f"  {len(prompts)} prompts alone: ttft p50 {percentile(ttft, 50):.0f} ms",
                  flush=True)
            mem.mark()
            for n in args.streams:
                order = list(range(n))
                random.Random(args.seed * 1_000_003 + n).shuffle(order)
                before = server.queue_status()
                results = run_streams(server, prompts[:n], args.tokens, order)
                after = server.queue_status()
                differ = [i for i, r in enumerate(results) if r["tokens"] != alone[i]["tokens"]]
                all_same &= not differ
                arm = {"name": name, "gpus": len(cards), "ranks": ranks, "command": command,
                       "streams": n, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.tokens, **stream_figures(results),
                       "send_order": order, "tokens_identical_to_alone": not differ,
                       "streams_differing": differ,
                       "tokens_sha256": sha([r["tokens"] for r in results]),
                       "peak_gib": round(mem.mark(), 2), **served_at_once(before, after),
                       **({} if kernel_shape is None else {"kernel_shape": kernel_shape}),
                       **({} if tree is None else tree.fields())}
                arms.append(arm)
                save(arms)
                print(f"  {n:3d} streams: {arm['aggregate_tok_s']:9.1f} tok/s decode, "
                      f"{arm['end_to_end_tok_s']:9.1f} tok/s end to end; ttft p50 "
                      f"{arm['ttft_p50_ms']:.0f} ms, p99 {arm['ttft_p99_ms']:.0f} ms; itl p50 "
                      f"{arm['itl_p50_ms']:.1f} ms, p99 {arm['itl_p99_ms']:.1f} ms; tokens "
                      f"{'identical to' if not differ else f'of streams {differ} DIFFER from'} "
                      f"alone", flush=True)
        finally:
            server.close()
    return arms, all_same, [r["tokens"] for r in alone]


def served_at_once(before: dict, after: dict) -> dict:
    """What the server did with an arm's streams, from /v1/status around it: `parallel` (its
    sessions: the requests it serves at once, 1 without --parallel) and, with --parallel, the
    arm's batched steps and the mean requests a step carried, and how often a request alone
    was left to the last stage's own loop (`lone_loops`: the one-request path's steps, no batched
    step) and taken back into the batch when another came (`hand_backs`)."""
    parallel = int(after.get("parallel") or 1)
    steps = after.get("batched_steps", 0) - before.get("batched_steps", 0)
    requests = after.get("batched_requests", 0) - before.get("batched_requests", 0)
    return {"parallel": parallel, "batched_steps": steps,
            "mean_requests_per_step": round(requests / steps, 3) if steps else None,
            "lone_loops": after.get("lone_loops", 0) - before.get("lone_loops", 0),
            "hand_backs": after.get("hand_backs", 0) - before.get("hand_backs", 0)}


# ---- llama.cpp ----------------------------------------------------------------------------------
# a row of llama-batched-bench's table: PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6
                 + r"\s*$")


def parse_batched_table(text: str) -> list[dict]:
    """The rows of llama-batched-bench's table (its default output), each as a dict."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            pp, tg, b, n_kv = map(int, m.groups()[:4])
            t_pp, s_pp, t_tg, s_tg, t, s = map(float, m.groups()[4:])
            rows.append({"pp": pp, "tg": tg, "streams": b, "n_kv": n_kv, "t_pp_s": t_pp,
                         "s_pp_tok_s": s_pp, "t_tg_s": t_tg, "s_tg_tok_s": s_tg, "t_s": t,
                         "s_tok_s": s})
    return rows


# llama.cpp's log (its table too) is printed by a thread of its own that the process does not wait
# for at exit: a run that ends right after its last row (a small model) can lose the last lines.
# Such a run is made again, at most this often in all.
LLAMA_TRIES = 3


def llama_tests(args) -> list[dict]:
    """llama-batched-bench once per -ub of --ubatches (-b the largest; -c room for the largest N's
    streams, else batched-bench skips that N without a word): every row, with its -ub, command
    and the device's peak while its run went."""
    llama_wait(args.llama_batched_bench, args.llama_wait)
    ctx = max(args.streams) * (args.prompt_tokens + args.tokens)
    tests = []
    for ub in args.ubatches:
        cmd = [args.llama_batched_bench, "-m", args.model, "-ngl", "99", "-fa", "1", "-c", str(ctx),
               "-b", str(max(args.ubatches)), "-ub", str(ub), "-npp", str(args.prompt_tokens),
               "-ntg", str(args.tokens), "-npl", ",".join(map(str, args.streams))]
        print("llama.cpp:", " ".join(cmd), flush=True)
        for attempt in range(1, LLAMA_TRIES + 1):
            with PeakMemory() as mem:
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                except subprocess.TimeoutExpired:
                    fail(f"llama-batched-bench -ub {ub} did not end within 1800 s")
            if done.returncode != 0:
                fail(f"llama-batched-bench exited {done.returncode}: {done.stderr[-1500:]}")
            rows = parse_batched_table(done.stdout + "\n" + done.stderr)
            missing = sorted(set(args.streams) - {r["streams"] for r in rows})
            if not missing:
                break
            if attempt == LLAMA_TRIES:
                fail(f"llama-batched-bench -ub {ub} printed no row for N = {missing} in "
                     f"{LLAMA_TRIES} runs: {(done.stdout + done.stderr)[-800:]}")
            print(f"llama.cpp: -ub {ub} printed no row for N = {missing} (its log lost the "
                  f"last lines at exit): run {attempt + 1} of at most {LLAMA_TRIES}", flush=True)
        shown = ["llama-batched-bench"] + cmd[1:]
        tests += [{**r, "ubatch": ub, "command": " ".join(shown), "peak_gib": round(mem.gib, 2)}
                  for r in rows]
    return tests


def llama_arms(args, tests: list[dict]) -> list[dict]:
    """One arm per N: decode at the -ub with the highest S_TG, the first token at the -ub with the
    shortest prompt phase, every -ub's figures in ubatch_sweep."""
    build, arms = llama_build(args.llama_batched_bench), []
    source = llama_source(args.llama_batched_bench, build)
    for n in args.streams:
        mine = [t for t in tests if t["streams"] == n]
        dec = max(mine, key=lambda t: t["s_tg_tok_s"])
        first = min(mine, key=lambda t: t["t_pp_s"])
        arms.append({
            "name": "llama.cpp", "gpus": 0 if args.cpu else 1, "command": dec["command"],
            "build": build, "source": source, "streams": n, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.tokens, "aggregate_tok_s": dec["s_tg_tok_s"],
            "end_to_end_tok_s": round(n * args.tokens / dec["t_s"], 2),
            "ttft_p50_ms": round(first["t_pp_s"] * 1e3, 2),
            "ttft_p99_ms": round(first["t_pp_s"] * 1e3, 2),
            "itl_p50_ms": round(dec["t_tg_s"] / args.tokens * 1e3, 3),
            "ttft_basis": "the N prompts read as one batch: every first token after T_PP",
            "best": {"decode": {"ubatch": dec["ubatch"], "command": dec["command"]},
                     "ttft": {"ubatch": first["ubatch"], "command": first["command"]}},
            "ubatch_sweep": {str(t["ubatch"]): {k: t[k] for k in (
                "t_pp_s", "s_pp_tok_s", "t_tg_s", "s_tg_tok_s", "t_s", "s_tok_s", "n_kv")}
                for t in mine},
            "peak_gib": max(dec["peak_gib"], first["peak_gib"])})
    return arms


def numbers(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        fail(f"{flag} {text}: comma-separated whole numbers")
    if not out or min(out) < 1:
        fail(f"{flag} {text}: each at least 1")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0", help="strata's ranks, one per index (0,0: two on one card)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (no GPU needed)")
    ap.add_argument("--cpu-ranks", type=int, default=1, help="with --cpu: how many ranks")
    ap.add_argument("--streams", default="1,4,16,32", help="the concurrent stream counts, one arm each")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="ids in each prompt")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--seed", type=int, default=0, help="draws each N's random send order")
    ap.add_argument("--launch-args", default="",
                    help="more strata-launch flags, one string (e.g. \"--kv-type q8_0\")")
    ap.add_argument("--load-timeout", type=float, default=1200, help="seconds for the launch")
    ap.add_argument("--llama-batched-bench", default="", help="path of llama.cpp's llama-batched-bench")
    ap.add_argument("--ubatches", default=",".join(map(str, UBATCHES)),
                    help="llama.cpp: the micro-batches (-ub) swept; each N at its best")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for llama-batched-bench to appear (a build in the background)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--shape-arm", action="append", default=[], metavar="SHAPE",
                    help="one more strata launch built with STRATA_KERNEL_SHAPE=SHAPE (repeatable): "
                         "its arms (every N) beside the first launch's in one record, each with "
                         "its aggregate over the first launch's at the same N")
    ap.add_argument("--tree-arm", default="", metavar="TARBALL",
                    help="one more strata launch run by an older tree of this project (a `git "
                         "archive <commit> | xz` tarball; tree_arm.py): its arms beside the first "
                         "launch's in one record, an after / before ratio at every N")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    for shape in args.shape_arm:
        from strata_dist.kernels.abi import KernelShape
        try:
            KernelShape.parse(shape)
        except (TypeError, ValueError) as e:
            fail(f"--shape-arm {shape!r}: {e}")
    args.streams = numbers(args.streams, "--streams")
    args.ubatches = numbers(args.ubatches, "--ubatches")
    if args.prompt_tokens < 1 or args.tokens < 2:
        fail(f"--prompt-tokens {args.prompt_tokens} (>= 1), --tokens {args.tokens} (>= 2: an "
             f"inter-token latency needs two tokens)")
    if args.cpu_ranks < 1:
        fail(f"--cpu-ranks {args.cpu_ranks}: at least 1")
    if not args.cpu and not re.fullmatch(r"\d+(,\d+)*", args.gpus):
        fail(f"--gpus {args.gpus}: comma-separated GPU indices")
    try:
        shlex.split(args.launch_args)
    except ValueError as e:
        fail(f"--launch-args {args.launch_args!r}: {e}")
    if args.llama_batched_bench and args.llama_wait <= 0 and not os.access(
            args.llama_batched_bench, os.X_OK):
        fail(f"--llama-batched-bench {args.llama_batched_bench}: not an executable file")
    facts = model_facts(args.model, args.popularity)
    recorder = Recorder("serve", facts, args.out)     # a tree no commit names: refused now
    arms: dict[str, list[dict]] = {"strata": [], "llama.cpp": []}

    def save(strata=None, llama=None) -> str:
        arms["strata"] = strata if strata is not None else arms["strata"]
        arms["llama.cpp"] = llama if llama is not None else arms["llama.cpp"]
        return recorder.save(arms["strata"] + arms["llama.cpp"])

    first_arms, all_same, first_alone = strata_arms(args, facts["vocab"],
                                                    lambda a: save(strata=a))
    variants = [(shape, None) for shape in args.shape_arm]
    if args.tree_arm:
        variants.append((None, OlderTree(args.tree_arm)))
    for shape, tree in variants:
        other, same, alone = strata_arms(args, facts["vocab"],
                                         lambda a: save(strata=first_arms + a), shape, tree)
        all_same &= same
        # the same prompts alone under the other build or tree: a change that moves no bit
        # gives every prompt's tokens of the first launch
        differ = [i for i, (a, b) in enumerate(zip(alone, first_alone)) if a != b]
        parts = [first_difference(a, b) for a, b in zip(alone, first_alone)]
        label = f"STRATA_KERNEL_SHAPE={shape}" if tree is None else f"tree {tree.short}"
        for ours, base in zip(other, first_arms):
            ours["alone_tokens_identical_to_first_arm"] = not differ
            if tree is not None:
                # the record checker's fields of a tree arm: over every prompt alone
                ours["tokens_identical_to_first_arm"] = not differ
                ours["first_token_differing"] = min((p for p in parts if p is not None),
                                                    default=None)
            ours["aggregate_vs_first_arm"] = round(
                ours["aggregate_tok_s"] / base["aggregate_tok_s"], 3)
            print(f"  {ours['streams']:3d} streams, {label}: aggregate decode "
                  f"{ours['aggregate_vs_first_arm']:.3f}x the first launch's; prompts alone "
                  + ("identical to" if not differ else f"{differ} DIFFER from")
                  + " the first launch's"
                  + ("" if tree is None else "; " + tree.ratio_line(
                      base["aggregate_tok_s"], ours["aggregate_tok_s"], " aggregate")),
                  flush=True)
        first_arms = first_arms + other
        save(strata=first_arms)
    if args.llama_batched_bench:
        save(llama=llama_arms(args, llama_tests(args)))
        for ours, theirs in zip(arms["strata"], arms["llama.cpp"]):
            print(f"  {ours['streams']:3d} streams: strata / llama.cpp aggregate decode "
                  f"{ours['aggregate_tok_s'] / theirs['aggregate_tok_s']:.2f}x; ttft p99 "
                  f"{ours['ttft_p99_ms']:.0f} ms against {theirs['ttft_p99_ms']:.0f} ms "
                  f"(llama.cpp's decode at -ub {theirs['best']['decode']['ubatch']}, its first "
                  f"token at -ub {theirs['best']['ttft']['ubatch']})", flush=True)
    else:
        print("llama.cpp: no --llama-batched-bench given, its arms left out", flush=True)
    first = arms["strata"][0]
    for arm in [a for a in arms["strata"][1:] if "kernel_shape" not in a
                and "tree_commit" not in a]:
        print(f"  {arm['streams']:3d} streams / {first['streams']}: aggregate decode "
              f"{arm['aggregate_tok_s'] / first['aggregate_tok_s']:.2f}x", flush=True)
    print(f"record: {save()}")
    if not all_same:
        print("tokens: some streams' tokens DIFFER from their prompts' alone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
