"""Where a decode step's time goes, in one process: the graph step's wall time per token, and one
eager step with every kernel timed (CUDA events), summed per kernel over the layers.

With --rows N (N > 1) it then profiles a batched step of N sessions, each opened with its own short
prompt (different lengths), as a server running N streams takes it (Stage.run_batch: the replays
of at most max_rows rows, backends/batched_decode.py): the step's wall time, host included, and
its replays' GPU time alone (each replay's captured graph launched back to back), per step and
per row; then each replay eager with every kernel timed, summed per kernel beside the one-row
step's (`kernel | 1 row | N rows | N rows / 1 row`), and the kernels whose time grows most.

The figures go to a record (../shared/RECORDS.md, `bench: profile`, one arm: the launch's kernel
shape and how its kernels were built, the one-row step's times and kernels, each variant's replay,
and with --rows the batched step's), benchmarks/results/profile-<like>-<quant>-<date>-<HHMMSS>-
<commit>.json, written after the one-row part and again after the batched one.

    python benchmarks/profile_decode.py --model q30.gguf [--context 1024] [--steps 64] [--rows 16]
    python benchmarks/profile_decode.py --model real.gguf --popularity uniform   # a file that does
                                                  # not store its routing law (as bench_decode.py)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from records import Recorder, model_facts  # noqa: E402

# a matvec's build is named for its rows (kernels/abi.py matvec_kernel: matvec_<type>_<rows>);
# the table compares one kernel across row counts, so it names the matvec by its type
MATVEC = "matvec_"


def prompt_ids(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """n spread-out token ids of a made-up prompt (seed 0: the one-row profile's), all below
    n_vocab (a real vocabulary's ids 10..1009)."""
    span = min(1000, n_vocab - 10)
    if span < 1:
        raise ValueError(f"a vocabulary of {n_vocab} ids is too small for a made-up prompt")
    return [(7919 * (i + 101 * seed)) % span + 10 for i in range(n)]


def graph_ms(graph, stream, steps: int) -> float:
    """A captured graph launched `steps` times back to back on `stream`: ms per launch."""
    import cupy as cp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(steps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / steps


def replay_ms(runner, steps: int) -> float:
    """Capture the one-row graph afresh and replay it back to back: ms per replay."""
    runner.graphs.clear()
    graph, stream = runner._graph(1), runner.stream
    graph.launch(stream)
    return graph_ms(graph, stream, steps)


def _said(same):
    """A comparison's answer for the record: a plain bool (numpy's is not JSON), or why none."""
    return same if isinstance(same, str) else bool(same)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=64, help="tokens read before decoding")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of a batched step to profile after the one-row step (1: none)")
    ap.add_argument("--popularity", default="",
                    help="the file's routing law where it does not store it (uniform, zipf:S)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="the record's folder")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.steps < 1:
        ap.error(f"--rows and --steps must be >= 1, got --rows {args.rows} --steps {args.steps}")
    from strata_dist.compute_options import read_environment
    recorder = Recorder("profile", model_facts(args.model, args.popularity), args.out)
    arm = {"name": "strata", "gpus": 1, "command": "python benchmarks/profile_decode.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "kernel_shape": read_environment().kernel_shape, "context": args.context,
           "prompt_tokens": args.prompt, "steps": args.steps}
    from strata_dist.tools.single_process import SingleProcessRunner
    t0 = time.perf_counter()
    eng = SingleProcessRunner(args.model, args.device, max_context=args.context, prompt_chunk=512)
    runner = eng.decode_graph
    if runner is None:
        raise SystemExit("this model's decode steps take the general path (see the log)")
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    eng.prefill(prompt_ids(args.prompt, eng.model.g.n_vocab))
    tok = 11
    for _ in range(4):                                      # capture and warm up
        tok = eng.decode_step([tok]).greedy_token
    t1 = time.perf_counter()
    for _ in range(args.steps):
        tok = eng.decode_step([tok]).greedy_token
    ms = (time.perf_counter() - t1) * 1e3 / args.steps
    print(f"graph step: {ms:.3f} ms/token = {1e3 / ms:.1f} tok/s (one process, "
          f"{runner.le - runner.lb} layers)")
    arm.update(layers=runner.le - runner.lb, graph_step_ms=round(ms, 4))
    # the same loop with each next step launched before the host reads the token
    # (the default; STRATA_DECODE_AHEAD=0 turns it off): what the host's share per token costs
    start = eng.session.n_past
    # a qwen3next session's recurrent state is not positional: moving n_past back replays the
    # steps over a state that has moved on, so their tokens and logits are not comparable
    recurrent = bool(getattr(eng.session, "linear_layers", ()))
    plain_tokens, tok0 = [], tok
    for _ in range(16):
        tok0 = eng.decode_step([tok0]).greedy_token
        plain_tokens.append(tok0)
    eng.session.n_past = start
    built_ahead = runner.ahead_enabled
    runner.ahead_enabled, ahead_tokens, tok1 = True, [], tok
    t2 = time.perf_counter()
    for i in range(args.steps):
        tok1 = eng.decode_step([tok1], ahead=i + 1 < args.steps).greedy_token
        ahead_tokens.append(tok1)
    ahead_ms = (time.perf_counter() - t2) * 1e3 / args.steps
    runner.ahead_enabled = built_ahead
    runner.settle()
    same = "n/a (recurrent state)" if recurrent else ahead_tokens[:16] == plain_tokens
    print(f"graph step, the next one launched ahead (the default): {ahead_ms:.3f} "
          f"ms/token; the same tokens: {same}")
    eng.session.n_past = start
    # the graph alone on the GPU: replays queued back to back (the same position each time)
    gpu_ms = replay_ms(runner, args.steps)
    print(f"graph replay on the GPU: {gpu_ms:.3f} ms/token; host and hand-back per step: "
          f"{ms - gpu_ms:.3f} ms")
    arm.update(graph_step_ahead_ms=round(ahead_ms, 4), graph_replay_ms=round(gpu_ms, 4),
               ahead_tokens_equal=_said(same))
    times = runner.kernel_times(eng.session, eng.session.n_past, ids=[tok])
    alone = runner.kernel_times(eng.session, eng.session.n_past, ids=[tok], repeat=10)
    total = sum(times.values())
    layers = runner.le - runner.lb
    print(f"eager step, kernels only: {total / 1e3:.3f} ms (the same kernels each run 10 times "
          f"in a row: {sum(alone.values()) / 1e3:.3f} ms)")
    arm.update(kernels_us={k: round(v, 2) for k, v in times.items()},
               kernels_alone_us={k: round(v, 2) for k, v in alone.items()}, variants=[])
    print(f"  {'kernel':18s} {'in the step':>11s} {'share':>6s} {'per layer':>9s} {'alone':>9s}")
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {name:18s} {us:8.1f} us {us / total:6.1%} {us / layers:6.1f} us "
              f"{alone[name] / layers:6.1f} us")
    # the experiments, side by side: replay time, and the logits of one step at the same
    # position (each variant rewrites that position's KV with the same values; none may change
    # a bit of them)
    import numpy as np
    from strata_dist.kernels.abi import attn_heads_choices
    from strata_dist.kernels.pdl import ProgrammaticLauncher
    pos = eng.session.n_past
    built_pdl = runner._pdl
    variants = [(f"as built ({runner.attn_heads} query heads an attention block)", {}, None),
                ("plain launches (STRATA_PDL=0)", {}, False)]
    for heads in attn_heads_choices(runner.g.n_head // runner.g.n_head_kv):
        if heads != runner.attn_heads:
            variants.append((f"attention {heads} query heads a block (STRATA_ATTN_HEADS={heads})",
                             {"attn_heads": heads}, None))
    base = None
    for name, kwargs, pdl in variants:
        other = type(runner)(eng.model, eng.max_context, **kwargs) if kwargs else runner
        if pdl is not None:                    # else as built ($STRATA_PDL, the GPU)
            other._pdl = ProgrammaticLauncher() if pdl else None
        logits = np.asarray(other.step(eng.session, pos, ids=[11]))   # and the position replayed
        ms = replay_ms(other, args.steps)
        base = logits if base is None else base
        same = "n/a (recurrent state)" if recurrent else np.array_equal(logits, base)
        print(f"graph replay, {name}: {ms:.3f} ms/token; logits equal to the first: {same}",
              flush=True)
        arm["variants"].append({"name": name, "graph_replay_ms": round(ms, 4),
                                "logits_equal_to_first": _said(same)})
    runner._pdl = built_pdl
    print(f"record: {recorder.save([arm])}", flush=True)
    if args.rows > 1:
        arm["rows"] = profile_rows(eng, runner, args.rows, args.steps, times)
        print(f"record: {recorder.save([arm])}", flush=True)
    return 0


# ---- a batched step of --rows rows ---------------------------------------------------------------
def row_prompts(n: int, n_vocab: int) -> list[list[int]]:
    """Session i's prompt: 8 + 5 i made-up tokens of its own (short, each length different)."""
    return [prompt_ids(8 + 5 * i, n_vocab, seed=i + 1) for i in range(n)]


def first_row_ids(n: int, n_vocab: int) -> list[int]:
    """The token ids of the batched step's first rows (later steps feed each row its greedy
    token)."""
    return [(11 + 7 * i) % n_vocab for i in range(n)]


def open_sessions(eng, prompts: list[list[int]]) -> list:
    """A session a prompt, each prompt read into its own session by the runner's prompt path (the
    runner's own session is put back)."""
    own, sessions = eng.session, []
    try:
        for prompt in prompts:
            eng.session = eng.model.new_session(eng.max_context)
            eng.prefill(prompt)
            sessions.append(eng.session)
    finally:
        eng.session = own
    return sessions


def batch_replays(runner, sessions):
    """The replays of the sessions' next batched step (each at its n_past), as Stage.run_batch
    asks for them; an error where the graph would hand the step to the general path."""
    replays = runner.batch_replays(sessions, [s.n_past for s in sessions])
    if replays is None:
        raise SystemExit("a batched step of these sessions takes the general path (see the log)")
    return replays


def batched_step(runner, sessions, ids: list[int]) -> list[int]:
    """One batched step (Stage.run_batch's: batch_replays, then step_rows), the sessions advanced
    a position; the next step's ids: each row's greedy token (a row with no finite logit, which
    has none, keeps its id)."""
    out = runner.step_rows(batch_replays(runner, sessions), ids=ids)
    for s in sessions:
        s.n_past += 1
    return [t if t is not None else i for t, i in zip((r.greedy_token for r in out), ids)]


def replays_gpu_ms(runner, replays, ids: list[int], steps: int) -> float:
    """The GPU time of a batched step's replays alone: each replay's captured graph (its rows,
    every row's logits) launched `steps` times back to back after one real replay wrote the
    descriptor and session tables it reads (the same positions each time); ms per step, the
    replays' times summed."""
    import numpy as np
    stream, total, at = runner.stream, 0.0, 0
    for rows in replays:
        part = np.asarray(ids[at:at + rows.n], dtype=np.int64)
        at += rows.n
        runner._launch_step(rows, part, None, 0, every_row=True)
        runner._wait(0, rows.n)
        total += graph_ms(runner._graph(rows.n, True), stream, steps)
    return total


def kernel_family(name: str) -> str:
    """The table's name of a kernel: a matvec's without its row count, others their own."""
    return name.rsplit("_", 1)[0] if name.startswith(MATVEC) else name


def by_family(times: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, us in times.items():
        out[kernel_family(name)] = out.get(kernel_family(name), 0.0) + us
    return out


def rows_table(one: dict[str, float], many: dict[str, float], n: int) -> list[str]:
    """`kernel | 1 row | n rows | n rows / 1 row` (microseconds a step, summed over the layers;
    "-": the kernel does not run in that step), the n-row step's slowest first; then the kernels
    whose time grows most from one row to n."""
    one, many = by_family(one), by_family(many)
    head = f"{n} rows"
    lines = [f"  {'kernel':24s} {'1 row':>10s} {head:>10s} {head + ' / 1 row':>14s}"]
    for name in sorted(set(one) | set(many), key=lambda k: (-many.get(k, 0.0), k)):
        a, b = one.get(name), many.get(name)
        ratio = f"{b / a:13.2f}x" if a and b is not None else f"{'-':>14s}"
        lines.append(f"  {name:24s} {_us(a)} {_us(b)} {ratio}")
    growth = sorted(((many.get(k, 0.0) - one.get(k, 0.0), k) for k in set(one) | set(many)),
                    reverse=True)
    most = [f"{k} +{d:.1f} us" + (f" ({many[k] / one[k]:.2f}x)" if one.get(k) else " (new)")
            for d, k in growth[:3] if d > 0]
    lines.append(f"grows most from 1 row to {n}: " + (", ".join(most) or "nothing"))
    return lines


def _us(value: float | None) -> str:
    return f"{value:7.1f} us" if value is not None else f"{'-':>10s}"


def profile_rows(eng, runner, n: int, steps: int, one_row: dict[str, float]) -> dict:
    """The batched step of n sessions (see the docstring); `one_row`: the one-row eager step's
    kernel times. Returns the figures for the record."""
    n_vocab = eng.model.g.n_vocab
    prompts = row_prompts(n, n_vocab)
    warm = 2
    need = max(len(p) for p in prompts) + warm + steps + 1
    if need > eng.max_context:
        raise SystemExit(f"--rows {n} --steps {steps}: the longest session reaches {need} "
                         f"positions, past the context of {eng.max_context} (--context)")
    sessions = open_sessions(eng, prompts)
    ids = first_row_ids(n, n_vocab)
    for _ in range(warm):                                    # capture and warm up
        ids = batched_step(runner, sessions, ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = batched_step(runner, sessions, ids)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    replays = batch_replays(runner, sessions)
    sizes = "+".join(str(r.n) for r in replays)
    plural = "s" if len(replays) > 1 else ""
    print(f"batched step of {n} rows ({len(replays)} replay{plural} of {sizes} rows, at most "
          f"{runner.max_rows} a replay): {wall:.3f} ms/step = {wall / n:.3f} ms/row (host "
          f"included)")
    gpu = replays_gpu_ms(runner, replays, ids, steps)
    print(f"its replays on the GPU, back to back: {gpu:.3f} ms/step = {gpu / n:.3f} ms/row; "
          f"host and hand-back per step: {wall - gpu:.3f} ms")
    many: dict[str, float] = {}
    at = 0
    for rows in replays:                       # each replay eager, every kernel timed
        got = runner.replay_kernel_times(rows, ids=ids[at:at + rows.n])
        at += rows.n
        for name, us in got.items():
            many[name] = many.get(name, 0.0) + us
    print(f"eager batched step, kernels only: {sum(many.values()) / 1e3:.3f} ms for {n} rows "
          f"(its replays summed) against {sum(one_row.values()) / 1e3:.3f} ms for one row "
          f"(matvecs named by type: each row count has its own build)")
    for line in rows_table(one_row, many, n):
        print(line)
    return {"n": n, "replays": [r.n for r in replays], "step_ms": round(wall, 4),
            "replays_gpu_ms": round(gpu, 4), "kernels_us": {k: round(v, 2) for k, v in many.items()}}


if __name__ == "__main__":
    sys.exit(main())
