"""--kv-resident on a GPU (run on the GPU machine: pytest -m gpu): a session keeping the attention
sinks and a small ring of its newest cells on the card and every cell in a pinned, mapped host
copy (backends/kv_cache.py RingKV) gives the logits and greedy tokens of the same model with every
cell resident, on qwen3moe and on qwen3next (its attention layers). Decode steps run the decode
graph's `_ring` builds (kernels/attention.cuh KvRing, kernels/next_attention.cuh: cells read in
place from the host copy over PCIe), prompt chunks the general path, which reads the store by its
own index rule.

The ring is 12 cells beside the 4 sinks: a 40-token prompt in chunks of 12 (the ring holds a whole
chunk, the floor the launcher keeps), 30 one-row steps and a step of three rows (the ring wraps
several times), a rewind to an earlier prefix (the ring then holds cells of the abandoned
continuation and is refilled from the host copy before the next step), a prompt chunk read at a
depth past the ring, greedy generations with steps launched ahead, and a stage (the rank's path)
whose verify window's rejected drafts move the next graph step back inside the window. qwen3next
moves back to a checkpoint (its recurrent state is not positional). The tolerance is the other
GPU decode tests'. A ring's prompt chunk writes K/V by the array path
(the fused prompt kernel writes whole f16 arrays, cupy_backend.py qk_norm_rope_kv), so both
runners take it here (STRATA_FUSED_PROMPT_OPS=0): then every kernel but the ring builds is shared
and the logits are expected to agree far closer than the tolerance, no near-tie of the routing
moved by a rounding of the reference alone."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from strata_dist.backends.kv_cache import RingKV  # noqa: E402
from strata_dist.plan.pricing import KV_SINK_CELLS  # noqa: E402

RING = 12
RESIDENT = KV_SINK_CELLS + RING
CELLS = 256
CHUNK = 12
PROMPT = [int(x) for x in np.random.default_rng(47).integers(0, 320, 40)]
STEPS = 30


def _close(ref: np.ndarray, got: np.ndarray, what: str, tolerance: float = 1e-2) -> None:
    """Logits [n, vocab] (or [vocab]) of the ring's runner within the GPU decode tests'
    tolerance of every-cell-resident ones (relative to the logits' size: qwen3moe's
    tests/test_gpu_decode.py, qwen3next's 2e-3 of tests/test_gpu_next_decode.py), and the same
    greedy token on every row."""
    ref, got = np.atleast_2d(np.asarray(ref)), np.atleast_2d(np.asarray(got))
    diff = float(np.abs(got - ref).max())
    assert diff <= tolerance * max(1.0, float(np.abs(ref).max())), \
        f"{what}: max |ring - all| {diff:.3g}"
    assert np.array_equal(got.argmax(axis=1), ref.argmax(axis=1)), f"{what}: greedy tokens differ"


def _runners(path: str, attention_layer: int = 0, **kw):
    """(every cell resident, RESIDENT cells resident) on cuda:0, both taking the decode graph;
    `attention_layer`: a layer with K/V."""
    from strata_dist.tools.single_process import SingleProcessRunner
    full, ring = (SingleProcessRunner(path, "cuda:0", prompt_chunk=CHUNK, max_context=CELLS,
                                      kv_resident=n, **kw) for n in (0, RESIDENT))
    assert full.decode_graph is not None and not full.decode_graph.ring
    g = ring.decode_graph
    assert g is not None and g.ring and g.ring.split == (KV_SINK_CELLS, RING)
    assert g.attn_kernel.endswith("_ring")
    k = ring.session.k(attention_layer)
    assert isinstance(k, RingKV) and k.host_device_ptr and k.card.shape[0] == RESIDENT
    return full, ring


def _steps(full, ring, first: int, n: int, what: str, tolerance: float = 1e-2) -> int:
    """n one-row decode steps on both runners, each fed the full runner's greedy token; the token
    the last step gives."""
    tok = first
    for i in range(n):
        a = np.asarray(full.decode_step([tok]))
        _close(a, np.asarray(ring.decode_step([tok])), f"{what}, step {i}", tolerance)
        tok = int(a.argmax())
    return tok


@pytest.fixture(autouse=True)
def shared_prompt_arithmetic(monkeypatch):
    monkeypatch.setenv("STRATA_FUSED_PROMPT_OPS", "0")


@pytest.fixture(scope="module")
def qwen3moe_path(tmp_path_factory):
    """128-wide heads (the decode graph's), 2 query heads over 1 kv head, f16 weights."""
    model = tiny_qwen3moe(47, hidden=256, head_dim=128, top_k=4, n_experts=16, n_layers=3)
    return write_gguf(model, tmp_path_factory.mktemp("ringgpu") / "m.gguf", "f16")


def test_ring_decode_graph_rewind_and_prompt_at_depth_equal_every_cell_resident(qwen3moe_path):
    full, ring = _runners(qwen3moe_path)
    prompt = full.feed(PROMPT)                           # chunks of 12, 12, 12, 4: general path
    _close(prompt, ring.feed(PROMPT), "the prompt")
    tok = _steps(full, ring, int(prompt[-1].argmax()), STEPS, "decode")
    rows = [tok, 5, 6]                                   # a step of three rows
    _close(np.asarray(full.decode_step(rows)), np.asarray(ring.decode_step(rows)), "three rows")
    depth = len(PROMPT) + STEPS + 3
    assert ring.session.n_past == depth and ring.session.k(0).end == depth
    for r in (full, ring):
        assert r.decode_graph.steps == STEPS + 1

    # rewound to 50: the ring's slots hold cells 61..72 of the abandoned continuation
    for r in (full, ring):
        r.session.n_past = 50
    tok = _steps(full, ring, 77, 12, "after the rewind")
    assert ring.session.k(0).end == 62

    # a prompt chunk at a depth past the ring (the general path: 12 rows, then 8), then steps
    more = [int(x) for x in np.random.default_rng(48).integers(0, 320, 20)]
    _close(full.feed(more), ring.feed(more), "a prompt chunk at depth 62")
    _steps(full, ring, tok, 8, "after the chunk at depth")
    assert ring.session.n_past == full.session.n_past == 90
    for r in (full, ring):
        assert r.decode_graph.steps == STEPS + 1 + 12 + 8


def test_greedy_generations_with_steps_ahead_equal_every_cell_resident(qwen3moe_path):
    """stream()'s path: greedy steps launched ahead (the ring's end moved for a step not yet
    asked for), then a follow-up resumed at an earlier prefix of the session."""
    full, ring = _runners(qwen3moe_path)
    want = full.generate(PROMPT, 40)
    got = ring.generate(PROMPT, 40)
    assert got.tokens == want.tokens
    assert ring.decode_graph.ahead_taken == full.decode_graph.ahead_taken > 0
    follow = PROMPT[:30] + [9, 8, 7, 6, 5]
    want = full.generate(follow, 24, resume=True)
    got = ring.generate(follow, 24, resume=True)
    assert got.reused == want.reused == 30
    assert got.tokens == want.tokens


def test_a_stage_with_a_ring_equals_one_with_every_cell_resident(qwen3moe_path):
    """The rank's path (strata_dist/rank/stage.py): prompt chunks, graph steps, and a verify window of
    four rows (the general path, as speculative decoding runs it) whose last two drafts are
    rejected: the next graph step starts inside the window, so its ring is refilled first."""
    from strata_dist.rank.stage import Stage, StageConfig
    every = [(l, e) for l in range(3) for e in range(16)]
    full, ring = (Stage(StageConfig(qwen3moe_path, "cuda:0", 0, 3, True, True, CELLS,
                                    cache_pairs=every, kv_resident=n)) for n in (0, RESIDENT))
    assert full.decode_graph is not None and ring.decode_graph is not None
    assert ring.decode_graph.ring and not full.decode_graph.ring
    for a in range(0, len(PROMPT), CHUNK):
        last = []
        for st in (full, ring):
            st.begin_prompt()
            last.append(np.asarray(st.run(0, a, ids=PROMPT[a:a + CHUNK], prompt=True)))
            st.end_prompt()
        _close(*last, f"the prompt chunk at {a}")
    tok, pos = int(last[0].argmax()), len(PROMPT)

    def step(ids, what, **kw):
        a = np.asarray(full.run(0, pos, ids=ids, **kw))
        _close(a, np.asarray(ring.run(0, pos, ids=ids, **kw)), what)
        return a

    for i in range(20):
        tok = int(step([tok], f"step {i}").argmax())
        pos += 1
    window = step([tok, 5, 6, 7], "a verify window", all_rows=True)
    pos += 2                                   # two rows stand, the last two drafts do not
    for i in range(8):
        tok = int(step([int(window[1].argmax()) if i == 0 else tok],
                       f"step {i} after the window").argmax())
        pos += 1
    assert ring.session(0).k(0).end == pos
    for st in (full, ring):
        assert st.tiers.counters["graph_steps"] == 28

# ---- qwen3next: K/V in its attention layers only (next_attention.cuh's `_ring` builds) ---------

# the kernels' attention geometry (tests/test_gpu_next_decode.py): heads of 256, their first 64
# dims rotated, 4 query heads over 2 kv heads; 8 layers, attention in layers 3 and 7
NEXT_GEOMETRY = dict(hidden=128, head_dim=256, n_head=4, n_kv=2, n_k_heads=2, n_v_heads=4,
                     head_k_dim=32, head_v_dim=32, top_k=4, n_experts=16)
NEXT_TOLERANCE = 2e-3
NEXT_ATTENTION = 3          # its first attention layer


@pytest.fixture(scope="module")
def qwen3next_path(tmp_path_factory):
    return write_next_gguf(tiny_qwen3next(49, **NEXT_GEOMETRY),
                           tmp_path_factory.mktemp("ringnext") / "n.gguf", "q8_0")


def test_qwen3next_ring_decode_graph_and_a_resumed_checkpoint_equal_every_cell_resident(
        qwen3next_path):
    """The prompt, 30 one-row steps and a step of three rows (the ring wraps), then the session
    moved back to a checkpoint at 36 (the recurrent state restored, the K/V rows positional: the
    ring holds cells of the abandoned continuation), a prompt chunk read there and steps after."""
    from strata_dist.backends.next_decode import NextDecodeGraph
    full, ring = _runners(qwen3next_path, NEXT_ATTENTION)
    assert isinstance(ring.decode_graph, NextDecodeGraph)
    for r in (full, ring):
        r.feed(PROMPT[:36])
        assert r.checkpoints.save(r.session, 36)
    prompt = full.feed(PROMPT[36:])
    _close(prompt, ring.feed(PROMPT[36:]), "the prompt's last chunk", NEXT_TOLERANCE)
    tok = _steps(full, ring, int(prompt[-1].argmax()), STEPS, "decode", NEXT_TOLERANCE)
    rows = [tok, 5, 6]
    _close(np.asarray(full.decode_step(rows)), np.asarray(ring.decode_step(rows)), "three rows",
           NEXT_TOLERANCE)
    depth = len(PROMPT) + STEPS + 3
    assert all(ring.session.k(l).end == ring.session.v(l).end == depth
               for l in ring.session.attention_layers)
    for r in (full, ring):
        assert r.decode_graph.steps == STEPS + 1
        r.checkpoints.enter(r.session, 36)
        assert r.session.n_past == 36
    more = [int(x) for x in np.random.default_rng(50).integers(0, 320, 14)]   # 12 rows, then 2
    after = full.feed(more)
    _close(after, ring.feed(more), "a prompt chunk at the checkpoint", NEXT_TOLERANCE)
    _steps(full, ring, int(after[-1].argmax()), 10, "after the checkpoint", NEXT_TOLERANCE)
    assert ring.session.k(NEXT_ATTENTION).end == 36 + 14 + 10
    for r in (full, ring):
        assert r.decode_graph.steps == STEPS + 1 + 10


def test_qwen3next_greedy_generations_with_steps_ahead_equal_every_cell_resident(qwen3next_path):
    """stream()'s path with checkpoints every chunk: greedy steps launched ahead, then a
    follow-up that resumes at the prompt's checkpoint at 36."""
    full, ring = _runners(qwen3next_path, NEXT_ATTENTION, checkpoint_every=CHUNK)
    want = full.generate(PROMPT, 40)
    assert ring.generate(PROMPT, 40).tokens == want.tokens
    assert ring.decode_graph.ahead_taken == full.decode_graph.ahead_taken > 0
    follow = PROMPT[:38] + [9, 8, 7, 6, 5]
    want = full.generate(follow, 24, resume=True)
    got = ring.generate(follow, 24, resume=True)
    assert got.reused == want.reused == 36
    assert got.tokens == want.tokens
