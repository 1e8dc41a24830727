"""The dense decode matvecs' integer path (kernels/matvec_int.cuh, KernelShape int_matvec=1)
against numpy on random rows of every type it takes (gguf-py's decoding, float64), with and
without the fused RMSNorm, the residual add and the router's top-k; F16 beside them keeps the
float path. Not yet run on a GPU (written 2026-12-06; tests/test_matvec_int_host.py checks the
row dot on the host). Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from strata_dist.backends import cuda_decode as cd  # noqa: E402
from strata_dist.backends.array_ops import softmax_topk  # noqa: E402
from strata_dist.ops.linear import Weight  # noqa: E402
from strata_dist.kernels.abi import (BLOCK_THREADS, MAT_SPEC, MAX_ROWS,  # noqa: E402
                                     ROUTE_SPEC, KernelShape, matvec_kernel, rows_per_block)

from test_gpu_kernels import K, N_EMBD, N_EXPERT, Experts, _kernel  # noqa: E402


# the types the dense matvecs' integer path takes (kernels/matvec_int.cuh, KernelShape int_matvec)
# and F16, which keeps the float path in that build
MATVEC_INT_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS, QT.IQ3_S, QT.IQ2_XXS)


def _run_matvec(shape, qtype, raw, n, x, nrows, ncols, wide, nw=None, add=None, route=None):
    """y (and normed) of one matvec launch of build `shape` over rows x (MAX_ROWS rows held, n
    used), with the runner's grid."""
    weight = cp.asarray(raw.reshape(-1))
    y = cp.zeros((MAX_ROWS, nrows), cp.float32) if add is None else cp.asarray(add)
    normed = cp.zeros((MAX_ROWS, ncols), cp.float32)
    mat = cd._spec_array(MAT_SPEC, [cd._mat(Weight(int(weight.data.ptr), int(qtype), raw.shape[1],
                                                   nrows, ncols), y,
                                            add=None if add is None else y)])
    per_block = rows_per_block(n, wide)
    _kernel(matvec_kernel(int(qtype), n), shape)(
        ((nrows + per_block - 1) // per_block, 1), (BLOCK_THREADS,),
        (mat, cp.asarray(x), np.int32(ncols), np.int32(n), np.int32(wide),
         cd.NULL if nw is None else cp.asarray(nw), np.float32(1e-6),
         cd.NULL if nw is None else normed, cd.NULL if route is None else route))
    return cp.asnumpy(y)[:n], cp.asnumpy(normed)[:n]


@pytest.mark.parametrize("qtype", (*MATVEC_INT_TYPES, QT.F16), ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("norm,add", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "norm", "add", "norm_add"])
@pytest.mark.parametrize("ncols,wide", [(2048, 1), (4096, 1), (2048, 0)])
def test_integer_matvec_matches_numpy(qtype, n, norm, add, ncols, wide):
    """The int_matvec build's dense matvec against numpy (gguf-py's decoded rows, float64), with
    the fused RMSNorm (and `normed` written) and the residual add: within the integer path's
    bound, |W| @ (amax / 64516 per 32-column block of the normed activations) plus 1e-5 of
    |W| @ |x| for float32 rounding (tests/test_matvec_int_host.py's bound). 4096 columns take two
    shared-memory tiles at n = 3; 37 rows leave a block's last rows past the matrix. The unit-dot
    types really take the integer path (their outputs differ from the default build's in the
    low bits); F16 keeps the float path (the same bits as the default build)."""
    import type_rows
    nrows = 37
    raw, w = type_rows.random_rows(qtype, nrows, ncols, int(qtype) * 13 + ncols)
    rng = np.random.default_rng(int(qtype) + n)
    x = (rng.standard_normal((MAX_ROWS, ncols)) * 3).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(ncols)).astype(np.float32) if norm else None
    h0 = rng.standard_normal((MAX_ROWS, nrows)).astype(np.float32) if add else None
    on = KernelShape.parse("int_matvec=1")
    y, normed = _run_matvec(on, qtype, raw, n, x, nrows, ncols, wide, nw, h0)
    xd = x[:n].astype(np.float64)
    if norm:
        xd = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-6) * nw
        np.testing.assert_allclose(normed, xd, rtol=1e-5, atol=1e-6)
    wd = w.astype(np.float64)
    want = xd @ wd.T + (h0[:n].astype(np.float64) if add else 0.0)
    amax = np.repeat(np.abs(xd).reshape(n, -1, 32).max(axis=2), 32, axis=1)
    bound = (amax / 64516) @ np.abs(wd).T + 1e-5 * (np.abs(xd) @ np.abs(wd).T) + 1e-6
    err = np.abs(y - want)
    assert (err <= bound).all(), float((err / bound).max())
    y_off, _ = _run_matvec(KernelShape(), qtype, raw, n, x, nrows, ncols, wide, nw, h0)
    if qtype in MATVEC_INT_TYPES:
        assert not np.array_equal(y, y_off)
    else:
        assert np.array_equal(y, y_off)


@pytest.mark.parametrize("qtype", MATVEC_INT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3])
def test_integer_router_matvec_picks_the_top_k(qtype, n):
    """A router of a unit-dot type on the int_matvec build (norm fused, top-k after the last
    block): logits within the integer path's bound and the top-k of numpy's logits."""
    import type_rows
    ex = Experts(QT.Q8_0, QT.Q8_0, seed=17)
    raw, w = type_rows.random_rows(qtype, N_EXPERT, N_EMBD, int(qtype))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((MAX_ROWS, N_EMBD)).astype(np.float32)
    nw = (1 + 0.2 * rng.standard_normal(N_EMBD)).astype(np.float32)
    logits = cp.zeros((MAX_ROWS, N_EXPERT), cp.float32)
    ids = cp.zeros((MAX_ROWS, K), cp.int32)
    wts = cp.zeros((MAX_ROWS, K), cp.float32)
    blobs = cp.zeros((MAX_ROWS, K), cp.uint64)
    done = cp.zeros(1, cp.uint32)
    weight = cp.asarray(raw.reshape(-1))
    mat = cd._spec_array(MAT_SPEC, [cd._mat(Weight(int(weight.data.ptr), int(qtype), raw.shape[1],
                                                   N_EXPERT, N_EMBD), logits)])
    route = cd._spec_array(ROUTE_SPEC, [dict(
        experts=int(ex.spec.data.ptr), logits=int(logits.data.ptr), ids=int(ids.data.ptr),
        wts=int(wts.data.ptr), blobs=int(blobs.data.ptr), done=int(done.data.ptr),
        n_expert=N_EXPERT, k=K, normalize=1)])
    per_block = rows_per_block(n, False)
    _kernel(matvec_kernel(int(qtype), n), KernelShape.parse("int_matvec=1"))(
        ((N_EXPERT + per_block - 1) // per_block, 1), (BLOCK_THREADS,),
        (mat, cp.asarray(x), np.int32(N_EMBD), np.int32(n), np.int32(0), cp.asarray(nw),
         np.float32(1e-6), cd.NULL, route))
    assert int(done.get()[0]) == 0
    xn = x[:n] / np.sqrt((x[:n].astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    wd = w.astype(np.float64)
    want = xn @ wd.T
    amax = np.repeat(np.abs(xn).reshape(n, -1, 32).max(axis=2), 32, axis=1)
    bound = (amax / 64516) @ np.abs(wd).T + 1e-5 * (np.abs(xn) @ np.abs(wd).T) + 1e-6
    assert (np.abs(cp.asnumpy(logits)[:n] - want) <= bound).all()
    want_ids, _ = softmax_topk(want, K)
    assert (cp.asnumpy(ids)[:n] == want_ids).all()
