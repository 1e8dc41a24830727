"""The shared writer of the synthetic files (the package docstring tells the whole story): tensor
streams generated chunk by chunk, the routing law's calibration, and the GGUF layout."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

from .blocks import channel_value, column_granule, random_rows, set_channel, zero_first_columns
from .ftypes import FILE_TYPES, ModelInfo, tensor_types
from .shards import write_gguf
from .tokenizer import add_tokenizer

T = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR

CHUNK_BYTES = 32 << 20       # generate and write at most this much at a time
WEIGHT_STD = 0.03            # std of every random weight matrix (dequantized)
EMBD_STD = 1.0               # std of the random part of token embeddings
CHANNEL_VALUE = 4.0          # the constant in coordinate 0 of every token embedding
ATTN_GAIN = 0.5              # attn_output std is set so |W_o W_v| ~ this (see attn_out_std)
ROUTER_NOISE = 1.0           # std of the token-dependent part of a router logit (layer 0)
PI_CAP = 0.95                # most tokens an expert may be routed (fraction) in the target law


QUANTS = FILE_TYPES             # the accepted --quant values (strata_dist/synth/ftypes.py)


@dataclass(frozen=True)
class Popularity:
    """Target routing law: `uniform`, or `zipf` with exponent `s` (share of rank r ∝ r^-s)."""
    kind: str
    s: float = 0.0

    def shares(self, n_expert: int) -> np.ndarray:
        """Target share of the routing of each popularity rank (hottest first); sums to 1."""
        w = np.arange(1, n_expert + 1, dtype=np.float64) ** -(self.s if self.kind == "zipf" else 0.0)
        return w / w.sum()

    def __str__(self) -> str:
        return "uniform" if self.kind == "uniform" else f"zipf:{self.s:g}"


def parse_popularity(text: str) -> Popularity:
    t = text.strip().lower()
    if t == "uniform":
        return Popularity("uniform")
    if t.startswith("zipf:"):
        try:
            s = float(t[5:])
        except ValueError:
            raise ValueError(f"bad popularity {text!r}: the Zipf exponent must be a number, as in zipf:1.0") from None
        if not math.isfinite(s) or s < 0 or s > 8:
            raise ValueError(f"bad popularity {text!r}: the Zipf exponent must be between 0 and 8")
        return Popularity("zipf", s)
    raise ValueError(f"bad popularity {text!r}: expected 'uniform' or 'zipf:S' (S a number, e.g. zipf:1.0)")


@dataclass
class SynthSummary:
    path: Path                        # the file, or its first shard
    bytes_written: int                # over all shards
    n_params: int
    geometry: object                  # the SynthGeometry or NextSynthGeometry written
    quant: str
    popularity: Popularity
    tensor_types: dict[str, str]      # tensor kind (name without blk.N.) -> its type in layer 0
    expert_rank: np.ndarray = field(repr=False)  # [n_layer, n_expert]: expert ids, hottest first
    types: dict[str, str] = field(default_factory=dict, repr=False)  # every tensor -> its type
    shards: list[Path] = field(default_factory=list)                 # the files written, in order


# ---------------------------------------------------------------- tensors, chunk by chunk

def stream(seed: int, *key: int) -> np.random.SFC64:
    """An independent random stream per (seed, tensor); SFC64.random_raw is ~4 GB/s."""
    return np.random.SFC64(np.random.SeedSequence(seed, spawn_key=key))


@dataclass
class Tensor:
    """A tensor to write: its type is set once the file type's plan is known (`assign_types`);
    `chunks(type)` generates its bytes."""
    name: str
    shape: tuple[int, ...]             # numpy order (GGUF ne reversed)
    ggml_type: T
    chunks: Callable[[T], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block * size

    def data(self) -> Iterator[np.ndarray]:
        return self.chunks(self.ggml_type)


Fix = Callable[[T, int, np.ndarray], None]   # (type, first row, rows): edits a chunk before writing


def matrix(name: str, n_rows: int, n_cols: int, bits: Callable[[], np.random.SFC64],
           fix: Fix | None = None, std: float = WEIGHT_STD) -> Tensor:
    """A 2-D random weight matrix, of the type the plan gives it."""
    def chunks(t: T) -> Iterator[np.ndarray]:
        src = bits()
        block, size = gguf.GGML_QUANT_SIZES[t]
        step = max(1, CHUNK_BYTES // (n_cols // block * size))
        for r0 in range(0, n_rows, step):
            rows = random_rows(t, src, min(step, n_rows - r0), n_cols, std)
            if fix is not None:
                fix(t, r0, rows)
            yield rows
    return Tensor(name, (n_rows, n_cols), T.F16, chunks)


def experts(name: str, g, n_out: int, n_in: int, bits: Callable[[], np.random.SFC64],
            reserved: int, writes: bool) -> Tensor:
    """[n_expert, n_out, n_in]. The reserved slice [0, reserved) of the hidden state: ffn_down
    (`writes`) gets those rows of every expert zeroed, ffn_gate/ffn_up those columns."""
    def fix(t: T, r0: int, rows: np.ndarray) -> None:
        if writes:
            out = (r0 + np.arange(len(rows))) % n_out   # row index inside its expert
            rows[out < reserved] = 0
        else:
            zero_first_columns(t, rows, reserved)
    m = matrix(name, g.n_expert * n_out, n_in, bits, fix)
    m.shape = (g.n_expert, n_out, n_in)
    return m


def const(name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> Tensor:
    """A small F32 tensor (never quantized), built only when written (routers of 94 layers would
    be 200 MB)."""
    return Tensor(name, shape, T.F32, lambda t: iter([np.ascontiguousarray(make(), dtype=np.float32)]))


def zero_reserved_rows(reserved: int) -> Fix:
    """Rows [0, reserved) of the matrix are zero: it does not write the routers' slice."""
    def fix(t: T, r0: int, rows: np.ndarray) -> None:
        rows[: max(0, reserved - r0)] = 0
    return fix


def zero_reserved_cols(reserved: int) -> Fix:
    """Columns [0, reserved) are zero: the matrix does not read the routers' slice."""
    return lambda t, r0, rows: zero_first_columns(t, rows, reserved)


def set_embedding_channel(t: T, r0: int, rows: np.ndarray) -> None:
    set_channel(t, rows, EMBD_STD, CHANNEL_VALUE)


def model_info(g) -> ModelInfo:
    return ModelInfo(n_layer=g.n_layer, n_expert=g.n_expert, n_gqa=g.n_head // g.n_head_kv)


def one_type(g, quant: str, name: str, shape: tuple[int, ...]) -> T:
    """The plan's type of one tensor whose rule reads no other tensor (experts, token_embd)."""
    others = [("output.weight", (1, 1), T.F32)]           # present: the embedding is not tied
    return tensor_types(quant, [(name, shape, T.F16), *others], model_info(g))[name]


def assign_types(g, quant: str, tensors: list[Tensor]) -> None:
    """Give every tensor its type under file type `quant` (strata_dist/synth/ftypes.py)."""
    types = tensor_types(quant, [(t.name, t.shape, t.ggml_type) for t in tensors], model_info(g))
    for t in tensors:
        t.ggml_type = types[t.name]


def embedding_channel(g, quant: str) -> float:
    """A: the value coordinate 0 of every token embedding holds in the file."""
    t = one_type(g, quant, "token_embd.weight", (g.n_vocab, g.n_embd))
    return channel_value(t, EMBD_STD, CHANNEL_VALUE)


# ---------------------------------------------------------------- popularity

def inclusion_targets(p: np.ndarray, k: int) -> np.ndarray:
    """Per-token top-k inclusion probability per rank: k * p, water-filled under PI_CAP."""
    pi = k * p
    for _ in range(len(p)):
        over = pi > PI_CAP
        free = pi < PI_CAP
        if not over.any() or not free.any():
            break
        pi = np.where(over, PI_CAP, pi)
        pi[free] *= (k - pi[~free].sum()) / pi[free].sum()
    return np.minimum(pi, PI_CAP)


def phi(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26 for erf, |error| < 1e-7; numpy has no erf)."""
    a = np.abs(x) / math.sqrt(2)
    t = 1 / (1 + 0.3275911 * a)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    return 0.5 * (1 + np.sign(x) * (1 - poly * np.exp(-a * a)))


def probit(p: np.ndarray) -> np.ndarray:
    lo, hi = np.full_like(p, -12.0), np.full_like(p, 12.0)
    for _ in range(50):                                  # bisection: robust in the tails
        mid = 0.5 * (lo + hi)
        below = phi(mid) < p
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


_Z = np.linspace(-8, 8, 64)                               # quadrature over one expert's noise
_ZW = np.exp(-_Z ** 2 / 2) / np.exp(-_Z ** 2 / 2).sum()


def top_k_inclusion(mu: np.ndarray, k: int) -> np.ndarray:
    """P(expert e is in the top k) for logits mu + N(0, 1) i.i.d.: for each value of e's own logit,
    the number of other experts above it is Poisson-binomial (a DP over experts) and must be < k."""
    n = len(mu)
    beats = phi(mu[None, None, :] - (mu[:, None] + _Z[None, :])[:, :, None])  # [e, z, j]
    beats[np.arange(n), :, np.arange(n)] = 0
    count = np.zeros((n, len(_Z), k))                    # P(#others above = c), c < k
    count[..., 0] = 1
    for j in range(n):
        moved = count * beats[:, :, j, None]
        count -= moved
        count[..., 1:] += moved[..., :-1]
    return (count.sum(-1) * _ZW).sum(-1)


@lru_cache(maxsize=16)
def calibrate_logit_means(pop: Popularity, n_expert: int, k: int) -> np.ndarray:
    """Router logit means per popularity rank (hottest first, in units of the logit noise std) such
    that top-k routing over logits mu + N(0, 1) includes rank r with the target frequency."""
    mu = np.zeros(n_expert)
    if pop.kind == "zipf" and pop.s > 0 and k < n_expert:
        target = inclusion_targets(pop.shares(n_expert), k)
        goal = probit(target)
        mu = goal - goal.mean()
        for _ in range(30):                              # Newton-like in probit space: 2-3 steps
            got = top_k_inclusion(mu, k)
            if np.abs(got - target).max() < 1e-4:
                break
            mu += 0.9 * (goal - probit(np.clip(got, 1e-12, 1 - 1e-12)))
            mu -= mu.mean()
    mu.flags.writeable = False                           # cached: shared between calls
    return mu


def router(g, bits: np.random.SFC64, mu_by_rank: np.ndarray, rank_order: np.ndarray,
           reserved: int, channel: float) -> np.ndarray:
    """[n_expert, n_embd] F32 router reading only the reserved slice: column 0 times the channel A
    gives the mean mu, orthonormal rows on [1, reserved) the token noise. In units of the layer-0
    RMSNorm input scale (rms_h), so logits at layer 0 are mu + N(0, 1) * ROUTER_NOISE."""
    rms_h = embedding_rms(g.n_embd, channel)
    q, _ = np.linalg.qr(np.random.Generator(bits).standard_normal((reserved - 1, g.n_expert)))
    w = np.zeros((g.n_expert, g.n_embd), np.float32)
    w[:, 1:reserved] = q.T * (ROUTER_NOISE * rms_h / EMBD_STD)
    mu = np.empty(g.n_expert)
    mu[rank_order] = mu_by_rank                          # expert rank_order[r] has rank r
    w[:, 0] = mu * ROUTER_NOISE * rms_h / channel
    return w


# ---------------------------------------------------------------- the file

def attn_out_std(g) -> float:
    """std of attn_output. Every position adds W_o W_v (mean of the normalised states it attends),
    so a part common to all positions is multiplied by |W_o W_v| ~ std_o * std_v * sqrt(n_embd * n_q)
    per layer: above 1 it runs away over depth (a random 30B would reach ~2.6 with WEIGHT_STD)."""
    gain = WEIGHT_STD * math.sqrt(g.n_embd * g.n_head * g.head_dim)
    return min(WEIGHT_STD, ATTN_GAIN / gain)


def embedding_rms(n_embd: int, channel: float = CHANNEL_VALUE) -> float:
    return math.sqrt((channel ** 2 + (n_embd - 1) * EMBD_STD ** 2) / n_embd)


def reserved_width(g, quant: str = "q8_0") -> int:
    """R: the hidden state's slice [0, R) that only routers read (the channel and the router noise);
    whole blocks of 32 where the experts' gate is quantized (zeroed columns are whole sub-blocks),
    of 256 where it is an i-quant that can only zero whole blocks (blocks.column_granule)."""
    gates = [one_type(g, quant, "blk.0.ffn_gate_exps.weight", (g.n_expert, g.n_ff_exp, g.n_embd))]
    if hasattr(g, "n_ff_shexp"):
        gates.append(one_type(g, quant, "blk.0.ffn_gate_shexp.weight", (g.n_ff_shexp, g.n_embd)))
    gran = max(1 if t in (T.F32, T.F16, T.BF16) else max(32, column_granule(t)) for t in gates)
    r = -(-(1 + g.n_expert) // gran) * gran
    if r > g.n_embd // 2:
        raise ValueError(f"{g.name}: n_embd {g.n_embd} is too narrow for {g.n_expert} experts "
                         f"(the router's reserved slice needs {r} of at most n_embd/2)")
    return r


def summary(paths: list[Path], size: int, g, quant: str, pop: Popularity, tensors: list[Tensor],
            ranks: np.ndarray) -> SynthSummary:
    types: dict[str, str] = {}
    for t in tensors:
        types.setdefault(t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name, t.ggml_type.name)
    return SynthSummary(path=paths[0], bytes_written=size, n_params=sum(math.prod(t.shape) for t in tensors),
                        geometry=g, quant=quant, popularity=pop, tensor_types=types, expert_rank=ranks,
                        types={t.name: t.ggml_type.name for t in tensors}, shards=paths)


def write_file(path: Path, arch: str, g, quant: str, pop: Popularity, seed: int, ranks: np.ndarray,
               metadata: Callable[[gguf.GGUFWriter], None], tensors: list[Tensor],
               progress: Callable[[int, int], None] | None, split_max_size: int = 0) -> list[Path]:
    """Stream `tensors` into a GGUF of `arch` at `path` (or its shards, at most `split_max_size`
    bytes of tensor data each) with the architecture's `metadata`, the tokenizer and the
    strata.synth.* keys; returns the files written."""
    def all_metadata(w: gguf.GGUFWriter) -> None:
        w.add_name(f"strata synthetic {g.name}")
        metadata(w)
        w.add_file_type(int(FILE_TYPES[quant].file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(w, g.n_vocab)
        w.add_string("strata.synth.popularity", str(pop))
        w.add_string("strata.synth.quant", quant)   # the --quant asked: q4_k and q4_k_m share a file type
        w.add_uint32("strata.synth.seed", seed)
        w.add_array("strata.synth.expert_rank", [int(x) for x in ranks.ravel()])
    return write_gguf(path, arch, all_metadata, tensors, progress, split_max_size, f"{g.name} {quant}")
