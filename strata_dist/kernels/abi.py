"""What Python and decode.cu must agree on, in one place and without CuPy (so CPU tests check it):
the GGML type ids the kernels read, the constants sizing their buffers, and the byte layout of the
argument tables (`struct MatSpec`, `struct ExpertSpec`)."""
from __future__ import annotations

import numpy as np

MAX_ROWS = 8          # rows of one decode step (MAX_ROWS in decode.cu; plan.pricing.DECODE_ROWS)
ATTN_CHUNK = 256      # keys per attention split (ATTN_CHUNK)
DESC_WORDS = 2 + MAX_ROWS   # the step descriptor: position, rows, token ids

# GGML type ids the kernels read, with the byte alignment their loads need
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K = 0, 1, 8, 12, 13, 14
KERNEL_TYPES = {F32: 16, F16: 16, Q8_0: 2, Q4_K: 16, Q5_K: 16, Q6_K: 2}

MAT_SPEC = np.dtype([("w", "<u8"), ("y", "<u8"), ("add", "<u8"), ("row_bytes", "<i8"),
                     ("nrows", "<i4"), ("ncols", "<i4"), ("y_stride", "<i4"), ("type", "<i4")])
EXPERT_SPEC = np.dtype([("arena", "<u8"), ("offsets", "<u8"), ("slot_of", "<u8"),
                        ("up_at", "<i8"), ("down_at", "<i8"), ("gate_row_bytes", "<i8"),
                        ("up_row_bytes", "<i8"), ("down_row_bytes", "<i8"), ("gate_type", "<i4"),
                        ("up_type", "<i4"), ("down_type", "<i4"), ("n_ff", "<i4"),
                        ("n_embd", "<i4"), ("k", "<i4")])
STRUCTS = {"MatSpec": MAT_SPEC, "ExpertSpec": EXPERT_SPEC}
