"""Shared builders for the planner tests (no tests here): small synthetic ModelShapes and rigs,
and a brute-force reference scorer written from the score's definition, independent of the
vectorised tables the planner searches with."""
from __future__ import annotations

import itertools

import numpy as np

from strata_dist.plan import Device, ModelShape, PlanParams, RoutingProfile, fill_stage, pair_masses
from strata_dist.plan.pricing import HANDOFF_DTYPE_BYTES, reserve_bytes, session_bytes, weights_bytes

MIB = 1 << 20


def make_shape(n_layers: int = 8, n_experts: int = 4, top_k: int = 2, *, seed: int = 0,
               kinds: list[str] | None = None, hidden: int = 64) -> ModelShape:
    """A shape whose per-layer numbers all differ (so a range priced from the wrong lower bound, or
    a blob size taken from the wrong layer, shows up)."""
    rng = np.random.default_rng(seed)
    kinds = kinds or ["attention"] * n_layers
    dense = [int(x) for x in rng.integers(8 * MIB, 40 * MIB, n_layers)]
    return ModelShape(
        arch="synthetic", n_layers=n_layers, n_experts=n_experts, top_k=top_k, hidden=hidden, n_head=4,
        layer_kind=kinds,
        layer_dense_bytes=dense,
        router_bytes=[d // 50 for d in dense],
        blob_bytes=[int(x) for x in rng.integers(2 * MIB, 9 * MIB, n_layers)],
        kv_bytes_per_cell=[int(rng.integers(512, 4096)) if k == "attention" else 0 for k in kinds],
        recurrent_bytes=[int(rng.integers(1 * MIB, 4 * MIB)) if k == "linear" else 0 for k in kinds],
        rope_bytes_per_cell=256,
        embed_bytes=20 * MIB, head_bytes=24 * MIB,
        prompt_bytes_per_token=16 * 1024,
    )


def hybrid_kinds(n_layers: int) -> list[str]:
    """qwen3next layout: linear attention except every 4th layer."""
    return ["attention" if l % 4 == 3 else "linear" for l in range(n_layers)]


def make_devices(free_mib: list[float], bw: list[float | None] | None = None,
                 hosts: list[str] | None = None, cards: list[str] | None = None,
                 kinds: list[str] | None = None) -> list[Device]:
    """`cards`: the physical card of each rank (the same name twice on one host: ranks sharing it);
    `kinds`: "cuda" (the default) or "cpu" per rank."""
    bw = bw or [None] * len(free_mib)
    hosts = hosts or ["localhost"] * len(free_mib)
    cards = cards or [""] * len(free_mib)
    kinds = kinds or ["cuda"] * len(free_mib)
    return [Device(f"{k.replace('cuda', 'gpu')}{i}", int(f * MIB) + 64 * MIB, int(f * MIB), b, h, i, c, k)
            for i, (f, b, h, c, k) in enumerate(zip(free_mib, bw, hosts, cards, kinds))]


def skewed_profile(n_layers: int, n_experts: int, seed: int = 1) -> RoutingProfile:
    rng = np.random.default_rng(seed)
    return RoutingProfile(rng.zipf(1.5, size=(n_layers, n_experts)).astype(float))


def reference_score(shape: ModelShape, devices, profile: RoutingProfile, cells: int, params: PlanParams,
                    stage_devices, bounds) -> float:
    """The score of one placement from its definition: plain walks, scalar pricing, no memo."""
    ranking = profile.ranking()
    mass = pair_masses(profile, ranking, params.coverage, params.cover_b)
    L, E, k = shape.n_layers, shape.n_experts, shape.top_k
    total, held, held_blob = 0.0, 0.0, 0.0
    for i, d in enumerate(stage_devices):
        lb, le = bounds[i], bounds[i + 1]
        first, last = lb == 0, le == L
        fixed = (weights_bytes(shape, lb, le, first, last, weight_slice=params.weight_slice)
                 + session_bytes(shape, cells, lb, le) + reserve_bytes(shape, first, last))
        budget = devices[d].free_bytes - fixed
        if budget < 0:
            return float("inf")
        fill = fill_stage(shape, ranking, lb, le, budget, params.stage_cache_slots)
        read = 0.0
        for l in range(lb, le):
            read += shape.layer_dense_bytes[l]
            if shape.layer_kind[l] == "attention":
                read += params.kv_fill * cells * shape.kv_bytes_per_cell[l]
            else:
                read += 2 * shape.recurrent_bytes[l]
        if last:
            read += shape.head_bytes
        for p in fill.pairs:
            read += L * k * mass[p] * shape.blob_bytes[p // E]
            held += mass[p]
            held_blob += mass[p] * shape.blob_bytes[p // E]
        bw = (devices[d].mem_bandwidth_gbs or params.default_bw_gbs) * 1e6
        total += read / bw + params.layer_ms * (le - lb)
        if i:
            total += reference_hop_ms(shape, params, devices[stage_devices[i - 1]], devices[d],
                                      shape.hidden * HANDOFF_DTYPE_BYTES)
    if len(stage_devices) > 1:     # the sampled token goes back from the last stage to the first
        total += reference_hop_ms(shape, params, devices[stage_devices[-1]], devices[stage_devices[0]], 0)
    all_blob = sum(mass[p] * shape.blob_bytes[p // E] for p in range(L * E))
    return total + L * k * (params.miss_ms * (1.0 - held)
                            + (all_blob - held_blob) / (params.host_gbs * 1e6))


def reference_hop_ms(shape, params, a, b, row_bytes) -> float:
    """One hop between two ranks: turns on one shared card, a boundary on one host, or a link."""
    if a.card and a.card == b.card and a.host == b.host:
        return params.shared_card_handoff_ms
    if a.host == b.host:
        return params.handoff_ms
    return params.handoff_ms + params.link_ms + row_bytes / (params.link_gbs * 1e6)


def all_placements(n_devices: int, n_layers: int, max_stages: int | None = None):
    """Every (device subsequence, bounds) placement."""
    top = min(n_devices, n_layers, max_stages or n_devices)
    for s in range(1, top + 1):
        for combo in itertools.combinations(range(n_devices), s):
            for cuts in itertools.combinations(range(1, n_layers), s - 1):
                yield combo, (0, *cuts, n_layers)


def brute_force(shape, devices, profile, cells, params, max_stages=None):
    best = (float("inf"), None)
    for combo, bounds in all_placements(len(devices), shape.n_layers, max_stages):
        v = reference_score(shape, devices, profile, cells, params, combo, bounds)
        if v < best[0]:
            best = (v, (combo, bounds))
    return best


def reference_helper_ms(shape: ModelShape, plan, profile: RoutingProfile, params: PlanParams) -> float:
    """What the live helper tiers add to a plan's prediction, from the definition, pair by pair:
    each pair's host miss is spared, and its blob is read where the tier is instead (the stage's
    own card, or a rank sharing it, at its bandwidth; another card of its host at peer_gbs by a
    GPU stage; otherwise by a request per (layer, tier) a token routes to, at most one a layer)."""
    ranking = profile.ranking()
    mass = pair_masses(profile, ranking, params.coverage, params.cover_b)
    L, E, k = shape.n_layers, shape.n_experts, shape.top_k
    total = 0.0
    for tier in plan.live_helpers:
        asked: dict[int, float] = {}
        for layer, e in tier.pairs:
            m, blob = mass[layer * E + e], shape.blob_bytes[layer]
            total -= L * k * m * (params.miss_ms + blob / (params.host_gbs * 1e6))
            stage = next(s for s in plan.stages if s.lb <= layer < s.le)
            bw = (tier.device.mem_bandwidth_gbs or params.default_bw_gbs) * 1e6
            if stage.device == tier.device or (stage.device.card == tier.device.card != ""
                                               and stage.device.host == tier.device.host):
                total += L * k * m * blob / bw
            elif stage.device.host == tier.device.host and stage.device.kind == "cuda":
                total += L * k * m * blob / (params.peer_gbs * 1e6)
            else:
                total += L * k * m * blob / bw
                asked[layer] = asked.get(layer, 0.0) + L * k * m
        for layer, expected in asked.items():
            stage = next(s for s in plan.stages if s.lb <= layer < s.le)
            one_way = params.handoff_ms
            if stage.device.host != tier.device.host:
                one_way += params.link_ms + shape.hidden * HANDOFF_DTYPE_BYTES / (params.link_gbs * 1e6)
            total += min(1.0, expected) * 2 * one_way
    return total
