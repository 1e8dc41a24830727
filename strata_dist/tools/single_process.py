"""The single-process runner: one model over all layers, one session, chunked prefill, decode.

It is the baseline every distributed run is compared against (`strata-dist generate`)."""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..backends import get_backend
from ..checkpoints import DEFAULT_EVERY, CheckpointStore, request_positions, resume_point
from ..models import load_model, open_checked
from ..rank.prompt_workspace import PromptWorkspace
from ..sampling.sampler import Sampler, SamplingParams

DEFAULT_PROMPT_CHUNK = 512
DEFAULT_CONTEXT = 4096   # session cells when none is asked (the launcher's default too)


def context_cells(asked: int | None, g, model_path: str,
                  warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> int:
    """The launcher's rule for --max-context: unset, DEFAULT_CONTEXT capped at the context the
    file says the model was trained for (`trained_context`: context_length, or yarn's factor x
    the original); asked past that, granted with a warning naming the trained length."""
    trained = g.trained_context
    if asked is None:
        return min(DEFAULT_CONTEXT, trained)
    if asked < 1:
        raise ValueError(f"--max-context must be >= 1, got {asked}")
    if asked > trained:
        rs = g.rope_scaling
        how = (f" (rope scaling {rs.kind} x{rs.factor:g} over {rs.original_context})"
               if rs.kind == "yarn" else f" (rope scaling {rs.kind} x{rs.factor:g})"
               if rs.kind != "none" else "")
        warn(f"warning: --max-context {asked} is past the {trained} positions "
             f"{os.path.basename(model_path)} was trained for{how}: output past {trained} "
             "tokens may degrade")
    return asked


@dataclass
class GenerationResult:
    tokens: list[int]
    n_prompt: int
    prompt_ms: float
    decode_ms: float
    stop_reason: str                  # "stop" (end-of-sequence) or "length"
    reused: int = 0                   # prompt tokens the session already held
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (tokens, ms) per prompt chunk


class SingleProcessRunner:
    def __init__(self, model_path: str, device: str = "cpu", max_context: int | None = None,
                 prompt_chunk: int = DEFAULT_PROMPT_CHUNK, checkpoint_every: int = DEFAULT_EVERY,
                 kv_type: str | None = None, warn: Callable[[str], None] | None = None,
                 kv_resident: int = 0):
        """`kv_type`: how the session keeps K/V (backends/kv_cache.py; None: the device's default).
        `kv_resident`: cells of each K/V kept resident, the rest read from a host copy (RingKV;
        0: every cell).
        `max_context`: session cells by the launcher's rule (context_cells; `warn` hears a
        context past the trained one)."""
        if max_context is not None and max_context < 1:   # said before a model is loaded
            raise ValueError(f"--max-context must be >= 1, got {max_context}")
        self.gguf = open_checked(model_path)
        self.backend = get_backend(device)
        if kv_type:
            self.backend.kv_type = kv_type
        self.backend.kv_resident = kv_resident
        self.model = load_model(self.gguf, self.backend)
        g = self.model.g
        self.max_context = context_cells(max_context, g, model_path,
                                         **({"warn": warn} if warn is not None else {}))
        if prompt_chunk < 1:
            raise ValueError(f"prompt_chunk must be >= 1, got {prompt_chunk}")
        self.prompt_chunk = prompt_chunk
        self.session = self.model.new_session(self.max_context)
        self.tokens: list[int] = []   # what the session's KV holds, position by position
        # recurrent state resumes from checkpoints, by the rule the pipeline follows (checkpoints.py)
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.checkpoints = CheckpointStore()
        # decode steps as one device graph where the backend has one for this model (CuPy)
        self.decode_graph = self.backend.decode_graph(self.model, self.max_context)
        # a GPU chunk's buffers in one fixed layout, allocated once (strata_dist/rank/prompt_workspace.py)
        self.workspace = None
        if self.backend.on_gpu:
            self.workspace = PromptWorkspace.allocate(self.model.prompt_layout(), prompt_chunk,
                                                      self.backend.xp)
        eos = self.gguf.metadata("tokenizer.ggml.eos_token_id")
        self.eos_id: int | None = None if eos is None else int(eos)

    def _check_fits(self, n_new: int) -> None:
        if self.session.n_past + n_new > self.max_context:
            raise ValueError(f"{self.session.n_past} + {n_new} tokens exceed the context of "
                             f"{self.max_context}")

    def _run(self, ids) -> object:
        """The hidden rows of `ids` after every layer: on a GPU a view of the workspace, read
        before the next call."""
        if self.decode_graph is not None:
            self.decode_graph.settle()     # a decode step launched ahead, before the general path
        with self.workspace.active(self.backend) if self.workspace is not None else nullcontext():
            h = self.model.embed(ids)
            h = self.model.forward_layers(h, self.session)
        self.session.n_past += len(ids)
        return h

    def decode_step(self, token_ids: list[int], ahead: bool = False):
        """Append a few tokens (a decode step); the last position's logits, as a host array or
        (graph path) the device step's StepLogits, which the sampler reads as they are. `ahead`:
        the caller takes the greedy token only and asks for the next step after it."""
        self._check_fits(len(token_ids))
        runner = self.decode_graph
        if runner is not None and runner.usable(len(token_ids)):
            out = runner.step(self.session, self.session.n_past, ids=token_ids, ahead=ahead)
            self.session.n_past += len(token_ids)
            return out
        h = self._run(token_ids)
        return self.backend.to_host(self.model.output_logits(h[-1:]))[0]

    def feed(self, token_ids: list[int]) -> np.ndarray:
        """Append tokens to the session; float32 logits of each of their positions, [n, vocab]."""
        self._check_fits(len(token_ids))
        out = []
        for start in range(0, len(token_ids), self.prompt_chunk):
            h = self._run(token_ids[start:start + self.prompt_chunk])
            out.append(self.backend.to_host(self.model.output_logits(h)).astype(np.float32))
        return np.concatenate(out, axis=0)

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 logits of every position of a fresh sequence, [n, vocab]."""
        if len(token_ids) > self.max_context:
            raise ValueError(f"the {len(token_ids)} tokens exceed the context of "
                             f"{self.max_context} (--max-context)")
        self.checkpoints.enter(self.session, 0)
        self.tokens = []
        return self.feed(token_ids)

    def reusable_prefix(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` the session already holds (at least one token is
        always left to read, since sampling needs its logits)."""
        n = 0
        while n < min(len(prompt), len(self.tokens)) and prompt[n] == self.tokens[n]:
            n += 1
        return min(n, len(prompt) - 1)

    def resume_point(self, prompt: list[int]) -> int:
        """Where `prompt` resumes: the longest usable position <= the reusable prefix (0, the
        session's end, or a checkpoint; any position when the state is positional)."""
        return resume_point(self.reusable_prefix(prompt), self.session.n_past,
                            self.checkpoints.held(self.session))

    def prefill(self, token_ids: list[int], on_chunk: Callable[[int, int, float], None] | None = None,
                checkpoint_at=()):
        """Read a prompt in chunks; returns the last position's logits (host float32).
        `checkpoint_at`: session positions to checkpoint at (chunk boundaries)."""
        self._check_fits(len(token_ids))
        last = None
        if self.session.n_past in checkpoint_at:
            self.checkpoints.save(self.session, self.session.n_past)
        for start in range(0, len(token_ids), self.prompt_chunk):
            t0 = time.perf_counter()
            chunk = token_ids[start:start + self.prompt_chunk]
            h = self._run(chunk)
            if self.session.n_past in checkpoint_at:
                self.checkpoints.save(self.session, self.session.n_past)
            if start + len(chunk) == len(token_ids):
                last = self.backend.to_host(self.model.output_logits(h[-1:]))[0]
            self.backend.synchronize()
            if on_chunk:
                on_chunk(start + len(chunk), len(token_ids), (time.perf_counter() - t0) * 1e3)
        return last

    def stream(self, prompt: list[int], max_new: int, params: SamplingParams = SamplingParams(),
               result: GenerationResult | None = None, resume: bool = False) -> Iterator[int]:
        """Yield generated token ids; fills `result` with timings when given. With resume, the
        part of `prompt` the session already holds is not read again (a chat's follow-up)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_new < 0:
            raise ValueError(f"max_new must be >= 0, got {max_new}")
        # generation stops at the context's end (stop reason "length"), as the pipeline's head
        # bounds it (head.py: ctx - prompt); the tokens made so far are the answer, not an error
        if len(prompt) > self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds "
                             f"{self.max_context} (--max-context)")
        max_new = min(max_new, self.max_context - len(prompt))
        reuse = self.resume_point(prompt) if resume else 0
        self.checkpoints.enter(self.session, reuse)
        at = request_positions(reuse, len(prompt), self.prompt_chunk, self.checkpoint_every)
        self.tokens = list(prompt)
        sampler = Sampler(params)
        res = result or GenerationResult([], len(prompt), 0.0, 0.0, "length")
        res.reused = reuse
        t0 = time.perf_counter()
        logits = self.prefill(prompt[reuse:],
                              on_chunk=lambda pos, tot, ms: res.chunks.append((pos, ms)),
                              checkpoint_at=at)
        res.prompt_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        for i in range(max_new):
            tok = sampler(logits)
            res.tokens.append(tok)
            yield tok
            if tok == self.eos_id:
                res.stop_reason = "stop"
                break
            if i + 1 == max_new:
                break
            self.tokens.append(tok)
            # a step ahead overwrites this row: only when the draw takes its greedy token
            ahead = params.greedy and not params.reshapes_logits and i + 2 < max_new
            logits = self.decode_step([tok], ahead=ahead)
        res.decode_ms = (time.perf_counter() - t1) * 1e3

    def generate(self, prompt: list[int], max_new: int, params: SamplingParams = SamplingParams(),
                 resume: bool = False) -> GenerationResult:
        res = GenerationResult([], len(prompt), 0.0, 0.0, "length")
        for _ in self.stream(prompt, max_new, params, res, resume):
            pass
        return res
