"""Pricing: what a stage running layers [lb, le) allocates, in bytes. Pure arithmetic.

One rule produces both the priced size and the loaded layout (DESIGN §4): the loader loads exactly
the tensors weights_bytes counts and the session allocates exactly the parts session_parts lists.
The lower bound of a range is `lb`, never 0 — pricing [0, le) instead of [lb, le) still prints
plausible numbers while leaving most of the carve unclaimed (seed #390).

All reserves live here, as named constants, and nowhere else.
"""
from __future__ import annotations

import numpy as np

from .shape import ModelShape

MIB = 1 << 20

# --- reserves: the one place they are defined -------------------------------------------------
STAGE_WORK_RESERVE_BYTES = 96 * MIB   # per stage: decode/verify work buffers, tiled attention scratch,
                                       # staging slots for streamed expert misses, allocator slack
HEAD_RESERVE_BYTES = 64 * MIB         # last stage only: logits rows and sampler scratch
HANDOFF_ROWS = 8192                   # the most rows a hand-off buffer holds (the largest auto chunk);
                                       # a plan sizes them to its own chunk
HANDOFF_DTYPE_BYTES = 4               # hidden rows travel as f32
HELPER_RESERVE_BYTES = 32 * MIB       # per helper tier: request/response rows of remote experts
DECODE_ROWS = 8                       # rows of a decode/verify step (sizes the score scratch)
SCORE_DTYPE_BYTES = 4                 # attention scores are f32
# --kv-resident: the first cells of a context stay on the device whatever its depth (later tokens
# attend to them strongly: the attention "sinks"); a ring of the newest cells beside them
KV_SINK_CELLS = 4
ATTN_TILE_BYTES = 48 * MIB            # a prompt chunk's attention scores, per tile of query rows
                                       # (inside the work reserve above)


def _check_range(shape: ModelShape, lb: int, le: int) -> None:
    if not 0 <= lb < le <= shape.n_layers:
        raise ValueError(f"layer range [{lb}, {le}) is not a non-empty range inside [0, {shape.n_layers})")


def blob_bytes(shape: ModelShape, layer: int) -> int:
    """One expert of `layer` (gate + up + down) in its stored format: what one cache entry holds."""
    return shape.blob_bytes[layer]


def weights_bytes(shape: ModelShape, lb: int, le: int, first: bool, last: bool, *,
                  weight_slice: bool = True) -> int:
    """Dense bytes a stage running [lb, le) loads: its layers' dense tensors, the embedding on the
    first stage, output norm + head on the last. weight_slice=False (STRATA_WEIGHT_SLICE=0) is the
    kill switch: every stage loads the whole model's dense weights."""
    _check_range(shape, lb, le)
    if not weight_slice:
        lb, le, first, last = 0, shape.n_layers, True, True
    total = sum(shape.layer_dense_bytes[lb:le])
    if first:
        total += shape.embed_bytes
    if last:
        total += shape.head_bytes
    if first and last and shape.head_shares_embedding:
        total -= shape.embed_bytes      # one tensor serves both ends
    return total


def kv_resident_floor(prompt_chunk: int) -> int:
    """The fewest resident cells (--kv-resident) a session may keep: the sinks plus a ring that
    holds a whole prompt chunk's new cells (a chunk's rows attend to each other, all from the
    ring, backends/kv_cache.py RingKV)."""
    return KV_SINK_CELLS + prompt_chunk


def resident_cells(cells: int, resident: int) -> int:
    """Cells of each K/V a session keeps on its device: `resident` (--kv-resident) where it is
    below the context, else every cell (resident 0: every cell)."""
    return resident if 0 < resident < cells else cells


def session_parts(shape: ModelShape, cells: int, lb: int, le: int,
                  resident: int = 0) -> dict[str, int]:
    """The session a stage running [lb, le) carves for `cells` context cells, part by part:

    primary    ONE RoPE table, carved even when the range has no attention layer (model-level uses
               read it) — never one per attention layer.
    kv         K + V of the range's attention layers, `cells` each (`resident` each where
               --kv-resident keeps fewer on the device: its sinks and ring, backends/kv_cache.py).
    kv_host    with fewer resident: K + V of every cell in pinned host memory (a write-through
               copy the attention reads the older cells from); not device memory, so not in
               session_bytes (session_host_bytes).
    recurrent  recurrent + conv state of the range's linear layers.
    scratch    decode attention scores (DECODE_ROWS x n_head x cells, f32), only if the range has an
               attention layer.
    Global layer ordinals are kept by the session; it simply holds fewer rows.
    """
    _check_range(shape, lb, le)
    if cells < 1:
        raise ValueError(f"cells must be >= 1, got {cells}")
    attn = [l for l in range(lb, le) if shape.layer_kind[l] == "attention"]
    kv_cell = sum(shape.kv_bytes_per_cell[l] for l in attn)
    on_device = resident_cells(cells, resident)
    return {
        "primary": shape.rope_bytes_per_cell * cells,
        "kv": kv_cell * on_device,
        "recurrent": sum(shape.recurrent_bytes[l] for l in range(lb, le) if shape.layer_kind[l] == "linear"),
        "scratch": DECODE_ROWS * shape.n_head * cells * SCORE_DTYPE_BYTES if attn else 0,
        "kv_host": kv_cell * cells if on_device < cells else 0,
    }


def session_bytes(shape: ModelShape, cells: int, lb: int, le: int, resident: int = 0) -> int:
    """Total of session_parts but kv_host: what the stage's session costs on its device."""
    parts = session_parts(shape, cells, lb, le, resident)
    return sum(v for k, v in parts.items() if k != "kv_host")


def session_host_bytes(shape: ModelShape, cells: int, lb: int, le: int, resident: int = 0) -> int:
    """What --kv-resident keeps of the session in pinned host memory (0: every cell resident)."""
    return session_parts(shape, cells, lb, le, resident)["kv_host"]


def kv_host_read_ms(shape: ModelShape, cells: int, lb: int, le: int, resident: int,
                    host_gbs: float) -> float:
    """What a decode token at full depth spends reading the cells beyond the device over PCIe:
    cells - resident of each attention layer of [lb, le), at host_gbs (the rate a kernel reads
    expert blobs in place from host memory, PlanParams.host_gbs). 0 when every cell is resident."""
    on_device = resident_cells(cells, resident)
    kv_cell = sum(b for b, k in zip(shape.kv_bytes_per_cell[lb:le], shape.layer_kind[lb:le])
                  if k == "attention")
    return kv_cell * (cells - on_device) / (host_gbs * 1e6)


def handoff_bytes(shape: ModelShape, rows: int = HANDOFF_ROWS) -> int:
    """One hand-off buffer (one direction of one stage boundary) of `rows` hidden rows: a rank
    sizes it to the plan's prompt chunk."""
    return rows * shape.hidden * HANDOFF_DTYPE_BYTES


def verify_window_bytes(shape: ModelShape, lb: int, le: int, rows: int, sessions: int = 1) -> int:
    """What a verify window of `rows` rows (speculative decoding, --spec K: K + 1 rows;
    strata_dist/sampling/speculative.py) takes on a stage of [lb, le) beyond a decode step: its rows'
    buffers through the many-row path a prompt chunk takes (the prompt layout at `rows` tokens,
    less the streamed experts a window never reads; once: a batched step runs its sessions'
    windows one after another, strata_dist/rank/stage_step.py), and on a range with linear layers
    each of the `sessions` sessions' copy of their state at its last window and that window's
    input rows, kept to roll back inside it at the session's next step. 0 for rows <= 1 (no
    speculation)."""
    _check_range(shape, lb, le)
    if rows <= 1:
        return 0
    rec = sum(shape.recurrent_bytes[l] for l in range(lb, le) if shape.layer_kind[l] == "linear")
    kept = rec + rows * shape.hidden * HANDOFF_DTYPE_BYTES if rec else 0
    return shape.resident_prompt_bytes(rows) + sessions * kept


def reserve_bytes(shape: ModelShape, first: bool, last: bool,
                  handoff_rows: int = HANDOFF_ROWS) -> int:
    """Bytes a stage holds back besides weights and session: its work buffers, the head reserve on
    the last stage, and a hand-off buffer for each boundary it touches (receive unless first, send
    unless last)."""
    return (STAGE_WORK_RESERVE_BYTES + (HEAD_RESERVE_BYTES if last else 0)
            + handoff_bytes(shape, handoff_rows) * ((not first) + (not last)))


def stage_fixed_bytes(shape: ModelShape, cells: int, lb: int, le: int, *,
                      weight_slice: bool = True, handoff_rows: int = HANDOFF_ROWS,
                      verify_rows: int = 0, sessions: int = 1,
                      draft_bytes: int = 0, resident: int = 0) -> tuple[int, int, int]:
    """(weights, session, reserve) of a stage running [lb, le); first/last follow from the range.
    `sessions` (--parallel): that many sessions, each of `cells` (`resident` of them on the
    device, --kv-resident; 0: every cell). The reserve holds a verify window
    of `verify_rows` rows, with each session's record of it (verify_window_bytes), and on the
    last stage the draft model's `draft_bytes` (PlanParams.draft_bytes)."""
    first, last = lb == 0, le == shape.n_layers
    return (weights_bytes(shape, lb, le, first, last, weight_slice=weight_slice),
            sessions * session_bytes(shape, cells, lb, le, resident),
            reserve_bytes(shape, first, last, handoff_rows)
            + verify_window_bytes(shape, lb, le, verify_rows, sessions)
            + (draft_bytes if last else 0))


def range_fixed_table(shape: ModelShape, cells: int, *, weight_slice: bool = True,
                      handoff_rows: int = HANDOFF_ROWS, verify_rows: int = 0,
                      sessions: int = 1, draft_bytes: int = 0, resident: int = 0) -> np.ndarray:
    """fixed[b, e] = weights + session + reserve of a stage running [b, e), for every range at once
    (int64, [L+1, L+1]; entries with e <= b are 0 and meaningless). The same rule as
    stage_fixed_bytes, by prefix sums; a test checks they agree on every range."""
    L = shape.n_layers

    def pre(values) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(np.asarray(values, dtype=np.int64))])

    def span(prefix: np.ndarray) -> np.ndarray:   # span[b, e] = sum over [b, e)
        return prefix[None, :] - prefix[:, None]

    is_attn = [k == "attention" for k in shape.layer_kind]
    is_lin = [not a for a in is_attn]
    b = np.arange(L + 1)[:, None]
    e = np.arange(L + 1)[None, :]
    first, last = (b == 0), (e == L)

    if weight_slice:
        w = span(pre(shape.layer_dense_bytes)) + first * shape.embed_bytes + last * shape.head_bytes
        if shape.head_shares_embedding:
            w = w - (first & last) * shape.embed_bytes
    else:
        whole = weights_bytes(shape, 0, L, True, True)
        w = np.full((L + 1, L + 1), whole, dtype=np.int64)

    kv = (span(pre([k if a else 0 for k, a in zip(shape.kv_bytes_per_cell, is_attn)]))
          * resident_cells(cells, resident))
    rec = span(pre([r if lin else 0 for r, lin in zip(shape.recurrent_bytes, is_lin)]))
    has_attn = span(pre(is_attn)) > 0
    scratch = has_attn * (DECODE_ROWS * shape.n_head * cells * SCORE_DTYPE_BYTES)
    session = sessions * (shape.rope_bytes_per_cell * cells + kv + rec + scratch)

    reserve = (STAGE_WORK_RESERVE_BYTES + last * HEAD_RESERVE_BYTES
               + handoff_bytes(shape, handoff_rows) * ((~first).astype(np.int64)
                                                       + (~last).astype(np.int64)))
    if verify_rows > 1:   # verify_window_bytes, every range at once
        kept = np.where(rec > 0, rec + verify_rows * shape.hidden * HANDOFF_DTYPE_BYTES, 0)
        reserve = reserve + shape.resident_prompt_bytes(verify_rows) + sessions * kept
    reserve = reserve + last * draft_bytes   # the draft model rides on the last stage
    return (w + session + reserve).astype(np.int64)
