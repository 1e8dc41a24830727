"""The decode attention kernel alone, on random data: microseconds per launch (50 launches captured
in one CUDA graph, so launch gaps are what a decode graph sees) against the context length, the
keys per split, the session's cells and the query heads of one block (STRATA_ATTN_HEADS), beside
an empty kernel (the floor any launch costs).

    python benchmarks/bench_attention.py [--heads 32 --kv-heads 4]
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

REPEAT = 50


def per_launch_us(launch) -> float:
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        launch()                                   # compile / warm
        stream.begin_capture()
        for _ in range(REPEAT):
            launch()
        graph = stream.end_capture()
    graph.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / REPEAT


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    args = ap.parse_args()
    import cupy as cp
    from strata_dist.kernels import function
    from strata_dist.kernels.abi import (BLOCK_THREADS, DESC_WORDS, MAX_ROWS, attn_heads_choices,
                                         attn_kernel)
    i32, f32, D = np.int32, np.float32, 128
    n_head, n_kv = args.heads, args.kv_heads
    spin = function("decode.cu", "spin")
    print(f"empty kernel: {per_launch_us(lambda: spin((1,), (1,), (np.uint64(0),))):.2f} us")
    group = n_head // n_kv
    heads_options = attn_heads_choices(group)
    rng = cp.random.default_rng(0)
    for cells, length, chunk in [(1024, 64, 64), (1024, 130, 32), (1024, 130, 64),
                                 (1024, 300, 64), (1024, 1000, 64), (4096, 130, 64),
                                 (4096, 4000, 64), (1024, 130, 256), (32768, 130, 256),
                                 (32768, 30000, 256)]:
        n_split = math.ceil(cells / chunk)
        k = rng.standard_normal((cells, n_kv, D), dtype=cp.float32).astype(cp.float16)
        v = rng.standard_normal((cells, n_kv, D), dtype=cp.float32).astype(cp.float16)
        cos = cp.ones((cells, D // 2), cp.float32)
        sin = cp.zeros((cells, D // 2), cp.float32)
        sess = cp.asarray(np.array([k.data.ptr, v.data.ptr, cos.data.ptr, sin.data.ptr],
                                   dtype=np.uint64))
        desc = cp.asarray(np.array([length - 1, 1] + [0] * (DESC_WORDS - 2), dtype=np.int32))
        q = rng.standard_normal((MAX_ROWS, n_head * D), dtype=cp.float32)
        part = cp.zeros(MAX_ROWS * n_head * n_split * D, cp.float32)
        ml = cp.zeros(MAX_ROWS * n_head * n_split * 2, cp.float32)
        out = cp.zeros((MAX_ROWS, n_head * D), cp.float32)
        kv_mb = 2 * length * n_kv * D * 2 / 1e6
        timings = []
        for heads in heads_options:
            attn = function("decode.cu", attn_kernel(group, "f16", heads))
            done = cp.zeros(MAX_ROWS * (n_head // heads), cp.uint32)
            fargs = (q, sess, i32(0), desc, i32(n_head), i32(n_kv), i32(n_split), i32(chunk),
                     f32(1 / math.sqrt(D)), part, ml, done, out, i32(1))
            us = per_launch_us(lambda: attn((n_head // heads, n_split, 1), (BLOCK_THREADS,),
                                            fargs))
            timings.append(f"{heads:2d} heads a block {us:6.2f} us ({kv_mb / us:.2f} TB/s)")
        print(f"attention: {cells:6d} cells, {length:6d} keys, {chunk:3d} keys per split "
              f"({n_split} splits): " + "; ".join(timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
