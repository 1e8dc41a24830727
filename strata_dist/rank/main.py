"""`strata-rank`: run one rank by itself — what strata-launch spawns per device, what a systemd
unit or another machine starts. It connects to the coordinator and waits for its assignment."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from protocol import ProtocolTimeout
from protocol.auth import AuthError, load_secret
from protocol.transport import load_curve_keys, use_curve

from ..compute_options import mark_rank_process
from ..devices import cpu_device, gpu_device, parse_size
from ..flag_values import check_seconds
from ..gguf_file.reader import GGUFError
from .shell import COORDINATOR_LOST_S, CoordinatorLost, RankOptions, RankProcess

RECONNECT_BACKOFF_S = (1.0, 10.0)   # first and longest pause before registering again


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
    ap.add_argument("--data-bind", default="auto",
                    help="endpoint to bind the data socket on (ipc://… or tcp://host:port|*); auto: "
                         "tcp on this host's address toward the coordinator (loopback for a local one)")
    ap.add_argument("--helper-bind", default="",
                    help="endpoint of the helper-tier socket (default: the data socket's host, any port)")
    ap.add_argument("--advertise-host", default="",
                    help="address other hosts reach this rank at, for sockets bound on a wildcard "
                         "(default: this host's address on the route to the coordinator)")
    ap.add_argument("--curve-keys", default=None,
                    help="directory with the deployment's CURVE key (server.key_secret): encrypt "
                         "every link (strata-dist deploy systemd --curve writes it)")
    ap.add_argument("--reconnect", action="store_true",
                    help="when the coordinator stops, restarts or is lost, register again (with "
                         "back-off) instead of exiting; a refusal still exits 2 (what units use)")
    ap.add_argument("--connect-timeout", type=float, default=15.0,
                    help="seconds to wait for each handshake reply (default 15)")
    ap.add_argument("--coordinator-timeout", type=float, default=COORDINATOR_LOST_S,
                    help=f"seconds without a delivered heartbeat before the coordinator counts as gone "
                         f"(default {COORDINATOR_LOST_S:.0f})")
    ap.add_argument("--host-id", default="", help="host identity (default: hostname)")
    ap.add_argument("--rank", type=int, default=None, help="preferred rank number")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--assign-timeout", type=float, default=300.0, help="seconds to wait for an assignment")
    ap.add_argument("--log-level", default=os.environ.get("STRATA_LOG", "WARNING"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mark_rank_process()   # it runs the compute options its Assign carries, not this environment's
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        for flag, value in (("--connect-timeout", args.connect_timeout),
                            ("--coordinator-timeout", args.coordinator_timeout),
                            ("--assign-timeout", args.assign_timeout)):
            check_seconds(flag, value)
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
        if args.curve_keys:
            use_curve(load_curve_keys(args.curve_keys))
        opts = RankOptions(coordinator=args.coordinator, model=args.model, device=device,
                           device_name=args.device, secret=secret, data_bind=args.data_bind,
                           host_id=args.host_id, rank_hint=args.rank, parent_pid=args.parent_pid,
                           assign_timeout_s=args.assign_timeout, advertise_host=args.advertise_host,
                           helper_bind=args.helper_bind, connect_timeout_s=args.connect_timeout,
                           coordinator_lost_s=args.coordinator_timeout)
        return run_rank(opts, args.reconnect)
    except CoordinatorLost as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (GGUFError, ValueError, AuthError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ProtocolTimeout, ConnectionError) as e:   # worth retrying: units restart on 3
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


def run_rank(opts: RankOptions, reconnect: bool) -> int:
    """One rank's life. With `reconnect`, a coordinator that stops, restarts or is lost is waited
    for and registered with again (a fresh process state each time); refusals still end it."""
    pause = RECONNECT_BACKOFF_S[0]
    while True:
        rank = RankProcess(opts)
        started = time.monotonic()
        try:
            code = rank.run()
            if not reconnect or code != 0:
                return code
            why = "the coordinator shut this rank down"
        except (ProtocolTimeout, CoordinatorLost, ConnectionError) as e:
            if not reconnect:
                raise
            why = str(e)
        finally:
            rank.close()
        if time.monotonic() - started > 60:
            pause = RECONNECT_BACKOFF_S[0]   # it served a while: the next outage starts afresh
        print(f"info: {why}; registering again in {pause:.0f} s", file=sys.stderr, flush=True)
        time.sleep(pause)
        pause = min(pause * 2, RECONNECT_BACKOFF_S[1])


if __name__ == "__main__":
    sys.exit(main())
