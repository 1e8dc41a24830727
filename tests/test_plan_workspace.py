"""The prompt layout's arithmetic (plan/workspace.py): the residual first, every other phase in
one shared room after it, each buffer aligned; what the planner prices is what is carved."""
import pytest

from strata_dist.plan.workspace import ALIGN, Buffer, PromptLayout

LAYOUT = PromptLayout.of([
    Buffer("h", "residual", 16), Buffer("h_mid", "residual", 16),
    Buffer("q", "attention", 64), Buffer("k", "attention", 8, 100),
    Buffer("y", "experts", 128), Buffer("stream", "experts", 0, 3 * ALIGN),
    Buffer("conv", "linear", 40),
])


def test_phases_share_the_room_after_the_residual():
    n = 100
    at = LAYOUT.carve(n)
    residual_end = at["h_mid"][0] + at["h_mid"][1]
    assert at["h"] == (0, 1600 // ALIGN * ALIGN + ALIGN)          # 1,600 bytes, aligned up
    assert at["q"][0] == at["y"][0] == at["conv"][0] == residual_end
    for name, (off, size) in at.items():
        assert off % ALIGN == 0 and size % ALIGN == 0, name
    # buffers of one phase never overlap; the phases do
    spans = sorted((o, o + s) for name, (o, s) in at.items() if name in ("y", "stream"))
    assert spans[0][1] <= spans[1][0]
    ends = {p: max(o + s for name, (o, s) in at.items() if name in names)
            for p, names in (("attention", ("q", "k")), ("experts", ("y", "stream")),
                             ("linear", ("conv",)))}
    assert LAYOUT.nbytes(n) == max(ends.values())


def test_the_price_of_a_chunk_is_its_carve_and_grows_with_it():
    for n in (0, 1, 31, 512, 4096):
        assert LAYOUT.nbytes(n) == max(o + s for o, s in LAYOUT.carve(n).values())
    assert LAYOUT.nbytes(4096) > LAYOUT.nbytes(512) > LAYOUT.nbytes(0) > 0   # the fixed parts
    assert PromptLayout.from_list(LAYOUT.to_list()) == LAYOUT


def test_a_layout_refuses_what_it_could_not_carve():
    with pytest.raises(ValueError, match="named twice: h"):
        PromptLayout.of([Buffer("h", "residual", 4), Buffer("h", "experts", 4)])
    with pytest.raises(ValueError, match="phase 'mixer'"):
        Buffer("x", "mixer", 4)
    with pytest.raises(ValueError, match="negative"):
        Buffer("x", "experts", -4)
    with pytest.raises(ValueError, match="-1 tokens"):
        LAYOUT.carve(-1)


def test_the_planner_prices_a_loan_by_the_layout():
    """plan_lend sizes a loan by the bytes of the chunk (ModelShape.prompt_bytes), so a layout's
    fixed part is priced once, not per token."""
    from strata_dist.plan.lend import Participant, loan_slots, plan_lend
    p = Participant("stage 0", slots=4000, slot_bytes=ALIGN * 64, room_bytes=10**9)
    plan = plan_lend([p], LAYOUT.nbytes, prompt_chunk=4096)
    assert plan.loans[0].slots == loan_slots(4096, LAYOUT.nbytes, p.slot_bytes)
    assert plan.loans[0].bytes >= LAYOUT.nbytes(4096) > plan.loans[0].bytes - p.slot_bytes


def test_a_capped_buffer_grows_with_the_chunk_up_to_its_cap():
    b = Buffer("s", "residual", 10 * ALIGN, 4 * ALIGN, most=100 * ALIGN)
    assert b.nbytes(0) == 4 * ALIGN and b.nbytes(5) == 54 * ALIGN and b.nbytes(10**6) == 100 * ALIGN
    layout = PromptLayout.of([Buffer("h", "residual", 16), b])
    assert PromptLayout.from_list(layout.to_list()) == layout
    with pytest.raises(ValueError, match="negative"):
        Buffer("x", "experts", 4, most=-1)


def test_the_stream_buffer_takes_a_layer_at_long_chunks_and_less_at_short_ones():
    """32 blobs and one more per 32 tokens of the chunk, at most a layer's experts: a 4,096-token
    chunk of a 128-expert layer streams through a whole layer (what the GPU measured best), a
    512-token one through 48 blobs; a layer of 16 experts never takes more than its 16."""
    from types import SimpleNamespace
    from strata_dist.models.common import routed_expert_buffers
    from strata_dist.plan.workspace import STREAMED

    def blobs(n_expert, n_tokens, blob=2_654_208):
        g = SimpleNamespace(n_embd=2048, n_ff_exp=768, n_expert_used=8, n_expert=n_expert)
        (stream,) = [b for b in routed_expert_buffers(g, blob) if b.name == STREAMED]
        return stream.nbytes(n_tokens) / blob

    assert blobs(128, 4096) == pytest.approx(128, abs=0.01)
    assert blobs(128, 8192) == pytest.approx(128, abs=0.01)
    assert blobs(128, 512) == pytest.approx(48, abs=0.01)
    assert blobs(128, 0) == pytest.approx(32, abs=0.01)
    assert blobs(512, 4096) == pytest.approx(160, abs=0.01)
    assert blobs(16, 4096) == pytest.approx(16, abs=0.01)
