"""strata-launch's cluster flags: where the ranks come from (spawned here, registered from other
hosts or systemd units over TCP, or Ray actors), the shared secret, CURVE, and cross-host helpers.

    --listen tcp://HOST:PORT --expect-ranks N   bind the coordinator there and wait for N ranks
                                                started elsewhere (strata-rank, strata-rank@.service)
    --backend ray [--ray-address auto]          one rank per GPU (or --cpu-ranks N) of a Ray cluster
    --token-file F                              the shared secret (else $STRATA_TOKEN; a spawning
                                                launch makes a fresh one)
    --curve | --curve-keys DIR                  encrypt every link (ZeroMQ CURVE)
    --no-remote-cross-host                      a stage asks only helper tiers on its own host

The coordinator binds loopback unless told otherwise: a non-loopback --listen address is the
operator's explicit choice, and a warning says when it is not encrypted."""
from __future__ import annotations

import argparse
import math
import os
import sys

from protocol.auth import AuthError, load_secret
from protocol.transport import (CurveKeys, is_loopback_endpoint, load_curve_keys,
                                new_curve_keypair)
from strata_dist.head.coordinator import HEARTBEAT_LOST_S

DEFAULT_LISTEN = "tcp://127.0.0.1:5555"
BACKENDS = ("local", "ray")


class ClusterUsageError(ValueError):
    """A cluster flag combination that cannot be honoured (exit 2)."""


def add_cluster_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("cluster (ranks on other hosts, systemd units, Ray)")
    g.add_argument("--listen", default=None,
                   help="tcp://HOST:PORT (or HOST:PORT, or PORT on loopback): bind the coordinator "
                        "here and wait for --expect-ranks ranks to register instead of spawning "
                        "them; a non-loopback HOST serves other machines")
    g.add_argument("--expect-ranks", type=int, default=None,
                   help=f"ranks to wait for (with --listen; default listen {DEFAULT_LISTEN})")
    g.add_argument("--register-timeout", type=float, default=None,
                   help="seconds to wait for the ranks to register (default 120; 600 with "
                        "--expect-ranks)")
    g.add_argument("--token-file", default=None,
                   help="the shared secret (else $STRATA_TOKEN); needed when ranks are started "
                        "elsewhere")
    g.add_argument("--curve", action="store_true",
                   help="encrypt every link with ZeroMQ CURVE (a fresh key for spawned ranks; "
                        "ranks elsewhere need --curve-keys)")
    g.add_argument("--curve-keys", default=None,
                   help="directory with the deployment's CURVE key (strata-dist deploy --curve)")
    g.add_argument("--no-remote-cross-host", action="store_true",
                   help="a stage sends expert requests only to helper tiers on its own host")
    g.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_LOST_S,
                   help=f"seconds of silence after which a rank is dead (default "
                        f"{HEARTBEAT_LOST_S:.0f}); the request in flight fails")
    g.add_argument("--backend", choices=BACKENDS, default="local",
                   help="local: spawn the ranks here; ray: actors on a Ray cluster")
    g.add_argument("--ray-address", default=None,
                   help="with --backend ray: ray.init address (auto: the running cluster; "
                        "default: a cluster on this machine)")


def listen_endpoint(text: str) -> str:
    """--listen forms: tcp://HOST:PORT, HOST:PORT, PORT (loopback). The port must be given."""
    ep = text if text.startswith("tcp://") else f"tcp://{text}" if ":" in text \
        else f"tcp://127.0.0.1:{text}"
    if "://" in text and not text.startswith("tcp://"):
        raise ClusterUsageError(f"--listen {text}: ranks on other hosts register over tcp://")
    host, _, port = ep[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterUsageError(f"--listen {text}: want tcp://HOST:PORT with a port in 1-65535")
    return ep


def check_cluster_flags(args) -> None:
    """Refusals (exit 2) naming both flags; fills in the --listen default."""
    if args.ray_address and args.backend != "ray":
        raise ClusterUsageError(f"--ray-address {args.ray_address} goes with --backend ray")
    if args.expect_ranks is not None:
        if args.backend == "ray":
            raise ClusterUsageError("--expect-ranks waits for ranks started elsewhere; --backend ray "
                                    "starts them: pick one")
        if args.expect_ranks < 1:
            raise ClusterUsageError(f"--expect-ranks {args.expect_ranks}: at least one rank")
        if args.listen is None:
            args.listen = DEFAULT_LISTEN
    if args.listen is not None:
        args.listen = listen_endpoint(args.listen)
        if args.expect_ranks is None and args.backend != "ray":
            raise ClusterUsageError(f"--listen {args.listen} waits for ranks: add --expect-ranks N")
        if args.backend == "local":
            for flag, value in (("--gpus", args.gpus), ("--cpu-ranks", args.cpu_ranks),
                                ("--vram-budget", args.vram_budget)):
                if value is not None:
                    raise ClusterUsageError(
                        f"--listen {args.listen} waits for ranks started elsewhere (they report "
                        f"their own devices); {flag} {value} is for ranks this launch spawns")
        if args.plan_only:
            raise ClusterUsageError("--plan-only plans without ranks (use --inventory); --listen "
                                    "waits for ranks: pick one")
    if args.backend == "ray" and args.gpus is not None:
        raise ClusterUsageError(f"--gpus {args.gpus} picks cards of this machine; --backend ray "
                                "runs a rank on every GPU of the cluster (or --cpu-ranks N)")
    if args.curve_keys and not os.path.isdir(args.curve_keys):
        raise ClusterUsageError(f"--curve-keys {args.curve_keys}: not a directory")
    if args.curve and args.listen and not args.curve_keys:
        raise ClusterUsageError(f"--curve with --listen {args.listen}: ranks elsewhere need the "
                                "same key; pass --curve-keys DIR (strata-dist deploy --curve)")
    if not math.isfinite(args.heartbeat_timeout) or args.heartbeat_timeout <= 0:
        raise ClusterUsageError(f"--heartbeat-timeout {args.heartbeat_timeout}: must be > 0")


def cluster_config(args) -> dict:
    """LaunchConfig fields from the cluster flags (after check_cluster_flags)."""
    secret = None
    if args.token_file or args.listen or os.environ.get("STRATA_TOKEN"):
        try:
            secret = load_secret(args.token_file, os.environ)
        except AuthError as e:
            raise ClusterUsageError(f"{e} (ranks started elsewhere must prove the same secret)") \
                from None
    curve: CurveKeys | None = None
    if args.curve_keys:
        curve = load_curve_keys(args.curve_keys)
    elif args.curve:
        curve = CurveKeys(*new_curve_keypair())   # this launch's ranks only
    if args.listen and not is_loopback_endpoint(args.listen) and curve is None:
        print(f"warning: --listen {args.listen} serves other machines without encryption "
              "(the secret still decides who may register; add --curve-keys DIR to encrypt)",
              file=sys.stderr, flush=True)
    timeout = args.register_timeout
    if timeout is None:
        timeout = 600.0 if args.expect_ranks else 120.0
    return dict(listen=args.listen, expect_ranks=args.expect_ranks or 0, secret=secret,
                curve=curve, cross_host_helpers=not args.no_remote_cross_host,
                heartbeat_timeout_s=args.heartbeat_timeout, backend=args.backend,
                ray_address=args.ray_address, register_timeout_s=timeout)


def spawns_locally(args) -> bool:
    """True when this launch starts its ranks as local processes (the --gpus/--cpu-ranks specs)."""
    return args.backend == "local" and not args.listen


__all__ = ["add_cluster_flags", "check_cluster_flags", "cluster_config", "ClusterUsageError",
           "listen_endpoint", "spawns_locally", "DEFAULT_LISTEN"]
