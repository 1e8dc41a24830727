"""Planner benchmark (a script, not a test).

    python benchmarks/bench_plan.py [--repeat N] [--random N]

1. 4 devices x 48 layers x 128 experts (Qwen3-30B-A3B geometry, Q8_0, 32K context): the exhaustive
   search over every placement of 1-4 stages, from scratch (ranking, prefix tables, all fills, all
   placements). Target < 50 ms on a 2-core machine (the C++ original: 14 ms).
2. 8 devices: the DP (exact for this additive score), its milliseconds, and the best of N random
   placements (random stage count, device subset and split points): the ratio random_best / dp is
   >= 1 when the DP is at least as good; 1.0 would mean random sampling found the optimum too.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from math import comb
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata_dist.plan import (CostModel, Device, PlanParams, RoutingProfile, make_plan,  # noqa: E402
                              qwen3_30b_a3b_shape, search_dp, search_exhaustive)

MIB = 1 << 20


def rig(free_mib: list[int], bw: list[float]) -> list[Device]:
    return [Device(f"card{i}", int(f * MIB) + 400 * MIB, int(f * MIB), b, "localhost", i)
            for i, (f, b) in enumerate(zip(free_mib, bw))]


def random_placements_best(cm: CostModel, n: int, rng: np.random.Generator) -> float:
    """Best score among n random placements: a stage count drawn uniformly from 1..D, a random
    order-preserving subset of the devices, random split points. Read off the planner's stage table
    (the same per-(device, range) terms the DP sums)."""
    S, _ = cm.stage_table()
    L, D = cm.shape.n_layers, len(cm.devices)
    best = np.inf
    for s, m in zip(range(1, D + 1), np.diff(np.linspace(0, n, D + 1).astype(int))):
        devs = np.sort(np.argsort(rng.random((m, D)), axis=1)[:, :s], axis=1)
        cuts = np.sort(np.argsort(rng.random((m, L - 1)), axis=1)[:, : s - 1] + 1, axis=1)
        bounds = np.concatenate([np.zeros((m, 1), dtype=np.int64), cuts, np.full((m, 1), L)], axis=1)
        total = np.full(m, cm.baseline_ms())
        for i in range(s):
            total += S[devs[:, i], bounds[:, i], bounds[:, i + 1]]
            if i:
                total += cm.links[devs[:, i - 1], devs[:, i]]
        total += cm.back[devs[:, -1], devs[:, 0]]
        best = min(best, float(total.min()))
    return best


def timed(fn, repeat: int) -> tuple[float, object, float]:
    """(median ms, last result, min ms) of `repeat` calls."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out, min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--random", type=int, default=100_000)
    ap.add_argument("--profile", choices=("uniform", "skewed"), default="uniform",
                    help="uniform (no recorded profile: the H(f) model) or a Zipf-skewed measured one")
    args = ap.parse_args()

    shape = qwen3_30b_a3b_shape()
    L = shape.n_layers
    if args.profile == "uniform":
        profile = RoutingProfile.uniform(L, shape.n_experts)
    else:
        profile = RoutingProfile(np.random.default_rng(0).zipf(1.3, size=(L, shape.n_experts)).astype(float))
    params = PlanParams()
    cells = 32768

    # 1. four cards: two 12 GB, two 16 GB
    four = rig([11900, 11900, 15900, 15900], [360, 360, 448, 448])
    search4 = lambda: search_exhaustive(CostModel(shape, four, profile, cells, params))  # noqa: E731
    search4()  # warm numpy
    med, p4, best = timed(search4, args.repeat)
    n_place = sum(comb(4, s) * comb(L - 1, s - 1) for s in range(1, 5))
    print(f"4 devices x {L} layers x {shape.n_experts} experts, exhaustive over {n_place} placements: "
          f"median {med:.1f} ms, min {best:.1f} ms (target < 50 ms)")
    print(f"  best: stages on {p4.devices}, bounds {p4.bounds}, {p4.score:.3f} ms/token")
    med_plan, _, _ = timed(lambda: make_plan(shape, four, cells=cells, profile=profile, params=params), 5)
    print(f"  whole make_plan (search + fills + loans + helper tiers): median {med_plan:.1f} ms")

    # 2. eight cards of 6-8 GB at 64K context: no card holds the model's KV alone
    cells8 = 65536
    free8 = [5900, 5900, 7900, 7900, 5900, 7900, 5900, 7900]
    bw8 = [288, 288, 448, 448, 288, 448, 336, 504]
    eight = rig(free8, bw8)
    cm8 = CostModel(shape, eight, profile, cells8, params)
    dp8 = lambda: search_dp(CostModel(shape, eight, profile, cells8, params))  # noqa: E731
    dp8()
    med8, p8, best8 = timed(dp8, args.repeat)
    t = time.perf_counter()
    rand = random_placements_best(cm8, args.random, np.random.default_rng(1))
    rand_ms = (time.perf_counter() - t) * 1e3
    print(f"8 devices x {L} layers at {cells8} cells, DP (exact): median {med8:.1f} ms, min {best8:.1f} ms")
    print(f"  best: stages on {p8.devices}, bounds {p8.bounds}, {p8.score:.4f} ms/token")
    print(f"  best of {args.random} random placements: {rand:.4f} ms/token ({rand_ms:.0f} ms to sample); "
          f"ratio random_best / dp = {rand / p8.score:.4f}")
    ex8 = search_exhaustive(cm8, max_stages=4)
    print(f"  cross-check: exhaustive over <= 4 stages of the 8 devices gives {ex8.score:.4f} ms/token "
          f"(the DP also considers 5-8 stages)")


if __name__ == "__main__":
    main()
