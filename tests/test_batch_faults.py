"""Faults and bookkeeping of batched decode (--parallel; strata_dist/head/batch_scheduler.py,
strata_dist/server/parallel.py): step timeouts that tell a queued request from a silent pipeline,
per-job running state and rank stats on /v1/status, a Cancel the last stage must answer. Real
CPU ranks through the launcher, real HTTP clients."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from protocol import Cancel, Channel, PromptProgress, Token, Tokens
from protocol.messages import Sampling
from pumped_scheduler import Pumped, cpu_launch, until
from server_helpers import ServerProcess
from strata_dist.head.coordinator import RankFailure, RequestError
from strata_dist.server.worker import STATS_EVERY_S, STATS_TIMEOUT_S
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep
from strata_dist.synth import write_synthetic

LONG_PROMPT = 16000     # tokens: several seconds of prompt on two CPU stages
# a step timeout a loaded machine (CI runs the suite on 2 cores beside other work) still answers
# every step of a short request within, and of which several pass while the long prompt is read
QUEUED_TIMEOUT_S = 1.0
READING_TIMEOUT_S = 60.0   # the long prompt's own: its chunks are real work, never the point here


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="f32")
    return str(path)


@pytest.fixture(scope="module")
def pipeline(synth):
    """Two CPU stage ranks through the launcher, and a scheduler over them."""
    with cpu_launch(synth, 2, [2], LONG_PROMPT + 64, sessions=2) as launched:
        yield launched


@pytest.mark.timeout(120)
def test_a_request_queued_behind_a_long_prompt_is_not_timed_out(pipeline):
    """B waits (no message of its own) while A's long prompt takes many of B's step timeouts to
    read: both finish, and nobody declares the healthy ranks failed."""
    launch, plan = pipeline
    pumped = Pumped(launch.coordinator, plan.prompt_chunk)
    out: dict = {}
    try:
        long = [int(x) for x in np.random.default_rng(1).integers(10, 300, LONG_PROMPT)]
        a = pumped.request(0, long, READING_TIMEOUT_S, out, "a")
        time.sleep(0.1)
        b = pumped.request(1, [5, 6, 7], QUEUED_TIMEOUT_S, out, "b")
        a.join(100)
        b.join(100)
    finally:
        pumped.stop()
    assert out["a"][:2] == ("ok", "length"), out
    assert out["b"][:2] == ("ok", "length"), out
    assert out["b"][2] > 3 * QUEUED_TIMEOUT_S, f"b was not queued behind a long prompt: {out}"
    assert not pumped.failure


@pytest.mark.timeout(120)
def test_a_request_the_pipeline_stops_answering_fails_alone(pipeline):
    """A's prompt stops on the first stage (a Cancel sent to that stage alone drops its chunks
    there: the last stage never hears of A again) while B decodes on: A fails alone after its
    step timeout, B runs on until its client cancels it, and the ranks are not declared
    failed."""
    launch, plan = pipeline
    coord = launch.coordinator
    first = next(s for s in coord.ranks if s.assign is not None and s.assign.first)
    to_first = Channel("push", peer=f"rank {first.rank}")
    to_first.connect(first.data_endpoint).seal_tcp(coord.seal)
    pumped = Pumped(coord, plan.prompt_chunk)
    out: dict = {}
    b_tokens: list = []
    b_cancel = threading.Event()
    cut = threading.Event()

    def a_event(event):   # A's first chunk came through: the rest stop on the first stage
        if not cut.is_set():
            cut.set()
            to_first.send(Cancel(request_id=event.msg.request_id), timeout_ms=5000)
    try:
        b = pumped.request(1, [5, 6, 7], QUEUED_TIMEOUT_S, out, "b", max_new=LONG_PROMPT,
                           on_event=b_tokens.append, cancel=b_cancel)
        until(lambda: len(b_tokens) > 3)
        long = [int(x) for x in np.random.default_rng(2).integers(10, 300, LONG_PROMPT // 2)]
        a = pumped.request(0, long, QUEUED_TIMEOUT_S, out, "a", on_event=a_event)
        a.join(60)
        b_running = "b" not in out
        b_cancel.set()
        b.join(60)
    finally:
        pumped.stop()
        to_first.close()
    kind, error, took = out["a"]
    assert kind == "error" and isinstance(error, RequestError), out
    assert f"no prompt progress for {QUEUED_TIMEOUT_S:g} s for this request" in str(error), out
    assert b_running, f"b ended before a failed: {out}"
    assert out["b"][:2] == ("ok", "cancelled"), out
    assert not pumped.failure


@pytest.mark.timeout(120)
def test_a_silent_pipeline_still_fails_every_request_in_bounded_time(pipeline):
    """A stage rank stopped (SIGSTOP: it holds its sockets, answers nothing, and its heartbeats
    stop later than the step timeout): every request fails with RankFailure naming what never
    came, within about the step timeout."""
    launch, plan = pipeline
    coord = launch.coordinator
    last = next(s for s in coord.ranks if s.assign is not None and s.assign.last)
    pumped = Pumped(coord, plan.prompt_chunk)
    out: dict = {}
    os.kill(last.register.pid, signal.SIGSTOP)
    try:
        a = pumped.request(0, [5, 6, 7, 8], 1.0, out, "a")
        b = pumped.request(1, [9, 10], 1.0, out, "b")
        a.join(30)
        b.join(30)
    finally:
        os.kill(last.register.pid, signal.SIGCONT)
        pumped.stop()
    for name in ("a", "b"):
        kind, error, took = out[name]
        assert kind == "error" and isinstance(error, RankFailure), out
        assert "no prompt progress for 1 s from the pipeline" in str(error), out
        assert took < 1.0 + 5, out
    assert pumped.failure and isinstance(pumped.failure[0], RankFailure)


@pytest.fixture(scope="module")
def server(synth):
    """An HTTP server with two jobs at once, one CPU stage rank."""
    srv = ServerProcess(synth, "--cpu-ranks", "1", "--vram-budget", "1G", "--max-context", "8192",
                        "--parallel", "2")
    try:
        yield srv
    finally:
        srv.close()


def _complete(server, prompt: list[int], max_tokens: int, out: dict, name: str):
    def run():
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
        out[name] = r
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _rows(server) -> dict[int, dict]:
    return {r["number"]: r for r in httpx.get(server.url + "/v1/status", timeout=10)
            .json()["recent_requests"]}


@pytest.mark.timeout(120)
def test_status_shows_every_running_job_with_its_own_token_count(server):
    """Two jobs at once: /v1/status shows both running, each with the tokens it made (the long
    one keeps counting after the short one ends)."""
    out: dict = {}
    before = set(_rows(server))
    a = _complete(server, [5, 6, 7], 6000, out, "a")
    a_number = until(lambda: next(iter(set(_rows(server)) - before), None))
    until(lambda: _rows(server)[a_number].get("generated_tokens", 0) > 50)
    b = _complete(server, [8, 9], 200, out, "b")
    b_number = until(lambda: next(iter(set(_rows(server)) - before - {a_number}), None))
    both = until(lambda: (lambda rows: rows if rows[b_number].get("generated_tokens", 0) > 0
                           else None)(_rows(server)))
    assert both[a_number]["state"] == both[b_number]["state"] == "running", both
    # each its own count: the one that started first has made more
    assert both[a_number]["generated_tokens"] > both[b_number]["generated_tokens"], both
    b.join(60)
    assert out["b"].status_code == 200, out["b"].text
    after = _rows(server)
    assert after[b_number]["state"] == "done" and after[b_number]["generated_tokens"] == 200
    assert after[a_number]["state"] == "running", after
    assert after[a_number]["generated_tokens"] > both[a_number]["generated_tokens"], after
    status = httpx.get(server.url + "/v1/status", timeout=10).json()
    assert status["queue"]["running"] == 1
    assert status["throughput"]["running"]["tokens"] >= after[a_number]["generated_tokens"]
    a.join(100)
    assert out["a"].status_code == 200, out["a"].text


@pytest.mark.timeout(120)
def test_rank_stats_stay_fresh_while_jobs_run_at_once(server):
    """Two clients keep both sessions busy for several refresh periods: /v1/status's rank stats
    keep being refreshed (asked without waiting, the replies met by the scheduler's pump)."""
    load_s = 3 * (STATS_EVERY_S + STATS_TIMEOUT_S)
    stop_at = time.monotonic() + load_s
    failures: list = []

    def client(prompt):
        while time.monotonic() < stop_at:
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 300,
                                 "temperature": 0, "ignore_eos": True})
            if r.status_code != 200:
                failures.append(r.text)
    clients = [threading.Thread(target=client, args=([5 + i, 6],), daemon=True)
               for i in range(2)]
    for t in clients:
        t.start()
    ages, busy = [], []
    while time.monotonic() < stop_at - 0.5:
        time.sleep(0.5)
        status = httpx.get(server.url + "/v1/status", timeout=10).json()
        ages.append(status["stats_age_s"])
        busy.append(status["queue"]["running"])
    for t in clients:
        t.join(60)
    assert not failures, failures
    assert sum(busy) >= len(busy), f"the server was not kept busy: {busy}"
    assert max(ages[2:]) < STATS_EVERY_S + STATS_TIMEOUT_S + 1.0, ages
    assert status["ranks"] and all(r.get("counters") for r in status["ranks"]), status["ranks"]


def test_the_last_stage_answers_a_cancel_of_a_request_that_did_not_end_there(synth):
    """--parallel: B's prompt (sent after A's) ends on the last stage before A's Cancel comes
    there; A never ended there, so the Cancel is answered (the head waits for that answer). A
    Cancel of a request that did end there (its final Token sent) stays unanswered."""
    stage = Stage(StageConfig(model_path=synth, device="cpu", lb=0, le=4, first=True, last=True,
                              max_context=256))
    for sid in (0, 1):
        stage.session(sid)
    step = StageStep(stage, 0, last=True)
    sampling = Sampling(max_new=5, head_steps=True)
    # A (request 5): chunk 0 of 2 read here; its chunk 1 was dropped upstream by A's Cancel
    assert [type(o.msg) for o in step.step(Tokens(
        request_id=5, session_id=0, pos=0, ids=[3, 4], chunk_index=0, chunk_total=2,
        sampling=sampling))] == [PromptProgress]
    # B (request 6) reads its whole prompt and gets its first token
    assert [type(o.msg) for o in step.step(Tokens(
        request_id=6, session_id=1, pos=0, ids=[7, 8], sampling=sampling))] == [PromptProgress,
                                                                                  Token]
    answer = step.step(Cancel(request_id=5))
    assert [(o.msg.request_id, o.msg.done, o.msg.reason) for o in answer] == [
        (5, True, "cancelled")]
    assert step.step(Cancel(request_id=5)) == []      # once
    # C (request 7) ends here (one token asked); its Cancel, come late, gets nothing
    out = step.step(Tokens(request_id=7, session_id=0, pos=0, ids=[9],
                           sampling=Sampling(max_new=1, head_steps=True)))
    assert out[-1].msg.done and out[-1].msg.reason == "length"
    assert step.step(Cancel(request_id=7)) == []
