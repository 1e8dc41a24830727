"""Batched decode (--parallel; protocol/batch.py, strata_dist/head/batch_scheduler.py): a row's bits do
not depend on the rows beside it, in process and through real ranks and real HTTP clients."""
from __future__ import annotations

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe
from hf_fixtures import write_gguf as write_moe_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from strata_dist.backends import get_backend
from strata_dist.rank.stage import Stage, StageConfig

VOCAB = 320
CTX = 128


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=4),
                          tmp_path_factory.mktemp("batch") / "moe.gguf", "f32")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_next_gguf(tiny_qwen3next(4, hidden=64, top_k=2),
                           tmp_path_factory.mktemp("batch") / "next.gguf", "f32")


def _stages(path, n_layers, split):
    bounds = [0, *split, n_layers]
    return [Stage(StageConfig(model_path=path, device="cpu", lb=lb, le=le, first=lb == 0,
                              last=le == n_layers, max_context=CTX))
            for lb, le in zip(bounds, bounds[1:])]


def _through(stages, run):
    """Rows through every stage: run(stage, rows) with ids on the first, hidden rows after."""
    out = None
    for i, st in enumerate(stages):
        out = run(st, out)
    return out


@pytest.mark.parametrize("arch,n_layers,split", [("moe", 4, [2]), ("next", 8, [3])])
def test_a_batched_step_gives_each_row_its_one_row_bits(arch, n_layers, split, moe, hybrid):
    """Sessions of different lengths, stepped alone and then all in one batched step (several
    orders): every row's logits and the KV (or recurrent state) it leaves are bit-identical."""
    path = moe if arch == "moe" else hybrid
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, VOCAB, n)] for n in (3, 17, 9, 30, 1, 12)]
    nxt = [int(x) for x in rng.integers(0, VOCAB, len(prompts))]

    def fill(stages):
        for sid, ids in enumerate(prompts):
            _through(stages, lambda st, h: st.run(sid, 0, ids=ids if st.cfg.first else None,
                                                  hidden=h, prompt=True))

    alone_stages = _stages(path, n_layers, split)
    fill(alone_stages)
    alone = [_through(alone_stages, lambda st, h: st.run(
        sid, len(prompts[sid]), ids=[nxt[sid]] if st.cfg.first else None, hidden=h))
        for sid in range(len(prompts))]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 4]):
        stages = _stages(path, n_layers, split)
        fill(stages)
        pos = [len(prompts[s]) for s in order]
        got = _through(stages, lambda st, h: st.run_batch(
            order, pos, ids=[nxt[s] for s in order] if st.cfg.first else None, hidden=h))
        assert got.shape == (len(order), alone[0].shape[0])
        for row, sid in enumerate(order):
            np.testing.assert_array_equal(got[row], alone[sid], err_msg=f"session {sid}")
            for a, b in zip(stages, alone_stages):
                assert a.session(sid).n_past == b.session(sid).n_past == pos[row] + 1
                for x, y in zip(_state(a.session(sid)), _state(b.session(sid))):
                    np.testing.assert_array_equal(x, y)


def _state(session):
    """Every array a session keeps (K/V rows up to its position, recurrent state)."""
    from strata_dist.rank.conversation_cache import kv_parts, state_parts
    return ([np.asarray(p[:session.n_past]) for p in kv_parts(session)]
            + [np.asarray(p) for p in state_parts(session)])


def test_numpy_rows_are_computed_alone():
    """The numpy backend's matrix products over a decode step's rows give each row what it gets
    alone (BLAS would pick other kernels for other row counts)."""
    be = get_backend("cpu")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((257, 300)).astype(np.float32)
    x = rng.standard_normal((13, 300)).astype(np.float32)
    many = be.linear(x, w)
    for i in range(13):
        np.testing.assert_array_equal(many[i], be.linear(x[i:i + 1], w)[0])
    # the reference: numpy's own product, to float32 rounding
    np.testing.assert_allclose(many, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4,
                               atol=1e-4)


# ---- real ranks, real HTTP clients ---------------------------------------------------------------

PARALLEL = 8


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    paths = {}
    for like in ("tiny", "tiny-next"):
        paths[like] = str(tmp_path_factory.mktemp("batch") / f"{like}.gguf")
        write_synthetic(paths[like], like=like, quant="f32")
    return paths


def _bodies(model: str) -> list[dict]:
    """Eight requests of different prompt lengths and answer lengths, streamed or not, greedy
    but for one seeded sampled one (its draws depend on its logits' bits too)."""
    out = []
    for i in range(PARALLEL):
        body = {"model": model, "prompt": " ".join(f"w{(i * 7 + j) % 23}" for j in range(3 + 9 * i)),
                "max_tokens": 16 + 8 * (i % 4), "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 1}
        if not body["stream"]:
            # their bits tell a row computed differently; each prompt read whole (a reused
            # prefix moves the chunks' bounds, and with them a prompt row's bits, batched or not)
            body.update(logprobs=2, cache_prompt=False)
        if i == 5:
            body.update(temperature=0.9, seed=1234)
        out.append(body)
    return out


async def _complete(http, url: str, body: dict) -> list:
    """A streamed answer's token ids; a whole one's ids, logprobs and top logprobs."""
    import json
    if not body["stream"]:
        r = await http.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return [choice["token_ids"], choice["logprobs"]["token_logprobs"],
                choice["logprobs"]["top_logprobs"]]
    ids = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return ids


@pytest.mark.timeout(180)
@pytest.mark.parametrize("like,args", [("tiny", ("--cpu-ranks", "1")),
                                       ("tiny", ("--cpu-ranks", "2", "--layer-split", "2")),
                                       ("tiny-next", ("--cpu-ranks", "2", "--layer-split", "4"))])
def test_concurrent_requests_get_the_tokens_each_gets_alone(synth, like, args):
    """Eight concurrent clients against `--parallel 8` (in two arrival orders, at random small
    offsets): each one's tokens are those it gets alone (the one-request path: the last stage
    loops a lone request), and the decode steps carried several requests' rows at once."""
    import asyncio
    import random

    import httpx

    from server_helpers import ServerProcess

    server = ServerProcess(synth[like], *args, "--vram-budget", "1G", "--max-context", "512",
                           "--prefill", "32", "--parallel", str(PARALLEL))
    try:
        bodies = _bodies(like)

        async def alone() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=120) as http:
                return [await _complete(http, server.url, b) for b in bodies]

        async def together(order: list[int]) -> list[list[int]]:
            rnd = random.Random(order[0])

            async def one(i):
                await asyncio.sleep(rnd.uniform(0, 0.05))
                return i, await _complete(http, server.url, bodies[i])
            async with httpx.AsyncClient(timeout=120) as http:
                got = dict(await asyncio.gather(*(one(i) for i in order)))
            return [got[i] for i in range(len(bodies))]

        want = asyncio.run(alone())
        assert [len(w[0] if not b["stream"] else w) for w, b in zip(want, bodies)] == \
            [b["max_tokens"] for b in bodies]
        before = httpx.get(server.url + "/v1/status", timeout=10).json()["queue"]
        # each alone stepped as the one-request path does (the last stage looping it), so the
        # batched answers below are checked against that path's
        assert (before["lone_loops"], before["batched_steps"]) == (len(bodies), 0), before
        for order in (list(range(PARALLEL)), [7, 2, 5, 0, 3, 6, 1, 4]):
            assert asyncio.run(together(order)) == want
        q = httpx.get(server.url + "/v1/status", timeout=10).json()["queue"]
        assert q["parallel"] == PARALLEL and len(q["sessions"]) == PARALLEL
        steps = q["batched_steps"] - before["batched_steps"]
        requests = q["batched_requests"] - before["batched_requests"]
        rows = q["batched_rows"] - before["batched_rows"]
        assert steps > 0 and requests / steps > 2, (steps, requests)   # batched, not one at a time
        assert rows == requests, (rows, requests)     # no --spec: a row a request
        # a group of requests on each stage at once (one step in flight per stage)
        assert q["most_steps_in_flight"] == (2 if "--layer-split" in args else 1)
    finally:
        server.close()


@pytest.mark.timeout(180)
def test_more_streams_than_a_replay_holds_go_as_two_steps_at_once(synth):
    """Twelve concurrent clients on one stage (`--parallel 12`), more than a graph replay's
    DECODE_ROWS rows: the scheduler keeps two steps in flight (the stage runs one group while the
    head reads the other's tokens), and each client's tokens are those it gets alone."""
    import asyncio
    import random

    import httpx

    from server_helpers import ServerProcess
    from strata_dist.plan.pricing import DECODE_ROWS

    n = 12
    assert n > DECODE_ROWS
    # answers long enough that every prompt is read while the first streams still decode
    bodies = [{"model": "tiny", "prompt": " ".join(f"w{(i * 5 + j) % 19}" for j in range(2 + 3 * i)),
               "max_tokens": 64 + 4 * (i % 3), "temperature": 0, "ignore_eos": True,
               "stream": i % 2 == 0, **({} if i % 2 == 0 else {"logprobs": 2, "cache_prompt": False})}
              for i in range(n)]
    server = ServerProcess(synth["tiny"], "--cpu-ranks", "1", "--vram-budget", "1G",
                           "--max-context", "512", "--prefill", "32", "--parallel", str(n))
    try:
        async def run(together: bool) -> list[list[int]]:
            async with httpx.AsyncClient(timeout=120) as http:
                if not together:
                    return [await _complete(http, server.url, b) for b in bodies]
                order = list(range(n))
                random.Random(3).shuffle(order)

                async def one(i):
                    return i, await _complete(http, server.url, bodies[i])
                got = dict(await asyncio.gather(*(one(i) for i in order)))
                return [got[i] for i in range(n)]

        want = asyncio.run(run(False))
        assert asyncio.run(run(True)) == want
        q = httpx.get(server.url + "/v1/status", timeout=10).json()["queue"]
        assert q["batched_steps"] > 0 and q["most_steps_in_flight"] == 2, q
    finally:
        server.close()


@pytest.mark.timeout(180)
def test_a_long_prompt_does_not_stall_a_running_stream(synth):
    """A stream decodes while another request's 2,000-token prompt is read (63 chunks): the
    prompt goes a chunk per decode step, so the stream keeps getting tokens while it is read (one
    after another, it would wait for all of it)."""
    import json
    import threading
    import time

    import httpx

    from server_helpers import ServerProcess

    server = ServerProcess(synth["tiny"], "--cpu-ranks", "1", "--vram-budget", "1G",
                           "--max-context", "8192", "--prefill", "32", "--parallel", "2")
    try:
        stamps: list[float] = []
        first, done = threading.Event(), threading.Event()

        def running_stream():
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                        stamps.extend([time.monotonic()] * n)
                        first.set()
                    if done.is_set():
                        return      # the client leaves: its request is cancelled

        t = threading.Thread(target=running_stream)
        t.start()
        assert first.wait(60)
        long = [int(x) for x in np.random.default_rng(1).integers(10, 300, 2000)]
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": long, "max_tokens": 1, "temperature": 0})
        t1 = time.monotonic()
        done.set()
        assert r.status_code == 200, r.text
        t.join(60)
        during = [s for s in stamps if t0 <= s <= t1]
        gaps = np.diff([t0, *during, t1])
        # about a token per chunk read; bounds loose enough for a loaded machine, where one
        # after another would see no token at all until the prompt is read
        assert len(during) >= 15, (len(during), t1 - t0)
        assert gaps.max() < 0.5 * (t1 - t0), (gaps.max(), t1 - t0)
    finally:
        server.close()


def test_a_batched_step_crosses_the_wire_and_bad_ones_are_refused():
    from protocol import Hidden, ProtocolError, Tokens
    from protocol.batch import MAX_BATCH_ROWS, BatchRows
    from protocol.codec import decode, encode

    rows = BatchRows(request_ids=[7, 9], session_ids=[1, 0], positions=[12, 3])
    msg = Tokens(request_id=11, session_id=0, pos=0, ids=[5, 6], batch=rows)
    assert decode(encode(msg))[0] == msg
    h = np.arange(8, dtype=np.float32).reshape(2, 4)
    got, arrays = decode(encode(Hidden(request_id=11, session_id=0, pos=0, n=2, dtype="float32",
                                       shape=[2, 4], batch=rows), [h]))
    assert got.batch == rows
    np.testing.assert_array_equal(arrays[0], h)
    for bad, needle in (
            (BatchRows(request_ids=[7], session_ids=[1, 2], positions=[0]), "session_ids 2"),
            (BatchRows(request_ids=[7, 8], session_ids=[1, 1], positions=[0, 4]), "twice"),
            (BatchRows(request_ids=[7], session_ids=[1], positions=[-1]), ">= 0"),
            (BatchRows(request_ids=list(range(MAX_BATCH_ROWS + 1)),
                       session_ids=list(range(MAX_BATCH_ROWS + 1)),
                       positions=[0] * (MAX_BATCH_ROWS + 1)), "1 to 64 rows")):
        with pytest.raises(ProtocolError, match=needle):
            decode(encode(Tokens(request_id=1, session_id=0, pos=0, ids=[1] * len(bad),
                                 batch=bad)))
    with pytest.raises(ProtocolError, match="carries 1 ids"):
        decode(encode(Tokens(request_id=1, session_id=0, pos=0, ids=[1], batch=rows)))
    # v20: an entry may be a verify window (--spec K beside --parallel B), its rows counted
    windows = BatchRows(request_ids=[7, 9], session_ids=[1, 0], positions=[12, 3],
                        window_rows=[3, 1])
    msg = Tokens(request_id=11, session_id=0, pos=0, ids=[5, 8, 8, 6], batch=windows)
    assert decode(encode(msg))[0] == msg and windows.rows_each() == [3, 1]
    for bad, ids, needle in ((windows, [5, 6], "4 rows carries 2 ids"),
                             (BatchRows(request_ids=[7], session_ids=[1], positions=[0],
                                        window_rows=[9]), [1] * 9, "1 to 8 rows, not 9"),
                             (BatchRows(request_ids=[7], session_ids=[1], positions=[0],
                                        window_rows=[1, 1]), [1, 1], "window_rows 2")):
        with pytest.raises(ProtocolError, match=needle):
            decode(encode(Tokens(request_id=1, session_id=0, pos=0, ids=ids, batch=bad)))


@pytest.mark.timeout(180)
def test_sixty_four_clients_each_get_an_answer_or_a_429_and_a_leaver_costs_nothing(synth):
    """--parallel 4 with 4 places in the queue: 64 clients at once (one of them leaving after its
    first token, its request cancelled on every stage mid-batch) each get their tokens alone or a
    429; /metrics counts every one, and the server serves on."""
    import asyncio
    import json

    import httpx

    from server_helpers import ServerProcess

    server = ServerProcess(synth["tiny"], "--cpu-ranks", "2", "--layer-split", "2",
                           "--vram-budget", "1G", "--max-context", "1024", "--prefill", "32",
                           "--parallel", "4", "--queue-size", "4")
    try:
        def body(i: int) -> dict:
            return {"model": "tiny", "prompt": f"client {i % 5} asks " * (1 + i % 3),
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}

        async def one(http, i: int):
            b = body(i)
            if not b["stream"]:
                r = await http.post(server.url + "/v1/completions", json=b)
                if r.status_code == 429:
                    after = r.headers["retry-after"]
                    assert after.isdigit() and 1 <= int(after) < 60, after
                    assert r.json()["error"]["code"] == "queue_full"
                    return "refused"
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            async with http.stream("POST", server.url + "/v1/completions", json=b) as r:
                if r.status_code == 429:
                    return "refused"
                assert r.status_code == 200
                ids = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                return ids

        async def leaver(http):
            b = dict(body(0), max_tokens=400, stream=True)
            async with http.stream("POST", server.url + "/v1/completions", json=b) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        return "left"          # gone after its first token
            return "refused"

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                want = {i: await one(http, i) for i in range(15)}
                got = await asyncio.gather(leaver(http), *(one(http, i) for i in range(63)))
                after = await one(http, 7)
            return want, got, after

        want, got, after = asyncio.run(run())
        assert got[0] == "left"
        served = [i for i, g in enumerate(got[1:]) if g != "refused"]
        assert served and len(served) < 63
        for i in served:
            assert got[1 + i] == want[i % 15], i
        assert after == want[7]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        count = {k: sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith(f'strata_requests_total{{outcome="{k}"}}'))
                 for k in ("ok", "rejected", "cancelled", "error")}
        assert count["error"] == 0
        assert count["ok"] + count["rejected"] + count["cancelled"] == 15 + 64 + 1, count
        assert count["ok"] == 15 + len(served) + 1 and count["cancelled"] == 1, count
    finally:
        server.close()


# ---- sessions priced as carved -------------------------------------------------------------------

@pytest.mark.parametrize("arch,n_layers,split", [("moe", 4, [2]), ("next", 8, [3])])
def test_the_plan_prices_each_session_a_stage_carves(arch, n_layers, split, moe, hybrid):
    """--parallel 4: the plan prices four sessions on every stage, each what a stage carves for
    one, and the stages carve exactly that (the launcher stops on any difference)."""
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.models.shape import model_shape
    from strata_dist.plan import PlanParams
    from strata_dist.plan.pricing import range_fixed_table, stage_fixed_bytes

    path = moe if arch == "moe" else hybrid
    shape = model_shape(GGUFModel(path), "cpu")
    bounds = [0, *split, n_layers]
    for stage, (lb, le) in zip(_stages(path, n_layers, split), zip(bounds, bounds[1:])):
        for sid in range(4):
            stage.session(sid)
        one = stage_fixed_bytes(shape, CTX, lb, le)[1]
        assert stage_fixed_bytes(shape, CTX, lb, le, sessions=4)[1] == stage.session_bytes() \
            == 4 * stage.sessions[0].nbytes == 4 * one
    table, one_table = (range_fixed_table(shape, CTX, sessions=n) for n in (4, 1))
    for lb in range(n_layers):
        for le in range(lb + 1, n_layers + 1):
            assert table[lb, le] == sum(stage_fixed_bytes(shape, CTX, lb, le, sessions=4))
            assert table[lb, le] - one_table[lb, le] == 3 * stage_fixed_bytes(shape, CTX, lb, le)[1]
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        PlanParams(sessions=0)


def test_plan_only_shows_the_sessions_and_bad_values_are_refused(moe, capsys):
    from launcher.cli import main as launch_main

    args = ["--model", moe, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
            "--max-context", str(CTX), "--plan-only", "--json"]
    import json
    assert launch_main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert launch_main(args + ["--parallel", "4"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert four["params"]["sessions"] == 4
    for a, b in zip(one["stages"], four["stages"]):
        assert b["session_bytes"] == 4 * a["session_bytes"] > 0
    for bad, needle in ((["--parallel", "0"], "--parallel 0: 1 to 64"),
                        (["--parallel", "65"], "--parallel 65: 1 to 64")):
        assert launch_main(args + bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_each_conversation_resumes_in_the_session_that_holds_it(synth):
    """--parallel 3: three conversations interleaved; each follow-up goes to the session holding
    its conversation and reads only its new tokens."""
    import httpx

    from server_helpers import ServerProcess

    server = ServerProcess(synth["tiny"], "--cpu-ranks", "1", "--vram-budget", "1G",
                           "--max-context", "512", "--prefill", "32", "--parallel", "3")
    try:
        def ask(prompt: list[int]) -> tuple[list[int], int]:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return (r.json()["choices"][0]["token_ids"],
                    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        starts = [[7, 8, 9] + [20 + 10 * c + i for i in range(30)] for c in range(3)]
        replies = [ask(p)[0] for p in starts]
        for c in (2, 0, 1):
            follow = starts[c] + replies[c] + [5, 6]
            _, cached = ask(follow)
            # all it held: the prompt and the reply but its last token (never read)
            assert cached == len(starts[c]) + len(replies[c]) - 1, (c, cached)
    finally:
        server.close()


def test_the_last_stage_answers_a_token_per_row_and_skips_a_cancelled_one(moe):
    """StageStep on a stage that is first and last: a head_steps prompt gets its first token and
    no next step; a batched step answers a Token per row; a row of a request cancelled meanwhile
    is skipped; a step that fails names its own request id."""
    from protocol import Cancel, Error, Token, Tokens
    from protocol.batch import BatchRows
    from protocol.messages import Sampling
    from strata_dist.rank.stage_step import StageStep, To

    step = StageStep(_stages(moe, 4, [])[0], 0, last=True)
    first = {}
    for rid, sid, ids in ((1, 0, [3, 4, 5]), (2, 1, [9, 8])):
        out = step.step(Tokens(request_id=rid, session_id=sid, pos=0, ids=ids,
                               sampling=Sampling(max_new=5, head_steps=True)))
        tokens = [o.msg for o in out if isinstance(o.msg, Token)]
        assert [o.to for o in out if isinstance(o.msg, Token)] == [To.HEAD]
        assert not [o for o in out if o.to is To.FIRST]
        first[rid] = tokens[0]
    rows = BatchRows(request_ids=[2, 1], session_ids=[1, 0], positions=[2, 3])
    out = step.step(Tokens(request_id=3, session_id=0, pos=0, ids=[first[2].token_id,
                                                                  first[1].token_id], batch=rows))
    assert [(o.to, o.msg.request_id, o.msg.pos) for o in out] == [(To.HEAD, 2, 3),
                                                                  (To.HEAD, 1, 4)]
    assert all(isinstance(o.msg, Token) and not o.msg.done for o in out)
    cancelled = step.step(Cancel(request_id=1))
    assert [(o.msg.request_id, o.msg.reason) for o in cancelled] == [(1, "cancelled")]
    rows = BatchRows(request_ids=[2, 1], session_ids=[1, 0], positions=[3, 4])
    out = step.step(Tokens(request_id=4, session_id=0, pos=0, ids=[1, 1], batch=rows))
    assert [o.msg.request_id for o in out] == [2]
    full = BatchRows(request_ids=[2], session_ids=[1], positions=[CTX])
    out = step.step(Tokens(request_id=5, session_id=0, pos=0, ids=[1], batch=full))
    assert len(out) == 1 and isinstance(out[0].msg, Error) and out[0].msg.request_id == 5
    assert "context full" in out[0].msg.message

