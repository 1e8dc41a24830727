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
from server_helpers import ServerProcess
from strata_dist.synth import write_synthetic

KEY = "sk-admission-31f"
RANK_ARGS = ("--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "1024")
QUEUE = 4
GREEDY = {"temperature": 0, "ignore_eos": True}     # every answer runs to max_tokens
CLIENTS = 64
TOKENS = 8

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("admission") / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32")
    return str(path)


@pytest.fixture(scope="module")
def server(model):
    s = ServerProcess(model, *RANK_ARGS, "--queue-size", str(QUEUE), api_key=KEY)
    yield s
    assert s.close() in (0, 130, -signal.SIGTERM)


def status(server) -> dict:
    r = httpx.get(f"{server.url}/v1/status", headers=server.headers, timeout=10)
    assert r.status_code == 200
    return r.json()


def requests_by_outcome(server) -> dict[str, float]:
    r = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples if s.name == "strata_requests_total"}


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
    assert "queue is full" in body["error"]["message"], body
    after = headers["retry-after"]
    assert after.isdigit() and int(after) >= 1, after
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
    kinds = [("chat" if i % 4 == 3 else "completion", i % 2 == 1) for i in range(CLIENTS)]
    alone: dict[tuple, list[int]] = {}
    with httpx.Client(timeout=30, headers=server.headers) as http:
        for i in range(5):
            for kind in ("completion", "chat"):
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                r = http.post(server.url + path, json=body_of(i, kind, False))
                assert r.status_code == 200, r.text
                alone[(i, kind)] = r.json()["choices"][0]["token_ids"]
                assert len(alone[(i, kind)]) == TOKENS
    before = requests_by_outcome(server)

    async def everyone():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=40, headers=server.headers, limits=limits) as http, \
                openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                   timeout=40, http_client=httpx.AsyncClient(limits=limits)) as api:
            tasks = []
            for i, (kind, stream) in enumerate(kinds):
                body = body_of(i, kind, stream)
                tasks.append(_openai_client(api, body, kind) if i % 4 in (0, 1)
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
    after = requests_by_outcome(server)
    assert after["ok"] - before["ok"] == len(served)
    assert after["rejected"] - before["rejected"] == len(refused)
    assert after["error"] == before["error"] and after["cancelled"] == before["cancelled"]
    assert status(server)["queue"] == {"waiting": 0, "capacity": QUEUE, "running": 0}


# ---- Retry-After, clients that leave ----------------------------------------------------------------

def _stream(http: httpx.Client, server, max_tokens: int, prompt: str = "a long story"):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}
    r = http.send(http.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
    assert r.status_code == 200
    return r


def _wait_queue(server, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (q := status(server)["queue"])["running"] != running or q["waiting"] != waiting:
        assert time.monotonic() < deadline, q
        time.sleep(0.02)


def test_retry_after_is_when_the_queue_drains(server):
    """The 429's Retry-After is the time the requests ahead take (their max tokens at the measured
    rate): measured here against the time the running request and the four waiting behind it
    really take to finish, with work for about 4 s on whatever machine runs the test."""
    with httpx.Client(timeout=60, headers=server.headers) as http:
        r = http.post(f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "warm", "max_tokens": 64, **GREEDY})
        tps = r.json()["timings"]["decode_tokens_per_second"]
        each = max(20, int(tps * 4.0 / (QUEUE + 1)))
        streams = [_stream(http, server, each)]
        _wait_queue(server, 1, 0)
        streams += [_stream(http, server, each, f"waiting {k}") for k in range(QUEUE)]
        _wait_queue(server, 1, QUEUE)
        time.sleep(0.3)          # the running request's rate is measured over a few tokens
        r = http.post(f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "one too many", "max_tokens": 4})
        t0 = time.monotonic()
        retry_after = check_429(r.status_code, r.headers, r.json())
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
    assert drained > 2.0, (drained, each, tps)     # long enough for the hint to be told apart from 1
    assert drained / 2 <= retry_after <= 2 * drained + 1, (retry_after, drained, each, tps)
