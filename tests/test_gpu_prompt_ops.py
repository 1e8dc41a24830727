"""A prompt chunk's fused row-wise steps on the GPU (kernels/prompt_ops.cu, and decode.cu's
qk_norm_rope_kv and next_qk_norm_rope_kv over a chunk's rows) against the array path they replace (the same backend with
STRATA_FUSED_PROMPT_OPS=0): RMSNorm within float32 rounding, the rank-ordered combine bit for
bit, q/k norm + RoPE + the K/V write within float32 (q) and one f16 rounding (K). Run on the GPU
machine: pytest -m gpu."""
import numpy as np
import pytest

from strata_dist.models.common import rope_tables

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _backends(monkeypatch):
    from strata_dist.backends.cupy_backend import CupyBackend
    monkeypatch.setenv("STRATA_FUSED_PROMPT_OPS", "0")
    plain = CupyBackend(0)
    monkeypatch.setenv("STRATA_FUSED_PROMPT_OPS", "1")
    return CupyBackend(0), plain


@pytest.mark.parametrize("shape", [(300, 2048), (7, 4, 128), (1, 96)])
def test_rms_norm_rows(shape, monkeypatch):
    fused, plain = _backends(monkeypatch)
    rng = np.random.default_rng(len(shape))
    x = cp.asarray((rng.standard_normal(shape) * 3).astype(np.float32))
    w = cp.asarray((1 + 0.2 * rng.standard_normal(shape[-1])).astype(np.float32))
    got, want = cp.asnumpy(fused.rms_norm(x, w, 1e-6)), cp.asnumpy(plain.rms_norm(x, w, 1e-6))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n,k,d", [(513, 8, 2048), (3, 10, 96)])
def test_combine_ranked_is_the_loop_bit_for_bit(n, k, d, monkeypatch):
    """Each product and sum rounded on its own, in rank order: the array loop's bits, NaN rows
    (a row that picked nothing) included."""
    fused, plain = _backends(monkeypatch)
    rng = np.random.default_rng(n)
    y = rng.standard_normal((n, k, d)).astype(np.float32)
    wts = rng.random((n, k)).astype(np.float32)
    wts[1, :] = np.nan
    y_d, w_d = cp.asarray(y), cp.asarray(wts)
    got, want = cp.asnumpy(fused.combine_ranked(y_d, w_d)), cp.asnumpy(plain.combine_ranked(y_d, w_d))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[1]).all()


class _Session:
    """The parts of a session the op reads: the cache of one layer and the RoPE tables."""

    def __init__(self, cells, n_kv, d, rot=None):
        cos, sin = rope_tables(np.arange(cells), rot or d, 1_000_000.0)
        self.rope_cos, self.rope_sin = cp.asarray(cos), cp.asarray(sin)
        self._k = cp.full((cells, n_kv, d), 7, cp.float16)
        self._v = cp.full((cells, n_kv, d), 7, cp.float16)

    def k(self, layer):
        return self._k

    def v(self, layer):
        return self._v


@pytest.mark.parametrize("n,pos0", [(300, 0), (37, 517)])
def test_qk_norm_rope_kv_over_a_chunk(n, pos0, monkeypatch):
    fused, plain = _backends(monkeypatch)
    n_head, n_kv, d, cells = 32, 4, 128, pos0 + n + 9
    rng = np.random.default_rng(n + pos0)
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    qn = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    kn = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    a, b = _Session(cells, n_kv, d), _Session(cells, n_kv, d)
    got = fused.qk_norm_rope_kv(cp.asarray(q), cp.asarray(k), cp.asarray(v), qn, kn, 1e-6, a, 0,
                                pos0)
    want = plain.qk_norm_rope_kv(cp.asarray(q), cp.asarray(k), cp.asarray(v), qn, kn, 1e-6, b, 0,
                                 pos0)
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=1e-5, atol=1e-5)
    ka, kb = cp.asnumpy(a._k).astype(np.float32), cp.asnumpy(b._k).astype(np.float32)
    np.testing.assert_allclose(ka, kb, rtol=2e-3, atol=2e-3)       # one f16 rounding apart
    np.testing.assert_array_equal(cp.asnumpy(a._v), cp.asnumpy(b._v))
    untouched = np.r_[0:pos0, pos0 + n:cells]
    assert (ka[untouched] == 7).all() and (cp.asnumpy(a._v)[untouched] == 7).all()


def test_qk_norm_rope_kv_of_qwen3next_heads(monkeypatch):
    """qwen3next: q is the first half of each head of attn_q's [q | gate] rows (a strided view),
    256 wide with its first 64 dims rotated; next_qk_norm_rope_kv reads it there."""
    fused, plain = _backends(monkeypatch)
    n, pos0, n_head, n_kv, d = 100, 33, 16, 2, 256
    cells = pos0 + n + 3
    rng = np.random.default_rng(5)
    qg = cp.asarray(rng.standard_normal((n, n_head, 2 * d)).astype(np.float32))
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    qn = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    kn = cp.asarray((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    a, b = _Session(cells, n_kv, d, rot=64), _Session(cells, n_kv, d, rot=64)
    got = fused.qk_norm_rope_kv(qg[..., :d], cp.asarray(k), cp.asarray(v), qn, kn, 1e-6, a, 0,
                                pos0)
    want = plain.qk_norm_rope_kv(qg[..., :d], cp.asarray(k), cp.asarray(v), qn, kn, 1e-6, b, 0,
                                 pos0)
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(a._k).astype(np.float32),
                               cp.asnumpy(b._k).astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(cp.asnumpy(a._v), cp.asnumpy(b._v))


def _row_errors(got, want):
    """Each row's largest difference, over the reference's largest magnitude (at least 1)."""
    return np.abs(got - want).max(axis=1) / max(1.0, float(np.abs(want).max()))


def test_a_prompt_with_and_without_the_fused_ops(tmp_path, monkeypatch, float32_prompt_kernels):
    """A qwen3moe prompt and its decode: the fused steps move the logits by float32 rounding only
    and keep the greedy tokens. The rest of the prompt in float32 (float32_prompt_kernels): an
    f16 rounding downstream turns a float32 difference into a flipped near-tie of the routing now
    and then (measured 2026-12-02: one row of 200 moved 0.89 with f16 on, every row within
    7.4e-4 without)."""
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_gguf(tiny_qwen3moe(3, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                    n_layers=3), tmp_path / "m.gguf", "q8_0")
    prompt = [int(x) for x in np.random.default_rng(4).integers(0, 320, 200)]
    out = {}
    for on in ("1", "0"):
        monkeypatch.setenv("STRATA_FUSED_PROMPT_OPS", on)
        runner = SingleProcessRunner(path, "cuda:0", prompt_chunk=64, max_context=512)
        out[on] = (runner.logits(prompt), runner.generate(prompt, 16).tokens)
    assert np.abs(out["1"][0] - out["0"][0]).max() <= 1e-3
    assert out["1"][1] == out["0"][1]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_f16_gemm_of_a_quantized_matrix(qtype):
    """CupyBackend.linear of a quantized matrix (the GPU default): x and W each rounded to f16,
    their product accumulated in float32 and written as f16 (CuPy's matmul of f16 arrays), so
    within one f16 step of each element of float64 numpy's product of the rounded inputs, and
    within f16 rounding of the exact product (gguf-py's decoding). Measured on the H200
    2026-12-02: 2.3-3.1e-4 of the product's scale from the rounded inputs' float64 product,
    half an f16 step at that scale (the f16 output)."""
    from quant_rows import TYPES, random_rows
    from strata_dist.backends.cupy_backend import CupyBackend
    from strata_dist.ops.linear import QuantMatrix
    qt = next(t for t in TYPES if t.name == qtype)
    raw, w = random_rows(qt, 96, 512, 3)
    m = QuantMatrix(cp.asarray(raw.reshape(-1)), w.shape, int(qt))
    x = (np.random.default_rng(4).standard_normal((300, 512)) * 2).astype(np.float32)
    got = cp.asnumpy(CupyBackend(0).linear(cp.asarray(x), m)).astype(np.float64)
    rounded = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(exact).max()
    # one f16 step of the element (float32 accumulation can round the other way), and a weight
    # rounded one f16 step the other way (the decoders' float32 order may differ; measured in
    # numpy: 6e-5 of the scale)
    step = np.spacing(np.abs(rounded).astype(np.float16)).astype(np.float64)
    assert (np.abs(got - rounded) <= step + 1e-4 * scale).all()
    assert np.abs(got - exact).max() <= 1e-3 * scale


def test_quantized_dense_matrices_on_tensor_cores(tmp_path, f16_kv_reference):
    """STRATA_F16_PROMPT_GEMM (the default): a prompt's Q8_0 dense matrices decoded to f16 and
    multiplied on tensor cores, as an F16 file's are, against numpy (float32, exact weights): the
    typical row within f16 rounding, and only the rows that f16 rounding moves across a routing
    near-tie (a flipped expert moves that row by far more than any rounding) beyond it, none by
    a wrong kernel's O(1). Measured on the H200 2026-12-02 on this model: the median row within
    5e-3 of the logits' scale, 9 rows of 200 beyond 5e-2, the worst 0.18."""
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_gguf(tiny_qwen3moe(6, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                    n_layers=3), tmp_path / "m.gguf", "q8_0")
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, 320, 200)]
    ref = SingleProcessRunner(path, "cpu", prompt_chunk=64, max_context=512).logits(prompt)
    got = SingleProcessRunner(path, "cuda:0", prompt_chunk=64, max_context=512).logits(prompt)
    err = _row_errors(got, ref)
    assert np.median(err) <= 5e-3
    assert (err > 5e-2).sum() <= 0.1 * len(err) and err.max() <= 0.5, np.sort(err)[-12:]
