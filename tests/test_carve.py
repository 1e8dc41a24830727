"""The carve: a stage loads exactly the dense tensors the planner prices for [lb, le) — from lb,
not from 0 — and its session holds exactly the priced parts for its own layers."""
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from strata_dist.gguf_model import GGUFModel
from strata_dist.model_shape import model_shape
from strata_dist.plan.pricing import session_bytes, weights_bytes
from strata_dist.stage import Stage, StageConfig

CELLS = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(4, n_layers=6), tmp_path_factory.mktemp("carve") / "m.gguf")


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
