"""Where a decode step's time goes, in one process: the graph step's wall time per token, and one
eager step with every kernel timed (CUDA events), summed per kernel over the layers.

    python benchmarks/profile_decode.py --model q30.gguf [--context 1024] [--steps 64]
"""
from __future__ import annotations

import argparse
import sys
import time


def replay_ms(runner, steps: int) -> float:
    """Capture the one-row graph afresh and replay it back to back: ms per replay."""
    import cupy as cp
    runner.graphs.clear()
    graph, stream = runner._graph(1), runner.stream
    graph.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(steps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=64, help="tokens read before decoding")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    from strata_dist.tools.single_process import SingleProcessRunner
    t0 = time.perf_counter()
    eng = SingleProcessRunner(args.model, args.device, max_context=args.context, prompt_chunk=512)
    runner = eng.decode_graph
    if runner is None:
        raise SystemExit("this model's decode steps take the general path (see the log)")
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    eng.prefill([(7919 * i) % 1000 + 10 for i in range(args.prompt)])
    tok = 11
    for _ in range(4):                                      # capture and warm up
        tok = eng.decode_step([tok]).greedy_token
    t1 = time.perf_counter()
    for _ in range(args.steps):
        tok = eng.decode_step([tok]).greedy_token
    ms = (time.perf_counter() - t1) * 1e3 / args.steps
    print(f"graph step: {ms:.3f} ms/token = {1e3 / ms:.1f} tok/s (one process, "
          f"{runner.le - runner.lb} layers)")
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
    times = runner.kernel_times(eng.session, eng.session.n_past, ids=[tok])
    alone = runner.kernel_times(eng.session, eng.session.n_past, ids=[tok], repeat=10)
    total = sum(times.values())
    layers = runner.le - runner.lb
    print(f"eager step, kernels only: {total / 1e3:.3f} ms (the same kernels each run 10 times "
          f"in a row: {sum(alone.values()) / 1e3:.3f} ms)")
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
        other = type(runner)(eng.model, runner.arena, args.context, **kwargs) if kwargs else runner
        if pdl is not None:                    # else as built ($STRATA_PDL, the GPU)
            other._pdl = ProgrammaticLauncher() if pdl else None
        logits = np.asarray(other.step(eng.session, pos, ids=[11]))   # and the position replayed
        ms = replay_ms(other, args.steps)
        base = logits if base is None else base
        same = "n/a (recurrent state)" if recurrent else np.array_equal(logits, base)
        print(f"graph replay, {name}: {ms:.3f} ms/token; logits equal to the first: {same}",
              flush=True)
    runner._pdl = built_pdl
    return 0


if __name__ == "__main__":
    sys.exit(main())
