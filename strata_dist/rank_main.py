"""`strata-rank`: run one rank by itself — what strata-launch spawns per device, what a systemd
unit or another machine starts. It connects to the coordinator and waits for its assignment."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from protocol import ProtocolError, ProtocolTimeout
from protocol.auth import AuthError, load_secret

from .devices import cpu_device, gpu_device, parse_size
from .gguf_model import GGUFError
from .rank import RankOptions, RankProcess


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-rank", description=__doc__)
    ap.add_argument("--coordinator", required=True, help="the coordinator's control endpoint")
    ap.add_argument("--model", required=True, help="the GGUF file (same on every host)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N")
    ap.add_argument("--vram-budget", default=None,
                    help="bytes this rank may use (512K, 64M, 16G); required for cpu ranks, "
                         "caps a GPU's reported memory")
    ap.add_argument("--mem-bandwidth-gbs", type=float, default=None,
                    help="speed figure of a cpu rank for the planner")
    ap.add_argument("--token-file", default=None, help="shared secret file (else STRATA_TOKEN)")
    ap.add_argument("--data-bind", default="tcp://127.0.0.1:*",
                    help="endpoint to bind the data socket on (ipc://… or tcp://host:port)")
    ap.add_argument("--host-id", default="", help="host identity (default: hostname)")
    ap.add_argument("--rank", type=int, default=None, help="preferred rank number")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--assign-timeout", type=float, default=300.0, help="seconds to wait for an assignment")
    ap.add_argument("--log-level", default=os.environ.get("STRATA_LOG", "WARNING"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        budget = parse_size(args.vram_budget) if args.vram_budget else None
        if args.device == "cpu":
            if budget is None:
                raise ValueError("a cpu rank needs --vram-budget (e.g. 16G)")
            device = cpu_device(budget, bandwidth_gbs=args.mem_bandwidth_gbs)
        elif args.device.startswith("cuda"):
            local = int(args.device.split(":", 1)[1]) if ":" in args.device else 0
            device = gpu_device(local, budget)
        else:
            raise ValueError(f"--device must be cpu or cuda:N, got '{args.device}'")
        secret = load_secret(args.token_file, os.environ)
        opts = RankOptions(coordinator=args.coordinator, model=args.model, device=device,
                           device_name=args.device, secret=secret, data_bind=args.data_bind,
                           host_id=args.host_id, rank_hint=args.rank, parent_pid=args.parent_pid,
                           assign_timeout_s=args.assign_timeout)
        return RankProcess(opts).run()
    except (GGUFError, ValueError, AuthError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ProtocolTimeout as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
