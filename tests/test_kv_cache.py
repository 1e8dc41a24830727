"""--kv-type: how sessions keep K/V (strata_dist/backends/kv_cache.py). The q8_0 rows round-trip
within half a step of their block's scale; every type is priced exactly as the sessions of both
architectures allocate it; the logits stay near float32's; the choice travels to every rank of a
launch (tokens equal the single process with the same type); a model whose heads are not whole
q8_0 blocks is refused before anything loads."""
import subprocess
import sys

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from strata_dist.backends.kv_cache import KV_TYPES, Q8Rows, kv_cell_bytes, new_kv
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.models.shape import model_shape
from strata_dist.plan.pricing import session_bytes, session_parts
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.rank.stage import Stage, StageConfig

CELLS = 96
PROMPT = [5, 17, 3, 250, 99, 4, 180, 61, 7, 42, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def moe32(tmp_path_factory):
    """head_dim 32: one q8_0 block per head."""
    return str(write_gguf(tiny_qwen3moe(21, head_dim=32), tmp_path_factory.mktemp("kv") / "m.gguf"))


@pytest.fixture(scope="module")
def next32(tmp_path_factory):
    return str(write_next_gguf(tiny_qwen3next(22), tmp_path_factory.mktemp("kvn") / "n.gguf"))


def test_q8_rows_round_trip_within_half_a_step():
    rng = np.random.default_rng(0)
    rows = Q8Rows(np, (10, 2, 64))
    x = (rng.standard_normal((4, 2, 64)) * rng.uniform(0.01, 30, (4, 2, 1))).astype(np.float32)
    x[1, 0, :32] = 0.0                                   # an all-zero block stays zero
    rows[3:7] = x
    back = rows[3:7]
    assert back.dtype == np.float32 and back.shape == x.shape
    step = np.abs(x.reshape(4, 2, 2, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(back - x).reshape(4, 2, 2, 32) <= 0.5 * step * 1.01 + 1e-7).all()
    assert (back[1, 0, :32] == 0).all() and (rows[0:3] == 0).all()
    assert rows.nbytes == 10 * kv_cell_bytes(2 * 64, "q8_0", 64)      # 10 cells of 2 heads x 64
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Rows(np, (4, 2, 48))


def test_cell_bytes_of_each_type():
    assert [kv_cell_bytes(256, t, 128) for t in KV_TYPES] == [1024, 512, 272]
    with pytest.raises(ValueError, match="unknown K/V type"):
        kv_cell_bytes(256, "q4_0", 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_cell_bytes(64, "q8_0", 16)
    with pytest.raises(ValueError, match="unknown K/V type"):
        new_kv(np, (2, 1, 32), "bf16")


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("lb,le", [(0, 4), (1, 3)])
@pytest.mark.parametrize("resident", [0, 40])        # 40: --kv-resident, the rest on the host
def test_sessions_equal_priced_for_every_type(moe32, next32, kv_type, lb, le, resident):
    for path, n_layers in ((moe32, 4), (next32, 8)):
        shape = model_shape(GGUFModel(path), "cpu", kv_type)
        stage = Stage(StageConfig(path, "cpu", lb, le, lb == 0, le == n_layers, CELLS,
                                  kv_type=kv_type, kv_resident=resident))
        s = stage.session(0)
        assert stage.session_bytes() == session_bytes(shape, CELLS, lb, le, resident), \
            (path, kv_type)
        assert stage.kv_host_bytes() == session_parts(shape, CELLS, lb, le, resident)["kv_host"]
        if hasattr(s, "parts_nbytes"):
            assert s.parts_nbytes() == session_parts(shape, CELLS, lb, le, resident)
    f32 = session_bytes(model_shape(GGUFModel(moe32), "cpu", "f32"), CELLS, 0, 4)
    q8 = session_bytes(model_shape(GGUFModel(moe32), "cpu", "q8_0"), CELLS, 0, 4)
    assert q8 < f32


@pytest.mark.parametrize("kv_type,tol", [("f16", 1e-2), ("q8_0", 6e-2)])
def test_logits_stay_near_float32(moe32, next32, kv_type, tol):
    for path in (moe32, next32):
        ref = SingleProcessRunner(path, "cpu", max_context=CELLS, prompt_chunk=5).feed(PROMPT)
        got = SingleProcessRunner(path, "cpu", max_context=CELLS, prompt_chunk=5,
                                  kv_type=kv_type).feed(PROMPT)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert 0 < err <= tol, (path, kv_type, err)


def test_a_launch_gives_every_rank_the_type(moe32):
    want = SingleProcessRunner(moe32, "cpu", max_context=256, prompt_chunk=8,
                               kv_type="q8_0").generate(PROMPT, 10).tokens
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", moe32, "--cpu-ranks",
                          "2", "--layer-split", "2", "--max-context", "256", "--prefill", "8",
                          "--kv-type", "q8_0", "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--max-new", "10"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kv_type" not in out.stderr or "q8_0" in out.stderr
    assert [int(t) for t in out.stdout.replace(",", " ").split()] == want


def test_q8_0_refused_for_heads_that_are_not_whole_blocks(tmp_path):
    path = str(write_gguf(tiny_qwen3moe(23), tmp_path / "h16.gguf"))      # head_dim 16
    for argv in ([sys.executable, "-m", "launcher.cli", "--model", path, "--cpu-ranks", "1",
                  "--kv-type", "q8_0", "--prompt-ids", "1,2", "--max-new", "1"],
                 [sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model", path,
                  "--kv-type", "q8_0", "--max-new", "1"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "--kv-type q8_0" in done.stderr and "multiple of 32" in done.stderr
