"""The integer expert path's unit dots for i-quants (kernels/experts_int_iq.cuh: IQ4_XS, IQ3_S,
IQ2_XXS) built for the host with nvcc, against gguf-py's decoding in float64: the counterpart of
test_kernels_compile.py's test_integer_expert_path_matches_gguf_on_the_host for Q4_K (kept in its
own file: that one is at the house rules' line limit). Skips where nvcc is not installed."""
import subprocess

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import Q4_K

from test_kernels_compile import NVCC, few_types_option, needs_nvcc

# The unit dots over whole rows, as test_kernels_compile's INT_HARNESS runs q4_k_unit_dot (the
# same quantizer and unit layout); experts_int.cuh does not include the header yet, so this does.
INT_IQ_HARNESS = r"""
#include "experts_int_iq.cuh"
static float unit_dot(int type, const u8* row, int u, const XFrag& f) {
    switch (type) {
        case T_IQ4_XS: return iq4_xs_unit_dot(row, u, f);
        case T_IQ3_S: return iq3_s_unit_dot(row, u, f);
        case T_IQ2_XXS: return iq2_xxs_unit_dot(row, u, f);
    }
    return 0.f;
}
int main(int argc, char** argv) {
    // the register copy of the IQ4 levels must be the generated table
    const u32 words[4] = {IQ4NL_LEVELS_0, IQ4NL_LEVELS_1, IQ4NL_LEVELS_2, IQ4NL_LEVELS_3};
    for (int v = 0; v < 16; ++v)
        if ((signed char)(words[v / 4] >> (8 * (v % 4))) != kvalues_iq4nl[v]) return 4;
    for (u32 s = 0; s < 128; ++s)           // and the computed sign patterns the table's
        if (iq_signs8(s) != ksigns_iq2xs[s]) return 5;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[4];                      // type, row bytes, columns, rows
    float w;                                // the factor folded into x (moe_down's rank weight)
    if (fread(head, sizeof head, 1, in) != 1 || fread(&w, sizeof w, 1, in) != 1) return 1;
    if (head[0] != T_IQ4_XS && head[0] != T_IQ3_S && head[0] != T_IQ2_XXS) return 2;
    const int ncols = (int)head[2];
    std::vector<float> x(ncols);
    std::vector<unsigned char> raw(head[1] * head[3]);
    if (fread(x.data(), sizeof(float), ncols, in) != (size_t)ncols) return 1;
    if (fread(raw.data(), 1, raw.size(), in) != raw.size()) return 1;
    std::vector<u32> h(xq_words(ncols)), l(xq_words(ncols));
    std::vector<float> step(ncols / 32), sum(ncols / 32);
    const XQ q{h.data(), l.data(), step.data(), sum.data()};
    for (int b = 0; b < ncols / 32; ++b)
        xq_block32(x.data() + 32 * b, w, q.h + xq_block_word(b), q.l + xq_block_word(b), q.step[b],
                   q.sum[b]);
    for (long long r = 0; r < head[3]; ++r) {
        float acc = 0.f;
        for (int u = 0; u < ncols / 64; ++u) {
            XFrag f;
            load_xfrag(f, q, u);
            acc += unit_dot((int)head[0], raw.data() + r * head[1], u, f);
        }
        fwrite(&acc, sizeof(float), 1, out);
    }
    return 0;
}
"""


@needs_nvcc
def test_integer_unit_dots_of_iquants_match_gguf_on_the_host(tmp_path):
    """experts_int_iq.cuh's unit dots (IQ4_XS, IQ3_S, IQ2_XXS: their grids, levels and signs as
    int8 into dp4a_s8) built for the host with the integer path's quantizer: random rows of each
    type against gguf-py's decoding in float64, within the quantizer's bound (|x - x'| <= amax /
    64516 per 32-column block) plus float rounding, as the Q4_K test holds; a NaN in x comes out
    as NaN."""
    import numpy as np
    from quant_rows import random_rows
    from gguf import GGMLQuantizationType as QT
    main = tmp_path / "int_iq.cu"
    main.write_text(f'#include <cstdio>\n#include <vector>\n#include "{KERNEL_DIR / "decode.cu"}"\n'
                    + INT_IQ_HARNESS)
    exe = tmp_path / "int_iq"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", f"-I{KERNEL_DIR}",
                           few_types_option(tmp_path, (Q4_K,)), "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(12)

    def run(qtype, x, w, raw):
        data = tmp_path / "in.bin"
        data.write_bytes(np.array([int(qtype), raw.shape[1], x.size, raw.shape[0]], np.int64)
                         .tobytes() + np.float32(w).tobytes() + x.astype(np.float32).tobytes()
                         + raw.tobytes())
        done = subprocess.run([str(exe), str(data), str(tmp_path / "out.bin")], timeout=60)
        assert done.returncode == 0, (qtype.name, done.returncode)
        return np.fromfile(tmp_path / "out.bin", dtype=np.float32)

    for qtype in (QT.IQ4_XS, QT.IQ3_S, QT.IQ2_XXS):
        for ncols, scale in ((768, 1.0), (2048, 30.0)):
            raw, ref = random_rows(qtype, 16, ncols, int(qtype) + ncols)
            assert np.isfinite(ref).all() and (ref != 0).any(), qtype.name
            # activations with a block of zeros, one of tiny values and one spike
            x = (rng.standard_normal(ncols) * scale).astype(np.float32)
            x[64:96], x[96:128] = 0.0, x[96:128] * 1e-6
            x[200] = 40 * scale
            w = np.float32(0.37)
            xw = (x * w).astype(np.float64)
            got = run(qtype, x, w, raw)
            want = ref.astype(np.float64) @ xw
            amax = np.repeat(np.abs(xw).reshape(-1, 32).max(axis=1), 32)
            bound = np.abs(ref) @ (amax / 64516) + 1e-6 * (np.abs(ref) @ np.abs(xw))
            err = np.abs(got - want)
            assert (err <= bound).all(), (qtype.name, ncols, float((err / bound).max()))
            # the path is not just within bounds by luck: far closer than an int8 activation
            rel = err.max() / np.abs(want).max()
            assert rel < 1e-4, (qtype.name, ncols, rel)
        x[5] = np.nan
        assert np.isnan(run(qtype, x, 1.0, raw)).all(), qtype.name


# The unit dots in device code, as the expert kernels would call them on rows read in place: a
# block a row, a thread the units t, t + blockDim.x, ...
INT_IQ_DEVICE = r"""
#include "experts_int_iq.cuh"
template <int T>
__global__ void int_iq_rows(const u8* __restrict__ rows, long long row_bytes, int units, XQ q,
                            float* __restrict__ out) {
    const u8* row = rows + blockIdx.x * row_bytes;
    float acc = 0.f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        XFrag f;
        load_xfrag(f, q, u);
        if constexpr (T == T_IQ4_XS) acc += iq4_xs_unit_dot(row, u, f);
        else if constexpr (T == T_IQ3_S) acc += iq3_s_unit_dot(row, u, f);
        else acc += iq2_xxs_unit_dot(row, u, f);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
template __global__ void int_iq_rows<T_IQ4_XS>(const u8*, long long, int, XQ, float*);
template __global__ void int_iq_rows<T_IQ3_S>(const u8*, long long, int, XQ, float*);
template __global__ void int_iq_rows<T_IQ2_XXS>(const u8*, long long, int, XQ, float*);
"""


@needs_nvcc
def test_integer_unit_dots_of_iquants_build_for_hopper_in_registers(tmp_path):
    """The same functions compiled for sm_90 (their device branches: __byte_perm, __dp4a, __ldg),
    warnings as errors, and each kernel using them without a stack frame (the 8 packed words of a
    half unit and the fragment stay in registers)."""
    import re
    main = tmp_path / "int_iq_device.cu"
    main.write_text(f'#include "{KERNEL_DIR / "decode.cu"}"\n' + INT_IQ_DEVICE)
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--std=c++17", "-Werror=all-warnings",
                           "-Xptxas", "-v", f"-I{KERNEL_DIR}", few_types_option(tmp_path, (Q4_K,)),
                           "-o", str(tmp_path / "k.cubin"), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stacks = dict(re.findall(r"Function properties for (\w*int_iq_rows\w*)\n\s+(\d+) bytes stack "
                             r"frame", done.stderr))
    assert len(stacks) == 3, done.stderr[-2000:]
    assert all(v == "0" for v in stacks.values()), stacks
