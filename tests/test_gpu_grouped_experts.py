"""The grouped decode gate/up (kernels/experts_grouped.cuh, KernelShape grouped_experts) on the GPU:
its act rows, and h after the (unchanged) down, BIT-IDENTICAL to moe_gate_up_<type>'s of the
default build, for every weight type family the decode experts read, 1, 3 and MAX_ROWS (8) rows
whose experts are shared; the groups moe_group_pairs writes equal kernels/grouped_model.py group_pairs'; and
a decode graph built grouped gives every row of a batched step the logits of the default build's
same step, bit for bit, and each session its greedy tokens alone. A 16-stream step is two replays
of MAX_ROWS rows (backends/batched_decode.py), so 8 is the most rows one grouped launch takes.
The grouped down (kernels/experts_grouped_down.cuh, KernelShape grouped_down; written on
2026-12-06, not yet run on a GPU): each pair's partial within 1e-4 of float64 and the bits it has
in an item of its own, h the combine's model (kernels/grouped_model.py down_combine) bit for bit and each
row's the bits of its own step; NaN for an expert not resident; and a graph built with it gives a
session the same logits bits whoever shares its step. Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from test_gpu_kernels import (IQ_PAIRS, INT_OFF, K, N_EMBD, N_FF, Experts,  # noqa: E402
                              _kernel, _run_experts)
from strata_dist.kernels.abi import (BLOCK_THREADS, GROUP_THREADS, MAX_ROWS,  # noqa: E402
                                     KernelShape, group_pairs_words)
from strata_dist.kernels.grouped_model import group_pairs  # noqa: E402

GROUPED = "grouped_experts=1"
# the grouped build's paths: items of 2 (the default), 4 and 1 pairs; the integer path staged;
# the integer types on the float path
SHAPES = [GROUPED, GROUPED + ",expert_group_rows=4", GROUPED + ",expert_group_rows=1",
          GROUPED + ",int_direct=0", GROUPED + "," + INT_OFF]
TYPE_PAIRS = [(QT.F32, QT.F32), (QT.F16, QT.F16), (QT.Q8_0, QT.Q8_0), (QT.Q4_K, QT.Q6_K),
              (QT.Q5_K, QT.Q5_K), (QT.Q6_K, QT.Q6_K), (QT.Q3_K, QT.Q3_K), (QT.Q2_K, QT.Q2_K),
              *IQ_PAIRS]


def _shared_ids(rng, n: int) -> np.ndarray:
    """ids [n, K] drawn from few experts (rows share most of theirs; expert 0 in every row), each
    row's K distinct."""
    rows = []
    for _ in range(n):
        rest = rng.choice(np.arange(1, 7), K - 1, replace=False)
        rows.append(rng.permutation(np.concatenate([[0], rest])))
    return np.stack(rows).astype(np.int32)


def _run_grouped(ex, shape: KernelShape, x, ids, wts, h0):
    """(act, h, groups) of the grouped build: moe_group_pairs, moe_gate_up_grouped_<type>, then
    moe_down_<type>, grids as ops/moe.py graph_experts sizes them."""
    n = x.shape[0]
    blobs = cp.asarray(cp.asnumpy(ex.blob_of)[ids])
    act = cp.zeros((n, K, N_FF), cp.float32)
    h = cp.asarray(h0)
    groups = cp.full(group_pairs_words(K), -7, cp.int32)     # stale words the kernel must ignore
    ff, out = shape.gate_up_block(ex.gate_up_type), shape.down_block(ex.down_type)
    _kernel("moe_group_pairs", shape)((1,), (GROUP_THREADS,),
                                      (ex.spec, cp.asarray(ids), np.int32(n), groups))
    _kernel(f"moe_gate_up_grouped_{ex.types[0]}", shape)(
        ((N_FF + ff - 1) // ff, n * K), (BLOCK_THREADS,),
        (ex.spec, cp.asarray(x), blobs, groups, act))
    _kernel(f"moe_down_{ex.types[1]}", shape)(
        ((N_EMBD + out - 1) // out, n), (BLOCK_THREADS,),
        (ex.spec, act, blobs, cp.asarray(wts), h))
    return act, h, cp.asnumpy(groups)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(cp.asnumpy(a)).view(np.uint32)


@pytest.mark.parametrize("gate_up,down", TYPE_PAIRS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_gate_up_gives_the_bits_of_each_row_alone(gate_up, down, n, shape):
    import dataclasses
    grouped = KernelShape.parse(shape)
    # the same build without the switch: today's kernels, compiled without experts_grouped.cuh's
    plain = dataclasses.replace(grouped, grouped_experts=0,
                                expert_group_rows=KernelShape().expert_group_rows)
    ex = Experts(gate_up, down, seed=int(gate_up) * 100 + int(down))
    rng = np.random.default_rng(45 + n)
    x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    ids = _shared_ids(rng, n)
    wts = rng.random((n, K)).astype(np.float32)
    h0 = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    act, h, groups = _run_grouped(ex, grouped, x, ids, wts, h0)
    want_groups = group_pairs(ids, grouped.expert_group_rows)
    pairs = n * K
    np.testing.assert_array_equal(groups[:2 * pairs], want_groups[:2 * pairs])
    at = 2 * MAX_ROWS * K
    np.testing.assert_array_equal(groups[at:at + pairs], want_groups[at:at + pairs])
    # the same step through today's kernels (the build without the switch), and each row alone
    act0, h0_out = _run_experts(ex, plain, x, ids, wts, h0)
    np.testing.assert_array_equal(_bits(act), _bits(act0))
    np.testing.assert_array_equal(_bits(h), _bits(h0_out))
    for i in range(n):
        a1, h1 = _run_experts(ex, plain, x[i:i + 1], ids[i:i + 1], wts[i:i + 1], h0[i:i + 1])
        np.testing.assert_array_equal(_bits(act)[i], _bits(a1)[0])
        np.testing.assert_array_equal(_bits(h)[i], _bits(h1)[0])


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_a_missing_expert_and_a_row_of_no_expert_read_as_nan_grouped(qtype):
    """Blob address 0 (not resident) for a shared expert and a row whose router picked nothing
    (id -1, blob 0): NaN act rows, as moe_gate_up_<type> writes them, the rest bit-identical."""
    shape = KernelShape.parse(GROUPED)
    ex = Experts(qtype, qtype, seed=9)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, N_EMBD)).astype(np.float32)
    ids = np.array([[0, 1, 2, 3], [1, 0, 4, 5], [-1, 1, 2, 6]], dtype=np.int32)
    table = cp.asnumpy(ex.blob_of).copy()
    table[1] = 0                                   # expert 1 not resident
    blob_of = np.append(table, np.uint64(0))       # id -1 reads the last entry: 0
    blobs = cp.asarray(blob_of[ids])
    acts = []
    for name, s in ((f"moe_gate_up_grouped_{ex.types[0]}", shape),
                    (f"moe_gate_up_{ex.types[0]}", KernelShape())):
        act = cp.zeros((3, K, N_FF), cp.float32)
        ff = s.gate_up_block(ex.gate_up_type)
        if "grouped" in name:
            groups = cp.zeros(group_pairs_words(K), cp.int32)
            _kernel("moe_group_pairs", s)((1,), (GROUP_THREADS,),
                                          (ex.spec, cp.asarray(ids), np.int32(3), groups))
            _kernel(name, s)(((N_FF + ff - 1) // ff, 3 * K), (BLOCK_THREADS,),
                             (ex.spec, cp.asarray(x), blobs, groups, act))
        else:
            _kernel(name, s)(((N_FF + ff - 1) // ff, K, 3), (BLOCK_THREADS,),
                             (ex.spec, cp.asarray(x), blobs, act))
        acts.append(cp.asnumpy(act))
    grouped, plain = acts
    missing = (ids == 1) | (ids == -1)
    assert np.isnan(grouped[missing]).all() and np.isfinite(grouped[~missing]).all()
    np.testing.assert_array_equal(grouped.view(np.uint32), plain.view(np.uint32))


N_LAYERS, N_EXPERTS, CTX = 3, 16, 512
LENGTHS = (5, 260, 17, 1, 64, 33, 129, 9)
STEPS = 3


def _stages(path):
    from strata_dist.rank.stage import Stage, StageConfig
    st = Stage(StageConfig(path, "cuda:0", 0, N_LAYERS, True, True, CTX,
                           cache_pairs=[(l, e) for l in range(N_LAYERS)
                                        for e in range(N_EXPERTS)]))
    assert st.decode_graph is not None
    return st


def _batched(path, prompts, tokens, order):
    st = _stages(path)
    for sid in order:
        st.run(sid, 0, ids=prompts[sid], prompt=True)
    out = []
    for step in range(STEPS):
        pos = [LENGTHS[sid] + step for sid in order]
        out.append(np.asarray(st.run_batch(order, pos, ids=[tokens[sid][step] for sid in order]),
                              dtype=np.float32).copy())
    return st, out


def _file(tmp_path, quant: str):
    """A 3-layer file of 16 experts top-4: Q8_0 (experts on the float path) or Q4_K_M (Q4_K
    gate/up and Q6_K / Q4_K down on the integer path)."""
    from test_gpu_decode import _model
    if quant == "q8_0":
        return _model(tmp_path, "q8_0", seed=21)
    import dataclasses
    from strata_dist.synth import GEOMETRIES, write_synthetic
    path = tmp_path / "m-q4_k_m.gguf"
    write_synthetic(path, like=dataclasses.replace(
        GEOMETRIES["tiny"], name="tiny-k", n_layer=N_LAYERS, n_embd=256, n_head=2,
        n_head_kv=1, head_dim=128, n_ff_exp=256, n_expert=N_EXPERTS, n_expert_used=4,
        n_vocab=320), quant="q4_k_m", popularity="zipf:1.0")
    return path


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_a_grouped_graph_step_gives_each_row_the_bits_of_the_plain_one(tmp_path, monkeypatch,
                                                                       quant):
    """Eight sessions at different positions as one batched step (MAX_ROWS rows; Q8_0 experts on
    the float path, Q4_K_M's Q4_K gate/up on the integer path), 16 experts top-4 (32 pairs: shared
    experts in every layer): the grouped build's logits equal the default build's bit for bit, and
    each session's greedy token is the one it gets alone."""
    path = _file(tmp_path, quant)
    rng = np.random.default_rng(8)
    prompts = [[int(x) for x in rng.integers(0, 320, n)] for n in LENGTHS]
    tokens = rng.integers(0, 320, (len(LENGTHS), STEPS)).tolist()
    order = [7, 1, 4, 0, 6, 2, 5, 3]
    monkeypatch.delenv("STRATA_KERNEL_SHAPE", raising=False)
    _, plain = _batched(path, prompts, tokens, order)
    monkeypatch.setenv("STRATA_KERNEL_SHAPE", GROUPED)
    st, grouped = _batched(path, prompts, tokens, order)
    assert st.decode_graph.shape.grouped_experts == 1
    for a, b in zip(grouped, plain):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    # each session alone (one-row steps: today's gate/up even in the grouped build)
    alone = _stages(path)
    for row, sid in enumerate(order):
        alone.run(sid, 0, ids=prompts[sid], prompt=True)
        for step in range(STEPS):
            ref = np.asarray(alone.run(sid, LENGTHS[sid] + step, ids=[tokens[sid][step]]),
                             dtype=np.float32)
            assert int(np.argmax(grouped[step][row])) == int(np.argmax(ref)), (sid, step)


# ---- the grouped down (KernelShape grouped_down, kernels/experts_grouped_down.cuh) ---------------
GROUPED_DOWN = GROUPED + ",grouped_down=1"
# items of 2 (the default), 4 and 1 pairs; 8 outputs a float-path block (passes of 2 of an item's
# 4 pairs); the integer types on the float path
DOWN_SHAPES = [GROUPED_DOWN, GROUPED_DOWN + ",expert_group_rows=4",
               GROUPED_DOWN + ",expert_group_rows=1",
               GROUPED_DOWN + ",expert_group_rows=4,down_per_block=8",
               GROUPED_DOWN + "," + INT_OFF]


def _groups_alone(n: int) -> np.ndarray:
    """A groups buffer that puts each of n * K pairs in an item of its own (p, 1), pairs in order:
    the per-pair reference grouping."""
    buf = np.zeros(group_pairs_words(K), np.int32)
    items = buf[:2 * MAX_ROWS * K].reshape(-1, 2)
    items[:n * K, 0], items[:n * K, 1] = np.arange(n * K), 1
    buf[2 * MAX_ROWS * K:2 * MAX_ROWS * K + n * K] = np.arange(n * K)
    return buf


def _run_down(ex, shape: KernelShape, act, ids, wts, h0, groups, blob_of=None):
    """(partials [n * K, N_EMBD], h) of moe_down_grouped_<type> over the items of `groups` then
    moe_down_combine, grids as ops/moe.py graph_experts sizes them; stale partials past the step
    are NaN (the combine must not read them)."""
    from strata_dist.kernels.abi import down_partial_floats
    n = ids.shape[0]
    table = cp.asnumpy(ex.blob_of) if blob_of is None else blob_of
    blobs = cp.asarray(table[ids])
    partial = cp.full(down_partial_floats(K, N_EMBD), np.nan, cp.float32)
    h = cp.asarray(h0)
    out = shape.down_block(ex.down_type)
    _kernel(f"moe_down_grouped_{ex.types[1]}", shape)(
        ((N_EMBD + out - 1) // out, n * K), (BLOCK_THREADS,),
        (ex.spec, cp.asarray(act), blobs, cp.asarray(wts), cp.asarray(groups), partial))
    _kernel("moe_down_combine", shape)(((N_EMBD + BLOCK_THREADS - 1) // BLOCK_THREADS, n),
                                       (BLOCK_THREADS,), (ex.spec, partial, h))
    return cp.asnumpy(partial).reshape(-1, N_EMBD)[:n * K], cp.asnumpy(h)


@pytest.mark.parametrize("gate_up,down", TYPE_PAIRS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("shape", DOWN_SHAPES)
def test_grouped_down_gives_each_pair_its_own_sum_in_any_item(gate_up, down, n, shape):
    """Rows sharing most experts (every item of moe_group_pairs' grouping full where it can be):
    each pair's partial is wts * (down_e . act) within 1e-4 of float64, the same bits as with
    every pair in an item of its own, h is kernels/grouped_model.py down_combine of the partials bit for
    bit, and each row's h is the bits it gets as a step of its own (its pairs grouped alone)."""
    from strata_dist.kernels.grouped_model import down_combine
    shape = KernelShape.parse(shape)
    ex = Experts(gate_up, down, seed=int(gate_up) * 100 + int(down))
    rng = np.random.default_rng(46 + n)
    x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    ids = _shared_ids(rng, n)
    wts = rng.random((n, K)).astype(np.float32)
    h0 = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    act, _, groups = _run_grouped(ex, shape, x, ids, wts, h0)
    act = cp.asnumpy(act)
    partial, h = _run_down(ex, shape, act, ids, wts, h0, groups)
    flat = ids.ravel()
    want = np.stack([wts.ravel()[p] * (ex.ref[flat[p]][2].astype(np.float64)
                                       @ act.reshape(n * K, N_FF)[p].astype(np.float64))
                     for p in range(n * K)])
    np.testing.assert_allclose(partial, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    alone_p, alone_h = _run_down(ex, shape, act, ids, wts, h0, _groups_alone(n))
    np.testing.assert_array_equal(partial.view(np.uint32), alone_p.view(np.uint32))
    np.testing.assert_array_equal(h.view(np.uint32), alone_h.view(np.uint32))
    np.testing.assert_array_equal(h.view(np.uint32), down_combine(partial, K, h0).view(np.uint32))
    for i in range(n):
        _, h1 = _run_down(ex, shape, act[i:i + 1], ids[i:i + 1], wts[i:i + 1], h0[i:i + 1],
                          group_pairs(ids[i:i + 1], shape.expert_group_rows))
        np.testing.assert_array_equal(h.view(np.uint32)[i], h1.view(np.uint32)[0])


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.IQ4_XS], ids=lambda t: t.name)
def test_a_missing_expert_and_a_row_of_no_expert_give_nan_partials(qtype):
    """Blob address 0 (expert 1 not resident) and a pair whose router picked nothing (id -1):
    their partials are NaN and so is h of their rows, every other partial finite and the bits
    it has with every pair alone."""
    shape = KernelShape.parse(GROUPED_DOWN)
    ex = Experts(qtype, qtype, seed=9)
    rng = np.random.default_rng(4)
    ids = np.array([[0, 1, 2, 3], [2, 0, 4, 5], [-1, 0, 2, 6]], dtype=np.int32)
    act = rng.standard_normal((3, K, N_FF)).astype(np.float32)
    wts = rng.random((3, K)).astype(np.float32)
    h0 = rng.standard_normal((3, N_EMBD)).astype(np.float32)
    table = cp.asnumpy(ex.blob_of).copy()
    table[1] = 0
    table = np.append(table, np.uint64(0))           # id -1 reads the last entry: 0
    groups = group_pairs(ids, shape.expert_group_rows)
    partial, h = _run_down(ex, shape, act, ids, wts, h0, groups, table)
    alone_p, _ = _run_down(ex, shape, act, ids, wts, h0, _groups_alone(3), table)
    missing = ((ids == 1) | (ids == -1)).ravel()
    assert np.isnan(partial[missing]).all() and np.isfinite(partial[~missing]).all()
    np.testing.assert_array_equal(partial.view(np.uint32), alone_p.view(np.uint32))
    assert np.isnan(h[0]).all() and np.isnan(h[2]).all() and np.isfinite(h[1]).all()


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_a_grouped_down_graph_gives_a_session_the_same_bits_whoever_shares_its_step(
        tmp_path, monkeypatch, quant):
    """Built grouped_experts=1,grouped_down=1: eight sessions as one batched step, and five of them
    in another order as another (both through the 8-row matvec builds; the experts' grouping
    differs: other rows, other leaders, other items), give each of the five the same logits, bit
    for bit, every step; and one-row steps (the grouped down too, the one-row matvecs) the same
    greedy tokens."""
    path = _file(tmp_path, quant)
    rng = np.random.default_rng(8)
    prompts = [[int(x) for x in rng.integers(0, 320, n)] for n in LENGTHS]
    tokens = rng.integers(0, 320, (len(LENGTHS), STEPS)).tolist()
    monkeypatch.setenv("STRATA_KERNEL_SHAPE", GROUPED_DOWN)
    full, part = [7, 1, 4, 0, 6, 2, 5, 3], [5, 0, 7, 2, 1]
    st, a = _batched(path, prompts, tokens, full)
    assert st.decode_graph.shape.grouped_down == 1
    assert st.decode_graph.down_partial is not None
    _, b = _batched(path, prompts, tokens, part)
    for step in range(STEPS):
        for row, sid in enumerate(part):
            np.testing.assert_array_equal(b[step][row].view(np.uint32),
                                          a[step][full.index(sid)].view(np.uint32),
                                          err_msg=f"session {sid} step {step}")
    alone = _stages(path)
    for row, sid in enumerate(full):
        alone.run(sid, 0, ids=prompts[sid], prompt=True)
        for step in range(STEPS):
            ref = np.asarray(alone.run(sid, LENGTHS[sid] + step, ids=[tokens[sid][step]]),
                             dtype=np.float32)
            assert int(np.argmax(a[step][row])) == int(np.argmax(ref)), (sid, step)


def test_the_default_build_allocates_no_partials(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_KERNEL_SHAPE", raising=False)
    st = _stages(_file(tmp_path, "q8_0"))
    assert st.decode_graph.shape.grouped_down == 0 and st.decode_graph.down_partial is None
