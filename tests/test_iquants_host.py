"""The i-quant decoders (kernels/iquants.cuh) built for the host with nvcc, against gguf-py's
`dequantize` on random valid blocks of every type: bit for bit, since each weight is gguf-py's
scale expression in its order times an exact value. Also: the same source builds for sm_90 with
every type instantiated in a kernel, and the generated table header is what
kernels/gen_iq_tables.py writes from gguf-py's numbers now (no drift). Skips the builds where
nvcc is not installed."""
import shutil
import subprocess

import gguf
import numpy as np
import pytest

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels import gen_iq_tables
from strata_dist.synth.blocks import IQUANT_TYPES, random_blocks

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
T = gguf.GGMLQuantizationType
TYPES = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS]

# One case per type: the harness decodes blocks with iq_block<T> (every chunk through
# iq_chunk8_q) and, as a second path, the chunks in reverse order through iq_chunk8 with plain
# loads (NC = false), so both template forms are checked.
HARNESS = r"""
#include <cstdio>
#include <vector>
#include "weights.cuh"
#include "iquants.cuh"

template <int T>
static void decode(const std::vector<u8>& in, long n_blocks, std::vector<float>& out,
                   std::vector<float>& out2) {
    const int size = iq_block_bytes(T), vals = iq_block_values(T);
    out.resize(n_blocks * vals);
    out2.resize(n_blocks * vals);
    for (long i = 0; i < n_blocks; ++i) iq_block<T>(in.data() + i * size, out.data() + i * vals);
    const long chunks = n_blocks * vals / 8;
    for (long c = chunks - 1; c >= 0; --c) iq_chunk8<T, false>(in.data(), (int)c, out2.data() + 8 * c);
}

int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    int type; long n_blocks, n_bytes;
    if (fread(&type, 4, 1, f) != 1 || fread(&n_blocks, 8, 1, f) != 1 || fread(&n_bytes, 8, 1, f) != 1) return 1;
    std::vector<u8> in(n_bytes);
    if (fread(in.data(), 1, n_bytes, f) != (size_t)n_bytes) return 1;
    std::vector<float> out, out2;
    switch (type) {
#define CASE(T) case T: decode<T>(in, n_blocks, out, out2); break;
        CASE(T_IQ2_XXS) CASE(T_IQ2_XS) CASE(T_IQ3_XXS) CASE(T_IQ1_S) CASE(T_IQ4_NL)
        CASE(T_IQ3_S) CASE(T_IQ2_S) CASE(T_IQ4_XS) CASE(T_IQ1_M)
        default: return 3;
    }
    FILE* o = fopen(argv[2], "wb");
    fwrite(out.data(), 4, out.size(), o);
    fwrite(out2.data(), 4, out2.size(), o);
    return fclose(o) == 0 ? 0 : 1;
}
"""

DEVICE = r"""
#include "weights.cuh"
#include "iquants.cuh"
template <int T>
__global__ void decode_rows(const u8* __restrict__ rows, long row_bytes, int chunks, float* out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= chunks) return;
    float w[8];
    iq_chunk8<T>(rows + blockIdx.y * row_bytes, c, w);
    for (int l = 0; l < 8; ++l) out[((long)blockIdx.y * chunks + c) * 8 + l] = w[l];
}
template __global__ void decode_rows<T_IQ2_XXS>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ2_XS>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ3_XXS>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ1_S>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ4_NL>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ3_S>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ2_S>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ4_XS>(const u8*, long, int, float*);
template __global__ void decode_rows<T_IQ1_M>(const u8*, long, int, float*);
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("iq")
    (tmp / "iq.cu").write_text(HARNESS)
    exe = tmp / "iq"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-I", str(KERNEL_DIR), "-o", str(exe),
                           str(tmp / "iq.cu")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe, tmp


def _decode(harness, t: T, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    exe, tmp = harness
    data = np.ascontiguousarray(blocks, np.uint8).tobytes()
    head = np.array([int(t)], np.int32).tobytes() + np.array([len(blocks), len(data)], np.int64).tobytes()
    (tmp / "in.bin").write_bytes(head + data)
    subprocess.run([str(exe), str(tmp / "in.bin"), str(tmp / "out.bin")], check=True, timeout=60)
    got = np.fromfile(tmp / "out.bin", np.float32)
    return got[:got.size // 2], got[got.size // 2:]


def _raw_blocks(t: T, rng: np.random.Generator, n: int) -> np.ndarray:
    """Every bit random except the f16 scale fields, which get finite values of either sign
    (the formats' other fields have no invalid values: every index is in its grid)."""
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = (rng.standard_normal(n) * 1e-3).astype(np.float16).view(np.uint16)
    if t == T.IQ1_M:                   # d's nibbles in the top of the 4 scale words
        words = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = words.view(np.uint8)
    else:
        b[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    return b


@needs_nvcc
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_iquant_decodes_bit_for_bit_as_gguf_py(harness, t):
    rng = np.random.default_rng(int(t))
    blocks = np.concatenate([_raw_blocks(t, rng, 600), random_blocks(t, np.random.SFC64(int(t)), 200, 0.03)])
    want = gguf.quants.dequantize(blocks, t).ravel()
    assert np.isfinite(want).all()
    got, got_chunks = _decode(harness, t, blocks)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(got_chunks.view(np.uint32), want.astype(np.float32).view(np.uint32))


@needs_nvcc
def test_decoders_build_for_the_gpu_with_every_type(tmp_path):
    (tmp_path / "dev.cu").write_text(DEVICE)
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-I", str(KERNEL_DIR), "-cubin", "-o",
                           str(tmp_path / "dev.cubin"), str(tmp_path / "dev.cu")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_decoders_build_with_nvrtc_as_cupy_does():
    """The kernels reach the GPU through NVRTC (no system headers, __CUDA_ARCH__ always set: the
    tables are device arrays there): the same source, its headers inlined as kernels.source_text
    inlines them (weights.cuh brings iquants.cuh)."""
    import ctypes
    from test_kernels_compile import _cuda_include, _nvrtc
    from strata_dist.kernels import COMPILE_OPTIONS, source_text
    lib, include = _nvrtc(), _cuda_include()
    if lib is None or include is None:
        pytest.skip("no NVRTC library or CUDA headers")
    text = source_text("weights.cuh") + DEVICE.split('#include "iquants.cuh"', 1)[1]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"iq.cu", 0, None, None) == 0
    opts = [o.encode() for o in (*COMPILE_OPTIONS, "-arch=compute_90", f"-I{include}")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")


def test_table_header_is_what_the_generator_writes_from_gguf_py():
    assert (KERNEL_DIR / "iq_tables.cuh").read_text() == gen_iq_tables.render()
    assert gen_iq_tables.main(["--check"]) == 0


def test_generated_tables_are_gguf_py_numbers():
    """The words decode back to gguf-py's grids; the sign patterns have an even count of
    negatives (the 8th sign is the parity of the 7 stored)."""
    for _, cls, width in gen_iq_tables.GRIDS:
        words = np.array(gen_iq_tables.grid_words(cls, width), np.uint64)
        back = ((words[:, None] >> (8 * np.arange(width, dtype=np.uint64))) & 0xFF).astype(np.uint8)
        np.testing.assert_array_equal(back.view(np.int8) if cls is gguf.quants.IQ1_S else back,
                                      gen_iq_tables.grid_values(cls))
    signs = np.array(gen_iq_tables.ksigns(), np.uint8)
    assert len(signs) == 128 and all(bin(int(s)).count("1") % 2 == 0 for s in signs)
    assert ((signs & 0x7F) == np.arange(128)).all()
    assert gen_iq_tables.iq4nl_levels() == list(gguf.quants.IQ4_NL.kvalues)
    assert set(IQUANT_TYPES) == set(TYPES)
