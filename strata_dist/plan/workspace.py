"""A prompt chunk's device buffers as one fixed layout: the function that prices a loan (or a
stage's own prompt buffers) is the one that carves them, so what is priced is what is loaded.

Each architecture lists the buffers its GPU prompt path writes (`prompt_buffers` in its module:
a name, bytes per token of the chunk, fixed bytes, and a phase). Buffers of the `residual` phase
live through the whole chunk; the other phases (a layer's attention, a linear-attention layer's
mixer, its MoE) are never live at once, so they share the room after the residual:

    | residual ... | attention buffers ...        |
                   | experts buffers ...     |

The layout of a chunk of n tokens is `residual + max(phases)`, every buffer rounded up to ALIGN
bytes. Pure arithmetic: the planner, the stage that carves it, and the tests that check
the GPU path against it all call `carve`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

ALIGN = 512          # CuPy's own pool rounds to 512 bytes: every kernel's alignment holds
PHASES = ("residual", "attention", "linear", "experts")
STREAMED = "stream"  # the buffer a prompt's misses stream through (tiers.py `_prompt_on_device`)
STREAM_BLOBS = 32    # ... of at least this many blobs,
STREAM_TOKENS_PER_BLOB = 32   # and one more per this many tokens of the chunk (models/common.py)


@dataclass(frozen=True)
class Buffer:
    name: str
    phase: str
    per_token: int          # bytes per token of the chunk
    fixed: int = 0          # bytes whatever the chunk
    most: int = 0           # at most this many bytes (0: no cap)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"buffer {self.name}: phase {self.phase!r} is not one of {PHASES}")
        if self.per_token < 0 or self.fixed < 0 or self.most < 0:
            raise ValueError(f"buffer {self.name}: negative size {self.per_token}/token + "
                             f"{self.fixed}, at most {self.most}")

    def nbytes(self, prompt_chunk: int) -> int:
        size = self.per_token * prompt_chunk + self.fixed
        if self.most:
            size = min(size, self.most)
        return -(-size // ALIGN) * ALIGN


@dataclass(frozen=True)
class PromptLayout:
    buffers: tuple[Buffer, ...]

    def __post_init__(self):
        names = [b.name for b in self.buffers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"prompt buffers named twice: {', '.join(dup)}")

    @classmethod
    def of(cls, buffers: Iterable[Buffer]) -> "PromptLayout":
        return cls(tuple(buffers))

    def without(self, *names: str) -> "PromptLayout":
        """The layout less the buffers `names` (a stage that never streams has no STREAMED)."""
        return PromptLayout(tuple(b for b in self.buffers if b.name not in names))

    def carve(self, prompt_chunk: int) -> dict[str, tuple[int, int]]:
        """name -> (offset, nbytes) of every buffer for a chunk of prompt_chunk tokens."""
        if prompt_chunk < 0:
            raise ValueError(f"a chunk of {prompt_chunk} tokens")
        out, at = {}, 0
        for b in self.buffers:
            if b.phase == "residual":
                out[b.name] = (at, b.nbytes(prompt_chunk))
                at += b.nbytes(prompt_chunk)
        for phase in PHASES[1:]:
            p = at
            for b in self.buffers:
                if b.phase == phase:
                    out[b.name] = (p, b.nbytes(prompt_chunk))
                    p += b.nbytes(prompt_chunk)
        return out

    def nbytes(self, prompt_chunk: int) -> int:
        """The layout's whole size for a chunk of prompt_chunk tokens."""
        return max((o + n for o, n in self.carve(prompt_chunk).values()), default=0)

    def per_token(self) -> int:
        """Bytes per token, for reports (nbytes(n) is the price; this is its slope, rounded up)."""
        return -(-(self.nbytes(4096) - self.nbytes(0)) // 4096)

    def to_list(self) -> list[list]:
        return [[b.name, b.phase, b.per_token, b.fixed, b.most] for b in self.buffers]

    @classmethod
    def from_list(cls, rows) -> "PromptLayout":
        return cls(tuple(Buffer(str(n), str(p), int(t), int(f), int(m)) for n, p, t, f, m in rows))
