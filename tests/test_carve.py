"""The carve: a stage loads exactly the dense tensors the planner prices for [lb, le) — from lb,
not from 0 — and its session holds exactly the priced parts for its own layers; in a mixed file
(a type per tensor, gate/up and down of one layer in different types) too."""
import gguf
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.models.shape import model_shape
from strata_dist.plan.pricing import blob_bytes, session_bytes, weights_bytes
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.synth import SynthGeometry, write_synthetic

CELLS = 256
# 256-wide rows hold every K block: q4_k_m puts ffn_down in Q6_K in layers 2 and 5 (Q4_K elsewhere,
# as gate/up), q2_k gate/up in Q2_K and down in Q3_K everywhere.
MIXED = SynthGeometry("mixed", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                      n_expert_used=4, n_ff_exp=256, n_vocab=512, context_length=4096)


@pytest.fixture(scope="module", params=["f32", "q4_k_m", "q2_k"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("carve")
    if request.param == "f32":
        return write_gguf(tiny_qwen3moe(4, n_layers=6), folder / "m.gguf")
    return str(write_synthetic(folder / "m.gguf", MIXED, quant=request.param, seed=4).path)


@pytest.mark.parametrize("lb,le", [(0, 6), (0, 2), (2, 4), (4, 6), (3, 4), (1, 6)])
def test_loaded_equals_priced(model, lb, le):
    shape = model_shape(GGUFModel(model), "cpu")
    first, last = lb == 0, le == 6
    stage = Stage(StageConfig(model, "cpu", lb, le, first, last, CELLS))
    stage.session(0)
    assert stage.weights_bytes == weights_bytes(shape, lb, le, first, last)
    assert stage.session_bytes() == session_bytes(shape, CELLS, lb, le)
    if lb > 0:  # the silent failure of the seeds: a stage of [lb, le) loading [0, le)
        assert stage.weights_bytes < weights_bytes(shape, 0, le, True, last)
    assert sorted(stage.model.layers) == list(range(lb, le))
    assert stage.session(0).k(lb).shape[0] == CELLS
    with pytest.raises(IndexError):
        stage.session(0).k(le)   # no rows beyond the stage's own layers
    with pytest.raises(IndexError):
        stage.session(0).v(lb - 1)


def test_weight_slice_off_loads_all_dense_weights(model):
    shape = model_shape(GGUFModel(model), "cpu")
    stage = Stage(StageConfig(model, "cpu", 2, 4, False, False, CELLS, weight_slice=False))
    assert stage.weights_bytes == weights_bytes(shape, 2, 4, False, False, weight_slice=False)
    assert stage.weights_bytes == weights_bytes(shape, 0, 6, True, True)


@pytest.mark.parametrize("lb,le", [(0, 4), (0, 2), (2, 4)])
def test_tied_embeddings_are_priced_once(tmp_path, lb, le):
    """A tied head is the embedding itself: a stage that is first and last loads it once."""
    path = write_gguf(tiny_qwen3moe(9, tied=True), tmp_path / "tied.gguf")
    shape = model_shape(GGUFModel(path), "cpu")
    first, last = lb == 0, le == 4
    stage = Stage(StageConfig(path, "cpu", lb, le, first, last, CELLS))
    assert stage.weights_bytes == weights_bytes(shape, lb, le, first, last)


def test_mixed_blobs_are_priced_as_carved(tmp_path):
    """Each expert blob is its gate, up and down rows, each in its own type: the planner's blob
    size, the stage's cache and the rows the file holds agree byte for byte."""
    path = str(write_synthetic(tmp_path / "m.gguf", MIXED, quant="q4_k_m", seed=6).path)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    shape = model_shape(GGUFModel(path), "cpu")
    pairs = [(l, e) for l in range(1, 6) for e in (0, 7, 15)]
    stage = Stage(StageConfig(path, "cpu", 1, 6, False, True, CELLS, cache_pairs=pairs))
    assert stage.cache.nbytes == sum(blob_bytes(shape, l) for l, _ in pairs)
    types = set()
    for layer in range(1, 6):
        parts = [reader[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")]
        types.add(tuple(t.tensor_type for t in parts))
        rows = [bytes(t.data.view(np.uint8).reshape(MIXED.n_expert, -1)[7]) for t in parts]
        for t, r in zip(parts, rows):
            block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            assert len(r) == int(np.prod(t.shape[:2])) // block * size     # one expert's rows
        assert blob_bytes(shape, layer) == sum(map(len, rows))
        slot = stage.cache.slot_of[layer, 7]
        lo, hi = stage.cache.offsets[slot], stage.cache.offsets[slot + 1]
        assert np.asarray(stage.cache.buf)[lo:hi].tobytes() == b"".join(rows)
    T = gguf.GGMLQuantizationType
    assert types == {(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K, T.Q4_K)}     # mixed, and per layer
