"""The routing and grouping helpers of the prompt path against their plain definitions: the top-k
of each row as a stable sort would give it (ties: the lower expert), and the per-expert jobs as
one scan per expert would build them."""
import numpy as np
import pytest

from strata_dist.backends.array_ops import softmax_topk
from strata_dist.experts.stores import stored_rows_jobs


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


@pytest.mark.parametrize("seed", range(3))
def test_group_layout_is_the_layout_of_the_host_jobs(seed):
    """kernels/abi.py group_layout (what the device grouping kernels must build, checked against
    them on the GPU) is the host path's layout: the jobs of stored_rows_jobs in order, cut into
    work items as ops/moe.py run_spec cuts them; pairs with no expert left out."""
    from strata_dist.kernels.abi import group_layout
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, k, n_expert = int(rng.integers(0, 70)), int(rng.integers(1, 5)), int(rng.integers(1, 12))
        ids = rng.integers(-1, n_expert, size=(n, k))
        rows, dest, items = group_layout(ids, n_expert, tile_m=4)
        jobs = stored_rows_jobs(ids, ids >= 0, lambda e: e)
        want_items, start = [], 0
        for e, job_rows, _ in jobs:
            want_items += [(e, start + s, min(4, len(job_rows) - s), 0)
                           for s in range(0, len(job_rows), 4)]
            start += len(job_rows)
        np.testing.assert_array_equal(items, np.asarray(want_items, dtype=np.int32).reshape(-1, 4))
        np.testing.assert_array_equal(rows, np.concatenate([j[1] for j in jobs] + [[]]))
        np.testing.assert_array_equal(dest, np.concatenate([j[2] for j in jobs] + [[]]))
