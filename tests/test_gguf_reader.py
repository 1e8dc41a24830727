"""The GGUF reader: the tensor index, expert blobs in every common stored format, and a clear
error (naming the file and tensor, exit 2 from the CLIs) for each kind of malformed file."""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from hf_fixtures import tiny_qwen3moe, write_gguf
from strata_dist.gguf_file.reader import GGUFError, GGUFModel, TensorKind
from strata_dist.models import open_checked
from strata_dist.models.qwen3moe import read_geometry

QT = GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(0), tmp_path_factory.mktemp("r") / "tiny.gguf", "f32")


def test_index_by_layer_and_kind(tiny_path):
    m = GGUFModel(tiny_path)
    g = read_geometry(m)
    assert (g.n_layers, g.n_embd, g.n_expert, g.n_expert_used, g.n_vocab) == (4, 64, 8, 2, 320)
    kinds = {t.kind for t in m.tensors.values()}
    assert kinds == {TensorKind.EMBEDDING, TensorKind.HEAD, TensorKind.DENSE,
                     TensorKind.ROUTER, TensorKind.EXPERT}
    assert m.tensor("blk.2.ffn_gate_inp.weight").kind is TensorKind.ROUTER
    assert m.tensor("blk.2.ffn_up_exps.weight").layer == 2
    assert {t.layer for t in m.layer_tensors(3)} == {3}
    assert len(m.layer_tensors(3)) == 12
    # stored sizes: F32 tensors are 4 bytes an element
    t = m.tensor("blk.0.attn_q.weight")
    assert t.n_bytes == 4 * t.shape[0] * t.shape[1]
    assert m.blob_bytes(0) == 3 * 32 * 64 * 4


def test_open_reads_only_the_header(tiny_path):
    # The map is lazy: opening does not copy tensor data (a view of the file, not an array).
    m = GGUFModel(tiny_path)
    raw = m.raw("blk.0.ffn_down_exps.weight")
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)


# ---- expert blobs in stored formats -----------------------------------------------------------

def _random_blocks(qtype: QT, n_rows: int, row: int, rng) -> np.ndarray:
    """Valid random blocks: random bytes with every f16 scale field set to a finite value."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * row // block
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scale_fields = {  # byte offsets of f16 fields inside one block (ggml-common.h layouts)
        QT.Q4_0: [0], QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2],
        QT.Q6_K: [size - 2], QT.IQ4_XS: [0],
    }[qtype]
    for off in scale_fields:
        vals = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16)
        data[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(n_rows, row // block * size)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS])
def test_expert_blobs_dequantize_like_gguf_py(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    n_exp, embd, ff = 4, 256, 256
    path = tmp_path / f"{qtype.name}.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    stored = {}
    for part, (rows, row) in {"ffn_gate_exps": (ff, embd), "ffn_up_exps": (ff, embd),
                              "ffn_down_exps": (embd, ff)}.items():
        blocks = _random_blocks(qtype, n_exp * rows, row, rng).reshape(n_exp, rows, -1)
        stored[part] = blocks
        w.add_tensor(f"blk.0.{part}.weight", blocks, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    m = GGUFModel(path)
    per_expert = sum(b[0].nbytes for b in stored.values())
    assert m.blob_bytes(0) == per_expert
    for e in range(n_exp):
        blob = m.expert_blob(0, e)
        assert blob.nbytes == per_expert
        gate, up, down = m.dequantize_expert(0, e)
        ref = {p: gguf_quants.dequantize(b, qtype)[e] for p, b in stored.items()}
        np.testing.assert_array_equal(gate, ref["ffn_gate_exps"])
        np.testing.assert_array_equal(up, ref["ffn_up_exps"])
        np.testing.assert_array_equal(down, ref["ffn_down_exps"])
        assert np.isfinite(gate).all() and np.abs(gate).max() > 0


# ---- malformed files ----------------------------------------------------------------------------

def _run_cli(path, tmp_path):
    env = dict(os.environ, STRATA_CACHE_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model", str(path),
                           "--max-new", "2"], capture_output=True, text=True, timeout=120, env=env)


def _expect(path, tmp_path, *needles):
    with pytest.raises(GGUFError) as err:
        open_checked(str(path))
    for needle in needles:
        assert needle in str(err.value)
    proc = _run_cli(path, tmp_path)
    assert proc.returncode == 2, proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    return err.value


def test_bad_magic(tmp_path, tiny_path):
    data = bytearray(open(tiny_path, "rb").read())
    data[:4] = b"GGUX"
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(bytes(data))
    _expect(bad, tmp_path, str(bad), "magic")


def test_truncated_data_names_the_tensor(tmp_path, tiny_path):
    data = open(tiny_path, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    err = _expect(bad, tmp_path, str(bad), "truncated")
    assert err.tensor is not None and err.tensor in str(err)


def test_missing_tensor(tmp_path):
    from hf_fixtures import gguf_tensors
    hf = tiny_qwen3moe(1)
    tensors = gguf_tensors(hf)
    del tensors["blk.2.attn_k.weight"]
    bad = write_gguf(hf, tmp_path / "missing.gguf", tensors=tensors)
    _expect(bad, tmp_path, bad, "blk.2.attn_k.weight", "missing")


def test_wrong_shape(tmp_path):
    from hf_fixtures import gguf_tensors
    hf = tiny_qwen3moe(2)
    tensors = gguf_tensors(hf)
    tensors["blk.1.ffn_down_exps.weight"] = tensors["blk.1.ffn_down_exps.weight"][:, :, :16]
    bad = write_gguf(hf, tmp_path / "shape.gguf", tensors=tensors)
    _expect(bad, tmp_path, bad, "blk.1.ffn_down_exps.weight", "shape")


def test_unknown_architecture(tmp_path):
    bad = write_gguf(tiny_qwen3moe(3), tmp_path / "arch.gguf", arch="mamba9")
    _expect(bad, tmp_path, bad, "unknown architecture", "mamba9")


def test_not_a_file(tmp_path):
    _expect(tmp_path / "nope.gguf", tmp_path, "nope.gguf", "no such file")


@pytest.mark.parametrize("path,needle", [("folder", "is a directory, not a GGUF file"),
                                         ("/dev/null", "is not a regular file")])
def test_a_path_that_exists_but_is_no_file_is_not_called_missing(tmp_path, path, needle):
    where = tmp_path / path if path == "folder" else path
    if path == "folder":
        where.mkdir()
    err = _expect(where, tmp_path, f"{where}: {needle}")
    assert "no such file" not in str(err)


# ---- NaN/Inf in stored weights (gguf_file/finite.py) -------------------------------------------

def _finite_blocks(qtype: QT, n_blocks: int, rng) -> np.ndarray:
    """Random blocks of `qtype` whose float scale fields hold small finite values."""
    from strata_dist.gguf_file.finite import _F32_SCALES, _SCALE_FIELDS
    _, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    dtype = np.float32 if qtype in _F32_SCALES else np.float16
    for off in _SCALE_FIELDS[qtype]:
        vals = rng.uniform(-0.05, 0.05, n_blocks).astype(dtype)
        data[:, off:off + dtype().itemsize] = vals.view(np.uint8).reshape(n_blocks, -1)
    return data


def _scale_types():
    from strata_dist.gguf_file.finite import _SCALE_FIELDS
    return sorted(_SCALE_FIELDS, key=int)


@pytest.mark.parametrize("qtype", _scale_types(), ids=lambda q: q.name)
def test_a_nan_scale_is_found_where_the_decoder_reads_it(qtype):
    """Each scale field of each quant type is where gguf-py's decoder reads a scale: a NaN put
    there is reported for that block, and (where gguf-py decodes the type) decodes to NaN."""
    from strata_dist.gguf_file.finite import _F32_SCALES, _SCALE_FIELDS, find_non_finite
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks = _finite_blocks(qtype, 16, rng)
    assert find_non_finite(blocks, qtype, 4 * block) is None
    dtype = np.float32 if qtype in _F32_SCALES else np.float16
    for off in _SCALE_FIELDS[qtype]:
        bad = blocks.copy()
        bad[9, off:off + dtype().itemsize] = np.array([np.nan], dtype).view(np.uint8)
        assert find_non_finite(bad, qtype, 4 * block) == "NaN in the scale of block 9 (row 2)"
        bad[9, off:off + dtype().itemsize] = np.array([-np.inf], dtype).view(np.uint8)
        assert find_non_finite(bad, qtype, 4 * block) == "Inf in the scale of block 9 (row 2)"
        try:
            with np.errstate(invalid="ignore", over="ignore"):
                values = gguf_quants.dequantize(bad, qtype).reshape(16, block)
        except NotImplementedError:
            continue
        assert np.isfinite(values[:9]).all() and not np.isfinite(values[9]).all()


@pytest.mark.parametrize("qtype,dtype", [(QT.F32, np.float32), (QT.F16, np.float16),
                                         (QT.BF16, None)])
def test_nan_and_inf_in_float_tensors(qtype, dtype):
    from strata_dist.gguf_file.finite import find_non_finite
    values = np.linspace(-3, 3, 640, dtype=np.float32).reshape(10, 64)
    for bad_value, word in ((np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")):
        v = values.copy()
        v[3, 5] = bad_value
        stored = (v.view(np.uint32) >> 16).astype(np.uint16) if dtype is None else v.astype(dtype)
        assert find_non_finite(stored.view(np.uint8), qtype, 64) == \
               f"{word} at element {3 * 64 + 5} (row 3)"
    ok = (values.view(np.uint32) >> 16).astype(np.uint16) if dtype is None else values.astype(dtype)
    assert find_non_finite(ok.view(np.uint8), qtype, 64) is None


def test_a_tensor_past_the_full_scan_size_is_sampled_first_and_last_block_included(monkeypatch):
    from strata_dist.gguf_file import finite as gguf_finite
    monkeypatch.setattr(gguf_finite, "FULL_SCAN_BYTES", 4 << 20)   # the rule, on a small tensor
    n = gguf_finite.FULL_SCAN_BYTES // 2 + 4096          # f16 values: just past a full scan
    values = np.zeros(n, dtype=np.float16)
    for at in (0, n - 1):
        v = values.copy()
        v[at] = np.nan
        assert gguf_finite.find_non_finite(v.view(np.uint8), QT.F16, 4096) == \
               f"NaN at element {at} (row {at // 4096})"
    assert gguf_finite.find_non_finite(values.view(np.uint8), QT.F16, 4096) is None
