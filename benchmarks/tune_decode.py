"""The decode kernels' build (kernels/abi.py KernelShape: the integer or float expert path, the
rows a block or warp of moe_gate_up and moe_down takes, a dense matvec block's threads), measured
in one process: one loaded stage, one DecodeGraph per shape over the same weights and cache, each
graph replayed back to back. Prints ms/token per shape, fastest first, and checks that every
shape gives the default's greedy token. The winner goes into decode.cu's defaults (and abi.py's),
or STRATA_KERNEL_SHAPE for a trial.

    python benchmarks/tune_decode.py --model q30_8l.gguf [--shapes "defaults int_direct=0"]
    python benchmarks/tune_decode.py --model q30_8l.gguf \
        --shapes "defaults int_gate_up=0,int_down=0 int_ff_per_warp=1"

A shape is "defaults", a KernelShape text (name=value,...), or "F,D": the float path's rows per
block (ff_per_block, down_per_block), which with the integer path on moves only the float types.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


# the defaults, the float build, then each experiment of kernels/abi.py KernelShape on its own
DEFAULT_SHAPES = ("defaults", "int_gate_up=0,int_down=0", "int_direct=0", "int_ff_per_warp=1",
                  "int_ff_per_warp=4", "int_down_per_warp=2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--shapes", default=" ".join(DEFAULT_SHAPES),
                    help="space-separated shapes: ff_per_block,down_per_block pairs or "
                         "KernelShape texts (name=value,...)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp
    from strata_dist.tools.single_process import SingleProcessRunner
    from strata_dist.kernels.abi import KernelShape
    eng = SingleProcessRunner(args.model, args.device, max_context=args.context, prompt_chunk=512)
    if eng.decode_graph is None:
        raise SystemExit("this model's decode steps take the general path (see the log)")
    eng.prefill([(7919 * i) % 1000 + 10 for i in range(64)])
    pos = eng.session.n_past            # every shape writes the same position: nothing advances
    rows = []
    want = None
    for text in args.shapes.split():
        if text == "defaults":
            shape = KernelShape()
        elif "=" in text:
            shape = KernelShape.parse(text)
        else:
            ff, down = (int(v) for v in text.split(","))
            shape = KernelShape(ff_per_block=ff, down_per_block=down)
        t0 = time.perf_counter()
        runner = type(eng.decode_graph)(eng.model, args.context,
                                        shape=shape)    # qwen3moe's or qwen3next's runner
        out = runner.step(eng.session, pos, ids=[11])
        token, logits = out.greedy_token, np.asarray(out, dtype=np.float64)
        ready_s = time.perf_counter() - t0
        if want is None:
            want, want_logits = token, logits
        # shapes that sum in another order round differently: how far from the first shape
        drift = float(np.max(np.abs(logits - want_logits)) / np.max(np.abs(want_logits)))
        graph, stream = runner._graph(1), runner.stream
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(args.replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        ms = cp.cuda.get_elapsed_time(start, end) / args.replays
        name = " ".join(shape.defines()) or "defaults"
        rows.append((ms, name, token, ready_s))
        print(f"{name}: {ms:.3f} ms/token, token {token}, logits within {drift:.1e} of the "
              f"first shape's (relative to their largest) (compiled and captured in "
              f"{ready_s:.1f} s)", flush=True)
    print("fastest first:")
    for ms, name, token, _ in sorted(rows):
        print(f"  {ms:.3f} ms/token  {name}"
              + ("" if token == want else f"  TOKEN DIFFERS ({token} != {want})"))
    return 0 if all(r[2] == want for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
