"""plan_lend: DESIGN §4's prompt-loan rule, one test per rule."""
import pytest

from test_plan_fixtures import MIB, make_devices
from strata_dist.plan import (LEND_CHUNKS, SLOT_FLOOR, Participant, PlanError, loan_slots, make_plan, plan_lend,
                              qwen3_30b_a3b_shape)

BPT = 100_000           # prompt bytes per token
SLOT = 1_000_000        # slot bytes: a chunk of c tokens needs ceil(c / 10) slots
ROOM = 10 ** 12


def part(name, slots, room=ROOM):
    return Participant(name, slots, SLOT, room)


def need(prompt_chunk):
    return loan_slots(prompt_chunk, BPT, SLOT)


def test_loan_slots_rounds_up():
    assert loan_slots(10, 100, 1000) == 1
    assert loan_slots(10, 100, 999) == 2
    assert loan_slots(8192, 233_984, 5_013_504) == 383   # Qwen3-30B Q8_0: 8192 tokens -> 383 slots
    assert need(8192) == 820


def test_auto_chunk_is_the_largest_every_participant_can_lend():
    rich = part("rich", 100_000)
    mid = part("mid", 10_000)                           # lends 8192 easily
    poor = part("poor", SLOT_FLOOR + need(2048))        # 2048 leaves exactly the floor, 3072 does not
    plan = plan_lend([rich, mid, poor], BPT, lend_pct=100)
    assert plan.auto and plan.prompt_chunk == 2048
    assert [l.slots for l in plan.loans] == [need(2048)] * 3 and all(l.lends for l in plan.loans)
    assert plan_lend([rich, mid], BPT).prompt_chunk == LEND_CHUNKS[0] == 8192


def test_a_loan_must_leave_the_128_slot_floor():
    exact = part("exact", SLOT_FLOOR + need(256))
    assert plan_lend([exact], BPT, prompt_chunk=256).loans[0].lends
    short = part("short", SLOT_FLOOR + need(256) - 1)
    assert not plan_lend([short], BPT, prompt_chunk=256).loans[0].lends


def test_percentage_cap_applies_to_the_auto_chunk_only():
    # 8192 tokens need 820 slots; of 1500 slots that is 54.7%: over a 50% cap, under the floor rule
    p = part("p", 1500)
    auto = plan_lend([p], BPT, lend_pct=50)
    assert auto.prompt_chunk == 6144 and auto.loans[0].slots == need(6144)      # 615 slots = 41%
    explicit = plan_lend([p], BPT, prompt_chunk=8192, lend_pct=50)
    assert explicit.prompt_chunk == 8192 and explicit.loans[0].lends and explicit.loans[0].slots == 820
    assert not explicit.auto


def test_an_explicit_chunk_is_the_operators_number():
    p = part("p", 5000)
    plan = plan_lend([p], BPT, prompt_chunk=5000, lend_pct=1)     # not in LEND_CHUNKS; the cap is ignored
    assert plan.prompt_chunk == 5000 and plan.loans[0].lends and plan.loans[0].slots == 500
    with pytest.raises(PlanError, match="at least 1 token"):
        plan_lend([p], BPT, prompt_chunk=0)


def test_a_participant_that_cannot_lend_falls_back_to_its_own_buffers():
    lender = part("stage 0", 10_000)
    tiny = part("stage 1", 130, room=500 * MIB)
    plan = plan_lend([lender, tiny], BPT, prompt_chunk=4096)
    a, b = plan.loans
    assert a.lends and a.slots == need(4096)
    assert not b.lends and b.slots == 0 and b.own_bytes == 4096 * BPT
    # the note names both numbers: what it needs and what it has
    assert f"needs {need(4096)} slots" in b.note and "has 130" in b.note and f"floor {SLOT_FLOOR}" in b.note


def test_auto_with_a_participant_that_cannot_lend_bounds_the_chunk_by_its_own_buffers():
    lender = part("stage 0", 100_000)
    tiny = part("stage 1", 100, room=500 * MIB)   # 85% of 500 MiB holds 4096 tokens' buffers, not 6144
    plan = plan_lend([lender, tiny], BPT)
    assert plan.prompt_chunk == 4096
    assert plan.loans[0].lends and not plan.loans[1].lends
    with pytest.raises(PlanError, match="cannot lend a 256-token chunk.*exceed 85% of its"):
        plan_lend([lender, part("stage 1", 100, room=20 * MIB)], BPT)
    with pytest.raises(PlanError, match="--prefill 8192.*own prompt buffers"):
        plan_lend([lender, part("stage 1", 100, room=20 * MIB)], BPT, prompt_chunk=8192)


def test_one_participant_is_exactly_the_single_device_plan():
    shape = qwen3_30b_a3b_shape(n_layers=8)
    dev = make_devices([6_000], bw=[400])     # the cache holds 882 of the 1,024 pairs: it lends
    single = make_plan(shape, dev, cells=8192, split="none")
    st = single.stages[0]
    alone = plan_lend([Participant("x", st.cache_slots, st.slot_bytes, st.budget_bytes)],
                      shape.prompt_bytes_per_token)
    assert (single.prompt_chunk, st.loan_slots, st.loan_bytes) == (alone.prompt_chunk, alone.loans[0].slots, alone.loans[0].bytes)
    # and adding participants that can lend anything changes nothing for it
    crowd = plan_lend([Participant("x", st.cache_slots, st.slot_bytes, st.budget_bytes), part("big", 10 ** 6)],
                      shape.prompt_bytes_per_token)
    assert crowd.prompt_chunk == alone.prompt_chunk and crowd.loans[0] == alone.loans[0]


def test_a_cache_holding_every_pair_lends_nothing():
    """Where the budget holds every pair of the stage's layers with room left, the prompt buffers
    take that room: a loan would evict experts to free memory that is already free. Where the
    room is too small for them, the stage lends as before."""
    roomy = Participant("roomy", 500, SLOT, ROOM, spare_bytes=BPT * 8192)
    plan = plan_lend([roomy], BPT)
    assert plan.prompt_chunk == 8192
    [loan] = plan.loans
    assert (loan.lends, loan.slots, loan.bytes, loan.own_bytes) == (False, 0, 0, BPT * 8192)
    assert "holds every pair of its layers" in loan.note
    tight = Participant("tight", 5000, SLOT, ROOM, spare_bytes=BPT * 8192 - 1)
    assert plan_lend([tight], BPT).loans[0].slots == need(8192)
    assert plan_lend([roomy], BPT, loans=False).loans[0].note.endswith(
        "it uses its own prompt buffers (781.2 MiB)")
    # the planner: 12 GB holds all 1,024 pairs of 8 layers and the buffers beside them
    shape = qwen3_30b_a3b_shape(n_layers=8)
    st = make_plan(shape, make_devices([12_000], bw=[400]), cells=8192, split="none").stages[0]
    assert st.cache_slots == 8 * shape.n_experts and st.loan_slots == 0
    assert st.own_prompt_bytes == shape.prompt_bytes_per_token * 8192
    assert st.cache_bytes + st.own_prompt_bytes <= st.budget_bytes


def test_a_cache_holding_every_pair_prices_no_stream_buffer():
    """A participant that holds every pair and keeps its own buffers in the room its cache left
    streams no miss, so they are the resident layout (no stream buffer). One that lends, or whose
    buffers take pairs out of its cache, streams, and pays for the stream buffer."""
    stream = 7 * SLOT                                   # the stream buffer, whatever the chunk

    def with_stream(c):
        return BPT * c + stream

    def resident(c):
        return BPT * c

    roomy = Participant("roomy", 500, SLOT, ROOM, spare_bytes=BPT * 8192, holds_all=True)
    [loan] = plan_lend([roomy], with_stream, resident_bytes=resident).loans
    assert not loan.lends and loan.own_bytes == BPT * 8192, loan
    # loans off: the same own buffers, where they fit in the room the cache left
    [off] = plan_lend([roomy], with_stream, loans=False, resident_bytes=resident).loans
    assert off.own_bytes == BPT * 8192, off
    # its buffers fit nowhere but in its cache: it evicts pairs, so it streams
    tight = Participant("tight", 500, SLOT, ROOM, spare_bytes=BPT * 1024 - 1, holds_all=True)
    [own] = plan_lend([tight], with_stream, 1024, loans=False, resident_bytes=resident).loans
    assert own.own_bytes == with_stream(1024), own
    # a partial cache streams: the full layout, lent or its own
    partial = Participant("partial", 5000, SLOT, ROOM)
    [lent] = plan_lend([partial], with_stream, 1024, resident_bytes=resident).loans
    assert lent.lends and lent.slots == loan_slots(1024, with_stream, SLOT), lent
    [kept] = plan_lend([partial], with_stream, 1024, loans=False, resident_bytes=resident).loans
    assert kept.own_bytes == with_stream(1024), kept
    # the planner, with a layout: a stage caching every pair carves the resident one
    from dataclasses import replace
    from strata_dist.plan.workspace import STREAMED, Buffer, PromptLayout
    shape = qwen3_30b_a3b_shape(n_layers=8)
    layout = PromptLayout.of([Buffer("h", "residual", 4 * shape.hidden),
                              Buffer("y", "experts", 4 * shape.top_k * shape.hidden),
                              Buffer(STREAMED, "residual", 0, shape.n_experts * max(shape.blob_bytes))])
    shape = replace(shape, prompt_layout=tuple(layout.to_list()))
    assert shape.resident_prompt_bytes(4096) == layout.without(STREAMED).nbytes(4096)
    assert shape.prompt_bytes(4096) == layout.nbytes(4096) > shape.resident_prompt_bytes(4096)
    st = make_plan(shape, make_devices([12_000], bw=[400]), cells=8192, split="none",
                   prompt_chunk=4096).stages[0]
    assert st.cache_slots == 8 * shape.n_experts and st.loan_slots == 0
    assert st.own_prompt_bytes == shape.resident_prompt_bytes(4096)


def test_the_auto_chunk_never_exceeds_the_context():
    from strata_dist.plan import Device, make_plan, qwen3_30b_a3b_shape
    shape = qwen3_30b_a3b_shape()
    devs = [Device("big", 140 << 30, 140 << 30, 4800.0, index=0)]
    plan = lambda **kw: make_plan(shape, devs, split="none", **kw)  # noqa: E731
    assert plan(cells=32768).prompt_chunk == 8192
    assert plan(cells=4096).prompt_chunk == 4096
    assert plan(cells=3000).prompt_chunk == 2048
    assert plan(cells=100).prompt_chunk == 256      # the smallest chunk still stands
    assert plan(cells=4096, prompt_chunk=8192).prompt_chunk == 8192  # the operator's number


def test_loans_off_every_participant_withholds_its_own_buffers():
    """The A/B arm: nobody lends; each stage's own buffers come out of its cache's room."""
    rich, poor = part("rich", 100_000, room=BPT * 8192), part("poor", 10_000, room=BPT * 2048)
    plan = plan_lend([rich, poor], BPT, loans=False, lend_pct=100)
    assert plan.prompt_chunk == 2048                     # the largest chunk whose buffers fit every room
    assert not any(l.lends for l in plan.loans) and all(l.slots == 0 for l in plan.loans)
    assert [l.own_bytes for l in plan.loans] == [BPT * 2048] * 2
    assert all("prompt loans are off" in l.note for l in plan.loans)


def test_loans_off_shrinks_the_stage_caches_by_the_prompt_buffers():
    from strata_dist.plan import PlanParams
    shape = qwen3_30b_a3b_shape()
    devices = make_devices([12 * 1024, 16 * 1024])
    on = make_plan(shape, devices, cells=4096, prompt_chunk=2048, split=[24])
    off = make_plan(shape, devices, cells=4096, prompt_chunk=2048, split=[24],
                    params=PlanParams(prompt_loans=False))
    for st_on, st_off in zip(on.stages, off.stages):
        assert st_on.loan_slots > 0 and st_off.loan_slots == 0
        assert st_off.own_prompt_bytes == shape.prompt_bytes_per_token * 2048
        # the cache gives up the buffers' bytes, to within a slot (a fill leaves less than one)
        given_up = st_on.cache_bytes - st_off.cache_bytes
        assert abs(given_up - st_off.own_prompt_bytes) <= max(shape.blob_bytes)


@pytest.mark.parametrize("free_mib", [1_500, 2_000, 2_300, 2_500, 3_000])   # own, lend, ..., resident
@pytest.mark.parametrize("prompt_chunk", [None, 256, 2048])
def test_own_buffers_are_the_resident_layout_exactly_where_the_stage_carves_it(free_mib, prompt_chunk):
    """The stage carves the layout less its stream buffer where its final cache holds every pair
    of its layers and it lends nothing (stage.py); the plan prices its own buffers by the same
    rule, whatever the fills and the chunk (so priced == carved)."""
    from dataclasses import replace
    from strata_dist.plan.workspace import STREAMED, Buffer, PromptLayout
    shape = qwen3_30b_a3b_shape(n_layers=4)
    layout = PromptLayout.of([Buffer("h", "residual", 4 * shape.hidden),
                              Buffer("y", "experts", 4 * shape.top_k * shape.hidden),
                              Buffer(STREAMED, "residual", 0, 32 * max(shape.blob_bytes))])
    shape = replace(shape, prompt_layout=tuple(layout.to_list()))
    try:
        plan = make_plan(shape, make_devices([free_mib, free_mib], bw=[400, 400]), cells=4096,
                         split=[2], prompt_chunk=prompt_chunk, order="as_given")
    except PlanError:
        return
    for st in plan.stages:
        holds_all = st.cache_slots == (st.le - st.lb) * shape.n_experts
        if st.loan_slots:
            assert st.own_prompt_bytes == 0
        elif holds_all:
            assert st.own_prompt_bytes == shape.resident_prompt_bytes(plan.prompt_chunk), st
        else:
            assert st.own_prompt_bytes == shape.prompt_bytes(plan.prompt_chunk), st
        assert st.cache_bytes + st.own_prompt_bytes <= st.budget_bytes
