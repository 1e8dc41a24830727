"""qwen3next's q8_0 decode attention and K/V write (kernels/attention.cuh attn_decode_body and
norm_rope_head, the code of next_attention.cuh's attn_decode_256_g*_q8[_ring] and
next_qk_norm_rope_kv_q8[_ring]) run on the host, every thread of a block as a thread
(tests/cuda_block_emulator.py; g++, no GPU), on random cells kept by numpy's Q8Rows:

- the attention of 3 rows over 41 cells (one split) and 300 (several, combined by the last
  block), 256-wide heads of the test model (4 query heads over 2) and of Qwen3-Next-80B (16 over
  2), against float64 numpy over the cells Q8Rows reads back; the ring build (4 sinks, a ring of
  40, the host copy of the cells the card holds overwritten with garbage, so a cell read from
  the wrong side shows) the plain build's output bit for bit;
- the write of 3 rows at positions 57.. (q and k normed, their first 64 dims rotated): the
  cells are Q8Rows' quantization of numpy's rows (codes within one step where the two sides'
  floats straddle a rounding step, a handful at most), q numpy's within float rounding, and the
  ring build's slot and host copy the plain build's cells bit for bit.

issue 47 (tests/test_kv_q8_routing_tie.py) put the H100 failures of tests/test_gpu_kv_q8.py on
a routing tie; this is the kernels' side of that account, checked where no GPU is."""
import re
import subprocess

import numpy as np
import pytest

from cuda_block_emulator import CUDA_INCLUDE, CXX, build, emulated_source
from strata_dist.backends.array_ops import apply_rope, rms_norm
from strata_dist.backends.kv_cache import Q8Rows
from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import DESC_WORDS, MAX_ROWS

pytestmark = pytest.mark.skipif(CXX is None or CUDA_INCLUDE is None,
                                reason="g++ or the CUDA toolkit's headers are not installed")

D, ROT = 256, 64
SINKS, RING = 4, 40

BODY = r"""
template <class T> static bool get(FILE* f, std::vector<T>& v, size_t n) {
    v.resize(n);
    return fread(v.data(), sizeof(T), n, f) == n;
}

template <int MAX_G, bool RING>
static void attend(const float* q, const u64* sess, const int* desc, int n_head, int n_kv,
                   int n_split, int chunk, int rows, int hb, float* out) {
    std::vector<float> part((size_t)MAX_ROWS * n_head * n_split * NEXT_D),
        ml((size_t)MAX_ROWS * n_head * n_split * 2);
    std::vector<u32> done((size_t)MAX_ROWS * (n_head / hb), 0u);
    emu_launch(EmuDim{(unsigned)(n_head / hb), (unsigned)n_split, (unsigned)rows}, BLOCK_THREADS,
               [&] {
        attn_decode_body<NEXT_D, true, MAX_G, RING>(q, sess, 0, desc, n_head, n_kv, n_split,
                                                    chunk, 1.f / 16.f, part.data(), ml.data(),
                                                    done.data(), out, 1);
    });
    for (u32 c : done) if (c != 0u) { fprintf(stderr, "a done counter left at %u\n", c); exit(3); }
}

template <bool RING>
static void write_kv(float* qg, const float* k, const float* v, const float* qn, const float* kn,
                     const u64* sess, const int* desc, int n_head, int n_kv, int rows, float* q) {
    emu_launch(EmuDim{(unsigned)(n_head + n_kv), (unsigned)rows, 1}, 32, [&] {
        const int head = blockIdx.x, i = blockIdx.y;
        float* q_dst = head < n_head ? q + ((i64)i * n_head + head) * NEXT_D : nullptr;
        norm_rope_head<true, NEXT_D, NEXT_ROT, 2 * NEXT_D, RING>(
            qg, k, v, qn, kn, sess, 0, 1, desc, n_head, n_kv, 1e-6f, i, head, threadIdx.x, q_dst);
    });
}

// The cells' arrays: plain [k, v, cos, sin, k scales, v scales], or the ring's card (sinks +
// ring slots) and host copy with the geometry word (attention.cuh KV_HOST_BASE for one layer)
struct Cells {
    std::vector<signed char> kq, vq, card_kq, card_vq;
    std::vector<u16> ks, vs, card_ks, card_vs;
};

int main(int argc, char** argv) {
    FILE* in = fopen(argv[2], "rb");
    FILE* res = fopen(argv[3], "wb");
    int h[10];      // n_head, n_kv, hb, ring, cells, rows, pos0, chunk, n_split, end
    if (fread(h, sizeof h, 1, in) != 1) return 1;
    const int n_head = h[0], n_kv = h[1], hb = h[2], ring = h[3], cells = h[4], rows = h[5];
    const int pos0 = h[6], chunk = h[7], n_split = h[8];
    const size_t cell_vals = (size_t)n_kv * NEXT_D, cell_sc = cell_vals / 32;
    const size_t slots = ring ? SINKS_ + RING_ : cells;
    Cells c;
    std::vector<float> cosT, sinT;
    if (!get(in, c.kq, cells * cell_vals) || !get(in, c.ks, cells * cell_sc) ||
        !get(in, c.vq, cells * cell_vals) || !get(in, c.vs, cells * cell_sc) ||
        !get(in, c.card_kq, slots * cell_vals) || !get(in, c.card_ks, slots * cell_sc) ||
        !get(in, c.card_vq, slots * cell_vals) || !get(in, c.card_vs, slots * cell_sc) ||
        !get(in, cosT, (size_t)cells * NEXT_ROT / 2) ||
        !get(in, sinT, (size_t)cells * NEXT_ROT / 2))
        return 1;
    std::vector<u64> sess;
    auto P = [](const void* p) { return (u64)(uintptr_t)p; };
    if (ring)
        sess = {P(c.card_kq.data()), P(c.card_vq.data()), P(cosT.data()), P(sinT.data()),
                P(c.card_ks.data()), P(c.card_vs.data()), P(c.kq.data()), P(c.vq.data()),
                P(c.ks.data()), P(c.vs.data()), (u64)SINKS_ | ((u64)RING_ << 32)};
    else
        sess = {P(c.kq.data()), P(c.vq.data()), P(cosT.data()), P(sinT.data()), P(c.ks.data()),
                P(c.vs.data())};
    std::vector<int> desc(DESC_WORDS_, 0);
    desc[0] = pos0;
    desc[1] = rows;
    if (std::string(argv[1]) == "attend") {
        std::vector<float> q, out((size_t)MAX_ROWS * n_head * NEXT_D, 0.f);
        if (!get(in, q, (size_t)MAX_ROWS * n_head * NEXT_D)) return 1;
        // the build: at most 2 or 8 query heads a block (hb of them, as kernels/abi.py picks)
        const bool wide = n_head / n_kv >= 8;
        auto run = wide ? (ring ? attend<8, true> : attend<8, false>)
                        : (ring ? attend<2, true> : attend<2, false>);
        run(q.data(), sess.data(), desc.data(), n_head, n_kv, n_split, chunk, rows, hb,
            out.data());
        fwrite(out.data(), 4, (size_t)rows * n_head * NEXT_D, res);
    } else {
        std::vector<float> qg, k, v, qn, kn, q((size_t)rows * n_head * NEXT_D, 0.f);
        if (!get(in, qg, (size_t)rows * n_head * 2 * NEXT_D) || !get(in, k, rows * cell_vals) ||
            !get(in, v, rows * cell_vals) || !get(in, qn, NEXT_D) || !get(in, kn, NEXT_D))
            return 1;
        (ring ? write_kv<true> : write_kv<false>)(qg.data(), k.data(), v.data(), qn.data(),
                                                  kn.data(), sess.data(), desc.data(), n_head,
                                                  n_kv, rows, q.data());
        fwrite(q.data(), 4, q.size(), res);
        for (auto* a : {&c.kq, &c.vq, &c.card_kq, &c.card_vq})
            fwrite(a->data(), 1, a->size(), res);
        for (auto* a : {&c.ks, &c.vs, &c.card_ks, &c.card_vs})
            fwrite(a->data(), 2, a->size(), res);
    }
    return fclose(res) == 0 ? 0 : 1;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attnq8")
    exe = tmp / "attn_q8"
    defines = (f"#define SINKS_ {SINKS}\n#define RING_ {RING}\n#define DESC_WORDS_ {DESC_WORDS}\n"
               "#include <string>\n")
    # next_attention.cuh's widths without its kernels (they need gated_delta.cuh's too)
    widths = "\n".join(line for line in (KERNEL_DIR / "next_attention.cuh").read_text().splitlines()
                        if re.match(r"#define NEXT_(D|ROT) ", line))
    assert f"#define NEXT_D {D} " in widths and f"#define NEXT_ROT {ROT} " in widths, widths
    source = emulated_source(defines + widths + "\n" + BODY, "attention.cuh")
    done = subprocess.run(build(source, exe), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe, tmp


def _slot(p):
    return p if p < SINKS else SINKS + (p - SINKS) % RING


def _card(rows: Q8Rows, end: int, slots: int):
    """The card's sinks and ring after cells [0, end) were written in order: (values, scales)."""
    q = np.zeros((slots,) + rows.q.shape[1:], np.int8)
    sc = np.zeros((slots,) + rows.scale.shape[1:], np.float16)
    for p in range(end):
        q[_slot(p)], sc[_slot(p)] = rows.q[p], rows.scale[p]
    return q, sc


def _run(harness, mode: str, header, arrays) -> bytes:
    exe, tmp = harness
    src, dst = tmp / f"{mode}.in", tmp / f"{mode}.out"
    with open(src, "wb") as f:
        f.write(np.asarray(header, np.int32).tobytes())
        for a in arrays:
            f.write(np.ascontiguousarray(a).tobytes())
    done = subprocess.run([str(exe), mode, str(src), str(dst)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return dst.read_bytes()


def _cells_arrays(k: Q8Rows, v: Q8Rows, ring: bool, end: int, rng, cells: int):
    """The harness's cell arrays: every cell (the ring's host copy, the cells the card holds
    overwritten with garbage there) and the card's slots; and the RoPE tables."""
    kq, ks, vq, vs = k.q.copy(), k.scale.copy(), v.q.copy(), v.scale.copy()
    if ring:
        card = [*_card(k, end, SINKS + RING), *_card(v, end, SINKS + RING)]
        on_card = [p for p in range(end) if p < SINKS or p >= end - RING]
        for a in (kq, vq):
            a[on_card] = rng.integers(-127, 128, a[on_card].shape)
        for a in (ks, vs):
            a[on_card] = np.float16(3.0)
    else:
        card = [kq, ks, vq, vs]
    rope = rng.standard_normal((2, cells, ROT // 2)).astype(np.float32)
    return [kq, ks.view(np.uint16), vq, vs.view(np.uint16), card[0], card[1].view(np.uint16),
            card[2], card[3].view(np.uint16), rope[0], rope[1]], rope


@pytest.mark.parametrize("n_head,n_kv,hb", [(4, 2, 2), (16, 2, 8)])
@pytest.mark.parametrize("length", [41, 300])
def test_the_q8_0_attention_of_256_wide_heads_matches_numpy(harness, n_head, n_kv, hb, length):
    cells, rows, chunk = 320, 3, 64
    n_split, pos0 = -(-cells // chunk), length - 1
    rng = np.random.default_rng(length + n_head)
    k, v = Q8Rows(np, (cells, n_kv, D)), Q8Rows(np, (cells, n_kv, D))
    k[0:cells] = rng.standard_normal((cells, n_kv, D)).astype(np.float32)
    v[0:cells] = rng.standard_normal((cells, n_kv, D)).astype(np.float32)
    q = rng.standard_normal((MAX_ROWS, n_head * D)).astype(np.float32)
    outs = []
    for ring in (False, True):
        arrays, _ = _cells_arrays(k, v, ring, pos0 + rows, rng, cells)
        header = [n_head, n_kv, hb, int(ring), cells, rows, pos0, chunk, n_split, pos0 + rows]
        raw = _run(harness, "attend", header, arrays + [q])
        outs.append(np.frombuffer(raw, np.float32).reshape(rows, n_head, D))
    assert np.array_equal(outs[1], outs[0])          # the ring's reads: the plain build's
    kf, vf = k[0:cells].astype(np.float64), v[0:cells].astype(np.float64)
    G = n_head // n_kv
    for i in range(rows):
        keys = pos0 + i + 1
        for h in range(n_head):
            s = kf[:keys, h // G] @ q[i, h * D:(h + 1) * D].astype(np.float64) / 16
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vf[:keys, h // G]
            np.testing.assert_allclose(outs[0][i, h], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"row {i} head {h}")


def _write(harness, ring: bool, pos0: int, inputs, n_head: int, n_kv: int, rows: int,
           cells: int) -> dict:
    """One launch of the write over fresh zeroed cells: q out, and the cells and card slots."""
    rng = np.random.default_rng(7)
    zeros = Q8Rows(np, (cells, n_kv, D))
    arrays, rope = _cells_arrays(zeros, zeros, ring, 0, rng, cells)
    header = [n_head, n_kv, 0, int(ring), cells, rows, pos0, 0, 0, pos0 + rows]
    raw = _run(harness, "write", header, arrays + list(inputs))
    slots = SINKS + RING if ring else cells
    sizes = [rows * n_head * D * 4] + [n * n_kv * D for n in (cells, cells, slots, slots)] + \
            [n * n_kv * D // 16 for n in (cells, cells, slots, slots)]
    parts, at = [], 0
    for n in sizes:
        parts.append(raw[at:at + n])
        at += n
    assert at == len(raw)
    out = {"q": np.frombuffer(parts[0], np.float32).reshape(rows, n_head, D), "rope": rope}
    for name, b in zip(("kq", "vq", "card_kq", "card_vq"), parts[1:5]):
        out[name] = np.frombuffer(b, np.int8).reshape(-1, n_kv, D)
    for name, b in zip(("ks", "vs", "card_ks", "card_vs"), parts[5:9]):
        out[name] = np.frombuffer(b, np.float16).reshape(-1, n_kv, D // 32)
    return out


def test_the_q8_0_write_of_256_wide_heads_quantizes_numpys_rows(harness):
    n_head, n_kv, rows, cells, pos0 = 4, 2, 3, 64, 57
    rng = np.random.default_rng(8)
    qg = rng.standard_normal((rows, n_head, 2 * D)).astype(np.float32)
    kx = rng.standard_normal((rows, n_kv, D)).astype(np.float32)
    vx = rng.standard_normal((rows, n_kv, D)).astype(np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    plain, ring = (_write(harness, r, pos0, (qg, kx, vx, qn, kn), n_head, n_kv, rows, cells)
                   for r in (False, True))
    rope = plain["rope"]
    cos, sin = rope[0][pos0:pos0 + rows], rope[1][pos0:pos0 + rows]
    want_q = apply_rope(rms_norm(qg[..., :D], qn, 1e-6, np), cos, sin, np)
    np.testing.assert_allclose(plain["q"], want_q, rtol=1e-5, atol=1e-5)
    want_k, want_v = Q8Rows(np, (rows, n_kv, D)), Q8Rows(np, (rows, n_kv, D))
    want_k[0:rows] = apply_rope(rms_norm(kx, kn, 1e-6, np), cos, sin, np)
    want_v[0:rows] = vx
    new = slice(pos0, pos0 + rows)
    # V is stored as given: the same floats, the same blocks, bit for bit
    assert np.array_equal(plain["vq"][new], want_v.q)
    assert np.array_equal(plain["vs"][new], want_v.scale)
    # K is normed and rotated on each side in its own order: a code may sit across a step
    code_diff = np.abs(plain["kq"][new].astype(int) - want_k.q.astype(int))
    scale_ulps = np.abs(plain["ks"][new].view(np.int16).astype(int)
                        - want_k.scale.view(np.int16))
    assert code_diff.max() <= 1 and scale_ulps.max() <= 1 and (code_diff > 0).sum() <= 8
    others = np.ones(cells, bool)
    others[new] = False
    for name in ("kq", "vq", "ks", "vs"):
        assert not plain[name][others].any(), name          # no other cell written
        assert np.array_equal(ring[name], plain[name]), name  # the host copy: the same cells
    # the ring's card: each new cell in its slot, as the plain build wrote it
    at = [SINKS + (p - SINKS) % RING for p in range(pos0, pos0 + rows)]
    for card, cells_of in (("card_kq", "kq"), ("card_vq", "vq"), ("card_ks", "ks"),
                           ("card_vs", "vs")):
        assert np.array_equal(ring[card][at], plain[cells_of][new]), card
    assert np.array_equal(ring["q"], plain["q"])
