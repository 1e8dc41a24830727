"""A launch: start the ranks (spawn one per local device, start them as Ray actors, or wait for
ranks started elsewhere to register over TCP), admit them, plan, assign, wait until every rank has
loaded and check what each loaded against what the plan priced."""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field

from protocol import Assign, CurveKeys, Endpoints, PeerInfo
from protocol.compute_options import ComputeOptions
from protocol.auth import new_secret
from protocol.transport import use_curve, write_curve_keys
from strata_dist.head.coordinator import HEARTBEAT_LOST_S, Coordinator, RankFailure, RankSlot
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.models.shape import model_shape
from strata_dist.plan import (Device, Plan, PlanError, PlanParams, RoutingProfile, make_plan,
                              render_table, skip_tier, split_shared_cards)
from strata_dist.plan.explicit import ExplicitTier
from strata_dist.tools.profile_io import LiveProfile

from .spawn import LocalRanks, RankSpec, cpu_thread_env

log = logging.getLogger("strata.launch")

REJOIN_BACKOFF_S = 0.5       # a replacement that died before loading: the next one waits this,
REJOIN_BACKOFF_MAX_S = 30.0  # doubling each time, up to this


@dataclass
class LaunchConfig:
    model: str
    ranks: list[RankSpec]
    split: str | list[int]          # "auto" or explicit split points
    max_context: int
    prompt_chunk: int | None             # None: the plan's auto chunk
    params: PlanParams
    profile: RoutingProfile | None = None
    order: str = "fastest_last"
    skip_if_fits: bool = False
    load_timeout_s: float = 600.0
    register_timeout_s: float = 120.0
    extra_env: dict = field(default_factory=dict)
    listen: str | None = None        # tcp:// control endpoint: ranks started elsewhere register here
    expect_ranks: int = 0            # with listen: how many (instead of spawning cfg.ranks)
    secret: bytes | None = None      # None: a fresh secret per launch, given to the spawned ranks
    curve: CurveKeys | None = None   # the deployment's CURVE keypair: every link encrypted
    cross_host_helpers: bool = True  # False: a stage asks only helper tiers on its own host
    heartbeat_timeout_s: float = HEARTBEAT_LOST_S
    rejoin_timeout_s: float | None = None   # set: a dead stage rank is replaced and rejoins
    backend: str = "local"           # local (spawn processes) | ray (actors in a placement group)
    ray_address: str | None = None   # ray.init(address=…): "auto" joins a running cluster
    kv_type: str | None = None       # --kv-type: how sessions keep K/V (None: each device's default)
    adapt_every: int = 0             # --adapt-every / --adapt-swaps: the adaptive cache (0: off)
    adapt_swaps: int = 0
    conversation_bytes: int = 0      # --conversation-cache-mib: each stage's kept conversations
    stage_gpus: list[str] | None = None   # --stage-gpus, as rank numbers: the ranks that run stages
    helper_tiers: tuple[ExplicitTier, ...] = ()   # --expert-cache-device: explicit helper tiers
    profile_out: str | None = None   # --expert-profile-out: the routing seen, saved as a profile
    profile_every_s: float = 60.0    # --expert-profile-every: seconds between its writes
    draft_model: str = ""            # --draft-model: loaded by the last stage (Assign.draft_model)
    draft_mtp: bool = False          # --draft mtp: the last stage drafts with the file's MTP block
    # every compute switch, as strata-launch read them from its environment (the ranks run this)
    compute: ComputeOptions = field(default_factory=ComputeOptions)


def devices_from_ranks(slots: list[RankSlot]) -> list[Device]:
    """The planner's inventory: one device per rank, identified by the rank number; ranks that
    share one card split its free memory (split_shared_cards)."""
    out = []
    for s in slots:
        d = s.register.devices[0]
        out.append(Device(name=d.name, total_bytes=d.total_bytes, free_bytes=d.free_bytes,
                          mem_bandwidth_gbs=d.mem_bandwidth_gbs, host=s.register.host,
                          index=s.rank, card=d.uuid, kind=d.kind))
    return split_shared_cards(out)


def same_host_helpers_only(plan: Plan) -> Plan:
    """--no-remote-cross-host: a helper tier on a host where no stage runs would serve nobody, so it
    is skipped (kept in the plan with the reason; the totals no longer count it)."""
    stage_hosts = {st.device.host for st in plan.stages}
    for h in plan.live_helpers:
        if h.device.host not in stage_hosts and h.explicit:
            raise PlanError(f"--no-remote-cross-host: the explicit helper tier on "
                            f"{h.device.label} (--expert-cache-device) would serve no stage: "
                            f"no stage runs on host {h.device.host}")
        if h.device.host not in stage_hosts:
            plan = skip_tier(plan, h.device, f"--no-remote-cross-host: no stage runs on host "
                                             f"{h.device.host}")
    return plan


def assignments(plan: Plan, slots: list[RankSlot], head_endpoint: str, max_context: int,
                weight_slice: bool, cross_host_helpers: bool = True,
                ipc: bool = True, kv_type: str = "",
                adapt: tuple[int, int] = (0, 0), count_routing: bool = False,
                draft_model: str = "", draft_mtp: bool = False) -> list[Assign]:
    """One Assign per rank from the plan: its stage range, neighbours and share of the plan.
    Endpoints are the ones each rank registered (reachable from the other hosts). With
    cross_host_helpers False a stage is told only of the helper tiers on its own host; with ipc
    False (rejoin on: a replacement cannot take over CUDA IPC buffers its neighbours opened from
    the process it replaces) every hand-off travels as frames. Every rank gets the plan's compute
    options and `adapt` (--adapt-every, --adapt-swaps); `count_routing`: the stages count their
    routing for a profile learnt live (--expert-profile-out); the last stage gets `draft_model`
    (--draft-model) or `draft_mtp` (--draft mtp), which the plan priced there."""
    stage_of = {st.device.index: st for st in plan.stages}
    helper_of = {h.device.index: h for h in plan.live_helpers}
    first_ep = slots[plan.stages[0].device.index].data_endpoint
    wire = plan.to_dict()
    helper_peers = [PeerInfo(rank=r, endpoint=slots[r].register.endpoints["helper"],
                             host=slots[r].register.host) for r in sorted(helper_of)]
    out = []
    for s in slots:
        st = stage_of.get(s.rank)
        peers = [p for p in helper_peers if cross_host_helpers or p.host == s.register.host]
        nxt = nxt_reg = prev = None
        if st is not None and st.stage + 1 < len(plan.stages):
            nxt_reg = slots[plan.stages[st.stage + 1].device.index]
            nxt = nxt_reg.data_endpoint
        if st is not None and st.stage > 0:
            prev = slots[plan.stages[st.stage - 1].device.index].data_endpoint
        role = ("stage+helper" if s.rank in helper_of else "stage") if st else "helper"
        out.append(Assign(
            rank=s.rank, role=role, lb=st.lb if st else 0, le=st.le if st else 0,
            first=bool(st and st.stage == 0), last=bool(st and st.stage == len(plan.stages) - 1),
            device=s.register.devices[0].kind, plan=wire, next_endpoint=nxt,
            first_endpoint=first_ep, head_endpoint=head_endpoint,
            prompt_chunk=plan.prompt_chunk, max_context=max_context,
            cache_slots=st.cache_slots if st else 0, loan_slots=st.loan_slots if st else 0,
            # each helper's pairs of this stage's layers: a miss there becomes a remote request
            helpers=[PeerInfo(rank=p.rank, endpoint=p.endpoint, host=p.host,
                              pairs=[list(x) for x in helper_of[p.rank].pairs
                                     if st.lb <= x[0] < st.le]) for p in peers] if st else [],
            helper_slots=len(helper_of[s.rank].pairs) if s.rank in helper_of else 0,
            helper_pairs=[list(p) for p in helper_of[s.rank].pairs] if s.rank in helper_of else [],
            stage=st.stage if st else -1, host=s.register.host, weight_slice=weight_slice,
            cache_pairs=[list(p) for p in st.pairs] if st else [], prev_endpoint=prev,
            next_host=nxt_reg.register.host if nxt_reg else "",
            next_kind=nxt_reg.register.devices[0].kind if nxt_reg else "", ipc=ipc,
            kv_type=kv_type, compute=plan.compute, adapt_every=adapt[0], adapt_swaps=adapt[1],
            count_routing=count_routing,
            draft_model=draft_model if st and st.stage == len(plan.stages) - 1 else "",
            draft_mtp=draft_mtp and bool(st) and st.stage == len(plan.stages) - 1))
    return out


class Launch:
    """Owns the rank processes and the coordinator of one run; `close()` leaves nothing behind."""

    def __init__(self, cfg: LaunchConfig, echo=lambda line: print(line, file=sys.stderr)):
        self.cfg = cfg
        self.echo = echo
        self.gguf = GGUFModel(cfg.model)
        # the run directory last: nothing after it can fail before the caller holds this launch
        # (and closes it, which removes the directory)
        self.endpoints = Endpoints()
        # who runs the rank processes: None when they are started elsewhere and register (--listen)
        self.ranks = (LocalRanks(self.endpoints.run_dir)
                      if cfg.backend == "local" and not cfg.listen else None)
        self.coordinator: Coordinator | None = None
        self.plan: Plan | None = None
        self.ready: dict[int, dict] = {}
        self._assigned: list[Assign] = []
        self._lost: set[int] = set()
        # rejoin: replacements started since each rank's last Ready, when each current death was
        # noticed, and the replacement loading now (pid, started)
        self._respawns: dict[int, int] = {}
        self._noticed: dict[int, float] = {}
        self._replacing: dict[int, tuple[int, float]] = {}
        self._loaded = False                   # every rank has loaded once
        self.live_profile: LiveProfile | None = None   # --expert-profile-out

    @property
    def n_ranks(self) -> int:
        if self.coordinator is not None and self.coordinator.ranks:
            return len(self.coordinator.ranks)
        return self.cfg.expect_ranks if self.cfg.listen and self.cfg.backend == "local" \
            else len(self.cfg.ranks)

    def start(self) -> Plan:
        cfg, ep = self.cfg, self.endpoints
        secret = cfg.secret or new_secret().encode()
        if cfg.curve is not None:
            use_curve(cfg.curve)   # every socket of this process from now on
        if cfg.backend == "ray":
            from .ray_backend import RayRanks
            self.ranks = RayRanks(cfg.ray_address, self.echo)
            control = cfg.listen or f"tcp://{self.ranks.head_address}:*"
            head = _any_port(control)
        elif cfg.listen:
            control, head = cfg.listen, _any_port(cfg.listen)
        else:
            control, head = ep.ipc("control"), ep.ipc("head")
        self.coordinator = Coordinator(secret, self.gguf.fingerprint, control_bind=control,
                                       head_bind=head, liveness=self._liveness,
                                       heartbeat_lost_s=cfg.heartbeat_timeout_s,
                                       on_refusal=lambda m: self.echo(f"warning: {m}"),
                                       rejoin_timeout_s=cfg.rejoin_timeout_s,
                                       on_rejoin=self._on_rejoin)
        n = self._start_ranks(secret.decode())
        slots = self.coordinator.wait_for_ranks(n, cfg.register_timeout_s)
        kind = "cuda" if any(s.register.devices[0].kind == "cuda" for s in slots) else "cpu"
        shape = model_shape(self.gguf, kind, cfg.kv_type)
        # ranks counted only at start (registered, or one per GPU of a Ray cluster): one is no split
        split = "none" if cfg.split == "auto" and len(slots) < 2 else cfg.split
        self.plan = make_plan(shape, devices_from_ranks(slots), cells=cfg.max_context,
                              profile=cfg.profile, params=cfg.params, split=split,
                              order=cfg.order, skip_if_fits=cfg.skip_if_fits, prompt_chunk=cfg.prompt_chunk,
                              stage_gpus=cfg.stage_gpus, helper_tiers=cfg.helper_tiers,
                              compute=cfg.compute, conversation_bytes=cfg.conversation_bytes)
        if not cfg.cross_host_helpers:
            self.plan = same_host_helpers_only(self.plan)
        hosts = sorted({s.register.host for s in slots})
        if len(hosts) > 1:
            self.echo(f"launch: {len(slots)} ranks on {len(hosts)} hosts ({', '.join(hosts)}); "
                      "hand-offs between hosts travel over TCP")
        for line in render_table(self.plan).splitlines():
            self.echo(f"plan: {line}")
        work = assignments(self.plan, slots, self.coordinator.head_endpoint, cfg.max_context,
                           cfg.params.weight_slice, cfg.cross_host_helpers,
                           ipc=cfg.rejoin_timeout_s is None, kv_type=cfg.kv_type or "",
                           adapt=(cfg.adapt_every, cfg.adapt_swaps),
                           count_routing=cfg.profile_out is not None,
                           draft_model=cfg.draft_model, draft_mtp=cfg.draft_mtp)
        self._assigned = work
        if cfg.profile_out is not None:
            self.live_profile = LiveProfile(
                cfg.profile_out, shape.n_layers, shape.n_experts, cfg.profile_every_s,
                model_fingerprint=self.gguf.fingerprint,
                meta={"model": os.path.basename(cfg.model)})
        self.coordinator.assign(work, cfg.load_timeout_s, on_ready=self._on_ready)
        self._loaded = True
        return self.plan

    def _start_ranks(self, secret: str) -> int:
        """Start the rank processes this launch owns; the number of ranks to wait for."""
        cfg, ep = self.cfg, self.endpoints
        if self.ranks is None:
            self.echo(f"launch: waiting for {cfg.expect_ranks} rank(s) to register at "
                      f"{self.coordinator.control_endpoint}")
            return cfg.expect_ranks
        env = dict(cfg.extra_env)
        if cfg.backend == "ray":
            n = self.ranks.start(cfg.ranks, cfg.model, self.coordinator.control_endpoint, secret,
                                 env, cfg.curve)
            self.echo(f"launch: {n} rank(s) starting as Ray actors")
            return n
        args: tuple[str, ...] = ()
        if cfg.curve is not None:
            args = ("--curve-keys", os.path.join(ep.run_dir, "curve"))
            write_curve_keys(args[1], cfg.curve)
        env.update(cpu_thread_env(sum(1 for r in cfg.ranks if r.device == "cpu")))
        for spec in cfg.ranks:
            self.ranks.spawn(spec, cfg.model, self.coordinator.control_endpoint,
                             ep.ipc(f"rank{spec.index}"), secret, env, args)
        self.echo(f"launch: {len(cfg.ranks)} rank(s) starting, logs in {ep.run_dir}")
        return len(cfg.ranks)

    def _liveness(self) -> str | None:
        """A dead stage rank ends the launch (with rejoin on, it is started again instead); a dead
        helper-only rank does not (the stages compute its experts from host memory), it is
        reported once. Ranks this launch did not start are watched by their heartbeats only."""
        self._profile_tick()
        if self.ranks is None:
            return None
        helper_only = frozenset(r for r, a in enumerate(self._assigned) if a.role == "helper")
        for r in helper_only - self._lost:
            if self.ranks.exited(r):
                self._lost.add(r)
                self.echo(f"warning: helper rank {r} is gone: "
                          f"{self.ranks.first_dead() or 'exited'}; continuing without its tier")
                self.coordinator.optional.add(r)
        if (self.cfg.rejoin_timeout_s is not None and isinstance(self.ranks, LocalRanks)
                and self._loaded):              # a rank failing its first load ends the launch
            return self._replace_dead(helper_only)
        return self.ranks.first_dead(ignore=helper_only)

    def _replace_dead(self, helper_only: frozenset) -> None:
        """Rejoin: a dead stage rank is started again with the same number and endpoints, and the
        coordinator waits for it (the other ranks keep everything they hold). A rank the
        coordinator lost while its process lives on (stopped, hung) is ended first, and so is a
        replacement that has not loaded within the load timeout. A replacement that dies before
        it has loaded is started again after a delay that doubles each time, counted from its
        death (up to REJOIN_BACKOFF_MAX_S): a rank that cannot load does not spin, and comes back
        once what kills it is fixed; meanwhile requests get ERR."""
        now = time.monotonic()
        for r in range(len(self._assigned)):
            if r in helper_only:
                continue
            why = self.ranks.death(r)
            if why is None:
                proc = self.ranks.procs[r]
                pid, started = self._replacing.get(r, (None, now))
                if r in self.coordinator.lost and proc.pid != pid:
                    self.echo(f"warning: rank {r} (pid {proc.pid}) is lost but still running; "
                              f"ending it so that it can be replaced")
                    proc.kill()
                elif r in self.coordinator.lost and now - started > self.cfg.load_timeout_s:
                    self.echo(f"warning: the replacement of rank {r} (pid {proc.pid}) has not "
                              f"loaded within {self.cfg.load_timeout_s:.0f} s; ending it")
                    proc.kill()
                continue
            self.coordinator.lose(r, why)
            noticed = self._noticed.setdefault(r, now)
            tries = self._respawns.get(r, 0)
            delay = 0.0 if tries == 0 else min(REJOIN_BACKOFF_MAX_S,
                                               REJOIN_BACKOFF_S * 2 ** (tries - 1))
            if now < noticed + delay:
                continue
            self._respawns[r] = tries + 1
            self._noticed.pop(r)
            pid = self.ranks.respawn(r).pid
            self._replacing[r] = (pid, now)
            self.echo(f"warning: {why.splitlines()[0]}; started rank {r} again (pid {pid}) to "
                      f"rejoin")
        return None

    def _on_rejoin(self, slot: RankSlot) -> None:
        self._on_ready(slot)
        self._respawns.pop(slot.rank, None)
        self._replacing.pop(slot.rank, None)
        self.echo(f"rank {slot.rank} rejoined")

    def _on_ready(self, slot: RankSlot) -> None:
        a, alloc = slot.assign, slot.ready.allocated
        self.ready[slot.rank] = alloc
        mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
        if "free_before" in alloc:        # a GPU rank: device memory around each carve
            steps = [("free_after_stage", "after its stage"),
                     ("free_after_helper", "after its helper tier")]
            self.echo(f"rank {slot.rank} device memory free: {mib(alloc['free_before'])} MiB "
                      f"before loading" + "".join(f", {mib(alloc[k])} MiB {what}"
                                                  for k, what in steps if k in alloc))
        tier = next((h for h in self.plan.live_helpers if h.device.index == slot.rank), None)
        if tier is not None:
            if alloc.get("helper_failed") and tier.explicit:
                # the operator sized it: a smaller run than asked would pass unnoticed
                raise RankFailure(f"rank {slot.rank} ({tier.device.label}): its explicit helper "
                                  f"tier (--expert-cache-device, {tier.budget_bytes / 2**20:.1f} "
                                  f"MiB asked, {len(tier.pairs)} pairs of {tier.bytes / 2**20:.1f} "
                                  f"MiB) did not open; the rank's log says why")
            if alloc.get("helper_failed"):
                # fail-soft: the tier is skipped, and the totals the run reports say so
                self.plan = skip_tier(self.plan, tier.device, "did not open on its rank")
                self.echo(f"rank {slot.rank}: helper tier of {len(tier.pairs)} pairs did not open; "
                          "skipped (its experts are computed from host memory)")
            elif alloc.get("helper") != tier.bytes:
                raise RankFailure(f"rank {slot.rank} holds {alloc.get('helper')} bytes of helper "
                                  f"tier; the plan priced {tier.bytes}")
        if a.role == "helper":
            self.echo(f"rank {slot.rank} ready: helper tier {mib(alloc.get('helper', 0))} MiB "
                      f"({len(a.helper_pairs)} pairs) in {slot.ready.elapsed_ms:.0f} ms")
            return
        st = self.plan.stages[a.stage]
        self.echo(f"rank {slot.rank} ready: stage {st.stage} [{a.lb}, {a.le}) weights "
                  f"{mib(alloc.get('weights', 0))} MiB (priced {mib(st.weights_bytes)}), session "
                  f"{mib(alloc.get('session', 0))} MiB (priced {mib(st.session_bytes)}), cache "
                  f"{st.cache_slots} slots {mib(alloc.get('cache', 0))} MiB in "
                  f"{slot.ready.elapsed_ms:.0f} ms"
                  + (f"; {mib(alloc['host_pinned'])} MiB of the experts it lacks pinned in host "
                     f"memory" if alloc.get("host_pinned") else ""))
        if alloc.get("host_pin_failed"):
            self.echo(f"warning: rank {slot.rank} could not pin the experts its cache lacks in "
                      f"host memory (memlock limit or host memory; its log says which): they are "
                      f"read from the file")
        # The priced and the loaded layout come from one rule; a difference is a bug that would
        # make every plan silently wrong, so the launch stops on it.
        for kind, priced in (("weights", st.weights_bytes), ("session", st.session_bytes),
                             ("cache", st.cache_bytes),
                             ("conversations", st.conversation_bytes or None),
                             ("kv_host", st.kv_host_bytes or None)):
            if alloc.get(kind) != priced:
                raise RankFailure(f"rank {slot.rank} allocated {alloc.get(kind)} bytes of {kind} "
                                  f"for [{a.lb}, {a.le}); the plan priced {priced}")

    def _profile_tick(self) -> None:
        """--expert-profile-out's clock, on the coordinator's pump (it calls _liveness every
        turn): when due, the counts the last replies brought are written and fresh ones asked."""
        p = self.live_profile
        if p is None or not self._loaded or not p.due():
            return
        try:
            p.write(self.coordinator.routing)
        except OSError as e:
            self.echo(f"warning: --expert-profile-out {p.path}: not written ({e.strerror or e})")
        self.coordinator.ask_stats()

    def _final_profile(self) -> None:
        """At shutdown: the stages' totals asked once more, then written."""
        try:
            self.coordinator.stats()
        except Exception as e:   # a rank gone: what the earlier replies brought is written
            self.echo(f"warning: --expert-profile-out: the ranks' last counts not read ({e})")
        try:
            if self.live_profile.write(self.coordinator.routing):
                self.echo(f"launch: routing profile written to {self.live_profile.path}")
        except OSError as e:
            self.echo(f"warning: --expert-profile-out {self.live_profile.path}: not written "
                      f"({e.strerror or e})")

    def close(self, reason: str = "") -> None:
        if self.coordinator is not None and self.live_profile is not None and self._loaded:
            self._final_profile()
        if self.coordinator is not None:
            self.coordinator.shutdown(reason)
        if self.ranks is not None:
            self.ranks.stop()
        self.endpoints.cleanup()
        if self.cfg.curve is not None:
            use_curve(None)   # this process's later channels are plain again


def _any_port(endpoint: str) -> str:
    """tcp://host:port -> tcp://host:* (the head's inbox beside the control socket)."""
    return endpoint.rsplit(":", 1)[0] + ":*"


__all__ = ["Launch", "LaunchConfig", "RankFailure", "assignments", "devices_from_ranks",
           "same_host_helpers_only"]
