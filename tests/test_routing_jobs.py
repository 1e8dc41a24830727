"""The routing and grouping helpers of the prompt path against their plain definitions: the top-k
of each row as a stable sort would give it (ties: the lower expert), and the per-expert jobs as
one scan per expert would build them."""
import numpy as np
import pytest

from strata_dist.backends.array_ops import softmax_topk
from strata_dist.experts import stored_rows_jobs


def plain_topk(probs, k):
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize("seed", range(6))
def test_topk_equals_the_stable_sort_with_ties_and_nan(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n, e = int(rng.integers(0, 40)), int(rng.integers(2, 40))
        k = int(rng.integers(1, e + 1))
        # few distinct logits: many ties, at the k-th place too
        logits = rng.integers(0, 4, size=(n, e)).astype(np.float32)
        if n and seed % 2:
            logits[0, int(rng.integers(0, e))] = np.nan
        idx, wts = softmax_topk(logits, k, normalize=False)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
        np.testing.assert_array_equal(idx, plain_topk(probs, k))
        np.testing.assert_array_equal(wts, np.take_along_axis(probs, idx, axis=-1))


def plain_jobs(idx, mask):
    k = idx.shape[1]
    jobs = []
    for e in np.unique(idx[mask]):
        rows, ranks = np.nonzero(mask & (idx == e))
        jobs.append((int(e), rows, rows * k + ranks))
    return jobs


@pytest.mark.parametrize("seed", range(4))
def test_jobs_group_pairs_by_expert_in_row_major_order(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n, k = int(rng.integers(0, 40)), int(rng.integers(1, 6))
        idx = rng.integers(0, 12, size=(n, k))
        mask = rng.random((n, k)) < 0.7
        got = stored_rows_jobs(idx, mask, lambda e: ("blob", e))
        want = plain_jobs(idx, mask)
        assert [g[0] for g in got] == [("blob", w[0]) for w in want]
        for (_, rows, dest), (_, want_rows, want_dest) in zip(got, want):
            np.testing.assert_array_equal(rows, want_rows)
            np.testing.assert_array_equal(dest, want_dest)
