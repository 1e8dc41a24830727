"""How the gated-delta kernels (qwen3next's linear-attention layers) are launched for a layer's
geometry: gated_delta.cuh's decode steps and gdn_prompt.cu's prompt chunks."""
from dataclasses import dataclass

import numpy as np

from .abi import GDN_ROWS


@dataclass(frozen=True)
class GdnLaunch:
    """How gated_delta.cuh's two kernels are launched for a linear layer's geometry (the decode
    graph's steps and the prompt path's chunks alike: both take the rows in order)."""
    conv_blocks: int      # gdn_conv_step: a block of a key head's width of channels
    conv_threads: int
    delta_blocks: int     # gdn_delta_step: a block a value head
    delta_threads: int    # a thread per GDN_ROWS rows of a state column
    delta_shared: int     # bytes of dynamic shared memory: q and k of a row, a partial per thread


def gdn_launch(n_v: int, head_k: int, head_v: int, conv_dim: int) -> GdnLaunch:
    """The launches for `n_v` value heads of head_k x head_v state over `conv_dim` channels;
    ValueError naming the geometry when the kernels cannot take it (a key head must be whole warps
    of at most 1,024 channels, a state at most 1,024 threads of GDN_ROWS rows)."""
    threads = head_k * head_v // GDN_ROWS
    if (head_k % 32 or head_k > 1024 or head_k % GDN_ROWS or conv_dim % head_k
            or threads % 32 or threads > 1024):
        raise ValueError(f"linear-attention heads of {head_k} x {head_v} over {conv_dim} "
                         f"channels (the GDN kernels take key heads of whole warps up to 1,024 "
                         f"and states of up to {1024 * GDN_ROWS} values)")
    return GdnLaunch(conv_dim // head_k, head_k, n_v, threads, (2 * head_k + threads) * 4)


GDN_LANE_ROWS = 4           # rows of a state column a gdn_delta_rows lane holds (gdn_prompt.cu)
GDN_MAX_K = 8               # the longest convolution gdn_conv_tail takes
GDN_COLUMNS_PER_BLOCK = 4   # gdn_delta_rows: a warp a state column
GDN_TAIL_THREADS = 256


@dataclass(frozen=True)
class GdnRowsLaunch:
    """How gdn_prompt.cu's four kernels are launched over a chunk's n rows (grids (x, n) where
    the rows are independent)."""
    conv_blocks: int      # gdn_conv_rows: grid (conv_blocks, n), a key head's width of channels
    conv_threads: int
    tail_blocks: int      # gdn_conv_tail: GDN_TAIL_THREADS channels a block
    delta_blocks: int     # gdn_delta_rows: GDN_COLUMNS_PER_BLOCK warps, a warp a state column
    norm_blocks: int      # gdn_gated_norm_rows: grid (n_v, n), head_v threads
    norm_threads: int

    def launch(self, kernel, spec, n: int) -> None:
        """The four launches in order; `kernel(name)` gives the function."""
        i32 = np.int32
        kernel("gdn_conv_rows")((self.conv_blocks, n), (self.conv_threads,), (spec, i32(n)))
        kernel("gdn_conv_tail")((self.tail_blocks,), (GDN_TAIL_THREADS,), (spec, i32(n)))
        kernel("gdn_delta_rows")(
            (self.delta_blocks,), (32 * GDN_COLUMNS_PER_BLOCK,), (spec, i32(n)))
        kernel("gdn_gated_norm_rows")((self.norm_blocks, n), (self.norm_threads,), (spec, i32(n)))


def gdn_rows_launch(n_v: int, head_k: int, head_v: int, conv_dim: int, K: int) -> GdnRowsLaunch:
    """The prompt kernels' launches for a linear layer's geometry; ValueError naming it when they
    cannot take it (key heads of whole warps up to 32 GDN_LANE_ROWS, value heads of whole warps
    up to 1,024, a convolution of at most GDN_MAX_K)."""
    if (head_k % 32 or head_k > 32 * GDN_LANE_ROWS or head_v % 32 or head_v > 1024
            or conv_dim % head_k or not 1 <= K <= GDN_MAX_K):
        raise ValueError(f"linear-attention heads of {head_k} x {head_v} over {conv_dim} "
                         f"channels, convolution {K} (the prompt's GDN kernels take key heads of "
                         f"whole warps up to {32 * GDN_LANE_ROWS}, value heads of whole warps up "
                         f"to 1,024 and convolutions up to {GDN_MAX_K})")
    return GdnRowsLaunch(conv_dim // head_k, head_k, -(-conv_dim // GDN_TAIL_THREADS),
                         -(-n_v * head_v // GDN_COLUMNS_PER_BLOCK), n_v, head_v)
