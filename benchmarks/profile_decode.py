"""Where a decode step's time goes, in one process: the graph step's wall time per token, and one
eager step with every kernel timed (CUDA events), summed per kernel over the layers.

    python benchmarks/profile_decode.py --model q30.gguf [--context 1024] [--steps 64]
"""
from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=64, help="tokens read before decoding")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    from strata_dist.single_process import SingleProcessRunner
    t0 = time.perf_counter()
    eng = SingleProcessRunner(args.model, args.device, max_context=args.context, prefill_chunk=512)
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
    # the graph alone on the GPU: replays queued back to back (the same position each time)
    import cupy as cp
    graph, stream = runner._graph(1), runner.stream
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(args.steps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    gpu_ms = cp.cuda.get_elapsed_time(start, end) / args.steps
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
    # the L1 / shared memory split: every kernel asking for the most shared memory, so the split
    # never changes between kernels
    for fn in runner._fns.values():
        fn.preferred_shared_memory_carveout = 100
    runner.graphs.clear()
    graph = runner._graph(1)
    graph.launch(stream)
    start.record(stream)
    for _ in range(args.steps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    print(f"graph replay, all kernels preferring the most shared memory: "
          f"{cp.cuda.get_elapsed_time(start, end) / args.steps:.3f} ms/token")
    # programmatic dependent launches (kernels/pdl.py): the same graph with programmatic edges
    from strata_dist.kernels.pdl import ProgrammaticLauncher
    runner._pdl = ProgrammaticLauncher()
    runner.graphs.clear()
    graph = runner._graph(1)
    graph.launch(stream)
    start.record(stream)
    for _ in range(args.steps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    print(f"graph replay with programmatic dependent launches: "
          f"{cp.cuda.get_elapsed_time(start, end) / args.steps:.3f} ms/token")
    tok_pdl = eng.decode_step([11]).greedy_token
    runner._pdl = None
    runner.graphs.clear()
    eng.session.n_past -= 1
    tok_plain = eng.decode_step([11]).greedy_token
    print(f"the same step's token with and without them: {tok_pdl} {tok_plain}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
