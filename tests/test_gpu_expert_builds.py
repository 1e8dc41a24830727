"""Kernel builds that must change no bit of the decode expert kernels' outputs (KernelShape
switches that move loads or share reads, not sums): each build's outputs against the default
build's, bit for bit, and near float64 over gguf-py's decoding. Run on the GPU machine: pytest -m gpu."""
import numpy as np
import pytest

from quant_rows import random_rows

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf import GGMLQuantizationType as QT  # noqa: E402
from test_gpu_kernels import K, N_EMBD, N_FF, Experts, _kernel  # noqa: E402

from strata_dist.backends import cuda_decode as cd  # noqa: E402
from strata_dist.kernels.abi import BLOCK_THREADS, EXPERT_SPEC, KernelShape  # noqa: E402


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ3_S], ids=lambda t: t.name)
@pytest.mark.parametrize("ahead", [2, 4])
def test_down_ahead_changes_no_bit(qtype, ahead):
    """int_down_ahead loads a lane's next (row, unit) pairs of the integer moe_down before its
    first dot and adds their dots in the same order: its h is the default build's bit for bit, at
    the Qwen3-30B-A3B expert shape (k = 8 rows of n_ff = 768: 96 pairs, 3 a lane, so a lane's
    pairs end part way through a group of 2 and of 4), one row and three, and near float64."""
    n_ff, n_embd, k, n_expert = 768, 512, 8, 12
    downs = [random_rows(qtype, n_embd, n_ff, 40 + e) for e in range(n_expert)]
    row_bytes = downs[0][0].nbytes // n_embd
    stride = (downs[0][0].nbytes + 255) // 256 * 256
    host = np.zeros(stride * n_expert, np.uint8)
    for e, (raw, _) in enumerate(downs):
        host[e * stride:e * stride + raw.nbytes] = raw.reshape(-1)
    buf = cp.asarray(host)
    blob_of = np.array([int(buf.data.ptr) + e * stride for e in range(n_expert)], np.uint64)
    blob_table = cp.asarray(blob_of)         # held: the spec points at it
    spec = cd._spec_array(EXPERT_SPEC, [dict(
        blob_of=int(blob_table.data.ptr), up_at=0, down_at=0, gate_row_bytes=0,
        up_row_bytes=0, down_row_bytes=row_bytes, gate_type=int(qtype), up_type=int(qtype),
        down_type=int(qtype), n_ff=n_ff, n_embd=n_embd, k=k)])
    rng = np.random.default_rng(3)
    for n in (1, 3):
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)])
        blobs = cp.asarray(blob_of[ids])
        act = rng.standard_normal((n, k, n_ff)).astype(np.float32)
        wts = rng.random((n, k)).astype(np.float32)
        h0 = rng.standard_normal((n, n_embd)).astype(np.float32)
        outs = []
        for text in ("", f"int_down_ahead={ahead}"):
            shape = KernelShape.parse(text)
            out = shape.down_block(int(qtype))
            h = cp.asarray(h0)
            _kernel(f"moe_down_{qtype.name.lower()}", shape)(
                ((n_embd + out - 1) // out, n), (BLOCK_THREADS,),
                (spec, cp.asarray(act), blobs, cp.asarray(wts), h))
            outs.append(cp.asnumpy(h))
        np.testing.assert_array_equal(outs[1], outs[0])
        want = h0.astype(np.float64) + np.stack([
            sum(wts[i, r] * (downs[ids[i, r]][1].astype(np.float64) @ act[i, r])
                for r in range(k)) for i in range(n)])
        np.testing.assert_allclose(outs[1], want, rtol=1e-3, atol=1e-3 * np.abs(want - h0).max())


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.IQ3_S, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("group", [2, 8])
def test_gate_up_group_changes_no_bit(qtype, group):
    """int_gate_up_group: a batched step's pairs of one expert are taken by one block of
    moe_gate_up_group_<type>, the expert's rows read once for them; every pair's act is the
    per-pair kernel's bit for bit (and near float64). 12 rows: one expert chosen by every row (more
    pairs than a group holds, so several blocks take them, the last not full), others by some
    rows; and one row (no grouping). Q8_0 is not on the integer path: its group kernel is the
    per-pair one."""
    ex = Experts(qtype, qtype, seed=70 + int(qtype))
    shape = KernelShape.parse(f"int_gate_up_group={group}")
    assert shape.gate_up_grouped(int(qtype)) == (qtype != QT.Q8_0)
    rng = np.random.default_rng(11)
    for n in (12, 1):
        ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, 6), K - 1, replace=False)])
                        for _ in range(n)])
        rng.shuffle(ids, axis=1)
        x = rng.standard_normal((n, N_EMBD)).astype(np.float32)
        blobs = cp.asarray(cp.asnumpy(ex.blob_of)[ids])
        acts = []
        for name, build in ((f"moe_gate_up_{ex.types[0]}", KernelShape()),
                            (f"moe_gate_up_group_{ex.types[0]}", shape)):
            ff = build.gate_up_block(ex.gate_up_type)
            act = cp.full((n, K, N_FF), cp.nan, cp.float32)
            _kernel(name, build)(((N_FF + ff - 1) // ff, K, n), (BLOCK_THREADS,),
                                 (ex.spec, cp.asarray(x), blobs, act))
            acts.append(cp.asnumpy(act))
        np.testing.assert_array_equal(acts[1], acts[0])
        for i in range(n):
            for r in range(K):
                g, u, _ = ex.ref[ids[i, r]]
                gv, uv = g.astype(np.float64) @ x[i], u.astype(np.float64) @ x[i]
                want = gv / (1 + np.exp(-gv)) * uv
                np.testing.assert_allclose(acts[1][i, r], want, rtol=1e-4,
                                           atol=1e-4 * np.abs(want).max())
