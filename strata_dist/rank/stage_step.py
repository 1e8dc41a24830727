"""What a stage rank does with one data-plane message, with no socket in sight.

`StageStep.step(msg, rows)` takes one message (prompt chunk or decode step as Tokens or Hidden rows,
Release, Cancel, Settle) and returns the messages it causes, each addressed to a neighbour: the next stage,
the head, or (last stage, the next decode step) the first stage. The rank's shell
(strata_dist/rank/shell.py) owns the sockets, receives, and sends what comes back. One decode token
through a stage, in order: `_on_rows` → `Stage.run` (the layers) → `_hand_on` → rows to the next
stage, or on the last stage `_sample` → Token to the head and Tokens to the first stage."""
from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from protocol import (Cancel, Error, HandBack, Hidden, PromptProgress, Release, Settle, StepTokens,
                      Token, Tokens)
from protocol.messages import Sampling

from ..ops import sample as sample_ops
from ..checkpoints import is_recurrent, common_positions
from .conversation_cache import common_keys
from ..sampling.sampler import Sampler, SamplingParams, masked_row, prompt_logprobs, token_logprobs
from ..sampling.speculative import MAX_SPEC, SpecState, draw_against
from .stage import Stage
from ..sampling.structured import GrammarError, GrammarMatcher, model_tokenizer

log = logging.getLogger("strata.step")

CANCELLED_KEPT = 16   # cancelled request ids a stage remembers (their late rows are dropped)
# request ids the last stage ended (a final Token or an Error sent) that it remembers, so that a
# Cancel of one of them goes unanswered: more than the requests at once (protocol/batch.py
# MAX_BATCH_ROWS) can end between a Cancel's sending and its arrival
ENDED_KEPT = 1024


class To(Enum):
    NEXT = "next"      # the next stage (Hidden rows through the hand-off, or a Release)
    HEAD = "head"      # the head session: progress, tokens, errors
    FIRST = "first"    # the first stage: the next decode step (last stage only)


@dataclass
class Outbound:
    to: To
    msg: object
    rows: object = None   # Hidden rows as a backend array: the shell hands them to the next stage


@dataclass
class _Request:
    """What the last stage keeps per request: the sampler and how many tokens it has made."""
    sampler: Sampler
    max_new: int
    stop_ids: frozenset
    session_id: int
    generated: int = 0
    grammar: GrammarMatcher | None = None   # structured output: what the tokens must follow
    logprobs: bool = False      # each Token carries its logprob
    top_logprobs: int = 0       # ... and this many alternatives
    spec: SpecState | None = None   # speculative decoding: drafts and verify windows
    # --parallel: the head asked for this request's steps back (HandBack); its next plain decode
    # step sends no next step, and the flag is spent there
    hand_back: bool = False
    # --parallel (its prompt's Sampling.head_steps): other requests' rows and prompts can reach
    # this stage between its own looped steps
    shared: bool = False


class StageStep:
    def __init__(self, stage: Stage, rank: int, last: bool, min_request_id: int = 0,
                 draft_model=None):
        self.stage, self.rank, self.last = stage, rank, last
        # last stage, --draft-model: the DraftModel that drafts instead of the n-gram drafter
        self.draft_model = draft_model
        self.min_request_id = min_request_id
        self.requests: dict[int, _Request] = {}
        # Cancelled requests (the latest few: requests run one after another): rows of theirs that
        # come later are dropped unread. `prompting`: the request whose prompt this stage is inside
        # (its loan is out), which a Cancel ends between two chunks.
        self.cancelled: deque[int] = deque(maxlen=CANCELLED_KEPT)
        self.prompting: int | None = None
        # last stage: the prompt's ids from position 0 so far, of the request whose prompt it reads
        # and whose Sampling asks for them: each chunk carries only its share (PROTOCOL.md, Sampling)
        self.prompt_ids: dict[int, list[int]] = {}
        # last stage: the requests that ended here (the latest ENDED_KEPT). With --parallel, a
        # later request may end before an earlier one's Cancel comes, so an order says nothing.
        self.ended: deque[int] = deque(maxlen=ENDED_KEPT)
        # last stage: the final Token (or Error) of each speculating request that ended, with its
        # session, held until its Settle has come round every stage (_on_settle), or its Cancel
        # comes (a stage lost meanwhile: the head fails it), or its session is reset
        self.settling: dict[int, tuple[int, Outbound]] = {}
        # compute_us: time in the stage's own work (the shell adds send_us)
        self.counters = {"chunks": 0, "rows": 0, "tokens": 0, "errors": 0, "compute_us": 0,
                         "stale_dropped": 0, "cancelled_dropped": 0,
                         # last stage: verify windows, their drafts, the drafts accepted
                         "spec_windows": 0, "spec_drafted": 0, "spec_accepted": 0,
                         # rows a recurrent stage ran again to roll back inside a window
                         "window_rerun_rows": 0,
                         # rows the draft model read again to roll back (draft_model.py)
                         "draft_rerun_rows": 0}
        self._handlers = {Tokens: self._on_rows, Hidden: self._on_rows,
                          Release: self._on_release, Cancel: self._on_cancel,
                          Settle: self._on_settle, HandBack: self._on_hand_back}

    def step(self, msg, rows=None) -> list[Outbound]:
        """The messages one data-plane message causes. ``rows`` are a Hidden message's rows as a
        backend array (the shell reads them from the frame or the upstream IPC slot)."""
        handler = self._handlers.get(type(msg))
        return handler(msg, rows) if handler is not None else []

    def _on_release(self, msg: Release, rows) -> list[Outbound]:
        self.stage.release(msg.session_id)
        for rid, (sid, _) in list(self.settling.items()):
            if sid == msg.session_id:     # its Settle will not come back to a session reset
                del self.settling[rid]
        if self.draft_model is not None:
            self.draft_model.release(msg.session_id)
        return [] if self.last else [Outbound(To.NEXT, msg)]

    def _on_hand_back(self, msg: HandBack, rows) -> list[Outbound]:
        """--parallel: the head takes a lone request's decode steps back (a second request came);
        its next plain decode step here answers the head instead of looping (`_sample`). A request
        that ended meanwhile, or one this stage does not sample, is left alone."""
        req = self.requests.get(msg.request_id) if self.last else None
        if req is not None:
            req.hand_back = True
        return []

    def _on_settle(self, msg: Settle, rows) -> list[Outbound]:
        """A speculating request ended: its last verify window settles here, then on the stages
        after this one; back on the last stage, which sent it round, the request's final Token
        held for it goes to the head (so every stage has settled once the head hears the end)."""
        self.stage.settle_window(msg.session_id, msg.pos)
        if not self.last:
            return [Outbound(To.NEXT, msg)]
        _, final = self.settling.pop(msg.request_id, (0, None))
        return [final] if final is not None else []

    def _settle(self, request_id: int, req: "_Request", final: Outbound) -> list[Outbound]:
        """A request's final Token, or for a speculating one (with a window drafted) its Settle:
        every stage's last window stands up to the position of the last token drawn (which no
        stage runs), and the Token waits for the Settle to come round (`_on_settle`)."""
        if req.spec is None or not req.spec.windows:
            return [final]
        self.settling[request_id] = (req.session_id, final)
        return [Outbound(To.FIRST, Settle(request_id=request_id, session_id=req.session_id,
                                          pos=req.spec.last_pos))]

    def _on_cancel(self, msg: Cancel, rows) -> list[Outbound]:
        """Every stage hears a Cancel (PROTOCOL.md §4): inside that request's prompt it ends the
        prompt here, and it drops the request's rows still to come. The last stage answers once,
        unless the request had already ended there (its final Token or Error is the answer). An
        answer held for a Settle goes now, not kept for a Settle that may never come back: the
        head cancels an ended request when it fails it (a stage lost while the Settle went
        round) or when its client leaves as it ends, and takes the answer as the end."""
        held = self.settling.pop(msg.request_id, None)
        if held is not None:
            return [held[1]]
        if msg.request_id in self.cancelled:
            return []
        self.cancelled.append(msg.request_id)
        self.prompt_ids.pop(msg.request_id, None)
        if self.prompting == msg.request_id:
            self._end_prompt()
        req = self.requests.pop(msg.request_id, None)
        if not self.last or (req is None and msg.request_id in self.ended):
            return []
        # still reading or generating: say so, with the drafts verified and accepted so far; its
        # step in flight is dropped when it comes back
        spec = req.spec if req is not None else None
        answer = Outbound(To.HEAD, Token(request_id=msg.request_id,
                                         session_id=req.session_id if req else 0,
                                         token_id=0, pos=0, done=True, reason="cancelled",
                                         drafted=spec.drafted if spec else 0,
                                         accepted=spec.accepted if spec else 0))
        return self._settle(msg.request_id, req, answer) if req is not None else [answer]

    def _end_prompt(self) -> None:
        self.prompting = None
        self.stage.end_prompt()

    def _on_rows(self, msg: Tokens | Hidden, rows) -> list[Outbound]:
        if msg.request_id < self.min_request_id:
            # a replacement (rejoin): rows of the request that was lost with the rank it
            # replaces, which the other ranks were still sending to this endpoint
            self.counters["stale_dropped"] += 1
            return []
        if msg.request_id in self.cancelled:
            self.counters["cancelled_dropped"] += 1
            return []
        t0 = time.perf_counter()
        if msg.batch is not None:
            return self._on_batch(msg, rows, t0)
        try:
            out = self._run(msg, rows)
        except Exception as e:  # a bad request must not take the rank down
            log.error("request %s failed:\n%s", msg.request_id, traceback.format_exc())
            self._end_prompt()   # a failed prompt still gives its loan back
            self.prompt_ids.pop(msg.request_id, None)
            return [self.error(msg.request_id, f"rank {self.rank}: {type(e).__name__}: {e}")]
        self.counters["compute_us"] += int((time.perf_counter() - t0) * 1e6)
        try:
            return self._hand_on(msg, out, t0)
        except (ValueError, IndexError) as e:   # sampling fields no sampler takes
            self.prompt_ids.pop(msg.request_id, None)
            return self._end_with_error(msg.request_id, f"{type(e).__name__}: {e}")

    def _on_batch(self, msg: Tokens | Hidden, rows, t0: float) -> list[Outbound]:
        """A batched decode step (protocol/batch.py): every row through this stage's layers at
        once (a verify window as its session's window); then the rows to the next stage, or (last
        stage) each request's window verified as the one-session path verifies it, its Tokens to
        the head, the last of them with the drafts of its next window."""
        b = msg.batch
        each = b.rows_each()
        try:
            out = self._run_batch(msg, rows, each)
        except Exception as e:  # the step's requests fail; the rank serves on
            log.error("batched step %s failed:\n%s", msg.request_id, traceback.format_exc())
            return [self.error(msg.request_id, f"rank {self.rank}: {type(e).__name__}: {e}")]
        self.counters["window_rerun_rows"] = self.stage.window_rerun_rows
        self.counters["compute_us"] += int((time.perf_counter() - t0) * 1e6)
        self.counters["tokens"] += 1
        self.counters["rows"] += b.total_rows
        if not self.last:
            shape = [int(d) for d in out.shape]
            return [Outbound(To.NEXT, Hidden(
                request_id=msg.request_id, session_id=0, pos=0, n=shape[0], dtype="float32",
                shape=shape, batch=b), rows=out)]
        sent: list[Outbound] = []
        for i, (rid, sid, pos) in enumerate(zip(b.request_ids, b.session_ids, b.positions)):
            req = self.requests.get(rid)
            if rid in self.cancelled or req is None:
                continue          # cancelled while its row was on its way: dropped
            drafted = len(req.spec.drafts) if req.spec is not None else 0
            if each[i] > 1 and each[i] - 1 != drafted:   # the window is not the one drafted
                sent += self._end_with_error(rid, f"a verify window of {each[i]} rows for "
                                                  f"{drafted} drafts")
                continue
            try:
                sent += self._sample_one(rid, sid, out[i], pos + each[i], loop=False)
            except (ValueError, IndexError) as e:   # sampling fields no sampler takes
                sent += self._end_with_error(rid, f"{type(e).__name__}: {e}")
        return sent

    def _run_batch(self, msg: Tokens | Hidden, rows, each: list[int]):
        """A batched step's rows through this stage: the one-row entries as one batch, each
        verify window as its session's window (Stage.run: the many-row path, and on a recurrent
        session the record it rolls back from), so every row is computed as the one-session path
        computes it. Returns the hidden rows in the step's order, or on the last stage each
        entry's logits rows (host float32 [rows, vocab] from the general path and a window; a
        graph's batched rows stay on the card: backends/batched_decode.py RowLogits)."""
        b, first = msg.batch, isinstance(msg, Tokens)
        starts = np.concatenate([[0], np.cumsum(each)[:-1]]).astype(int).tolist()
        ones = [i for i, n in enumerate(each) if n == 1]
        parts: list = [None] * len(each)
        if ones:
            at = [starts[i] for i in ones]
            got = self.stage.run_batch([b.session_ids[i] for i in ones],
                                       [b.positions[i] for i in ones],
                                       ids=[msg.ids[a] for a in at] if first else None,
                                       hidden=None if first else rows[at])
            if len(ones) == len(each) and not self.last:
                return got
            for k, i in enumerate(ones):
                parts[i] = got[k:k + 1]
        for i, n in enumerate(each):
            if n > 1:
                a = starts[i]
                parts[i] = self.stage.run(b.session_ids[i], b.positions[i],
                                          ids=msg.ids[a:a + n] if first else None,
                                          hidden=None if first else rows[a:a + n],
                                          all_rows=self.last)
        if self.last:
            return parts
        xp = np if isinstance(parts[0], np.ndarray) else _device_arrays()
        return xp.concatenate(parts)

    def _end_with_error(self, request_id: int, why: str) -> list[Outbound]:
        """Request request_id ends here on `why` (last stage): its Error, naming it, to the head;
        for a speculating one with a window drafted, after its Settle has come round every stage
        (`_settle`), as at any end, so no stage keeps the window's records. The head fails the
        request when the Error comes and frees its session."""
        req = self.requests.pop(request_id, None)
        answer = self.error(request_id, f"rank {self.rank}: request {request_id}: {why}")
        return self._settle(request_id, req, answer) if req is not None else [answer]

    def error(self, request_id: int, message: str) -> Outbound:
        self.counters["errors"] += 1
        if self.last:
            self.ended.append(request_id)
        return Outbound(To.HEAD, Error(rank=self.rank, request_id=request_id, message=message))

    def _run(self, msg: Tokens | Hidden, rows):
        is_prompt = msg.sampling is not None
        if is_prompt and msg.chunk_index == 0:
            if self.prompting is not None:   # a prompt left unfinished (its Cancel not here yet)
                self._end_prompt()
            # a prompt of one chunk borrows only what its rows need
            self.stage.begin_prompt(_rows_of(msg) if msg.chunk_total == 1 else None)
            self.prompting = msg.request_id
            if msg.conversation is not None:
                self.stage.switch_conversation(msg.session_id, msg.conversation)
        # prompt logprobs, or a verify window (a decode step of more than one row): every row's
        all_rows = self.last and (msg.sampling.prompt_logprobs if is_prompt else _rows_of(msg) > 1)
        if isinstance(msg, Tokens):
            out = self.stage.run(msg.session_id, msg.pos, ids=msg.ids, prompt=is_prompt,
                                 checkpoint_at=msg.checkpoint_at, ahead=self._ahead(msg),
                                 all_rows=all_rows)
        else:
            out = self.stage.run(msg.session_id, msg.pos, hidden=rows, prompt=is_prompt,
                                 checkpoint_at=msg.checkpoint_at, all_rows=all_rows)
        if is_prompt and msg.chunk_index == msg.chunk_total - 1:
            self._end_prompt()   # before the first decode step reaches this stage
        self.counters["window_rerun_rows"] = self.stage.window_rerun_rows
        self.counters["chunks" if is_prompt else "tokens"] += 1
        self.counters["rows"] += _rows_of(msg)
        return out

    def _ahead(self, msg: Tokens) -> bool:
        """Whether the next decode step of this request will follow this one on this stage: a
        greedy request with more than this step's token to go, on a stage that is first and last
        (the stage may then start that step before the host has this one's token). Not when the
        row itself is read (logprobs, penalties, bias): a step ahead overwrites it."""
        req = self.requests.get(msg.request_id)
        return (self.last and msg.sampling is None and req is not None
                and req.sampler.params.greedy and not req.sampler.params.reshapes_logits
                and not req.logprobs and req.generated + 1 < req.max_new
                and req.grammar is None    # a grammar's draw needs the row, masked, on the host
                and req.spec is None       # the next step's rows depend on this one's drafts
                and not req.hand_back      # the head sends the next step (--parallel)
                # under --parallel another request's prompt or step can come between: the step
                # ahead is then waited for and dropped (DecodeGraph.settle) and run again, which
                # rewrites the same KV cells but would apply the token twice to a recurrent
                # layer's conv/delta state (qwen3next), updated in place
                and not (req.shared and is_recurrent(self.stage.session(req.session_id))))

    def _hand_on(self, msg: Tokens | Hidden, out, t0: float) -> list[Outbound]:
        """Rows to the next stage, or (last stage) progress, the sampled token to the head and the
        next decode step to the first stage."""
        is_prompt = msg.sampling is not None
        # the checkpoints every stage so far holds for the session (checkpoints.py; PROTOCOL.md §4a)
        upstream = None if isinstance(msg, Tokens) or msg.resume_any else msg.checkpoints
        held = common_positions(upstream, self.stage.checkpoint_positions(msg.session_id))
        # the conversations every stage so far keeps (conversation_cache.py), with prompt chunks
        kept = (common_keys(None if isinstance(msg, Tokens) else msg.conversations,
                            self.stage.conversations.keys()) if is_prompt else [])
        if not self.last:
            shape = [int(d) for d in out.shape]
            return [Outbound(To.NEXT, Hidden(
                request_id=msg.request_id, session_id=msg.session_id, pos=msg.pos, n=shape[0],
                dtype="float32", shape=shape, chunk_index=msg.chunk_index,
                chunk_total=msg.chunk_total, sampling=msg.sampling,
                checkpoint_at=msg.checkpoint_at, checkpoints=held or [],
                resume_any=held is None, conversation=msg.conversation,
                conversations=kept), rows=out)]
        end = msg.pos + _rows_of(msg)
        sent: list[Outbound] = []
        if is_prompt:
            ids = self._prompt_ids_so_far(msg)
            progress = PromptProgress(
                request_id=msg.request_id, session_id=msg.session_id, pos=end,
                chunk_index=msg.chunk_index, chunk_total=msg.chunk_total,
                ms=(time.perf_counter() - t0) * 1e3, checkpoints=held or [],
                resume_any=held is None, conversations=kept)
            if msg.sampling.prompt_logprobs:
                _attach_prompt_logprobs(progress, out, msg.pos, ids, msg.sampling.top_logprobs)
                out = out[-1]             # the row the first token is sampled from
            sent.append(Outbound(To.HEAD, progress))
            if msg.chunk_index < msg.chunk_total - 1:
                return sent
            self.prompt_ids.pop(msg.request_id, None)
            self.requests[msg.request_id] = _new_request(msg.sampling, ids, msg.session_id)
            self._attach_draft_model(self.requests[msg.request_id])
            self._attach_grammar(self.requests[msg.request_id], msg.sampling)
        return sent + self._sample(msg, out, end)

    def _prompt_ids_so_far(self, msg: Tokens | Hidden) -> list[int]:
        """The prompt's ids from position 0 through the one after this chunk's last row, gathered
        from the chunks' shares (the first chunk's starts at 0, each later one at its own pos); []
        when the request asks for none."""
        share = msg.sampling.prompt_ids
        if msg.chunk_index == 0:    # a prompt left unfinished leaves nothing behind
            self.prompt_ids = {msg.request_id: list(share)} if share else {}
            return self.prompt_ids.get(msg.request_id, [])
        if not share:
            return []
        held = self.prompt_ids.get(msg.request_id, [])
        if len(held) < msg.pos:
            raise ValueError(f"chunk {msg.chunk_index}'s prompt ids start at position {msg.pos}, "
                             f"the ones read end at {len(held)}")
        del held[msg.pos:]          # the one after the previous chunk's last row is this one's first
        held.extend(share)
        self.prompt_ids[msg.request_id] = held
        return held

    def _sample(self, msg: Tokens | Hidden, logits, end: int) -> list[Outbound]:
        """The step's token(s) to the head and the next step to the first stage. A verify window
        (`logits` of its every row) yields its accepted drafts and one token more
        (strata_dist/sampling/speculative.py); each token is drawn exactly as a one-row step draws it."""
        window = msg.sampling is None and _rows_of(msg) > 1
        # a request whose decode steps the head sends (batched) gets no next step from here; nor
        # does a lone one the head takes back (HandBack): its Token says so
        req = self.requests.get(msg.request_id)
        hand_back = msg.sampling is None and req is not None and req.hand_back
        loop = (msg.sampling is None or not msg.sampling.head_steps) and not hand_back
        sent = self._sample_one(msg.request_id, msg.session_id, logits if window else [logits],
                                end, loop)
        if hand_back:
            req.hand_back = False
            last = sent[-1].msg if sent else None
            if isinstance(last, Token) and not last.done:   # an ended request has nothing to hand
                last.handed_back = True
        return sent

    def _sample_one(self, request_id: int, session_id: int, rows, end: int,
                    loop: bool) -> list[Outbound]:
        """Draw request_id's next token from each of `rows` (one row; or a verify window's, the
        last at position `end`) while its drafts are accepted: a Token each to the head, and when
        `loop` and the request goes on, its next decode step to the first stage. A batched step's
        entry (--parallel) comes with `loop` off: the head sends the next step, so the last Token
        carries the next window's drafts (protocol/batch.py)."""
        req = self.requests.get(request_id)
        if req is None or req.max_new <= 0:   # cancelled, or a prompt that asks for no token
            if self.requests.pop(request_id, None) is not None:
                self.ended.append(request_id)
            return []
        drafts = req.spec.drafts if len(rows) > 1 and req.spec is not None else []
        sent: list[Outbound] = []
        for i, row in enumerate(rows):
            draft = drafts[i] if i < len(drafts) else None
            q = req.spec.qs[i] if draft is not None else None
            pos = end - len(rows) + i + 1
            # host rows (a window's, the CPU path's) are looked at here; a batched graph step's
            # row stays on its card and says whether it holds one (RowLogits.nan). (A one-session
            # graph step's greedy token comes from argmax_row, which skips NaN: a row with some
            # NaN is refused here when batched but drawn alone, an asymmetry left as it was.)
            # No token is drawn from NaN: a greedy draw would take token 0
            if ((isinstance(row, np.ndarray) and np.isnan(row).any())
                    or getattr(row, "nan", False)):
                return self._end_with_error(request_id, f"the logits of the row at position "
                                                        f"{pos - 1} are NaN")
            try:
                tok, finished = _draw(req, row, draft, q)
            except GrammarError as e:   # the request ends with its error; the rank serves on
                # a speculating request's last window settles on every stage first, as at any end
                return self._end_with_error(request_id, f"structured output: {e}")
            except sample_ops.RowNotNumbers as e:   # a device row (host rows are checked above)
                return self._end_with_error(request_id, f"the row at position {pos - 1}: {e}")
            req.generated += 1
            reason = ("stop" if tok in req.stop_ids or finished
                      else ("length" if req.generated >= req.max_new else ""))
            token = Token(request_id=request_id, session_id=session_id, token_id=tok,
                          pos=pos, done=bool(reason), reason=reason)
            if req.logprobs:
                lp = token_logprobs(row, tok, req.top_logprobs)
                token.logprob, token.top_ids, token.top_logprobs = (lp.logprob, lp.top_ids,
                                                                    lp.top_logprobs)
            sent.append(Outbound(To.HEAD, token))
            accepted = tok == draft
            if req.spec is not None:
                req.spec.history.append(tok)
                req.spec.accepted += accepted
                req.spec.last_pos = pos
                self.counters["spec_accepted"] += accepted
            if reason:
                if req.spec is not None:
                    token.drafted, token.accepted = req.spec.drafted, req.spec.accepted
                del self.requests[request_id]
                self.ended.append(request_id)
                # the window settles on every stage before the head hears the request ended
                return sent[:-1] + self._settle(request_id, req, sent[-1])
            if not accepted:
                break
        drafts = []
        if req.spec is not None:
            drafts = list(req.spec.draft(req.max_new - req.generated))
            self.counters["spec_drafted"] += len(drafts)
            self.counters["spec_windows"] += bool(drafts)
        if not loop:
            sent[-1].msg.drafts = drafts    # the head sends the window with the next step
            return sent
        ids = [tok] + drafts
        return sent + [Outbound(To.FIRST, Tokens(request_id=request_id,
                                                 session_id=session_id, pos=pos, ids=ids))]

    def _attach_draft_model(self, req: _Request) -> None:
        """A speculating request on a stage that carries a draft model drafts with it, in its
        session's draft session; a sampled one draws its drafts from a stream of its own (the
        target's stream stays the acceptance rule's)."""
        if req.spec is None or self.draft_model is None:
            return
        params = req.sampler.params
        seed = params.seed
        rng = np.random.default_rng(None if seed is None else [seed, 1])
        model, session_id = self.draft_model, req.session_id

        def drafts(history, k, min_p):
            out = model.draft(session_id, history, k, min_p, params, rng)
            self.counters["draft_rerun_rows"] = model.rerun_rows
            return out
        req.spec.model = drafts

    def _attach_grammar(self, req: _Request, s: Sampling) -> None:
        """A request with a grammar gets its matcher (built at its first draw, from the model's
        tokenizer, read once per process)."""
        if s.grammar_kind:
            req.grammar = GrammarMatcher(s.grammar_kind, s.grammar,
                                         lambda: model_tokenizer(self.stage.gguf))


def one_message_a_step(step_id: int, outbound: list[Outbound]) -> list[Outbound]:
    """A batched step's Tokens to the head (`StageStep.step`'s answer to it on the last stage) as
    one StepTokens, where the first of them was; the rest (a request's Error, a Settle) as they
    were: one send, and one receive and decode on the head, a step instead of one a row (each
    a cost per row of the step, on the head's one thread that sends the next step)."""
    tokens = [o.msg for o in outbound if o.to is To.HEAD and isinstance(o.msg, Token)]
    if not tokens:
        return outbound
    out, bundled = [], False
    for o in outbound:
        if o.to is To.HEAD and isinstance(o.msg, Token):
            if not bundled:
                out.append(Outbound(To.HEAD, StepTokens(request_id=step_id, tokens=tokens)))
                bundled = True
        else:
            out.append(o)
    return out


def _draw(req: _Request, logits, draft: int | None = None, q=None) -> tuple[int, bool]:
    """The next token, and whether the request's grammar is finished with it. With a grammar the
    mask (its packed bitmask) is applied where the row is: a GPU step's row on the card, so only
    the token comes back. `draft`: the verify window's draft of the next row, `q` what it was
    drawn from (speculative.draw_against)."""
    if req.grammar is None:
        return draw_against(req.sampler, logits, draft, q), False
    with sample_ops.device_of(logits):
        row = sample_ops.row_of(logits)[1]
        tok = draw_against(req.sampler, masked_row(row, req.grammar.bitmask_words(int(row.size))),
                           draft, q)
    return tok, req.grammar.advance(tok)


def _device_arrays():
    """The array module of device rows (a GPU stage's hidden rows)."""
    import cupy
    return cupy


def _rows_of(msg: Tokens | Hidden) -> int:
    return len(msg.ids) if isinstance(msg, Tokens) else msg.n


def _new_request(s: Sampling, prompt_ids: list[int], session_id: int) -> _Request:
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            min_p=s.min_p, seed=s.seed, presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty,
                            repetition_penalty=s.repetition_penalty,
                            logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values)))
    spec = (SpecState(min(s.spec_tokens, MAX_SPEC), s.spec_min_p, list(prompt_ids))
            if s.spec_tokens else None)   # a window fits the decode step's rows
    return _Request(Sampler(params, prompt_ids), s.max_new, frozenset(s.stop_ids), session_id,
                    logprobs=s.logprobs, top_logprobs=s.top_logprobs, spec=spec,
                    shared=s.head_steps)


def _attach_prompt_logprobs(progress: PromptProgress, rows, pos: int, prompt_ids: list[int],
                            top: int) -> None:
    """Each row's logprob of the prompt token after it (rows at positions pos..; `prompt_ids` from
    position 0; the prompt's last row has none: the first sampled token follows it)."""
    n = min(len(rows), len(prompt_ids) - 1 - pos)
    if n <= 0:
        return
    got = prompt_logprobs(rows[:n], prompt_ids[pos + 1:pos + 1 + n], top)
    progress.logprobs = [g.logprob for g in got]
    progress.top_ids = [g.top_ids for g in got]
    progress.top_logprobs = [g.top_logprobs for g in got]
