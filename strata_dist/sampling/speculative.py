"""Speculative decoding (`--spec K --draft ngram`): the drafter, the acceptance of a verify
window's rows, and a stage's roll-back of recurrent state inside a window.

The last stage drives it (strata_dist/rank/stage_step.py). After a token it drafts up to K more with
the n-gram drafter (a suffix of the conversation so far, prompt and generated tokens, matched
against its earlier occurrences; no extra weights) and sends the token and its drafts as ONE
decode step of K+1 rows: each stage runs them once (the many-row path prompt chunks take), and the
last stage gets the logits of every row. Row i's draw decides token i+1 of the window:
- greedy: the draw (the sampler's own, penalties, bias and grammar mask included, with the state
  the tokens before it left) is the token; a draft that equals it is accepted and the next row
  is read, else the window ends there with the drawn token. Every token emitted is the one a
  decode step without speculation draws at that place, so the tokens are identical where the
  rows' logits are (the numpy backend computes a window's rows as one-row steps do; a GPU
  stage's window takes the many-row path, its one-row steps the decode graph).
- sampled (temperature > 0): standard speculative rejection sampling. A draft x drawn from the
  drafter's distribution q is accepted with probability min(1, p(x) / q(x)), p the sampler's
  distribution of that row; on rejection the token is drawn from max(0, p - q) renormalised. A
  token y then comes with probability q(y) min(1, p/q)(y) + (1 - sum min(p, q)) (p - q)+(y) /
  sum (p - q)+ = min(p, q)(y) + (p - q)+(y) = p(y): the target's distribution, draw by draw.
  The n-gram draft (and a draft model's greedy draft) is a point mass q = [x]: accept with
  p(x), else draw from p with x removed and renormalised. A draft model
  (--draft-model, strata_dist/rank/draft_model.py) samples its drafts and hands q with them.
The window always yields at least one token (the row after the last accepted draft). What the
stages computed past the accepted rows is rolled back at the next step: attention KV is
positional (the next step's position overwrites it); a stage with recurrent state (qwen3next's
linear layers) keeps the state at the window's start and the window's input rows
(`WindowRecord`), and at the next step restores that state and runs the accepted rows again,
through the same path, so its state is what one-row steps would have left.

With --parallel B a batched step (protocol/batch.py) carries each request's window: the last stage
sends the drafts on the request's last Token of a step (`Token.drafts`), the head sends them back
with that token as the request's entry of its next step, and every stage runs each entry of
several rows as that session's verify window (strata_dist/rank/stage_step.py); the acceptance and the
roll-back are the one-session path's, per request.

Bounds: a window has at most DECODE_ROWS rows (the decode score scratch every session is priced
with), so K <= DECODE_ROWS - 1."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..models.shape import model_shape
from ..models import open_checked
from .mtp_draft import step_bytes as mtp_step_bytes
from ..plan.pricing import DECODE_ROWS
from ..plan.speculation import SpecPrediction, predict_spec

# --draft values (model: --draft-model FILE.gguf; mtp: the file's multi-token-prediction block,
# strata_dist/sampling/mtp_draft.py)
DRAFTERS = ("ngram", "model", "mtp")
MAX_SPEC = DECODE_ROWS - 1     # --spec K: a window of K+1 rows fits the decode scratch
MAX_NGRAM = 8                  # the longest suffix the n-gram drafter matches
MIN_NGRAM = 1                  # ... and the shortest (--spec-min-p prunes weak matches)


def check_spec(k: int, drafter: str, min_p: float, draft_model: str = "") -> None:
    """The flags' values, refused with the value and the bound named (ValueError)."""
    if not 0 <= k <= MAX_SPEC:
        raise ValueError(f"--spec {k}: K must be in [0, {MAX_SPEC}] (a verify window of K+1 "
                         f"rows fits the {DECODE_ROWS}-row decode step)")
    if drafter not in DRAFTERS:
        raise ValueError(f"--draft {drafter!r}: the drafters are {', '.join(DRAFTERS)}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"--spec-min-p {min_p}: P must be in [0, 1]")
    if drafter == "model" and not draft_model:
        raise ValueError("--draft model: name the draft model with --draft-model FILE.gguf")
    if draft_model and drafter != "model":
        raise ValueError(f"--draft {drafter} and --draft-model {draft_model}: a draft model is "
                         "the drafter 'model' (leave --draft out)")
    if drafter == "mtp" and k == 0:
        raise ValueError("--draft mtp with --spec 0: the MTP block drafts only with --spec K > 0")
    if draft_model and k == 0:
        raise ValueError(f"--draft-model {draft_model} with --spec 0: the draft model drafts "
                         "only with --spec K > 0")


@dataclass(frozen=True)
class SpecOptions:
    """--spec K, --draft, --spec-min-p, --draft-model as the head applies them to every request
    (K = 0: off). The last stage drafts with the draft model when it carries one."""
    k: int = 0
    drafter: str = "ngram"
    min_p: float = 0.0
    draft_model: str = ""

    def __post_init__(self):
        check_spec(self.k, self.drafter, self.min_p, self.draft_model)


def ngram_next(history: np.ndarray) -> tuple[int, float] | None:
    """The token most often following the longest suffix of `history` (MIN_NGRAM..MAX_NGRAM
    tokens) that occurred earlier, and its share of those occurrences (the drafter's
    probability); None when no such suffix occurred. Ties go to the token that followed the
    latest occurrence."""
    n_hist = len(history)
    for n in range(min(MAX_NGRAM, n_hist - 1), MIN_NGRAM - 1, -1):
        suffix = history[n_hist - n:]
        # starts i of earlier occurrences, i + n < n_hist: a token follows each
        starts = np.flatnonzero(history[:n_hist - n] == suffix[0])
        for j in range(1, n):
            starts = starts[history[starts + j] == suffix[j]]
        if starts.size:
            nexts = history[starts + n]
            ids, counts = np.unique(nexts, return_counts=True)
            best = set(ids[counts == counts.max()].tolist())
            tok = next(int(t) for t in nexts[::-1] if int(t) in best)
            return tok, float(counts.max()) / starts.size
    return None


def ngram_draft(history, k: int, min_p: float = 0.0) -> list[int]:
    """Up to k draft tokens after `history` (prompt and generated ids): each the n-gram drafter's
    next token of the history extended by the drafts before it. Drafting stops where no suffix
    matches or the drafter's probability falls below `min_p` (--spec-min-p)."""
    h = np.asarray(history, dtype=np.int64)
    out: list[int] = []
    while len(out) < k:
        got = ngram_next(h)
        if got is None or got[1] < min_p:
            break
        out.append(got[0])
        h = np.append(h, got[0])
    return out


def draw_against(sampler, row, draft: int | None, q=None) -> int:
    """Row i's token given the draft of row i+1 (None: the window's last row, or no draft): the
    sampler's own draw when greedy (the caller accepts the draft when they are equal); when
    sampled, the draft accepted with probability min(1, p/q), else a draw from the residual
    max(0, p - q) (module doc). `q`: (ids, probs) the draft was drawn from; None: a point mass."""
    if draft is None or sampler.params.greedy:
        return sampler(row)
    ids, probs = sampler.distribution(row)
    p_draft = float(probs[ids == draft].sum())
    if q is None:
        q_ids, q_probs = np.array([draft]), np.array([1.0])
    else:
        q_ids, q_probs = q
    q_draft = float(np.asarray(q_probs)[np.asarray(q_ids) == draft].sum())
    if sampler.rng.random() * q_draft < p_draft:     # u < p/q, written without a division
        tok = draft
    else:
        q_on_p = np.zeros(len(ids))
        where = {int(t): i for i, t in enumerate(ids)}
        for t, pr in zip(np.asarray(q_ids).tolist(), np.asarray(q_probs).tolist()):
            if int(t) in where:
                q_on_p[where[int(t)]] = pr
        rest = np.maximum(probs - q_on_p, 0.0)
        if rest.sum() <= 0.0:    # p <= q everywhere, so p == q: a rejection had probability 0
            rest = probs
        tok = int(ids[sampler.rng.choice(len(ids), p=rest / rest.sum())])
    sampler.record(tok)
    return tok


def plan_prediction(plan, shape, profile, options: SpecOptions,
                    kv_type: str | None = None, model: str = "") -> SpecPrediction:
    """--plan-only's prediction of decode tok/s with `options` (K > 0) on `plan` of the file
    `model`; a draft model, or the file's MTP block (--draft mtp), is priced as the last stage's
    device loads it (plan/speculation.py)."""
    draft, block = None, None
    kind = plan.stages[-1].device.kind
    if options.draft_model:
        draft = model_shape(open_checked(options.draft_model), kind, kv_type)
    elif options.drafter == "mtp":   # the model file's own block, on the same device
        block = mtp_step_bytes(model, kind, kv_type, plan.cells,
                               plan.params.kv_fill)
    return predict_spec(plan, shape, profile, options.k, options.drafter, draft,
                        block_bytes=block)


@dataclass
class SpecState:
    """The last stage's speculation for one request: K, --spec-min-p, the conversation so far
    (what the drafter matches), the drafts of the window in flight and the counts. `model`: a
    draft model's drafting (a callable history, k, min_p -> drafts and each one's q), else the
    n-gram drafter; `qs`: the distributions the window's drafts were drawn from (None: a point
    mass)."""
    k: int
    min_p: float
    history: list[int]
    drafts: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    windows: int = 0
    model: object = None
    last_pos: int = 0   # the position of the latest token drawn (no stage has run it yet)

    def draft(self, left: int) -> list[int]:
        """The drafts of the next window: at most K, and fewer than `left` tokens to go (the
        window's own token comes on top of them)."""
        k = min(self.k, left - 1)
        if self.model is not None:
            self.drafts, self.qs = self.model(self.history, k, self.min_p)
        else:
            self.drafts = ngram_draft(self.history, k, self.min_p)
            self.qs = [None] * len(self.drafts)
        self.drafted += len(self.drafts)
        self.windows += bool(self.drafts)
        return self.drafts


@dataclass
class WindowRecord:
    """A stage's copy of a verify window on a session with recurrent state: the state at its
    start (a SessionCheckpoint) and its input rows (ids on the first stage, else hidden rows)."""
    start: int
    n: int
    rows: object
    state: object

    def covers(self, pos: int, n_past: int) -> bool:
        """Whether a step at `pos` lands inside this window, as the session left it."""
        return n_past == self.start + self.n and self.start <= pos < self.start + self.n
