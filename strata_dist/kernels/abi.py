"""What Python and decode.cu must agree on, in one place and without CuPy (so CPU tests check it):
the GGML type ids the kernels read, the constants sizing their buffers, and the byte layout of the
argument tables (`struct MatSpec`, `ExpertSpec`, `RouteSpec`, `GdnSpec`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAX_ROWS = 8          # rows of one decode step (MAX_ROWS in decode.cu; plan.pricing.DECODE_ROWS)
ATTN_CHUNK = 256      # keys per attention split (ATTN_CHUNK)
# The step descriptor (int32 words; kernels/decode.cu DESC_*, backends/decode_rows.py packs it):
# the first row's position, the rows, their token ids, then the words of one session's pointer
# table and each row's position, table slot and step end. A descriptor whose table words are 0
# names rows pos, pos + 1, ... of the table at slot 0 (what a one-session writer leaves).
DESC_POS, DESC_ROWS, DESC_TOKENS = 0, 1, 2
DESC_TABLE_WORDS = DESC_TOKENS + MAX_ROWS
DESC_ROW_POS = DESC_TABLE_WORDS + 1
DESC_ROW_TABLE = DESC_ROW_POS + MAX_ROWS
DESC_ROW_END = DESC_ROW_TABLE + MAX_ROWS
DESC_WORDS = DESC_ROW_END + MAX_ROWS

# GGML type ids the kernels read (kernels/weights.cuh's type table, FOR_EACH_TYPE), with the byte
# alignment their loads need: a row (and a blob part) of that type must start on it
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 8, 12, 13, 14
Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, BF16 = 2, 3, 6, 7, 10, 11, 30
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, \
    23, 29
IQUANTS = (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS)
# the i-quants' blocks leave rows 2-byte aligned only (iquants.cuh reads them as u16 words)
KERNEL_TYPES = {F32: 16, F16: 16, Q8_0: 2, Q4_K: 16, Q5_K: 16, Q6_K: 2,
                BF16: 16, Q4_0: 2, Q4_1: 4, Q5_0: 2, Q5_1: 4, Q2_K: 4, Q3_K: 2,
                **{t: 2 for t in IQUANTS}}
# the suffix of each type's own matvec / expert kernels (FOR_EACH_TYPE): the type's GGML name
TYPE_NAMES = {t: GGMLQuantizationType(t).name.lower() for t in KERNEL_TYPES}
MATVEC_ROWS = (1, 2, 4, 8)      # activation rows a matvec kernel is built for (padded_rows)
MATVEC_ACCS = 32                # KernelShape.matvec_accs' default (decode.cu MATVEC_ACCS)
MMA_ROWS = 16                   # weight rows of a matvec_mma block (matvec_mma.cuh MMA_ROWS)
PIECE_ROWS = 4                  # weight rows of a warp pair of matvec_pieces (matvec_pieces.cuh)
PIECE_THREADS = 128             # threads of a matvec_pieces block (matvec_pieces.cuh)
PIECE_SPLIT = 2                 # warps that share a matvec_pieces warp's rows (matvec_pieces.cuh)
BLOCK_THREADS = 256             # threads of the matrix and expert kernels
FF_PER_BLOCK = 4                # expert rows f per block of moe_gate_up (decode.cu's default)
DOWN_PER_BLOCK = 4              # outputs per block of moe_down (decode.cu's default)


WARPS = BLOCK_THREADS // 32
# The expert types on the integer path beyond Q4_K (which always takes it with int_gate_up /
# int_down): KernelShape switch -> GGML type. experts_int.cuh's int_type(T) has a line for each,
# on behind the macro MACROS names (the switch in capitals), each with its unit dot
# (int_unit_dot); gate_up_block / down_block and docs/BENCHMARKS.md read this table. A new type:
# its row here, its field on KernelShape, its unit dot and its line in int_type.
INT_TYPE_SWITCHES = {"int_q5_k": Q5_K, "int_q6_k": Q6_K, "int_q3_k": Q3_K, "int_q2_k": Q2_K,
                     "int_iq4_xs": IQ4_XS, "int_iq3_s": IQ3_S, "int_iq2_xxs": IQ2_XXS}
# the types matvec_mma puts on tensor cores -> the columns of one scale (matvec_mma.cuh
# mma_scale_cols; every other type keeps the plain matvec in that build)
MMA_SCALE_COLS = {**dict.fromkeys((F16, Q8_0, Q4_K, Q5_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
                                    IQ4_XS), 32), Q6_K: 16, Q2_K: 16, Q3_K: 16}
# the types matvec_pieces takes (matvec_pieces.cuh piece_type)
PIECE_TYPES = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, Q8_0)
GDN_ROWS = 16                   # rows of a state column a gdn_delta_step thread holds (gated_delta.cuh)
NEXT_HEAD_DIM = 256             # qwen3next's attention head width (next_attention.cuh NEXT_D)
NEXT_ROT = 64                   # the dims of a head it rotates (NEXT_ROT)


@dataclass(frozen=True)
class KernelShape:
    """The compile-time shape of the expert kernels: the runner sizes its grids from the same value
    it compiles decode.cu with (`defines`). STRATA_KERNEL_SHAPE="ff_per_block=8,down_per_block=2"
    picks another (benchmarks/tune_decode.py measures them).

    `int_gate_up` / `int_down` (on: measured faster, docs/BENCHMARKS.md): Q4_K experts take the
    integer path of kernels/experts_int.cuh (activations as two int8 parts, __dp4a against the
    stored integers), whose blocks take `int_ff_per_warp` / `int_down_per_warp` rows per warp
    (`int_direct`: rows read from device memory by the lanes instead of staged); the float path
    (every other type, and a block the integer path cannot take) takes `ff_per_block` /
    `down_per_block` rows per block. `int_q5_k` / `int_q6_k` / `int_q3_k` / `int_q2_k`
    (INT_TYPE_SWITCHES) put Q5_K / Q6_K / Q3_K / Q2_K experts on the integer path too, and
    `int_iq4_xs` / `int_iq3_s` / `int_iq2_xxs` IQ4_XS / IQ3_S / IQ2_XXS experts (their rows read
    in place whatever `int_direct` says, experts_int.cuh int_direct): all seven default 1 (on),
    measured faster on an H100 on 2026-12-06, 1.03x to 1.20x the float path's decode on the
    model quantized to each (q2_k: 258.0 against 308.3 tok/s,
    benchmarks/results/decode-qwen3-30b-a3b-q2_k-2026-12-06-052031-f6081f8.json); `=0` puts a
    type back on the float path. The float path's switches (0 or 1) pick how
    it computes: `factored_dots` a * sum(q x) + b * sum(x) per chunk of a quantized row,
    `cvt_magic` stored integers to floats through the mantissa of 2^23 (weights.cuh says why each
    exists; both on, measured).
    `matvec_threads` (256, or 128: measured no faster) the threads of a dense matvec block
    (decode.cu MATVEC_THREADS). `matvec_accs` (8..64) the dot sums a matvec thread holds at N >= 2
    rows, matvec_accs / N weight rows a block (decode.cu rows_per_block says why; no bit changes).
    `matvec_pieces` (default 1 since 2026-12-07: 323.6 against 298.5 tok/s one-row decode on
    q4_k_m, benchmarks/results/decode-qwen3-30b-a3b-q4_k_m-2026-12-07-081812-f97cb1b.json) gives
    the Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and Q8_0 dense matvecs (PIECE_TYPES) a pair of warps
    PIECE_ROWS weight rows (PIECE_SPLIT) and a block PIECE_THREADS threads, a lane 32 weights at a
    time (kernels/matvec_pieces.cuh; other bits than the plain build's, `=0`; `matvec_mma=1`
    alone implies `=0`).
    `matvec_mma` (default 0) puts the dense matvecs of MMA_SCALE_COLS' types on tensor cores at
    every row count (kernels/matvec_mma.cuh: activations as two f16 parts; other bits than the
    plain build's), in blocks of `mma_threads` (256, measured; or 512: K split over twice the
    warps of a 16-row tile, for one row's latency; matvec_block_threads).
    A name in REMOVED (a build deleted after it measured slower) is refused by `parse` with why."""
    ff_per_block: int = FF_PER_BLOCK
    down_per_block: int = DOWN_PER_BLOCK
    factored_dots: int = 1
    cvt_magic: int = 1
    int_gate_up: int = 1
    int_down: int = 1
    int_ff_per_warp: int = 2
    int_down_per_warp: int = 1
    int_direct: int = 1
    int_q5_k: int = 1
    int_q6_k: int = 1
    int_q3_k: int = 1
    int_q2_k: int = 1
    int_iq4_xs: int = 1
    int_iq3_s: int = 1
    int_iq2_xxs: int = 1
    matvec_threads: int = BLOCK_THREADS
    matvec_accs: int = MATVEC_ACCS
    matvec_mma: int = 0
    mma_threads: int = BLOCK_THREADS
    matvec_pieces: int = 1

    # field -> the macro decode.cu reads
    MACROS = {"ff_per_block": "FF_PER_BLOCK", "down_per_block": "DOWN_PER_BLOCK",
              "factored_dots": "FACTORED_DOTS", "cvt_magic": "CVT_MAGIC",
              "int_gate_up": "INT_GATE_UP", "int_down": "INT_DOWN",
              "int_ff_per_warp": "INT_FPW", "int_down_per_warp": "INT_DPW",
              "int_direct": "INT_DIRECT",
              **{name: name.upper() for name in INT_TYPE_SWITCHES},
              "matvec_threads": "MATVEC_THREADS", "matvec_accs": "MATVEC_ACCS",
              "matvec_mma": "MATVEC_MMA", "mma_threads": "MMA_THREADS",
              "matvec_pieces": "MATVEC_PIECES"}
    SWITCHES = ("factored_dots", "cvt_magic", "int_gate_up", "int_down", "int_direct",
                *INT_TYPE_SWITCHES, "matvec_mma", "matvec_pieces")
    # names of deleted builds -> why (issue 52: a measured loser is deleted, its figure kept in
    # docs/BENCHMARKS.md); a shape text still naming one is refused, never silently ignored
    REMOVED = {"matvec_warp": "removed on 2026-12-05: a warp a weight row of the tall matrices "
                              "measured slower (0.780 against 0.641 ms a step, docs/BENCHMARKS.md)",
               "int_q8_0": "removed on 2026-12-05: Q8_0 experts on the integer path measured "
                           "slower than on the float path (0.607 against 0.592 ms a step, "
                           "docs/BENCHMARKS.md); Q8_0 experts always take the float path",
               "int_matvec": "removed on 2026-12-06: the dense matvecs on the integer path "
                             "measured slower (257.6 against 297.3 tok/s decode on q4_k_m, "
                             "benchmarks/results/decode-qwen3-30b-a3b-q4_k_m-2026-12-06-082354-"
                             "5ecdac4.json); dense matvecs always take the float path",
               "grouped_experts": "removed on 2026-12-06: the decode gate/up grouped by expert "
                                  "(a weight piece read once for several rows) measured slower "
                                  "(29.6 against 15.8 ms a 16-row step with grouped_down, its "
                                  "gate/up 8.6 against 5.5 ms; alone 0.97x at 16 streams, "
                                  "docs/BENCHMARKS.md)",
               "grouped_down": "removed on 2026-12-06: the decode down grouped by expert (a sum "
                               "a pair, then added per row) measured slower (29.6 against 15.8 "
                               "ms a 16-row step, its down 14.4 against 4.6 ms, "
                               "docs/BENCHMARKS.md)",
               "expert_group_rows": "removed on 2026-12-06 with grouped_experts, whose work "
                                    "items it sized: measured slower (29.6 against 15.8 ms a "
                                    "16-row step, docs/BENCHMARKS.md)",
               "expert_prefetch": "removed on 2026-12-07: the integer-path expert blocks asking "
                                  "their rows into L2 before quantizing measured slower (305.0 "
                                  "against 323.6 tok/s decode on q4_k_m, both matvec_pieces=1, "
                                  "benchmarks/results/decode-qwen3-30b-a3b-q4_k_m-2026-12-07-"
                                  "081812-f97cb1b.json)",
               "piece_stage": "removed on 2026-12-07: the pieces' activations staged in shared "
                              "memory measured slower (285.6 against 330.0 tok/s decode, a "
                              "16-row step 25.42 against 24.66 ms, docs/BENCHMARKS.md)",
               "piece_ahead": "removed on 2026-12-07: a one-row pieces lane loading its next "
                              "pieces first measured slower (297.7 against 330.0 tok/s decode on "
                              "q4_k_m, benchmarks/results/decode-qwen3-30b-a3b-q4_k_m-2026-12-07-"
                              "152154-ea356c8.json)",
               "int_down_ahead": "removed on 2026-12-07: the integer moe_down's pairs loaded 4 at "
                                 "a time measured 1.006-1.012x at one row and slower at 16 rows "
                                 "(its down 6.30 against 5.51 ms a step, docs/BENCHMARKS.md)",
               "int_gate_up_group": "removed on 2026-12-07: a batched step's pairs of one expert "
                                    "taken by one gate/up block measured slower (7.3 against 5.5 "
                                    "ms a 16-row step's gate/up, 0.946x at 16 streams, "
                                    "docs/BENCHMARKS.md)",
               "piece_split": "removed on 2026-12-07: two warps share a pieces warp's rows in "
                              "every build now (353.0 tok/s decode against 327.8 with one and "
                              "346.5 with four, benchmarks/results/decode-qwen3-30b-a3b-q4_k_m-"
                              "2026-12-07-190238-a751dcf.json; 16 streams 457.9 against 407.1 and "
                              "417.0 tok/s, serve-qwen3-30b-a3b-q4_k_m-2026-12-07-191001-"
                              "a751dcf.json)",
               "piece_accs": "removed on 2026-12-07: fewer weight rows a pieces warp at 2-8 "
                             "activation rows measured slower (16-row replays 26.35 and 32.83 "
                             "against 24.69 ms, 16 streams 0.881x and 0.790x, serve-qwen3-30b-"
                             "a3b-q4_k_m-2026-12-07-185922-a751dcf.json, docs/BENCHMARKS.md)"}

    def __post_init__(self) -> None:
        for name in ("ff_per_block", "down_per_block"):
            v = getattr(self, name)
            if not 1 <= v <= 32:
                raise ValueError(f"kernel shape {name}={v}: expected 1..32")
        for name in ("int_ff_per_warp", "int_down_per_warp"):
            v = getattr(self, name)
            if not 1 <= v <= 4:
                raise ValueError(f"kernel shape {name}={v}: expected 1..4")
        if self.matvec_threads not in (128, BLOCK_THREADS):
            raise ValueError(f"kernel shape matvec_threads={self.matvec_threads}: expected 128 or "
                             f"{BLOCK_THREADS}")
        if self.mma_threads not in (BLOCK_THREADS, 2 * BLOCK_THREADS):
            raise ValueError(f"kernel shape mma_threads={self.mma_threads}: expected "
                             f"{BLOCK_THREADS} or {2 * BLOCK_THREADS}")
        if self.matvec_accs not in (8, 16, 32, 64):
            raise ValueError(f"kernel shape matvec_accs={self.matvec_accs}: expected 8, 16, 32 "
                             f"or 64")
        for name in self.SWITCHES:
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"kernel shape {name}={getattr(self, name)}: expected 0 or 1")
        if self.matvec_mma and self.matvec_pieces:
            raise ValueError(f"kernel shape matvec_mma={self.matvec_mma} with matvec_pieces="
                             f"{self.matvec_pieces}: both take the K-quant matvecs; pick one")
        # a block the integer path cannot take runs the float body over its range, a float
        # block at a time: the ranges must tile (moe_down adds into h)
        for on, per_warp, per_block in (("int_gate_up", "int_ff_per_warp", "ff_per_block"),
                                        ("int_down", "int_down_per_warp", "down_per_block")):
            block = WARPS * getattr(self, per_warp)
            if getattr(self, on) and block % getattr(self, per_block):
                raise ValueError(f"kernel shape {per_block}={getattr(self, per_block)} with "
                                 f"{per_warp}={getattr(self, per_warp)}: the integer path's "
                                 f"{block} rows a block must be a multiple of {per_block}")

    def int_types(self) -> frozenset[int]:
        """The GGML types whose experts this build puts on the integer path (experts_int.cuh
        int_type): Q4_K, and each type of INT_TYPE_SWITCHES whose switch is on."""
        return frozenset({Q4_K} | {t for name, t in INT_TYPE_SWITCHES.items()
                                   if getattr(self, name)})

    def gate_up_block(self, ggml_type: int) -> int:
        """Expert rows f of one moe_gate_up block for experts stored as `ggml_type` (the integer
        types take the integer path's grid)."""
        if self.int_gate_up and ggml_type in self.int_types():
            return WARPS * self.int_ff_per_warp
        return self.ff_per_block

    def down_block(self, ggml_type: int) -> int:
        """Outputs of one moe_down block for down rows stored as `ggml_type`."""
        if self.int_down and ggml_type in self.int_types():
            return WARPS * self.int_down_per_warp
        return self.down_per_block

    def defines(self) -> tuple[str, ...]:
        """NVRTC options for this shape (none for the defaults, so the default build's cache key
        stays the source's)."""
        default = KernelShape()
        return tuple(f"-D{macro}={getattr(self, name)}" for name, macro in self.MACROS.items()
                     if getattr(self, name) != getattr(default, name))

    @classmethod
    def parse(cls, text: str) -> "KernelShape":
        """"ff_per_block=8,down_per_block=2,factored_dots=1" (any may be left out)."""
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if key.strip() in cls.REMOVED:
                raise ValueError(f"kernel shape {part!r}: {key.strip()} was "
                                 f"{cls.REMOVED[key.strip()]}")
            if not sep or key not in cls.MACROS or not value.strip().isdigit():
                raise ValueError(f"kernel shape {part!r}: expected NAME=N, NAME one of "
                                 f"{', '.join(cls.MACROS)}")
            fields[key] = int(value)
        # the tensor-core matvecs take the K-quant types that pieces (the default) takes: asking
        # for them alone means without pieces; both named at once is refused (__post_init__)
        if fields.get("matvec_mma") and "matvec_pieces" not in fields:
            fields["matvec_pieces"] = 0
        return cls(**fields)


@dataclass(frozen=True)
class ExpertLayout:
    """How a layer's expert blobs (gate rows, up rows, down rows, each as stored) are read by the
    expert kernels: the decode graph's and the row kernels'."""
    gate_type: int
    up_type: int
    down_type: int
    up_at: int            # byte offsets of the up and down parts inside a blob
    down_at: int
    gate_row_bytes: int
    up_row_bytes: int
    down_row_bytes: int
    n_ff: int
    n_embd: int
    align: int            # the byte alignment a blob's address needs


def expert_layout(gguf, layer: int) -> ExpertLayout:
    """`layer`'s blob layout; ValueError naming the tensor when the kernels cannot read it."""
    parts = gguf.expert_parts(layer)           # gate, up, down as stored
    types = [int(t.ggml_type) for t in parts]
    per = [t.n_bytes // t.shape[0] for t in parts]
    rows = [t.shape[1] for t in parts]
    for t, ty, size, r in zip(parts, types, per, rows):
        align = KERNEL_TYPES.get(ty)
        if align is None or size % align or (size // r) % align:
            raise ValueError(f"{t.name}: type {t.ggml_type.name} is not readable by the expert "
                             f"kernels")
    if types[0] != types[1]:
        raise ValueError(f"{parts[0].name} and {parts[1].name} are stored in different types "
                         f"(the expert kernel reads gate and up rows as one type)")
    if per[0] % KERNEL_TYPES[types[1]] or (per[0] + per[1]) % KERNEL_TYPES[types[2]]:
        raise ValueError(f"blk.{layer}: the up or down part of an expert blob is not aligned for "
                         f"its type")
    return ExpertLayout(types[0], types[1], types[2], per[0], per[0] + per[1], per[0] // rows[0],
                        per[1] // rows[1], per[2] // rows[2], rows[0], rows[2],
                        max(KERNEL_TYPES[t] for t in types))


def padded_rows(n: int) -> int:
    """The matvec build for n activation rows (padded_rows in decode.cu)."""
    return next(m for m in MATVEC_ROWS if n <= m)


def rows_per_block(n: int, wide: bool, shape: KernelShape = KernelShape(),
                   ggml_type: int | None = None) -> int:
    """Weight rows one block of a matvec takes (rows_per_block in decode.cu; MMA_ROWS where
    the shape puts the type on tensor cores; PIECE_ROWS a warp where it takes the type in
    pieces)."""
    if shape.matvec_mma and ggml_type in MMA_SCALE_COLS:
        return MMA_ROWS
    if shape.matvec_pieces and ggml_type in PIECE_TYPES:
        return PIECE_ROWS * (PIECE_THREADS // 32) // PIECE_SPLIT
    return shape.matvec_accs // padded_rows(n) if padded_rows(n) > 1 else MAX_ROWS if wide else 1


def matvec_block_threads(shape: KernelShape, ggml_type: int) -> int:
    """Threads of one block of a dense matvec of this type (decode.cu matvec_block_threads)."""
    if shape.matvec_mma and ggml_type in MMA_SCALE_COLS:
        return shape.mma_threads
    return PIECE_THREADS if shape.matvec_pieces and ggml_type in PIECE_TYPES else \
        shape.matvec_threads


def matvec_kernel(ggml_type: int, n: int) -> str:
    return f"matvec_{TYPE_NAMES[ggml_type]}_{padded_rows(n)}"


ATTN_HEAD_DIMS = (128, 256)    # head widths of the decode attention builds
ATTN_GROUPS = (2, 4, 8, 16)  # the builds of attn_decode_128: query heads of one block, at most


def attn_kernel(group: int, kv_type: str, heads_per_block: int | None = None,
                head_dim: int = 128) -> str:
    """The decode attention build for `group` query heads per kv head over K/V kept as
    `kv_type` (f16 or q8_0), each block taking `heads_per_block` of them (the whole group when
    None; else a build's bound that divides the group): the least bound that holds them
    (attention.cuh ATTN_DECODE; 256-wide heads: next_attention.cuh). The launch's grid has
    n_head / heads_per_block columns."""
    if head_dim not in ATTN_HEAD_DIMS or kv_type not in ("f16", "q8_0"):
        raise ValueError(f"no decode attention build for {head_dim}-wide heads over {kv_type} K/V "
                         f"(builds: {' and '.join(map(str, ATTN_HEAD_DIMS))} wide, over f16 or "
                         f"q8_0)")
    hb = group if heads_per_block is None else heads_per_block
    if hb > ATTN_GROUPS[-1]:
        raise ValueError(f"{hb} query heads per attention block (the attention kernels take <= "
                         f"{ATTN_GROUPS[-1]})")
    if hb not in attn_heads_choices(group):
        raise ValueError(f"{hb} query heads per attention block with {group} per kv head: "
                         f"expected the group or one of {ATTN_GROUPS} dividing it")
    bound = next(b for b in ATTN_GROUPS if hb <= b)
    return f"attn_decode_{head_dim}_g{bound}" + ("_q8" if kv_type == "q8_0" else "")


def attn_heads_choices(group: int) -> list[int]:
    """Every count of query heads one attention block may take for `group` per kv head, the whole
    group first: the group itself (when a build holds it) and each smaller build dividing it."""
    whole = [group] if group <= ATTN_GROUPS[-1] else []
    return whole + [b for b in reversed(ATTN_GROUPS) if b < group and group % b == 0]


def default_attn_heads(group: int, chunk: int) -> int:
    """Query heads of one decode attention block unless told otherwise: 2 where 2 divides the
    group and a split holds at most 128 keys, else the whole group. A block's instructions, not
    memory, bound these launches; measured on an H200 (docs/BENCHMARKS.md, bench_attention.py):
    64-key splits of 8 heads, 2 a block against 8: 4.2 against 7.8 us at 64 keys, 19.8 against
    31.9 us at 4,000; 256-key splits at 30,000 keys: 89 against 75 us."""
    return 2 if group % 2 == 0 and chunk <= 128 else group


# gdn_prompt.cu's kernels (their launches: kernels/gdn_launch.py)
GDN_ROWS_KERNELS = ("gdn_conv_rows", "gdn_conv_tail", "gdn_delta_rows", "gdn_gated_norm_rows")


# The attention partials are a decode step's only buffer that grows with the context. The runner
# gives them at most this much (inside the planner's STAGE_WORK_RESERVE_BYTES) and captures graphs
# only for the row counts that fit; larger steps take the general path.
ATTN_SCRATCH_BYTES = 32 << 20
ATTN_CHUNKS = (64, 128, ATTN_CHUNK)   # keys per split, the shortest that fits the budget


class AttnScratchError(ValueError):
    """A session too long for the attention partials' budget (the step takes the general path)."""


@dataclass(frozen=True)
class AttnLaunch:
    """How a decode graph launches its attention for sessions of up to `max_cells` cells."""
    kernel: str           # the build (attn_kernel)
    heads: int            # query heads of one block: the grid is (n_head / heads, n_split, rows)
    chunk: int            # keys per split
    n_split: int          # splits of the longest context
    max_rows: int         # rows of one step whose partials fit ATTN_SCRATCH_BYTES


def attn_launch(n_head: int, n_kv: int, head_dim: int, max_cells: int, kv_type: str,
                heads: int | None = None) -> AttnLaunch:
    """The shortest splits whose partials of one row fit the scratch budget (short splits spread
    a context over more blocks), and `heads` query heads a block (default_attn_heads when None).
    Raises AttnScratchError when even the longest splits do not fit, ValueError when `heads` is
    not a build's."""
    for chunk in ATTN_CHUNKS:
        n_split = -(-max_cells // chunk)
        per_row = n_head * n_split * (head_dim + 2) * 4
        if per_row <= ATTN_SCRATCH_BYTES:
            break
    else:
        raise AttnScratchError(f"{max_cells} cells need {per_row >> 20} MiB of attention "
                               f"partials per row (more than {ATTN_SCRATCH_BYTES >> 20} MiB)")
    group = n_head // n_kv
    heads = heads or default_attn_heads(group, chunk)
    return AttnLaunch(attn_kernel(group, kv_type, heads, head_dim), heads, chunk, n_split,
                      max(1, min(MAX_ROWS, ATTN_SCRATCH_BYTES // per_row)))


def kernel_names() -> list[str]:
    """Every kernel the runner may ask decode.cu for."""
    names = ["dequant_rows", "dequant_rows_f16", "embed_tokens", "qk_norm_rope_kv",
             "qk_norm_rope_kv_q8", "argmax_row", "spin", "gdn_conv_step", "gdn_delta_step"]
    names += [attn_kernel(g, kv) for g in ATTN_GROUPS for kv in ("f16", "q8_0")]
    # --kv-resident's builds (f16, q8_0): the KV write and attention of a sinks + ring + host copy
    names += ["qk_norm_rope_kv_ring", "qk_norm_rope_kv_q8_ring"]
    names += [attn_kernel(g, kv) + "_ring" for g in ATTN_GROUPS for kv in ("f16", "q8_0")]
    names += ["next_attn_gate", "next_shexp_act"]          # next_attention.cuh
    names += [f"next_qk_norm_rope_kv{q8}{ring}" for q8 in ("", "_q8") for ring in ("", "_ring")]
    names += [attn_kernel(g, kv, head_dim=256) + ring for g in ATTN_GROUPS
              for kv in ("f16", "q8_0") for ring in ("", "_ring")]
    for t in TYPE_NAMES.values():
        names += [f"matvec_{t}_{n}" for n in MATVEC_ROWS] + [f"moe_gate_up_{t}", f"moe_down_{t}"]
    return names


def source_kernel_names(source: str) -> list[str]:
    """Every kernel the runners may ask a source for."""
    return {"decode.cu": kernel_names, "experts_rows.cu": rows_kernel_names,
            "prompt_ops.cu": lambda: ["rms_norm_rows", "combine_ranked"],
            "sample_rows.cu": lambda: ["greedy_rows"],
            "gdn_prompt.cu": lambda: list(GDN_ROWS_KERNELS),
            "prefill_attention.cu": lambda: [f"prefill_attention_{d}"
                                             for d in PREFILL_ATTENTION_BUILDS]}[source]()


# prefill_attention.cu's builds by head width: (16-row query tiles a warp, keys a tile); every
# build has 4 warps over its query rows, each warp the whole head
PREFILL_ATTENTION_BUILDS = {128: (2, 32), 256: (1, 32)}
PREFILL_ATTENTION_WARPS_M = 4


def prefill_attention_launch(d: int, mt: int | None = None, bn: int | None = None,
                             warps_m: int = PREFILL_ATTENTION_WARPS_M) -> tuple[int, int, int]:
    """(query rows a block, threads a block, dynamic shared bytes) of the head-width-d build
    (mt / bn / warps_m: a build with other -D values), as FA_SHARED_BYTES counts them: two stages
    of a K and a V tile, and the block's q in f16 unless one 16-row tile of a 128-wide head keeps
    it in registers; rows of d + 8 halves."""
    build_mt, build_bn = PREFILL_ATTENTION_BUILDS[d]
    mt, bn = mt or build_mt, bn or build_bn
    rows = 16 * mt * warps_m
    q_shared = mt > 1 or d > 128
    shared = (2 * 2 * bn + (rows if q_shared else 0)) * (d + 8) * 2
    return rows, 32 * warps_m, shared


def rows_kernel_names() -> list[str]:
    """Every kernel ops/moe.py may ask experts_rows.cu for."""
    return [f"{kind}{mma}_{t}" for t in TYPE_NAMES.values() for mma in ("", "_mma")
            for kind in ("moe_gate_up_rows", "moe_down_rows")] + ["rows_to_half"] \
        + list(GROUP_KERNELS)


# experts_rows.cu's routing and grouping of a chunk on the device
GROUP_KERNELS = ("route_rows", "group_count", "group_items", "group_scatter")
ROWS_TILE_M = 128               # pairs of one work item (TILE_M in experts_rows.cu)
ROWS_TILE_N = 64                # outputs of one block (TILE_N)
ROWS_TILE_K = 32                # columns of one staged step (TILE_K): K must be whole steps
MAX_GROUP_EXPERTS = 512         # the most experts a layer may have for group_items
ROWS_X_BUFS = 3                 # input-row steps in shared memory (X_BUFS)
ROWS_MMA_LD = ROWS_TILE_K + 8   # halves a shared row of a step (MMA_LD)


def rows_stage_cols(ggml_type: int) -> int:
    """Columns of one copied weight stage of the tensor-core row kernels (stage_cols)."""
    return {F32: 32, F16: 64, BF16: 64, Q8_0: 128}.get(ggml_type, 256)


def rows_mma_shared_bytes(ggml_type: int, nmat: int) -> int:
    """Dynamic shared memory of a tensor-core row kernel (experts_rows.cu rows_mma_shared_bytes;
    a test builds both and compares): nmat = 2 for gate/up, 1 for down."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    stored = rows_stage_cols(ggml_type) // block * type_size    # a stage's stored bytes of a row
    stage_row = (stored + 30) // 16 * 16
    return (ROWS_X_BUFS * ROWS_TILE_M * ROWS_MMA_LD * 2 + 2 * nmat * ROWS_TILE_N * ROWS_MMA_LD * 2
            + 2 * nmat * ROWS_TILE_N * stage_row + 16)


def group_layout(ids: np.ndarray, n_expert: int, tile_m: int = ROWS_TILE_M):
    """The sorted pair layout the row kernels read, as experts_rows.cu's group_* kernels build it
    on the device and the host path builds it from its jobs: the pairs p = row * k + rank of
    ids [n, k] grouped by expert (ascending), each group in row-major order; returns (rows, dest,
    items): rows[q] and dest[q] the input row and the pair p of sorted place q, items [m, 4] of
    (expert, first sorted place, pairs <= tile_m, 0). Pairs outside [0, n_expert) are left out."""
    n, k = ids.shape
    flat = ids.ravel().astype(np.int64)
    valid = np.flatnonzero((flat >= 0) & (flat < n_expert))
    order = valid[np.argsort(flat[valid], kind="stable")]
    counts = np.bincount(flat[valid], minlength=n_expert)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    items = [(e, int(starts[e]) + t, min(tile_m, int(counts[e]) - t), 0)
             for e in range(n_expert) for t in range(0, int(counts[e]), tile_m)]
    return (order // k).astype(np.int32), order.astype(np.int32), \
        np.asarray(items, dtype=np.int32).reshape(-1, 4)


MAT_SPEC = np.dtype([("w", "<u8"), ("y", "<u8"), ("add", "<u8"), ("row_bytes", "<i8"),
                     ("nrows", "<i4"), ("ncols", "<i4"), ("y_stride", "<i4"), ("type", "<i4")])
EXPERT_SPEC = np.dtype([("blob_of", "<u8"), ("up_at", "<i8"), ("down_at", "<i8"),
                        ("gate_row_bytes", "<i8"), ("up_row_bytes", "<i8"), ("down_row_bytes", "<i8"), ("gate_type", "<i4"),
                        ("up_type", "<i4"), ("down_type", "<i4"), ("n_ff", "<i4"),
                        ("n_embd", "<i4"), ("k", "<i4")])
ROUTE_SPEC = np.dtype([("experts", "<u8"), ("logits", "<u8"), ("ids", "<u8"), ("wts", "<u8"),
                       ("blobs", "<u8"), ("done", "<u8"), ("n_expert", "<i4"), ("k", "<i4"),
                       ("normalize", "<i4")], align=True)    # sized as C pads it: 64 bytes
GDN_SPEC = np.dtype([(f, "<u8") for f in ("qkv", "z", "ba", "conv_w", "ssm_a", "ssm_dt", "norm_w",
                                         "mixed", "out", "sess")]
                    + [(f, "<i4") for f in ("layer_slot", "n_k", "n_v", "head_k", "head_v",
                                            "conv_dim", "K")]
                    + [("eps", "<f4")], align=True)          # 112 bytes, as C pads it
STRUCTS = {"MatSpec": MAT_SPEC, "ExpertSpec": EXPERT_SPEC, "RouteSpec": ROUTE_SPEC,
           "GdnSpec": GDN_SPEC}
