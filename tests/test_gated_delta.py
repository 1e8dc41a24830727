"""The blocked gated delta rule (what a GPU rank runs for prompt chunks) against the token-by-token
reference, including the state carried between calls and blocks of every length."""
import numpy as np
import pytest

from strata_dist.models.delta_rule import gated_delta_chunked, gated_delta_steps


def _inputs(seed, n, heads=4, dk=16, dv=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, heads, dk)).astype(np.float32)
    k = rng.standard_normal((n, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)                    # L2-normalised, as in the model
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.standard_normal((n, heads, dv)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((n, heads))))).astype(np.float32)
    decay = (-np.abs(rng.standard_normal((n, heads))) * 0.5).astype(np.float32)
    state = (rng.standard_normal((heads, dk, dv)) * 0.1).astype(np.float32)
    return q, k, v, beta, decay, state


@pytest.mark.parametrize("n,block", [(1, 64), (7, 4), (64, 64), (100, 64), (130, 32)])
def test_blocks_equal_the_token_loop(n, block):
    q, k, v, beta, decay, state = _inputs(n, n)
    s_ref, s_blk = state.copy(), state.copy()
    ref = gated_delta_steps(q, k, v, beta, decay, s_ref, np)
    got = gated_delta_chunked(q, k, v, beta, decay, s_blk, np, block=block)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_blk, s_ref, atol=2e-5, rtol=1e-4)


def test_state_carries_across_calls():
    q, k, v, beta, decay, state = _inputs(9, 90)
    s_ref, s_blk = state.copy(), state.copy()
    ref = gated_delta_steps(q, k, v, beta, decay, s_ref, np)
    parts = [gated_delta_chunked(q[a:b], k[a:b], v[a:b], beta[a:b], decay[a:b], s_blk, np, block=16)
             for a, b in ((0, 33), (33, 34), (34, 90))]
    np.testing.assert_allclose(np.concatenate(parts), ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_blk, s_ref, atol=2e-5, rtol=1e-4)


def test_the_model_through_blocks_matches_transformers(tmp_path, monkeypatch):
    """The whole qwen3next forward with its prompt chunks read in blocks (the GPU path, run here
    with numpy) against transformers."""
    import strata_dist.models.delta_rule as next_mod      # gdn_mixer's module
    from hf_next_fixtures import hf_logits, tiny_qwen3next, write_gguf
    from strata_dist.tools.single_process import SingleProcessRunner

    def blocks(q, k, v, beta, decay, state, xp):
        return gated_delta_chunked(q, k, v, beta, decay, state, xp, block=8)
    monkeypatch.setattr(next_mod, "gated_delta_steps", blocks)
    hf = tiny_qwen3next(0)
    path = write_gguf(hf, tmp_path / "next.gguf", "f32")
    ids = [int(x) for x in np.random.default_rng(0).integers(0, hf.config.vocab_size, 40)]
    ours = SingleProcessRunner(path, prompt_chunk=13).logits(ids)
    assert np.abs(ours - hf_logits(hf, ids)).max() <= 1e-4
