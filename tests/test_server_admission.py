"""Admission under load on a real `strata-launch --port` (real CPU ranks, real HTTP): many clients at
once each get a full answer or a 429 with an OpenAI error body and a Retry-After that says when the
queue will have drained; a client that leaves while queued costs nothing; a server that is loading
or lost a rank answers 503, as /health does."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch_helpers import launcher_children
from protocol.auth import write_secret
from server_helpers import ServerProcess, server_fixture, tiny_model_fixture
from strata_dist.synth import write_synthetic

KEY = "sk-admission-31f"
RANK_ARGS = ("--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "8192")
QUEUE = 4
GREEDY = {"temperature": 0, "ignore_eos": True}     # every answer runs to max_tokens
CLIENTS = 64
TOKENS = 8

pytestmark = pytest.mark.timeout(90)


model = tiny_model_fixture("admission")
server = server_fixture(*RANK_ARGS, "--queue-size", str(QUEUE), api_key=KEY, clean_exit=True)


def status(server) -> dict:
    r = httpx.get(f"{server.url}/v1/status", headers=server.headers, timeout=10)
    assert r.status_code == 200
    return r.json()


def scrape(server) -> dict[str, float]:
    """/metrics by sample name; strata_requests_total by its outcome label."""
    r = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.labels["outcome"] if s.name == "strata_requests_total" else s.name] = s.value
    return out


def requests_by_outcome(server) -> dict[str, float]:
    m = scrape(server)
    return {k: m[k] for k in ("ok", "error", "cancelled", "rejected", "unavailable") if k in m}


def body_of(i: int, kind: str, stream: bool) -> dict:
    prompt = f"client number {i % 5} asks"
    body = {"model": "tiny", "max_tokens": TOKENS, "stream": stream, **GREEDY}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def check_429(code: int, headers, body: dict) -> int:
    assert code == 429, (code, body)
    assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error", body
    after = headers["retry-after"]
    assert after.isdigit() and int(after) >= 1, after
    # the generation queue is full, or (a chat) the chat-template renderers and their wait list
    assert "the queue is full" in body["error"]["message"] \
        or "chat-template renderers are busy" in body["error"]["message"], body
    assert f"retry in {after} s" in body["error"]["message"], body
    return int(after)


async def _http_client(http: httpx.AsyncClient, url: str, body: dict, kind: str) -> tuple:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not body["stream"]:
        r = await http.post(url + path, json=body)
        if r.status_code != 200:
            return ("refused", check_429(r.status_code, r.headers, r.json()))
        choice = r.json()["choices"][0]
        return ("served", choice["token_ids"], choice["finish_reason"])
    async with http.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return ("refused", check_429(r.status_code, r.headers, json.loads(await r.aread())))
        ids, finish, done = [], None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                choice = chunk["choices"][0]
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
        assert done, "the stream ended without [DONE]"
        return ("served", ids, finish)


async def _openai_client(api: openai.AsyncOpenAI, body: dict, kind: str) -> tuple:
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    create = api.chat.completions.create if kind == "chat" else api.completions.create
    try:
        out = await create(**body, extra_body=extra)
    except openai.RateLimitError as e:
        return ("refused", check_429(e.status_code, e.response.headers, e.response.json()))
    if not body["stream"]:
        return ("served", out.choices[0].model_extra["token_ids"], out.choices[0].finish_reason)
    ids, finish = [], None
    async for chunk in out:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
    return ("served", ids, finish)


def test_sixty_four_clients_get_an_answer_or_a_429(server):
    """64 clients at once (plain HTTP and the official client, streaming and not, chat and
    completions) against a queue of 4: each gets its whole answer — the tokens the same request gets
    served alone — or a 429 with an OpenAI error and a Retry-After; none hangs, none gets a 500 or a
    reset connection, and /metrics counts every one of them once."""
    # client i: the official client when i % 8 < 4, chat when i % 4 >= 2, streaming when i is odd
    # (eight of each of the eight kinds; 32 chats at once are more than the chat-template
    # renderers take, so some are refused before the queue)
    kinds = [("chat" if i % 4 >= 2 else "completion", i % 2 == 1) for i in range(CLIENTS)]
    alone: dict[tuple, list[int]] = {}
    with httpx.Client(timeout=30, headers=server.headers) as http:
        for i in range(5):
            for kind in ("completion", "chat"):
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                r = http.post(server.url + path, json=body_of(i, kind, False))
                assert r.status_code == 200, r.text
                alone[(i, kind)] = r.json()["choices"][0]["token_ids"]
                assert len(alone[(i, kind)]) == TOKENS
    before = scrape(server)

    async def everyone():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=40, headers=server.headers, limits=limits) as http, \
                openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                   timeout=40, http_client=httpx.AsyncClient(limits=limits)) as api:
            tasks = []
            for i, (kind, stream) in enumerate(kinds):
                body = body_of(i, kind, stream)
                tasks.append(_openai_client(api, body, kind) if i % 8 < 4
                             else _http_client(http, server.url, body, kind))
            # every client is answered within a bound: a hung one fails the test here
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    t0 = time.monotonic()
    outcomes = asyncio.run(everyone())
    took = time.monotonic() - t0
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    served = [i for i, o in enumerate(outcomes) if o[0] == "served"]
    refused = [i for i, o in enumerate(outcomes) if o[0] == "refused"]
    assert len(served) + len(refused) == CLIENTS
    assert len(served) > QUEUE and refused, (len(served), len(refused), took)
    for i in served:
        _, ids, finish = outcomes[i]
        assert finish == "length", (i, kinds[i], finish)
        assert ids == alone[(i % 5, kinds[i][0])], (i, kinds[i])
    after = scrape(server)
    assert after["ok"] - before["ok"] == len(served)
    assert after["rejected"] - before["rejected"] == len(refused)
    for outcome in ("error", "cancelled", "unavailable"):
        assert after[outcome] == before[outcome], outcome
    # each served request's wait in the queue, first token and last token are in the histograms
    for histogram in ("strata_queue_wait_seconds", "strata_time_to_first_token_seconds",
                      "strata_request_latency_seconds"):
        assert after[f"{histogram}_count"] - before[f"{histogram}_count"] == len(served), histogram
    assert after["strata_inter_token_latency_seconds_count"] \
        - before["strata_inter_token_latency_seconds_count"] == len(served) * (TOKENS - 1)
    queue = status(server)["queue"]
    assert {k: v for k, v in queue.items() if k != "sessions"} == {
        "waiting": 0, "capacity": QUEUE, "running": 0}
    assert all(s["request"] is None for s in queue["sessions"]), queue   # every session idle


# A ChatML template that first counts to 20,000 (about 0.15 s a render, under the 1 s a render
# may take): a burst of chats keeps every chat-template renderer busy long enough to fill their
# wait list on any machine.
SLOW_TEMPLATE = (
    "{%- set ns = namespace(n=0) %}{%- for i in range(20000) %}{%- set ns.n = ns.n + 1 %}{%- endfor %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_chats_past_the_template_renderers_get_429(tmp_path):
    """30 chats at once against a slow chat template and a queue with room for all: those
    past the renderers and their wait list are refused with a 429 and a Retry-After (not a 503:
    the server is loaded, not broken), the rest are served, and /metrics counts each once."""
    import strata_dist.synth.tokenizer as synth_tokenizer

    path = tmp_path / "tiny.gguf"      # the model id is the file name
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synth_tokenizer, "CHAT_TEMPLATE", SLOW_TEMPLATE)
        write_synthetic(path, like="tiny", quant="f32")
    s = ServerProcess(str(path), *RANK_ARGS, "--queue-size", "64", api_key=KEY)
    try:
        async def burst():
            limits = httpx.Limits(max_connections=30, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=40, headers=s.headers, limits=limits) as http:
                tasks = [_http_client(http, s.url, body_of(i, "chat", i % 2 == 1), "chat")
                         for i in range(30)]
                return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

        outcomes = asyncio.run(burst())
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        served = [o for o in outcomes if o[0] == "served"]
        refused = [o for o in outcomes if o[0] == "refused"]
        assert served and refused, (len(served), len(refused))
        assert all(o[2] == "length" and len(o[1]) == TOKENS for o in served), served
        counts = requests_by_outcome(s)
        assert counts["ok"] == len(served) and counts["rejected"] == len(refused), counts
        assert counts["error"] == counts["unavailable"] == counts["cancelled"] == 0, counts
    finally:
        s.close()


# ---- Retry-After, clients that leave ----------------------------------------------------------------

def _stream(http: httpx.Client, server, max_tokens: int, prompt: str | list[int] = "a long story",
            n: int = 1):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "n": n,
            **GREEDY}
    r = http.send(http.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
    assert r.status_code == 200
    return r


def _wait_queue(server, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (q := status(server)["queue"])["running"] != running or q["waiting"] != waiting:
        assert time.monotonic() < deadline, q
        time.sleep(0.02)


PROMPT_IDS = 4


def _running(server, timeout: float = 10.0) -> tuple[int, float]:
    """The running request's tokens so far (of every choice) and its decode rate, as the server
    measures them (/v1/status), once it has made a few tokens."""
    deadline = time.monotonic() + timeout
    while True:
        running = status(server)["throughput"]["running"]
        if running and running["tokens"] >= 8 and running["tokens_per_second"] > 0:
            return int(running["tokens"]), float(running["tokens_per_second"])
        assert time.monotonic() < deadline, running
        time.sleep(0.05)


@pytest.mark.parametrize("n", [1, 4])
def test_retry_after_is_when_the_queue_drains(server, n):
    """The 429's Retry-After is the time the requests ahead take: their max tokens (each of their
    n choices) less what the running one has made, at the rate the server measures. The bound is
    what the server itself measured around the 429 (the running request's tokens and rate read
    from /v1/status just before and after it), not the wall clock, which a loaded machine
    stretches; the waiting requests are sized from that rate to ~4 s of work, so a hint that
    leaves out waiting requests, their n choices or the running one's rest falls outside it.
    And the hint is never far past the real drain (a loaded machine only lengthens that)."""
    with httpx.Client(timeout=60, headers=server.headers) as http:
        r = http.post(f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "warm", "max_tokens": 64, **GREEDY})
        warm = r.json()["timings"]       # the last request finished when the 429 comes
        tps = warm["decode_tokens_per_second"]
        # the running request: ~2 s at the warm-up's rate (room for that rate to be off by 2),
        # still running when the queue is filled and the 429 asked for
        running_max = max(40, int(tps * 2.0 / n))
        streams = [_stream(http, server, running_max, n=n)]
        _wait_queue(server, 1, 0)
        _, rate = _running(server)
        each = max(20, int(rate * 4.0 / QUEUE / n))
        # prompts of PROMPT_IDS ids each: the prompt time ahead is known exactly
        streams += [_stream(http, server, each, [30 + 10 * k + i for i in range(PROMPT_IDS)], n)
                    for k in range(QUEUE)]
        _wait_queue(server, 1, QUEUE)
        made_before, rate_before = _running(server)
        r = http.post(f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "one too many", "max_tokens": 4})
        t0 = time.monotonic()
        retry_after = check_429(r.status_code, r.headers, r.json())
        made_after, rate_after = _running(server)
        ends: list[float] = []

        def read(s):
            for line in s.iter_lines():
                if line == "data: [DONE]":
                    ends.append(time.monotonic())
            s.close()

        readers = [threading.Thread(target=read, args=(s,)) for s in streams]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert len(ends) == QUEUE + 1
        drained = max(ends) - t0
    waiting = QUEUE * each * n
    fewest = waiting + running_max * n - made_after       # tokens ahead at the 429, at least
    most = waiting + running_max * n - made_before        # ... and at most
    slow, fast = min(rate_before, rate_after), max(rate_before, rate_after)
    # the waiting prompts at the last finished request's read rate (the warm-up's)
    prompts_s = (QUEUE * PROMPT_IDS / warm["prompt_tokens_per_second"]
                 if warm["prompt_tokens_per_second"] > 0 else 0.0)
    # 10% for the rate's drift between the readings and the 429, a second for the rounding up
    low = fewest / (1.1 * fast) + prompts_s
    high = most / (0.9 * slow) + prompts_s + 1
    said = (retry_after, low, high, drained, each, rate_before, rate_after, made_before, made_after)
    assert low >= 3, said                   # enough work that the hint tells apart from 1
    assert low <= retry_after <= high, said
    assert retry_after <= 2 * drained + 1, said


def test_clients_that_leave_while_queued_cost_nothing(server):
    """Three clients leave while they wait behind a long generation (a plain-HTTP stream closed,
    the official client's chat stream closed, a non-streaming client whose read times out): each
    leaves the queue at once, while the generation ahead still runs, never starts, and is counted
    as cancelled; the next request does not wait for them."""
    before = status(server)["requests"]
    with httpx.Client(timeout=30, headers=server.headers) as http:
        running = _stream(http, server, 8000, "running")
        _wait_queue(server, 1, 0)
        plain = _stream(http, server, 50, "plain")
        api = server.client(timeout=30)
        chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=50, stream=True, extra_body=GREEDY)
        gave_up: list[BaseException] = []

        def impatient():
            try:
                httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                           json={"model": "tiny", "prompt": "impatient", "max_tokens": 50, **GREEDY},
                           timeout=httpx.Timeout(10.0, read=1.0))
            except httpx.ReadTimeout as e:
                gave_up.append(e)

        t = threading.Thread(target=impatient)
        t.start()
        _wait_queue(server, 1, 3)
        plain.close()
        chat.close()
        t.join(10)
        assert gave_up
        _wait_queue(server, 1, 0, timeout=3.0)     # gone while the long one still runs
        rows = sorted(status(server)["recent_requests"], key=lambda row: row["number"])[-4:]
        assert rows[0]["state"] == "running", rows
        for row in rows[1:]:
            assert row["state"] == "cancelled" and row["generated_tokens"] == 0, row
            assert "waited_s" not in row, row      # it never started
        after = status(server)["requests"]
        assert after["requests_cancelled"] == before["requests_cancelled"] + 3
        running.close()
        _wait_queue(server, 0, 0, timeout=3.0)
        t0 = time.monotonic()
        r = http.post(f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "next", "max_tokens": 3, **GREEDY})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert time.monotonic() - t0 < 3.0
    after = status(server)["requests"]
    assert after["requests_cancelled"] == before["requests_cancelled"] + 4
    assert after["generated_tokens"] == before["generated_tokens"] + 3


# ---- 503 while the server cannot serve ------------------------------------------------------------

def check_503(code: int, body: dict) -> None:
    assert code == 503, (code, body)
    err = body["error"]
    assert err["type"] == "server_error" and err["code"] == "unavailable", body
    assert err["message"].startswith("not ready: "), body


def test_requests_while_loading_get_503_as_health_does(model, tmp_path):
    """Before any rank has registered (they are started by hand and never come), every request —
    streaming or not, through the official client too — is refused with a 503 that says the
    server is loading, as /health says, and counted as unavailable in /metrics."""
    token = tmp_path / "token"
    write_secret(str(token), "a" * 48)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = ServerProcess(model, "--listen", str(port), "--expect-ranks", "2", "--token-file", str(token),
                      "--layer-split", "2", "--max-context", "1024", api_key=KEY, wait=False)
    try:
        with httpx.Client(timeout=10, headers=s.headers) as http:
            health = http.get(f"{s.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            for stream in (False, True):
                r = http.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "x",
                                                                "max_tokens": 2, "stream": stream})
                check_503(r.status_code, r.json())
                assert "loading" in r.json()["error"]["message"]
            with pytest.raises(openai.InternalServerError) as e:
                s.client().chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
            check_503(e.value.status_code, e.value.response.json())
            assert http.get(f"{s.url}/health").status_code == 503
            assert requests_by_outcome(s)["unavailable"] == 3
    finally:
        s.close()


def test_a_dead_rank_fails_what_it_held_then_503_until_reloaded(model):
    """With --restart-ranks, killing a rank mid-generation ends the running stream and the one
    waiting behind it with a 503 error naming the rank; while fresh ranks load, a request gets 503
    whenever /health (asked just before and just after) says 503, and is served when it says 200.
    Every request shows once in /metrics."""
    s = ServerProcess(model, *RANK_ARGS, "--queue-size", "2", "--restart-ranks", "1", api_key=KEY)
    try:
        ranks = launcher_children(s.proc.pid)
        sent = 0
        with httpx.Client(timeout=30, headers=s.headers) as http:
            held = [_stream(http, s, 8000, "running")]
            _wait_queue(s, 1, 0)
            held.append(_stream(http, s, 8, "queued"))
            _wait_queue(s, 1, 1)
            sent += 2
            os.kill(ranks[1], signal.SIGKILL)
            for r in held:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                r.close()
                assert lines[-1] == "data: [DONE]", lines[-3:]
                err = json.loads(lines[-2][6:])["error"]
                assert err["code"] == "unavailable" and "rank" in err["message"], err
            pairs = []
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                first = http.get(f"{s.url}/health")
                r = http.post(f"{s.url}/v1/completions",
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2, **GREEDY})
                sent += 1
                last = http.get(f"{s.url}/health")
                pairs.append((first.status_code, r.status_code, last.status_code, r.json()))
                if r.status_code == 200:
                    break
            for before, code, after, body in pairs:
                assert code in (200, 503), body
                if before == after:
                    assert code == before, (before, code, after, body)
                if code == 503:
                    check_503(code, body)
            unavailable = [p for p in pairs if p[0] == p[2] == p[1] == 503]
            assert unavailable and pairs[-1][1] == 200, pairs[-3:]
            assert pairs[-1][3]["usage"]["completion_tokens"] == 2
        counts = requests_by_outcome(s)
        assert sum(counts.values()) == sent, (counts, sent)
        assert counts["error"] == 2 and counts["ok"] == 1, counts
        assert counts["unavailable"] == len(pairs) - 1, counts
    finally:
        s.close()
