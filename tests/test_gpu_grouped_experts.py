"""The grouped decode gate/up (kernels/experts_grouped.cuh, KernelShape grouped_experts) on the GPU:
its act rows, and h after the (unchanged) down, BIT-IDENTICAL to moe_gate_up_<type>'s of the
default build, for every weight type family the decode experts read, 1, 3 and MAX_ROWS (8) rows
whose experts are shared; the groups moe_group_pairs writes equal kernels/abi.py group_pairs'; and
a decode graph built grouped gives every row of a batched step the logits of the default build's
same step, bit for bit, and each session its greedy tokens alone. A 16-stream step is two replays
of MAX_ROWS rows (backends/batched_decode.py), so 8 is the most rows one grouped launch takes.
Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from test_gpu_kernels import (IQ_PAIRS, INT_OFF, K, N_EMBD, N_FF, Experts,  # noqa: E402
                              _kernel, _run_experts)
from strata_dist.kernels.abi import (BLOCK_THREADS, GROUP_THREADS, MAX_ROWS,  # noqa: E402
                                     KernelShape, group_pairs, group_pairs_words)

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


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_a_grouped_graph_step_gives_each_row_the_bits_of_the_plain_one(tmp_path, monkeypatch,
                                                                       quant):
    """Eight sessions at different positions as one batched step (MAX_ROWS rows; Q8_0 experts on
    the float path, Q4_K_M's Q4_K gate/up on the integer path), 16 experts top-4 (32 pairs: shared
    experts in every layer): the grouped build's logits equal the default build's bit for bit, and
    each session's greedy token is the one it gets alone."""
    from test_gpu_decode import _model
    if quant == "q8_0":
        path = _model(tmp_path, "q8_0", seed=21)
    else:
        import dataclasses
        from strata_dist.synth import GEOMETRIES, write_synthetic
        path = tmp_path / "m-q4_k_m.gguf"
        write_synthetic(path, like=dataclasses.replace(
            GEOMETRIES["tiny"], name="tiny-k", n_layer=N_LAYERS, n_embd=256, n_head=2,
            n_head_kv=1, head_dim=128, n_ff_exp=256, n_expert=N_EXPERTS, n_expert_used=4,
            n_vocab=320), quant="q4_k_m", popularity="zipf:1.0")
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
