"""`strata-dist synth`: a synthetic qwen3moe GGUF of a real geometry, random weights, a usable tokenizer.

Streaming. The header, metadata and every tensor info go first (sizes are known up front), then each
tensor's data, generated chunk by chunk (<= `CHUNK_BYTES`) from a per-tensor random stream and written
straight into the file, so memory stays at a few chunks whatever the file size. Quantized expert data
is generated directly as random blocks (random quants, f16 scales from a table picked by a random
byte) instead of quantizing floats: that keeps the writer at disk speed.

Types. `quant` is a file type (ftypes.py): each tensor gets the type the reference quantizer's rules
give it for that file type and architecture (q4_k_m: attn_v and half the layers' ffn_down in Q6_K,
the output in Q6_K, the rest Q4_K; norms and routers F32), a tensor whose rows do not hold the
type's blocks falling back as those rules say (the tiny geometry's 64-wide rows cannot hold 256-wide
K blocks). The legacy `q4_k` keeps its first meaning: Q4_K experts, F16 dense tensors.
Shards (`split_max_size`): shards.py.
Values: weights std WEIGHT_STD (dequantized), except attn_output, scaled so attention cannot amplify
a component common to all positions layer after layer (`attn_out_std`); norms 1.

Popularity (`uniform` or `zipf:S`): a reserved slice of the hidden state that only routers read.
  * Coordinates [0, R) of the hidden state are reserved, R = 1 + n_expert (rounded up to whole blocks
    of 32 when the experts are quantized, of 256 for the i-quants that zero only whole blocks). Token embedding rows hold the constant A in coordinate 0
    (the same for every token: CHANNEL_VALUE in a float embedding; in a quantized one the value the
    first block's fixed scales give, `embedding_channel`) and random values (std EMBD_STD)
    everywhere else, reserved or not.
  * Nothing writes the reserved slice: rows [0, R) of attn_output and of every expert's ffn_down are
    zero, so the residual stream keeps exactly its embedding values there at every layer.
  * Nothing else reads it: attn_norm and output_norm are 0 on [0, R), and columns [0, R) of
    ffn_gate/ffn_up are zero (whole zero-scale blocks), so attention, experts and logits are those of
    a plain random model of width n_embd - R.
  * Router row e of layer l is zero outside [0, R): beta_e in column 0, and on [1, R) orthonormal rows
    (R - 1 >= n_expert) scaled so that, at layer 0, logit_e = mu_e + noise_e with noise_e ~ N(0, 1)
    i.i.d. over experts and tokens (ROUTER_NOISE). At a deeper layer the logits are the same values
    times rms(h_0)/rms(h_l) (the RMSNorm denominator), and top-k is scale-free: a token's choice of
    experts at layer l does not depend on what earlier layers computed, so the law holds exactly at
    every depth, in any correct forward, whatever the prompt.
  The means mu_e are calibrated once (quadrature on that noise model) so that top-k includes the
  expert of popularity rank r with a frequency ∝ r^-S (capped at PI_CAP of the tokens where k times
  the share would exceed it, e.g. the hottest experts of zipf:2). A per-layer random permutation
  decides which expert holds which rank (`SynthSummary.expert_rank`; in the file as
  `strata.synth.expert_rank`, n_layer x n_expert ids, hottest first).
  Consequence: routing depends on the token and the layer, not on the context (as early layers of
  real MoE models mostly do); the softmax weights flatten where the residual stream has grown. The
  law is over tokens: measure it on many distinct token ids (random ids, or generated text).
"""
from __future__ import annotations

import os
from typing import Callable

from .moe import GEOMETRIES, SynthGeometry, write_moe
from .next import NEXT_GEOMETRIES, NextSynthGeometry, write_next
from .ftypes import FILE_TYPES
from .rope import RopeScalingSpec, parse_rope_scaling
from .shards import parse_size
from .writer import (QUANTS, Popularity, SynthSummary, parse_popularity, reserved_width,
                     top_k_inclusion)


def write_synthetic(path: str | os.PathLike[str], like: str | SynthGeometry | NextSynthGeometry,
                    quant: str = "q8_0", popularity: str | Popularity = "uniform", seed: int = 0,
                    progress: Callable[[int, int], None] | None = None,
                    split_max_size: int | str = 0,
                    rope_scaling: str | RopeScalingSpec | None = None,
                    mtp: bool = False) -> SynthSummary:
    """Write a synthetic GGUF of a geometry (a name of GEOMETRIES or NEXT_GEOMETRIES, or the
    value) to `path`; `progress(bytes_written, total_bytes)` per chunk. `split_max_size` (bytes, or
    text such as "4G"): write shards `<path without .gguf>-0000i-of-0000N.gguf` instead.
    `rope_scaling` ("yarn:4:32768", "linear:2", "none"; synth/rope.py): the file's
    rope.scaling.* keys, and under yarn its context_length factor x original. `mtp`: a qwen3next
    file with one multi-token-prediction block (synth/next.py `mtp_block`)."""
    if isinstance(split_max_size, str):
        split_max_size = parse_size(split_max_size)
    if not isinstance(rope_scaling, RopeScalingSpec):
        rope_scaling = parse_rope_scaling(rope_scaling)
    if isinstance(like, NextSynthGeometry) or like in NEXT_GEOMETRIES:
        return write_next(path, like, quant, popularity, seed, progress, split_max_size,
                          rope_scaling, mtp)
    if mtp:
        raise ValueError(f"--mtp: {like if isinstance(like, str) else like.name} is a qwen3moe "
                         f"geometry; the MTP block is written for {', '.join(NEXT_GEOMETRIES)}")
    if isinstance(like, SynthGeometry):
        g = like
    elif like in GEOMETRIES:
        g = GEOMETRIES[like]
    else:
        raise ValueError(f"unknown geometry {like!r}: expected one of "
                         f"{', '.join([*GEOMETRIES, *NEXT_GEOMETRIES])}")
    pop = parse_popularity(popularity) if isinstance(popularity, str) else popularity
    return write_moe(path, g, quant, pop, seed, progress, split_max_size, rope_scaling)


__all__ = ["FILE_TYPES", "GEOMETRIES", "NEXT_GEOMETRIES", "QUANTS", "NextSynthGeometry", "Popularity",
           "RopeScalingSpec", "SynthGeometry", "parse_rope_scaling", "SynthSummary", "parse_popularity", "reserved_width", "top_k_inclusion",
           "parse_size", "write_synthetic"]
