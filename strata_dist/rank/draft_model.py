"""The draft model of speculative decoding (`--spec K --draft-model FILE.gguf`).

A small model of the target's vocabulary, loaded whole on the rank that drafts (the last stage,
where the n-gram drafter runs too) as one Stage that is first and last, with its own session per
serving session. Before each verify window it reads the conversation's tokens its session lacks
(the window's accepted drafts and the token after them), then drafts up to K tokens one row at a
time: greedy requests take its argmax; sampled requests draw each draft from its distribution q
(the request's temperature, top-k, top-p and min-p over the draft's logits), which the last stage
hands to the acceptance rule (speculative.draw_against: accept with min(1, p/q), else draw from
max(0, p - q) renormalised). `--spec-min-p P` stops drafting where q(draft) falls below P.

Roll-back: attention KV is positional, so the session simply reads on from the first position
where its tokens and the conversation differ. A session with recurrent state (qwen3next) keeps a
checkpoint (strata_dist/checkpoints.py) at the position each window's drafting started from; the
next window restores it and reads the accepted tokens again (at most K + 1 rows). A conversation
that diverges before that checkpoint is read again from position 0.

The planner reserves `plan_bytes` on the last stage, priced for the kind of device it lands on
(PlanParams.draft_bytes on a GPU, draft_cpu_bytes on a CPU rank): the draft's weights (on a GPU
with every expert resident), its session for the context, the buffers of a catch-up chunk and,
with recurrent state, its checkpoints."""
from __future__ import annotations

import numpy as np

from ..backends import get_backend
from ..checkpoints import is_recurrent
from ..models.shape import model_shape
from ..models import architecture_for, open_checked
from ..models.qwen3next import RecurrentRewindError
from ..plan.pricing import session_bytes, weights_bytes
from ..sampling.sampler import Sampler, SamplingParams
from .stage import Stage, StageConfig

CATCH_UP_ROWS = 64    # the most rows one catch-up call reads (the prompt's, at a request's start)
# a recurrent draft session keeps one checkpoint, at the latest window's start (a roll-back goes
# back no further); while the next is taken there are two
CHECKPOINTS_KEPT = 2


class DraftModelError(ValueError):
    """A draft model that cannot draft for the target: said with both files named."""


def check_draft_model(target_path: str, draft_path: str) -> None:
    """Refuse a draft model whose vocabulary differs from the target's (its token count or any
    token's text), or that is not a model this build runs (DraftModelError)."""
    try:
        draft = open_checked(draft_path)
        architecture_for(draft).read_geometry(draft)
    except Exception as e:   # noqa: BLE001 - any unreadable file is one error line
        raise DraftModelError(f"--draft-model {draft_path}: {e}") from None
    target = open_checked(target_path)
    tv = target.metadata_array("tokenizer.ggml.tokens") or []
    dv = draft.metadata_array("tokenizer.ggml.tokens") or []
    n_target = architecture_for(target).read_geometry(target).n_vocab
    n_draft = architecture_for(draft).read_geometry(draft).n_vocab
    if n_target != n_draft or len(tv) != len(dv):
        raise DraftModelError(
            f"--draft-model {draft_path}: its vocabulary has {n_draft} tokens ({len(dv)} in its "
            f"tokenizer), the model {target_path}'s has {n_target} ({len(tv)}): a draft must "
            "share the target's vocabulary")
    differ = next((i for i, (a, b) in enumerate(zip(tv, dv)) if a != b), None)
    if differ is not None:
        raise DraftModelError(
            f"--draft-model {draft_path}: token {differ} is {dv[differ]!r} there and "
            f"{tv[differ]!r} in the model {target_path}: a draft must share the target's "
            "vocabulary")


def plan_bytes(draft_path: str, device_kind: str, kv_type: str | None, cells: int,
               sessions: int = 1) -> int:
    """What the draft model takes on a stage of `device_kind` that carries it: its dense weights,
    on a GPU every routed expert (copied resident: drafting never streams; a CPU rank reads them
    where the file maps them, as DraftModel loads it), a session of `cells` cells for each of the
    `sessions` serving sessions (--parallel B: each request drafts in its own), the many-row
    buffers of one catch-up chunk, and with recurrent state its checkpoints: each session's one
    kept, and the next while one session's is taken (the catch-ups run one at a time)."""
    shape = model_shape(open_checked(draft_path), device_kind, kv_type)
    L = shape.n_layers
    experts = shape.n_experts * sum(shape.blob_bytes) if device_kind == "cuda" else 0
    recurrent = sum(r for r, kind in zip(shape.recurrent_bytes, shape.layer_kind)
                    if kind == "linear")
    return (weights_bytes(shape, 0, L, True, True) + experts
            + sessions * session_bytes(shape, cells, 0, L)
            + shape.prompt_bytes(CATCH_UP_ROWS)
            + (sessions + CHECKPOINTS_KEPT - 1) * recurrent)


class DraftModel:
    """The draft model on one device: `draft(session_id, history, k, min_p, params)` gives the
    drafts after `history` and, for sampled requests, the distribution each was drawn from."""

    def __init__(self, path: str, device: str, max_context: int, kv_type: str | None = None):
        gguf = open_checked(path)
        g = architecture_for(gguf).read_geometry(gguf)
        self.path, self.n_layers = path, g.n_layers
        # on a GPU every expert is copied resident (a draft step never streams); a host stage
        # reads them where the file maps them
        on_gpu = get_backend(device).on_gpu
        pairs = [(l, e) for l in range(g.n_layers) for e in range(g.n_expert)] if on_gpu else []
        self.stage = Stage(StageConfig(path, device, 0, g.n_layers, True, True, max_context,
                                       cache_pairs=pairs, kv_type=kv_type))
        self.stage.session(0)   # the serving session's draft session, carved up front as priced
        self.max_context = max_context
        self.fed: dict[int, list[int]] = {}    # per session: the tokens its KV holds, in order
        self.mark: dict[int, int] = {}         # per recurrent session: its checkpoint's position
        self.rerun_rows = 0                    # rows read again to roll back (counters)

    @property
    def weights_bytes(self) -> int:
        return self.stage.weights_bytes + self.stage.cache.nbytes

    def release(self, session_id: int) -> None:
        self.stage.release(session_id)
        self.fed.pop(session_id, None)
        self.mark.pop(session_id, None)

    def draft(self, session_id: int, history: list[int], k: int, min_p: float,
              params: SamplingParams | None = None, rng: np.random.Generator | None = None
              ) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray] | None]]:
        """Up to k drafts after `history` and each one's q (None: greedy, a point mass at the
        argmax). `params`/`rng`: a sampled request's; None drafts greedily."""
        k = min(k, self.max_context - len(history))
        if k <= 0 or not history:
            return [], []
        logits = self._catch_up(session_id, history)
        sampler = Sampler(SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                         top_p=params.top_p, min_p=params.min_p)) \
            if params is not None and not params.greedy else None
        drafts: list[int] = []
        qs: list = []
        fed = self.fed[session_id]
        while True:
            if sampler is None and min_p == 0.0:
                # a graph step's logits carry their argmax: the row stays on the device
                tok, prob, q = int(_argmax(logits)), 1.0, None
            elif sampler is None:
                row = np.asarray(logits, dtype=np.float64).reshape(-1)
                tok = int(np.argmax(row))
                prob, q = 1.0 / float(np.exp(row - row[tok]).sum()), None
            else:
                ids, probs = sampler.distribution(np.asarray(logits, dtype=np.float64).reshape(-1))
                at = int(rng.choice(len(ids), p=probs))
                tok, prob, q = int(ids[at]), float(probs[at]), (ids, probs)
            if prob < min_p:
                break
            drafts.append(tok)
            qs.append(q)
            if len(drafts) == k:
                break
            logits = self.stage.run(session_id, len(fed), ids=[tok])
            fed.append(tok)
        return drafts, qs

    def _catch_up(self, session_id: int, history: list[int]):
        """Read the tokens of `history` the session lacks (rolled back to where they differ);
        the logits of its last row."""
        s = self.stage.session(session_id)
        self.stage.checkpoint_store(session_id).limit = CHECKPOINTS_KEPT - 1
        fed = self.fed.setdefault(session_id, [])
        common = _common_prefix(fed, history)
        # the last token's row is read again when the session holds it: its logits are wanted
        same = min(common, len(history) - 1)
        if is_recurrent(s) and same < len(fed):
            mark = self.mark.get(session_id, 0)
            same = mark if mark <= same else 0
        self.rerun_rows += common - same   # rows the session held that are read again
        del fed[same:]
        end = len(history)
        pos = same
        logits = None
        while pos < end:
            n = min(CATCH_UP_ROWS, end - pos)
            try:
                logits = self.stage.run(session_id, pos, ids=history[pos:pos + n], prompt=True,
                                        checkpoint_at=[pos + n] if pos + n == end else [])
            except RecurrentRewindError:   # no checkpoint there: the conversation from its start
                del fed[:]
                pos = 0
                continue
            fed.extend(history[pos:pos + n])
            pos += n
        self.mark[session_id] = end
        return logits


def _argmax(logits) -> int:
    token = getattr(logits, "greedy_token", None)
    return int(token) if token is not None else int(np.argmax(np.asarray(logits).reshape(-1)))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
