"""A prompt chunk's causal attention alone, on random data: the product's flash kernel
(kernels/prefill_attention.cu, through CupyBackend.prompt_attention) against PyTorch's
scaled_dot_product_attention on the same card (FlashAttention-2 / cuDNN, f16 in, f16 out), at the
shapes a long prompt's chunks take: n query rows at positions pos0 .. over pos0 + n keys.

    python benchmarks/bench_prompt_attention.py [--heads 32 --kv-heads 4 --dim 128]
        [--shapes 512:0,4096:0,4096:12288] [--variant FA_MT_128=1,FA_BN_128=32 ...]

Prints milliseconds a launch (the median of --repeats, each timed by CUDA events), TFLOP/s of the
causal products (4 D flops a row-key pair a head), and ours / torch. A --variant is the kernel
compiled with other -D values (NVRTC), launched with the grid they imply; its largest difference
to the product build's output is printed beside its time. With --json PATH the figures are also written
there."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def causal_flops(n: int, pos0: int, heads: int, dim: int) -> float:
    return 4.0 * dim * heads * (n * pos0 + n * (n + 1) / 2)


def time_ms(run, repeats: int) -> float:
    import cupy as cp
    run()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def torch_attention(q, k, v, pos0: int):
    """torch's SDPA on the same data (f16, GQA expanded), or None where torch is missing."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    tq = torch.as_tensor(q, device="cuda").half().permute(1, 0, 2)[None]
    tk = torch.as_tensor(k, device="cuda").repeat_interleave(group, dim=1).permute(1, 0, 2)[None]
    tv = torch.as_tensor(v, device="cuda").repeat_interleave(group, dim=1).permute(1, 0, 2)[None]
    if pos0 == 0:
        return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(n, pos0 + n)
    return lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)


def kernel_launch(defines: tuple[str, ...], dim: int, q, k, v, pos0: int, out):
    """The kernel built with `defines` (none: the product's build), launched as the backend
    launches it, with the rows a block, threads and shared memory those defines imply."""
    import cupy as cp
    from strata_dist.kernels import function
    from strata_dist.kernels.abi import prefill_attention_launch
    values = {name: int(value) for name, value in (d.split("=") for d in defines)}
    rows, threads, shared = prefill_attention_launch(
        dim, mt=values.get(f"FA_MT_{dim}"), bn=values.get(f"FA_BN_{dim}"),
        warps_m=values.get("FA_WARPS_M", 4))
    fn = function("prefill_attention.cu", f"prefill_attention_{dim}", cp.cuda.Device().id,
                  tuple(f"-D{d}" for d in defines))
    fn.max_dynamic_shared_size_bytes = shared
    n, heads, _ = q.shape
    args = (q, k, v, np.int32(n), np.int32(pos0), np.int32(heads), np.int32(k.shape[1]),
            np.float32(1 / math.sqrt(dim)), out)
    return lambda: fn((heads, (n + rows - 1) // rows), (threads,), args, shared_mem=shared)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--shapes", default="512:0,4096:0,4096:4096,4096:12288,4096:28672",
                    help="n:pos0 pairs, comma separated")
    ap.add_argument("--variant", action="append", default=[],
                    help="comma-separated NAME=VALUE defines of one more build to time")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import cupy as cp
    from strata_dist.backends import get_backend
    be = get_backend("cuda:0")
    rng = cp.random.default_rng(0)
    results = []
    for shape in args.shapes.split(","):
        n, pos0 = (int(x) for x in shape.split(":"))
        q = rng.standard_normal((n, args.heads, args.dim), dtype=cp.float32)
        k = rng.standard_normal((pos0 + n, args.kv_heads, args.dim), dtype=cp.float32).astype(cp.float16)
        v = rng.standard_normal((pos0 + n, args.kv_heads, args.dim), dtype=cp.float32).astype(cp.float16)
        want = be.prompt_attention(q, k, v, pos0)          # the backend's own launch
        out = cp.empty_like(q)
        flops = causal_flops(n, pos0, args.heads, args.dim)
        launch = kernel_launch((), args.dim, q, k, v, pos0, out)
        ours = time_ms(launch, args.repeats)
        assert bool((out == want).all()), "the timed launch differs from the backend's"
        row = {"n": n, "pos0": pos0, "strata_ms": ours, "strata_tflops": flops / ours / 1e9}
        line = f"n {n:6d} pos0 {pos0:6d}: strata {ours:8.3f} ms ({flops / ours / 1e9:6.1f} TFLOP/s)"
        for spec in args.variant:
            defines = tuple(spec.split(","))
            launch = kernel_launch(defines, args.dim, q, k, v, pos0, out)
            launch()
            err = float(cp.abs(out - want).max())
            ms = time_ms(launch, args.repeats)
            row[spec] = {"ms": ms, "max_abs_diff_to_default": err}
            line += f"; {spec} {ms:8.3f} ms (diff {err:.1e})"
        ref = torch_attention(q, k, v, pos0)
        if ref is not None:
            try:
                theirs = time_ms(ref, args.repeats)
                got = cp.asarray(ref()[0].permute(1, 0, 2).float().contiguous())
                err = float(cp.abs(got - want).max())
                row.update(torch_ms=theirs, ratio_torch_over_strata=theirs / ours)
                line += (f"; torch sdpa {theirs:8.3f} ms ({flops / theirs / 1e9:6.1f} TFLOP/s, "
                         f"diff {err:.1e}): strata at {theirs / ours:.2f}x")
            except Exception as e:         # a torch without this mask or backend: say so
                line += f"; torch sdpa failed: {type(e).__name__}: {e}"
        print(line, flush=True)
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"heads": args.heads, "kv_heads": args.kv_heads,
                                         "dim": args.dim, "shapes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
