"""The expert kernels' shape (kernels/abi.py KernelShape: expert rows per block of moe_gate_up,
outputs per block of moe_down), measured in one process: one loaded stage, one DecodeGraph per
shape over the same weights and cache, each graph replayed back to back. Prints ms/token per
shape, fastest first, and checks that every shape gives the default's greedy token. The winner
goes into decode.cu's defaults (and abi.py's), or STRATA_KERNEL_SHAPE for a trial.

    python benchmarks/tune_decode.py --model q30_8l.gguf [--shapes "4,4 8,4 8,8 2,2 4,8"]
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
    ap.add_argument("--shapes", default="4,4 8,4 8,8 16,8 2,2 4,8 4,2",
                    help="ff_per_block,down_per_block pairs, space-separated")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp
    from strata_dist.backends.cuda_decode import DecodeGraph
    from strata_dist.single_process import SingleProcessRunner
    from strata_dist.kernels.abi import KernelShape
    eng = SingleProcessRunner(args.model, args.device, max_context=args.context, prefill_chunk=512)
    if eng.decode_graph is None:
        raise SystemExit("this model's decode steps take the general path (see the log)")
    eng.prefill([(7919 * i) % 1000 + 10 for i in range(64)])
    pos = eng.session.n_past            # every shape writes the same position: nothing advances
    rows = []
    want = None
    for text in args.shapes.split():
        ff, down = (int(v) for v in text.split(","))
        shape = KernelShape(ff_per_block=ff, down_per_block=down)
        t0 = time.perf_counter()
        runner = DecodeGraph(eng.model, eng.decode_graph.arena, args.context, shape=shape)
        token = runner.step(eng.session, pos, ids=[11]).greedy_token
        ready_s = time.perf_counter() - t0
        want = token if want is None else want
        graph, stream = runner._graph(1), runner.stream
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(args.replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        ms = cp.cuda.get_elapsed_time(start, end) / args.replays
        rows.append((ms, ff, down, token, ready_s))
        print(f"ff_per_block={ff} down_per_block={down}: {ms:.3f} ms/token, token {token} "
              f"(compiled and captured in {ready_s:.1f} s)", flush=True)
    print("fastest first:")
    for ms, ff, down, token, _ in sorted(rows):
        print(f"  {ms:.3f} ms/token  ff_per_block={ff} down_per_block={down}"
              + ("" if token == want else f"  TOKEN DIFFERS ({token} != {want})"))
    return 0 if all(r[3] == want for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
