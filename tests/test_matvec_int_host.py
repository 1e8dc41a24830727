"""The integer path of the dense decode matvecs (kernels/matvec_int.cuh, KernelShape int_matvec)
built for the host with nvcc and run against gguf-py: a dense row's dot through the path's
activation quantizer (matvec_xq_block32, with the fused RMSNorm folded in) and each type's unit
dot (int_unit_dot<T>), for every type the path takes, in float64. No GPU needed; skips where
nvcc is not installed. The GPU kernels themselves are tested in tests/test_gpu_kernels.py."""
import subprocess

import pytest

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import (F16, IQ2_XXS, IQ3_S, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
                                     Q8_0, KernelShape)

from test_experts_int_host import HOST_INT_PATH
from test_kernels_compile import NVCC, few_types_option, needs_nvcc

MATVEC_INT_TYPES = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ2_XXS)

# One dense row dot as matvec_int_dots takes it: inv = 1 / rms(x) (when a norm is given), each
# 32-column block through matvec_xq_block32 (x * inv * norm_w, then quantized), the row's units
# through int_unit_dot<T>. Exit 2: a type matvec_int_type leaves on the float path; 3: rows the
# path's alignment check (int_row_align) refuses at that shift.
MATVEC_HARNESS = HOST_INT_PATH + r"""
template <int T>
int dot_rows(const u8* raw, long long row_bytes, long long nrows, const XQ& q, int ncols,
             FILE* out) {
    if (!matvec_int_type(T)) return 2;
    for (long long r = 0; r < nrows; ++r) {
        const float acc = row_dot<T>(raw + r * row_bytes, q, ncols);
        fwrite(&acc, sizeof(float), 1, out);
    }
    return 0;
}

int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[6];                      // type, row bytes, columns, rows, shift, with norm
    float eps;
    if (fread(head, sizeof head, 1, in) != 1 || fread(&eps, sizeof eps, 1, in) != 1) return 1;
    const int type = (int)head[0], ncols = (int)head[2];
    if (ncols % 64 != 0) return 3;
    std::vector<float> x(ncols), norm_w(ncols);
    std::vector<unsigned char> buf(head[1] * head[3] + 32);
    u8* raw = buf.data() + (16 - (reinterpret_cast<unsigned long long>(buf.data()) & 15)) + head[4];
    if (fread(x.data(), sizeof(float), ncols, in) != (size_t)ncols) return 1;
    if (fread(norm_w.data(), sizeof(float), ncols, in) != (size_t)ncols) return 1;
    if (fread(raw, 1, head[1] * head[3], in) != (size_t)(head[1] * head[3])) return 1;
    float inv = 1.f;
    if (head[5]) {
        float ss = 0.f;
        for (int c = 0; c < ncols; ++c) ss = fmaf(x[c], x[c], ss);
        inv = 1.f / sqrtf(ss / (float)ncols + eps);
    }
    std::vector<u32> h(xq_words(ncols)), l(xq_words(ncols));
    std::vector<float> step(ncols / 32), sum(ncols / 32);
    const XQ q{h.data(), l.data(), step.data(), sum.data()};
    for (int b = 0; b < ncols / 32; ++b) {
        float v[32];
        for (int j = 0; j < 32; ++j) v[j] = x[32 * b + j];
        matvec_xq_block32(v, head[5] ? norm_w.data() + 32 * b : nullptr, inv,
                          q.h + xq_block_word(b), q.l + xq_block_word(b), q.step[b], q.sum[b]);
    }
    // the kernel's check (matvec_int_ok): rows at this address and row size readable in place
    const bool ok = [&] {
        switch (type) {
#define OK_CASE(T) case T: return matvec_int_ok_bits<T>((unsigned long long)raw | (unsigned long long)head[1], ncols);
        OK_CASE(T_Q4_K) OK_CASE(T_Q5_K) OK_CASE(T_Q6_K) OK_CASE(T_Q3_K) OK_CASE(T_Q2_K)
        OK_CASE(T_IQ4_XS) OK_CASE(T_IQ3_S) OK_CASE(T_IQ2_XXS)
        default: return true;
        }
    }();
    if (!ok) return 3;
    switch (type) {
    case T_Q4_K: return dot_rows<T_Q4_K>(raw, head[1], head[3], q, ncols, out);
    case T_Q5_K: return dot_rows<T_Q5_K>(raw, head[1], head[3], q, ncols, out);
    case T_Q6_K: return dot_rows<T_Q6_K>(raw, head[1], head[3], q, ncols, out);
    case T_Q3_K: return dot_rows<T_Q3_K>(raw, head[1], head[3], q, ncols, out);
    case T_Q2_K: return dot_rows<T_Q2_K>(raw, head[1], head[3], q, ncols, out);
    case T_IQ4_XS: return dot_rows<T_IQ4_XS>(raw, head[1], head[3], q, ncols, out);
    case T_IQ3_S: return dot_rows<T_IQ3_S>(raw, head[1], head[3], q, ncols, out);
    case T_IQ2_XXS: return dot_rows<T_IQ2_XXS>(raw, head[1], head[3], q, ncols, out);
    case T_F16: return dot_rows<T_F16>(raw, head[1], head[3], q, ncols, out);
    default: return dot_rows<T_Q8_0>(raw, head[1], head[3], q, ncols, out);
    }
}
"""


def _build(tmp_path, shape: str):
    main = tmp_path / "matvec_int.cu"
    main.write_text(f'#include <cstdio>\n#include <cmath>\n#include <vector>\n'
                    f'#include "{KERNEL_DIR / "decode.cu"}"\n' + MATVEC_HARNESS)
    exe = tmp_path / "matvec_int"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", *KernelShape.parse(shape).defines(),
                           few_types_option(tmp_path, MATVEC_INT_TYPES + (F16, Q8_0)),
                           "-o", str(exe), str(main)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return exe


def _run(tmp_path, exe, qtype, x, norm_w, raw, shift, with_norm, eps=1e-6):
    import numpy as np
    data = tmp_path / "in.bin"
    data.write_bytes(np.array([int(qtype), raw.shape[1], x.size, raw.shape[0], shift,
                               int(with_norm)], np.int64).tobytes() + np.float32(eps).tobytes()
                     + x.astype(np.float32).tobytes() + norm_w.astype(np.float32).tobytes()
                     + raw.tobytes())
    done = subprocess.run([str(exe), str(data), str(tmp_path / "out.bin")], timeout=60)
    if done.returncode != 0:
        return done.returncode, None
    return 0, np.fromfile(tmp_path / "out.bin", dtype=np.float32)


@pytest.fixture(scope="module")
def int_matvec_exe(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not installed")
    return _build(tmp_path_factory.mktemp("int_matvec"), "int_matvec=1")


@needs_nvcc
@pytest.mark.parametrize("with_norm", [False, True])
def test_dense_int_matvec_matches_gguf_on_the_host(tmp_path, int_matvec_exe, with_norm):
    """Each type's dense row dot on the integer path (int_matvec=1, every expert switch off: the
    matvec path does not depend on them), with and without the fused RMSNorm, over random rows of
    2048 and 4096 columns (the widths Qwen3-30B's dense matrices read), against gguf-py's decoding
    in float64 of W @ (x * inv * norm_w). Bound: the quantizer's |x - x'| <= amax / 64516 per
    32-column block (amax of the normed activations) plus float rounding (1e-5 of |W| @ |x|,
    which also covers inv's float32 rounding). Rows start at the least alignment the path
    accepts (int_row_align), and a NaN in x comes out as NaN."""
    import numpy as np
    import type_rows
    from gguf import GGMLQuantizationType as QT
    from strata_dist.kernels.abi import TYPE_NAMES  # noqa: F401 (the table the build reads)
    rng = np.random.default_rng(5)
    aligns = {Q4_K: 16, Q5_K: 16, Q6_K: 2, Q3_K: 2, Q2_K: 4, IQ4_XS: 8, IQ3_S: 2, IQ2_XXS: 2}
    eps = 1e-6
    for t in MATVEC_INT_TYPES:
        qtype = QT(t)
        for ncols, scale in ((2048, 1.0), (4096, 20.0)):
            raw, ref = type_rows.random_rows(qtype, 8, ncols, t * 7 + ncols)
            x = (rng.standard_normal(ncols) * scale).astype(np.float32)
            x[64:96] = 0.0
            x[300] = 30 * scale
            norm_w = (rng.standard_normal(ncols) * 0.5 + 1.0).astype(np.float32)
            xd = x.astype(np.float64)
            if with_norm:
                inv = 1.0 / np.sqrt((xd * xd).mean() + eps)
                xn = xd * inv * norm_w.astype(np.float64)
            else:
                xn = xd
            want = ref.astype(np.float64) @ xn
            amax = np.repeat(np.abs(xn).reshape(-1, 32).max(axis=1), 32)
            bound = np.abs(ref) @ (amax / 64516) + 1e-5 * (np.abs(ref) @ np.abs(xn))
            for shift in (0, aligns[t]) if aligns[t] < 16 else (0,):
                rc, got = _run(tmp_path, int_matvec_exe, qtype, x, norm_w, raw, shift, with_norm)
                assert rc == 0, (qtype.name, shift, rc)
                err = np.abs(got - want)
                assert (err <= bound).all(), (qtype.name, ncols, shift, float((err / bound).max()))
            if aligns[t] > 2:       # an address the unit dot cannot read: the float path's
                rc, _ = _run(tmp_path, int_matvec_exe, qtype, x, norm_w, raw, aligns[t] // 2,
                             with_norm)
                assert rc == 3, qtype.name
        x[7] = np.nan
        rc, got = _run(tmp_path, int_matvec_exe, qtype, x, norm_w, raw, 0, with_norm)
        assert rc == 0 and np.isnan(got).all(), qtype.name


@needs_nvcc
def test_only_the_unit_dot_types_take_the_dense_integer_path(tmp_path, int_matvec_exe):
    """F16 and Q8_0 (no unit dot) keep the float path in the int_matvec build (the harness exits
    2 for them), and the default build (int_matvec=0) puts no type on it."""
    import numpy as np
    import type_rows
    from gguf import GGMLQuantizationType as QT
    x, norm_w = np.ones(256, np.float32), np.ones(256, np.float32)

    def rc_of(exe, t):
        raw, _ = type_rows.random_rows(QT(t), 2, 256, 3)
        return _run(tmp_path, exe, QT(t), x, norm_w, raw, 0, False)[0]

    assert [rc_of(int_matvec_exe, t) for t in (F16, Q8_0, Q4_K)] == [2, 2, 0]
    default = _build(tmp_path, "")
    assert [rc_of(default, t) for t in MATVEC_INT_TYPES] == [2] * len(MATVEC_INT_TYPES)
