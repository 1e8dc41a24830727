"""The qwen3moe geometries and their synthetic files (the shared writer: writer.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from .rope import RopeScalingSpec
from .writer import (EMBD_STD, MT, QUANTS, Popularity, SynthSummary, Tensor, assign_types,
                     attn_out_std, calibrate_logit_means, const, embedding_channel, experts, matrix,
                     reserved_width, router, set_embedding_channel, stream, summary, write_file,
                     zero_reserved_rows)


@dataclass(frozen=True)
class SynthGeometry:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    context_length: int = 40960
    rope_base: float = 1e6
    rms_eps: float = 1e-6


# From the published config.json of each model (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B on HF).
GEOMETRIES: dict[str, SynthGeometry] = {
    "tiny": SynthGeometry("tiny", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                          n_expert=8, n_expert_used=2, n_ff_exp=32, n_vocab=512,
                          context_length=4096, rope_base=1e6, rms_eps=1e-6),
    "qwen3-30b-a3b": SynthGeometry("qwen3-30b-a3b", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
                                   head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768,
                                   n_vocab=151936),
    "qwen3-235b-a22b": SynthGeometry("qwen3-235b-a22b", n_layer=94, n_embd=4096, n_head=64, n_head_kv=4,
                                     head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=1536,
                                     n_vocab=151936),
    # Qwen/Qwen3-30B-A3B-Instruct-2507: the same layers, trained to 262,144 positions (theta 1e7)
    "qwen3-30b-a3b-2507": SynthGeometry("qwen3-30b-a3b-2507", n_layer=48, n_embd=2048, n_head=32,
                                        n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8,
                                        n_ff_exp=768, n_vocab=151936, context_length=262144,
                                        rope_base=1e7),
}


def plan_moe(g: SynthGeometry, quant: str, pop: Popularity, seed: int) -> tuple[list[Tensor], np.ndarray]:
    """The tensors of the file, in order, each of the type file type `quant` gives it."""
    res = reserved_width(g, quant)
    channel = embedding_channel(g, quant)
    out_std = attn_out_std(g)
    mu = calibrate_logit_means(pop, g.n_expert, g.n_expert_used)
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    ones = np.ones(g.n_embd, np.float32)
    unreserved = ones.copy()
    unreserved[:res] = 0

    def name(t: MT, layer: int | None = None) -> str:
        return gguf.TENSOR_NAMES[t].format(bid=layer) + ".weight"

    tensors = [matrix(name(MT.TOKEN_EMBD), g.n_vocab, g.n_embd, lambda: stream(seed, 0, 0),
                      set_embedding_channel, std=EMBD_STD)]
    ranks = np.empty((g.n_layer, g.n_expert), np.int64)
    for il in range(g.n_layer):
        def bits(kind: int, il: int = il) -> Callable[[], np.random.SFC64]:
            return lambda: stream(seed, il + 1, kind)
        ranks[il] = np.random.Generator(stream(seed, il + 1, 99)).permutation(g.n_expert)
        tensors += [
            const(name(MT.ATTN_NORM, il), (g.n_embd,), lambda: unreserved),
            matrix(name(MT.ATTN_Q, il), q, g.n_embd, bits(1)),
            matrix(name(MT.ATTN_K, il), kv, g.n_embd, bits(2)),
            matrix(name(MT.ATTN_V, il), kv, g.n_embd, bits(3)),
            matrix(name(MT.ATTN_OUT, il), g.n_embd, q, bits(4), zero_reserved_rows(res), std=out_std),
            const(name(MT.ATTN_Q_NORM, il), (g.head_dim,), lambda: np.ones(g.head_dim)),
            const(name(MT.ATTN_K_NORM, il), (g.head_dim,), lambda: np.ones(g.head_dim)),
            const(name(MT.FFN_NORM, il), (g.n_embd,), lambda: ones),
            const(name(MT.FFN_GATE_INP, il), (g.n_expert, g.n_embd),
                  lambda il=il: router(g, stream(seed, il + 1, 9), mu, ranks[il], res, channel)),
            experts(name(MT.FFN_GATE_EXP, il), g, g.n_ff_exp, g.n_embd, bits(5), res, writes=False),
            experts(name(MT.FFN_UP_EXP, il), g, g.n_ff_exp, g.n_embd, bits(6), res, writes=False),
            experts(name(MT.FFN_DOWN_EXP, il), g, g.n_embd, g.n_ff_exp, bits(7), res, writes=True),
        ]
    tensors += [const(name(MT.OUTPUT_NORM), (g.n_embd,), lambda: unreserved),
                matrix(name(MT.OUTPUT), g.n_vocab, g.n_embd, lambda: stream(seed, 0, 1))]
    assign_types(g, quant, tensors)
    return tensors, ranks


def write_moe(path: str | os.PathLike[str], g: SynthGeometry, quant: str, pop: Popularity,
              seed: int, progress: Callable[[int, int], None] | None,
              split_max_size: int = 0, rope_scaling: RopeScalingSpec | None = None) -> SynthSummary:
    """Write a synthetic qwen3moe GGUF of geometry `g` to `path` (or its shards), with
    `rope_scaling`'s keys where given (synth/rope.py)."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}: expected one of {', '.join(QUANTS)}")
    if g.n_head % g.n_head_kv or not 0 < g.n_expert_used <= g.n_expert:
        raise ValueError(f"{g.name}: needs n_head a multiple of n_head_kv and 0 < n_expert_used <= n_expert")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed {seed} is not in [0, 2**32)")
    path = Path(path)
    tensors, ranks = plan_moe(g, quant, pop, seed)

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_block_count(g.n_layer)
        w.add_context_length(rope_scaling.context_length(g.context_length) if rope_scaling
                             else g.context_length)
        w.add_embedding_length(g.n_embd)
        w.add_feed_forward_length(g.n_ff_exp)     # qwen3moe has no dense FFN; the expert ff stands in
        w.add_expert_feed_forward_length(g.n_ff_exp)
        w.add_head_count(g.n_head)
        w.add_head_count_kv(g.n_head_kv)
        w.add_key_length(g.head_dim)
        w.add_value_length(g.head_dim)
        w.add_rope_freq_base(g.rope_base)
        if rope_scaling:
            rope_scaling.write(w)
        w.add_layer_norm_rms_eps(g.rms_eps)
        w.add_expert_count(g.n_expert)
        w.add_expert_used_count(g.n_expert_used)

    paths = write_file(path, "qwen3moe", g, quant, pop, seed, ranks, metadata, tensors, progress,
                       split_max_size)
    return summary(paths, sum(p.stat().st_size for p in paths), g, quant, pop, tensors, ranks)
