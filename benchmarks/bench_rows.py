"""The prompt path's expert kernels alone (ops/moe.py, kernels/experts_rows.cu): one
layer's experts of a GGUF file in device memory, a chunk of N random rows routed top-k by the
popularity the synthetic file was written with (zipf:s: expert e picked with weight 1/(e+1)^s),
and each launch of the layer timed between CUDA events (median of --reps): the device grouping,
the rows' f16 rounding, gate/up with SwiGLU, the SwiGLU outputs' rounding, down. Prints µs, the
tensor-core rate (2 flops a multiply-add) and the weight bytes read a second, per launch.

    python benchmarks/bench_rows.py --model q30_8l.gguf --tokens 512,4096
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def routed_ids(n: int, k: int, n_expert: int, popularity: str, seed: int) -> np.ndarray:
    """[n, k] distinct experts a row, drawn by the file's popularity (uniform unless zipf:s)."""
    s = float(popularity.split(":", 1)[1]) if popularity.startswith("zipf:") else 0.0
    p = 1.0 / np.arange(1, n_expert + 1) ** s
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_expert, k, replace=False, p=p / p.sum())
                     for _ in range(n)]).astype(np.int32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import cupy as cp
    from strata_dist.ops.moe import TILE_M, RowsKernels, layer_experts
    from strata_dist.gguf_file.reader import GGUFModel
    g = GGUFModel(args.model)
    spec = layer_experts(g, args.layer)
    if spec is None:
        raise SystemExit(f"layer {args.layer}: the row kernels do not take its experts")
    n_expert = int(g.arch_int("expert_count", required=True))
    k = int(g.arch_int("expert_used_count", required=True))
    size = g.blob_bytes(args.layer)
    stride = (size + 255) // 256 * 256
    host = np.zeros(stride * n_expert, dtype=np.uint8)
    for e in range(n_expert):
        host[e * stride:e * stride + size] = g.expert_blob(args.layer, e)
    blobs = cp.asarray(host)
    table = cp.asarray(np.array([int(blobs.data.ptr) + e * stride for e in range(n_expert)],
                                dtype=np.uint64))
    popularity = str(g.metadata("strata.synth.popularity") or "uniform")
    kernels = RowsKernels(0)
    print(f"{args.model}: layer {args.layer}, {n_expert} experts top-{k}, blob {size / 2**20:.2f} "
          f"MiB, popularity {popularity}, {'tensor cores' if kernels.mma else 'FMA'}")
    for n in (int(t) for t in args.tokens.split(",")):
        x = cp.asarray(np.random.default_rng(n).standard_normal((n, spec.n_embd))
                       .astype(np.float32))
        ids_h = routed_ids(n, k, n_expert, popularity, seed=n)
        ids = cp.asarray(ids_h)
        counts = np.bincount(ids_h.ravel(), minlength=n_expert)
        rows, dest, items = kernels.group(ids, n_expert)
        n_items = int(items.shape[0])
        act = cp.empty((n * k, spec.n_ff), cp.float32)
        out = cp.empty((n * k, spec.n_embd), cp.float32)
        xh = kernels._half(x) if kernels.mma else (x,)       # what each build reads
        acth = kernels._half(act) if kernels.mma else (act,)
        launches = {
            "group (count, items, scatter)": lambda: kernels.group(ids, n_expert),
            "rows_to_half (x)": lambda: kernels._half(x),
            "gate/up + SwiGLU": lambda: kernels.gate_up(spec, table, items, n_items, rows, xh,
                                                        act),
            "rows_to_half (act)": lambda: kernels._half(act),
            "down": lambda: kernels.down(spec, table, items, n_items, dest, acth, out),
        }
        used = int((counts > 0).sum())
        gu_bytes = used * spec.down_at          # gate and up rows of every expert with a pair
        d_bytes = used * (size - spec.down_at)
        flops = {"gate/up + SwiGLU": 2 * 2 * n * k * spec.n_ff * spec.n_embd,
                 "down": 2 * n * k * spec.n_ff * spec.n_embd}
        weight = {"gate/up + SwiGLU": gu_bytes, "down": d_bytes}
        items_used = int(sum(-(-int(c) // TILE_M) for c in counts))
        print(f"{n} rows: {n * k} pairs, {used} experts with a pair (most {counts.max()}, "
              f"median {int(np.median(counts))}), {items_used} work items ({n_items} launched: "
              f"the grid is sized before the counts)")
        total = 0.0
        for name, launch in launches.items():
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            times = []
            for _ in range(args.reps + 2):
                start.record()
                launch()
                stop.record()
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
            us = float(np.median(times[2:]))
            total += us
            rate = ""
            if name in flops:
                rate = (f"  {flops[name] / us / 1e6:7.1f} TFLOP/s  "
                        f"{weight[name] / us / 1e3:7.1f} GB/s of weights")
            print(f"  {name:30s} {us:8.1f} µs{rate}")
        print(f"  {'the layer':30s} {total:8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
