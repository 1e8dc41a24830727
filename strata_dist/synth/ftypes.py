"""File types (`strata-dist synth --quant`): which GGML type each tensor of a synthetic file gets.

One table-driven, pure function of the file type, the tensor names and shapes and a few hyper-
parameters (`tensor_types`), so a 60 GiB file's type plan can be checked without writing it. The
rules are those of the reference quantizer for the file types named in FILE_TYPES (docs/DEVELOPING.md,
"Synthetic file types", lists what is followed and what is left out):

  * Only tensors whose name ends in `weight`, of two or more dimensions (trailing 1s do not count),
    are quantized, and never a `*_norm.weight`, a router (`ffn_gate_inp.weight`) or `ssm_conv1d`:
    those keep their written type (F32 here).
  * The rest starts at the file type's default type, then RULES may raise it by the tensor's
    category (below), its layer and the model's hyperparameters; the output tensor gets Q6_K
    (Q8_0 in a Q8_0 file, or where its rows do not hold the default type's blocks; Q5_K in the
    2-bit-class i-quant files, OUTPUT_Q5_K).
  * The i-quant file types whose default type needs an importance matrix (iq1_*, iq2_*, iq3_xxs)
    are only ever made with one, so their rules are the importance-matrix rules (iq3_xxs: attn_v
    IQ3_XXS where n_gqa < 4, no Q4_K/Q3_K ffn_down); the others follow the rules without one.
  * Last, a tensor whose rows are not a whole number of the type's blocks falls back (FALLBACK),
    then to F16.
  * Float file types (f32, f16, bf16) write every quantizable tensor in that type.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import gguf

T = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class FileType:
    name: str
    default: T                       # the type of every quantizable tensor no rule raises
    file_type: FT                    # general.file_type
    experts_only: bool = False       # the legacy `q4_k`: only the expert tensors take `default`


# `q4_k` is the synth's original meaning, kept for the benchmarks that name it: Q4_K experts with
# F16 dense tensors (general.file_type says Q4_K_M, the nearest file type).
FILE_TYPES: dict[str, FileType] = {f.name: f for f in (
    FileType("f32", T.F32, FT.ALL_F32),
    FileType("f16", T.F16, FT.MOSTLY_F16),
    FileType("bf16", T.BF16, FT.MOSTLY_BF16),
    FileType("q8_0", T.Q8_0, FT.MOSTLY_Q8_0),
    FileType("q4_0", T.Q4_0, FT.MOSTLY_Q4_0),
    FileType("q4_1", T.Q4_1, FT.MOSTLY_Q4_1),
    FileType("q5_0", T.Q5_0, FT.MOSTLY_Q5_0),
    FileType("q5_1", T.Q5_1, FT.MOSTLY_Q5_1),
    FileType("q2_k", T.Q2_K, FT.MOSTLY_Q2_K),
    FileType("q3_k_s", T.Q3_K, FT.MOSTLY_Q3_K_S),
    FileType("q3_k_m", T.Q3_K, FT.MOSTLY_Q3_K_M),
    FileType("q3_k_l", T.Q3_K, FT.MOSTLY_Q3_K_L),
    FileType("q4_k_s", T.Q4_K, FT.MOSTLY_Q4_K_S),
    FileType("q4_k_m", T.Q4_K, FT.MOSTLY_Q4_K_M),
    FileType("q5_k_s", T.Q5_K, FT.MOSTLY_Q5_K_S),
    FileType("q5_k_m", T.Q5_K, FT.MOSTLY_Q5_K_M),
    FileType("q6_k", T.Q6_K, FT.MOSTLY_Q6_K),
    FileType("q4_k", T.Q4_K, FT.MOSTLY_Q4_K_M, experts_only=True),
    # i-quants; iq2_s's default type is IQ2_XS and iq2_m's IQ2_S (the reference's own mapping)
    FileType("iq1_s", T.IQ1_S, FT.MOSTLY_IQ1_S),
    FileType("iq1_m", T.IQ1_M, FT.MOSTLY_IQ1_M),
    FileType("iq2_xxs", T.IQ2_XXS, FT.MOSTLY_IQ2_XXS),
    FileType("iq2_xs", T.IQ2_XS, FT.MOSTLY_IQ2_XS),
    FileType("iq2_s", T.IQ2_XS, FT.MOSTLY_IQ2_S),
    FileType("iq2_m", T.IQ2_S, FT.MOSTLY_IQ2_M),
    FileType("iq3_xxs", T.IQ3_XXS, FT.MOSTLY_IQ3_XXS),
    FileType("iq3_xs", T.IQ3_S, FT.MOSTLY_IQ3_XS),
    FileType("iq3_s", T.IQ3_S, FT.MOSTLY_IQ3_S),
    FileType("iq3_m", T.IQ3_S, FT.MOSTLY_IQ3_M),
    FileType("iq4_nl", T.IQ4_NL, FT.MOSTLY_IQ4_NL),
    FileType("iq4_xs", T.IQ4_XS, FT.MOSTLY_IQ4_XS),
)}

FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})

# A type whose blocks do not tile a row falls back to this one (then to F16).
FALLBACK: dict[T, T] = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
                        **{t: T.IQ4_NL for t in (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S,
                                                 T.IQ3_XXS, T.IQ3_S, T.IQ4_XS)}}

# The 2-bit-class i-quant files: a rule set of their own (attn_v Q4_K wherever n_gqa >= 4 or
# there are 4+ experts, no Q8_0 for the 8-expert attn_v/attn_k, the first ffn_down tensors
# counted in file order raised), and the output in Q5_K.
IQ2_CLASS = frozenset({"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m"})
OUTPUT_Q5_K = IQ2_CLASS | {"iq3_xxs"}


@dataclass(frozen=True)
class ModelInfo:
    """What the rules read of the model besides the tensors."""
    n_layer: int
    n_expert: int
    n_gqa: int                       # n_head / n_head_kv


@dataclass(frozen=True)
class Where:
    """A tensor's place, as a rule sees it: `i` is the layer (or, for the attn_v-like category, the
    running count of such tensors in layer order) and `n` the number of layers (or of such tensors);
    `count` the running count of its category's tensors in (layer, name) order."""
    i: int
    n: int
    info: ModelInfo
    count: int = 0


def use_more_bits(i: int, n: int) -> bool:
    """The first and last eighth of the layers, and every third one between them."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Cond = Callable[[Where], bool]
ALWAYS: Cond = lambda w: True                                   # noqa: E731
MORE_BITS: Cond = lambda w: use_more_bits(w.i, w.n)             # noqa: E731
EIGHT_EXPERTS: Cond = lambda w: w.info.n_expert == 8           # noqa: E731
GQA4: Cond = lambda w: w.info.n_gqa >= 4                        # noqa: E731
FIRST_EIGHTH: Cond = lambda w: w.i < w.n // 8                   # noqa: E731
IQ2S_M = frozenset({"iq2_s", "iq2_m"})
IQ1 = frozenset({"iq1_s", "iq1_m"})

# (category, file types, condition, type): per category the first matching row wins; an
# OVERRIDES row then applies on top, whatever the first match was.
RULES: list[tuple[str, frozenset[str], Cond, T]] = [
    # the 2-bit-class i-quant files (the reference tests these first, whatever the category)
    ("token_embd", IQ1 | {"iq2_xxs", "iq2_xs"}, ALWAYS, T.Q2_K),
    ("token_embd", IQ2S_M | {"iq3_xxs"}, ALWAYS, T.IQ3_S),
    ("attn_v", IQ2_CLASS, lambda w: w.info.n_gqa >= 4 or w.info.n_expert >= 4, T.Q4_K),
    ("attn_v", IQ2S_M, ALWAYS, T.IQ3_S),
    ("attn_v", IQ2_CLASS, ALWAYS, T.Q2_K),
    ("attn_k", IQ2_CLASS, EIGHT_EXPERTS, T.Q4_K),
    ("ffn_down", IQ2S_M, lambda w: w.count < w.info.n_layer // 8, T.IQ3_S),
    ("ffn_down", IQ2_CLASS, lambda w: w.count < w.info.n_layer // 8, T.Q2_K),
    ("attn_output", IQ2_CLASS, EIGHT_EXPERTS, T.Q5_K),
    ("attn_output", IQ1, ALWAYS, T.IQ2_XXS),
    ("attn_output", IQ2S_M, ALWAYS, T.IQ3_S),
    # the other i-quant files
    ("attn_v", frozenset({"iq3_xxs", "iq3_xs", "iq3_s", "iq3_m"}), GQA4, T.Q4_K),
    ("attn_v", frozenset({"iq3_m"}), ALWAYS, T.Q4_K),
    ("attn_v", frozenset({"iq4_nl", "iq4_xs"}), GQA4, T.Q5_K),
    ("attn_k", frozenset({"iq3_xs"}), ALWAYS, T.IQ3_XXS),
    ("attn_k", frozenset({"iq3_xxs"}), ALWAYS, T.IQ2_S),
    ("attn_q", frozenset({"iq3_xs"}), ALWAYS, T.IQ3_XXS),
    ("attn_q", frozenset({"iq3_xxs"}), ALWAYS, T.IQ2_S),
    ("ffn_down", frozenset({"iq3_m"}), lambda w: w.i < w.n // 8 or (w.info.n_expert == 8 and MORE_BITS(w)),
     T.Q4_K),
    ("ffn_down", frozenset({"iq4_nl", "iq4_xs"}), FIRST_EIGHTH, T.Q5_K),
    ("ffn_gate", frozenset({"iq3_xs"}), lambda w: w.n // 8 <= w.i < 7 * w.n // 8, T.IQ3_XXS),
    ("ffn_up", frozenset({"iq3_xs"}), lambda w: w.n // 8 <= w.i < 7 * w.n // 8, T.IQ3_XXS),
    ("attn_output", frozenset({"iq3_xxs", "iq3_xs", "iq3_s", "iq3_m", "iq4_nl", "iq4_xs"}), EIGHT_EXPERTS,
     T.Q5_K),
    ("attn_output", frozenset({"iq3_xxs"}), ALWAYS, T.IQ3_S),
    ("attn_output", frozenset({"iq3_m"}), ALWAYS, T.Q4_K),
    # the K and legacy files
    ("attn_v", frozenset({"q2_k"}), lambda w: w.info.n_gqa >= 4, T.Q4_K),
    ("attn_v", frozenset({"q2_k"}), ALWAYS, T.Q3_K),
    ("attn_v", frozenset({"q3_k_m"}), lambda w: w.i < 2, T.Q5_K),
    ("attn_v", frozenset({"q3_k_m"}), ALWAYS, T.Q4_K),
    ("attn_v", frozenset({"q3_k_l"}), ALWAYS, T.Q5_K),
    ("attn_v", frozenset({"q4_k_m", "q5_k_m"}), MORE_BITS, T.Q6_K),
    ("attn_v", frozenset({"q4_k_s"}), lambda w: w.i < 4, T.Q5_K),
    ("ffn_down", frozenset({"q2_k"}), ALWAYS, T.Q3_K),
    ("ffn_down", frozenset({"q3_k_m"}), lambda w: w.i < w.n // 16, T.Q5_K),
    ("ffn_down", frozenset({"q3_k_m"}), ALWAYS, T.Q4_K),
    ("ffn_down", frozenset({"q3_k_l"}), ALWAYS, T.Q5_K),
    ("ffn_down", frozenset({"q4_k_m", "q5_k_m"}), MORE_BITS, T.Q6_K),
    ("ffn_down", frozenset({"q4_k_s"}), lambda w: w.i < w.n // 8, T.Q5_K),
    ("attn_output", frozenset({"q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m"}), EIGHT_EXPERTS, T.Q5_K),
    ("attn_output", frozenset({"q2_k"}), lambda w: w.info.n_expert != 8, T.Q3_K),
    ("attn_output", frozenset({"q3_k_m"}), lambda w: w.info.n_expert != 8, T.Q4_K),
    ("attn_output", frozenset({"q3_k_l"}), lambda w: w.info.n_expert != 8, T.Q5_K),
]
QUANTIZED_FILE_TYPES = frozenset(n for n, f in FILE_TYPES.items() if f.default not in FLOAT_TYPES)
OVERRIDES: list[tuple[str, frozenset[str], Cond, T]] = [
    ("attn_v", QUANTIZED_FILE_TYPES - IQ2_CLASS, EIGHT_EXPERTS, T.Q8_0),
    ("attn_k", QUANTIZED_FILE_TYPES - IQ2_CLASS, EIGHT_EXPERTS, T.Q8_0),
]

_LAYER = re.compile(r"blk\.(\d+)\.")


def category(name: str) -> str:
    """The rules' category of a tensor name (substring tests, in this order)."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"),
                     ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """shape in numpy order; dimensions of 1 at the outer end do not count."""
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    return (len(dims) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name)


def block_size(t: T) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


def fall_back(t: T, row: int) -> T:
    """The type a row of `row` values can hold: `t`, its FALLBACK, else F16."""
    if row % block_size(t) == 0:
        return t
    alt = FALLBACK.get(t, T.F16)
    return alt if row % block_size(alt) == 0 else T.F16


def _pick(rules, cat: str, ftype: str, where: Where, current: T) -> T:
    for c, names, cond, t in rules:
        if c == cat and ftype in names and cond(where):
            return t
    return current


def tensor_types(ftype: str, tensors: Iterable[tuple[str, tuple[int, ...], T]],
                 info: ModelInfo) -> dict[str, T]:
    """The type of every tensor of a file of type `ftype`, from (name, numpy shape, written type)
    triples: the written type stands for tensors that are not quantized."""
    if ftype not in FILE_TYPES:
        raise ValueError(f"unknown quant {ftype!r}: expected one of {', '.join(FILE_TYPES)}")
    f = FILE_TYPES[ftype]
    tensors = list(tensors)

    def order(item: tuple[str, tuple[int, ...], T]) -> tuple[int, str]:   # layer, then name
        m = _LAYER.match(item[0])
        return (int(m.group(1)) if m else -1, item[0])

    n_wv = sum(category(n) == "attn_v" for n, _, _ in tensors)
    tied = not any(n == "output.weight" for n, _, _ in tensors)
    i_wv = 0
    seen: dict[str, int] = {}        # tensors of each category so far, in (layer, name) order
    out: dict[str, T] = {}
    for name, shape, written in sorted(tensors, key=order):
        if not quantizable(name, shape):
            out[name] = written
            continue
        if f.experts_only:          # its own fallback: Q8_0, then F16
            fits = [t for t in (f.default, T.Q8_0) if shape[-1] % block_size(t) == 0]
            out[name] = (fits[0] if fits else T.F16) if "_exps." in name else T.F16
            continue
        if f.default in FLOAT_TYPES:
            out[name] = f.default
            continue
        cat = category(name)
        if cat == "token_embd" and tied:
            cat = "output"
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else 0
        count = seen.get(cat, 0)
        seen[cat] = count + 1
        where = (Where(i_wv, n_wv, info, count) if cat == "attn_v"
                 else Where(layer, info.n_layer, info, count))
        if cat == "output":
            row_fits = shape[-1] % block_size(f.default) == 0
            t = (T.Q8_0 if not row_fits or f.default == T.Q8_0
                 else T.Q5_K if ftype in OUTPUT_Q5_K else T.Q6_K)
        else:
            t = _pick(OVERRIDES, cat, ftype, where, _pick(RULES, cat, ftype, where, f.default))
        if cat == "attn_v":
            i_wv += 1
        out[name] = fall_back(t, shape[-1])
    return {name: out[name] for name, _, _ in tensors}        # in the caller's order
