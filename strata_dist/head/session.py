"""The head's view of a conversation: which tokens the stages' session holds, how much of a new
prompt can be reused, and one generation through the pipeline. Used by the `--serve` line
protocol and by the HTTP server, so both resume and stream the same way.

A session with recurrent state (qwen3next) resumes only at 0, at its own end, or at a checkpoint
every stage holds (strata_dist/checkpoints.py): the longest such position <= the common prefix."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from protocol.messages import Sampling

from ..checkpoints import DEFAULT_EVERY, request_positions, resume_point
from .conversation_table import ConversationTable
from .coordinator import Coordinator, RequestError, StreamEvent
from ..sampling.sampler import SamplingParams, TokenLogprob
from ..sampling.speculative import SpecOptions


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    reused: int = 0          # prompt tokens the session already held
    read: int = 0            # prompt tokens read by this request
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    reason: str = "length"   # stop | length | cancelled
    # asked for (LogprobRequest): per prompt position 1.. the logprob of its token (position 0 has
    # none), and per sampled token its own
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    drafted: int = 0         # speculative decoding: draft tokens verified, and those accepted
    accepted: int = 0


@dataclass(frozen=True)
class LogprobRequest:
    """What a generation reports beyond its tokens: each token's logprob (`tokens`), the `top`
    most likely alternatives with each, and (`prompt`) every prompt token's logprob but the
    first's, which reads the whole prompt afresh."""
    tokens: bool = False
    top: int = 0
    prompt: bool = False


class HeadSession:
    """One session on the stages (its KV lives there); this object remembers its tokens."""

    def __init__(self, coordinator: Coordinator, ctx: int, prompt_chunk: int, vocab: int,
                 eos_id: int | None, session_id: int = 0, checkpoint_every: int = DEFAULT_EVERY,
                 keep_conversations: bool = False, conversations_in_host: bool = False,
                 spec: SpecOptions = SpecOptions()):
        """`keep_conversations`: the stages keep earlier conversations (--conversation-cache-mib,
        strata_dist/head/conversation_table.py), and a request resumes from the longest of any;
        `conversations_in_host`: some stage keeps them in pinned host memory (the plan's
        conversation_in), where no checkpoint is kept with them."""
        self.coord, self.ctx, self.prompt_chunk, self.vocab = coordinator, ctx, prompt_chunk, vocab
        self.spec = spec        # --spec, --draft, --spec-min-p: every request speculates so
        self.eos_id, self.session_id = eos_id, session_id
        self.tokens: list[int] = []    # what the session's KV holds, position by position
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: no mid-prompt checkpoints), "
                             f"got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every   # --prompt-cache-every
        # Positions every stage holds a checkpoint at, as the last stage last reported; None: the
        # state is positional on every stage (any position resumes). Until a report: none.
        self.checkpoints: list[int] | None = []
        self._rejoins = coordinator.rejoins   # a replacement rank holds none of the session
        self.salt = ""   # the salt (API key and cache_salt) of the request whose tokens it holds
        self.conversations = ConversationTable(keep_conversations,
                                               checkpoints_kept=not conversations_in_host)
        # what runs its requests: the coordinator itself, or (--parallel) a BatchScheduler that
        # batches them with other sessions' (strata_dist/head/batch_scheduler.py), called from the
        # request's own thread: the scheduler then also answers for lost ranks
        self.runner = None

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        if len(ids) >= self.ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.ctx}")

    def reusable(self, ids: list[int]) -> int:
        """Where a request for `ids` resumes: the longest usable position <= the common prefix."""
        n = 0
        while n < min(len(ids), len(self.tokens)) and ids[n] == self.tokens[n]:
            n += 1
        n = min(n, len(ids) - 1)   # at least one token is read, to sample from its logits
        return resume_point(n, len(self.tokens), self.checkpoints)

    def generate(self, ids: list[int], max_new: int, params: SamplingParams = SamplingParams(),
                 stop_ids: tuple[int, ...] = (),
                 on_resume: Callable[[int], None] | None = None,
                 on_progress: Callable[[int, int, float, float], None] | None = None,
                 on_token: Callable[[int], None] | None = None,
                 should_cancel: Callable[[], bool] | None = None,
                 logprobs: LogprobRequest = LogprobRequest(),
                 on_logprob: Callable[[TokenLogprob], None] | None = None,
                 cache_salt: str = "", reuse: bool = True,
                 on_prompt_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> Outcome:
        """Generate after `ids`, streaming through the callbacks:
        on_progress(pos, total, chunk_ms, chunk_tok_per_s) per prompt chunk, on_token(id), and
        before it, when `logprobs.tokens`, on_logprob(its TokenLogprob); when `logprobs.prompt`,
        on_prompt_logprobs(the prompt's) once the prompt is read, before the first token.
        Prompt state is reused only from requests of the same `cache_salt`; `reuse` False reads
        the whole prompt (what it leaves is reused by later requests as any other's)."""
        self.check_prompt(ids)
        if max_new < 0:
            raise ValueError(f"max_new must be >= 0, got {max_new}")
        if self.runner is None:
            self.coord.await_ranks(should_cancel)
        if self.coord.rejoins != self._rejoins:   # a rank was replaced: nothing is reusable
            self.tokens, self.checkpoints, self._rejoins = [], [], self.coord.rejoins
            self.conversations.clear()
        reuse = reuse and not logprobs.prompt
        out = Outcome(reused=self.reusable(ids) if reuse and cache_salt == self.salt else 0)
        table, positional = self.conversations, self.checkpoints is None
        table.begin()
        restore = table.best(ids, cache_salt, positional) if reuse else (0, 0)
        if restore[1] <= out.reused:
            restore = (0, 0)
        else:
            out.reused = restore[1]
        conversation = table.step(self.tokens, self.salt, cache_salt, out.reused, restore,
                                  positional, self.checkpoints or [])
        self.salt = cache_salt
        if restore[0] and not positional:
            self.checkpoints = []   # the serving session's were of the conversation it leaves
        out.read = len(ids) - out.reused
        if on_resume:
            on_resume(out.reused)
        stops = set(stop_ids) | ({self.eos_id} if self.eos_id is not None else set())
        sampling = _sampling(params, logprobs, ids, max_new=min(max_new, self.ctx - len(ids)),
                             stop_ids=sorted(stops), spec=self.spec)
        self.tokens = ids[:out.reused]
        at = (request_positions(out.reused, len(ids), self.prompt_chunk, self.checkpoint_every)
              if self.checkpoints is not None else [])
        t0 = last = time.perf_counter()
        read_to = out.reused   # what the last stage has read (every stage holds it)
        confirmed = False      # a PromptProgress came back: every stage applied `conversation`

        def on_event(ev: StreamEvent) -> None:
            nonlocal last, read_to, confirmed
            now = time.perf_counter()
            if ev.kind == "progress":
                m = ev.msg
                confirmed = True
                self.checkpoints = None if m.resume_any else list(m.checkpoints)
                table.reported(m.conversations)
                read_to = m.pos
                n_chunk = m.pos - (out.reused + m.chunk_index * self.prompt_chunk)
                ms = (now - last) * 1e3
                if on_progress:
                    on_progress(m.pos, len(ids), ms, n_chunk / max(ms, 1e-9) * 1e3)
                if m.chunk_index == m.chunk_total - 1:
                    out.prompt_ms = (now - t0) * 1e3
                start = len(out.prompt_logprobs) + 1    # the position the chunk's first entry is of
                out.prompt_logprobs += [TokenLogprob(ids[start + i], lp, top, tops)
                                        for i, (lp, top, tops) in enumerate(
                                            zip(m.logprobs, m.top_ids, m.top_logprobs))]
                if on_prompt_logprobs and logprobs.prompt and m.chunk_index == m.chunk_total - 1:
                    on_prompt_logprobs(list(out.prompt_logprobs))
            elif ev.kind == "cancelled":
                out.drafted, out.accepted = ev.msg.drafted, ev.msg.accepted
            else:
                m = ev.msg
                out.tokens.append(m.token_id)
                if m.done:
                    out.drafted, out.accepted = m.drafted, m.accepted
                if m.logprob is not None:
                    lp = TokenLogprob(m.token_id, m.logprob, list(m.top_ids), list(m.top_logprobs))
                    out.logprobs.append(lp)
                    if on_logprob:
                        on_logprob(lp)
                if on_token:
                    on_token(m.token_id)
            last = now

        try:
            reason = (self.runner or self.coord).run_request(
                self.session_id, out.reused, ids[out.reused:], sampling, self.prompt_chunk, on_event,
                should_cancel=should_cancel, checkpoint_at=at, conversation=conversation)
        except RequestError:
            self.tokens = []   # the stages may hold part of the request: the next one reads afresh
            if restore[0] and read_to == out.reused:   # nothing read: the restore may have failed
                table.discard(restore[0])
            if conversation is not None and not confirmed:
                table.unconfirmed(conversation)
            raise
        out.reason = reason or "length"
        out.decode_ms = (time.perf_counter() - t0) * 1e3 - out.prompt_ms
        # the last token sampled has not been read by the stages yet
        self.tokens = ids + out.tokens[:-1] if out.tokens else list(ids)
        if out.reason == "cancelled":
            # A prompt cancelled between chunks: what the last stage read is held by every stage
            # (an earlier stage may have read further; a positional session moves back there).
            # A decode cancelled (a stop string, a client gone, the next of n choices): every
            # token before the last one seen went through every stage, and a stage that ran a
            # step past it is overwritten by position. A recurrent state is not positional (it
            # may hold a step past what we saw): it reads afresh.
            prompt_cut = read_to < len(ids) and not out.tokens
            if self.checkpoints is not None:
                self.tokens = []
            elif prompt_cut:
                self.tokens = ids[:read_to]
            if conversation is not None and not confirmed:
                # Cancelled before any stage reported chunk 0: the step rides on it, so some
                # stages may have applied it (kept, dropped, restored) and others not (a Cancel
                # read before the chunk drops it; one before sending sends none). Nothing is
                # believed: the session reads afresh from 0 (which overwrites every stage's
                # state), the new key stays unconfirmed and the forgets go again.
                self.tokens = []
                if self.checkpoints is not None:
                    self.checkpoints = []
                table.unconfirmed(conversation)
        return out


def _sampling(params: SamplingParams, logprobs: LogprobRequest, ids: list[int], max_new: int,
              stop_ids: list[int], spec: SpecOptions = SpecOptions()) -> Sampling:
    """The request's Sampling: the prompt's ids (all of them, from position 0) are kept only when
    the last stage needs them (the n-gram drafter matches over them); each prompt chunk carries
    its own share (coordinator.chunk_sampling)."""
    needs_prompt = logprobs.prompt or params.repetition_penalty != 1.0 or spec.k > 0
    return Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                    min_p=params.min_p, seed=params.seed, max_new=max_new, stop_ids=stop_ids,
                    logprobs=logprobs.tokens, top_logprobs=logprobs.top,
                    prompt_logprobs=logprobs.prompt, presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty,
                    repetition_penalty=params.repetition_penalty,
                    grammar_kind=params.grammar_kind, grammar=params.grammar,
                    logit_bias_ids=[t for t, _ in params.logit_bias],
                    logit_bias_values=[b for _, b in params.logit_bias],
                    prompt_ids=list(ids) if needs_prompt else [],
                    spec_tokens=spec.k, spec_min_p=spec.min_p)
