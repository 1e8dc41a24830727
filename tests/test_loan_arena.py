"""The loan arena's bookkeeping: first-fit ranges in the lent bytes, coalesced on free."""
import numpy as np
import pytest

from strata_dist.loan_arena import ALIGN, RangeAllocator


def test_blocks_are_aligned_disjoint_and_inside():
    r = RangeAllocator(64 * ALIGN)
    blocks = [(r.alloc(n), n) for n in (1, ALIGN, ALIGN + 1, 5 * ALIGN)]
    assert all(off is not None and off % ALIGN == 0 for off, _ in blocks)
    spans = sorted((off, off + -(-n // ALIGN) * ALIGN) for off, n in blocks)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= r.capacity
    assert r.used == (1 + 1 + 2 + 5) * ALIGN == r.peak


def test_a_full_arena_says_so_and_free_coalesces():
    r = RangeAllocator(4 * ALIGN)
    a, b, c, d = (r.alloc(ALIGN) for _ in range(4))
    assert r.alloc(1) is None and r.largest_free == 0
    r.free(b)
    r.free(c)                      # b and c merge: a 2-block request fits between a and d
    assert r.alloc(2 * ALIGN) == b
    r.free(a)
    r.free(d)
    r.free(b)
    assert r.largest_free == 4 * ALIGN and r.used == 0 and r.live_blocks == 0
    assert r.peak == 4 * ALIGN


def test_freeing_a_block_twice_or_one_never_given_is_refused():
    r = RangeAllocator(8 * ALIGN)
    off = r.alloc(10)
    r.free(off)
    with pytest.raises(ValueError, match="no block at offset"):
        r.free(off)
    with pytest.raises(ValueError):
        r.free(3)


def test_random_alloc_free_keeps_the_books_exact():
    rng = np.random.default_rng(1)
    r = RangeAllocator(1000 * ALIGN)
    live = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = list(live)[int(rng.integers(len(live)))]
            r.free(off)
            del live[off]
        else:
            n = int(rng.integers(1, 40 * ALIGN))
            off = r.alloc(n)
            if off is not None:
                live[off] = -(-n // ALIGN) * ALIGN
        spans = sorted((o, o + n) for o, n in live.items())
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
        assert r.used == sum(live.values())
    for off in list(live):
        r.free(off)
    assert r.largest_free == r.capacity       # everything merged back into one range
