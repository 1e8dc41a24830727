"""`strata-launch --backend ray`: the ranks as Ray actors, one per GPU of the cluster (or N CPU ranks),
in one placement group. Ray only places and watches them: each actor runs `strata-rank` in a child
process, which registers with the coordinator in this launcher over the same ZeroMQ control and
data plane as every other rank (HMAC, optional CURVE, rows in frames across nodes).

    strata-launch --backend ray --ray-address auto --model /shared/M.gguf --port 8080
    strata-launch --backend ray --cpu-ranks 2 --model M.gguf --serve      # a Ray cluster on this machine

Every node needs strata-dist installed under the same Python and the model at the same path (the
fingerprint check refuses another file). A rank's host identity is its node's IP address, so CUDA
IPC is tried only between ranks of one node. Ray needs the extra: pip install 'strata-dist[ray]'."""
from __future__ import annotations

import os
import time

LOCAL_HOST = "127.0.0.1"        # a cluster this launcher starts itself lives on this machine
PLACE_TIMEOUT_S = 120.0
POLL_EVERY_S = 1.0              # how often the launcher asks the actors whether their rank lives


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--backend ray needs Ray: pip install 'strata-dist[ray]'") from None
    return ray


class _RankActor:
    """Runs one strata-rank in a child process of this Ray actor."""

    def start(self, args: list[str], env: dict, bind_host: str | None, curve: tuple | None) -> dict:
        import subprocess
        import sys
        import tempfile

        import ray
        node = bind_host or ray.util.get_node_ip_address()
        self.dir = tempfile.mkdtemp(prefix="strata-ray-rank-")
        argv = [sys.executable, "-m", "strata_dist.rank.main", *args, "--data-bind",
                f"tcp://{node}:*", "--host-id", node, "--parent-pid", str(os.getpid())]
        if curve is not None:
            from protocol.transport import CurveKeys, write_curve_keys
            write_curve_keys(os.path.join(self.dir, "curve"), CurveKeys(*curve))
            argv += ["--curve-keys", os.path.join(self.dir, "curve")]
        self.log = os.path.join(self.dir, "rank.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=dict(os.environ, **env), start_new_session=True)
        return {"pid": self.proc.pid, "node": node}

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 6) -> str:
        try:
            with open(self.log, "rb") as f:
                text = f.read()[-8192:].decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def stop(self, grace_s: float = 3.0) -> int | None:
        import signal
        import subprocess
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()


class RayRanks:
    """The launcher's handle on the rank actors: start, watch (throttled), stop."""

    def __init__(self, address: str | None, echo=print):
        ray = self.ray = _ray()
        self.echo = echo
        self.owns_cluster = not ray.is_initialized()
        self.bind_host = LOCAL_HOST if address is None else None
        if self.owns_cluster:
            kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
            ray.init(address=address, **kw) if address else ray.init(**kw)
        self.head_address = self.bind_host or ray.util.get_node_ip_address()
        self.actors: list = []
        self.pg = None
        self._codes: dict[int, int] = {}
        self._dead: dict[int, str] = {}
        self._polled = 0.0

    def start(self, specs, model: str, coordinator: str, secret: str, env: dict,
              curve=None) -> int:
        """Place and start the ranks; `specs` are CPU ranks, or empty for one rank per GPU."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if specs:
            bundles = [{"CPU": 1}] * len(specs)
            ranks = [(s.index, "cpu", s.vram_budget) for s in specs]
            env = dict(env, **_thread_env(len(specs)))
        else:
            n = int(ray.cluster_resources().get("GPU", 0))
            if n == 0:
                raise ValueError("the Ray cluster has no GPU; add --cpu-ranks N for CPU ranks")
            bundles = [{"GPU": 1, "CPU": 1}] * n
            ranks = [(i, "cuda:0", None) for i in range(n)]   # each actor sees only its GPU
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"the Ray cluster could not place {len(bundles)} rank(s) of "
                             f"{bundles[0]} within {PLACE_TIMEOUT_S:.0f} s "
                             f"(it has {ray.cluster_resources()})") from None
        remote = ray.remote(_RankActor)
        env = dict(env, STRATA_TOKEN=secret)
        started = []
        for i, (index, device, budget) in enumerate(ranks):
            gpu = device != "cpu"
            actor = remote.options(
                num_cpus=1, num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i)).remote()
            self.actors.append(actor)
            args = ["--coordinator", coordinator, "--model", model, "--device", device,
                    "--rank", str(index)] + (["--vram-budget", budget] if budget else [])
            started.append(actor.start.remote(args, env, self.bind_host,
                                              (curve.public, curve.secret) if curve else None))
        for i, info in enumerate(ray.get(started, timeout=PLACE_TIMEOUT_S)):
            self.echo(f"launch: rank {i} on Ray node {info['node']} (pid {info['pid']})")
        return len(ranks)

    # ---- liveness (what LocalRanks offers the launch) --------------------------------------
    def _poll(self) -> None:
        if time.monotonic() - self._polled < POLL_EVERY_S or not self.actors:
            return
        self._polled = time.monotonic()
        ray = self.ray
        for i, actor in enumerate(self.actors):
            if i in self._dead:
                continue
            try:
                code = ray.get(actor.poll.remote(), timeout=10)
            except ray.exceptions.GetTimeoutError:
                continue   # a busy node: ask again next time
            except ray.exceptions.RayError as e:   # the actor (or its node) is gone
                self._dead[i] = f"rank {i}: its Ray actor is gone ({type(e).__name__})"
                continue
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                try:
                    tail = ray.get(actor.log_tail.remote(), timeout=10)
                except ray.exceptions.RayError:
                    tail = ""
                self._dead[i] = f"rank {i} (Ray actor) {how}" + (f": {tail}" if tail else "")

    def exited(self, index: int) -> bool:
        self._poll()
        return index in self._dead

    def first_dead(self, ignore: frozenset = frozenset()) -> str | None:
        self._poll()
        return next((m for i, m in sorted(self._dead.items()) if i not in ignore), None)

    def stop(self) -> None:
        ray = self.ray
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=15)
        except ray.exceptions.RayError:
            pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:   # already gone
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        if self.owns_cluster:
            ray.shutdown()


def _thread_env(n_cpu_ranks: int) -> dict[str, str]:
    from .spawn import cpu_thread_env
    return cpu_thread_env(n_cpu_ranks)


__all__ = ["RayRanks"]
