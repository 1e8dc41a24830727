"""The router's top-k on the device: route_rows (a prompt chunk's routing) against the host's
stable top-k, ties included, and the decode graph's router matvec, whose last block routes.
Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

from quant_rows import random_rows

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from strata_dist.backends import cuda_decode as cd  # noqa: E402
from strata_dist.backends.array_ops import softmax_topk  # noqa: E402
from strata_dist.kernels.abi import (BLOCK_THREADS, EXPERT_SPEC, MAT_SPEC,  # noqa: E402
                                     MAX_ROWS, ROUTE_SPEC, matvec_kernel, rows_per_block)
from strata_dist.ops.linear import Weight  # noqa: E402
from test_gpu_kernels import K, N_EMBD, N_EXPERT, Experts, _kernel  # noqa: E402


def test_device_routing_matches_the_host_top_k():
    """route_rows (the decode graph's top-k code) against array_ops.softmax_topk, ties included
    (the least expert first, within a lane's experts and across lanes); a row of NaN logits picks
    nothing (-1, NaN weights)."""
    from strata_dist.ops.moe import RowsKernels
    rng = np.random.default_rng(12)
    logits = (3 * rng.standard_normal((200, 128))).astype(np.float32)
    logits[3] = 0.5                                  # every expert tied
    logits[5, [72, 8, 40, 9, 104]] = 20.0            # tied across lanes 8 and 9 and within lane 8
    logits[6, 3:] = -np.inf                          # three finite, then ties at probability 0
    logits[7] = np.nan
    ids, wts = RowsKernels(0).route(cp.asarray(logits), 8, True)
    ids, wts = cp.asnumpy(ids), cp.asnumpy(wts)
    want_ids, want_wts = softmax_topk(np.delete(logits, 7, axis=0), 8)
    np.testing.assert_array_equal(np.delete(ids, 7, axis=0), want_ids)
    np.testing.assert_allclose(np.delete(wts, 7, axis=0), want_wts, rtol=1e-5)
    assert (ids[7] == -1).all() and np.isnan(wts[7]).all()


def _route(expert_spec, raw, n_expert, k, x, n, norm_w=None, launches=1):
    """The router's F32 matvec of rows `raw` over x's first n rows (norm_w: its fused RMSNorm, or
    none), its last block routing through `expert_spec`'s address table, launched `launches` times
    (the done counter back at 0 after each): (logits, ids, wts, blobs) of the n rows, on the host."""
    weight = cp.asarray(raw.reshape(-1))
    logits = cp.zeros((MAX_ROWS, n_expert), cp.float32)
    ids = cp.zeros((MAX_ROWS, k), cp.int32)
    wts = cp.zeros((MAX_ROWS, k), cp.float32)
    blobs = cp.zeros((MAX_ROWS, k), cp.uint64)
    done = cp.zeros(1, cp.uint32)
    mat = cd._spec_array(MAT_SPEC, [cd._mat(Weight(int(weight.data.ptr), int(QT.F32),
                                                      N_EMBD * 4, n_expert, N_EMBD), logits)])
    route = cd._spec_array(ROUTE_SPEC, [dict(
        experts=int(expert_spec.data.ptr), logits=int(logits.data.ptr), ids=int(ids.data.ptr),
        wts=int(wts.data.ptr), blobs=int(blobs.data.ptr), done=int(done.data.ptr),
        n_expert=n_expert, k=k, normalize=1)])
    per_block = rows_per_block(n, False)
    for _ in range(launches):
        _kernel(matvec_kernel(int(QT.F32), n))(
            ((n_expert + per_block - 1) // per_block, 1), (BLOCK_THREADS,),
            (mat, cp.asarray(x), np.int32(N_EMBD), np.int32(n), np.int32(0),
             cd.NULL if norm_w is None else cp.asarray(norm_w), np.float32(1e-6), cd.NULL, route))
        assert int(done.get()[0]) == 0
    return tuple(cp.asnumpy(a)[:n] for a in (logits, ids, wts, blobs))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_router_matvec_picks_the_top_k(n):
    """The router's matvec (RMSNorm fused) writes the logits, and its last block the top-k in
    rank order with renormalised weights and each pick's blob address."""
    ex = Experts(QT.Q8_0, QT.Q8_0, seed=17)
    rng = np.random.default_rng(6)
    raw, w = random_rows(QT.F32, N_EXPERT, N_EMBD, 7)
    x = rng.standard_normal((MAX_ROWS, N_EMBD)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(N_EMBD)).astype(np.float32)
    # twice: the second launch finds the done counter the first left at 0
    logits, ids, wts, blobs = _route(ex.spec, raw, N_EXPERT, K, x, n, nw, launches=2)
    xn = x[:n] / np.sqrt((x[:n].astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    want_logits = xn @ w.T.astype(np.float64)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    want_ids, want_wts = softmax_topk(want_logits, K)
    assert (ids == want_ids).all()
    np.testing.assert_allclose(wts, want_wts, rtol=1e-4, atol=1e-6)
    assert (blobs == cp.asnumpy(ex.blob_of)[want_ids]).all()


@pytest.mark.parametrize("n_expert", [100, 128, 200])
def test_router_tail_over_many_experts_and_a_row_of_nan(n_expert):
    """The router's last block at k = 8 over 100 and 128 experts (four a lane: each pick's
    address comes from its lane's preloaded ones by shuffle, from every slot; 100 leaves lanes
    with three) and 200 (the 16-a-lane build, not a multiple of 32: the address read from the
    table): the top-k and each pick's address; a row of NaN activations picks nothing (-1, NaN
    weights, no address)."""
    k, n = 8, 3
    rng = np.random.default_rng(21)
    raw, w = random_rows(QT.F32, n_expert, N_EMBD, 11)
    x = rng.standard_normal((MAX_ROWS, N_EMBD)).astype(np.float32)
    x[1] = np.nan
    blob_of = cp.asarray((np.arange(n_expert, dtype=np.uint64) + 1) * np.uint64(4096))  # never read
    experts = cd._spec_array(EXPERT_SPEC, [dict(
        blob_of=int(blob_of.data.ptr), up_at=0, down_at=0, gate_row_bytes=0, up_row_bytes=0,
        down_row_bytes=0, gate_type=int(QT.F32), up_type=int(QT.F32), down_type=int(QT.F32),
        n_ff=64, n_embd=N_EMBD, k=k)])
    logits, got_ids, got_wts, got_blobs = _route(experts, raw, n_expert, k, x, n)
    finite = [0, 2]
    want_ids, want_wts = softmax_topk(logits[finite], k)
    np.testing.assert_array_equal(got_ids[finite], want_ids)
    np.testing.assert_allclose(got_wts[finite], want_wts, rtol=1e-5)
    np.testing.assert_array_equal(got_blobs[finite], cp.asnumpy(blob_of)[want_ids])
    assert (got_ids[1] == -1).all() and np.isnan(got_wts[1]).all() and (got_blobs[1] == 0).all()
