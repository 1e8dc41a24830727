"""render_table: the plan as the table `--plan-only` prints."""
from __future__ import annotations

from .plan import Plan
from .pricing import KV_SINK_CELLS, MIB


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def render_table(plan: Plan) -> str:
    head = ("device", "role", "[lb, le)", "free", "weights", "session", "reserve", "loan", "cache",
            "helper", "slots", "left")
    rows = [head]
    for dev in plan.devices:
        st, h = plan.stage_on(dev), plan.helper_on(dev)
        live = h is not None and not h.skipped
        helper = "helper (explicit)" if live and h.explicit else "helper"
        role = " + ".join(([f"stage {st.stage}"] if st else []) + ([helper] if live else [])) or "idle"
        slots = []
        if st:
            slots.append(str(st.cache_slots))
        if live:
            slots.append(f"h{len(h.pairs)}")
        rows.append((
            dev.label, role, f"[{st.lb}, {st.le})" if st else "-", _mib(dev.free_bytes),
            _mib(st.weights_bytes) if st else "-", _mib(st.session_bytes) if st else "-",
            _mib(st.reserve_bytes) if st else "-",
            (_mib(st.loan_bytes) if st.own_prompt_bytes == 0 else f"own {_mib(st.own_prompt_bytes)}") if st else "-",
            _mib(st.cache_bytes) if st else "-", _mib(h.bytes) if live else "-",
            " + ".join(slots) or "0", _mib(plan.left_bytes(dev)),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(MiB; reserve: work buffers, hand-off rows and, on the last stage, the head's "
                 "scratch; slots: stage cache + hN helper pairs)")
    lines.append(f"expert_slots {plan.expert_slots} (stage caches {plan.expert_slots_stages}, the "
                 f"first card's {plan.expert_slots_primary}), expert cache "
                 f"{plan.expert_cache_mib:.1f} MiB (stage caches {plan.expert_cache_stages_mib:.1f} MiB)")
    lines.append(f"predicted {plan.predicted_ms_per_token:.3f} ms/token = compute {plan.compute_ms:.3f} "
                 f"+ host misses {plan.host_miss_ms:.3f} + helper reads {plan.helper_ms:.3f} "
                 f"+ hand-offs {plan.handoff_ms:.3f} (search: {plan.method})")
    lines.append(f"routing mass held: {100 * plan.coverage_all:.2f}% (stage caches {100 * plan.coverage_primary:.2f}%)")
    lines.append(f"prompt chunk {plan.prompt_chunk} ({'auto' if plan.prompt_chunk_auto else 'explicit'}), "
                 f"context {plan.cells} cells")
    for dev, other in _shared_cards(plan):
        lines.append(f"{dev.label} and {other.label} share one card: their memory is split between "
                     f"them, and a hop between them costs {plan.params.shared_card_handoff_ms:g} ms "
                     f"(they take turns on it)")
    kept = next((st for st in plan.stages if st.conversation_bytes), None)
    if kept is not None:
        where = ("on its device, taken before its expert cache fills"
                 if kept.conversation_in == "device" else "in pinned host memory")
        lines.append(f"conversation cache: {_mib(kept.conversation_bytes)} MiB per stage {where}")
    lines += _kv_lines(plan)
    for h in plan.helpers:
        if h.skipped:
            lines.append(f"helper tier on {h.device.label} skipped: {h.reason}")
    lines += [f"note: {n}" for n in plan.notes]
    changed = plan.compute.changed()
    lines.append(f"compute options: {plan.compute.describe()} ("
                 + (f"not the default: {', '.join(changed)})" if changed else "every default)"))
    return "\n".join(lines)


def _shared_cards(plan: Plan):
    """Each pair of devices of the plan that are ranks on one card, once."""
    devs = plan.devices
    return [(a, b) for i, a in enumerate(devs) for b in devs[i + 1:] if a.shares_card_with(b)]


def _kv_lines(plan: Plan) -> list[str]:
    """--kv-resident: each stage's resident cells (auto gives each card its own), its K/V on its
    device and in pinned host memory (every cell), and what a decode token at full depth spends
    reading the cells beyond the device over PCIe at host_gbs (pricing.kv_host_read_ms; inside
    the compute figure above)."""
    cells, sessions = plan.cells, plan.params.sessions
    if not any(st.kv_resident for st in plan.stages):
        return []
    lines = [f"K/V: of {cells} cells of each session, each stage keeps its {KV_SINK_CELLS} "
             f"attention sinks and a ring of the newest on the device, every cell in pinned host "
             f"memory (--kv-resident)"]
    for st in plan.stages:
        n = st.kv_resident
        if not n:
            lines.append(f"  stage {st.stage} ({st.device.label}): every one of the {cells} "
                         f"cells on the device")
            continue
        per_cell = st.kv_host_bytes // (sessions * cells)     # K + V of the stage's layers
        ms = per_cell * (cells - n) / (plan.params.host_gbs * 1e6)
        lines.append(f"  stage {st.stage} ({st.device.label}): {n} cells resident, K/V "
                     f"{_mib(sessions * per_cell * n)} MiB on the device, "
                     f"{_mib(st.kv_host_bytes)} MiB in host memory, {ms:.3f} ms/token over PCIe "
                     f"at full depth")
    return lines
