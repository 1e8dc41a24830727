"""qwen3next's linear-layer decode kernels (kernels/gated_delta.cuh) built for the host with nvcc:
their per-value steps (the causal conv of a channel, a value head's gates, the delta rule on a
thread's rows of a state column), driven in the kernels' order and thread layout, against models/qwen3next.py's gdn_mixer (the numpy path the
transformers reference checks) over 64 decode steps and over one step of several rows. The GPU
launches themselves are tests/test_gpu_decode.py's. Skips where nvcc is not installed."""
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from strata_dist.backends.numpy_backend import NumpyBackend
from strata_dist.kernels import KERNEL_DIR
from strata_dist.models.qwen3next import gdn_mixer

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")

HARNESS = r"""
#include <cstdio>
#include <vector>
#include "weights.cuh"
#include "gated_delta.cuh"

static bool get(FILE* f, std::vector<float>& v, size_t n) {
    v.resize(n);
    return fread(v.data(), sizeof(float), n, f) == n;
}

int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    int g[6];                                 // n_k, n_v, head_k, head_v, K, rows
    float eps;
    if (fread(g, sizeof g, 1, in) != 1 || fread(&eps, sizeof eps, 1, in) != 1) return 1;
    const int nk = g[0], nv = g[1], hk = g[2], hv = g[3], K = g[4], n = g[5], r = nv / nk;
    const int key_dim = nk * hk, vd = nv * hv, conv_dim = 2 * key_dim + vd;
    std::vector<float> qkv, z, ba, conv_w, ssm_a, dt, norm_w, conv, state;
    if (!get(in, qkv, (size_t)n * conv_dim) || !get(in, z, (size_t)n * vd) ||
        !get(in, ba, (size_t)n * nk * 2 * r) || !get(in, conv_w, (size_t)conv_dim * K) ||
        !get(in, ssm_a, nv) || !get(in, dt, nv) || !get(in, norm_w, hv) ||
        !get(in, conv, (size_t)(K - 1) * conv_dim) || !get(in, state, (size_t)nv * hk * hv))
        return 1;
    // gdn_conv_step: a thread a channel, rows in order; a block a q or k head, normalised
    std::vector<float> mixed((size_t)n * conv_dim), out((size_t)n * vd);
    for (int t = 0; t < n; ++t) {
        float* m = mixed.data() + (size_t)t * conv_dim;
        for (int c = 0; c < conv_dim; ++c)
            m[c] = gdn_conv_channel(conv.data() + c, conv_dim, conv_w.data() + (size_t)c * K,
                                    qkv[(size_t)t * conv_dim + c], K);
        for (int head = 0; head < 2 * nk; ++head) {
            float ss = 0.f;
            for (int i = 0; i < hk; ++i) ss += m[head * hk + i] * m[head * hk + i];
            const float scale = head < nk ? 1.f / sqrtf((float)hk) : 1.f;
            for (int i = 0; i < hk; ++i) m[head * hk + i] = m[head * hk + i] / sqrtf(ss + GDN_L2_EPS) * scale;
        }
    }
    // gdn_delta_step: a block a value head; "thread" (g, j) holds rows [g R, (g+1) R) of column j
    const int R = GDN_ROWS, groups = hk / R;
    for (int h = 0; h < nv; ++h) {
        const int kh = h / r;
        float* S = state.data() + (size_t)h * hk * hv;
        std::vector<float> regs((size_t)groups * hv * R), part((size_t)groups * hv);
        auto reg = [&](int g, int j) -> float (&)[GDN_ROWS] {
            return *reinterpret_cast<float (*)[GDN_ROWS]>(regs.data() + ((size_t)g * hv + j) * R);
        };
        for (int g = 0; g < groups; ++g)
            for (int j = 0; j < hv; ++j)
                for (int i = 0; i < R; ++i) reg(g, j)[i] = S[(size_t)(g * R + i) * hv + j];
        for (int t = 0; t < n; ++t) {
            const float* row = mixed.data() + (size_t)t * conv_dim;
            const float* q = row + kh * hk;
            const float* k = row + key_dim + kh * hk;
            const float* b = ba.data() + (size_t)t * nk * 2 * r + kh * 2 * r;
            float beta, gexp;
            gdn_gates(b[h % r], b[r + h % r], ssm_a[h], dt[h], beta, gexp);
            for (int g = 0; g < groups; ++g)
                for (int j = 0; j < hv; ++j)
                    part[(size_t)g * hv + j] = gdn_decay_dot<GDN_ROWS>(reg(g, j), gexp, k + g * R);
            std::vector<float> delta(hv), o(hv, 0.f);
            for (int j = 0; j < hv; ++j) {
                float kv = 0.f;
                for (int g = 0; g < groups; ++g) kv += part[(size_t)g * hv + j];
                delta[j] = (row[2 * key_dim + h * hv + j] - kv) * beta;
            }
            for (int g = 0; g < groups; ++g)
                for (int j = 0; j < hv; ++j)
                    part[(size_t)g * hv + j] = gdn_rows_update<GDN_ROWS>(reg(g, j), gexp, k + g * R,
                                                                        delta[j], q + g * R);
            float ss = 0.f;
            for (int j = 0; j < hv; ++j) {
                for (int g = 0; g < groups; ++g) o[j] += part[(size_t)g * hv + j];
                ss += o[j] * o[j];
            }
            for (int j = 0; j < hv; ++j) {
                const size_t at = (size_t)t * vd + h * hv + j;
                out[at] = o[j] / sqrtf(ss / (float)hv + eps) * norm_w[j] * gdn_silu(z[at]);
            }
        }
        for (int g = 0; g < groups; ++g)
            for (int j = 0; j < hv; ++j)
                for (int i = 0; i < R; ++i) S[(size_t)(g * R + i) * hv + j] = reg(g, j)[i];
    }
    FILE* res = fopen(argv[2], "wb");
    fwrite(out.data(), sizeof(float), out.size(), res);
    fwrite(conv.data(), sizeof(float), conv.size(), res);
    fwrite(state.data(), sizeof(float), state.size(), res);
    return fclose(res) == 0 ? 0 : 1;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gdn")
    main = tmp / "gdn.cu"
    main.write_text(HARNESS)
    exe = tmp / "gdn"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-I", str(KERNEL_DIR), "-o",
                           str(exe), str(main)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe, tmp


def _layer(rng, nk, nv, hk, hv, K):
    """Random weights of one linear layer in the shapes gdn_mixer reads, and its geometry."""
    conv_dim = 2 * nk * hk + nv * hv
    g = SimpleNamespace(n_k_heads=nk, n_v_heads=nv, head_k_dim=hk, head_v_dim=hv,
                        key_dim=nk * hk, value_dim=nv * hv, conv_dim=conv_dim, ssm_conv_kernel=K,
                        rms_eps=1e-6)
    w = {"ssm_conv1d": (rng.standard_normal((conv_dim, K)) * 0.5).astype(np.float32),
         "ssm_a": -np.exp(rng.standard_normal(nv) * 0.5).astype(np.float32),
         "ssm_dt": (rng.standard_normal(nv) * 0.5).astype(np.float32),
         "ssm_norm": (1 + rng.standard_normal(hv) * 0.1).astype(np.float32)}
    return g, w, conv_dim


def _states(rng, g, conv_dim):
    """A session's conv state [K-1, conv_dim] and recurrent state [n_v, head_k, head_v]."""
    conv = (rng.standard_normal((g.ssm_conv_kernel - 1, conv_dim)) * 0.3).astype(np.float32)
    state = (rng.standard_normal((g.n_v_heads, g.head_k_dim, g.head_v_dim)) * 0.1).astype(np.float32)
    return conv, state


def _rows(rng, g, conv_dim, n, ba_scale=1.0):
    """n rows of the layer's input projections: qkv, z and ba."""
    qkv = rng.standard_normal((n, conv_dim)).astype(np.float32)
    z = rng.standard_normal((n, g.value_dim)).astype(np.float32)
    ba = (rng.standard_normal((n, 2 * g.n_v_heads)) * ba_scale).astype(np.float32)
    return qkv, z, ba


def _run(harness, g, w, qkv, z, ba, conv, state):
    exe, tmp = harness
    head = np.array([g.n_k_heads, g.n_v_heads, g.head_k_dim, g.head_v_dim, g.ssm_conv_kernel,
                     qkv.shape[0]], np.int32)
    parts = [head.tobytes(), np.float32(g.rms_eps).tobytes()]
    parts += [np.ascontiguousarray(a, np.float32).tobytes()
              for a in (qkv, z, ba, w["ssm_conv1d"], w["ssm_a"], w["ssm_dt"], w["ssm_norm"], conv,
                        state)]
    (tmp / "in.bin").write_bytes(b"".join(parts))
    subprocess.run([str(exe), str(tmp / "in.bin"), str(tmp / "out.bin")], check=True, timeout=60)
    got = np.fromfile(tmp / "out.bin", dtype=np.float32)
    n_out = qkv.shape[0] * g.value_dim
    return (got[:n_out].reshape(qkv.shape[0], g.n_v_heads, g.head_v_dim),
            got[n_out:n_out + conv.size].reshape(conv.shape), got[n_out + conv.size:].reshape(state.shape))


@pytest.mark.parametrize("nk,nv,hk,hv,K", [(2, 4, 32, 64, 4), (4, 4, 64, 32, 3)])
def test_linear_layer_steps_match_the_numpy_path_over_64_steps(harness, nk, nv, hk, hv, K):
    rng = np.random.default_rng(nk * 100 + hk)
    g, w, conv_dim = _layer(rng, nk, nv, hk, hv, K)
    be = NumpyBackend()
    conv, state = _states(rng, g, conv_dim)
    conv_ref, state_ref = conv.copy(), state.copy()
    worst = 0.0
    for step in range(64):
        qkv, z, ba = _rows(rng, g, conv_dim, 1, ba_scale=2.0)
        want = gdn_mixer(be, g, w, qkv, z, ba, conv_ref, state_ref)
        got, conv, state = _run(harness, g, w, qkv, z, ba, conv, state)
        # the states carried on are the host's own: a drift would compound over the steps
        np.testing.assert_array_equal(conv, conv_ref)         # moved, not computed
        scale = max(1.0, float(np.abs(want).max()))
        worst = max(worst, float(np.abs(got - want).max()) / scale)
        np.testing.assert_allclose(state, state_ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(state_ref).max()))
    assert worst < 1e-4, worst


def test_one_step_of_several_rows_takes_them_in_order(harness):
    """A step of 5 rows (consecutive positions of one session) equals 5 steps of one row."""
    rng = np.random.default_rng(7)
    g, w, conv_dim = _layer(rng, 2, 4, 32, 32, 4)
    conv, state = _states(rng, g, conv_dim)
    qkv, z, ba = _rows(rng, g, conv_dim, 5)
    got, conv5, state5 = _run(harness, g, w, qkv, z, ba, conv, state)
    want = gdn_mixer(NumpyBackend(), g, w, qkv, z, ba, conv.copy(), state.copy())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
    for t in range(5):
        one, conv, state = _run(harness, g, w, qkv[t:t + 1], z[t:t + 1], ba[t:t + 1], conv, state)
        np.testing.assert_array_equal(one[0], got[t])
    np.testing.assert_array_equal(conv, conv5)
    np.testing.assert_array_equal(state, state5)
