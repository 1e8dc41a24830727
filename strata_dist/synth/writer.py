"""The shared writer of the synthetic files (the package docstring tells the whole story): tensor
streams generated chunk by chunk, the routing law's calibration, and the GGUF layout."""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np

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
_INT8_STD = math.sqrt((256 ** 2 - 1) / 12)  # std of a uniform random int8


QUANTS: dict[str, tuple[T, gguf.LlamaFileType]] = {
    "f32": (T.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_k": (T.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}


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
    path: Path
    bytes_written: int
    n_params: int
    geometry: object                  # the SynthGeometry or NextSynthGeometry written
    quant: str
    popularity: Popularity
    tensor_types: dict[str, str]      # tensor kind (name without blk.N.) -> GGML type name
    expert_rank: np.ndarray = field(repr=False)  # [n_layer, n_expert]: expert ids, hottest first


# ---------------------------------------------------------------- random data, chunk by chunk

def stream(seed: int, *key: int) -> np.random.SFC64:
    """An independent random stream per (seed, tensor); SFC64.random_raw is ~4 GB/s."""
    return np.random.SFC64(np.random.SeedSequence(seed, spawn_key=key))


def _raw(bits: np.random.SFC64, n: int) -> np.ndarray:
    return bits.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _uniform(bits: np.random.SFC64, shape: tuple[int, ...], std: float, dtype: type) -> np.ndarray:
    """Values on 256 levels symmetric about 0 with the given std, one random byte each through a
    lookup table: one pass, several times faster than normals or int8 -> float arithmetic."""
    levels = ((np.arange(256) - 127.5) * (std / _INT8_STD)).astype(dtype)
    raw = _raw(bits, math.prod(shape))
    out = np.empty(raw.size, dtype)
    for i in range(0, raw.size, 1 << 20):               # take() widens indices to int64: slice it
        np.take(levels, raw[i:i + (1 << 20)], out=out[i:i + (1 << 20)])
    return out.reshape(shape)


def _scale_table(mean: float) -> np.ndarray:
    """256 f16 scales spread ±25% around `mean`, as uint16 bit patterns, picked by a random byte."""
    return (mean * np.linspace(0.75, 1.25, 256)).astype(np.float16).view(np.uint16)


# Q8_0 block: f16 d, 32 int8 quants; w = d * q. Uniform int8 quants have std _INT8_STD.
_Q8_D = _scale_table(WEIGHT_STD / _INT8_STD)
# Q4_K super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks, 128 bytes of
# 4-bit quants; w = d*sc*q - dmin*m. We store m = sc and dmin = 7.5*d so w = d*sc*(q - 7.5) has zero
# mean; scales in 32..63 (rms 48.4) and uniform 4-bit q (std 4.61) give std = d * 223.
_Q4K_D = _scale_table(WEIGHT_STD / (48.4 * 4.61))
_Q4K_DMIN = (_Q4K_D.view(np.float16).astype(np.float32) * 7.5).astype(np.float16).view(np.uint16)


def _blocks_q8_0(bits: np.random.SFC64, n_blocks: int) -> np.ndarray:
    b = _raw(bits, n_blocks * 34).reshape(n_blocks, 34)
    b[:, 0:2] = _Q8_D[b[:, 0]].view(np.uint8).reshape(n_blocks, 2)
    return b


def _blocks_q4_k(bits: np.random.SFC64, n_blocks: int) -> np.ndarray:
    b = _raw(bits, n_blocks * 144).reshape(n_blocks, 144)
    pick = b[:, 0].copy()
    b[:, 0:2] = _Q4K_D[pick].view(np.uint8).reshape(n_blocks, 2)
    b[:, 2:4] = _Q4K_DMIN[pick].view(np.uint8).reshape(n_blocks, 2)
    # scales[0:4] low 6 bits = scale j<4, top 2 bits = high bits of scale j+4; 0xA0 puts every scale
    # in 32..63. scales[4:8] the same for the mins; scales[8:12] nibbles = low bits of scale/min j+4.
    b[:, 4:8] |= 0xA0
    b[:, 8:12] = b[:, 4:8]
    b[:, 12:16] = (b[:, 12:16] & 0x0F) * 17
    return b


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]             # numpy order (GGUF ne reversed)
    ggml_type: T
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block * size


def random_rows(t: T, bits: np.random.SFC64, n_rows: int, n_cols: int, std: float = WEIGHT_STD) -> np.ndarray:
    """n_rows rows of n_cols random weights: float16/32 values, or block bytes [n_rows, row_bytes]."""
    if t in (T.F32, T.F16):
        return _uniform(bits, (n_rows, n_cols), std, np.float32 if t == T.F32 else np.float16)
    block = gguf.GGML_QUANT_SIZES[t][0]
    make = _blocks_q8_0 if t == T.Q8_0 else _blocks_q4_k
    return make(bits, n_rows * n_cols // block).reshape(n_rows, -1)


def zero_first_columns(t: T, rows: np.ndarray, n: int) -> None:
    """Make the first n weights of every row exactly zero (n a multiple of 32 for quant types)."""
    if t in (T.F32, T.F16):
        rows[:, :n] = 0
    elif t == T.Q8_0:
        rows[:, :n // 32 * 34] = 0                       # d = 0 and q = 0: whole blocks
    else:
        whole = n // 256                                 # Q4_K: whole super-blocks (d = dmin = 0) ...
        rows[:, :whole * 144] = 0
        sc = rows[:, whole * 144 + 4: whole * 144 + 16]  # ... then sub-blocks: scale = min = 0
        for j in range(n % 256 // 32):
            if j < 4:
                sc[:, j] &= 0xC0                         # keep the top bits: they belong to j + 4
                sc[:, j + 4] &= 0xC0
            else:
                sc[:, j + 4] = 0
                sc[:, j - 4] &= 0x3F
                sc[:, j] &= 0x3F


def matrix(name: str, t: T, n_rows: int, n_cols: int, bits: Callable[[], np.random.SFC64],
            fix: Callable[[int, np.ndarray], None] | None = None, std: float = WEIGHT_STD) -> Tensor:
    """A 2-D random weight matrix; `fix(first_row, rows)` edits each chunk before it is written."""
    def chunks() -> Iterator[np.ndarray]:
        src = bits()
        block, size = gguf.GGML_QUANT_SIZES[t]
        step = max(1, CHUNK_BYTES // (n_cols // block * size))
        for r0 in range(0, n_rows, step):
            rows = random_rows(t, src, min(step, n_rows - r0), n_cols, std)
            if fix is not None:
                fix(r0, rows)
            yield rows
    return Tensor(name, (n_rows, n_cols), t, chunks)


def experts(name: str, t: T, g, n_out: int, n_in: int, bits: Callable[[], np.random.SFC64],
             reserved: int, writes: bool) -> Tensor:
    """[n_expert, n_out, n_in]. The reserved slice [0, reserved) of the hidden state: ffn_down
    (`writes`) gets those rows of every expert zeroed, ffn_gate/ffn_up those columns."""
    def fix(r0: int, rows: np.ndarray) -> None:
        if writes:
            out = (r0 + np.arange(len(rows))) % n_out   # row index inside its expert
            rows[out < reserved] = 0
        else:
            zero_first_columns(t, rows, reserved)
    m = matrix(name, t, g.n_expert * n_out, n_in, bits, fix)
    m.shape = (g.n_expert, n_out, n_in)
    return m


def const(name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> Tensor:
    """A small F32 tensor, built only when written (routers of 94 layers would be 200 MB)."""
    return Tensor(name, shape, T.F32, lambda: iter([np.ascontiguousarray(make(), dtype=np.float32)]))


def expert_type(quant: T, n_in: int) -> T:
    """The requested expert type, or the first fallback whose blocks tile a row of n_in values."""
    return next(t for t in (quant, T.Q8_0, T.F16) if n_in % gguf.GGML_QUANT_SIZES[t][0] == 0)


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
            reserved: int) -> np.ndarray:
    """[n_expert, n_embd] F32 router reading only the reserved slice: column 0 times CHANNEL_VALUE
    gives the mean mu, orthonormal rows on [1, reserved) the token noise. In units of the layer-0
    RMSNorm input scale (rms_h), so logits at layer 0 are mu + N(0, 1) * ROUTER_NOISE."""
    rms_h = embedding_rms(g.n_embd)
    q, _ = np.linalg.qr(np.random.Generator(bits).standard_normal((reserved - 1, g.n_expert)))
    w = np.zeros((g.n_expert, g.n_embd), np.float32)
    w[:, 1:reserved] = q.T * (ROUTER_NOISE * rms_h / EMBD_STD)
    mu = np.empty(g.n_expert)
    mu[rank_order] = mu_by_rank                          # expert rank_order[r] has rank r
    w[:, 0] = mu * ROUTER_NOISE * rms_h / CHANNEL_VALUE
    return w


# ---------------------------------------------------------------- the file

def attn_out_std(g) -> float:
    """std of attn_output. Every position adds W_o W_v (mean of the normalised states it attends),
    so a part common to all positions is multiplied by |W_o W_v| ~ std_o * std_v * sqrt(n_embd * n_q)
    per layer: above 1 it runs away over depth (a random 30B would reach ~2.6 with WEIGHT_STD)."""
    gain = WEIGHT_STD * math.sqrt(g.n_embd * g.n_head * g.head_dim)
    return min(WEIGHT_STD, ATTN_GAIN / gain)


def embedding_rms(n_embd: int) -> float:
    return math.sqrt((CHANNEL_VALUE ** 2 + (n_embd - 1) * EMBD_STD ** 2) / n_embd)


def reserved_width(g, quant: str = "q8_0") -> int:
    """R: the hidden state's slice [0, R) that only routers read (the channel and the router noise)."""
    gran = 1 if expert_type(QUANTS[quant][0], g.n_embd) in (T.F32, T.F16) else 32  # whole blocks
    r = -(-(1 + g.n_expert) // gran) * gran
    if r > g.n_embd // 2:
        raise ValueError(f"{g.name}: n_embd {g.n_embd} is too narrow for {g.n_expert} experts "
                         f"(the router's reserved slice needs {r} of at most n_embd/2)")
    return r


def summary(path: Path, size: int, g, quant: str, pop: Popularity, tensors: list[Tensor],
             ranks: np.ndarray) -> SynthSummary:
    types: dict[str, str] = {}
    for t in tensors:
        types.setdefault(t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name, t.ggml_type.name)
    return SynthSummary(path=path, bytes_written=size, n_params=sum(math.prod(t.shape) for t in tensors),
                        geometry=g, quant=quant, popularity=pop, tensor_types=types, expert_rank=ranks)


def write_file(path: Path, arch: str, g, quant: str, pop: Popularity, seed: int, ranks: np.ndarray,
                metadata: Callable[[gguf.GGUFWriter], None], tensors: list[Tensor],
                progress: Callable[[int, int], None] | None) -> int:
    """Stream `tensors` into a GGUF of `arch` at `path` (via path.part, renamed once complete) with
    the architecture's `metadata`, the tokenizer and the strata.synth.* keys; returns its size."""
    need, free = sum(t.nbytes for t in tensors), shutil.disk_usage(path.parent).free
    if need > free:  # refuse at the start rather than fail an hour in
        mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
        raise ValueError(f"{g.name} {quant} needs {mib(need)}, {path.parent} has {mib(free)} free")

    part = path.with_name(path.name + ".part")           # renamed into place once complete
    w = gguf.GGUFWriter(part, arch)
    w.add_name(f"strata synthetic {g.name}")
    metadata(w)
    w.add_file_type(int(QUANTS[quant][1]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(w, g.n_vocab)
    w.add_string("strata.synth.popularity", str(pop))
    w.add_uint32("strata.synth.seed", seed)
    w.add_array("strata.synth.expert_rank", [int(x) for x in ranks.ravel()])
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)

    align = w.data_alignment
    ok = False
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # Data, as GGUFWriter.write_tensor_data lays it out (each tensor aligned, then padded),
        # but in chunks: that method wants the whole tensor in memory.
        assert w.fout is not None and len(w.fout) == 1
        f = w.fout[0]
        pad = gguf.GGUFWriter.ggml_pad
        data_start = pad(f.tell(), align)
        total = data_start + sum(pad(t.nbytes, align) for t in tensors)
        f.write(bytes(data_start - f.tell()))
        if progress is not None:
            progress(data_start, total)
        for t in tensors:
            written = 0
            for chunk in t.chunks():
                chunk.tofile(f)
                written += chunk.nbytes
                if progress is not None:
                    progress(f.tell(), total)
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: generated {written} bytes, expected {t.nbytes}")
            f.write(bytes(pad(written, align) - written))
        f.flush()
        size = f.tell()
        if size != total:
            raise AssertionError(f"{path}: wrote {size} bytes, expected {total}")
        ok = True
    finally:
        w.close()
        if not ok:
            part.unlink(missing_ok=True)
    os.replace(part, path)
    return size
