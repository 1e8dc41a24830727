"""The rows of a decode graph step as the kernels will read them (backends/decode_rows.py): the
step descriptor's words (kernels/abi.py DESC_*: each row's position, table slot and its
session's step end) and the slots of the sessions' pointer tables, for a one-session window of
rows and for a batch of sessions at different positions. Pure numpy: no GPU needed."""
from __future__ import annotations

import gc
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_dist.backends.decode_rows import (SessionSlots, StepRows, pack_descriptor,
                                              session_pointers)
from strata_dist.kernels.abi import (DESC_POS, DESC_ROW_END, DESC_ROW_POS, DESC_ROW_TABLE,
                                     DESC_ROWS, DESC_TABLE_WORDS, DESC_TOKENS, DESC_WORDS,
                                     MAX_ROWS)

WORDS = 5


class Session:
    """A session as the slots see it: an object whose pointer table is `table`."""

    def __init__(self, base: int):
        self.table = [base + w for w in range(WORDS)]


def _packed(rows: StepRows, ids=None):
    slots = SessionSlots(WORDS, lambda s: s.table)
    row_slots, changed = slots.assign(rows)
    desc = np.full(DESC_WORDS, -7, dtype=np.int32)      # whatever a slot held before
    pack_descriptor(desc, rows, row_slots, WORDS, ids)
    return desc, slots, changed


def test_a_window_of_one_session_names_slot_0_at_consecutive_positions():
    s = Session(100)
    desc, slots, changed = _packed(StepRows.window(s, 10, 3), ids=[7, 8, 9])
    assert changed and slots.host[0].tolist() == s.table
    assert desc[DESC_POS] == 10 and desc[DESC_ROWS] == 3 and desc[DESC_TABLE_WORDS] == WORDS
    assert desc[DESC_TOKENS:DESC_TOKENS + 3].tolist() == [7, 8, 9]
    assert desc[DESC_ROW_POS:DESC_ROW_POS + 3].tolist() == [10, 11, 12]
    assert desc[DESC_ROW_TABLE:DESC_ROW_TABLE + 3].tolist() == [0, 0, 0]
    # the ring builds keep the session's newest cell of the step: its last row's
    assert desc[DESC_ROW_END:DESC_ROW_END + 3].tolist() == [13, 13, 13]


def test_a_batch_gives_each_row_its_sessions_table_position_and_end():
    a, b, c = Session(100), Session(200), Session(300)
    rows = StepRows((b, a, c, a), (7, 3, 0, 4))
    desc, slots, _ = _packed(rows, ids=[1, 2, 3, 4])
    # slot k: the k-th session in the order its rows first appear
    assert [slots.host[k].tolist() for k in range(3)] == [b.table, a.table, c.table]
    assert desc[DESC_POS] == 7 and desc[DESC_ROWS] == 4
    assert desc[DESC_ROW_POS:DESC_ROW_POS + 4].tolist() == [7, 3, 0, 4]
    assert desc[DESC_ROW_TABLE:DESC_ROW_TABLE + 4].tolist() == [0, 1, 2, 1]
    assert desc[DESC_ROW_END:DESC_ROW_END + 4].tolist() == [8, 5, 1, 5]
    # what a kernel reading row i finds: its session's table, at its position
    tables = slots.host.reshape(-1)
    for i, (s, p) in enumerate(zip(rows.sessions, rows.positions)):
        at = int(desc[DESC_ROW_TABLE + i]) * int(desc[DESC_TABLE_WORDS])
        assert tables[at:at + WORDS].tolist() == s.table and desc[DESC_ROW_POS + i] == p


def test_the_words_past_the_rows_are_zeros_no_kernel_reads():
    """The graphs are captured per row count, so no row is padding; what a step of 8 rows left
    in the words of rows 2.. is cleared (a stale position there would name a live cell)."""
    sessions = [Session(100 * k) for k in range(1, 9)]
    desc, _, _ = _packed(StepRows(tuple(sessions), tuple(range(8))), ids=list(range(8)))
    pack_descriptor(desc, StepRows((sessions[0], sessions[1]), (5, 6)),
                    np.array([0, 1], np.int32), WORDS, ids=[3, 4])
    for start in (DESC_TOKENS, DESC_ROW_POS, DESC_ROW_TABLE, DESC_ROW_END):
        assert not desc[start + 2:start + MAX_ROWS].any()
    assert desc[DESC_ROW_POS:DESC_ROW_POS + 2].tolist() == [5, 6]


def test_slots_are_rewritten_only_when_their_session_changes():
    a, b, c = Session(100), Session(200), Session(300)
    written = []
    slots = SessionSlots(WORDS, lambda s: written.append(s) or s.table)
    assert slots.assign(StepRows((a, b), (1, 2)))[1]
    assert written == [a, b]
    # the same batch again, and a window of its first session: nothing to upload
    assert not slots.assign(StepRows((a, b), (2, 3)))[1]
    assert not slots.assign(StepRows.window(a, 3, 4))[1]
    # another order: both slots change; a new session takes its slot
    row_slots, changed = slots.assign(StepRows((b, a, c), (5, 5, 5)))
    assert changed and row_slots.tolist() == [0, 1, 2]
    assert [slots.host[k].tolist() for k in range(3)] == [b.table, a.table, c.table]
    # a session that is gone never counts as bound, even if a new one reuses its slot
    del c
    gc.collect()
    d = Session(400)
    assert slots.assign(StepRows((b, a, d), (6, 6, 0)))[1]
    assert slots.host[2].tolist() == d.table


def test_rows_a_step_cannot_take_are_refused():
    a, b = Session(100), Session(200)
    with pytest.raises(ValueError, match="1..8 rows"):
        StepRows((), ())
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        StepRows.window(a, 0, MAX_ROWS + 1)
    with pytest.raises(ValueError, match="consecutive positions"):
        StepRows((a, b, a), (4, 0, 6))           # the cell at 5 would be stale
    with pytest.raises(ValueError, match="consecutive positions"):
        StepRows((a, a), (4, 4))                 # one cell written twice
    with pytest.raises(ValueError, match="negative"):
        StepRows((a,), (-1,))
    with pytest.raises(ValueError, match="2 rows but 1 positions"):
        StepRows((a, b), (0,))
    slots = SessionSlots(WORDS + 1, lambda s: s.table)
    with pytest.raises(ValueError, match="5 words, the device table 6"):
        slots.assign(StepRows((a,), (0,)))


def _array(ptr: int, **parts):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), **parts)


class NoRing:
    """kv_cache.DeviceRing of a stage keeping every cell on the card: no words of its own."""

    def table_tail(self, kv):
        return []


def test_a_sessions_table_is_k_v_of_each_layer_then_rope_then_q8_scales():
    layers = {l: (_array(10 * l, q=_array(10 * l + 1), scale=_array(10 * l + 2)),
                  _array(10 * l + 5, q=_array(10 * l + 6), scale=_array(10 * l + 7)))
              for l in (2, 3)}
    s = SimpleNamespace(k=lambda l: layers[l][0], v=lambda l: layers[l][1],
                        rope_cos=_array(900), rope_sin=_array(901))
    assert session_pointers(s, 2, 4, False, NoRing()) == [20, 25, 30, 35, 900, 901]
    assert session_pointers(s, 2, 4, True, NoRing()) == [21, 26, 31, 36, 900, 901,
                                                         22, 27, 32, 37]


# ---- the kernels' side: attention.cuh's row helpers compiled for the host ------------------------

KERNELS = Path(__file__).resolve().parent.parent / "strata_dist" / "kernels"
HOST_MAIN = r"""
#include <cstdio>
#include <cstdlib>
// argv: rows, then the descriptor's words; prints each row's table offset (in words), position
// and step end as the kernels compute them from a descriptor of exactly DESC_WORDS words on the
// heap, so the address sanitizer stops any read past it
int main(int argc, char** argv) {
    const int rows = atoi(argv[1]);
    int* desc = new int[DESC_WORDS];
    for (int w = 0; w < DESC_WORDS; ++w) desc[w] = atoi(argv[2 + w]);
    u64* tables = new u64[1];
    for (int i = 0; i < rows; ++i)
        printf("%lld %d %lld\n", (long long)(row_table(tables, desc, i) - tables),
               row_position(desc, i), (long long)row_step_end(desc, i));
    delete[] tables;
    delete[] desc;
    return 0;
}
"""


@pytest.fixture(scope="module")
def kernel_rows(tmp_path_factory):
    """A host build (g++ with the address sanitizer) of attention.cuh's row_position, row_table
    and row_step_end, with decode.cu's descriptor layout: `run(desc, rows)` gives each row's
    (table offset, position, step end), or raises on a read outside the descriptor."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    attention = (KERNELS / "attention.cuh").read_text()
    helpers = attention[attention.index("// ---- the rows of a step"):attention.index("struct KvRing")]
    layout = [line for line in (KERNELS / "decode.cu").read_text().splitlines()
              if line.startswith("#define DESC_")]
    source = "\n".join([
        "#define __device__", "#define __forceinline__ inline", "#define __restrict__",
        "typedef long long i64;", "typedef unsigned long long u64;",
        f"#define MAX_ROWS {MAX_ROWS}", f"#define DESC_WORDS {DESC_WORDS}", *layout, helpers,
        HOST_MAIN])
    folder = tmp_path_factory.mktemp("rows")
    (folder / "rows.cpp").write_text(source)
    subprocess.run([gxx, "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
                    str(folder / "rows.cpp"), "-o", str(folder / "rows")], check=True,
                   capture_output=True, timeout=120)

    def run(desc: np.ndarray, rows: int) -> list[tuple[int, int, int]]:
        done = subprocess.run([str(folder / "rows"), str(rows), *map(str, desc.tolist())],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        return [tuple(int(v) for v in line.split()) for line in done.stdout.splitlines()]
    return run


def test_the_kernels_read_a_steps_rows_as_packed(kernel_rows):
    a, b = Session(100), Session(200)
    rows = StepRows((a, b, a, b), (7, 30, 8, 31))
    desc, _, _ = _packed(rows)
    # a's table in slot 0, b's in slot 1 (WORDS words a slot); each session's step ends after
    # its own last row
    assert kernel_rows(desc, rows.n) == [(0, 7, 9), (WORDS, 30, 32), (0, 8, 9), (WORDS, 31, 32)]
    # a one-session window (every GPU user's step): slot 0, pos + i, the window's end
    desc, _, _ = _packed(StepRows.window(a, 10, 3))
    assert kernel_rows(desc, 3) == [(0, 10, 13), (0, 11, 13), (0, 12, 13)]


def test_a_prompt_chunks_descriptor_is_read_inside_its_words_whatever_the_rows(kernel_rows):
    """A prompt chunk's fused q/k norm (cupy_backend.qk_norm_rope_kv) launches a row a block
    y, thousands of rows over a descriptor of DESC_WORDS words holding only the first position
    and the rows (no table words): every row reads the one table at slot 0, at pos + i, and no
    row reads a word past the descriptor."""
    desc = np.zeros(DESC_WORDS, dtype=np.int32)
    desc[DESC_POS], desc[DESC_ROWS] = 40, 64
    assert kernel_rows(desc, 64) == [(0, 40 + i, 104) for i in range(64)]
