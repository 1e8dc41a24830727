"""`strata-dist deploy systemd`: systemd units for a deployment over several hosts.

    strata-dist deploy systemd --coordinator hostA:5555 --hosts hostA:0,1 hostB:0 \\
        --model /models/M.gguf --out deploy-out [--curve]

writes, per host, a directory to copy there: the unit templates (deploy/strata-rank@.service on
every host, deploy/strata-coordinator.service on the coordinator's), its environment file
(strata.env), the shared secret (token, mode 0600), with --curve the deployment's CURVE key
(curve/server.key_secret, 0600), with --calibration the planner constants the coordinator plans
with (calibration.json, from `strata-dist calibrate --out`), and install.sh; then prints how to
install them. Nothing here touches the machine it runs on beyond --out."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from protocol.auth import load_secret, new_secret, write_secret
from protocol.transport import write_curve_keys

ETC = "/etc/strata-dist"
RANK_UNIT = "strata-rank@.service"
HEAD_UNIT = "strata-coordinator.service"


@dataclass
class HostPlan:
    name: str
    gpus: list[int]
    coordinator: bool


def template_dir() -> Path:
    """deploy/ of the source tree (editable installs), else the copy installed under share/."""
    for d in (Path(__file__).resolve().parent.parent / "deploy",
              Path(sys.prefix) / "share" / "strata-dist" / "deploy"):
        if (d / RANK_UNIT).is_file():
            return d
    raise FileNotFoundError(f"the unit templates ({RANK_UNIT}, {HEAD_UNIT}) are not installed")


def parse_hosts(items: list[str]) -> list[tuple[str, list[int]]]:
    out, seen = [], set()
    for item in items:
        name, sep, devs = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"--hosts {item}: want HOST:GPU[,GPU…] (e.g. hostB:0,1)")
        try:
            gpus = [int(d) for d in devs.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"--hosts {item}: GPU indices must be integers") from None
        if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ValueError(f"--hosts {item}: list each GPU index once (0, 1, …)")
        if name in seen:
            raise ValueError(f"--hosts lists {name} twice")
        seen.add(name)
        out.append((name, gpus))
    return out


def parse_coordinator(text: str) -> tuple[str, int]:
    text = text[len("tcp://"):] if text.startswith("tcp://") else text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {text}: want HOST:PORT (e.g. hostA:5555)")
    return host, int(port)


def render(template: str, bin_dir: str, etc: str, user: str | None) -> str:
    text = template.replace("@BIN@", bin_dir).replace("@ETC@", etc)
    return text.replace("#User=\n", f"User={user}\n" if user else "")


def env_file(host: HostPlan, args, coord_host: str, port: int, listen: str, n_ranks: int,
             etc: str) -> str:
    lines = [f"# strata-dist settings for {host.name} (written by strata-dist deploy systemd)",
             f"STRATA_COORDINATOR=tcp://{coord_host}:{port}",
             f"STRATA_MODEL={args.model}",
             f"STRATA_TOKEN_FILE={etc}/token",
             f"STRATA_HOST_ID={host.name}",
             f"STRATA_CURVE_ARGS={'--curve-keys ' + etc + '/curve' if args.curve else ''}",
             "# extra strata-rank flags, e.g. --vram-budget 20G or --advertise-host 192.168.1.20",
             "STRATA_RANK_ARGS="]
    if host.coordinator:
        lines += ["# the head: where ranks register, how many it waits for, its serving surface",
                  f"STRATA_LISTEN=tcp://{listen}:{port}",
                  f"STRATA_EXPECT_RANKS={n_ranks}",
                  f"STRATA_LAUNCH_ARGS=--port {args.http_port}"
                  + ("" if args.no_rejoin else " --rejoin")
                  + (" --no-remote-cross-host" if args.no_remote_cross_host else "")
                  + (f" --calibration {etc}/calibration.json" if args.calibration else "")]
    return "\n".join(lines) + "\n"


def install_script(host: HostPlan, etc: str, user: str | None, calibration: bool = False) -> str:
    units = ([HEAD_UNIT] if host.coordinator else []) + [f"strata-rank@{g}.service" for g in host.gpus]
    own = f'chown -R {user} "$ETC"\n' if user else ""
    return f"""#!/bin/sh
# Install strata-dist on {host.name}: run as root on {host.name}, from a copy of this directory.
set -eu
cd "$(dirname "$0")"
ETC={etc}
install -d -m 0700 "$ETC"
install -m 0644 strata.env "$ETC/strata.env"
install -m 0600 token "$ETC/token"
{'install -m 0644 calibration.json "$ETC/calibration.json"' + chr(10) if calibration else ''}if [ -d curve ]; then
    install -d -m 0700 "$ETC/curve"
    install -m 0600 curve/server.key_secret "$ETC/curve/server.key_secret"
    install -m 0644 curve/server.key "$ETC/curve/server.key"
fi
{own}install -m 0644 {RANK_UNIT} /etc/systemd/system/{RANK_UNIT}
{'install -m 0644 ' + HEAD_UNIT + ' /etc/systemd/system/' + HEAD_UNIT if host.coordinator else ''}
systemctl daemon-reload
systemctl enable --now {' '.join(units)}
echo "strata-dist on {host.name}: {', '.join(units)} enabled"
"""


def deploy_systemd(args, out=print) -> int:
    coord_host, port = parse_coordinator(args.coordinator)
    if args.calibration:    # refused here, not on the coordinator at its first start
        from strata_dist.tools.calibrate import load_calibration
        load_calibration(args.calibration)
    hosts = [HostPlan(n, g, n == coord_host) for n, g in parse_hosts(args.hosts)]
    if not any(h.coordinator for h in hosts):
        hosts.insert(0, HostPlan(coord_host, [], True))     # a head that runs no rank
    n_ranks = sum(len(h.gpus) for h in hosts)
    if n_ranks == 0:
        raise ValueError("--hosts lists no GPU: nothing would run a rank")
    only_here = all(h.coordinator for h in hosts if h.gpus)
    # one host: loopback; several: the coordinator must be reachable, which the operator asked for
    listen = args.listen_address or ("127.0.0.1" if only_here else "0.0.0.0")
    if only_here and listen == "127.0.0.1":
        coord_host = "127.0.0.1"
    bin_dir = args.bin_dir or os.path.dirname(shutil.which("strata-rank") or sys.executable)
    tdir = template_dir()
    secret = load_secret(args.token_file) if args.token_file else new_secret().encode()
    root = Path(args.out)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--out {args.out} is a file: name a folder for the deployment")
    root.mkdir(parents=True, exist_ok=True)
    curve_dir = root / ".curve"
    if args.curve:
        write_curve_keys(str(curve_dir))
    for h in hosts:
        d = root / h.name
        d.mkdir(parents=True, exist_ok=True)
        units = [RANK_UNIT] + ([HEAD_UNIT] if h.coordinator else [])
        for unit in units:
            (d / unit).write_text(render((tdir / unit).read_text(), bin_dir, args.etc, args.user))
        (d / "strata.env").write_text(env_file(h, args, coord_host, port, listen, n_ranks, args.etc))
        write_secret(str(d / "token"), secret)
        if args.curve:
            (d / "curve").mkdir(mode=0o700, exist_ok=True)
            for name, mode in (("server.key_secret", 0o600), ("server.key", 0o644)):
                shutil.copyfile(curve_dir / name, d / "curve" / name)
                os.chmod(d / "curve" / name, mode)
        calibration = bool(args.calibration) and h.coordinator
        if calibration:
            shutil.copyfile(args.calibration, d / "calibration.json")
        script = d / "install.sh"
        script.write_text(install_script(h, args.etc, args.user, calibration))
        script.chmod(0o755)
    if args.curve:
        shutil.rmtree(curve_dir)
    out(f"wrote {root}/: per host the units, strata.env, the shared secret (token, 0600)"
        + (", the CURVE key (curve/, 0600)" if args.curve else "") + " and install.sh")
    out(f"the model must be at {args.model} on every host (its fingerprint is checked); "
        f"strata-dist installed with its commands in {bin_dir}")
    for h in hosts:
        what = ", ".join((["coordinator"] if h.coordinator else []) + [f"strata-rank@{g}" for g in h.gpus])
        out(f"  {h.name} ({what}):")
        out(f"    scp -r {root / h.name} {h.name}:/tmp/strata-deploy && "
            f"ssh -t {h.name} sudo sh /tmp/strata-deploy/install.sh")
    out(f"then on {coord_host if not only_here else hosts[0].name}: journalctl -fu strata-coordinator; "
        f"curl -s http://127.0.0.1:{args.http_port}/health")
    if listen not in ("127.0.0.1", "::1") and not args.curve:
        out(f"note: the coordinator listens on {listen}:{port} unencrypted (the secret still decides "
            "who may register); add --curve to encrypt every link between the hosts")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-dist deploy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="target", required=True)
    s = sub.add_parser("systemd", help="systemd units, environment files and the secret per host")
    s.add_argument("--coordinator", required=True, help="HOST:PORT the ranks register at")
    s.add_argument("--hosts", nargs="+", required=True, metavar="HOST:GPU[,GPU…]",
                   help="each host and the GPU indices that run a rank there")
    s.add_argument("--model", required=True, help="the GGUF file's path (the same on every host)")
    s.add_argument("--out", required=True, help="directory to write (one subdirectory per host)")
    s.add_argument("--curve", action="store_true", help="generate a CURVE key: encrypt every link")
    s.add_argument("--token-file", default=None, help="use this secret (default: a fresh one)")
    s.add_argument("--listen-address", default=None,
                   help="address the coordinator binds (default 0.0.0.0 when ranks run on other "
                        "hosts, else 127.0.0.1)")
    s.add_argument("--http-port", type=int, default=8080, help="the head's HTTP port (loopback)")
    s.add_argument("--no-remote-cross-host", action="store_true",
                   help="stages ask only helper tiers on their own host")
    s.add_argument("--no-rejoin", action="store_true",
                   help="a lost rank restarts the head and every rank (default: the head runs "
                        "with --rejoin, so the lost rank's unit restarts it alone and it takes "
                        "its place)")
    s.add_argument("--calibration", default=None, metavar="FILE",
                   help="the planner constants `strata-dist calibrate --out FILE` measured on "
                        "these hosts: installed on the coordinator, which plans with them")
    s.add_argument("--bin-dir", default=None,
                   help="where strata-rank/strata-launch are installed on the hosts "
                        "(default: where they are here)")
    s.add_argument("--etc", default=ETC, help=f"settings directory on the hosts (default {ETC})")
    s.add_argument("--user", default=None, help="run the units as this user (default root)")
    s.set_defaults(func=deploy_systemd)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OSError as e:     # the path and the system's reason, not the errno's repr
        print(f"error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


__all__ = ["main", "deploy_systemd", "parse_hosts", "parse_coordinator", "template_dir"]
