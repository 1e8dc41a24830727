"""The grouped decode gate/up's grouping (kernels/experts_grouped.cuh, KernelShape grouped_experts):
the model of what moe_group_pairs writes (kernels/grouped_model.py group_pairs) checked for what the grouped
kernel relies on, and the kernel's own grouping code (group_scan, group_place: HOST_DEVICE) built
for the host with nvcc and run through the kernel's three phases, against the model. The grouped
kernels' numbers (act bit-identical to moe_gate_up_<type>'s) are tests/test_gpu_grouped_experts.py's
(marked gpu)."""
import shutil
import subprocess

import numpy as np
import pytest

from strata_dist.kernels.abi import (EXPERT_GROUP_ROWS, GROUP_MAX_K, GROUP_THREADS, MAX_ROWS,
                                     KernelShape, group_pairs_words)
from strata_dist.kernels.grouped_model import group_pairs
from strata_dist.kernels import KERNEL_DIR

NVCC = shutil.which("nvcc")


def unpack(buf: np.ndarray, k: int):
    """(items [(first, count)] up to the first empty one, sorted pairs) of a groups buffer."""
    items = buf[:2 * MAX_ROWS * k].reshape(-1, 2)
    n_items = next((i for i, (_, c) in enumerate(items) if c == 0), len(items))
    return [tuple(int(v) for v in it) for it in items[:n_items]], buf[2 * MAX_ROWS * k:]


def check_layout(ids: np.ndarray, group_rows: int) -> list[tuple[int, int]]:
    """What the grouped kernel relies on, for ids [n, k]: every pair exactly once, each item's
    pairs of one expert (a pair of no expert alone), at most group_rows of them, the items
    covering the sorted pairs in order, a group's pairs in row order, groups in the order of their
    first pair, nothing past the buffer's bound (MAX_ROWS * k items). Returns the items."""
    n, k = ids.shape
    buf = group_pairs(ids, group_rows)
    assert buf.shape == (group_pairs_words(k),) and buf.dtype == np.int32
    items, order = unpack(buf, k)
    pairs = n * k
    assert len(items) <= pairs <= MAX_ROWS * k
    assert (buf[2 * len(items):2 * MAX_ROWS * k] == 0).all()       # no stale item past the last
    assert sorted(order[:pairs].tolist()) == list(range(pairs))   # each pair once
    assert (order[pairs:] == 0).all()
    flat = ids.ravel()
    place = 0
    for first, count in items:
        assert first == place and 1 <= count <= group_rows, (items, group_rows)
        members = order[first:first + count]
        e = flat[members[0]]
        assert (e >= 0 and (flat[members] == e).all()) or count == 1, (e, flat[members])
        assert (np.diff(members) > 0).all()                         # row order within a group
        place += count
    assert place == pairs
    # a group's items follow each other, groups in the order of their first pair
    leads = []
    for first, count in items:
        e = flat[order[first]]
        if not leads or e < 0 or flat[leads[-1]] != e:
            leads.append(int(order[first]))
    assert leads == sorted(leads)
    return items


def test_an_expert_chosen_by_every_row_is_cut_into_items_of_group_rows():
    ids = np.array([[5, r + 10] for r in range(MAX_ROWS)])       # expert 5 in every row, slot 0
    items = check_layout(ids, 4)
    assert items[:2] == [(0, 4), (4, 4)]                           # its 8 pairs, two items
    assert items[2:] == [(8 + r, 1) for r in range(MAX_ROWS)]      # the rest one pair each
    buf = group_pairs(ids, 4)
    assert buf[2 * MAX_ROWS * 2:][:8].tolist() == [2 * r for r in range(MAX_ROWS)]


def test_rows_with_nothing_in_common_give_one_item_a_pair_at_the_bound():
    k = GROUP_MAX_K
    ids = np.arange(MAX_ROWS * k).reshape(MAX_ROWS, k)             # 128 pairs, 128 experts
    items = check_layout(ids, EXPERT_GROUP_ROWS)
    assert items == [(p, 1) for p in range(MAX_ROWS * k)]           # the buffer's whole bound


def test_one_row_and_rows_that_pick_nothing():
    check_layout(np.array([[3, 1, 2, 0]]), 4)                        # one row: k items of 1
    assert unpack(group_pairs(np.array([[3, 1, 2, 0]]), 4), 4)[0] == [(p, 1) for p in range(4)]
    ids = np.array([[-1, -1], [7, -1], [7, 2]])                     # NaN logits: no expert
    items = check_layout(ids, 2)
    # -1 pairs are never grouped, with each other or with anything
    assert items == [(0, 1), (1, 1), (2, 2), (4, 1), (5, 1)]
    assert unpack(group_pairs(ids, 2), 2)[1][:6].tolist() == [0, 1, 2, 4, 3, 5]


def test_random_steps_keep_the_layout_for_every_item_size():
    rng = np.random.default_rng(45)
    for trial in range(300):
        n, k = int(rng.integers(1, MAX_ROWS + 1)), int(rng.integers(1, GROUP_MAX_K + 1))
        pool = int(rng.integers(k, 3 * k + 1))
        ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)])
        ids[rng.random(ids.shape) < 0.05] = -1
        check_layout(ids, int(rng.integers(1, 5)))


def test_a_step_the_kernel_cannot_take_is_refused_naming_it():
    with pytest.raises(ValueError, match=f"9 rows x 2 slots.*1..{MAX_ROWS} rows"):
        group_pairs(np.zeros((9, 2), dtype=int))
    with pytest.raises(ValueError, match="17 slots"):
        group_pairs(np.zeros((1, 17), dtype=int))
    with pytest.raises(ValueError, match="expert_group_rows=5: expected 1..4"):
        KernelShape.parse("expert_group_rows=5")
    with pytest.raises(ValueError, match="grouped_experts=2: expected 0 or 1"):
        KernelShape.parse("grouped_experts=2")


def test_the_switch_is_off_by_default_and_builds_with_its_macros():
    assert KernelShape().grouped_experts == 0 and KernelShape().defines() == ()
    assert KernelShape.parse("grouped_experts=1,expert_group_rows=4").defines() == (
        "-DGROUPED_EXPERTS=1", "-DEXPERT_GROUP_ROWS=4")


HOST_MAIN = r'''
#include <cstdio>
#include <vector>
// The kernel's three phases over its `pairs` threads, a loop a phase (each phase reads only what
// the one before wrote: the kernel's barriers)
int main() {
    printf("%d %d %d %d\n", EXPERT_GROUP_ROWS, GROUP_MAX_K, GROUP_THREADS, MAX_ROWS);
    int n, k, rows;
    while (scanf("%d %d %d", &n, &k, &rows) == 3) {
        const int pairs = n * k;
        std::vector<int> ids(pairs), buf(3 * MAX_ROWS * k, 0), lead_count(pairs), start(pairs),
            leader(pairs), rank(pairs), count(pairs);
        for (int& v : ids) scanf("%d", &v);
        for (int p = 0; p < pairs; ++p) {
            group_scan(ids.data(), pairs, p, leader[p], rank[p], count[p]);
            lead_count[p] = rank[p] == 0 ? count[p] : 0;
        }
        for (int p = 0; p < pairs; ++p) {
            if (rank[p] != 0) continue;
            int item0;
            group_place(lead_count.data(), p, rows, start[p], item0);
            for (int t = 0; t < count[p]; t += rows) {
                buf[2 * (item0 + t / rows)] = start[p] + t;
                buf[2 * (item0 + t / rows) + 1] = count[p] - t < rows ? count[p] - t : rows;
            }
        }
        for (int p = 0; p < pairs; ++p)
            buf[group_order_at(k) + start[leader[p]] + rank[p]] = p;
        for (int v : buf) printf("%d ", v);
        printf("\n");
    }
    return 0;
}
'''


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.timeout(600)
def test_the_kernels_grouping_code_matches_the_model(tmp_path):
    """experts_grouped.cuh's group_scan / group_place, built for the host, through the phases of
    moe_group_pairs: the buffer is kernels/grouped_model.py group_pairs' for random steps and the cases
    above."""
    main = tmp_path / "grouping.cu"
    main.write_text(f'#include "{KERNEL_DIR / "weights.cuh"}"\n'
                    f'#include "{KERNEL_DIR / "experts_grouped.cuh"}"\n' + HOST_MAIN)
    exe = tmp_path / "grouping"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(7)
    cases = [np.array([[5, r + 10] for r in range(MAX_ROWS)]),
             np.arange(MAX_ROWS * GROUP_MAX_K).reshape(MAX_ROWS, GROUP_MAX_K),
             np.array([[-1, -1], [7, -1], [7, 2]]), np.array([[3, 1, 2, 0]]),
             np.full((MAX_ROWS, 1), 4)]
    for _ in range(200):
        n, k = int(rng.integers(1, MAX_ROWS + 1)), int(rng.integers(1, GROUP_MAX_K + 1))
        ids = np.stack([rng.choice(int(rng.integers(k, 3 * k + 1)), k, replace=False)
                        for _ in range(n)])
        ids[rng.random(ids.shape) < 0.05] = -1
        cases.append(ids)
    sizes = [int(rng.integers(1, 5)) for _ in cases]
    text = "".join(f"{ids.shape[0]} {ids.shape[1]} {g}\n" + " ".join(map(str, ids.ravel())) + "\n"
                   for ids, g in zip(cases, sizes))
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    # the header's constants are the ones Python sizes the launches and buffers by
    assert out.pop(0).split() == [str(v) for v in (EXPERT_GROUP_ROWS, GROUP_MAX_K, GROUP_THREADS,
                                                   MAX_ROWS)]
    assert len(out) == len(cases)
    for ids, g, line in zip(cases, sizes, out):
        got = np.array(line.split(), dtype=np.int32)
        np.testing.assert_array_equal(got, group_pairs(ids, g), err_msg=f"{ids.tolist()} {g}")
