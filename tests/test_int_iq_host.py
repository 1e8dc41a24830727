"""The integer expert path's i-quants (kernels/experts_int_iq.cuh: IQ4_XS, IQ3_S, IQ2_XXS, on the
path behind KernelShape int_iq4_xs / int_iq3_s / int_iq2_xxs) built for the host with nvcc and
driven through experts_int.cuh's int_unit_dot<T> (the dispatch the expert kernels call), against
gguf-py's decoding in float64: the counterpart of test_experts_int_host.py's K-quant test (kept in
its own file for now). Skips where nvcc is not installed."""
import subprocess

import pytest

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import IQ2_XXS, IQ3_S, IQ4_XS, Q4_K, KernelShape

from test_experts_int_host import HOST_INT_PATH
from test_kernels_compile import NVCC, few_types_option, needs_nvcc

# the switches that put the three i-quants on the integer path (abi.py INT_TYPE_SWITCHES): on by
# default, named here so the tests keep their meaning whatever the defaults; and the same off
IQ_PATH_SHAPE = "int_iq4_xs=1,int_iq3_s=1,int_iq2_xxs=1"
IQ_PATH_OFF = "int_iq4_xs=0,int_iq3_s=0,int_iq2_xxs=0"

# The unit dots over whole rows through int_unit_dot<T>, with the integer path's quantizer and unit
# layout (as test_experts_int_host.py's INT_HARNESS). A type its build leaves off the path
# (int_type false) exits 2; rows start `shift` bytes past 16-byte alignment (a multiple of
# int_row_align, else exit 3, as where int_direct(T) is false), so the loads meet the least
# alignment the kernels accept.
INT_IQ_HARNESS = HOST_INT_PATH + r"""
int main(int argc, char** argv) {
    // the register copy of the IQ4 levels must be the generated table
    const u32 words[4] = {IQ4NL_LEVELS_0, IQ4NL_LEVELS_1, IQ4NL_LEVELS_2, IQ4NL_LEVELS_3};
    for (int v = 0; v < 16; ++v)
        if ((signed char)(words[v / 4] >> (8 * (v % 4))) != kvalues_iq4nl[v]) return 4;
    for (u32 s = 0; s < 128; ++s)           // and the computed sign patterns the table's
        if (iq_signs8(s) != ksigns_iq2xs[s]) return 5;
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[5];                      // type, row bytes, columns, rows, shift
    float w;                                // the factor folded into x (moe_down's rank weight)
    if (fread(head, sizeof head, 1, in) != 1 || fread(&w, sizeof w, 1, in) != 1) return 1;
    const int type = (int)head[0];
    if (!(type == T_IQ4_XS && int_type(T_IQ4_XS)) && !(type == T_IQ3_S && int_type(T_IQ3_S)) &&
        !(type == T_IQ2_XXS && int_type(T_IQ2_XXS)))
        return 2;                           // not a type this build puts on the integer path
    if (head[4] % int_row_align(type) != 0 || !int_direct(type)) return 3;
    const int ncols = (int)head[2];
    std::vector<float> x(ncols);
    std::vector<unsigned char> buf(head[1] * head[3] + 32);
    u8* raw = buf.data() + (16 - (reinterpret_cast<unsigned long long>(buf.data()) & 15)) + head[4];
    if (fread(x.data(), sizeof(float), ncols, in) != (size_t)ncols) return 1;
    if (fread(raw, 1, head[1] * head[3], in) != (size_t)(head[1] * head[3])) return 1;
    const HostXQ xq(x.data(), w, ncols);
    const XQ& q = xq.q;
    for (long long r = 0; r < head[3]; ++r) {
        const u8* row = raw + r * head[1];
        const float acc = type == T_IQ4_XS ? row_dot<T_IQ4_XS>(row, q, ncols)
                        : type == T_IQ3_S ? row_dot<T_IQ3_S>(row, q, ncols)
                                          : row_dot<T_IQ2_XXS>(row, q, ncols);
        fwrite(&acc, sizeof(float), 1, out);
    }
    return 0;
}
"""


# the least alignment each type's rows need on the path (experts_int.cuh int_row_align: IQ4_XS's
# 136-byte blocks keep 8-byte loads aligned, IQ3_S's 110 and IQ2_XXS's 66 only 2-byte ones)
ROW_ALIGN = {IQ4_XS: 8, IQ3_S: 2, IQ2_XXS: 2}


def _build(tmp_path, shape: str):
    main = tmp_path / "int_iq.cu"
    main.write_text(f'#include <cstdio>\n#include <vector>\n#include "{KERNEL_DIR / "decode.cu"}"\n'
                    + INT_IQ_HARNESS)
    exe = tmp_path / f"int_iq_{len(shape)}"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", f"-I{KERNEL_DIR}",
                           *KernelShape.parse(shape).defines(),
                           few_types_option(tmp_path, (Q4_K,)), "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe


def _run(tmp_path, exe, qtype, x, w, raw, shift: int = 0) -> tuple[int, "np.ndarray"]:
    """(exit code, the rows' dots) of the harness on these rows and activations."""
    import numpy as np
    data = tmp_path / "in.bin"
    data.write_bytes(np.array([int(qtype), raw.shape[1], x.size, raw.shape[0], shift], np.int64)
                     .tobytes() + np.float32(w).tobytes() + x.astype(np.float32).tobytes()
                     + raw.tobytes())
    out = tmp_path / "out.bin"
    out.unlink(missing_ok=True)
    done = subprocess.run([str(exe), str(data), str(out)], timeout=60)
    got = np.fromfile(out, dtype=np.float32) if out.exists() else np.zeros(0, np.float32)
    return done.returncode, got


@needs_nvcc
def test_integer_unit_dots_of_iquants_match_gguf_on_the_host(tmp_path):
    """experts_int_iq.cuh's unit dots (IQ4_XS, IQ3_S, IQ2_XXS: their grids, levels and signs as
    int8 into dp4a_s8) through int_unit_dot<T>, built for the host with their switches on and the
    integer path's quantizer: random rows of each type, starting 16-byte aligned or only
    int_row_align past (8 / 2 / 2 bytes), against gguf-py's decoding in float64, within the
    quantizer's bound (|x - x'| <= amax / 64516 per 32-column block) plus float rounding, as the
    K-quant test holds; a NaN in x comes out as NaN; a start less aligned than int_row_align is
    refused (the alignment the kernels check, int_aligned). Built with int_direct=0, which must not
    move them off reading in place."""
    import numpy as np
    from quant_rows import random_rows
    from gguf import GGMLQuantizationType as QT
    # int_direct=0 too: the i-quants are read in place whatever it says (the harness exits 3
    # where int_direct(T) is false)
    exe = _build(tmp_path, IQ_PATH_SHAPE + ",int_direct=0")
    rng = np.random.default_rng(12)

    def run(qtype, x, w, raw, shift=0):
        rc, got = _run(tmp_path, exe, qtype, x, w, raw, shift)
        assert rc == 0, (qtype.name, shift, rc)
        return got

    for qtype in (QT.IQ4_XS, QT.IQ3_S, QT.IQ2_XXS):
        align = ROW_ALIGN[int(qtype)]
        for ncols, scale in ((768, 1.0), (2048, 30.0)):
            raw, ref = random_rows(qtype, 16, ncols, int(qtype) + ncols)
            assert np.isfinite(ref).all() and (ref != 0).any(), qtype.name
            # activations with a block of zeros, one of tiny values and one spike
            x = (rng.standard_normal(ncols) * scale).astype(np.float32)
            x[64:96], x[96:128] = 0.0, x[96:128] * 1e-6
            x[200] = 40 * scale
            w = np.float32(0.37)
            xw = (x * w).astype(np.float64)
            want = ref.astype(np.float64) @ xw
            amax = np.repeat(np.abs(xw).reshape(-1, 32).max(axis=1), 32)
            bound = np.abs(ref) @ (amax / 64516) + 1e-6 * (np.abs(ref) @ np.abs(xw))
            for shift in (0, align):
                got = run(qtype, x, w, raw, shift)
                err = np.abs(got - want)
                assert (err <= bound).all(), (qtype.name, ncols, shift,
                                              float((err / bound).max()))
                # the path is not just within bounds by luck: far closer than an int8 activation
                rel = err.max() / np.abs(want).max()
                assert rel < 1e-4, (qtype.name, ncols, shift, rel)
        x[5] = np.nan
        assert np.isnan(run(qtype, x, 1.0, raw)).all(), qtype.name
        assert _run(tmp_path, exe, qtype, x, 1.0, raw, align // 2)[0] == 3, qtype.name


@needs_nvcc
@pytest.mark.parametrize("shape, want_rc", [("", 0), (IQ_PATH_OFF, 2)],
                         ids=["default", "switches_0"])
def test_iquants_take_the_integer_path_by_default_and_leave_it_at_0(tmp_path, shape, want_rc):
    """The default build (int_iq4_xs, int_iq3_s, int_iq2_xxs 1, measured faster) puts the three
    i-quants on the integer path: the harness built with it takes their rows; built with the
    switches 0 it refuses them (int_type false, exit 2), so the switches, not the unit dots
    alone, decide the path."""
    import numpy as np
    from quant_rows import random_rows
    from gguf import GGMLQuantizationType as QT
    exe = _build(tmp_path, shape)
    for qtype in (QT.IQ4_XS, QT.IQ3_S, QT.IQ2_XXS):
        raw, _ = random_rows(qtype, 2, 256, 3)
        assert _run(tmp_path, exe, qtype, np.ones(256, np.float32), 1.0, raw)[0] == want_rc, \
            (shape, qtype.name)


# The unit dots in device code through int_unit_dot<T>, as the expert kernels call them on rows
# read in place: a block a row, a thread the units t, t + blockDim.x, ...
INT_IQ_DEVICE = r"""
template <int T>
__global__ void int_iq_rows(const u8* __restrict__ rows, long long row_bytes, int units, XQ q,
                            float* __restrict__ out) {
    const u8* row = rows + blockIdx.x * row_bytes;
    float acc = 0.f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        XFrag f;
        load_xfrag(f, q, u);
        acc += int_unit_dot<T>(row, u, f);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
template __global__ void int_iq_rows<T_IQ4_XS>(const u8*, long long, int, XQ, float*);
template __global__ void int_iq_rows<T_IQ3_S>(const u8*, long long, int, XQ, float*);
template __global__ void int_iq_rows<T_IQ2_XXS>(const u8*, long long, int, XQ, float*);
"""


@needs_nvcc
def test_integer_unit_dots_of_iquants_build_for_hopper_in_registers(tmp_path):
    """The same dispatch compiled for sm_90 with the three switches on (the unit dots' device
    branches: __byte_perm, __dp4a, __ldg), warnings as errors, and each kernel using them without
    a stack frame (the 8 packed words of a half unit and the fragment stay in registers)."""
    import re
    main = tmp_path / "int_iq_device.cu"
    main.write_text(f'#include "{KERNEL_DIR / "decode.cu"}"\n' + INT_IQ_DEVICE)
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--std=c++17", "-Werror=all-warnings",
                           "-Xptxas", "-v", f"-I{KERNEL_DIR}",
                           *KernelShape.parse(IQ_PATH_SHAPE).defines(),
                           few_types_option(tmp_path, (Q4_K,)),
                           "-o", str(tmp_path / "k.cubin"), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stacks = dict(re.findall(r"Function properties for (\w*int_iq_rows\w*)\n\s+(\d+) bytes stack "
                             r"frame", done.stderr))
    assert len(stacks) == 3, done.stderr[-2000:]
    assert all(v == "0" for v in stacks.values()), stacks
