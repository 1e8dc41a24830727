"""The grouped decode down projection (kernels/experts_grouped_down.cuh, KernelShape grouped_down)
built for the host with nvcc: its per-pair arithmetic (down_lane_units over the 32 lanes of a warp,
then the warp's xor tree as warp_sum adds, after each pair's act row times its weight is quantized
as quantize_x does) for every integer-path type, run for several groupings of the same pairs into
work items of 1, 2 or 4 pairs: each pair's partial is the same bits whichever pairs share its item,
and within the quantizer's bound of a float64 reference of (weight * act) . down row; and
down_combine (moe_down_combine's sum) against kernels/grouped_model.py's numpy model, bit for bit. What
cannot run here: the kernels' own glue (which pairs a block takes, the float path's chunk dots,
which are device-only) and the launches; tests/test_gpu_grouped_experts.py (marked gpu) runs
them. Skips where nvcc is not installed."""
import subprocess

import numpy as np
import pytest

from strata_dist.kernels import KERNEL_DIR
from strata_dist.kernels.abi import (IQ2_XXS, IQ3_S, IQ4_XS, MAX_ROWS, Q2_K, Q3_K, Q4_K, Q5_K,
                                     Q6_K, KernelShape)
from strata_dist.kernels.grouped_model import down_combine
from test_experts_int_host import HOST_INT_PATH
from test_kernels_compile import NVCC, few_types_option, needs_nvcc

INT_TYPES = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ2_XXS)
SHAPE = "grouped_experts=1,grouped_down=1"

# argv[1] "pairs": a down matrix of one expert and P pairs' act rows and weights, then groupings
# (items of G = 1, 2 or 4 pairs, each item's pairs listed), the partials [P, rows] of each
# grouping out; argv[1] "combine": partials [n * k, n_embd] and h [n, n_embd], h + down_combine out.
HARNESS = HOST_INT_PATH + r"""
// one warp's sum of the lanes' values as warp_sum adds them (v += shfl_xor(v, o), o = 16 .. 1)
float xor_tree(float (&v)[32]) {
    for (int o = 16; o > 0; o >>= 1) {
        float next[32];
        for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ o];
        for (int l = 0; l < 32; ++l) v[l] = next[l];
    }
    return v[0];
}

// the item's pairs' partials for every down row, as down_group_int computes them
template <int T, int G>
void item_partials(const unsigned char* raw, long long row_bytes, int rows, int n_ff,
                   const std::vector<const HostXQ*>& xq, float* out /* [cnt][rows] */) {
    const int cnt = (int)xq.size();
    XQ q[G];
    for (int j = 0; j < G; ++j) q[j] = xq[j < cnt ? j : cnt - 1]->q;   // short items repeat
    for (int d = 0; d < rows; ++d) {
        float lanes[G][32];
        for (int lane = 0; lane < 32; ++lane) {
            float acc[G];
            down_lane_units<T, G>(raw + d * row_bytes, n_ff / 64, lane, q, cnt, acc);
            for (int j = 0; j < G; ++j) lanes[j][lane] = acc[j];
        }
        for (int j = 0; j < cnt; ++j) out[j * rows + d] = xor_tree(lanes[j]);
    }
}

template <int T>
void item_dispatch(int g, const unsigned char* raw, long long rb, int rows, int n_ff,
                   const std::vector<const HostXQ*>& xq, float* out) {
    if (g == 1) item_partials<T, 1>(raw, rb, rows, n_ff, xq, out);
    else if (g == 2) item_partials<T, 2>(raw, rb, rows, n_ff, xq, out);
    else item_partials<T, 4>(raw, rb, rows, n_ff, xq, out);
}

int main(int argc, char** argv) {
    FILE* in = fopen(argv[2], "rb");
    FILE* out = fopen(argv[3], "wb");
    if (std::string(argv[1]) == "combine") {
        int head[3];                         // n, k, n_embd
        if (fread(head, sizeof head, 1, in) != 1) return 1;
        const int n = head[0], k = head[1], n_embd = head[2];
        std::vector<float> partial((size_t)n * k * n_embd), h((size_t)n * n_embd);
        if (fread(partial.data(), 4, partial.size(), in) != partial.size()) return 1;
        if (fread(h.data(), 4, h.size(), in) != h.size()) return 1;
        for (int i = 0; i < n; ++i)
            for (int d = 0; d < n_embd; ++d)
                h[(size_t)i * n_embd + d] += down_combine(partial.data(), n_embd, k, i, d);
        fwrite(h.data(), 4, h.size(), out);
        return 0;
    }
    long long head[5];                       // type, row bytes, n_ff, rows, pairs
    if (fread(head, sizeof head, 1, in) != 1) return 1;
    const int type = (int)head[0], n_ff = (int)head[2], rows = (int)head[3], P = (int)head[4];
    const long long rb = head[1];
    std::vector<float> w(P), act((size_t)P * n_ff);
    std::vector<unsigned char> buf(rb * rows + 32);
    // 16-byte aligned rows (the kernels' blobs are; Q6_K's and the i-quants' rows of 2-byte
    // alignment follow at their own sizes)
    unsigned char* raw = buf.data() + (16 - (reinterpret_cast<unsigned long long>(buf.data()) & 15));
    if (fread(w.data(), 4, P, in) != (size_t)P) return 1;
    if (fread(act.data(), 4, act.size(), in) != act.size()) return 1;
    if (fread(raw, 1, rb * rows, in) != (size_t)(rb * rows)) return 1;
    // each pair's act row times its weight, quantized as quantize_x(act_p, n_ff, wts + p, n_ff)
    std::vector<HostXQ*> xq;
    for (int p = 0; p < P; ++p) xq.push_back(new HostXQ(act.data() + (size_t)p * n_ff, w[p], n_ff));
    int groupings;
    if (fread(&groupings, 4, 1, in) != 1) return 1;
    std::vector<float> partial((size_t)P * rows), part((size_t)4 * rows);
    for (int t = 0; t < groupings; ++t) {
        int g, items;
        if (fread(&g, 4, 1, in) != 1 || fread(&items, 4, 1, in) != 1) return 1;
        for (int it = 0; it < items; ++it) {
            int cnt, pairs[4];
            if (fread(&cnt, 4, 1, in) != 1 || cnt < 1 || cnt > g) return 1;
            if (fread(pairs, 4, cnt, in) != (size_t)cnt) return 1;
            std::vector<const HostXQ*> members;
            for (int j = 0; j < cnt; ++j) members.push_back(xq[pairs[j]]);
            switch (type) {
            case T_Q4_K: item_dispatch<T_Q4_K>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_Q5_K: item_dispatch<T_Q5_K>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_Q6_K: item_dispatch<T_Q6_K>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_Q3_K: item_dispatch<T_Q3_K>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_Q2_K: item_dispatch<T_Q2_K>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_IQ4_XS: item_dispatch<T_IQ4_XS>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_IQ3_S: item_dispatch<T_IQ3_S>(g, raw, rb, rows, n_ff, members, part.data()); break;
            case T_IQ2_XXS: item_dispatch<T_IQ2_XXS>(g, raw, rb, rows, n_ff, members, part.data()); break;
            default: return 2;
            }
            for (int j = 0; j < cnt; ++j)
                for (int d = 0; d < rows; ++d)
                    partial[(size_t)pairs[j] * rows + d] = part[(size_t)j * rows + d];
        }
        fwrite(partial.data(), 4, partial.size(), out);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("grouped_down")
    main = d / "grouped_down.cu"
    main.write_text('#include <cstdio>\n#include <string>\n#include <vector>\n'
                    f'#include "{KERNEL_DIR / "decode.cu"}"\n' + HARNESS)
    exe = d / "grouped_down"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17",
                           *KernelShape.parse(SHAPE).defines(), few_types_option(d, INT_TYPES),
                           "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe


def _groupings(rng, P: int) -> list[tuple[int, list[list[int]]]]:
    """Ways to cut pairs 0 .. P - 1 into items of at most G (1, 2, 4): one pair each, in order by
    twos and fours, and shuffled cuts of random sizes (a pair beside different others, first or
    last in its item, in items short of G)."""
    out = [(1, [[p] for p in range(P)]),
           (2, [list(range(p, min(P, p + 2))) for p in range(0, P, 2)]),
           (4, [list(range(p, min(P, p + 4))) for p in range(0, P, 4)])]
    for g in (2, 4, 4):
        perm = [int(p) for p in rng.permutation(P)]
        items, at = [], 0
        while at < P:
            size = int(rng.integers(1, g + 1))
            items.append(perm[at:at + size])
            at += size
        out.append((g, items))
    return out


def _run_pairs(exe, tmp_path, qtype, raw, act, w, groupings):
    rows, row_bytes = raw.shape
    P, n_ff = act.shape
    body = [np.array([int(qtype), row_bytes, n_ff, rows, P], np.int64).tobytes(),
            w.astype(np.float32).tobytes(), act.astype(np.float32).tobytes(), raw.tobytes(),
            np.int32(len(groupings)).tobytes()]
    for g, items in groupings:
        body.append(np.array([g, len(items)], np.int32).tobytes())
        for item in items:
            body.append(np.array([len(item), *item], np.int32).tobytes())
    data = tmp_path / "in.bin"
    data.write_bytes(b"".join(body))
    subprocess.run([str(exe), "pairs", str(data), str(tmp_path / "out.bin")], check=True,
                   timeout=120)
    return np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(len(groupings), P, rows)


@needs_nvcc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda t: f"type{t}")
def test_a_pairs_partial_is_the_same_bits_in_any_item(harness, tmp_path, qtype):
    """Six pairs of one expert (a down matrix of 16 rows of n_ff 768 and 256 columns), their act
    rows with a zero block, a tiny block and a spike, each its own weight: every grouping gives
    every partial the same bits, and each partial is within the quantizer's bound of float64
    (w * act) . row (amax / 64516 a 32-column block, as tests/test_experts_int_host.py holds the
    unit dots to)."""
    import type_rows
    from gguf import GGMLQuantizationType as QT
    rng = np.random.default_rng(int(qtype))
    for n_ff in (256, 768):
        raw, ref = type_rows.random_rows(QT(qtype), 16, n_ff, int(qtype) * 7 + n_ff)
        P = 6
        act = rng.standard_normal((P, n_ff)).astype(np.float32)
        act[1, 64:96], act[2, 96:128] = 0.0, act[2, 96:128] * 1e-6
        act[3, 200] = 40.0
        w = rng.random(P).astype(np.float32) * 0.9 + 0.05
        groupings = _groupings(rng, P)
        got = _run_pairs(harness, tmp_path, qtype, raw, act, w, groupings)
        bits = got.view(np.uint32)
        for t in range(1, len(groupings)):
            np.testing.assert_array_equal(bits[t], bits[0], err_msg=f"grouping {groupings[t]}")
        xw = act.astype(np.float32) * w[:, None]            # as quantize_x folds the weight in
        want = xw.astype(np.float64) @ ref.astype(np.float64).T          # [P, rows]
        amax = np.repeat(np.abs(xw).reshape(P, -1, 32).max(axis=2), 32, axis=1)
        bound = (amax / 64516) @ np.abs(ref.astype(np.float64)).T \
            + 1e-6 * (np.abs(xw) @ np.abs(ref.astype(np.float64)).T)
        err = np.abs(got[0] - want)
        assert (err <= bound).all(), (qtype, n_ff, float((err / bound).max()))


@needs_nvcc
@pytest.mark.timeout(600)
def test_the_combine_adds_a_rows_partials_in_slot_order(harness, tmp_path):
    """down_combine (moe_down_combine's sum) against kernels/grouped_model.py down_combine's float32 model,
    bit for bit, for top-1, top-8 and top-16 over MAX_ROWS rows: partials of wide range (the order
    of the adds shows in the bits: a model adding in another order fails, checked below), and a
    NaN partial (a pair whose expert was not resident) makes its row's output NaN, no other."""
    rng = np.random.default_rng(5)
    n, n_embd = MAX_ROWS, 96
    for k in (1, 8, 16):
        partial = (rng.standard_normal((n * k, n_embd))
                   * 10.0 ** rng.integers(-4, 5, (n * k, 1))).astype(np.float32)
        partial[3 * k, 7] = np.nan if k > 1 else partial[3 * k, 7]
        h = rng.standard_normal((n, n_embd)).astype(np.float32)
        data = tmp_path / "in.bin"
        data.write_bytes(np.array([n, k, n_embd], np.int32).tobytes() + partial.tobytes()
                         + h.tobytes())
        subprocess.run([str(harness), "combine", str(data), str(tmp_path / "out.bin")],
                       check=True, timeout=60)
        got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(n, n_embd)
        want = down_combine(partial, k, h)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        if k > 1:
            assert np.isnan(got[3, 7]) and np.isfinite(np.delete(got.ravel(), 3 * n_embd + 7)).all()
            # the slots added the other way round: another float32 sum somewhere
            backwards = down_combine(partial.reshape(n, k, n_embd)[:, ::-1].reshape(n * k, n_embd),
                                     k, h)
            assert (backwards.view(np.uint32) != want.view(np.uint32)).any()


def test_the_model_of_the_combine_refuses_partials_of_another_shape():
    with pytest.raises(ValueError, match=r"partials \(8, 16\) for 3 rows of top-4 and 16 outputs"):
        down_combine(np.zeros((8, 16), np.float32), 4, np.zeros((3, 16), np.float32))


def test_the_switch_is_off_by_default_and_needs_the_grouped_gate_up():
    assert KernelShape().grouped_down == 0 and KernelShape().defines() == ()
    assert KernelShape.parse(SHAPE).defines() == ("-DGROUPED_EXPERTS=1", "-DGROUPED_DOWN=1")
    with pytest.raises(ValueError, match="grouped_down=1 with grouped_experts=0"):
        KernelShape.parse("grouped_down=1")
    with pytest.raises(ValueError, match="grouped_down=2: expected 0 or 1"):
        KernelShape.parse("grouped_experts=1,grouped_down=2")
