"""The sample op: the decode graph's greedy token (`graph_argmax`: argmax_row over the last
row's logits, the last block picking the token on the device), and sampling's arithmetic.

Sampling's arithmetic on one row of logits, written once for numpy and CuPy (`xp`): the
penalties and logit bias, the grammar's allowed-token mask, the draw (greedy, or temperature,
top-k, top-p, min-p) and log-probabilities. A host row runs it with numpy; a GPU last stage runs
the same functions on the device's row, so only the drawn token id (and the few log-probabilities
a request asks for) crosses to the host, never the vocabulary-wide row (strata_dist/sampling/sampler.py
drives them; docs/ARCHITECTURE.md, "Structured output").

Every function keeps the host sampler's arithmetic step for step (float64, a stable sort, the
draw's cumulative sum searched for one uniform), so that with numpy a seeded request draws the
same tokens, bit for bit, as it always has. The random generator stays on the host: a draw takes
one uniform from it (`uniform()`), as the generator's own weighted choice would."""
from __future__ import annotations

import contextlib

import numpy as np

BITS_PER_WORD = 32     # the grammar's bitmask: token i is bit i % 32 of word i // 32


def array_module(row):
    """numpy for a host array, CuPy for a device array (one that offers CUDA's array interface)."""
    if hasattr(row, "__cuda_array_interface__"):
        import cupy
        return cupy
    return np


def to_host(a) -> np.ndarray:
    """A host copy of a (small) array, from either module."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def row_of(logits):
    """(xp, the row as float64 [vocab]) of one row of logits: a host array, a device array, or a
    graph step's StepLogits, whose row is read where it is (`on_device`), not copied to the host.
    The row may be the caller's own array: the functions below never write into it."""
    on_device = getattr(logits, "on_device", None)
    if on_device is not None:
        logits = on_device()
    xp = array_module(logits)
    return xp, xp.asarray(logits, dtype=xp.float64).reshape(-1)


def device_of(logits):
    """A context in which the row's card is the current one (a process may hold stages on several
    cards: each row is sampled on its own), or one that does nothing for a host row."""
    on_device = getattr(logits, "on_device", None)
    dev = getattr(on_device() if on_device is not None else logits, "device", None)
    return dev if hasattr(dev, "__enter__") else contextlib.nullcontext()


class TokenCounts:
    """One request's tokens as the penalties count them, kept beside its rows (on their device),
    sparse as the tokens are few beside the vocabulary: `seen_ids` (repetition: the prompt's and
    the drawn tokens), `drawn_ids` with `drawn_counts` (frequency and presence: how often each was
    drawn, float64 as the penalty multiplies it). Tokens past the row's length are never counted
    (the row has no logit for them). The host keeps where each token sits, so that recording one
    writes one element on the device, or appends one."""

    def __init__(self, xp, n: int, seen_ids=(), drawn_counts: dict | None = None,
                 track_seen: bool = True):
        self.xp, self.n, self.track_seen = xp, n, track_seen
        seen = sorted({int(t) for t in seen_ids if 0 <= t < n}) if track_seen else []
        drawn = sorted((int(t), c) for t, c in (drawn_counts or {}).items() if 0 <= t < n)
        self._seen = set(seen)
        self._slot = {t: i for i, (t, _) in enumerate(drawn)}    # token -> its place in drawn_ids
        self.seen_ids = xp.asarray(np.array(seen, dtype=np.int64))
        self.drawn_ids = xp.asarray(np.array([t for t, _ in drawn], dtype=np.int64))
        self.drawn_counts = xp.asarray(np.array([c for _, c in drawn], dtype=np.float64))

    def record(self, token: int) -> None:
        """`token` is drawn: one element written on the device, or one appended."""
        if not 0 <= token < self.n:
            return
        with device_of(self.drawn_ids):
            xp, one = self.xp, self.xp.asarray(np.array([token], dtype=np.int64))
            slot = self._slot.get(token)
            if slot is None:
                self._slot[token] = int(self.drawn_ids.size)
                self.drawn_ids = xp.concatenate([self.drawn_ids, one])
                self.drawn_counts = xp.concatenate([self.drawn_counts,
                                                    xp.ones(1, dtype=xp.float64)])
            else:
                self.drawn_counts[slot] += 1.0
            if self.track_seen and token not in self._seen:
                self._seen.add(token)
                self.seen_ids = xp.concatenate([self.seen_ids, one])


def adjust(xp, row, params, counts: TokenCounts):
    """A new row: `row` with the repetition penalty (at `counts.seen_ids`: a positive logit
    divided by it, a negative one multiplied), then the frequency and presence penalties (at
    `counts.drawn_ids`) subtracted, then the logit bias added (`params` a SamplingParams)."""
    out = row.copy()
    if params.repetition_penalty != 1.0 and counts.track_seen and counts.seen_ids.size:
        rp, ids = params.repetition_penalty, counts.seen_ids
        v = out[ids]
        out[ids] = xp.where(v > 0, v / rp, v * rp)
    if (params.frequency_penalty or params.presence_penalty) and counts.drawn_ids.size:
        out[counts.drawn_ids] -= (params.frequency_penalty * counts.drawn_counts
                                  + params.presence_penalty)
    pairs = [(t, b) for t, b in params.logit_bias if t < out.size]
    ids = [t for t, _ in pairs]
    if pairs and len(set(ids)) == len(ids):
        out[xp.asarray(ids)] += xp.asarray([b for _, b in pairs], dtype=xp.float64)
    else:   # a token named twice gets both biases, one after the other
        for token, bias in pairs:
            out[token] += bias
    return out


def any_allowed(words: np.ndarray, n: int) -> bool:
    """Whether the bitmask (host uint32 words) allows any of tokens [0, n)."""
    full, rest = divmod(n, BITS_PER_WORD)
    if words[:full].any():
        return True
    return bool(rest and full < len(words) and int(words[full]) & ((1 << rest) - 1))


def allowed_tokens(xp, words: np.ndarray, n: int):
    """The bitmask's words (host uint32, a bit per token) uploaded and expanded where `xp` computes,
    into a bool per token of a row of `n`; tokens past the mask are never allowed."""
    need = -(-n // BITS_PER_WORD)
    packed = np.zeros(need, dtype=np.uint32)
    packed[:min(need, len(words))] = words[:need]
    # int64 throughout: a word's 32 bits fit, and every array module indexes with it
    idx = xp.arange(n, dtype=xp.int64)
    bits = (xp.asarray(packed.astype(np.int64))[idx >> 5] >> (idx & 31)) & 1
    return bits.astype(bool)


def masked(xp, row, words: np.ndarray):
    """A new row in which the tokens the bitmask does not allow are -inf: greedy or sampled, the
    draw picks among the allowed only."""
    return xp.where(allowed_tokens(xp, words, int(row.size)), row, -np.inf)


def _stable_argsort(xp, a):
    # CuPy's sort is always stable and takes no `kind`; numpy's must be asked
    return xp.argsort(a, kind="stable") if xp is np else xp.argsort(a)


def kept(xp, row, params):
    """What a sampled draw picks from: the token ids it can draw (most likely first) and their
    probabilities, summing to 1, after temperature, top-k, top-p and min-p (arrays of `xp`)."""
    order = _stable_argsort(xp, -row)
    if params.top_k:
        order = order[: params.top_k]
    z = row[order] / params.temperature
    probs = xp.exp(z - z.max())
    probs /= probs.sum()
    keep = int(order.size)
    if params.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        at = xp.searchsorted(xp.cumsum(probs), xp.asarray([params.top_p], dtype=xp.float64))
        keep = min(keep, int(at[0]) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(xp.count_nonzero(probs >= params.min_p * probs[0]))))
    return order[:keep], probs[:keep] / probs[:keep].sum()


class RowNotNumbers(ValueError):
    """A row of logits with nothing to draw: NaN in it, or no finite logit. The request it was
    drawn for ends with this error; the rank serves on."""


def pick(xp, order, probs, u: float) -> int:
    """The token a weighted choice picks for the uniform `u` in [0, 1): the first whose cumulative
    probability (normalised by the total) exceeds u. Raises ValueError for probabilities that are
    not numbers (a row with NaN or no finite logit)."""
    cdf = xp.cumsum(probs)
    cdf = cdf / cdf[-1]    # not in place: on a device, cdf[-1] is a view the kernel would rewrite
    at = xp.searchsorted(cdf, xp.asarray([u], dtype=xp.float64), side="right")
    at = xp.minimum(at, int(order.size) - 1)   # u < 1 = cdf[-1]: only a NaN row reaches the end
    # the token and the total in one copy back: a total that is not a number has no draw
    token, total = to_host(xp.concatenate([order[at].astype(xp.float64), cdf[-1:]]))
    if not np.isfinite(total):
        raise RowNotNumbers("the row's probabilities are not numbers (NaN or no finite logit)")
    return int(token)


def draw(xp, row, params, uniform) -> int:
    """The token drawn from `row` (already adjusted and masked): its argmax when greedy, else a
    weighted choice among `kept` for one uniform from the host's generator (`uniform()`)."""
    if params.greedy:
        at = xp.argmax(row)          # the first NaN where the row has one, as numpy's
        # the token and its logit in one copy back: NaN, or a row whose best is -inf (no finite
        # logit, e.g. a grammar that allows no token), has no greedy token - never token 0
        token, best = to_host(xp.stack([xp.asarray(at, dtype=xp.float64),
                                        xp.asarray(row[at], dtype=xp.float64)]))
        if not np.isfinite(best):
            raise RowNotNumbers("the row's logits are not numbers (NaN or no finite logit)")
        return int(token)
    order, probs = kept(xp, row, params)
    return pick(xp, order, probs, uniform())


# ---- log-probabilities ---------------------------------------------------------------------------------

def log_softmax(xp, rows):
    """float64 log-softmax over the last axis."""
    x = xp.asarray(rows, dtype=xp.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - xp.log(xp.exp(x - m).sum(axis=-1, keepdims=True))


def top_of(xp, lp, n: int, also: int | None = None):
    """The `n` most likely tokens of one row of log-probabilities (most likely first, ties by
    token id) and their values, as host lists; with `also`, that token's value too (else None).
    Only those few values are copied back."""
    ids = np.zeros(0, dtype=np.int64)
    sel = xp.zeros(0, dtype=xp.int64)
    if n > 0:
        sel = xp.argpartition(-lp, min(n, int(lp.size)) - 1)[:n]
        ids = to_host(sel).astype(np.int64)
    if also is not None:
        sel = xp.concatenate([sel.astype(xp.int64), xp.asarray([also], dtype=xp.int64)])
    vals = to_host(lp[sel]) if int(sel.size) else np.zeros(0)
    top_vals = vals[:ids.size]
    order = np.lexsort((ids, -top_vals))
    return ([int(ids[i]) for i in order], [float(top_vals[i]) for i in order],
            float(vals[-1]) if also is not None else None)


# ---- the decode graph's greedy token ------------------------------------------------------------
ARGMAX_BLOCKS = 128               # blocks of the greedy token's argmax over the vocabulary


def graph_argmax(graph) -> None:
    """The greedy token of the graph's logits (its last row's) into graph.token: each of
    ARGMAX_BLOCKS blocks leaves its best value and index (post_v, post_i), the last to finish
    (graph.done counting them) picks among them."""
    graph._launch("argmax_row")((ARGMAX_BLOCKS,), (256,),
                                (graph.logits, np.int32(graph.g.n_vocab), graph.post_v,
                                 graph.post_i, graph.done, graph.token))
