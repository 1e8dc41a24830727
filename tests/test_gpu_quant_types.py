"""Every weight-reading kernel x every stored type of the kernels' type table (kernels/weights.cuh
FOR_EACH_TYPE: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS) against
gguf-py's `dequantize` (tests/type_rows.py), the reference nobody here wrote:

- dequant_rows / dequant_rows_f16 (QuantMatrix: the general path's experts, a prompt's dense
  matrices before their f16 GEMM, embedding rows) and embed_tokens (the decode graph's first
  stage): gguf-py's float32 bit for bit (Q4_K / Q5_K: within a unit in the last place, their
  measured fused multiply-add), and f16 its round to nearest;
- the dense matvec, 1..8 activation rows, each row's bits independent of the others';
- the decode expert kernels (moe_gate_up / moe_down: the float path, and the default build's
  integer path of Q4_K and of the K- and i-quants of INT_TYPE_SWITCHES, and those switches 0),
  1..8 rows, gate/up and down in the same and in different types, blobs in device memory and
  in pinned host memory read in place (the host tier) giving the same bits;
- the prompt's row kernels (FMA and tensor-core builds) over a chunk of 300 rows.

Run on the GPU machine: pytest -m gpu."""
import ctypes

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from strata_dist.backends import cuda_decode as cd  # noqa: E402
from strata_dist.ops.linear import Weight  # noqa: E402
from strata_dist.ops.linear import QuantMatrix  # noqa: E402
from strata_dist.kernels.abi import (BLOCK_THREADS, DESC_TOKENS, DESC_WORDS,  # noqa: E402
                                     EXPERT_SPEC, INT_TYPE_SWITCHES, KERNEL_TYPES, MAT_SPEC,
                                     MAX_ROWS, TYPE_NAMES, ExpertLayout, KernelShape,
                                     matvec_block_threads, matvec_kernel, rows_per_block)
from type_rows import ALL_TYPES, random_rows  # noqa: E402

N_EMBD, N_FF, N_EXPERT, K = 512, 256, 8, 4
FUSED = {QT.Q4_K, QT.Q5_K}          # chunk8's fmaf(a, q, b): within an ulp of gguf-py
ids = lambda t: t.name             # noqa: E731


def _fn(name, shape: KernelShape = KernelShape()):
    return cd.function("decode.cu", name, 0, shape.defines())


def _same_as_gguf(got: np.ndarray, ref: np.ndarray, qtype) -> None:
    if qtype in FUSED:
        assert (np.abs(got - ref) <= np.spacing(np.abs(ref))).all(), qtype.name
    else:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), qtype.name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids)
def test_dequantize_and_embedding_rows_are_gguf_py(qtype):
    raw, ref = random_rows(qtype, 24, 768, 1)
    m = QuantMatrix(cp.asarray(raw.reshape(-1)), ref.shape, int(qtype))
    _same_as_gguf(cp.asnumpy(m.dequantize()), ref, qtype)
    half = cp.asnumpy(m.dequantize(cp.float16)).astype(np.float32)
    np.testing.assert_allclose(half, ref.astype(np.float16).astype(np.float32), rtol=1e-3,
                               atol=0)
    if qtype not in FUSED:      # round to nearest of the same float32: the same f16
        assert np.array_equal(half, ref.astype(np.float16).astype(np.float32)), qtype.name
    pick = np.array([5, 0, 23, 5])
    _same_as_gguf(cp.asnumpy(m.rows(pick)), ref[pick], qtype)
    # the decode graph's embedding: token ids from the step descriptor, a NaN row for a bad id
    desc = np.zeros(DESC_WORDS, np.int32)
    desc[DESC_TOKENS:DESC_TOKENS + 5] = [5, 0, 23, 5, 24]
    h = cp.zeros((MAX_ROWS, 768), cp.float32)
    _fn("embed_tokens")((1, 5), (128,), (m.raw, np.int32(qtype), np.int64(m.row_bytes),
                                         np.int32(768), np.int32(24), cp.asarray(desc), h))
    got = cp.asnumpy(h)
    _same_as_gguf(got[:4], ref[pick], qtype)
    assert np.isnan(got[4]).all()


def _matvec(dev, qtype, shape, x, row_bytes: int, wide: bool, build: str = ""):
    w = Weight(int(dev.data.ptr), int(qtype), row_bytes, *shape)
    n = x.shape[0]
    xs = cp.zeros((MAX_ROWS, shape[1]), cp.float32)     # the runner's buffers hold 8 rows
    xs[:n] = cp.asarray(x)
    y = cp.zeros((n, shape[0]), cp.float32)
    spec = cd._spec_array(MAT_SPEC, [cd._mat(w, y)])
    ks = KernelShape.parse(build)
    per_block = rows_per_block(n, wide, ks, int(qtype))
    _fn(matvec_kernel(int(qtype), n), ks)(
        ((shape[0] + per_block - 1) // per_block, 1), (matvec_block_threads(ks, int(qtype)),),
        (spec, xs, np.int32(shape[1]), np.int32(n), np.int32(wide), cd.NULL, np.float32(1e-6),
         cd.NULL, cd.NULL))
    return cp.asnumpy(y)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("build", ["", "matvec_mma=1", "matvec_mma=1,mma_threads=512",
                                   "matvec_pieces=0"])
def test_matvec_of_every_type(qtype, n, build):
    rows, cols = 203, 768
    raw, w = random_rows(qtype, rows, cols, 2, synth=True)
    x = np.random.default_rng(3).standard_normal((n, cols)).astype(np.float32)
    dev = cp.asarray(raw.reshape(-1))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    for wide in (False, True):
        got = _matvec(dev, qtype, (rows, cols), x, raw.shape[1], wide, build)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        alone = _matvec(dev, qtype, (rows, cols), x[:1], raw.shape[1], wide, build)
        assert np.array_equal(alone[0], got[0]), qtype.name


class Blobs:
    """N_EXPERT expert blobs (gate rows, up rows, down rows as stored) 256 bytes apart in device
    memory, and the same bytes in pinned host memory the kernels read in place."""

    def __init__(self, gate_up, down, seed: int):
        self.ref, parts = [], []
        for e in range(N_EXPERT):
            g_raw, g = random_rows(gate_up, N_FF, N_EMBD, seed + 3 * e, synth=True)
            u_raw, u = random_rows(gate_up, N_FF, N_EMBD, seed + 3 * e + 1, synth=True)
            d_raw, d = random_rows(down, N_EMBD, N_FF, seed + 3 * e + 2, synth=True)
            self.ref.append((g, u, d))
            parts.append(np.concatenate([g_raw.ravel(), u_raw.ravel(), d_raw.ravel()]))
        self.size, self.stride = parts[0].size, (parts[0].size + 255) // 256 * 256
        host = np.zeros(self.stride * N_EXPERT, np.uint8)
        for e, b in enumerate(parts):
            host[e * self.stride:e * self.stride + self.size] = b
        self.buf = cp.asarray(host)
        self.pinned = cp.cuda.runtime.hostAlloc(host.nbytes, 1 | 2)   # portable | mapped
        np.ctypeslib.as_array((ctypes.c_uint8 * host.nbytes).from_address(
            self.pinned))[:] = host
        self.pinned_dev = cp.cuda.runtime.pointerGetAttributes(self.pinned).devicePointer
        g_bytes, u_bytes = g_raw.nbytes, u_raw.nbytes
        self.layout = ExpertLayout(int(gate_up), int(gate_up), int(down), g_bytes,
                                   g_bytes + u_bytes, g_bytes // N_FF, u_bytes // N_FF,
                                   d_raw.nbytes // N_EMBD, N_FF, N_EMBD,
                                   max(KERNEL_TYPES[int(gate_up)], KERNEL_TYPES[int(down)]))

    def addresses(self, pinned: bool) -> np.ndarray:
        base = self.pinned_dev if pinned else int(self.buf.data.ptr)
        return np.array([base + e * self.stride for e in range(N_EXPERT)], np.uint64)

    def spec(self, blob_of):
        lay = self.layout
        return cd._spec_array(EXPERT_SPEC, [dict(
            blob_of=int(blob_of.data.ptr), up_at=lay.up_at, down_at=lay.down_at,
            gate_row_bytes=lay.gate_row_bytes, up_row_bytes=lay.up_row_bytes,
            down_row_bytes=lay.down_row_bytes, gate_type=lay.gate_type, up_type=lay.up_type,
            down_type=lay.down_type, n_ff=N_FF, n_embd=N_EMBD, k=K)])

    def close(self):
        cp.cuda.runtime.freeHost(self.pinned)


# each type with itself, and mixes as files mix them (an i-quant file's first ffn_down tensors
# IQ3_S or Q2_K, K-quants for the 4-bit ones)
PAIRS = [(t, t) for t in ALL_TYPES] + [(QT.Q4_0, QT.Q8_0), (QT.Q2_K, QT.Q3_K),
                                       (QT.Q3_K, QT.Q6_K), (QT.Q4_K, QT.Q5_1), (QT.BF16, QT.Q4_1),
                                       (QT.IQ2_XXS, QT.IQ3_S), (QT.IQ1_M, QT.Q2_K),
                                       (QT.IQ4_XS, QT.Q5_K)]


@pytest.mark.parametrize("gate_up,down", PAIRS, ids=ids)
# the default build has every integer-path type's switch on (abi.py INT_TYPE_SWITCHES): Q5_K,
# Q6_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ2_XXS take the integer path in the PAIRS that have them;
# with those switches 0 they take the float path and Q4_K alone the integer one
@pytest.mark.parametrize("shape", ["", "int_gate_up=0,int_down=0",
                                   ",".join(f"{name}=0" for name in INT_TYPE_SWITCHES)])
def test_decode_expert_kernels_of_every_type(gate_up, down, shape):
    ks = KernelShape.parse(shape)
    ex = Blobs(gate_up, down, seed=int(gate_up) * 100 + int(down))
    try:
        rng = np.random.default_rng(5)
        ff, out = ks.gate_up_block(int(gate_up)), ks.down_block(int(down))
        results = {}
        for n in range(1, MAX_ROWS + 1):
            x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
            pick = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n)])
            wts = rng.random((n, K)).astype(np.float32)
            h0 = rng.standard_normal((n, N_EMBD)).astype(np.float32)
            for pinned in (False, True):
                blob_of = ex.addresses(pinned)
                spec = ex.spec(cp.asarray(blob_of))
                act = cp.zeros((n, K, N_FF), cp.float32)
                h = cp.asarray(h0)
                _fn(f"moe_gate_up_{TYPE_NAMES[int(gate_up)]}", ks)(
                    ((N_FF + ff - 1) // ff, K, n), (BLOCK_THREADS,),
                    (spec, cp.asarray(x), cp.asarray(blob_of[pick]), act))
                _fn(f"moe_down_{TYPE_NAMES[int(down)]}", ks)(
                    ((N_EMBD + out - 1) // out, n), (BLOCK_THREADS,),
                    (spec, act, cp.asarray(blob_of[pick]), cp.asarray(wts), h))
                results[pinned] = (cp.asnumpy(act), cp.asnumpy(h))
            # the host tier's blobs, read in place over the bus, give the device copy's bits
            assert all(np.array_equal(a, b) for a, b in zip(results[False], results[True]))
            act, h = results[False]
            want_act = np.zeros((n, K, N_FF))
            want_h = h0.astype(np.float64).copy()
            for i in range(n):
                for r in range(K):
                    g, u, d = (m.astype(np.float64) for m in ex.ref[pick[i, r]])
                    gx, ux = g @ x[i], u @ x[i]
                    want_act[i, r] = gx / (1 + np.exp(-gx)) * ux
                    # each kernel against float64 on its own input: the down kernel on the
                    # activations the gate/up kernel gave (the integer build's gate/up reads
                    # x as ~15 bits, within 1e-4 of its largest activation, and an outlier row
                    # carries that error on into h past 1e-4 of h's update: seen on an H200)
                    want_h[i] += wts[i, r] * (d @ act[i, r].astype(np.float64))
            np.testing.assert_allclose(act, want_act, rtol=1e-4,
                                       atol=1e-4 * np.abs(want_act).max())
            np.testing.assert_allclose(h, want_h, rtol=1e-4, atol=1e-4 * np.abs(want_h - h0).max())
    finally:
        ex.close()


@pytest.mark.parametrize("gate_up,down", PAIRS, ids=ids)
@pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
def test_row_kernels_of_every_type(gate_up, down, mma):
    """A prompt chunk's experts (ops/moe.py): pairs of several experts around the
    FMA slice's 32 and the work item's 128, against float64 numpy (the tensor-core build rounds
    rows and weights to f16); a pair's bits the same alone, and from pinned host memory."""
    from strata_dist.ops.moe import RowsKernels
    ex = Blobs(gate_up, down, seed=int(gate_up) * 10 + int(down))
    try:
        kernels = RowsKernels(0, mma=mma)
        tol = 5e-3 if mma else 1e-4
        rng = np.random.default_rng(8)
        n = 300
        x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
        blob = lambda e: ex.buf[e * ex.stride:e * ex.stride + ex.size]  # noqa: E731
        counts = {0: 1, 3: 31, 5: 33, 7: 129, 6: 200}
        jobs, at = [], 0
        for e, c in counts.items():
            rows = rng.choice(n, c, replace=False)
            jobs.append((blob(e), rows, np.arange(at, at + c)))
            at += c
        out = cp.zeros((at, N_EMBD), cp.float32)
        assert kernels.run_spec(ex.layout, cp.asarray(x), jobs, out)
        got = cp.asnumpy(out)
        for (b, rows, dest), e in zip(jobs, counts):
            g, u, d = (m.astype(np.float64) for m in ex.ref[e])
            gx, ux = x[rows] @ g.T, x[rows] @ u.T
            want = (gx / (1 + np.exp(-gx)) * ux) @ d.T
            np.testing.assert_allclose(got[dest], want, rtol=tol, atol=tol * np.abs(want).max())
            alone = cp.zeros((len(rows), N_EMBD), cp.float32)
            assert kernels.run_spec(ex.layout, cp.asarray(x), [(b, rows, np.arange(len(rows)))],
                                    alone)
            assert np.array_equal(cp.asnumpy(alone), got[dest])
        # the same blob read in place from pinned host memory
        mem = cp.cuda.UnownedMemory(ex.pinned_dev, ex.stride * N_EXPERT, ex)
        host_buf = cp.ndarray((ex.stride * N_EXPERT,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
        b, rows, dest = jobs[-1]
        e = list(counts)[-1]
        from_host = cp.zeros((len(rows), N_EMBD), cp.float32)
        assert kernels.run_spec(ex.layout, cp.asarray(x),
                                [(host_buf[e * ex.stride:e * ex.stride + ex.size], rows,
                                  np.arange(len(rows)))], from_host)
        assert np.array_equal(cp.asnumpy(from_host), got[dest])
    finally:
        ex.close()


def test_a_tensor_no_kernel_reads_is_named_once_at_load(tmp_path, caplog):
    """CupyBackend.dense_tensor (what a stage's load calls for every dense matrix): a TQ2_0 matrix
    is named with its cost once however often it is loaded, and the experts of its layer with
    it; a Q4_0 one (read as stored) is not named."""
    import logging
    from gguf import GGML_QUANT_SIZES, GGUFWriter
    from strata_dist.backends.cupy_backend import CupyBackend
    from strata_dist.gguf_file.reader import GGUFModel
    w = GGUFWriter(str(tmp_path / "t.gguf"), "qwen3moe")
    types = {"blk.0.attn_q.weight": QT.TQ2_0, "blk.0.attn_k.weight": QT.Q4_0,
             "blk.0.ffn_gate_exps.weight": QT.TQ2_0, "blk.0.ffn_up_exps.weight": QT.TQ2_0,
             "blk.0.ffn_down_exps.weight": QT.Q4_K}
    for name, qtype in types.items():
        shape = (2, 256, 256) if "exps" in name else (256, 256)
        block, size = GGML_QUANT_SIZES[qtype]
        w.add_tensor(name, np.zeros((*shape[:-1], 256 // block * size), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFModel(str(tmp_path / "t.gguf"))
    be = CupyBackend(0)
    with caplog.at_level(logging.WARNING, logger="strata.cupy"):
        for _ in range(2):
            be.dense_tensor(g, g.tensor("blk.0.attn_k.weight"))
            be.dense_tensor(g, g.tensor("blk.0.attn_q.weight"))
    lines = [r.getMessage() for r in caplog.records if r.name == "strata.cupy"]
    assert lines[0] == "blk.0.ffn_gate_exps.weight: TQ2_0 has no GPU kernel: decoded on the " \
                       "host to float32 at each use (15.5x the bytes moved), and its stage's " \
                       "decode steps take the general path"
    assert lines[1].startswith("blk.0.ffn_up_exps.weight: TQ2_0 has no GPU kernel")
    assert lines[2] == "blk.0.attn_q.weight: TQ2_0 read as f16, 7.8x the bytes"
    assert len(lines) == 3, lines
