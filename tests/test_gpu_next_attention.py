"""qwen3next's gated attention and shared-expert kernels of the decode step
(kernels/next_attention.cuh) against the numpy path's arithmetic (backends/array_ops.py, the
operations models/qwen3next.py's `_attention` and `_moe` are written in), at Qwen3-Next-80B's
head geometry: 16 query heads over 2 kv heads of 256, the first 64 dims rotated. The attention
over the session itself is test_gpu_kernels.py's test_attention_kernel_of_256_wide_heads. Run on
the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

from strata_dist.backends import array_ops
from strata_dist.kernels.abi import BLOCK_THREADS, DESC_WORDS
from strata_dist.models.common import rope_tables

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

N_HEAD, N_KV, D, ROT, EPS = 16, 2, 256, 64, 1e-6


def _fn(name):
    from strata_dist.backends import cuda_decode as cd
    return cd.function("decode.cu", name)


def _sigmoid(x):
    return 0.5 * np.tanh(0.5 * x) + 0.5          # the backends' form (backends/base.py)


@pytest.mark.parametrize("rows,pos", [(1, 0), (3, 517)])
def test_q_gate_norm_rope_and_the_kv_write(rows, pos):
    """next_qk_norm_rope_kv: q out of attn_q's [q | gate] heads, RMSNormed and NEOX-rotated over
    its first 64 dims (the rest passes through), and k the same into the f16 cache at each row's
    position with v beside it; cells the step does not write stay as they were."""
    rng = np.random.default_rng(rows + pos)
    cells = pos + rows + 5
    qg = rng.standard_normal((rows, N_HEAD, 2 * D)).astype(np.float32)
    k = rng.standard_normal((rows, N_KV, D)).astype(np.float32)
    v = rng.standard_normal((rows, N_KV, D)).astype(np.float32)
    qn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    cos, sin = rope_tables(np.arange(cells), ROT, 10_000_000.0)
    kc = cp.full((cells, N_KV, D), 7, cp.float16)
    vc = cp.full((cells, N_KV, D), 7, cp.float16)
    cos_d, sin_d = cp.asarray(cos), cp.asarray(sin)
    sess = cp.asarray(np.array([kc.data.ptr, vc.data.ptr, cos_d.data.ptr, sin_d.data.ptr],
                               np.uint64))
    desc = cp.asarray(np.array([pos, rows] + [0] * (DESC_WORDS - 2), np.int32))
    q = cp.zeros((rows, N_HEAD, D), cp.float32)
    _fn("next_qk_norm_rope_kv")(
        (N_HEAD + N_KV, rows), (32,),
        (cp.asarray(qg), cp.asarray(k), cp.asarray(v), cp.asarray(qn), cp.asarray(kn), sess,
         np.int32(0), np.int32(1), desc, np.int32(N_HEAD), np.int32(N_KV), np.float32(EPS), q))
    c, s = cos[pos:pos + rows], sin[pos:pos + rows]
    want_q = array_ops.apply_rope(array_ops.rms_norm(qg[..., :D], qn, EPS, np), c, s, np)
    want_k = array_ops.apply_rope(array_ops.rms_norm(k, kn, EPS, np), c, s, np)
    np.testing.assert_allclose(cp.asnumpy(q), want_q, rtol=1e-4, atol=1e-5)
    got_k, got_v = cp.asnumpy(kc).astype(np.float32), cp.asnumpy(vc).astype(np.float32)
    # K went through f16 after the same float32 steps: within an f16 rounding of the reference
    np.testing.assert_allclose(got_k[pos:pos + rows], want_k, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got_v[pos:pos + rows], v.astype(np.float16).astype(np.float32))
    untouched = np.r_[0:pos, pos + rows:cells]
    assert (got_k[untouched] == 7).all() and (got_v[untouched] == 7).all()


def test_attention_output_gate():
    """next_attn_gate: each head's attention times sigmoid of its gate (attn_q's second half)."""
    rng = np.random.default_rng(3)
    rows = 5
    qg = rng.standard_normal((rows, N_HEAD, 2 * D)).astype(np.float32)
    out = rng.standard_normal((rows, N_HEAD * D)).astype(np.float32)
    dev = cp.asarray(out)
    _fn("next_attn_gate")((-(-N_HEAD * D // BLOCK_THREADS), rows), (BLOCK_THREADS,),
                          (dev, cp.asarray(qg), np.int32(N_HEAD)))
    want = out * _sigmoid(qg[..., D:].reshape(rows, N_HEAD * D))
    np.testing.assert_allclose(cp.asnumpy(dev), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_ff", [512, 300])
def test_shared_expert_activation(n_ff):
    """next_shexp_act: silu(gate) * up * sigmoid(the shared gate's logit) per row, gate and up
    the two halves of one buffer (one matvec launch writes both)."""
    rng = np.random.default_rng(n_ff)
    rows = 4
    gu = rng.standard_normal((rows, 2 * n_ff)).astype(np.float32)
    s = rng.standard_normal(rows).astype(np.float32)
    act = cp.zeros((rows, n_ff), cp.float32)
    _fn("next_shexp_act")((-(-n_ff // BLOCK_THREADS), rows), (BLOCK_THREADS,),
                          (cp.asarray(gu), cp.asarray(s), np.int32(n_ff), act))
    g, u = gu[:, :n_ff], gu[:, n_ff:]
    want = g * _sigmoid(g) * u * _sigmoid(s)[:, None]
    np.testing.assert_allclose(cp.asnumpy(act), want, rtol=1e-5, atol=1e-6)
