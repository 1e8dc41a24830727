"""The hand-off itself, without a model: one decode row [1, 2048] float32 passed between two
processes and back through strata_dist.rank.handoff (the rank's own code path; the measurement is
strata_dist/tools/calibrate.py's, which `strata-dist calibrate` writes for the planner), as frames over
ZeroMQ and, on a GPU, through CUDA IPC. Prints the median microseconds per hop. With --devices A,B the
two processes sit on two cards (cuda:A and cuda:B), as two stages of a pipeline do.

    python benchmarks/bench_transport.py --device cuda:0
    python benchmarks/bench_transport.py --devices 0,1 --json
    python benchmarks/bench_transport.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import sys

from strata_dist.tools.calibrate import handoff_hop_us

N = 2000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--devices", default="", help="A,B: the two processes on cuda:A and cuda:B")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = ap.parse_args()
    device, peer = args.device, None
    if args.devices:
        device, peer = (f"cuda:{d}" for d in args.devices.split(","))
    modes = [False] + ([True] if device.startswith("cuda") else [])
    figures = {}
    for ipc in modes:
        us, path = handoff_hop_us(device, ipc, peer, rounds=N)
        figures[path] = us
        print(f"device={device} peer={peer or device} path={path}: {us:.0f} us per hop "
              f"(median of {N} round trips / 2)", flush=True)
    if args.json:
        # a decode row goes by IPC between stages of one host when it can, else in frames
        print(json.dumps({"decode_row_median_us": figures.get("ipc", figures.get("frames")),
                          **{f"{k}_us": v for k, v in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
