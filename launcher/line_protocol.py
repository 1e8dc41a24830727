"""`--serve`: the stdin/stdout line protocol for scripted runs (README.md, under `strata-launch`).

    INFO key=value …            startup facts (one line for the run, one per rank)
    READY <ctx>
    GEN <max_new> [key=val …] <id> <id> …   ->  RESUME <n>, PP <pos> <total> <ms> <tok/s> per
                                                prompt chunk, T <id> per token, then
                                                DONE <gen> <prompt> <prompt_ms> <decode_ms>
                                                <stop|length|cancelled>
                                                (with --spec K > 0, `STATS drafted=<d>
                                                accepted=<a>` before DONE: its drafts)
    STATS                       ->  STATS rank=<r> key=value … per rank, then STATS END
    CANCEL                      the running GEN ends early (its DONE says cancelled)
    QUIT
Lines are served in order: QUIT and the end of input come after every GEN before them, each
answered in full; only CANCEL (or SIGINT, LineProtocol.interrupt) cuts a generation short.
Errors answer `ERR <message>`. The session keeps its tokens between GENs: a GEN whose ids extend
them reads only the new part."""
from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from typing import TextIO

from strata_dist.head.coordinator import RankFailure, RequestError
from strata_dist.head.session import HeadSession, Outcome
from strata_dist.sampling.sampler import SamplingParams

SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int,
                 "stats": int}
# a SIGINT this soon after one that cancelled a generation ends the run (a double Ctrl-C)
SECOND_INTERRUPT_S = 2.0
TIER_COUNTERS = ("hits", "remote", "host", "remote_lost", "helper_requests", "streamed",
                 "loan_overflow_bytes", "graph_steps", "prompt_layers_on_device")


class GenRequest:
    def __init__(self, max_new: int, ids: list[int], options: dict):
        self.max_new, self.ids, self.options = max_new, ids, options

    def sampling(self) -> SamplingParams:
        o = self.options   # greedy unless the line says otherwise
        return SamplingParams(temperature=o.get("temperature", 0.0), top_k=o.get("top_k", 0),
                              top_p=o.get("top_p", 1.0), min_p=o.get("min_p", 0.0),
                              seed=o.get("seed"))


def parse_gen(line: str) -> GenRequest:
    parts = line.split()
    if len(parts) < 3:
        raise ValueError("GEN wants: GEN <max_new> [key=val …] <id> <id> …")
    try:
        max_new = int(parts[1])
    except ValueError:
        raise ValueError(f"max_new '{parts[1]}' is not an integer") from None
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    options, ids = {}, []
    for tok in parts[2:]:
        if "=" in tok and ids:
            raise ValueError(f"option '{tok}' after the token ids: options come first "
                             f"(GEN <max_new> [key=val …] <id> <id> …)")
        if "=" in tok:
            key, _, value = tok.partition("=")
            if key not in SAMPLING_KEYS:
                raise ValueError(f"unknown option '{key}' (known: {', '.join(SAMPLING_KEYS)})")
            try:
                options[key] = SAMPLING_KEYS[key](value)
            except ValueError:
                kind = "an integer" if SAMPLING_KEYS[key] is int else "a number"
                raise ValueError(f"option {key}='{value}' is not {kind}") from None
            continue
        try:
            ids.append(int(tok))
        except ValueError:
            raise ValueError(f"token id '{tok}' is not an integer") from None
    if not ids:
        raise ValueError("GEN has no token ids")
    req = GenRequest(max_new, ids, options)
    req.sampling()   # refused here, at parse, rather than by a rank mid-request
    return req


class LineProtocol:
    def __init__(self, session: HeadSession, out: TextIO = sys.stdout):
        self.session = session
        self.coord = session.coord
        self.out = out
        self.failure = ""     # why run() ended with 1 (a dead rank)
        self._lines: "queue.Queue[str | None] | None" = None
        self._pending: "collections.deque[str | None]" = collections.deque()  # read ahead
        self._generating = False
        self._interrupted = False          # a SIGINT cancelled the running generation
        self._last_interrupt = float("-inf")

    def _next_line(self, timeout: float) -> str | None:
        if self._pending:
            return self._pending.popleft()
        return self._lines.get(timeout=timeout)

    def interrupt(self) -> bool:
        """SIGINT: whether it was taken as a CANCEL of the running generation. It is not (the
        caller then ends the run) while no generation runs, when a SIGINT already cancelled this
        one, or within SECOND_INTERRUPT_S of the last SIGINT that cancelled."""
        now = time.monotonic()
        if (not self._generating or self._interrupted
                or now - self._last_interrupt < SECOND_INTERRUPT_S):
            return False
        self._interrupted, self._last_interrupt = True, now
        return True

    def _cancel_requested(self) -> bool:
        """Whether the running generation is to end now: a SIGINT, or a CANCEL line read ahead
        before any later GEN (a CANCEL behind a queued GEN is that one's). The CANCEL is taken
        out; every other line read ahead is kept, in order. QUIT and the end of input cancel
        nothing: they are served after the generation, as lines are."""
        if self._interrupted:
            return True
        if self._lines is None:
            return False
        while True:
            try:
                self._pending.append(self._lines.get_nowait())
            except queue.Empty:
                break
        for i, line in enumerate(self._pending):
            if line is None or line.strip() == "QUIT" or line.split()[:1] == ["GEN"]:
                return False
            if line.strip() == "CANCEL":
                del self._pending[i]
                return True
        return False

    def say(self, line: str) -> None:
        """One protocol line: an error message that spans lines (a rank's last log lines) is
        joined with " | ", so a reader never takes its tail for the next answer."""
        self.out.write(" | ".join(part for part in line.splitlines() if part.strip()) + "\n")
        self.out.flush()

    def run(self, lines: "queue.Queue[str | None]") -> int:
        """Answer lines in order until QUIT or end of input (every GEN before them answered in
        full); a dead rank ends the run (returns 1)."""
        self._lines = lines
        while True:
            try:
                line = self._next_line(timeout=0.5)
            except queue.Empty:
                try:
                    self.coord.idle(0.0)
                except RankFailure as e:
                    return self._fail(e)
                continue
            if line is None or line.strip() == "QUIT":
                return 0
            if isinstance(line, OverlongLine):
                self.say(f"ERR a line longer than {line.limit} bytes (a GEN of the whole context "
                         f"fits): dropped")
                continue
            line = line.strip()
            if not line or line == "CANCEL":   # CANCEL with nothing running: it came too late
                continue
            if line == "STATS":
                try:
                    self.stats()
                except RankFailure as e:
                    return self._fail(e)
                continue
            if line.split()[0] != "GEN":
                self.say(f"ERR unknown command '{line.split()[0]}' (GEN, STATS, CANCEL or QUIT)")
                continue
            try:
                self.generate(parse_gen(line))
            except (ValueError, RequestError) as e:
                self.say(f"ERR {e}")
            except RankFailure as e:
                return self._fail(e)

    def _fail(self, e: RankFailure) -> int:
        """A dead rank ends the run: ERR to the client, and the reason kept for the launcher's
        stderr (a client's stdout is not where an operator looks)."""
        self.failure = str(e)
        self.say(f"ERR {e}")
        return 1

    def stats(self) -> None:
        """One `STATS rank=<r> key=value …` line per rank (its counters since start), then END."""
        for rank, reply in sorted(self.coord.stats().items()):
            fields = " ".join(f"{k}={v}" for k, v in sorted(reply.counters.items()))
            self.say(f"STATS rank={rank} {fields}")
        self.say(f"STATS head forged_dropped={self.coord.seal.rejected}")
        self.say("STATS END")

    def generate(self, req: GenRequest) -> Outcome:
        """With option stats=1, `STATS rank=<r> hits=… remote=… host=…` lines (this request's
        deltas per rank) come before DONE."""
        o = req.options
        before = self.coord.stats() if o.get("stats") else None
        self._generating, self._interrupted = True, False
        try:
            out = self.session.generate(
                req.ids, req.max_new, req.sampling(),
                on_resume=lambda n: self.say(f"RESUME {n}"),
                on_progress=lambda pos, total, ms, tps: self.say(f"PP {pos} {total} {ms:.1f} "
                                                                 f"{tps:.1f}"),
                on_token=lambda t: self.say(f"T {t}"),
                should_cancel=self._cancel_requested)
        finally:
            self._generating = False
        if before is not None:
            for rank, reply in sorted(self.coord.stats().items()):
                old = before[rank].counters if rank in before else {}
                delta = {k: reply.counters.get(k, 0) - old.get(k, 0) for k in TIER_COUNTERS}
                self.say(f"STATS rank={rank} " + " ".join(f"{k}={v}" for k, v in delta.items()))
        if self.session.spec.k:
            self.say(f"STATS drafted={out.drafted} accepted={out.accepted}")
        self.say(f"DONE {len(out.tokens)} {out.read} {out.prompt_ms:.1f} {out.decode_ms:.1f} "
                 f"{out.reason}")
        return out


def max_line_bytes(max_context: int) -> int:
    """The longest line read: a GEN of a whole context of ids (at most 16 bytes an id, an id and
    its separator are 7 for a 300k vocabulary) and its options. A longer line is dropped unread
    (ERR), so a stream without newlines (`< /dev/zero`) costs this much memory, not all of it."""
    return 16 * max_context + 4096


class OverlongLine(str):
    """Stands for a line longer than the reader's bound, dropped: answered with ERR."""

    def __new__(cls, limit: int):
        line = super().__new__(cls, "")
        line.limit = limit
        return line


def stdin_lines(stream: TextIO = sys.stdin,
                max_line: int = max_line_bytes(1 << 20)) -> "queue.Queue[str | None]":
    """Lines from a stream on a thread, so the head keeps watching its ranks while it waits.

    The stream is read as bytes and each line decoded on its own: a byte that is not UTF-8 turns
    into U+FFFD, which no command accepts, so that line gets ERR and the next ones are served (a
    strict text decoder would kill this thread and leave QUIT and EOF unanswered). A line longer
    than `max_line` bytes becomes an OverlongLine, its bytes read and dropped up to its newline."""
    q: "queue.Queue[str | None]" = queue.Queue()
    raw = getattr(stream, "buffer", stream)

    def pump() -> None:
        try:
            while line := raw.readline(max_line + 1):
                newline = b"\n" if isinstance(line, bytes) else "\n"
                if len(line) > max_line and not line.endswith(newline):
                    q.put(OverlongLine(max_line))
                    while (rest := raw.readline(max_line + 1)) and not rest.endswith(newline):
                        pass
                    continue
                q.put(line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line)
        except (OSError, ValueError):   # a terminal hung up, a stream closed under us: the end
            pass
        q.put(None)

    threading.Thread(target=pump, daemon=True, name="stdin").start()
    return q


def info_lines(plan, ready: dict[int, dict], ranks_devices: list, ctx: int, extra: dict) -> list[str]:
    """INFO lines: the run's totals, then one line per rank."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    head = dict(extra)
    head.update(ranks=len(ranks_devices), stages=len(plan.stages), ctx=ctx, prefill=plan.prompt_chunk,
                expert_slots=plan.expert_slots, expert_slots_stages=plan.expert_slots_stages,
                expert_slots_primary=plan.expert_slots_primary,
                expert_cache_mib=f"{plan.expert_cache_mib:.1f}",
                expert_cache_primary_mib=f"{plan.expert_cache_primary_mib:.1f}",
                predicted_ms_per_token=f"{plan.predicted_ms_per_token:.3f}")
    lines = ["INFO " + " ".join(f"{k}={v}" for k, v in head.items())]
    stage_of = {st.device.index: st for st in plan.stages}
    helper_of = {h.device.index: h for h in plan.live_helpers}
    for rank, dev in enumerate(ranks_devices):
        st, h = stage_of.get(rank), helper_of.get(rank)
        alloc = ready.get(rank, {})
        role = ("stage+helper" if h else "stage") if st else "helper"
        fields = dict(rank=rank, role=role, device=dev.name.replace(" ", "_"),
                      lb=st.lb if st else "-", le=st.le if st else "-",
                      weights_mib=mib(alloc.get("weights", 0)), session_mib=mib(alloc.get("session", 0)),
                      loan_mib=mib(st.loan_bytes if st else 0), cache_mib=mib(st.cache_bytes if st else 0),
                      helper_mib=mib(h.bytes if h else 0), free_mib=mib(dev.free_bytes),
                      total_mib=mib(dev.total_bytes))
        if st is not None and st.conversation_bytes:   # kept conversations: carved as priced
            fields.update(conversation_bytes=alloc.get("conversations", 0),
                          conversation_priced_bytes=st.conversation_bytes,
                          conversation_in=st.conversation_in)
        lines.append("INFO " + " ".join(f"{k}={v}" for k, v in fields.items()))
    return lines


__all__ = ["LineProtocol", "OverlongLine", "info_lines", "max_line_bytes", "parse_gen",
           "stdin_lines"]
