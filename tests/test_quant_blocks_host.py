"""The block decoders every weight-reading kernel uses (kernels/weights.cuh chunk8 / chunk8_q and
quant_blocks.cuh), built for the host with nvcc and run over random rows of every type of the
type table (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS), against gguf-py's
`dequantize`:

- chunk8 (the decoded weights of dequant_rows, embed_tokens, the row kernels' staged tiles and
  the non-factored dots) is gguf-py's float32, bit for bit, for every type but Q4_K and Q5_K,
  which keep their measured fused multiply-add (a * q + b rounded once where gguf-py rounds the
  product, then the sum): within one unit in the last place of the weight there;
- chunk8_q's parts (what the factored dots of the decode kernels read: integers q, the chunk's
  scale a and offset b) put together in gguf-py's order (a * q rounded, then + b) are gguf-py's
  float32 bit for bit for every quantized type, and every q is an integer (IQ1_S / IQ1_M: a
  whole number of eighths, their grid values plus or minus 1/8).

Both conversions of stored integers to floats (CVT_MAGIC 1 and 0) are built. The GPU runs of the
kernels themselves are tests/test_gpu_quant_types.py's. Skips where nvcc is not installed."""
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import KERNEL_TYPES, TYPE_NAMES
from type_rows import ALL_TYPES, random_rows

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
FUSED = {QT.Q4_K, QT.Q5_K}      # chunk8 keeps fmaf(a, q, b) for these
WITH_MIN = {QT.Q4_1, QT.Q5_1, QT.Q2_K, QT.Q4_K, QT.Q5_K}      # b != 0 (weights.cuh has_min)
EIGHTHS = {QT.IQ1_S, QT.IQ1_M}      # q = grid value +- 1/8 (iquants.cuh IQ1_DELTA)

HARNESS = r"""
#include <cstdio>
#include <vector>
#include "weights.cuh"

// chunk c of a row: its 8 decoded weights, then (quantized types) chunk8_q's q[8], a, b
template <int T>
void one_chunk(const u8* row, int c, float* out) {
    chunk8<T>(row, c, out);
    if constexpr (is_quantized(T)) chunk8_q<T>(row, c, out + 8, out[16], out[17]);
}

int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[4];                      // type, row bytes, columns, rows
    if (fread(head, sizeof head, 1, in) != 1) return 1;
    std::vector<unsigned char> raw(head[1] * head[3]);
    if (fread(raw.data(), 1, raw.size(), in) != raw.size()) return 1;
    const int type = (int)head[0], ncols = (int)head[2];
    bool known = false;
    DISPATCH_TYPE(type, (known = true));
    if (!known) return 3;
    printf("%d %d\n", block_cols(type), block_bytes(type));
    for (long long r = 0; r < head[3]; ++r)
        for (int c = 0; c < ncols / 8; ++c) {
            float w[18] = {0};
            DISPATCH_TYPE(type, (one_chunk<TT>(raw.data() + r * head[1], c, w)));
            fwrite(w, sizeof(float), 18, out);
        }
    return 0;
}
"""


@pytest.fixture(scope="module", params=[1, 0], ids=["cvt_magic", "cvt_plain"])
def decoder(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"decoders{request.param}")
    main = tmp / "decoders.cu"
    main.write_text(HARNESS)
    exe = tmp / "decoders"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", f"-DCVT_MAGIC={request.param}",
                           f"-I{KERNEL_DIR}", "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    def run(qtype, raw: np.ndarray, ncols: int):
        data, got = tmp / f"{qtype.name}.bin", tmp / f"{qtype.name}.out"
        data.write_bytes(np.array([int(qtype), raw.shape[1], ncols, raw.shape[0]], np.int64)
                         .tobytes() + np.ascontiguousarray(raw).tobytes())
        done = subprocess.run([str(exe), str(data), str(got)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, (qtype.name, done.returncode)
        out = np.fromfile(got, dtype=np.float32).reshape(raw.shape[0], ncols // 8, 18)
        return done.stdout.split(), out
    return run


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("synth", [False, True], ids=["random_bytes", "synth_blocks"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_block_decoders_are_gguf_py_bit_for_bit(decoder, qtype, synth):
    from gguf import GGML_QUANT_SIZES
    n_rows, ncols = 6, 768                  # 3 super-blocks, 24 legacy blocks a row
    raw, ref = random_rows(qtype, n_rows, ncols, 100 + int(qtype), synth)
    sizes, out = decoder(qtype, raw, ncols)
    # the kernels' type table says what gguf-py's does of the block
    assert [int(v) for v in sizes] == list(GGML_QUANT_SIZES[qtype])
    w = out[..., :8].reshape(n_rows, ncols)
    if qtype in FUSED:
        ulp = np.spacing(np.abs(ref))
        assert (np.abs(w - ref) <= ulp).all(), qtype.name
    else:
        np.testing.assert_array_equal(bits(w), bits(ref), err_msg=qtype.name)
    if qtype in (QT.F32, QT.F16, QT.BF16):
        return
    q, a, b = out[..., 8:16], out[..., 16:17], out[..., 17:18]
    steps = q * (8 if qtype in EIGHTHS else 1)
    assert (steps == np.round(steps)).all() and np.abs(q).max() <= 128, qtype.name
    joined = (a * q).astype(np.float32)                        # float32: rounded, then added
    if qtype in WITH_MIN:
        joined = joined + b
    else:
        assert (b == 0).all(), qtype.name
    np.testing.assert_array_equal(bits(joined.reshape(n_rows, ncols)), bits(ref),
                                  err_msg=qtype.name)


def test_type_table_is_the_hosts(decoder):
    """Every type of kernels/abi.py (TYPE_NAMES, KERNEL_TYPES: what the host picks kernels and
    checks alignment by) has kernels, and a type that is not in the table (Q8_1, which no file
    stores weights in) is not dispatched."""
    assert {int(t) for t in ALL_TYPES} <= set(TYPE_NAMES) == set(KERNEL_TYPES)
    from gguf import GGML_QUANT_SIZES
    for t in ALL_TYPES:         # a row of whole blocks keeps the alignment its loads need
        block, size = GGML_QUANT_SIZES[t]
        assert (8 // block * size if block == 1 else size) % KERNEL_TYPES[int(t)] == 0, t.name
    raw = np.zeros((1, 36), np.uint8)
    with pytest.raises(AssertionError, match="Q8_1"):
        decoder(QT.Q8_1, raw, 32)
