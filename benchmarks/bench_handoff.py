"""Hand-off cost per stage per decode token, measured end to end.

All ranks share one device, so the compute per token is the same whatever the split; what a
split adds is the hand-offs. Per hand-off cost = (ms/token with K stages - ms/token with one
stage) / (K - 1), measured side by side in one run, for CUDA IPC and for frames over ZeroMQ.

    python benchmarks/bench_handoff.py --device cuda      # GPU ranks sharing GPU 0
    python benchmarks/bench_handoff.py --device cpu --tokens 8 --reps 1   # CPU ranks (ratios only)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from launch_helpers import ServeSession  # noqa: E402
from strata_dist.synth import SynthGeometry, write_synthetic  # noqa: E402

# Qwen3-30B-A3B's width (the rows handed over are [1, 2048] float32), few and small layers.
GEOMETRY = SynthGeometry("handoff-bench", n_layer=4, n_embd=2048, n_head=32, n_head_kv=4,
                         head_dim=128, n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=2048,
                         context_length=4096)


def decode_ms_per_token(model: str, device: str, stages: int, ipc: bool, tokens: int, reps: int):
    splits = {1: None, 2: "2", 4: "1,2,3"}[stages]
    args = (["--gpus", ",".join(["0"] * stages)] if device == "cuda"
            else ["--cpu-ranks", str(stages), "--vram-budget", "2G"])
    args += ["--max-context", "1024", "--prefill", "64", "--gpu-order", "as_given"]
    if splits:
        args += ["--layer-split", splits]
    # One BLAS thread per rank in every arm, so the arms differ only in their hand-offs.
    env = {"STRATA_IPC": "1" if ipc else "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    s = ServeSession(model, *args, env=env, timeout=300)
    try:
        s.gen(list(range(1, 17)), 8)   # warm-up: kernels compiled, buffers allocated
        runs = []
        for r in range(reps):
            out = s.gen([r + 1] + list(range(20, 36)), tokens)
            gen, decode_ms = int(out["done"][0]), float(out["done"][3])
            runs.append(decode_ms / max(gen - 1, 1))
        s.send("STATS")
        stats = []
        while True:
            line = s.next_line(30)
            if line == "STATS END":
                break
            stats.append(line)
        return statistics.median(runs), stats
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "bench.gguf")
        write_synthetic(model, like=GEOMETRY, quant="q8_0" if args.device == "cuda" else "f32",
                        popularity="uniform")
        modes = [("frames", False)] + ([("cuda-ipc", True)] if args.device == "cuda" else [])
        base, _ = decode_ms_per_token(model, args.device, 1, False, args.tokens, args.reps)
        print(f"device={args.device} 1 stage: {base:.3f} ms/token")
        for name, ipc in modes:
            for k in (2, 4):
                ms, stats = decode_ms_per_token(model, args.device, k, ipc, args.tokens, args.reps)
                per = (ms - base) / (k - 1) * 1e3
                print(f"device={args.device} {name:8s} {k} stages: {ms:.3f} ms/token, "
                      f"{per:.0f} us per hand-off ({ms / base:.2f}x one stage)")
                for line in stats:
                    if "handoff" in line:
                        print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
