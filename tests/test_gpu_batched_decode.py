"""Batched decode steps through the GPU decode graph (backends/batched_decode.py, decode_rows.py):
B sessions at different positions, as the rows of one graph replay (Stage.run_batch), give each
session the logits and greedy tokens it gets alone through the graph, and a one-session window of
rows still reads and writes its own cells after such steps. Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_gpu_decode import TOLERANCE, _model  # noqa: E402

N_LAYERS, N_EXPERTS, CTX = 3, 16, 512
# prompt lengths: one cell, several attention splits, and lengths between
LENGTHS = (5, 260, 17, 1, 64, 33, 129, 9)
STEPS = 3                                  # batched steps after the prompts
WINDOW = [17, 3, 250]                      # a one-session step of three rows after them


def _stages(path, split, kv_type):
    from strata_dist.rank.stage import Stage, StageConfig
    bounds = [0, *split, N_LAYERS]
    stages = [Stage(StageConfig(path, "cuda:0", lb, le, lb == 0, le == N_LAYERS, CTX,
                                cache_pairs=[(l, e) for l in range(lb, le)
                                             for e in range(N_EXPERTS)], kv_type=kv_type))
              for lb, le in zip(bounds, bounds[1:])]
    assert all(st.decode_graph is not None for st in stages)
    return stages


def _through(stages, run):
    """Rows through every stage: run(stage, rows) with ids on the first, hidden rows after."""
    out = None
    for st in stages:
        out = run(st, out)
    return out


def _fill(stages, prompts, sids):
    for sid in sids:
        _through(stages, lambda st, h: st.run(sid, 0, ids=prompts[sid] if st.cfg.first else None,
                                              hidden=h, prompt=True))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("split", [[], [2]], ids=["one-stage", "two-stages"])
def test_batched_rows_equal_each_session_alone_through_the_graph(tmp_path, kv_type, split):
    path = _model(tmp_path, "f32", seed=21)
    rng = np.random.default_rng(8)
    prompts = [[int(x) for x in rng.integers(0, 320, n)] for n in LENGTHS]
    tokens = rng.integers(0, 320, (len(LENGTHS), STEPS)).tolist()
    # each session alone: one-row graph steps (stage.run), then the window's rows one at a time
    alone_stages = _stages(path, split, kv_type)
    _fill(alone_stages, prompts, range(len(LENGTHS)))
    alone = {}
    for sid, n in enumerate(LENGTHS):
        for step, t in enumerate(tokens[sid]):
            out = _through(alone_stages, lambda st, h: st.run(
                sid, n + step, ids=[t] if st.cfg.first else None, hidden=h))
            alone[sid, step] = np.asarray(out, dtype=np.float32).copy()
    assert alone_stages[-1].tiers.counters["graph_steps"] == len(LENGTHS) * STEPS

    for order in ([6], [3, 0, 5], [7, 1, 4, 0, 6, 2, 5, 3]):    # B = 1, 3, 8, mixed slots
        stages = _stages(path, split, kv_type)
        _fill(stages, prompts, order)
        for step in range(STEPS):
            pos = [LENGTHS[sid] + step for sid in order]
            before = [st.tiers.counters["graph_steps"] for st in stages]
            got = _through(stages, lambda st, h: st.run_batch(
                order, pos, ids=[tokens[sid][step] for sid in order] if st.cfg.first else None,
                hidden=h))
            # the graph ran it (not the general path), on every stage
            assert [st.tiers.counters["graph_steps"] for st in stages] == [b + 1 for b in before]
            assert got.shape == (len(order), alone[0, 0].shape[0])
            rows = np.asarray(got)      # the last stage's rows stay on the card: copied here
            for row, sid in enumerate(order):
                ref = alone[sid, step]
                assert np.abs(rows[row] - ref).max() <= TOLERANCE["f32"], (order, sid, step)
                assert int(np.argmax(rows[row])) == int(np.argmax(ref)), (order, sid, step)
                # the greedy token reduced on the card is the one the host picks from the row
                assert got[row].greedy_token == int(np.argmax(rows[row])), (order, sid, step)
                assert not got[row].nan
        for st in stages:
            for sid in order:
                assert st.session(sid).n_past == LENGTHS[sid] + STEPS

    # a verify-like window of one session through the same descriptor, after batched steps left
    # other sessions in the table's slots: its last row equals the rows fed one at a time
    sid = order[3]
    start = LENGTHS[sid] + STEPS
    for i, t in enumerate(WINDOW):
        ref = _through(alone_stages, lambda st, h: st.run(
            sid, start + i, ids=[t] if st.cfg.first else None, hidden=h))
    ref = np.asarray(ref, dtype=np.float32)

    def window(st, h):
        s = st.session(sid)
        out = st.decode_graph.step(s, start, ids=WINDOW if st.cfg.first else None, hidden=h)
        s.n_past = start + len(WINDOW)
        return out
    got = np.asarray(_through(stages, window), dtype=np.float32)
    assert np.abs(got - ref).max() <= TOLERANCE["f32"]
    assert int(np.argmax(got)) == int(np.argmax(ref))


def test_greedy_rows_gives_numpys_argmax_facts_on_the_card():
    """sample_rows.cu greedy_rows (the batched step's greedy tokens) on rows of Qwen3's vocabulary
    with ties, NaNs and infinities, at the block width the step launches it with: numpy's argmax
    facts of each row (tests/test_sample_rows_host.py runs it on the host)."""
    from strata_dist.backends.batched_decode import GREEDY_THREADS
    from strata_dist.kernels import function
    from test_sample_rows_host import hostile_rows, numpy_facts
    rows = np.concatenate([hostile_rows(vocab=151_936, seed=1),
                           (np.random.default_rng(2).standard_normal((22, 151_936)) * 4)
                           .astype(np.float32)])
    out = cp.empty((3, len(rows)), cp.int32)
    function("sample_rows.cu", "greedy_rows")((len(rows),), (GREEDY_THREADS,),
                                              (cp.asarray(rows), np.int32(rows.shape[1]),
                                               np.int32(len(rows)), out))
    assert np.array_equal(cp.asnumpy(out), numpy_facts(rows))
