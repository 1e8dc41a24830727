"""The GPU decode path (kernels/decode.cu through backends/cuda_decode.py) against references
nobody here wrote: gguf-py's dequantizers for every block type the kernels read, numpy float32
for the whole forward. Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

from hf_fixtures import routed_by_token, tiny_qwen3moe, write_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from quant_rows import TYPES, random_rows  # noqa: E402
from strata_dist.kernels.abi import PIECE_TYPES  # noqa: E402


@pytest.mark.parametrize("qtype", TYPES[2:], ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    from strata_dist.ops.linear import QuantMatrix
    raw, ref = random_rows(qtype, 24, 512, 1)
    m = QuantMatrix(cp.asarray(raw.reshape(-1)), ref.shape, int(qtype))
    np.testing.assert_allclose(cp.asnumpy(m.dequantize()), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(cp.asnumpy(m.rows(np.array([5, 0, 23]))), ref[[5, 0, 23]],
                               rtol=1e-6, atol=1e-7)


def _matvec(raw, qtype, shape, x, norm_w=None, add=None, normed=None, wide=False, build=""):
    from strata_dist.backends import cuda_decode as cd
    from strata_dist.ops.linear import Weight
    from strata_dist.kernels.abi import (MAT_SPEC, KernelShape, matvec_block_threads,
                                         matvec_kernel, rows_per_block)
    w = Weight(int(raw.data.ptr), int(qtype), int(raw.nbytes) // shape[0], *shape)
    n = x.shape[0]
    xs = cp.zeros((8, shape[1]), cp.float32)        # the runner's buffers hold 8 rows
    xs[:n] = x
    y = cp.zeros((n, shape[0]), cp.float32) if add is None else add
    spec = cd._spec_array(MAT_SPEC, [cd._mat(w, y, add=add)])
    ks = KernelShape.parse(build)
    per_block = rows_per_block(n, wide, ks, int(qtype))
    cd.function("decode.cu", matvec_kernel(int(qtype), n), 0, ks.defines())(
        ((shape[0] + per_block - 1) // per_block, 1), (matvec_block_threads(ks, int(qtype)),), (
            spec, xs, np.int32(shape[1]), np.int32(n), np.int32(wide),
            cd.NULL if norm_w is None else norm_w, np.float32(1e-6),
            cd.NULL if normed is None else normed, cd.NULL))
    return cp.asnumpy(y)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
# the plain matvecs' variants name matvec_pieces=0: the default build takes the K quants in pieces
@pytest.mark.parametrize("build", ["", "matvec_pieces=0", "matvec_pieces=0,matvec_threads=128",
                                   "matvec_pieces=0,matvec_accs=8", "matvec_mma=1",
                                   "matvec_mma=1,mma_threads=512"])
def test_matvec_matches_numpy_and_is_batch_invariant(qtype, n, build):
    rows, cols = 203, 768      # not whole blocks of rows; 3 chunk rounds of a warp
    raw, w = random_rows(qtype, rows, cols, 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    dev = cp.asarray(raw.reshape(-1))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    # tall and short matrices (the runner's `wide`) may sum in other orders, but a row's bits do
    # not depend on how many rows shared the launch
    for wide in (False, True):
        got = _matvec(dev, qtype, (rows, cols), cp.asarray(x), wide=wide, build=build)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        alone = _matvec(dev, qtype, (rows, cols), cp.asarray(x[:1]), wide=wide, build=build)
        assert np.array_equal(alone[0], got[0])
        if "matvec_accs" in build:   # other weight rows a block: the same bits as the plain's
            assert np.array_equal(got, _matvec(dev, qtype, (rows, cols), cp.asarray(x), wide=wide,
                                               build="matvec_pieces=0"))
    # fused RMSNorm, the normed rows written out, a residual added in place
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    res = rng.standard_normal((n, rows)).astype(np.float32)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    ref = res + xn @ w.T.astype(np.float64)
    for wide in (False, True):
        normed = cp.zeros((n, cols), cp.float32)
        got = _matvec(dev, qtype, (rows, cols), cp.asarray(x), norm_w=cp.asarray(nw),
                      add=cp.asarray(res), normed=normed, wide=wide, build=build)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        np.testing.assert_allclose(cp.asnumpy(normed), xn, rtol=1e-5, atol=1e-6)
        alone = _matvec(dev, qtype, (rows, cols), cp.asarray(x[:1]), norm_w=cp.asarray(nw),
                        add=cp.asarray(res[:1]), normed=cp.zeros((1, cols), cp.float32),
                        wide=wide, build=build)
        assert np.array_equal(alone[0], got[0])     # the norm's scale: a row's own, too
        if "matvec_accs" in build:   # the norm's scale from the same sums: the plain's bits
            assert np.array_equal(got, _matvec(dev, qtype, (rows, cols), cp.asarray(x),
                                               norm_w=cp.asarray(nw), add=cp.asarray(res),
                                               normed=cp.zeros((n, cols), cp.float32), wide=wide,
                                               build="matvec_pieces=0"))


@pytest.mark.parametrize("qtype", [t for t in TYPES if int(t) in PIECE_TYPES],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 8])
def test_pieces_over_several_lane_rounds(qtype, n):
    """matvec_pieces on rows of 4,096 columns: 128 pieces a row, so each lane of a row's two warps
    takes two in turn (the 768-column test above gives a lane one at most), with the fused norm,
    its normed rows and a residual; against float64, and a row alone against the same row among
    others."""
    rows, cols = 37, 4096
    raw, w = random_rows(qtype, rows, cols, 4)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(cols)).astype(np.float32)
    res = rng.standard_normal((n, rows)).astype(np.float32)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    ref = res + xn @ w.T.astype(np.float64)
    dev = cp.asarray(raw.reshape(-1))
    normed = cp.zeros((n, cols), cp.float32)
    got = _matvec(dev, qtype, (rows, cols), cp.asarray(x), norm_w=cp.asarray(nw),
                  add=cp.asarray(res), normed=normed, wide=True)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(cp.asnumpy(normed), xn, rtol=1e-4, atol=1e-4 * np.abs(xn).max())
    alone = _matvec(dev, qtype, (rows, cols), cp.asarray(x[:1]), norm_w=cp.asarray(nw),
                    add=cp.asarray(res[:1]), normed=cp.zeros((1, cols), cp.float32), wide=True)
    assert np.array_equal(alone[0], got[0])


def _model(tmp_path, dtype, seed=7):
    model = tiny_qwen3moe(seed, hidden=256, head_dim=128, top_k=4, n_experts=16, n_layers=3)
    return write_gguf(model, tmp_path / f"m-{dtype}.gguf", dtype)


PROMPT = [int(x) for x in np.random.default_rng(11).integers(0, 320, 300)]   # 5 attention splits
NEXT = [17, 3, 250, 99, 4, 180, 61, 7]


# F16 files: the prompt (general path) rounds activations to f16 before each cuBLAS product, which
# alone moves these random models' logits by ~1e-2 (tests/test_gpu.py); the graph's own kernels
# keep activations in f32.
TOLERANCE = {"f32": 1e-2, "f16": 2e-2, "q8_0": 1e-2}


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_graph_decode_logits_match_numpy(tmp_path, dtype, f16_kv_reference,
                                        float32_prompt_kernels):
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _model(tmp_path, dtype)
    cpu, gpu = SingleProcessRunner(path, "cpu", prompt_chunk=128), SingleProcessRunner(path, "cuda:0", prompt_chunk=128)
    assert gpu.decode_graph is not None
    cpu.prefill(PROMPT)
    gpu.prefill(PROMPT)
    for t in NEXT:                             # one row per step, as decode runs
        ref = cpu.feed([t])[-1]
        got = np.asarray(gpu.decode_step([t]))
        assert np.abs(got - ref).max() <= TOLERANCE[dtype], t
    for rows in ([5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]):   # several rows in one step
        ref = cpu.feed(rows)[-1]
        got = np.asarray(gpu.decode_step(rows))
        assert np.abs(got - ref).max() <= TOLERANCE[dtype]
    assert gpu.decode_graph.steps == len(NEXT) + 2


def test_graph_decode_with_q8_0_kv_matches_numpy(tmp_path):
    """--kv-type q8_0: the graph's attention reads the session's q8_0 blocks (and its q/k kernel
    writes them) within tolerance of numpy keeping the same blocks."""
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _model(tmp_path, "q8_0", seed=14)
    cpu = SingleProcessRunner(path, "cpu", prompt_chunk=128, kv_type="q8_0")
    gpu = SingleProcessRunner(path, "cuda:0", prompt_chunk=128, kv_type="q8_0")
    assert gpu.decode_graph is not None and gpu.decode_graph.kv_suffix == "_q8"
    cpu.prefill(PROMPT)
    gpu.prefill(PROMPT)
    for t in NEXT:
        ref = cpu.feed([t])[-1]
        got = np.asarray(gpu.decode_step([t]))
        assert np.abs(got - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max()), t
    assert gpu.decode_graph.steps == len(NEXT)


def _token_routed_model(tmp_path, seed):
    """_model's geometry (top-4 of 16 experts, Q8_0) routed by a code in each token's embedding
    (hf_fixtures.routed_by_token)."""
    model = tiny_qwen3moe(seed, hidden=256, head_dim=128, top_k=4, n_experts=16, n_layers=3)
    tensors, _ = routed_by_token(model, seed)
    return write_gguf(model, tmp_path / "routed.gguf", "q8_0", tensors=tensors)


def _assert_rows_close(got, ref, rel, where):
    """Every row of `got` within rel * max(1, max |ref|) of `ref`; a failure names how many rows
    are beyond and where the worst one is."""
    got, ref = np.atleast_2d(got), np.atleast_2d(ref)
    bound = rel * max(1.0, float(np.abs(ref).max()))
    err = np.abs(got - ref).max(axis=-1)
    over = np.nonzero(err > bound)[0]
    assert not len(over), (
        f"{where}: {len(over)} of {len(err)} rows beyond {bound:.4g}, the worst row {err.argmax()} "
        f"(max |gpu - numpy| {err.max():.4g}, max |numpy| {np.abs(ref).max():.4g}); rows beyond: "
        f"{over[:20].tolist()}")


def test_prompt_kernels_match_numpy(tmp_path, monkeypatch, f16_kv_reference):
    """STRATA_FLASH_PREFILL=1 and STRATA_GROUPED_EXPERTS=1: a 300-token prompt in chunks of 128
    through the flash attention and the row kernels (their default tensor-core build: rows
    rounded to f16), within tolerance of numpy, and the decode graph after it too. The dense
    matrices in float32 (STRATA_F16_PROMPT_GEMM=0): this test is about the two kernels.

    The model routes by token (hf_fixtures.routed_by_token), not by a random router. With one
    (_model, seed 15) this failed on an H100 on 2026-12-06, max |gpu - numpy| 0.47 (row not
    recorded): of its 900 (row, layer) routings the ten closest had their 4th and 5th router
    logits under 2.2e-3 apart (1.5e-5 at row 211 of layer 1), and the row kernels' f16
    rounding, imitated in numpy, moves layer 1's logits by up to 1.7e-3, flips row 211's expert
    and moves that row by 0.29, every other row staying within 1.2e-2 (imitating the attention's
    rounding too flips none: which near-tie a rounding crosses is luck, not the kernels). Here
    the 4th and 5th router logits of every row are at least 0.3 apart in every layer, and the
    kernels' rounding moves a row's router logits only by a common factor (its RMS) and float32
    rounding, so none flips an expert (test_token_routed_model.py checks the routing and the
    margin on the CPU); both roundings imitated move its logits by 1.1e-3 at most. The grouping
    stays a real one: each token picks its own 4 of 16 experts, so a chunk of 128 rows gives
    every expert its own uneven share of the rows (21 to 46 in the full chunks), never all."""
    from strata_dist.tools.single_process import SingleProcessRunner
    monkeypatch.setenv("STRATA_FLASH_PREFILL", "1")
    monkeypatch.setenv("STRATA_GROUPED_EXPERTS", "1")
    monkeypatch.setenv("STRATA_F16_PROMPT_GEMM", "0")
    path = _token_routed_model(tmp_path, seed=15)
    cpu = SingleProcessRunner(path, "cpu", prompt_chunk=128)
    gpu = SingleProcessRunner(path, "cuda:0", prompt_chunk=128)
    ref, got = cpu.feed(PROMPT), np.asarray(gpu.feed(PROMPT))
    _assert_rows_close(got, ref, 2e-2, "the prompt's logits")
    for t in NEXT[:3]:
        ref = cpu.feed([t])[-1]
        got = np.asarray(gpu.decode_step([t]))
        _assert_rows_close(got, ref, 2e-2, f"the decode step of token {t}")


def test_replayed_graph_equals_eager_step_and_general_path_tokens(tmp_path):
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _model(tmp_path, "q8_0", seed=8)
    graph, eager, general = (SingleProcessRunner(path, "cuda:0", prompt_chunk=128) for _ in range(3))
    eager.decode_graph.use_graph = False
    general.decode_graph = None
    for e in (graph, eager):
        e.prefill(PROMPT[:40])
    for t in NEXT:
        a, b = np.asarray(graph.decode_step([t])), np.asarray(eager.decode_step([t]))
        assert np.array_equal(a, b)
    assert len(graph.decode_graph.graphs) == 1 and not eager.decode_graph.graphs
    want = general.generate(PROMPT[:40], 24).tokens
    assert SingleProcessRunner(path, "cuda:0", prompt_chunk=128).generate(PROMPT[:40], 24).tokens == want


def test_programmatic_dependent_launches_change_no_bit(tmp_path):
    """The default graph (programmatic edges between the kernels) gives the plain graph's
    (STRATA_PDL=0) logits exactly, step after step."""
    from strata_dist.tools.single_process import SingleProcessRunner
    from strata_dist.kernels.pdl import ProgrammaticLauncher
    path = _model(tmp_path, "q8_0", seed=9)
    plain, pdl = (SingleProcessRunner(path, "cuda:0", prompt_chunk=128) for _ in range(2))
    assert isinstance(pdl.decode_graph._pdl, ProgrammaticLauncher)
    plain.decode_graph._pdl = None
    for e in (plain, pdl):
        e.prefill(PROMPT[:40])
    for t in NEXT:
        assert np.array_equal(np.asarray(plain.decode_step([t])), np.asarray(pdl.decode_step([t])))


def _k_quant_model(tmp_path, seed=3):
    """Q4_K experts (the synthetic writer's blocks), F16 dense: 3 layers of 16 experts, top-4."""
    from strata_dist.synth import SynthGeometry, write_synthetic
    geo = SynthGeometry("small", n_layer=3, n_embd=512, n_head=4, n_head_kv=2, head_dim=128,
                        n_expert=16, n_expert_used=4, n_ff_exp=256, n_vocab=1024,
                        context_length=2048)
    path = str(tmp_path / "q4k.gguf")
    write_synthetic(path, like=geo, quant="q4_k", popularity="zipf:1.0", seed=seed)
    return path


def test_graph_decode_of_a_k_quant_file_matches_numpy(tmp_path, f16_kv_reference):
    """Q4_K experts (the synthetic writer's blocks) with F16 dense weights."""
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _k_quant_model(tmp_path)
    cpu, gpu = SingleProcessRunner(path, "cpu", prompt_chunk=64), SingleProcessRunner(path, "cuda:0", prompt_chunk=64)
    assert gpu.decode_graph is not None
    prompt = [int(x) for x in np.random.default_rng(5).integers(10, 1000, 70)]
    cpu.prefill(prompt)
    gpu.prefill(prompt)
    for t in NEXT:
        ref = cpu.feed([t])[-1]
        got = np.asarray(gpu.decode_step([t]))
        assert np.abs(got - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max())


def test_stage_takes_the_graph_only_with_every_expert_cached(tmp_path, monkeypatch):
    """With host reads off (STRATA_HOST_MAPPED=0; the default reads a partial cache's misses in
    place, test_host_mapped_misses_give_the_cached_stages_bits) a stage takes the graph only when
    its cache holds every expert, and both give the same tokens."""
    from strata_dist.rank.stage import Stage, StageConfig
    monkeypatch.setenv("STRATA_HOST_MAPPED", "0")
    path = _model(tmp_path, "q8_0")
    full = Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512,
                             cache_pairs=[(l, e) for l in range(3) for e in range(16)]))
    part = Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512,
                             cache_pairs=[(l, e) for l in range(3) for e in range(8)]))
    assert full.decode_graph is not None and part.decode_graph is None
    toks = {}
    for name, st in (("full", full), ("part", part)):
        st.run(0, 0, ids=PROMPT[:20], prompt=True)
        hits_after_prompt = st.tiers.counters["hits"]
        out, pos, seq = None, 20, []
        for t in NEXT:
            out = st.run(0, pos, ids=[t])
            pos += 1
            seq.append(int(np.argmax(np.asarray(out))))
        toks[name] = seq
        if name == "full":   # every (token, layer, rank) of a graph step counts as a hit
            assert st.tiers.counters["hits"] - hits_after_prompt == len(NEXT) * 4 * 3
    assert toks["full"] == toks["part"]
    assert full.tiers.counters["graph_steps"] == len(NEXT)



@pytest.mark.parametrize("experts", ["q8_0", "q4_k"])
def test_host_mapped_misses_give_the_cached_stages_bits(tmp_path, monkeypatch, experts):
    """STRATA_HOST_MAPPED=1: a stage caching half its experts keeps the graph, the other half
    read in place from pinned host memory by the same kernels, so its logits equal a fully
    cached stage's bit for bit, and each step's computations are counted by where they were.
    Q4_K experts take the integer path, whose lanes read the rows in place (host memory too)."""
    from strata_dist.rank.stage import Stage, StageConfig
    path = _model(tmp_path, "q8_0", seed=10) if experts == "q8_0" else _k_quant_model(tmp_path)
    full = Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512,
                             cache_pairs=[(l, e) for l in range(3) for e in range(16)]))
    monkeypatch.setenv("STRATA_HOST_MAPPED", "1")
    part = Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512,
                             cache_pairs=[(l, e) for l in range(3) for e in range(0, 16, 2)],
                             loan_slots=6))
    assert part.decode_graph is not None and \
        part.decode_graph.addresses.host_blobs is part.tiers.pinned
    assert len(part.tiers.pinned.pairs) == 3 * 8 + 6     # the missing, and the 6 lent
    prompt_logits = []
    for st in (full, part):       # the prompt: the misses streamed from the pinned copies
        st.begin_prompt()
        prompt_logits.append(np.asarray(st.run(0, 0, ids=PROMPT[:20], prompt=True)))
        st.end_prompt()
    assert np.array_equal(*prompt_logits)
    assert part.tiers.counters["streamed"] > 0
    before = dict(part.tiers.counters)
    pos = 20
    for t in NEXT:
        a = np.asarray(full.run(0, pos, ids=[t]))
        b = np.asarray(part.run(0, pos, ids=[t]))
        assert np.array_equal(a, b), t
        pos += 1
    hits = part.tiers.counters["hits"] - before.get("hits", 0)
    host = part.tiers.counters["host"] - before.get("host", 0)
    assert hits + host == len(NEXT) * 4 * 3 and host > 0 and hits > 0
    assert part.tiers.counters["graph_steps"] == len(NEXT)


def test_a_cards_own_helper_tier_is_read_in_place_by_the_graph(tmp_path, monkeypatch):
    """A stage+helper card in one rank: a third of the stage's experts cached, a third in the
    card's own helper tier (opened after the stage, as a rank opens it), the rest pinned in host
    memory. The decode graph reads all three kinds of address with the same kernels, so its
    logits equal a fully cached stage's bit for bit, and each step's computations are counted by
    tier. A helper tier that did not open leaves its pairs to host memory: the same bits."""
    from strata_dist.ops.expert_addresses import HELPER_TIERS
    from strata_dist.experts.stores import BlobArena
    from strata_dist.rank.stage import Stage, StageConfig
    monkeypatch.delenv("STRATA_HOST_MAPPED", raising=False)
    path = _model(tmp_path, "q8_0", seed=10)
    full = Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512,
                             cache_pairs=[(l, e) for l in range(3) for e in range(16)]))
    cached = [(l, e) for l in range(3) for e in range(0, 16, 3)]
    helper = [(l, e) for l in range(3) for e in range(1, 16, 3)]

    def stage():
        return Stage(StageConfig(path, "cuda:0", 0, 3, True, True, 512, cache_pairs=cached,
                                 local_helper_pairs=helper))
    part, lost = stage(), stage()
    assert part.decode_graph is None                 # it waits for the card's helper tier
    assert not any(part.tiers.pinned.holds(l, e) for l, e in helper)
    part.attach_local_helper(BlobArena(part.backend, part.gguf, helper, 3, 16))
    assert part.decode_graph.addresses.pairs(*HELPER_TIERS) == set(helper)
    lost.attach_local_helper(None)                   # the tier did not open (fail-soft)
    assert lost.decode_graph is not None and not lost.decode_graph.addresses.pairs(*HELPER_TIERS)
    assert all(lost.tiers.pinned.holds(l, e) for l, e in helper)
    logits = []
    for st in (full, part, lost):
        st.begin_prompt()
        logits.append(np.asarray(st.run(0, 0, ids=PROMPT[:20], prompt=True)))
        st.end_prompt()
    assert np.array_equal(logits[0], logits[1]) and np.array_equal(logits[0], logits[2])
    before = {id(st): dict(st.tiers.counters) for st in (part, lost)}
    pos = 20
    for t in NEXT:
        a = np.asarray(full.run(0, pos, ids=[t]))
        for st in (part, lost):
            assert np.array_equal(a, np.asarray(st.run(0, pos, ids=[t]))), t
        pos += 1
    for st in (part, lost):
        done = {k: st.tiers.counters[k] - before[id(st)].get(k, 0)
                for k in ("hits", "remote", "host", "graph_steps")}
        assert done["graph_steps"] == len(NEXT)
        assert done["hits"] + done["remote"] + done["host"] == len(NEXT) * 4 * 3
        assert done["hits"] > 0 and done["host"] > 0
        assert (done["remote"] > 0) == (st is part)


def test_steps_launched_ahead_give_the_same_tokens(tmp_path):
    """STRATA_DECODE_AHEAD: a greedy generation whose every next step is launched before the host
    reads the token gives the plain runner's tokens, and the steps ahead are the ones taken."""
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _model(tmp_path, "q8_0", seed=16)
    plain, ahead = (SingleProcessRunner(path, "cuda:0", prompt_chunk=128) for _ in range(2))
    assert ahead.decode_graph.ahead_enabled            # the default
    plain.decode_graph.ahead_enabled = False            # as with STRATA_DECODE_AHEAD=0
    want = plain.generate(PROMPT[:40], 32).tokens
    assert ahead.generate(PROMPT[:40], 32).tokens == want
    # every decode step but the first was launched ahead (the last one launched is never asked
    # for; fewer steps if a stop token came)
    assert ahead.decode_graph.ahead_taken == max(0, len(want) - 2)
    assert plain.decode_graph.ahead_taken == 0
    # the next request on the same session reads its prompt after the runner settles
    assert ahead.generate(PROMPT[:20], 8).tokens == plain.generate(PROMPT[:20], 8).tokens


def test_a_step_ahead_not_taken_is_dropped(tmp_path):
    """A step launched ahead whose token the caller does not feed (a sampler that picked another
    token) is waited for and dropped; the step asked for is computed afresh, equal to a runner's
    without steps ahead. Logits read after a later launch raise instead of being another step's."""
    from strata_dist.tools.single_process import SingleProcessRunner
    path = _model(tmp_path, "q8_0", seed=17)
    plain, ahead = (SingleProcessRunner(path, "cuda:0", prompt_chunk=128) for _ in range(2))
    ahead.decode_graph.ahead_enabled = True
    for e in (plain, ahead):
        e.prefill(PROMPT[:40])
    first = ahead.decode_step([NEXT[0]], ahead=True)
    with pytest.raises(RuntimeError):
        np.asarray(first)                       # the step ahead has overwritten the row
    plain.decode_step([NEXT[0]])
    other = (first.greedy_token + 1) % 100      # not the token the step ahead read
    got = np.asarray(ahead.decode_step([other]))
    assert np.array_equal(got, np.asarray(plain.decode_step([other])))
    assert ahead.decode_graph.ahead_taken == 0
