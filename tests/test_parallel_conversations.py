"""--parallel B with --conversation-cache-mib N: a batched server keeps conversations, and a request
resumes from the longest kept prefix of any conversation of its salt while others decode.

Real rank processes (CPU) behind a real `strata-launch --port`, real concurrent HTTP clients: eight
conversations interleaved over four sessions, each follow-up reading only its new tokens, with the
tokens the same requests get read whole, one at a time, from a server without kept conversations.
In process: the shared table's order rules (a report never drops a key a later step kept; a
request waits for the step ahead to be confirmed)."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import numpy as np
import pytest

from server_helpers import ServerProcess
from strata_dist.head.conversation_table import SharedConversationTable

N_NEW = 4          # a first turn's reply
N_FOLLOW = 12      # a follow-up's: long enough that follow-ups decode while others resume
CONVERSATIONS = 8


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    paths = {}
    for like in ("tiny", "tiny-next"):
        paths[like] = str(tmp_path_factory.mktemp("pconv") / f"{like}.gguf")
        write_synthetic(paths[like], like=like, quant="f32")
    return paths


def _body(model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


async def _ask(http, url: str, body: dict, delay: float = 0.0) -> dict:
    await asyncio.sleep(delay)
    r = await http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _conversations(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = [int(x) for x in rng.integers(10, 300, 20)]
    return [system + [int(x) for x in rng.integers(10, 300, 15)] for _ in range(CONVERSATIONS)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("like,args", [
    ("tiny", ("--cpu-ranks", "1")),
    ("tiny", ("--cpu-ranks", "2", "--layer-split", "2")),
    ("tiny-next", ("--cpu-ranks", "2", "--layer-split", "4", "--prompt-cache-every", "16"))])
def test_eight_conversations_over_four_sessions_read_only_their_new_tokens(synth, like, args):
    """Eight first turns at once over `--parallel 4` (four wait for a session; each that takes
    one keeps the conversation it held), then eight follow-ups at once, in another order: each
    resumes at its own conversation's end, kept in whichever session, and reads the 3 new tokens
    and its reply's last; the tokens equal those of a server without kept conversations, one
    request at a time, every prompt read whole."""
    starts = _conversations(7)
    common = ("--vram-budget", "1G", "--max-context", "512", "--prefill", "16", *args)
    server = ServerProcess(synth[like], *common, "--parallel", "4",
                           "--conversation-cache-mib", "16")
    try:
        async def rounds():
            rnd = random.Random(3)
            async with httpx.AsyncClient(timeout=120) as http:
                first = await asyncio.gather(*(
                    _ask(http, server.url, _body(like, p, N_NEW), rnd.uniform(0, 0.05))
                    for p in starts))
                follows = [p + r["choices"][0]["token_ids"] + [5, 6, 7]
                           for p, r in zip(starts, first)]
                order = [3, 6, 0, 5, 2, 7, 1, 4]
                got = await asyncio.gather(*(
                    _ask(http, server.url, _body(like, follows[c], N_FOLLOW),
                         rnd.uniform(0, 0.05)) for c in order))
                return first, follows, dict(zip(order, got))
        first, follows, second = asyncio.run(rounds())
        # the ranks' counters, refreshed every few seconds while idle: 4 conversations at
        # least were in no session when their follow-up came, so every stage restored them
        deadline = time.monotonic() + 15
        while True:
            ranks = httpx.get(server.url + "/v1/status", timeout=10).json()["ranks"]
            restored = [int(r["counters"].get("conversations_restored", 0)) for r in ranks]
            if all(n >= 4 for n in restored) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ranks and all(n >= 4 for n in restored), restored
    finally:
        server.close()
    kept = len(starts[0]) + N_NEW - 1      # each first turn's prompt and reply, less the last
    for c in range(CONVERSATIONS):
        usage, timings = second[c]["usage"], second[c]["timings"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == kept, (c, usage)
        assert timings["prompt_read"] == len(follows[c]) - kept == 4, (c, timings)

    # the reference: no kept conversations, no --parallel, one at a time, read whole
    alone = ServerProcess(synth[like], *common)
    try:
        with httpx.Client(timeout=120) as http:
            def whole(prompt, n):
                r = http.post(alone.url + "/v1/completions",
                              json=_body(like, prompt, n, cache_prompt=False))
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            want_first = [whole(p, N_NEW) for p in starts]
            want_second = [whole(f, N_FOLLOW) for f in follows]
    finally:
        alone.close()
    assert [r["choices"][0]["token_ids"] for r in first] == want_first
    assert [second[c]["choices"][0]["token_ids"] for c in range(CONVERSATIONS)] == want_second


@pytest.mark.timeout(240)
def test_conversations_evicted_and_clients_leaving_mid_stream_lose_nothing(synth):
    """Twelve long conversations over `--parallel 4` with room for a few of them on each stage:
    kept ones are evicted while others restore, and four clients leave mid-stream. Every other
    request is answered with the tokens it gets read whole, nothing hangs, and the server serves
    on."""
    rng = np.random.default_rng(11)
    starts = [[int(x) for x in rng.integers(10, 300, 250)] for _ in range(12)]
    # 512 bytes of K/V per cell on each of the two stages: 1 MiB holds about seven 255-cell
    # conversations
    server = ServerProcess(synth["tiny"], "--cpu-ranks", "2", "--layer-split", "2",
                           "--vram-budget", "1G", "--max-context", "1024", "--prefill", "64",
                           "--parallel", "4", "--conversation-cache-mib", "1",
                           "--queue-size", "64")
    try:
        with httpx.Client(timeout=120) as http:
            def whole(prompt, n):
                r = http.post(server.url + "/v1/completions",
                              json=_body("tiny", prompt, n, cache_prompt=False,
                                         cache_salt="reference"))
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            want_first = [whole(p, N_NEW) for p in starts]
            follows = [p + w + [5, 6, 7] for p, w in zip(starts, want_first)]
            want_second = [whole(f, N_FOLLOW) for f in follows]

        async def leaver(http, prompt):
            body = _body("tiny", prompt, 400, stream=True)
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        return "left"       # gone after its first token: cancelled
            return "ended"

        async def rounds():
            rnd = random.Random(5)
            async with httpx.AsyncClient(timeout=120) as http:
                first = await asyncio.gather(*(
                    _ask(http, server.url, _body("tiny", p, N_NEW), rnd.uniform(0, 0.1))
                    for p in starts))
                order = rnd.sample(range(12), 12)
                got = await asyncio.gather(
                    *(_ask(http, server.url, _body("tiny", follows[c], N_FOLLOW),
                           rnd.uniform(0, 0.3)) for c in order),
                    *(leaver(http, follows[c][:-2] + [9]) for c in (0, 4, 8, 11)))
                after = await _ask(http, server.url, _body("tiny", follows[3], N_FOLLOW))
                return first, dict(zip(order, got[:12])), got[12:], after
        first, second, left, after = asyncio.run(rounds())
        deadline = time.monotonic() + 15
        while True:
            ranks = httpx.get(server.url + "/v1/status", timeout=10).json()["ranks"]
            evicted = [int(r["counters"].get("conversations_evicted", 0)) for r in ranks]
            restored = [int(r["counters"].get("conversations_restored", 0)) for r in ranks]
            if all(n > 0 for n in evicted + restored) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        server.close()
    assert left == ["left"] * 4
    assert [r["choices"][0]["token_ids"] for r in first] == want_first
    assert [second[c]["choices"][0]["token_ids"] for c in range(12)] == want_second
    assert after["choices"][0]["token_ids"] == want_second[3]
    assert all(n > 0 for n in evicted), evicted      # the budget made room as it went
    assert all(n > 0 for n in restored), restored    # and kept ones came back on every stage
    kept = len(starts[0]) + N_NEW - 1
    cached = [second[c]["usage"]["prompt_tokens_details"]["cached_tokens"] for c in range(12)]
    # each from its own conversation's kept end (or, after a leaver of the same conversation,
    # from further on), or read afresh where its conversation was evicted. How many find theirs
    # kept depends on how far the others got when each came (every admission keeps the
    # conversation its session held, evicting the least recently used): on a loaded machine
    # all sixteen queue before the first ends and fewer resume than on an idle one
    assert all(n == 0 or n >= kept for n in cached), cached
    assert any(n >= kept for n in cached), cached


# ---- in process: the shared table's order ---------------------------------------------------------

def _in_thread(fn):
    """Run fn on a thread of its own (a request's), return what it returned."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out[0]


def _until(done, timeout_s: float = 10.0) -> None:
    """Wait for another thread's progress, bounded: one that failed before it fails this wait."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.01)


def test_a_report_never_drops_a_key_a_later_step_kept():
    """Request A (a step-less continuation) reports after request B's step kept a key: the stages
    had not applied B's step when they read A's chunk, so A's report lacks B's key; B's own
    report decides it."""
    t = SharedConversationTable(True)
    a_started, b_done, a_reports = threading.Event(), threading.Event(), threading.Event()

    def a():
        t.begin()
        assert t.step([1, 2], "s", "s", 2, (0, 0), positional=True) is None   # continues
        a_started.set()
        assert b_done.wait(5)
        t.reported([])                  # the stages, at A's chunk: nothing kept yet
        a_reports.set()

    def b():
        assert a_started.wait(5)
        t.begin()
        step = t.step([7, 8, 9], "s", "s", 0, (0, 0), positional=True)      # keeps 7 8 9
        b_done.set()
        assert a_reports.wait(5)
        assert list(t.kept) == [step.keep]      # A's later report kept it
        t.reported([step.keep])
        return step.keep

    ta = threading.Thread(target=a)
    ta.start()
    key = _in_thread(b)
    ta.join(5)
    assert list(t.kept) == [key]
    # a report of B's own order (or later) that lacks its key drops it: a stage had no room
    assert _in_thread(lambda: (t.begin(), t.step([], "s", "s", 0, (0, 0), True),
                               t.reported([]), list(t.kept))[-1]) == []


def test_a_request_waits_until_the_step_ahead_is_confirmed_or_its_request_ends():
    """B picks where it resumes only after A's step (which keeps a conversation, and may evict
    one on a stage) came back confirmed; a request that ends unconfirmed lets the next go too,
    its new key dropped on every stage with the next step."""
    t = SharedConversationTable(True)
    go = threading.Event()
    order: list[str] = []

    def a():
        t.begin()
        step = t.step([1, 2, 3], "s", "s", 0, (0, 0), positional=True)
        assert step.keep
        order.append("a sent")
        assert go.wait(5)
        time.sleep(0.2)
        order.append("a confirmed")
        t.reported([step.keep])

    ta = threading.Thread(target=a)
    ta.start()
    _until(lambda: order)

    def b():
        go.set()
        t.begin()                     # waits for A's report
        order.append("b begins")
        assert t.best([1, 2, 3, 4], "s", positional=True) == (1, 3)
        t.step([], "s", "s", 3, (1, 3), positional=True)
    _in_thread(b)
    ta.join(5)
    assert order == ["a sent", "a confirmed", "b begins"]

    # C's step is never confirmed (its request failed): D's waits end with C's settle, and D's
    # step forgets C's key everywhere
    c_step = []

    def c():
        t.begin()
        c_step.append(t.step([4, 5], "s", "s", 0, (0, 0), positional=True))
        time.sleep(0.2)
        t.settle()
    tc = threading.Thread(target=c)
    tc.start()
    _until(lambda: c_step)
    d = _in_thread(lambda: (t.begin(), t.step([], "s", "s", 0, (0, 0), True))[1])
    tc.join(5)
    assert c_step[0].keep not in t.kept and c_step[0].keep in d.forget
    # a bounded wait: a request ahead that never confirms costs the next one its restore only
    slow = SharedConversationTable(True, wait_s=0.3)
    held = threading.Event()

    def e():
        slow.begin()
        slow.step([1, 2, 3], "s", "s", 0, (0, 0), positional=True)
        held.set()
        time.sleep(2)
    te = threading.Thread(target=e)
    te.start()
    assert held.wait(5)
    t0 = time.monotonic()
    assert _in_thread(lambda: (slow.begin(), slow.best([1, 2, 3, 4], "s", True))[1]) == (0, 0)
    assert time.monotonic() - t0 < 2
    te.join(5)
