"""A prompt chunk's attention read in tiles of query rows equals plain causal softmax attention
(and the tiles' scores stay within the tile budget)."""
import numpy as np
import pytest

from strata_dist.backends import array_ops as common


class _Session:
    def score_buffer(self, shape):
        return np.empty(shape, dtype=np.float32)


def _reference(q, k, v, pos0):
    n, h, d = q.shape
    t, kvh, _ = k.shape
    out = np.empty_like(q)
    for head in range(h):
        kv = head // (h // kvh)
        s = (q[:, head] @ k[:, kv].T) / np.sqrt(d)
        s[np.arange(t)[None, :] > (pos0 + np.arange(n))[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, head] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, kv]
    return out


@pytest.mark.parametrize("pos0,n,tile_rows", [(0, 37, 5), (20, 40, 7), (0, 9, 1), (11, 64, 64)])
def test_tiled_prompt_attention_equals_causal_softmax(monkeypatch, pos0, n, tile_rows):
    rng = np.random.default_rng(pos0 + n)
    h, kvh, d = 8, 2, 16
    t = pos0 + n
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    k = rng.standard_normal((t, kvh, d)).astype(np.float32)
    v = rng.standard_normal((t, kvh, d)).astype(np.float32)
    monkeypatch.setattr(common, "ATTN_TILE_BYTES", tile_rows * h * t * 4)
    seen = []
    attend = common._attend

    def spy(qg, kt, vt, q0, xp, out_buf=None):
        seen.append(qg.shape[2] * kt.shape[-1] * h * 4)
        return attend(qg, kt, vt, q0, xp, out_buf)

    monkeypatch.setattr(common, "_attend", spy)
    got = common.causal_attention(q, k, v, pos0, np, _Session())
    np.testing.assert_allclose(got, _reference(q, k, v, pos0), rtol=2e-5, atol=2e-6)
    assert len(seen) == (-(-n // tile_rows) if n > common.DECODE_ROWS else 1)
    assert max(seen) <= common.ATTN_TILE_BYTES
