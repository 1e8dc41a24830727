"""Checkpoints of recurrent (qwen3next) sessions: a conversation resumes from a checkpoint, each
stage saving and restoring only its own part, and resumes only at a position every stage holds.

Real rank processes (CPU) for the conversation tests: RESUME > 0 over 2 and 3 stages, a follow-up
equal to a fresh read at the same chunk boundaries, a regenerate, a prompt that diverges mid-way
(resumed at the longest usable checkpoint before the divergence), and the single-process SingleProcessRunner
following the same rule turn by turn. In process: the rules, the bytes, an incomplete set (one
stage's part dropped, or not allocated) is not used, and a stage refuses another stage's part."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe
from hf_fixtures import write_gguf as write_moe_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf
from launch_helpers import ServeSession
from launcher.cli import main as launch_main
from strata_dist.checkpoints import (MAX_PER_SESSION, CheckpointStore, chunk_positions,
                                     common_positions, request_positions, resume_point)
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.models.shape import model_shape
from strata_dist.models.qwen3next import RecurrentRewindError
from strata_dist.plan.pricing import session_parts
from strata_dist.rank.stage import Stage, StageConfig

CHUNK = 16
CTX = 256
VOCAB = 320
N_NEW = 8
PROMPT = [int(x) for x in np.random.default_rng(21).integers(0, VOCAB, 40)]   # 16 + 16 + 8


def _ids(seed, n, avoid=None):
    ids = [int(x) for x in np.random.default_rng(seed).integers(0, VOCAB, n)]
    if avoid is not None and ids[0] == avoid:
        ids[0] = (ids[0] + 1) % VOCAB
    return ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """8 layers, attention at 3 and 7: [0, 3) is linear only, [3, 4) attention only."""
    return write_gguf(tiny_qwen3next(4, hidden=64, top_k=2),
                      tmp_path_factory.mktemp("ckpt") / "next.gguf", "f32")


# ---- the rules ------------------------------------------------------------------------------------

def test_request_positions_are_chunk_boundaries():
    # from 0: mid-prompt at the first chunk end past each multiple of 16, and the prompt's end
    assert request_positions(0, 40, 16, 16) == [16, 32, 40]
    assert request_positions(0, 40, 16, 0) == [40]
    # the start (the end of the previous request) when > 0; chunk ends counted from it
    assert request_positions(47, 51, 16, 16) == [47, 51]
    assert request_positions(10, 80, 16, 32) == [10, 42, 74, 80]   # 32 in (26, 42], 64 in (58, 74]
    assert request_positions(5, 5 + 16 * 3, 16, 2048) == [5, 53]
    for start, total, chunk, every in [(0, 100, 7, 10), (13, 200, 16, 32), (3, 4, 16, 1)]:
        bounds = set(range(start, total, chunk)) | {total}
        assert set(request_positions(start, total, chunk, every)) <= bounds
    # each chunk carries the boundaries it ends at, and the first chunk its start too
    at = [47, 51]
    assert chunk_positions(at, 47, 4, first=True) == [47, 51]
    assert chunk_positions([16, 32, 40], 16, 16, first=False) == [32]


def test_resume_point_and_common_positions():
    assert resume_point(50, 58, [32, 40, 47, 51]) == 47     # the longest usable <= 50
    assert resume_point(36, 58, [32, 40, 47, 51]) == 32     # not 36 itself
    assert resume_point(20, 58, [32, 40]) == 0              # nothing before: read afresh
    assert resume_point(60, 58, [32]) == 58                 # the live end
    assert resume_point(36, 58, None) == 36                 # positional: anywhere
    assert common_positions(None, None) is None
    assert common_positions(None, [4, 8]) == [4, 8]
    assert common_positions([4, 8], None) == [4, 8]         # a positional stage adds no constraint
    assert common_positions([4, 8, 12], [8, 12, 16]) == [8, 12]


# ---- in process: stages --------------------------------------------------------------------------

def _stages(path, bounds):
    return [Stage(StageConfig(path, "cpu", lb, le, lb == 0, le == 8, CTX)) for lb, le in bounds]


def _request(stages, pos, ids, every=CHUNK):
    """What the head and the ranks do for one prompt, in process: chunks through every stage with
    their checkpoint positions; returns the last row's logits and what every stage holds."""
    at = request_positions(pos, pos + len(ids), CHUNK, every)
    for i in range(0, len(ids), CHUNK):
        part, p = ids[i:i + CHUNK], pos + i
        mine = chunk_positions(at, p, len(part), first=i == 0)
        h = None
        for st in stages:
            h = st.run(0, p, ids=part if st.cfg.first else None, hidden=h, prompt=True,
                       checkpoint_at=mine)
    return h, _held(stages)


def _held(stages):
    held = None
    for st in stages:          # as the ranks merge it on the way down
        held = common_positions(held, st.checkpoint_positions(0))
    return held


def test_incomplete_set_is_not_used(model):
    stages = _stages(model, [(0, 3), (3, 4), (4, 8)])
    _, held = _request(stages, 0, PROMPT + _ids(3, 8))              # 48 tokens
    assert held == [16, 32, 48]
    assert stages[1].checkpoint_positions(0) is None               # attention only: positional
    stages[2].checkpoint_store(0).drop(32)                          # one stage's part is gone
    held = _held(stages)
    assert held == [16, 48]
    other = PROMPT[:36] + _ids(4, 12, avoid=PROMPT[36])
    start = resume_point(36, 48, held)
    assert start == 16                                              # not 32: its set is incomplete
    with pytest.raises(RecurrentRewindError):                       # and no stage guesses
        stages[2].run(0, 32, hidden=np.zeros((1, 64), np.float32))
    logits, _ = _request(stages, start, other[start:])
    fresh = SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX)
    assert np.array_equal(logits, fresh.prefill(other))


def test_a_part_that_cannot_be_allocated_makes_the_set_incomplete(model, monkeypatch):
    stages = _stages(model, [(0, 3), (3, 8)])
    s = stages[1].session(0)
    real = s.save

    def save(pos):
        if pos == 32:
            raise MemoryError("out of memory allocating the copy")
        return real(pos)

    monkeypatch.setattr(s, "save", save)
    _, held = _request(stages, 0, PROMPT)
    assert stages[0].checkpoint_positions(0) == [16, 32, 40]
    assert stages[1].checkpoint_store(0).failed == 1
    assert held == [16, 40]


def test_a_stage_refuses_another_stages_part(model):
    a, b = _stages(model, [(0, 3), (4, 8)])
    a.run(0, 0, ids=PROMPT[:16], checkpoint_at=[16])
    b.run(0, 0, hidden=np.ones((16, 64), np.float32), checkpoint_at=[16])
    part_a = a.checkpoint_store(0)._by_pos[16]
    assert (part_a.lb, part_a.le, part_a.layers) == (0, 3, [0, 1, 2])
    with pytest.raises(ValueError, match=r"\[0, 3\).*cannot be restored into the session of \[4, 8\)"):
        b.session(0).restore(part_a)
    # same range, another model object: accepted, and puts back exactly what was saved
    sess = a.session(0)
    saved = {l: sess.recurrent_state(l).copy() for l in sess.linear_layers}
    a.run(0, 16, ids=PROMPT[16:20])
    assert not np.array_equal(sess.recurrent_state(0), saved[0])
    a.checkpoint_store(0).enter(sess, 16)
    assert sess.n_past == 16 and a.checkpoint_store(0).restores == 1
    assert all(np.array_equal(sess.recurrent_state(l), saved[l]) for l in sess.linear_layers)
    with pytest.raises(ValueError, match="is at 16"):
        sess.save(12)
    a.release(0)                                   # its bytes go, the rank's totals stay
    assert a.checkpoint_bytes() == 0
    assert a.checkpoint_counters() == {"checkpoint_saves": 1, "checkpoint_restores": 1,
                                       "checkpoint_failed": 0}


def test_checkpoint_bytes_are_bounded_and_known(model):
    shape = model_shape(GGUFModel(model), "cpu")
    for lb, le in [(0, 3), (3, 4), (4, 8), (0, 8)]:
        st = Stage(StageConfig(model, "cpu", lb, le, lb == 0, le == 8, CTX))
        one = session_parts(shape, CTX, lb, le)["recurrent"]
        assert st.checkpoint_bound_bytes() == MAX_PER_SESSION * one
        if one == 0:
            assert st.checkpoint_positions(0) is None
            continue
        ids = _ids(lb, 6 * 4)
        h = None if lb == 0 else np.zeros((4, 64), np.float32)
        for i in range(6):                     # six checkpoints asked, the 4 newest kept
            st.run(0, 4 * i, ids=ids[4 * i:4 * i + 4] if lb == 0 else None, hidden=h,
                   checkpoint_at=[4 * i + 4])
        assert st.checkpoint_positions(0) == [12, 16, 20, 24]
        assert st.checkpoint_bytes() == 4 * one <= st.checkpoint_bound_bytes()
        st.run(0, 16, ids=ids[16:20] if lb == 0 else None, hidden=h)   # reading at 16 ...
        assert st.checkpoint_positions(0) == [12, 16]                  # drops what lies past it


def test_store_of_a_positional_session_moves_anywhere():
    class KV:
        n_past = 30

        def reset(self, n):
            self.n_past = n

    s, store = KV(), CheckpointStore()
    store.enter(s, 7)
    assert s.n_past == 7 and store.held(s) is None and store.save(s, 7) is False


def test_engine_resumes_by_the_same_rule(model):
    eng = SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX, checkpoint_every=CHUNK)
    first = eng.generate(PROMPT, N_NEW, resume=True)
    assert eng.checkpoints.positions() == [16, 32, 40]
    other = PROMPT[:36] + _ids(8, 20, avoid=PROMPT[36])
    again = eng.generate(other, N_NEW, resume=True)
    assert again.reused == 32
    assert again.tokens == SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX).generate(other, N_NEW).tokens
    assert first.tokens == SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX).generate(PROMPT, N_NEW).tokens


# ---- real rank processes -------------------------------------------------------------------------

def _fresh_read(path, segments, max_new):
    """Greedy tokens after reading `segments` on a fresh single-process session, each segment as
    one chunk (so the chunk boundaries are the ones given)."""
    eng = SingleProcessRunner(path, max_context=CTX, prompt_chunk=10 ** 6)
    logits = None
    for seg in segments:
        h = eng._run(seg)
        logits = eng.backend.to_host(eng.model.output_logits(h[-1:]))[0]
    out = []
    for i in range(max_new):
        out.append(int(np.argmax(logits)))
        if i + 1 < max_new:
            h = eng._run([out[-1]])
            logits = eng.backend.to_host(eng.model.output_logits(h[-1:]))[0]
    return out


def _chunks(ids, start=0):
    return [ids[i:i + CHUNK] for i in range(start, len(ids), CHUNK)]


@pytest.mark.parametrize("split", ["3", "3,4"], ids=["2-stages", "3-stages"])
def test_conversation_resumes_from_checkpoints(model, split):
    n = len(split.split(",")) + 1
    s = ServeSession(model, "--cpu-ranks", str(n), "--layer-split", split, "--prefill", str(CHUNK),
                     "--max-context", str(CTX), "--prompt-cache-every", str(CHUNK),
                     "--gpu-order", "as_given", "--vram-budget", "1G")
    turns = []
    try:
        # 1: a fresh prompt; checkpoints at 16, 32 and the prompt's end 40
        t1 = s.gen(PROMPT, N_NEW)
        # 2: a follow-up: resumes at the session's end (47 = 40 + 8 - 1), checkpointing it
        follow = PROMPT + t1["tokens"] + [7, 8, 9]
        t2 = s.gen(follow, N_NEW)
        # 3: the same prompt again (a regenerate): 50 is held by nobody, 47 is the longest usable
        t3 = s.gen(follow, N_NEW)
        # 4: diverges at 36: resumes at the checkpoint 32, not at 36 (no state there) nor 0
        other = PROMPT[:36] + _ids(5, 20, avoid=PROMPT[36])
        t4 = s.gen(other, N_NEW)
        # 5: diverges at 20, before every checkpoint still held (16 was the oldest, dropped)
        early = PROMPT[:20] + _ids(6, 10, avoid=PROMPT[20])
        t5 = s.gen(early, N_NEW)
        turns = [(PROMPT, t1), (follow, t2), (follow, t3), (other, t4), (early, t5)]
        stats = s.stats()
    finally:
        assert s.close() == 0
    for _, t in turns:
        assert t["err"] is None, t["err"]
    assert [t["resume"] for _, t in turns] == [0, 47, 47, 32, 0]
    assert [int(t["done"][1]) for _, t in turns] == [40, 4, 4, 24, 30]    # tokens read
    # the follow-up equals a fresh read of the whole conversation at the same chunk boundaries
    segments = _chunks(PROMPT) + [[t] for t in t1["tokens"][:-1]] + [follow[47:]]
    assert t2["tokens"] == _fresh_read(model, segments, N_NEW)
    assert t3["tokens"] == t2["tokens"]
    # resumed at a multiple of the chunk, the boundaries are those of a plain fresh read
    for prompt, t in [(other, t4), (early, t5)]:
        assert t["tokens"] == SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX).generate(
            prompt, N_NEW).tokens
    # the single process, resuming by the same rule, resumes at the same positions
    eng = SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=CTX, checkpoint_every=CHUNK)
    for prompt, t in turns:
        r = eng.generate(prompt, N_NEW, resume=True)
        assert (r.reused, r.tokens) == (t["resume"], t["tokens"])
    # every stage with linear layers restored its own part (turns 3 and 4); [3, 4) has none
    bounds = [0] + [int(k) for k in split.split(",")] + [8]
    for rank, (lb, le) in enumerate(zip(bounds, bounds[1:])):
        linear = any((l + 1) % 4 for l in range(lb, le))
        assert int(stats[rank]["checkpoint_restores"]) == (2 if linear else 0)
        assert (int(stats[rank]["checkpoint_saves"]) > 0) == linear


def test_qwen3moe_resumes_at_any_prefix(tmp_path):
    path = write_moe_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=4), tmp_path / "moe.gguf",
                          "f32")
    s = ServeSession(path, "--cpu-ranks", "2", "--layer-split", "2", "--prefill", str(CHUNK),
                     "--max-context", str(CTX))
    try:
        s.gen(PROMPT, 4)
        other = PROMPT[:37] + _ids(7, 5, avoid=PROMPT[37])
        out = s.gen(other, 4)
    finally:
        s.close()
    assert out["resume"] == 37                      # KV is positional: the divergence itself
    eng = SingleProcessRunner(path, prompt_chunk=CHUNK, max_context=CTX)
    eng.generate(PROMPT, 4)
    again = eng.generate(other, 4, resume=True)
    assert (again.reused, again.tokens) == (37, out["tokens"])


def test_prompt_cache_every_must_not_be_negative(model, capsys):
    assert launch_main(["--model", model, "--prompt-cache-every", "-1", "--plan-only"]) == 2
    assert "--prompt-cache-every -1" in capsys.readouterr().err
