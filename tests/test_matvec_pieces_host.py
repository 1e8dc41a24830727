"""The Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and Q8_0 matvecs in pieces (kernels/matvec_pieces.cuh,
KernelShape matvec_pieces) built for the host with nvcc: a row's dot product in the kernel's order
(lane l of warp k of a pair the pieces l + 32k, then every 64, through row_piece and k_piece_dot,
then each warp's xor tree, then the two warps' sums in order) against gguf-py's decoding in
float64, and the build with the switch compiles for the GPU. The GPU launches themselves are
tests/test_gpu_decode.py's. Skips where nvcc is not installed."""
import subprocess

import numpy as np
import pytest

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import PIECE_TYPES, KernelShape
from test_kernels_compile import NVCC, few_types_option, needs_nvcc

HARNESS = r"""
// one row's dot product as a pair of warps of matvec_pieces_rows sums it
template <int T>
static float pieces_row_dot(const unsigned char* row, const float* x, int ncols) {
    const int pieces = piece_count<T>(ncols);
    float total = 0.f;
    for (int share = 0; share < PIECE_SPLIT; ++share) {     // the warps of a pair, in order
        float lane_acc[32];
        for (int lane = 0; lane < 32; ++lane) {
            float acc = 0.f;
            for (int t = lane + 32 * share; t < pieces; t += 32 * PIECE_SPLIT) {
                const int col = piece_first_col<T>(t);
                const KPiece<T> w = row_piece<T>(row, t);
                const int hi = col + piece_hi(T);
                acc = k_piece_dot<T>(w, x + col, x + hi, sum16(x + col), sum16(x + hi), acc);
            }
            lane_acc[lane] = acc;
        }
        for (int o = 16; o > 0; o >>= 1) {       // warp_sum's xor tree
            float next[32];
            for (int lane = 0; lane < 32; ++lane) next[lane] = lane_acc[lane] + lane_acc[lane ^ o];
            memcpy(lane_acc, next, sizeof next);
        }
        total = share == 0 ? lane_acc[0] : total + lane_acc[0];
    }
    return total;
}

int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[4];                      // type, row bytes, columns, rows
    if (fread(head, sizeof head, 1, in) != 1) return 1;
    const int type = (int)head[0];
    head[0] = head[1]; head[1] = head[2]; head[2] = head[3];
    std::vector<float> x(head[1]);
    std::vector<unsigned char> raw(head[0] * head[2]);
    if (fread(x.data(), sizeof(float), x.size(), in) != x.size()) return 1;
    if (fread(raw.data(), 1, raw.size(), in) != raw.size()) return 1;
    for (long long r = 0; r < head[2]; ++r) {
        const unsigned char* row = raw.data() + r * head[0];
        const int c = (int)head[1];
        const float v = type == T_Q5_K   ? pieces_row_dot<T_Q5_K>(row, x.data(), c)
                        : type == T_Q6_K ? pieces_row_dot<T_Q6_K>(row, x.data(), c)
                        : type == T_Q3_K ? pieces_row_dot<T_Q3_K>(row, x.data(), c)
                        : type == T_Q2_K ? pieces_row_dot<T_Q2_K>(row, x.data(), c)
                        : type == T_Q8_0 ? pieces_row_dot<T_Q8_0>(row, x.data(), c)
                                         : pieces_row_dot<T_Q4_K>(row, x.data(), c);
        fwrite(&v, sizeof(float), 1, out);
    }
    return 0;
}
"""


@needs_nvcc
def test_k_quant_pieces_match_gguf_on_the_host(tmp_path):
    """Random Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and Q8_0 rows (every 6-bit scale and min, both nibbles, every
    fifth bit, d and dmin varied; Q6_K every 2-bit top and int8 scale, its 630-byte rows 2-byte
    aligned; Q3_K every 2-bit field, hmask bit and 6-bit scale, its 330-byte rows 2-byte aligned;
    Q2_K every 2-bit field and 4-bit scale and min, 252-byte rows 4-byte aligned; Q8_0 every int8,
    816-byte rows 2-byte aligned) of 768 and
    4,096 columns (3 and 16 super-blocks: fewer pieces than lanes, and several rounds of a warp)
    against gguf-py's dequantize in float64: within float32 rounding of the sums. The build is
    decode.cu with matvec_pieces=1 (its kernels compiled for sm_90 as well)."""
    from quant_rows import random_rows
    from gguf import GGMLQuantizationType as QT
    main = tmp_path / "pieces.cu"
    main.write_text('#include <cstdio>\n#include <cstring>\n#include <vector>\n'
                    f'#include "{KERNEL_DIR / "decode.cu"}"\n' + HARNESS)
    exe = tmp_path / "pieces"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-Werror", "all-warnings",
                           *KernelShape.parse("matvec_pieces=1").defines(),
                           few_types_option(tmp_path, PIECE_TYPES), "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(5)
    for qtype in (QT(t) for t in PIECE_TYPES):
        for ncols in (768, 4096):
            raw, ref = random_rows(qtype, 24, ncols, ncols + int(qtype))
            x = rng.standard_normal(ncols).astype(np.float32)
            x[100] = 30.0                                   # a spike, as residual streams have
            data = tmp_path / "in.bin"
            data.write_bytes(np.array([int(qtype), raw.shape[1], ncols, raw.shape[0]], np.int64)
                             .tobytes() + x.tobytes() + raw.tobytes())
            subprocess.run([str(exe), str(data), str(tmp_path / "out.bin")], check=True,
                           timeout=60)
            got = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
            want = ref.astype(np.float64) @ x.astype(np.float64)
            bound = 1e-5 * (np.abs(ref).astype(np.float64) @ np.abs(x.astype(np.float64)))
            err = np.abs(got - want)
            assert (err <= bound).all(), (qtype.name, ncols, float((err / bound).max()))


def test_pieces_are_the_default_and_give_way_to_tensor_cores():
    """matvec_pieces is the default build (no -D); matvec_pieces=0 the plain matvecs; matvec_mma=1
    alone takes the K-quant matvecs off pieces, and both at once are refused."""
    assert KernelShape().matvec_pieces == 1
    assert KernelShape.parse("matvec_pieces=1").defines() == ()
    assert KernelShape.parse("matvec_pieces=0").defines() == ("-DMATVEC_PIECES=0",)
    assert KernelShape.parse("matvec_mma=1").matvec_pieces == 0
    assert KernelShape.parse("matvec_mma=1").defines() == ("-DMATVEC_MMA=1", "-DMATVEC_PIECES=0")
    with pytest.raises(ValueError, match="matvec_mma=1 with matvec_pieces=1"):
        KernelShape.parse("matvec_mma=1,matvec_pieces=1")
