"""qwen3next's linear-layer decode kernels on the GPU (kernels/gated_delta.cuh: gdn_conv_step,
gdn_delta_step) against models/qwen3next.py's gdn_mixer over 64 decode steps, the state carried
on the device, one step of several rows, and prompt chunks through the CuPy backend's
linear_attention (gdn_prompt.cu's row kernels, or the same decode kernels). Run on the GPU
machine: pytest -m gpu."""
import numpy as np
import pytest

from strata_dist.kernels.abi import GDN_ROWS, GDN_SPEC
from test_gated_delta_kernel import _layer, _rows, _states

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


class LinearLayer:
    """One layer's weights, state and buffers on the device, and its GdnSpec table."""

    def __init__(self, g, w, conv, state, rows: int):
        from strata_dist.backends import cuda_decode as cd
        self.g, self.rows = g, rows
        conv_dim = 2 * g.key_dim + g.value_dim
        self.dev = {k: cp.asarray(v) for k, v in w.items()}
        self.qkv = cp.zeros((rows, conv_dim), cp.float32)
        self.z = cp.zeros((rows, g.value_dim), cp.float32)
        self.ba = cp.zeros((rows, 2 * g.n_v_heads), cp.float32)
        self.mixed = cp.zeros((rows, conv_dim), cp.float32)
        self.out = cp.zeros((rows, g.value_dim), cp.float32)
        self.conv, self.state = cp.asarray(conv), cp.asarray(state)
        ptr = lambda a: int(a.data.ptr)  # noqa: E731
        # the pointer table as the decode graph's: layer slot 1's conv and recurrent state
        self.sess = cp.asarray(np.array([0, 0, ptr(self.conv), ptr(self.state)], np.uint64))
        self.spec = cd._spec_array(GDN_SPEC, [dict(
            qkv=ptr(self.qkv), z=ptr(self.z), ba=ptr(self.ba), conv_w=ptr(self.dev["ssm_conv1d"]),
            ssm_a=ptr(self.dev["ssm_a"]), ssm_dt=ptr(self.dev["ssm_dt"]),
            norm_w=ptr(self.dev["ssm_norm"]), mixed=ptr(self.mixed), out=ptr(self.out),
            sess=ptr(self.sess), layer_slot=1, n_k=g.n_k_heads, n_v=g.n_v_heads,
            head_k=g.head_k_dim, head_v=g.head_v_dim, conv_dim=conv_dim, K=g.ssm_conv_kernel,
            eps=g.rms_eps)])
        self.conv_fn = cd.function("decode.cu", "gdn_conv_step")
        self.delta_fn = cd.function("decode.cu", "gdn_delta_step")

    def step(self, qkv, z, ba):
        n, g = qkv.shape[0], self.g
        self.qkv[:n], self.z[:n], self.ba[:n] = cp.asarray(qkv), cp.asarray(z), cp.asarray(ba)
        conv_dim = 2 * g.key_dim + g.value_dim
        self.conv_fn((conv_dim // g.head_k_dim,), (g.head_k_dim,), (self.spec, np.int32(n)))
        # a thread per GDN_ROWS rows of a state column, its partial sums in shared memory
        threads = g.head_k_dim * g.head_v_dim // GDN_ROWS
        self.delta_fn((g.n_v_heads,), (threads,), (self.spec, np.int32(n)),
                      shared_mem=(2 * g.head_k_dim + threads) * 4)
        return cp.asnumpy(self.out[:n]).reshape(n, g.n_v_heads, g.head_v_dim)


@pytest.mark.parametrize("nk,nv,hk,hv,K", [(2, 4, 32, 64, 4), (16, 32, 128, 128, 4)])
def test_linear_layer_kernels_match_the_numpy_path_over_64_steps(nk, nv, hk, hv, K):
    """The second geometry is Qwen3-Next-80B-A3B's (16 key heads, 32 value heads of 128)."""
    from strata_dist.backends.numpy_backend import NumpyBackend
    from strata_dist.models.qwen3next import gdn_mixer
    rng = np.random.default_rng(nk + hk)
    g, w, conv_dim = _layer(rng, nk, nv, hk, hv, K)
    conv, state = _states(rng, g, conv_dim)
    layer = LinearLayer(g, w, conv, state, rows=1)
    be = NumpyBackend()
    for _ in range(64):
        qkv, z, ba = _rows(rng, g, conv_dim, 1, ba_scale=2.0)
        want = gdn_mixer(be, g, w, qkv, z, ba, conv, state)
        got = layer.step(qkv, z, ba)
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_array_equal(cp.asnumpy(layer.conv), conv)
    np.testing.assert_allclose(cp.asnumpy(layer.state), state, rtol=1e-3,
                               atol=1e-4 * max(1.0, float(np.abs(state).max())))


def test_a_step_of_several_rows_equals_one_row_steps():
    rng = np.random.default_rng(3)
    g, w, conv_dim = _layer(rng, 2, 4, 32, 32, 4)
    conv, state = _states(rng, g, conv_dim)
    qkv, z, ba = _rows(rng, g, conv_dim, 5)
    many = LinearLayer(g, w, conv, state, rows=8)
    got = many.step(qkv, z, ba)
    one = LinearLayer(g, w, conv, state, rows=8)
    for t in range(5):
        np.testing.assert_array_equal(one.step(qkv[t:t + 1], z[t:t + 1], ba[t:t + 1])[0], got[t])
    np.testing.assert_array_equal(cp.asnumpy(one.state), cp.asnumpy(many.state))


@pytest.mark.parametrize("mode", ["rows", "steps"])
@pytest.mark.parametrize("nk,nv,hk,hv,K", [(2, 4, 32, 64, 4), (16, 32, 128, 128, 4)])
def test_prompt_chunks_through_the_backend_match_the_numpy_path(nk, nv, hk, hv, K, mode,
                                                                 monkeypatch):
    """CupyBackend.linear_attention (what gdn_mixer calls on a GPU) over chunks of 300, 2 (fewer
    rows than the conv state holds) and 37 rows, the state carried on the device between them:
    the token loop's outputs and the conv and recurrent state it leaves, within float32
    rounding. mode: gdn_prompt.cu's row kernels (the default) or the decode graph's token
    loop."""
    from strata_dist.backends.cupy_backend import CupyBackend
    from strata_dist.backends.numpy_backend import NumpyBackend
    from strata_dist.models.qwen3next import gdn_mixer
    monkeypatch.setenv("STRATA_GDN_KERNELS", mode)
    rng = np.random.default_rng(nv + hv)
    g, w, conv_dim = _layer(rng, nk, nv, hk, hv, K)
    conv, state = _states(rng, g, conv_dim)
    conv_d, state_d = cp.asarray(conv), cp.asarray(state)
    be, w_d = CupyBackend(0), {k: cp.asarray(v) for k, v in w.items()}
    for n in (300, 2, 37):
        qkv, z, ba = _rows(rng, g, conv_dim, n, ba_scale=2.0)
        got = be.linear_attention(g, w_d, cp.asarray(qkv), cp.asarray(z), cp.asarray(ba),
                                  conv_d, state_d)
        assert got is not None
        want = gdn_mixer(NumpyBackend(), g, w, qkv, z, ba, conv, state)
        assert np.abs(cp.asnumpy(got) - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
        np.testing.assert_array_equal(cp.asnumpy(conv_d), conv)
        np.testing.assert_allclose(cp.asnumpy(state_d), state, rtol=1e-3,
                                   atol=1e-4 * max(1.0, float(np.abs(state).max())))
