"""The decode kernels one by one against numpy on random data: the expert kernels (each weight
type, gate/up and down in different types as Q4_K_M files store them) and the attention kernel at
several context lengths and split sizes (the router: tests/test_gpu_routing.py). Weights are
decoded by gguf-py (tests/quant_rows.py), the reference nobody here wrote. Run on the GPU machine:
pytest -m gpu."""
import math

import numpy as np
import pytest

from quant_rows import random_rows

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402

from strata_dist.backends import cuda_decode as cd  # noqa: E402
from strata_dist.kernels.abi import (BLOCK_THREADS, DESC_WORDS,  # noqa: E402
                                     EXPERT_SPEC, INT_TYPE_SWITCHES, KernelShape,
                                     MAX_ROWS, TYPE_NAMES, attn_kernel)

N_EMBD, N_FF, N_EXPERT, K = 512, 256, 16, 4


def _kernel(name, shape: KernelShape = KernelShape()):
    return cd.function("decode.cu", name, 0, shape.defines())


class Experts:
    """N_EXPERT expert blobs (gate rows, up rows, down rows) in one device buffer, their float32
    decodings, and the ExpertSpec table the kernels read."""

    def __init__(self, gate_up_type, down_type, seed: int):
        self.ref, blobs = [], []
        for e in range(N_EXPERT):
            g_raw, g = random_rows(gate_up_type, N_FF, N_EMBD, seed + 3 * e)
            u_raw, u = random_rows(gate_up_type, N_FF, N_EMBD, seed + 3 * e + 1)
            d_raw, d = random_rows(down_type, N_EMBD, N_FF, seed + 3 * e + 2)
            self.ref.append((g, u, d))
            blobs.append(np.concatenate([g_raw.reshape(-1), u_raw.reshape(-1), d_raw.reshape(-1)]))
        size = len(blobs[0])
        self.stride = (size + 255) // 256 * 256
        host = np.zeros(self.stride * N_EXPERT, dtype=np.uint8)
        for e, b in enumerate(blobs):
            host[e * self.stride:e * self.stride + size] = b
        self.buf = cp.asarray(host)
        self.blob_of = cp.asarray(np.array([int(self.buf.data.ptr) + e * self.stride
                                            for e in range(N_EXPERT)], dtype=np.uint64))
        g_bytes, u_bytes = g_raw.nbytes, u_raw.nbytes
        self.size = size
        self.layout = (g_bytes, u_bytes, d_raw.nbytes)
        self.types = (TYPE_NAMES[int(gate_up_type)], TYPE_NAMES[int(down_type)])
        self.gate_up_type, self.down_type = int(gate_up_type), int(down_type)
        self.spec = cd._spec_array(EXPERT_SPEC, [dict(
            blob_of=int(self.blob_of.data.ptr), up_at=g_bytes, down_at=g_bytes + u_bytes,
            gate_row_bytes=g_bytes // N_FF, up_row_bytes=u_bytes // N_FF,
            down_row_bytes=d_raw.nbytes // N_EMBD, gate_type=int(gate_up_type),
            up_type=int(gate_up_type), down_type=int(down_type), n_ff=N_FF, n_embd=N_EMBD, k=K)])

    def rows_layout(self):
        """The ExpertLayout the row kernels (ops/moe.py) read these blobs by."""
        from strata_dist.kernels.abi import ExpertLayout
        g_bytes, u_bytes, d_bytes = self.layout
        return ExpertLayout(self.gate_up_type, self.gate_up_type, self.down_type, g_bytes,
                            g_bytes + u_bytes, g_bytes // N_FF, u_bytes // N_FF, d_bytes // N_EMBD,
                            N_FF, N_EMBD, 16)


def _run_experts(ex, shape: KernelShape, x, ids, wts, h0):
    """(act, h) of the decode graph's two expert launches of build `shape` over rows x picking
    experts ids with weights wts, h starting at h0; grids as the runner sizes them."""
    n = x.shape[0]
    blobs = cp.asarray(cp.asnumpy(ex.blob_of)[ids])
    act = cp.zeros((n, K, N_FF), cp.float32)
    h = cp.asarray(h0)
    ff, out = shape.gate_up_block(ex.gate_up_type), shape.down_block(ex.down_type)
    _kernel(f"moe_gate_up_{ex.types[0]}", shape)(
        ((N_FF + ff - 1) // ff, K, n), (BLOCK_THREADS,), (ex.spec, cp.asarray(x), blobs, act))
    _kernel(f"moe_down_{ex.types[1]}", shape)(
        ((N_EMBD + out - 1) // out, n), (BLOCK_THREADS,),
        (ex.spec, act, blobs, cp.asarray(wts), h))
    return act, h


# the integer path of every type it has (kernels/abi.py INT_TYPE_SWITCHES on: the default, named
# where a test means it whatever the defaults); and every switch off: those types on the float
# path, Q4_K alone on the integer path
INT_ALL = ",".join(f"{name}=1" for name in INT_TYPE_SWITCHES)
INT_OFF = ",".join(f"{name}=0" for name in INT_TYPE_SWITCHES)
# the integer path's i-quants, each as gate/up and as down (int_iq4_xs, int_iq3_s, int_iq2_xxs)
IQ_PAIRS = [(QT.IQ4_XS, QT.IQ3_S), (QT.IQ3_S, QT.IQ2_XXS), (QT.IQ2_XXS, QT.IQ4_XS)]


@pytest.mark.parametrize("gate_up,down", [(QT.F16, QT.F16), (QT.Q8_0, QT.Q8_0),
                                          (QT.Q4_K, QT.Q6_K), (QT.Q5_K, QT.Q5_K),
                                          (QT.Q6_K, QT.Q6_K), *IQ_PAIRS],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3])
# "" (the default) has every INT_TYPE_SWITCHES switch on; INT_OFF puts those types back on the
# float path
@pytest.mark.parametrize("shape", ["", "int_gate_up=0,int_down=0", "int_direct=0",
                                   "int_ff_per_warp=1,int_down_per_warp=2",
                                   "int_ff_per_warp=4,int_down_per_warp=2",
                                   "factored_dots=0,cvt_magic=0", INT_OFF,
                                   INT_OFF + ",int_direct=0"])
def test_expert_kernels_match_numpy(gate_up, down, n, shape):
    """Every build tune_decode.py measures computes the same experts (up to rounding)."""
    shape = KernelShape.parse(shape)
    ex = Experts(gate_up, down, seed=int(gate_up) * 100 + int(down))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n)])
    wts = rng.random((n, K)).astype(np.float32)
    h0 = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    act, h = _run_experts(ex, shape, x, ids, wts, h0)
    want_act = np.zeros((n, K, N_FF))
    want_h = h0.astype(np.float64).copy()
    for i in range(n):
        for r in range(K):
            g, u, d = (m.astype(np.float64) for m in ex.ref[ids[i, r]])
            gx, ux = g @ x[i], u @ x[i]
            want_act[i, r] = gx / (1 + np.exp(-gx)) * ux
            want_h[i] += wts[i, r] * (d @ want_act[i, r])
    np.testing.assert_allclose(cp.asnumpy(act), want_act, rtol=1e-4,
                               atol=1e-4 * np.abs(want_act).max())
    np.testing.assert_allclose(cp.asnumpy(h), want_h, rtol=1e-4,
                               atol=1e-4 * np.abs(want_h - h0).max())


@pytest.mark.parametrize("gate_up,down", [(QT.Q5_K, QT.Q5_K), (QT.Q6_K, QT.Q6_K),
                                          (QT.Q4_K, QT.Q6_K), (QT.Q3_K, QT.Q3_K),
                                          (QT.Q2_K, QT.Q2_K), *IQ_PAIRS], ids=lambda t: t.name)
@pytest.mark.parametrize("direct", [1, 0], ids=["in_place", "staged"])
def test_the_switches_put_their_types_on_the_integer_path(gate_up, down, direct):
    """int_q5_k / int_q6_k / int_q3_k / int_q2_k / int_iq4_xs / int_iq3_s / int_iq2_xxs really
    take those types off the float path: the integer build's outputs differ in their low bits from
    the float build's (int_gate_up=0,int_down=0) where the integer path can take the rows, and
    equal them bit for bit where it cannot and hands the block's range to the float body: staged
    rows must be whole 16-byte pieces, which the Q6_K, Q3_K and Q2_K rows here (420 and 210, 220
    and 110, 168 and 84 bytes) are not. The i-quants are read in place in both builds
    (int_direct=0 too). (Q4_K's gate/up takes the integer path in every build but the float one,
    as by default.)"""
    ex = Experts(gate_up, down, seed=int(gate_up) * 10 + int(down) + 7)
    rng = np.random.default_rng(21)
    n = 2
    x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n)])
    wts = rng.random((n, K)).astype(np.float32)
    h0 = np.zeros((n, N_EMBD), np.float32)
    shape = KernelShape.parse(f"{INT_ALL},int_direct={direct}")
    assert {int(gate_up), int(down)} <= shape.int_types()
    assert shape.gate_up_block(int(gate_up)) == 8 * shape.int_ff_per_warp
    float_act, float_h = (cp.asnumpy(a) for a in _run_experts(
        ex, KernelShape.parse("int_gate_up=0,int_down=0"), x, ids, wts, h0))
    # the down launch of both builds on the float build's activations, so h differs only by
    # the down kernel's path
    act, _ = _run_experts(ex, shape, x, ids, wts, h0)
    h = cp.asarray(h0)
    blobs = cp.asarray(cp.asnumpy(ex.blob_of)[ids])
    out = shape.down_block(int(down))
    _kernel(f"moe_down_{ex.types[1]}", shape)(
        ((N_EMBD + out - 1) // out, n), (BLOCK_THREADS,),
        (ex.spec, cp.asarray(float_act), blobs, cp.asarray(wts), h))
    act, h = cp.asnumpy(act), cp.asnumpy(h)
    assert np.isfinite(act).all() and np.isfinite(h).all()
    # the staged path cannot take the rows of these types here (their sizes above)
    aligned = lambda t: t not in (QT.Q6_K, QT.Q3_K, QT.Q2_K) or direct  # noqa: E731
    assert np.array_equal(act, float_act) != aligned(gate_up), "gate/up"
    assert np.array_equal(h, float_h) != aligned(down), "down"


@pytest.mark.parametrize("gate_up,down", [(QT.F16, QT.F16), (QT.Q8_0, QT.Q8_0),
                                          (QT.Q4_K, QT.Q6_K), (QT.Q5_K, QT.Q5_K)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
def test_row_kernels_match_numpy_and_ignore_the_grouping(gate_up, down, mma):
    """The prompt path's expert kernels (ops/moe.py), both builds: pairs of several
    experts, with counts around the FMA slice's 32 and the work item's 128, against float64 numpy (the tensor-core build
    rounds rows and weights to f16); and every pair's bits the same when its expert is computed
    alone or the pair alone (the tier or grouping never shows)."""
    from strata_dist.ops.moe import RowsKernels
    ex = Experts(gate_up, down, seed=int(gate_up) * 10 + int(down))
    spec = ex.rows_layout()
    kernels = RowsKernels(0, mma=mma)
    tol = 5e-3 if mma else 1e-4
    rng = np.random.default_rng(8)
    n = 300
    x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    blob = lambda e: ex.buf[e * ex.stride:e * ex.stride + ex.size]  # noqa: E731
    counts = {0: 1, 3: 31, 5: 32, 6: 33, 7: 127, 8: 128, 10: 129, 9: 260}
    jobs, at = [], 0
    for e, c in counts.items():
        rows = rng.choice(n, c, replace=False)
        jobs.append((blob(e), rows, np.arange(at, at + c)))
        at += c
    out = cp.zeros((at, N_EMBD), cp.float32)
    assert kernels.run_spec(spec, cp.asarray(x), jobs, out)
    got = cp.asnumpy(out)
    for (b, rows, dest), e in zip(jobs, counts):
        g, u, d = (m.astype(np.float64) for m in ex.ref[e])
        gx, ux = x[rows] @ g.T, x[rows] @ u.T
        want = (gx / (1 + np.exp(-gx)) * ux) @ d.T
        np.testing.assert_allclose(got[dest], want, rtol=tol, atol=tol * np.abs(want).max())
        alone = cp.zeros((len(rows), N_EMBD), cp.float32)
        assert kernels.run_spec(spec, cp.asarray(x), [(b, rows, np.arange(len(rows)))], alone)
        assert np.array_equal(cp.asnumpy(alone), got[dest])
        one = cp.zeros((1, N_EMBD), cp.float32)
        assert kernels.run_spec(spec, cp.asarray(x), [(b, rows[-1:], np.zeros(1, int))], one)
        assert np.array_equal(cp.asnumpy(one)[0], got[dest[-1]])


@pytest.mark.parametrize("popularity", ["uniform", "skewed"])
def test_device_grouping_builds_the_host_layout(popularity):
    """experts_rows.cu's group_* kernels (STRATA_DEVICE_ROUTING) against kernels/abi.py
    group_layout, the layout the host path builds: experts with no pair, experts with more than a
    work item, a row that picked nothing; the unused items of the worst-case launch empty."""
    from strata_dist.ops.moe import RowsKernels
    from strata_dist.kernels.abi import group_layout
    rng = np.random.default_rng(11)
    n, k, n_expert = 300, 8, 128
    p = np.ones(n_expert) if popularity == "uniform" else 1.0 / np.arange(1, n_expert + 1) ** 1.5
    ids = np.stack([rng.choice(n_expert, k, replace=False, p=p / p.sum())
                    for _ in range(n)]).astype(np.int32)
    ids[5] = -1
    rows, dest, items = RowsKernels(0).group(cp.asarray(ids), n_expert)
    want_rows, want_dest, want_items = group_layout(ids, n_expert)
    got_items = cp.asnumpy(items)
    np.testing.assert_array_equal(got_items[:len(want_items)], want_items)
    assert (got_items[len(want_items):, 2] == 0).all()
    np.testing.assert_array_equal(cp.asnumpy(rows)[:len(want_rows)], want_rows)
    np.testing.assert_array_equal(cp.asnumpy(dest)[:len(want_dest)], want_dest)


@pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
def test_experts_grouped_on_the_device_equal_the_host_grouping(mma):
    """run_routed (routing and grouping on the device) gives every pair the bits run_spec gives
    it from the host's jobs: the grouping never shows."""
    from strata_dist.ops.moe import RowsKernels
    from strata_dist.experts.stores import stored_rows_jobs
    ex = Experts(QT.Q4_K, QT.Q6_K, seed=31)
    spec = ex.rows_layout()
    kernels = RowsKernels(0, mma=mma)
    rng = np.random.default_rng(13)
    n = 600
    x = cp.asarray(rng.standard_normal((n, N_EMBD)).astype(np.float32))
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n)]).astype(np.int32)
    routed = cp.zeros((n * K, N_EMBD), cp.float32)
    kernels.run_routed(spec, x, cp.asarray(ids), ex.blob_of, routed)
    blob = lambda e: ex.buf[e * ex.stride:e * ex.stride + ex.size]  # noqa: E731
    hosted = cp.zeros((n * K, N_EMBD), cp.float32)
    jobs = stored_rows_jobs(ids.astype(np.int64), np.ones(ids.shape, bool), blob)
    assert kernels.run_spec(spec, x, jobs, hosted)
    assert np.array_equal(cp.asnumpy(routed), cp.asnumpy(hosted))


@pytest.mark.parametrize("popularity", ["uniform", "skewed"])
def test_grouped_pairs_computed_a_few_experts_at_a_time_give_the_same_bits(popularity):
    """A partial cache's prompt path (tiers.py `_prompt_on_device`) groups a layer's pairs once
    and computes them in several launches, each with a blob table holding some experts (0 for
    the others, whose pairs that launch leaves alone): the union is run_routed's output bit for
    bit, whichever experts share a launch, experts with no pair among them."""
    from strata_dist.ops.moe import RowsKernels
    ex = Experts(QT.Q4_K, QT.Q6_K, seed=33)
    spec = ex.rows_layout()
    kernels = RowsKernels(0, mma=True)
    rng = np.random.default_rng(15)
    n = 333
    p = np.ones(N_EXPERT) if popularity == "uniform" else 1.0 / np.arange(1, N_EXPERT + 1) ** 2
    ids = np.stack([rng.choice(N_EXPERT, K, replace=False, p=p / p.sum())
                    for _ in range(n)]).astype(np.int32)
    x = cp.asarray(rng.standard_normal((n, N_EMBD)).astype(np.float32))
    whole = cp.zeros((n * K, N_EMBD), cp.float32)
    kernels.run_routed(spec, x, cp.asarray(ids), ex.blob_of, whole)
    table = cp.asnumpy(ex.blob_of)
    parts = cp.full((n * K, N_EMBD), np.nan, cp.float32)
    pairs = kernels.group_routed(spec, x, cp.asarray(ids), N_EXPERT)
    order = rng.permutation(N_EXPERT)
    for batch in np.array_split(order, 4):
        only = np.zeros(N_EXPERT, dtype=np.uint64)
        only[batch] = table[batch]
        kernels.compute_grouped(pairs, cp.asarray(only), parts)
    np.testing.assert_array_equal(cp.asnumpy(pairs.counts), np.bincount(ids.ravel(),
                                                                        minlength=N_EXPERT))
    assert np.isfinite(cp.asnumpy(whole)).all()
    assert np.array_equal(cp.asnumpy(parts), cp.asnumpy(whole))


@pytest.mark.parametrize("gate_up,down", [(QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0)],
                         ids=lambda t: t.name)
def test_row_kernels_read_blobs_in_pinned_host_memory_to_the_same_bits(gate_up, down):
    """The tensor-core row kernels copy their weight stages with the copy engine
    (cp.async.bulk, experts_rows.cu): blobs read in place from pinned host memory (over PCIe) give
    every pair the bits the same blobs give in device memory."""
    from strata_dist.ops.moe import RowsKernels
    ex = Experts(gate_up, down, seed=41)
    spec = ex.rows_layout()
    kernels = RowsKernels(0, mma=True)
    rng = np.random.default_rng(14)
    n = 200
    x = cp.asarray(rng.standard_normal((n, N_EMBD)).astype(np.float32))
    ids = cp.asarray(np.stack([rng.choice(N_EXPERT, K, replace=False)
                               for _ in range(n)]).astype(np.int32))
    on_card = cp.zeros((n * K, N_EMBD), cp.float32)
    kernels.run_routed(spec, x, ids, ex.blob_of, on_card)
    pinned = cp.cuda.alloc_pinned_memory(ex.buf.nbytes)
    host = np.frombuffer(pinned, np.uint8, ex.buf.nbytes)
    host[:] = cp.asnumpy(ex.buf)
    table = cp.asarray(np.array([pinned.ptr + e * ex.stride for e in range(N_EXPERT)],
                                dtype=np.uint64))
    in_host = cp.zeros_like(on_card)
    kernels.run_routed(spec, x, ids, table, in_host)
    assert np.isfinite(cp.asnumpy(on_card)).all()
    assert np.array_equal(cp.asnumpy(in_host), cp.asnumpy(on_card))


# A second process's device allocation holding the same bytes, exported through CUDA IPC: what a
# helper tier's slot on another card of the host is to a stage (one GPU here, so the same card).
_IPC_EXPORTER = """
import sys, numpy as np, cupy as cp
data = cp.asarray(np.fromfile(sys.argv[1], dtype=np.uint8))
ptr = cp.cuda.runtime.malloc(data.nbytes)        # its own allocation: the handle names its base
cp.cuda.runtime.memcpy(ptr, data.data.ptr, data.nbytes, 3)      # device to device
cp.cuda.runtime.deviceSynchronize()
print(cp.cuda.runtime.ipcGetMemHandle(ptr).hex(), flush=True)
sys.stdin.readline()                               # the importer is done with it
cp.cuda.runtime.free(ptr)
"""


@pytest.mark.parametrize("gate_up,down", [(QT.Q4_K, QT.Q6_K), (QT.Q8_0, QT.Q8_0)],
                         ids=lambda t: t.name)
def test_expert_kernels_give_the_same_bits_wherever_the_blob_lies(tmp_path, gate_up, down):
    """The decode graph's expert kernels and the prompt's row kernels read a blob by address: in
    the stage's own device memory, in another process's allocation opened through CUDA IPC (a
    helper tier's slot) and in pinned host memory read in place, every output has the same bits."""
    import subprocess
    import sys
    from strata_dist.ops.moe import RowsKernels
    ex = Experts(gate_up, down, seed=43)
    nbytes = int(ex.buf.nbytes)
    raw = tmp_path / "blobs.bin"
    raw.write_bytes(cp.asnumpy(ex.buf).tobytes())
    exporter = subprocess.Popen([sys.executable, "-c", _IPC_EXPORTER, str(raw)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pinned = cp.cuda.alloc_pinned_memory(nbytes)
    np.frombuffer(pinned, np.uint8, nbytes)[:] = cp.asnumpy(ex.buf)
    opened = None
    try:
        import select
        ready, _, _ = select.select([exporter.stdout], [], [], 120)
        assert ready, "the exporting process sent no handle in 120 s"
        handle = bytes.fromhex(exporter.stdout.readline().strip())
        opened = cp.cuda.runtime.ipcOpenMemHandle(handle)
        bases = {"device": int(ex.buf.data.ptr), "ipc": int(opened), "pinned": int(pinned.ptr)}
        rng = np.random.default_rng(15)
        n = 3                                        # decode rows
        x = cp.asarray(rng.standard_normal((n, N_EMBD)).astype(np.float32))
        ids = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(n)])
        wts = cp.asarray(rng.random((n, K)).astype(np.float32))
        rows_x = cp.asarray(rng.standard_normal((64, N_EMBD)).astype(np.float32))
        rows_ids = cp.asarray(np.stack([rng.choice(N_EXPERT, K, replace=False)
                                        for _ in range(64)]).astype(np.int32))
        kernels, spec = RowsKernels(0, mma=True), ex.rows_layout()
        shape = KernelShape()
        ff, per = shape.gate_up_block(int(gate_up)), shape.down_block(int(down))
        got = {}
        for where, base in bases.items():
            table = np.array([base + e * ex.stride for e in range(N_EXPERT)], dtype=np.uint64)
            table_d = cp.asarray(table)
            ex_spec = cd._spec_array(EXPERT_SPEC, [dict(
                blob_of=int(table_d.data.ptr), up_at=spec.up_at, down_at=spec.down_at,
                gate_row_bytes=spec.gate_row_bytes, up_row_bytes=spec.up_row_bytes,
                down_row_bytes=spec.down_row_bytes, gate_type=int(gate_up), up_type=int(gate_up),
                down_type=int(down), n_ff=N_FF, n_embd=N_EMBD, k=K)])
            act = cp.zeros((n, K, N_FF), cp.float32)
            h = cp.zeros((n, N_EMBD), cp.float32)
            blobs = cp.asarray(table[ids])
            _kernel(f"moe_gate_up_{ex.types[0]}")(
                ((N_FF + ff - 1) // ff, K, n), (BLOCK_THREADS,), (ex_spec, x, blobs, act))
            _kernel(f"moe_down_{ex.types[1]}")(
                ((N_EMBD + per - 1) // per, n), (BLOCK_THREADS,), (ex_spec, act, blobs, wts, h))
            routed = cp.zeros((64 * K, N_EMBD), cp.float32)
            kernels.run_routed(spec, rows_x, rows_ids, table_d, routed)
            got[where] = [cp.asnumpy(a) for a in (act, h, routed)]
        assert all(np.isfinite(a).all() for a in got["device"])
        for where in ("ipc", "pinned"):
            for a, b in zip(got[where], got["device"]):
                assert np.array_equal(a, b), where
    finally:
        if opened is not None:
            cp.cuda.runtime.ipcCloseMemHandle(opened)
        try:
            exporter.communicate("done\n", timeout=60)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.communicate(timeout=10)


@pytest.mark.parametrize("qtype,shape", [(QT.Q8_0, "int_gate_up=0,int_down=0"),
                                         (QT.Q8_0, ""), (QT.Q4_K, ""),
                                         (QT.Q4_K, "int_direct=0"), (QT.Q5_K, "int_q5_k=1"),
                                         (QT.Q5_K, "int_q5_k=0"), (QT.IQ4_XS, "int_iq4_xs=0"),
                                         (QT.Q6_K, "int_q6_k=1"), (QT.Q3_K, "int_q3_k=1"),
                                         (QT.Q2_K, "int_q2_k=1"),
                                         (QT.Q5_K, "int_q5_k=1,int_direct=0"),
                                         (QT.IQ4_XS, "int_iq4_xs=1"), (QT.IQ3_S, "int_iq3_s=1"),
                                         (QT.IQ2_XXS, "int_iq2_xxs=1,int_direct=0")], ids=str)
def test_a_missing_expert_reads_as_nan(qtype, shape):
    """A blob address of 0 (not resident) must never pass for a result (the integer path's
    blocks hand such an expert to the float body)."""
    shape = KernelShape.parse(shape)
    ex = Experts(qtype, qtype, seed=9)
    blobs = cp.asarray(np.array([[int(cp.asnumpy(ex.blob_of)[0]), 0, 0, 0]], dtype=np.uint64))
    act = cp.zeros((1, K, N_FF), cp.float32)
    h = cp.zeros((1, N_EMBD), cp.float32)
    x = cp.ones((1, N_EMBD), cp.float32)
    ff, out = shape.gate_up_block(int(qtype)), shape.down_block(int(qtype))
    name = qtype.name.lower()
    _kernel(f"moe_gate_up_{name}", shape)(((N_FF + ff - 1) // ff, K, 1),
                                         (BLOCK_THREADS,), (ex.spec, x, blobs, act))
    _kernel(f"moe_down_{name}", shape)(((N_EMBD + out - 1) // out, 1), (BLOCK_THREADS,),
                                      (ex.spec, act, blobs, cp.ones((1, K), cp.float32), h))
    act, h = cp.asnumpy(act), cp.asnumpy(h)
    assert np.isfinite(act[0, 0]).all() and np.isnan(act[0, 1:]).all()
    assert np.isnan(h).all()


@pytest.mark.parametrize("length", [1, 63, 64, 65, 300, 1000])
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_attention_kernel_matches_numpy(length, chunk, kv_type):
    check_attention_kernel(length, chunk, kv_type, n_head=32)


@pytest.mark.parametrize("n_head", [4, 8, 12, 16, 40, 64])
def test_attention_kernel_builds_for_each_group(n_head):
    """The builds for at most 2, 4, 8 and 16 query heads per kv head, full and partly used."""
    check_attention_kernel(300, 64, "f16", n_head=n_head)


@pytest.mark.parametrize("heads_per_block", [2, 4])
@pytest.mark.parametrize("length,kv_type", [(1, "f16"), (40, "q8_0"), (300, "f16"),
                                            (1000, "q8_0")])
def test_attention_kernel_splits_a_group_over_blocks(heads_per_block, length, kv_type):
    """A kv head's 8 query heads taken 2 or 4 to a block (STRATA_ATTN_HEADS), with one split
    (the block writes the attention itself) and several (the last block combines them)."""
    check_attention_kernel(length, 64, kv_type, n_head=32, heads_per_block=heads_per_block)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("heads_per_block", [2, 8])
@pytest.mark.parametrize("length", [1, 300])
def test_attention_kernel_of_256_wide_heads(heads_per_block, length, kv_type):
    """attn_decode_256_g* (next_attention.cuh: qwen3next's heads; f16 K/V, or q8_0's `_q8`
    builds): the same reference, Qwen3-Next-80B's 16 query heads over 2 kv heads."""
    check_attention_kernel(length, 64, kv_type, n_head=16, heads_per_block=heads_per_block,
                           head_dim=256, n_kv=2)


def check_attention_kernel(length, chunk, kv_type, n_head, heads_per_block=None, head_dim=128,
                           n_kv=4):
    """attn_decode_<head_dim>_g* (and _q8): causal attention of each row over the session's KV,
    f16 or in q8_0 blocks (the host's Q8Rows wrote them), the splits combined by the last block of
    each head group, for rows at positions length-1, length, ..."""
    from strata_dist.backends.kv_cache import Q8Rows
    D, n = head_dim, 3
    cells = 1024 + n
    n_split = math.ceil(cells / chunk)
    rng = np.random.default_rng(length + chunk)
    k = rng.standard_normal((cells, n_kv, D)).astype(np.float16)
    v = rng.standard_normal((cells, n_kv, D)).astype(np.float16)
    q = rng.standard_normal((MAX_ROWS, n_head * D)).astype(np.float32)
    rope = cp.zeros((cells, D // 2), cp.float32)
    if kv_type == "f16":
        kd, vd = cp.asarray(k), cp.asarray(v)
        table = [kd.data.ptr, vd.data.ptr, rope.data.ptr, rope.data.ptr]
    else:
        kd, vd = Q8Rows(cp, k.shape), Q8Rows(cp, v.shape)
        kd[0:cells], vd[0:cells] = cp.asarray(k), cp.asarray(v)
        k, v = cp.asnumpy(kd[0:cells]), cp.asnumpy(vd[0:cells])      # what the kernel reads
        table = [kd.q.data.ptr, vd.q.data.ptr, rope.data.ptr, rope.data.ptr,
                 kd.scale.data.ptr, vd.scale.data.ptr]
    sess = cp.asarray(np.array(table, dtype=np.uint64))
    desc = cp.asarray(np.array([length - 1, n] + [0] * (DESC_WORDS - 2), dtype=np.int32))
    part = cp.zeros(MAX_ROWS * n_head * n_split * D, cp.float32)
    ml = cp.zeros(MAX_ROWS * n_head * n_split * 2, cp.float32)
    hb = heads_per_block or n_head // n_kv
    done = cp.zeros(MAX_ROWS * (n_head // hb), cp.uint32)
    out = cp.zeros((MAX_ROWS, n_head * D), cp.float32)
    scale = 1 / math.sqrt(D)
    for _ in range(2):                  # the counters are back at 0 for the next launch
        _kernel(attn_kernel(n_head // n_kv, kv_type, hb, head_dim))(
            (n_head // hb, n_split, n), (BLOCK_THREADS,),
            (cp.asarray(q), sess, np.int32(0), desc, np.int32(n_head), np.int32(n_kv),
             np.int32(n_split), np.int32(chunk), np.float32(scale), part, ml, done, out,
             np.int32(1)))
        assert not cp.asnumpy(done).any()
    got = cp.asnumpy(out)[:n].reshape(n, n_head, D)
    G = n_head // n_kv
    for i in range(n):
        keys = length + i
        for h in range(n_head):
            kk = k[:keys, h // G].astype(np.float64)
            s = kk @ q[i, h * D:(h + 1) * D] * scale
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v[:keys, h // G].astype(np.float64)
            np.testing.assert_allclose(got[i, h], want, rtol=1e-3, atol=1e-4,
                                       err_msg=f"row {i} head {h}")


@pytest.mark.parametrize("n_head,n_kv,D", [(32, 4, 128), (16, 2, 256)])
@pytest.mark.parametrize("n,pos0", [(9, 0), (64, 0), (65, 37), (200, 500), (130, 64), (300, 0),
                                   (129, 4000)])
def test_prefill_attention_kernel_matches_numpy(n, pos0, n_head, n_kv, D, monkeypatch):
    """kernels/prefill_attention.cu (STRATA_FLASH_PREFILL=1): a prompt chunk's rows at positions
    pos0.. over f16 K/V, causal, against float64 numpy (the kernel rounds q and the softmax
    weights to f16): Qwen3-30B-A3B's heads (32 over 4 kv heads of 128, two 16-row tiles a warp)
    and Qwen3-Next-80B's (16 over 2 of 256, each head's output dims over two warps). Every row:
    ragged last blocks, warps past the chunk, tiles straddling the diagonal, and blocks whose
    keys start far before their rows."""
    from strata_dist.backends import get_backend
    monkeypatch.setenv("STRATA_FLASH_PREFILL", "1")
    be = get_backend("cuda:0")
    t = pos0 + n
    rng = np.random.default_rng(n + pos0)
    q = rng.standard_normal((n, n_head, D)).astype(np.float32)
    k = rng.standard_normal((t, n_kv, D)).astype(np.float16)
    v = rng.standard_normal((t, n_kv, D)).astype(np.float16)
    got = be.prompt_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), pos0)
    assert got is not None and got.shape == (n, n_head, D)
    got = cp.asnumpy(got)
    G = n_head // n_kv
    for i in range(n):
        keys = pos0 + i + 1
        for h in range(0, n_head, 5):
            s = k[:keys, h // G].astype(np.float64) @ q[i, h].astype(np.float64) / math.sqrt(D)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v[:keys, h // G].astype(np.float64)
            np.testing.assert_allclose(got[i, h], want, rtol=5e-3, atol=5e-3,
                                       err_msg=f"row {i} head {h}")
