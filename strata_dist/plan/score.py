"""The score: predicted milliseconds per decode token of a placement.

    score = sum over stages of compute(stage)            bytes the stage reads per token / its bandwidth
                                                         + layer_ms per layer (launches, reductions)
          + top_k * n_layers * sum over pairs not held of  experts computed from host memory:
              mass * (miss_ms + blob bytes / host_gbs)     each one's blob read over PCIe
          + sum over boundaries of link(dev_i, dev_i+1)   hand-offs (priced higher across hosts,
                                                         and between two ranks sharing one card)
          + back(dev_last, dev_first)                   the sampled token's way back to the first
                                                         stage: K stages take K hops a token

A stage reads, per token: its layers' dense tensors, its share of KV (kv_fill of the context) and
recurrent state (read + write), the head if last, and — for the fraction of routed activations its
cache holds — those experts' blobs. `held` is the routing mass the stage caches hold (fill.py).

Every term depends on one stage's (range, device) or on one boundary's pair of devices, so the score
is ADDITIVE over stages: stage_term(d, b, e) = compute - miss credit for the mass it holds. That is
what makes the DP in search.py exact.

The search scores placements with the stage caches alone. Helper tiers are chosen after it
(helpers.py) and priced then (`helper_costs`): the plan's prediction adds what reading their pairs
costs and takes off the host misses they spare.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .device import Device
from .fill import Fill, RankTables, pair_masses
from .params import PlanParams
from .pricing import HANDOFF_DTYPE_BYTES, HANDOFF_ROWS, range_fixed_table, resident_cells
from .profile import RoutingProfile
from .shape import ModelShape

INF = float("inf")


class CostModel:
    """Everything the search needs about one (model, ordered devices, profile, context, params),
    with fills memoised per (device, range)."""

    def __init__(self, shape: ModelShape, devices: Sequence[Device], profile: RoutingProfile,
                 cells: int, params: PlanParams, handoff_rows: int = HANDOFF_ROWS,
                 withheld: Sequence[int] | None = None, resident: Sequence[int] | None = None):
        """`handoff_rows`: the hand-off buffers' rows each stage boundary reserves (the chunk).
        `withheld` (bytes per device): taken off each device's free memory before a stage is
        priced there — an explicit helper tier (--expert-cache-device) comes before the stage's
        cache, which fills what is left. `resident` (per device): the cells of each K/V a stage
        there keeps on the card (--kv-resident auto gives each card its own); None:
        params.kv_resident on every device."""
        profile.check(shape.n_layers, shape.n_experts)
        self.shape, self.devices, self.cells, self.params = shape, tuple(devices), cells, params
        self.handoff_rows = handoff_rows
        L = shape.n_layers
        self.ranking = profile.ranking()
        self.mass = pair_masses(profile, self.ranking, params.coverage, params.cover_b)
        self.tables = RankTables(shape, self.ranking, self.mass)
        self.resident = (tuple(resident) if resident is not None
                         else (params.kv_resident,) * len(self.devices))
        if len(self.resident) != len(self.devices):
            raise ValueError(f"{len(self.resident)} resident cell counts for "
                             f"{len(self.devices)} devices")
        # fixed[d, b, e]: weights + session + reserve of a stage on device d running [b, e) (the
        # session's K/V at that device's resident cells); one table per distinct count
        tables = {n: range_fixed_table(shape, cells, weight_slice=params.weight_slice,
                                       handoff_rows=handoff_rows, verify_rows=params.verify_rows,
                                       draft_bytes=params.draft_bytes,
                                       sessions=params.sessions, resident=n)
                  for n in set(self.resident)}
        self.fixed = np.stack([tables[n] for n in self.resident]) if self.resident else \
            np.zeros((0, L + 1, L + 1), dtype=np.int64)
        self.withheld = np.zeros(len(self.devices), dtype=np.int64) if withheld is None else \
            np.array(withheld, dtype=np.int64)
        self.free = np.array([d.free_bytes for d in self.devices], dtype=np.int64) - self.withheld
        # bytes per millisecond of each device
        self.bw = np.array([(d.mem_bandwidth_gbs or params.default_bw_gbs) * 1e6 for d in self.devices])
        self.lk = shape.top_k * L   # routed expert activations per token
        self.host_bw = params.host_gbs * 1e6    # bytes per millisecond of a host miss (and of
                                                 # K/V read from host memory, --kv-resident)
        # what one routed activation costs when nothing is held: the mass-weighted blob
        self.all_mass_blob = float(self.tables.span(self.tables.mass_blob, 0, L, self.tables.n))
        reads = {n: self._read_table(n) for n in set(self.resident)}
        # read[d, b, e], kv_host_ms[d, b, e]: as _read_table, at device d's resident cells
        self.read = np.stack([reads[n][0] for n in self.resident]) if self.resident else \
            np.zeros((0, L + 1, L + 1))
        self.kv_host_ms = np.stack([reads[n][1] for n in self.resident]) if self.resident else \
            np.zeros((0, L + 1, L + 1))
        self.links = np.array([[self._link(a, b) for b in self.devices] for a in self.devices])
        # back[last, first]: a token id instead of a hidden row (0 on the diagonal: one stage)
        self.back = np.array([[0.0 if i == j else self._link(a, b, row_bytes=0)
                               for j, b in enumerate(self.devices)] for i, a in enumerate(self.devices)])
        self._fills: dict[tuple[int, int, int], Fill] = {}
        self._stage: tuple[np.ndarray, np.ndarray] | None = None
        self._load: np.ndarray | None = None

    # --- per-range quantities ---------------------------------------------------------------------
    def _read_table(self, resident: int) -> tuple[np.ndarray, np.ndarray]:
        """(read[b, e]: non-expert bytes a stage on [b, e) reads per decode token from its device,
        host[b, e]: ms it spends reading the K/V cells --kv-resident keeps in host memory, at
        full depth, over PCIe at host_gbs; 0 when every cell is resident)."""
        s, L = self.shape, self.shape.n_layers
        on_device = resident_cells(self.cells, resident)
        attn = [k == "attention" for k in s.layer_kind]
        per_layer = np.array([
            s.layer_dense_bytes[l]
            + (min(self.params.kv_fill * self.cells, on_device) * s.kv_bytes_per_cell[l]
               if attn[l] else 2.0 * s.recurrent_bytes[l])
            for l in range(L)])
        host_ms = np.array([s.kv_bytes_per_cell[l] * (self.cells - on_device) / self.host_bw
                            if attn[l] else 0.0 for l in range(L)])

        def span(values) -> np.ndarray:
            pre = np.concatenate([[0.0], np.cumsum(values)])
            return pre[None, :] - pre[:, None]
        read = span(per_layer)
        read[:, L] += s.head_bytes
        return read, span(host_ms)

    def _link(self, a: Device, b: Device, row_bytes: int | None = None) -> float:
        """One hop from a's rank to b's carrying `row_bytes` (default: a decode row of hidden)."""
        p = self.params
        if a.shares_card_with(b):     # two processes taking turns on one card
            return p.shared_card_handoff_ms
        if a.host == b.host:
            return p.handoff_ms
        if row_bytes is None:
            row_bytes = self.shape.hidden * HANDOFF_DTYPE_BYTES
        return p.handoff_ms + p.link_ms + row_bytes / (p.link_gbs * 1e6)

    def budget(self, d: int, lb: int, le: int) -> int:
        """Bytes left for device d's stage cache on [lb, le) after weights, session and reserves."""
        return int(self.free[d] - self.fixed[d, lb, le])

    def fill(self, d: int, lb: int, le: int) -> Fill:
        """The stage cache of device d running [lb, le); memoised (a fill depends only on these)."""
        key = (d, lb, le)
        if key not in self._fills:
            self._fills[key] = self.tables.fill(lb, le, self.budget(d, lb, le), self.params.stage_cache_slots)
        return self._fills[key]

    def held_mass(self, pairs: Sequence[int]) -> float:
        return float(self.mass[list(pairs)].sum()) if pairs else 0.0

    def stage_parts(self, d: int, lb: int, le: int, fill: Fill) -> tuple[float, float, float]:
        """(compute ms, routing mass held, mass-weighted blob bytes held) of a stage from its fill
        — the scalar path."""
        E = self.shape.n_experts
        pairs = np.asarray(fill.pairs, dtype=np.int64)
        m = self.mass[pairs]
        mass_blob = float((m * np.asarray(self.shape.blob_bytes)[pairs // E]).sum()) if pairs.size else 0.0
        compute = ((self.read[d, lb, le] + self.lk * mass_blob) / self.bw[d]
                   + self.params.layer_ms * (le - lb) + self.kv_host_ms[d, lb, le])
        return float(compute), float(m.sum()), mass_blob

    def miss_credit(self, held, held_mass_blob):
        """The host misses a stage saves by holding `held` routing mass of `held_mass_blob`."""
        return self.lk * (self.params.miss_ms * held + held_mass_blob / self.host_bw)

    def stage_term(self, d: int, lb: int, le: int) -> float:
        """The stage's additive share of the score (inf when its weights and session do not fit)."""
        if self.budget(d, lb, le) < 0:
            return INF
        compute, held, mass_blob = self.stage_parts(d, lb, le, self.fill(d, lb, le))
        return compute - self.miss_credit(held, mass_blob)

    def baseline_ms(self) -> float:
        """The miss cost if nothing were held; every stage term subtracts its credit from it."""
        return self.miss_credit(1.0, self.all_mass_blob)

    # --- all ranges at once -------------------------------------------------------------------------
    def stage_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, T): S[d, b, e] = stage_term for every device and range (inf if it does not fit or
        e <= b), T[d, b, e] = the fill threshold. One vectorised pass; computed once."""
        if self._stage is None:
            L, D = self.shape.n_layers, len(self.devices)
            bb, ee = np.triu_indices(L + 1, k=1)
            budget = self.free[:, None] - self.fixed[:, bb, ee]                # [D, Q]
            ok = budget >= 0
            t = self.tables.threshold(bb[None, :], ee[None, :], np.maximum(budget, 0),
                                      self.params.stage_cache_slots)
            held = self.tables.span(self.tables.mass, bb, ee, t)
            mass_blob = self.tables.span(self.tables.mass_blob, bb, ee, t)
            compute = ((self.read[:, bb, ee] + self.lk * mass_blob) / self.bw[:, None]
                       + self.params.layer_ms * (ee - bb)[None, :] + self.kv_host_ms[:, bb, ee])
            term = np.where(ok, compute - self.miss_credit(held, mass_blob), INF)
            S = np.full((D, L + 1, L + 1), INF)
            T = np.zeros((D, L + 1, L + 1), dtype=np.int64)
            S[:, bb, ee] = term
            T[:, bb, ee] = t
            self._stage = (S, T)
        return self._stage

    def load_table(self) -> np.ndarray:
        """U[d, b, e]: what a stage of [b, e) asks of device d, its fixed bytes plus every expert
        of its layers, as a fraction of d's free memory (inf where it does not fit). The search
        breaks ties of the score with the placement whose most-asked card is asked least: on
        equal cards, equal shares instead of one card left mostly idle."""
        if self._load is None:
            S, _ = self.stage_table()
            blobs = np.concatenate([[0], np.cumsum(np.asarray(self.shape.blob_bytes, dtype=np.float64)
                                                   * self.shape.n_experts)])
            ask = self.fixed + (blobs[None, :] - blobs[:, None])[None]     # [d, b, e]
            U = ask / np.maximum(self.free, 1)[:, None, None].astype(np.float64)
            self._load = np.where(S < INF, U, INF)
        return self._load

    # --- helper tiers (priced after the placement; they never change it) ---------------------------
    def helper_costs(self, stages: Sequence[tuple[int, int, int]], tiers: Sequence
                     ) -> list[tuple[float, float]]:
        """(saved ms, read ms) per decode token of each tier in `tiers` (HelperTiers holding
        their pairs): the host misses its pairs no longer are, and what reading them costs
        instead. `stages`: (device index, lb, le) of each stage. A pair is read by the stage that
        runs its layer: in place at that card's bandwidth from a tier on the same card (its own,
        or that of another rank sharing the card); by a GPU stage at peer_gbs from another card
        of the same host (CUDA IPC); otherwise (a CPU stage; tiers of other hosts hold only CPU
        stages' pairs, helpers.py `serves`) by a request, one round trip per (layer, tier) a
        token routes to (at most one a layer), the blob read by the helper's own card."""
        E = self.shape.n_experts
        blob = np.asarray(self.shape.blob_bytes, dtype=np.float64)
        owner = np.full(self.shape.n_layers, -1, dtype=np.int64)
        for d, lb, le in stages:
            owner[lb:le] = d
        out = []
        for tier in tiers:
            if not tier.pairs:
                out.append((0.0, 0.0))
                continue
            t = self.devices.index(tier.device)
            layers = np.array([p[0] for p in tier.pairs], dtype=np.int64)
            m = self.mass[layers * E + np.array([p[1] for p in tier.pairs], dtype=np.int64)]
            saved = self.miss_credit(float(m.sum()), float((m * blob[layers]).sum()))
            read = 0.0
            for d in np.unique(owner[layers]):
                mine = owner[layers] == d
                bytes_read = self.lk * float((m[mine] * blob[layers[mine]]).sum())
                if d == t or self.devices[d].shares_card_with(tier.device):
                    read += bytes_read / self.bw[t]
                elif self.devices[d].host == tier.device.host and self.devices[d].decodes_as_graph:
                    read += bytes_read / (self.params.peer_gbs * 1e6)
                else:
                    per_layer = np.bincount(layers[mine], weights=m[mine], minlength=self.shape.n_layers)
                    asked = np.minimum(1.0, self.lk * per_layer).sum()
                    read += bytes_read / self.bw[t] + asked * 2 * self.links[d, t]
            out.append((float(saved), float(read)))
        return out

    # --- placements ---------------------------------------------------------------------------------
    def score(self, devices: Sequence[int], bounds: Sequence[int]) -> float:
        """Score of stages devices[i] running [bounds[i], bounds[i+1]) (scalar path, memoised fills)."""
        total = self.baseline_ms()
        for i, d in enumerate(devices):
            total += self.stage_term(d, bounds[i], bounds[i + 1])
            if i:
                total += self.links[devices[i - 1], d]
        return total + self.back[devices[-1], devices[0]]

    def breakdown(self, devices: Sequence[int], bounds: Sequence[int],
                  fills: Sequence[Fill]) -> dict[str, float]:
        """compute / miss / hand-off ms of a placement with the given fills."""
        compute = held = held_mass_blob = 0.0
        for i, d in enumerate(devices):
            c, h, mb = self.stage_parts(d, bounds[i], bounds[i + 1], fills[i])
            compute += c
            held += h
            held_mass_blob += mb
        handoff = float(sum(self.links[a, b] for a, b in zip(devices, devices[1:]))
                        + self.back[devices[-1], devices[0]])
        miss = self.baseline_ms() - self.miss_credit(held, held_mass_blob)
        return {"compute_ms": compute, "miss_ms": miss, "handoff_ms": handoff,
                "total_ms": compute + miss + handoff, "held_mass": held}
