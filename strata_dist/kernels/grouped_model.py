"""Numpy models of what the grouped expert kernels write (kernels/experts_grouped.cuh's
moe_group_pairs, experts_grouped_down.cuh's moe_down_combine), which the tests hold the kernels
to bit for bit."""
from __future__ import annotations

import numpy as np

from .abi import EXPERT_GROUP_ROWS, GROUP_MAX_K, MAX_ROWS, group_pairs_words


def down_combine(partial: np.ndarray, k: int, h: np.ndarray) -> np.ndarray:
    """What moe_down_combine leaves in h [n, n_embd] (float32) from the partials [n * k or more,
    n_embd] of top-k pairs p = row * k + slot: each row's k partials added in slot order from
    slot 0's, in float32, then added to h."""
    n, n_embd = h.shape
    if partial.shape[0] < n * k or partial.shape[1] != n_embd:
        raise ValueError(f"partials {partial.shape} for {n} rows of top-{k} and {n_embd} outputs")
    per = np.asarray(partial[:n * k], dtype=np.float32).reshape(n, k, n_embd)
    s = per[:, 0].copy()
    for r in range(1, k):
        s = s + per[:, r]           # float32 + float32: one rounding an add, as the kernel's
    return (np.asarray(h, dtype=np.float32) + s).astype(np.float32)


def group_pairs(ids: np.ndarray, group_rows: int = EXPERT_GROUP_ROWS) -> np.ndarray:
    """What moe_group_pairs writes for a step's ids [n, k] (n <= MAX_ROWS, k <= GROUP_MAX_K):
    the groups buffer (group_pairs_words(k) int32; words past the step's n * k items and
    pairs are 0 here, left as they were by the kernel, and read by no launch): items
    (first sorted place, pairs <= group_rows) in the order of each group's first pair p = row * k +
    slot, a group's pairs cut into items of group_rows in row order, count 0 past the last item;
    then the sorted pairs. A pair whose id is negative (no expert: NaN logits) is its own group."""
    ids = np.asarray(ids)
    n, k = ids.shape
    if not (1 <= n <= MAX_ROWS and 1 <= k <= GROUP_MAX_K and 1 <= group_rows <= 4):
        raise ValueError(f"ids of {n} rows x {k} slots, {group_rows} rows an item: moe_group_pairs "
                         f"takes 1..{MAX_ROWS} rows, 1..{GROUP_MAX_K} slots, 1..4 rows an item")
    flat = ids.ravel()
    out = np.zeros(group_pairs_words(k), dtype=np.int32)
    items = out[:2 * MAX_ROWS * k].reshape(-1, 2)
    order = out[2 * MAX_ROWS * k:]
    leaders: dict[int, list[int]] = {}      # leader pair -> its group's pairs in row order
    for p, e in enumerate(flat):
        lead = p if e < 0 else next((q for q in leaders if flat[q] == e), p)
        leaders.setdefault(lead, []).append(p)
    place = item = 0
    for lead in sorted(leaders):
        members = leaders[lead]
        order[place:place + len(members)] = members
        for t in range(0, len(members), group_rows):
            items[item] = (place + t, min(group_rows, len(members) - t))
            item += 1
        place += len(members)
    return out
