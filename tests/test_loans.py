"""Per-stage prompt loans: a prompt borrows the tail of its own stage's cache, streams the
chunk's missing experts through it, and refills it afterwards — into its own cache, marking only
its own layers' pairs. Tokens are those of a run that never lent."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.rank.stage import Stage, StageConfig

CHUNK = 16
N_LAYERS, N_EXPERTS, TOP_K = 8, 64, 2
PROMPT = [int(x) for x in np.random.default_rng(9).integers(0, 320, 70)]   # 5 chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 64 experts a layer: a stage of 4 layers caches 256 pairs, enough above the 128-slot floor
    # to lend a chunk's buffers (their stream buffer alone holds a layer's 64 blobs)
    return write_gguf(tiny_qwen3moe(17, hidden=64, top_k=TOP_K, n_experts=N_EXPERTS,
                                    n_layers=N_LAYERS),
                      tmp_path_factory.mktemp("loans") / "m.gguf", "q8_0")


@pytest.fixture(scope="module")
def baseline(model):
    return SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 32).tokens


def test_lend_and_refill_keep_the_tokens(model, baseline):
    # caches of 240 of a stage's 256 pairs (the loan takes about 70 of them, the floor keeps
    # 128): the chunks have misses to stream through the loan
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "4", "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given", "--no-remote-auto",
                     env={"STRATA_STAGE_CACHE_SLOTS": "240"})
    try:
        loans = [int(f["loan_mib"].replace(".", "") or 0) for f in s.info_fields() if "rank" in f]
        assert all(x > 0 for x in loans), s.info   # every stage lends
        out = s.gen(PROMPT, 32, "stats=1")
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        for r in s.stats().values():
            assert int(r["loans"]) == 1 and int(r["refilled_slots"]) > 0, r
            assert int(r["streamed"]) > 0, r
        # decode after the refill reads the refilled slots: a wrong refill would change tokens
        again = s.gen(PROMPT[:40], 32)
        fresh = SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=512).generate(PROMPT[:40], 32)
        assert again["tokens"] == fresh.tokens
    finally:
        assert s.close() == 0



def test_a_stage_holding_every_pair_lends_nothing(model, baseline):
    """A budget that caches every pair of a stage's layers: its prompt buffers take the room its
    cache leaves (plan/lend.py), so no stage lends, nothing is streamed or refilled, and the
    tokens are the same."""
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "4", "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given", "--no-remote-auto")
    try:
        stages = [f for f in s.info_fields() if "rank" in f]
        assert len(stages) == 2 and all(float(f["loan_mib"]) == 0 for f in stages), s.info
        assert int(s.info_fields()[0]["expert_slots_stages"]) == N_LAYERS * N_EXPERTS, s.info
        out = s.gen(PROMPT, 32, "stats=1")
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        for r in s.stats().values():
            assert int(r.get("loans", 0)) == 0 and int(r.get("streamed", 0)) == 0, r
    finally:
        assert s.close() == 0

def test_second_turn_equals_a_fresh_read_of_the_conversation(model):
    first_turn = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "4", "--prefill",
                              str(CHUNK), "--max-context", "512", "--no-remote-auto")
    try:
        a = first_turn.gen(PROMPT, 8)
        convo = PROMPT + a["tokens"] + [11, 12, 13, 14, 15]
        b = first_turn.gen(convo, 16)
        assert b["resume"] > 0
    finally:
        first_turn.close()
    fresh = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "4", "--prefill", str(CHUNK),
                         "--max-context", "512", "--no-remote-auto")
    try:
        c = fresh.gen(convo, 16)
        assert c["resume"] == 0
        assert b["tokens"] == c["tokens"]
    finally:
        fresh.close()


def test_refill_touches_only_its_own_cache_and_layers(model):
    gguf = GGUFModel(model)
    lb, le = 4, 8
    pairs = [(l, e) for l in range(lb, le) for e in range(N_EXPERTS)]
    stage = Stage(StageConfig(model, "cpu", lb, le, False, True, 256, cache_pairs=pairs,
                              loan_slots=40))
    arena = stage.cache
    before = arena.slot_of.copy()
    stage.begin_prompt()
    assert len(arena.lent) == 40 and arena.loan_bytes > 0
    lent_pairs = {arena.pairs[i] for i in arena.lent}
    assert all(arena.slot_of[l, e] == -1 for l, e in lent_pairs)
    x = np.random.default_rng(1).standard_normal((CHUNK, 64)).astype(np.float32)
    stage.run(0, 0, hidden=x, prompt=True)       # streams the chunk's misses through the loan
    assert stage.tiers.counters["streamed"] > 0
    stage.end_prompt()
    np.testing.assert_array_equal(arena.slot_of, before)        # the same pairs, the same slots
    assert (arena.slot_of[:lb] == -1).all() and (arena.slot_of[le:] == -1).all()
    for i, (l, e) in enumerate(arena.pairs):                   # each slot holds its own pair
        np.testing.assert_array_equal(arena.blob(l, e), gguf.expert_blob(l, e))
        assert arena.slot_of[l, e] == i
