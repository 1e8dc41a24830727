"""Synthetic qwen3next GGUFs (`strata-dist synth --like tiny-next | qwen3-next-80b-a3b`) and
qwen35moe ones (`--like tiny-qwen35 | qwen3.5-35b-a3b`).

The same streaming writer, random blocks and routing-popularity law as the qwen3moe files (the
package's docstring), carried over to the hybrid stack: the reserved slice [0, R) of the hidden state is read
only by the routers and written by nothing, whatever the mixer is.
  * attn_norm and output_norm are 0 on [0, R) (so neither mixer reads it), post_attention_norm is 1;
  * rows [0, R) of attn_output, ssm_out, every expert's ffn_down and of ffn_down_shexp are zero,
    and columns [0, R) of the experts' and the shared expert's gate/up are zero;
  * so routing at every layer follows the law exactly, as in the qwen3moe files.
The GDN tensors follow llama.cpp's conventions (see models/qwen3next.py): ssm_a = -A with A in
[1, 8], ssm_dt.bias = softplus^-1 of a time step in [0.01, 0.1] (what Qwen3-Next's training init
draws), ssm_norm 1, ssm_conv1d F32 [conv_dim, K]. Norms are written as stored (llama.cpp's +1
already applied): 1 means an identity scale.
A qwen35moe file (Qwen3.5 MoE) is laid out as llama.cpp's converter writes that architecture:
blk.N.ssm_beta and blk.N.ssm_alpha ([n_v, n_embd] each) instead of ssm_ba, the RoPE sections
(rope.dimension_sections) and a recurrent flag per block (attention.recurrent_layers). Its value
heads are random, so their order (tiled in such files, models/qwen35moe.py) needs no writing.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from .rope import RopeScalingSpec
from .writer import (EMBD_STD, QUANTS, WEIGHT_STD, MT, Popularity, SynthSummary, assign_types,
                     attn_out_std, const, embedding_channel, experts, matrix, router,
                     set_embedding_channel, stream, summary, write_file, calibrate_logit_means,
                     parse_popularity, reserved_width, zero_reserved_cols, zero_reserved_rows)

GDN_OUT_GAIN = 0.5     # ssm_out std so |ssm_out| * rms(gated norm output ~ 0.5) stays ~ this


@dataclass(frozen=True)
class NextSynthGeometry:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_vocab: int
    n_k_heads: int          # linear attention key heads (ssm.group_count)
    n_v_heads: int          # linear attention value heads (ssm.time_step_rank)
    head_k_dim: int         # ssm.state_size
    head_v_dim: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    context_length: int = 262144
    rope_base: float = 1e7
    rms_eps: float = 1e-6
    arch: str = "qwen3next"             # or "qwen35moe"
    rope_sections: tuple[int, ...] = ()  # qwen35moe: rope.dimension_sections

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


# Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers (attention every 4th), hidden 2048,
# 16 q / 2 kv heads of 256 (partial rotary 0.25: 64 dims), linear attention 16 key / 32 value heads
# of 128, conv kernel 4, 512 experts top-10 of ff 512, shared expert ff 512, vocab 151936,
# rope_theta 1e7, context 262144.
NEXT_GEOMETRIES: dict[str, NextSynthGeometry] = {
    "tiny-next": NextSynthGeometry("tiny-next", n_layer=8, n_embd=64, n_head=4, n_head_kv=2,
                                   head_dim=16, n_expert=8, n_expert_used=2, n_ff_exp=32,
                                   n_ff_shexp=32, n_vocab=512, n_k_heads=2, n_v_heads=4,
                                   head_k_dim=16, head_v_dim=16, context_length=4096,
                                   rope_base=1e6),
    "qwen3-next-80b-a3b": NextSynthGeometry("qwen3-next-80b-a3b", n_layer=48, n_embd=2048,
                                            n_head=16, n_head_kv=2, head_dim=256, n_expert=512,
                                            n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
                                            n_vocab=151936, n_k_heads=16, n_v_heads=32,
                                            head_k_dim=128, head_v_dim=128),
    # 8 pairs rotated per head (head 32, partial rotary 0.25) in sections 2 + 1 + 1
    "tiny-qwen35": NextSynthGeometry("tiny-qwen35", n_layer=8, n_embd=64, n_head=4, n_head_kv=2,
                                     head_dim=32, n_expert=8, n_expert_used=2, n_ff_exp=32,
                                     n_ff_shexp=32, n_vocab=512, n_k_heads=2, n_v_heads=4,
                                     head_k_dim=16, head_v_dim=16, context_length=4096,
                                     rope_base=1e6, arch="qwen35moe", rope_sections=(2, 1, 1, 0)),
    # Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults (40 layers, attention every
    # 4th, hidden 2048, 16 q / 2 kv heads of 256, partial rotary 0.25, linear attention 16 key /
    # 32 value heads of 128, 256 experts top-8 of ff 512, shared expert ff 512, vocab 248320,
    # rope_theta 1e4, 32768 positions) and the converter's default sections [11, 11, 10, 0]
    "qwen3.5-35b-a3b": NextSynthGeometry("qwen3.5-35b-a3b", n_layer=40, n_embd=2048, n_head=16,
                                         n_head_kv=2, head_dim=256, n_expert=256,
                                         n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                                         n_vocab=248320, n_k_heads=16, n_v_heads=32,
                                         head_k_dim=128, head_v_dim=128, context_length=32768,
                                         rope_base=1e4, arch="qwen35moe",
                                         rope_sections=(11, 11, 10, 0)),
}


def _name(t: MT, layer: int | None = None, suffix: str = ".weight") -> str:
    return gguf.TENSOR_NAMES[t].format(bid=layer) + suffix


def plan_next(g: NextSynthGeometry, quant: str, pop: Popularity, seed: int, mtp: bool = False):
    """The tensors of the file, in order, each of the type file type `quant` gives it; with `mtp`,
    one multi-token-prediction block after the stack, as blk.{n_layer} (`mtp_block`)."""
    res = reserved_width(g, quant)
    channel = embedding_channel(g, quant)
    mu = calibrate_logit_means(pop, g.n_expert, g.n_expert_used)
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    ones = np.ones(g.n_embd, np.float32)
    unreserved = ones.copy()
    unreserved[:res] = 0
    out_std = attn_out_std(g)
    gdn_out_std = min(WEIGHT_STD, GDN_OUT_GAIN / (0.5 * math.sqrt(g.value_dim)))
    no_write, no_read = zero_reserved_rows(res), zero_reserved_cols(res)

    def attention(il: int, bits) -> list:    # a gated-attention layer's parts
        return [
            matrix(_name(MT.ATTN_Q, il), 2 * q, g.n_embd, bits(1)),   # q and its gate
            matrix(_name(MT.ATTN_K, il), kv, g.n_embd, bits(2)),
            matrix(_name(MT.ATTN_V, il), kv, g.n_embd, bits(3)),
            matrix(_name(MT.ATTN_OUT, il), g.n_embd, q, bits(4), no_write, std=out_std),
            const(_name(MT.ATTN_Q_NORM, il), (g.head_dim,), lambda: np.ones(g.head_dim)),
            const(_name(MT.ATTN_K_NORM, il), (g.head_dim,), lambda: np.ones(g.head_dim)),
        ]

    def moe(il: int, bits) -> list:          # the routed experts and the shared expert
        return [
            experts(_name(MT.FFN_GATE_EXP, il), g, g.n_ff_exp, g.n_embd, bits(5), res, writes=False),
            experts(_name(MT.FFN_UP_EXP, il), g, g.n_ff_exp, g.n_embd, bits(6), res, writes=False),
            experts(_name(MT.FFN_DOWN_EXP, il), g, g.n_embd, g.n_ff_exp, bits(7), res, writes=True),
            matrix(_name(MT.FFN_GATE_SHEXP, il), g.n_ff_shexp, g.n_embd, bits(10), no_read),
            matrix(_name(MT.FFN_UP_SHEXP, il), g.n_ff_shexp, g.n_embd, bits(11), no_read),
            matrix(_name(MT.FFN_DOWN_SHEXP, il), g.n_embd, g.n_ff_shexp, bits(12), no_write),
            const(_name(MT.FFN_GATE_INP_SHEXP, il), (1, g.n_embd),
                   lambda: np.random.Generator(stream(seed, il + 1, 13)).uniform(
                       -1, 1, (1, g.n_embd)) * unreserved * (WEIGHT_STD * math.sqrt(3))),
        ]

    tensors = [matrix(_name(MT.TOKEN_EMBD), g.n_vocab, g.n_embd, lambda: stream(seed, 0, 0),
                      set_embedding_channel, std=EMBD_STD)]
    ranks = np.empty((g.n_layer, g.n_expert), np.int64)
    for il in range(g.n_layer):
        def bits(kind: int, il: int = il) -> Callable[[], np.random.SFC64]:
            return lambda: stream(seed, il + 1, kind)
        ranks[il] = np.random.Generator(stream(seed, il + 1, 99)).permutation(g.n_expert)
        tensors.append(const(_name(MT.ATTN_NORM, il), (g.n_embd,), lambda: unreserved))
        if g.is_linear(il):
            rng = lambda kind, il=il: np.random.Generator(stream(seed, il + 1, kind))  # noqa: E731
            tensors += [
                matrix(_name(MT.ATTN_QKV, il), g.conv_dim, g.n_embd, bits(1)),
                matrix(_name(MT.ATTN_GATE, il), g.value_dim, g.n_embd, bits(2)),
                const(_name(MT.SSM_CONV1D, il), (g.conv_dim, g.conv_kernel),
                       lambda rng=rng: rng(20).uniform(-1, 1, (g.conv_dim, g.conv_kernel))
                       / math.sqrt(g.conv_kernel)),
                const(_name(MT.SSM_DT, il, ".bias"), (g.n_v_heads,),
                       lambda rng=rng: np.log(np.expm1(np.exp(rng(21).uniform(
                           math.log(0.01), math.log(0.1), g.n_v_heads))))),
                const(_name(MT.SSM_A, il, ""), (g.n_v_heads,),
                       lambda rng=rng: -rng(22).uniform(1.0, 8.0, g.n_v_heads)),
                *([matrix(_name(MT.SSM_BETA, il), g.n_v_heads, g.n_embd, bits(3)),
                   matrix(_name(MT.SSM_ALPHA, il), g.n_v_heads, g.n_embd, bits(8))]
                  if g.arch == "qwen35moe" else
                  [matrix(_name(MT.SSM_BETA_ALPHA, il), 2 * g.n_v_heads, g.n_embd, bits(3))]),
                const(_name(MT.SSM_NORM, il), (g.head_v_dim,), lambda: np.ones(g.head_v_dim)),
                matrix(_name(MT.SSM_OUT, il), g.n_embd, g.value_dim, bits(4), no_write,
                       std=gdn_out_std),
            ]
        else:
            tensors += attention(il, bits)
        tensors += [
            const(_name(MT.ATTN_POST_NORM, il), (g.n_embd,), lambda: ones),
            const(_name(MT.FFN_GATE_INP, il), (g.n_expert, g.n_embd),
                   lambda il=il: router(g, stream(seed, il + 1, 9), mu, ranks[il], res, channel)),
            *moe(il, bits)]
    tensors += [const(_name(MT.OUTPUT_NORM), (g.n_embd,), lambda: unreserved),
                matrix(_name(MT.OUTPUT), g.n_vocab, g.n_embd, lambda: stream(seed, 0, 1))]
    if mtp:
        tensors += mtp_block(g, seed, attention, moe, unreserved)
    assign_types(g, quant, tensors)
    return tensors, ranks


def mtp_block(g: NextSynthGeometry, seed: int, attention, moe, unreserved) -> list:
    """The multi-token-prediction block as llama.cpp's converter lays it out: blk.{n_layer} holds a
    full-attention layer (the stack's attention parts and its MoE with the shared expert) and the
    nextn parts: eh_proj [n_embd, 2 n_embd] (it reads [enorm(embedding) | hnorm(hidden)]),
    enorm, hnorm and shared_head_norm; the embedding and head are the model's. Its own random
    streams (layer index n_layer + 1), so the stack's tensors are those of the file without it.
    enorm, hnorm and shared_head_norm are 0 on the routers' slice, as output_norm is; its router
    is a plain random one (std 1/sqrt(n_embd): logits of about unit spread), the law being the
    stack's."""
    il = g.n_layer
    bits = lambda kind: lambda: stream(seed, il + 1, kind)   # noqa: E731
    rng = lambda kind: np.random.Generator(stream(seed, il + 1, kind))   # noqa: E731
    return [
        const(_name(MT.ATTN_NORM, il), (g.n_embd,), lambda: unreserved),
        *attention(il, bits),
        const(_name(MT.ATTN_POST_NORM, il), (g.n_embd,), lambda: np.ones(g.n_embd)),
        const(_name(MT.FFN_GATE_INP, il), (g.n_expert, g.n_embd),
               lambda: rng(9).normal(0, 1 / math.sqrt(g.n_embd), (g.n_expert, g.n_embd))),
        *moe(il, bits),
        matrix(_name(MT.NEXTN_EH_PROJ, il), g.n_embd, 2 * g.n_embd, bits(14)),
        const(_name(MT.NEXTN_ENORM, il), (g.n_embd,), lambda: unreserved),
        const(_name(MT.NEXTN_HNORM, il), (g.n_embd,), lambda: unreserved),
        const(_name(MT.NEXTN_SHARED_HEAD_NORM, il), (g.n_embd,), lambda: unreserved),
    ]


def write_next(path: str | os.PathLike[str], like: str | NextSynthGeometry,
               quant: str = "q8_0", popularity: str | Popularity = "uniform", seed: int = 0,
               progress: Callable[[int, int], None] | None = None,
               split_max_size: int = 0, rope_scaling: RopeScalingSpec | None = None,
               mtp: bool = False) -> SynthSummary:
    """Write a synthetic qwen3next GGUF to `path`, or its shards (see the module docstring), with
    `rope_scaling`'s keys where given (synth/rope.py); `mtp`: with one multi-token-prediction
    block after the stack (`mtp_block`), counted in block_count as llama.cpp's converter counts
    it, with nextn_predict_layers 1 and attention.recurrent_layers (a bool per block)."""
    g = like if isinstance(like, NextSynthGeometry) else NEXT_GEOMETRIES.get(like)
    if g is None:
        raise ValueError(f"unknown geometry {like!r}: expected one of {', '.join(NEXT_GEOMETRIES)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}: expected one of {', '.join(QUANTS)}")
    pop = parse_popularity(popularity) if isinstance(popularity, str) else popularity
    if g.n_head % g.n_head_kv or g.n_v_heads % g.n_k_heads or not 0 < g.n_expert_used <= g.n_expert:
        raise ValueError(f"{g.name}: needs n_head a multiple of n_head_kv, value heads a multiple "
                         f"of key heads and 0 < n_expert_used <= n_expert")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed {seed} is not in [0, 2**32)")
    path = Path(path)
    tensors, ranks = plan_next(g, quant, pop, seed, mtp)

    def metadata(w: gguf.GGUFWriter) -> None:   # what llama.cpp's converter writes for the arch
        w.add_block_count(g.n_layer + mtp)
        if mtp:
            w.add_nextn_predict_layers(1)
        if mtp or g.arch == "qwen35moe":
            w.add_array(f"{w.arch}.attention.recurrent_layers",
                        [g.is_linear(il) for il in range(g.n_layer)] + [False] * mtp)
        if g.rope_sections:
            w.add_array(f"{w.arch}.rope.dimension_sections", list(g.rope_sections))
        w.add_context_length(rope_scaling.context_length(g.context_length) if rope_scaling
                             else g.context_length)
        w.add_embedding_length(g.n_embd)
        w.add_feed_forward_length(g.n_ff_exp)
        w.add_expert_feed_forward_length(g.n_ff_exp)
        w.add_expert_shared_feed_forward_length(g.n_ff_shexp)
        w.add_head_count(g.n_head)
        w.add_head_count_kv(g.n_head_kv)
        w.add_key_length(g.head_dim)
        w.add_value_length(g.head_dim)
        w.add_rope_freq_base(g.rope_base)
        w.add_rope_dimension_count(int(g.head_dim * g.partial_rotary))
        if rope_scaling:
            rope_scaling.write(w)
        w.add_layer_norm_rms_eps(g.rms_eps)
        w.add_expert_count(g.n_expert)
        w.add_expert_used_count(g.n_expert_used)
        w.add_ssm_conv_kernel(g.conv_kernel)
        w.add_ssm_state_size(g.head_k_dim)
        w.add_ssm_group_count(g.n_k_heads)
        w.add_ssm_time_step_rank(g.n_v_heads)
        w.add_ssm_inner_size(g.value_dim)
        w.add_full_attention_interval(g.full_attention_interval)

    paths = write_file(path, g.arch, g, quant, pop, seed, ranks, metadata, tensors, progress,
                       split_max_size)
    return summary(paths, sum(p.stat().st_size for p in paths), g, quant, pop, tensors, ranks)
