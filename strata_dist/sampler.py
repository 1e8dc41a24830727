"""Token sampling on the host: greedy, temperature, top-k, top-p, min-p, with a seed; the
penalties and logit bias that reshape a row before it is sampled; and the log-probabilities a
request may ask for (`token_logprobs`, `prompt_logprobs`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


MAX_TOP_K = 2 ** 31 - 1       # the most a request may ask for (the wire carries an int32)
MAX_TOP_LOGPROBS = 20         # the most alternatives per token a request may ask for
MAX_LOGIT_BIAS = 100.0        # |bias| per token, as the OpenAI API bounds it
MAX_PENALTY = 2.0             # |presence_penalty|, |frequency_penalty|


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
    # Penalties and bias, applied to the row in this order before it is sampled (Sampler.adjust):
    # repetition (prompt and generated tokens: a positive logit is divided by it, a negative one
    # multiplied), frequency (times each generated token's count) and presence (once per
    # generated token) subtracted, then the bias added.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias {token}: {bias} is not a token id with a bias in "
                                 f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def reshapes_logits(self) -> bool:
        """Whether a penalty or bias changes the row before sampling (then a device's own
        greedy token is not the answer)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


class Sampler:
    """Stateful in its random generator, so a seeded request is reproducible, and in the tokens it
    has drawn (the penalties count them). `prompt_ids`: the tokens the repetition penalty counts
    besides the drawn ones."""

    def __init__(self, params: SamplingParams = SamplingParams(), prompt_ids=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.drawn_counts: dict[int, int] = {}
        self.seen: set[int] = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 \
            else set()

    def __call__(self, logits) -> int:
        """A token from one row of logits: a host array, or a device step's logits that carry
        their greedy token already (`greedy_token`; the row is copied only when sampling or
        when a penalty or bias reshapes it)."""
        tok = self._draw(logits)
        self.record(tok)
        return tok

    def record(self, tok: int) -> None:
        """`tok` is drawn: the penalties count it from now on."""
        self.drawn_counts[tok] = self.drawn_counts.get(tok, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self.seen.add(tok)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """The row the sampler draws from: `logits` (float64, a copy) with the penalties and bias."""
        p = self.params
        out = np.array(logits, dtype=np.float64).reshape(-1)
        if p.repetition_penalty != 1.0 and self.seen:
            ids = np.fromiter(self.seen, dtype=np.int64)
            ids = ids[ids < out.size]
            v = out[ids]
            out[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.drawn_counts:
            ids = np.fromiter(self.drawn_counts.keys(), dtype=np.int64)
            counts = np.fromiter(self.drawn_counts.values(), dtype=np.float64)
            keep = ids < out.size
            out[ids[keep]] -= p.frequency_penalty * counts[keep] + p.presence_penalty
        for token, bias in p.logit_bias:
            if token < out.size:
                out[token] += bias
        return out

    def _draw(self, logits) -> int:
        p = self.params
        if p.greedy and not p.reshapes_logits and getattr(logits, "greedy_token", None) is not None:
            return int(logits.greedy_token)
        logits = self.adjust(logits) if p.reshapes_logits else \
            np.asarray(logits, dtype=np.float64).reshape(-1)
        if p.greedy:
            return int(np.argmax(logits))
        order, probs = self._kept(logits)
        return int(order[self.rng.choice(len(order), p=probs)])

    def distribution(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """What a sampled (temperature > 0) draw picks from: the token ids it can draw and their
        probabilities (summing to 1), after the penalties and bias, temperature, top-k, top-p and
        min-p. A speculative window's rejection sampling reads it (strata_dist/speculative.py)."""
        p = self.params
        row = self.adjust(logits) if p.reshapes_logits else \
            np.asarray(logits, dtype=np.float64).reshape(-1)
        return self._kept(row)

    def _kept(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
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
        return order[:keep], probs[:keep] / probs[:keep].sum()


def masked_row(logits, allowed: np.ndarray) -> np.ndarray:
    """A host copy of one row of logits in which the tokens not `allowed` (a bool per token) can
    never be drawn: greedy or sampled, the draw then picks among the allowed only."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    return np.where(allowed, row, -np.inf)


# ---- log-probabilities ---------------------------------------------------------------------------------
# Of the model's own distribution: the log-softmax of the raw logits, before temperature, penalties
# and bias (what the sampler then draws from is another distribution; these say what the model
# thinks of the text).

@dataclass
class TokenLogprob:
    """One position's token and its log-probability, and the `top` most likely tokens there."""
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def log_softmax(rows) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(rows, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _top(lp: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    if n <= 0:
        return [], []
    part = np.argpartition(-lp, min(n, lp.size) - 1)[:n]
    order = part[np.lexsort((part, -lp[part]))]    # most likely first; ties by token id
    return [int(i) for i in order], [float(lp[i]) for i in order]


def token_logprobs(logits, token_id: int, top: int) -> TokenLogprob:
    """`token_id`'s log-probability under one row of logits, and the `top` most likely tokens."""
    lp = log_softmax(np.asarray(logits, dtype=np.float64).reshape(-1))
    ids, lps = _top(lp, top)
    return TokenLogprob(int(token_id), float(lp[token_id]), ids, lps)


def prompt_logprobs(rows, next_ids, top: int) -> list[TokenLogprob]:
    """Per row of logits [n, vocab], the log-probability of the token that follows it
    (`next_ids`, one per row), and the `top` most likely tokens there."""
    lp = log_softmax(rows)
    return [TokenLogprob(int(t), float(lp[r, t]), *_top(lp[r], top))
            for r, t in enumerate(next_ids)]
