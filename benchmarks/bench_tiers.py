"""Decode tok/s with and without the helper tier, side by side in one run.

Two stage ranks share the device with budgets that cache about half the experts; the second arm
adds a third rank that runs no stage and holds a helper tier. Prints tok/s and where every
(token, expert) was computed (hits, remote, host) per arm, and the ratio.

    python benchmarks/bench_tiers.py --model q30.gguf --gpus --budgets 9G,9G --helper-budget 8G
    python benchmarks/bench_tiers.py --model tiny.gguf --budgets 1M,1M --helper-budget 1M   # CPU
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from launch_helpers import ServeSession  # noqa: E402


def arm(model: str, gpus: bool, budgets: list[str], split: str, tokens: int, extra: list[str]):
    n = len(budgets)
    devices = ["--gpus", ",".join(["0"] * n)] if gpus else ["--cpu-ranks", str(n)]
    s = ServeSession(model, *devices, "--vram-budget", ",".join(budgets), "--layer-split", split,
                     "--max-context", "1024", "--prefill", "64", "--gpu-order", "as_given", *extra,
                     timeout=900)
    try:
        info = s.info_fields()[0]
        s.gen(list(range(1, 9)), 4, timeout=600)            # warm-up
        out = s.gen(list(range(10, 42)), tokens, "stats=1", timeout=900)
        gen, decode_ms = int(out["done"][0]), float(out["done"][3])
        tps = (gen - 1) / (decode_ms / 1e3)
        tiers = {k: sum(int(r[k]) for r in out["stats"]) for k in ("hits", "remote", "host")}
        return tps, tiers, info
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", action="store_true", help="GPU ranks sharing GPU 0 (else CPU ranks)")
    ap.add_argument("--budgets", default="9G,9G", help="the two stage ranks' budgets")
    ap.add_argument("--helper-budget", default="8G", help="the helper-only rank's budget")
    ap.add_argument("--split", default=None, help="split point (default: half the layers)")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from strata_dist.gguf_model import GGUFModel
    n_layers = int(GGUFModel(args.model).arch_metadata("block_count"))
    split = args.split or str(n_layers // 2)
    budgets = args.budgets.split(",")
    results = {}
    for name, b, extra in (("no helper tier", budgets, ["--no-remote-auto"]),
                           ("helper tier", budgets + [args.helper_budget], [])):
        tps, tiers, info = arm(args.model, args.gpus, b, split, args.tokens, extra)
        results[name] = tps
        total = sum(tiers.values())
        print(f"{name:15s}: {tps:7.2f} tok/s decode; expert_slots={info['expert_slots']} "
              f"(stage caches {info['expert_slots_stages']}); of {total} expert computations: "
              + ", ".join(f"{k} {v / total:.1%}" for k, v in tiers.items()))
    print(f"helper tier / no helper tier: {results['helper tier'] / results['no helper tier']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
