"""Token sampling on the host: greedy, temperature, top-k, top-p, min-p, with a seed."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


MAX_TOP_K = 2 ** 31 - 1       # the most a request may ask for (the wire carries an int32)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # <= 0 means greedy
    top_k: int = 0                # 0: off
    top_p: float = 1.0            # 1: off
    min_p: float = 0.0            # 0: off
    seed: int | None = None
    # structured output: the grammar the tokens must follow ("json_schema" or "lark" and its text;
    # strata_dist/structured.py), drawn on the last stage through `masked_row`
    grammar_kind: str = ""
    grammar: str = ""

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Stateful only in its random generator, so a seeded request is reproducible."""

    def __init__(self, params: SamplingParams = SamplingParams()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits) -> int:
        """A token from one row of logits: a host array, or a device step's logits that carry
        their greedy token already (`greedy_token`; the row is copied only when sampling)."""
        p = self.params
        if p.greedy and getattr(logits, "greedy_token", None) is not None:
            return int(logits.greedy_token)
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if p.greedy:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        z = logits[order] / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        keep = len(order)
        if p.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (always at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(keep, p=probs)])


def masked_row(logits, allowed: np.ndarray) -> np.ndarray:
    """A host copy of one row of logits in which the tokens not `allowed` (a bool per token) can
    never be drawn: greedy or sampled, the draw then picks among the allowed only."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    return np.where(allowed, row, -np.inf)
