"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a seed; the penalties and logit
bias that reshape a row before it is sampled; a grammar's mask; and the log-probabilities a request
may ask for (`token_logprobs`, `prompt_logprobs`). The request's state lives here (the seeded
generator on the host, the token counts); the arithmetic on the row is
strata_dist/ops/sample.py, run where the row is (numpy on the host, CuPy on a card)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..ops import sample as sample_ops


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
    # strata_dist/sampling/structured.py), drawn on the last stage through `masked_row`
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
    besides the drawn ones. A row is sampled where it is: a host row with numpy, a device row (a
    graph step's StepLogits, a CuPy array) on its device with the same functions
    (strata_dist/ops/sample.py), the generator staying on the host."""

    def __init__(self, params: SamplingParams = SamplingParams(), prompt_ids=()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.drawn_counts: dict[int, int] = {}
        self.seen: set[int] = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 \
            else set()
        # the same counts beside the rows (on their device), made at the first row reshaped
        self._counts: sample_ops.TokenCounts | None = None

    def __call__(self, logits) -> int:
        """A token from one row of logits: a host array, or a device step's logits that carry
        their greedy token already (`greedy_token`; the row is read on its device only when
        sampling or when a penalty or bias reshapes it)."""
        tok = self._draw(logits)
        self.record(tok)
        return tok

    def record(self, tok: int) -> None:
        """`tok` is drawn: the penalties count it from now on."""
        self.drawn_counts[tok] = self.drawn_counts.get(tok, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self.seen.add(tok)
        if self._counts is not None:
            self._counts.record(tok)

    def _counts_for(self, xp, n: int) -> sample_ops.TokenCounts:
        c = self._counts
        if c is None or c.xp is not xp or c.n != n:
            c = self._counts = sample_ops.TokenCounts(
                xp, n, self.seen, self.drawn_counts,
                track_seen=self.params.repetition_penalty != 1.0)
        return c

    def _row(self, logits):
        """(xp, the row the sampler draws from: with the penalties and bias when they apply)."""
        xp, row = sample_ops.row_of(logits)
        if self.params.reshapes_logits:
            row = sample_ops.adjust(xp, row, self.params, self._counts_for(xp, int(row.size)))
        return xp, row

    def adjust(self, logits):
        """The row the sampler draws from: `logits` (float64, a copy) with the penalties and bias,
        on the row's device."""
        with sample_ops.device_of(logits):
            xp, row = sample_ops.row_of(logits)
            return sample_ops.adjust(xp, row, self.params, self._counts_for(xp, int(row.size)))

    def _draw(self, logits) -> int:
        p = self.params
        if p.greedy and not p.reshapes_logits and getattr(logits, "greedy_token", None) is not None:
            return int(logits.greedy_token)
        with sample_ops.device_of(logits):
            xp, row = self._row(logits)
            return sample_ops.draw(xp, row, p, self.rng.random)

    def distribution(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """What a sampled (temperature > 0) draw picks from: the token ids it can draw and their
        probabilities (summing to 1), after the penalties and bias, temperature, top-k, top-p and
        min-p, as host arrays. A speculative window's rejection sampling reads it
        (strata_dist/sampling/speculative.py)."""
        with sample_ops.device_of(logits):
            xp, row = self._row(logits)
            ids, probs = sample_ops.kept(xp, row, self.params)
            return sample_ops.to_host(ids), sample_ops.to_host(probs)


def masked_row(logits, words: np.ndarray):
    """One row of logits (host or device: it stays where it is) in which the tokens the grammar's
    bitmask `words` (host uint32, a bit per token: GrammarMatcher.bitmask_words) does not allow can
    never be drawn: greedy or sampled, the draw then picks among the allowed only."""
    with sample_ops.device_of(logits):
        xp, row = sample_ops.row_of(logits)
        return sample_ops.masked(xp, row, words)


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
    """float64 log-softmax over the last axis (host rows)."""
    return sample_ops.log_softmax(np, rows)


def token_logprobs(logits, token_id: int, top: int) -> TokenLogprob:
    """`token_id`'s log-probability under one row of logits, and the `top` most likely tokens;
    a device row is reduced on its device and only those values come back."""
    with sample_ops.device_of(logits):
        xp, row = sample_ops.row_of(logits)
        ids, lps, value = sample_ops.top_of(xp, sample_ops.log_softmax(xp, row), top,
                                            also=token_id)
    return TokenLogprob(int(token_id), value, ids, lps)


def prompt_logprobs(rows, next_ids, top: int) -> list[TokenLogprob]:
    """Per row of logits [n, vocab], the log-probability of the token that follows it
    (`next_ids`, one per row), and the `top` most likely tokens there."""
    lp = log_softmax(rows)
    out = []
    for r, t in enumerate(next_ids):
        ids, lps, value = sample_ops.top_of(np, lp[r], top, also=int(t))
        out.append(TokenLogprob(int(t), value, ids, lps))
    return out


# ---- at load -------------------------------------------------------------------------------------

def warm_up(row) -> None:
    """Each kernel a request's sampling asks the row's array module for, run once on `row` (a
    device row of logits, float32 [vocab], which it does not change): CuPy compiles its array
    operations with NVRTC at their first use in a process (from its disk cache on a machine that
    compiled them before), and a GPU last stage samples every running stream's row in line, so a
    kernel compiled at the first sampled, penalised, structured or logprobs request would hold
    every stream for the compile. Run at load instead (rank/shell.py)."""
    everything = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=0,
                                repetition_penalty=1.1, frequency_penalty=0.1,
                                presence_penalty=0.1, logit_bias=((1, 1.0), (2, -1.0)))
    # Besides `everything`: top-p and min-p with no top-k before them, plain greedy, a token
    # biased twice, and below a sampled masked row (an H100 compiled two kernels for
    # tests/test_gpu_sample_ops.py's requests after a warm-up without these; which two was not
    # found out). Each runs on `row` and on a peaked copy (a ramp of 40 over the vocabulary), so
    # top-p and min-p keep a few tokens as well as most (the lengths CuPy's kernels run over).
    xp = sample_ops.array_module(row)
    peaked = row + xp.arange(int(row.size), dtype=row.dtype) * (40.0 / int(row.size))
    for params in (everything, SamplingParams(temperature=0.7, seed=0),
                   SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=0,
                                  repetition_penalty=0.9), SamplingParams(),
                   SamplingParams(logit_bias=((1, 1.0), (1, 1.0)))):
        for logits in (row, peaked):
            sampler = Sampler(params, prompt_ids=(1, 2))
            for _ in range(2):       # the second draw's penalties read the device's counts
                sampler(logits)
            if not params.greedy:    # what a speculative window's rejection sampling reads
                sampler.distribution(logits)
    words = np.full(-(-int(row.size) // sample_ops.BITS_PER_WORD), 0xFFFFFFFF, dtype=np.uint32)
    Sampler()(masked_row(row, words))
    Sampler(SamplingParams(temperature=0.7, seed=0))(masked_row(row, words))
    token_logprobs(row, 0, 5)
    token_logprobs(row, 0, 20)
