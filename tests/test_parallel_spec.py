"""Speculation among many users: `--parallel B --spec K` (protocol/batch.py's verify windows,
strata_dist/head/batch_scheduler.py, strata_dist/rank/stage_step.py).

A batched step carries, per running request, its last token and the drafts the last stage sent
with it (none for some); every stage runs each window as its session's verify window, the last
stage verifies each request as the one-session path does, and each request rolls back on its own
(K/V; qwen3next's recurrent state). Real rank processes through the launcher (CPU ranks) and real
HTTP clients: eight concurrent clients, in a random arrival order, each get the greedy tokens
they get alone without speculation, with drafts accepted; on 1 and 2 stages, both architectures,
and with the draft-model and MTP drafters."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from server_helpers import ServerProcess

CLIENTS = 8
BASE = ("--vram-budget", "1G", "--max-context", "512", "--prefill", "32")
SPEC = ("--parallel", "4", "--spec", "3")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """The tiny synthetic files of both architectures, and a qwen3moe one at q8_0 (one
    vocabulary with the f32 file: a draft model it can take)."""
    from strata_dist.synth import write_synthetic
    d = tmp_path_factory.mktemp("parallel-spec")
    paths = {}
    for name, like, quant in (("tiny", "tiny", "f32"), ("tiny-next", "tiny-next", "f32"),
                              ("tiny-q8", "tiny", "q8_0")):
        paths[name] = str(d / f"{name}.gguf")
        write_synthetic(paths[name], like=like, quant=quant)
    return paths


def _bodies(model: str) -> list[dict]:
    """Eight greedy requests whose prompts repeat a short cycle of words (of 3 to 5 words, so the
    n-gram drafter finds continuations and the model's answers echo them), of different lengths;
    every other one streamed."""
    out = []
    for i in range(CLIENTS):
        words = " ".join(f"w{j % (3 + i % 3)}" for j in range(10 + 3 * i))
        out.append({"model": model, "prompt": words, "max_tokens": 20 + 4 * (i % 3),
                    "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "stream": i % 2 == 1})
    return out


async def _complete(http: httpx.AsyncClient, url: str, body: dict) -> tuple[list[int], dict]:
    """An answer's token ids and its usage (a stream's from its last chunk)."""
    import json
    if not body["stream"]:
        r = await http.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]
    ids, usage = [], {}
    body = dict(body, stream_options={"include_usage": True})
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    ids += chunk["choices"][0].get("token_ids") or []
                usage = chunk.get("usage") or usage
    return ids, usage


def _alone(path: str, args: tuple, bodies: list[dict], usage: bool = False) -> list:
    """Each request alone, one after another (`args` without --spec: without speculation); with
    `usage`, each one's token ids and usage."""
    server = ServerProcess(path, *args, *BASE)
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return [await _complete(http, server.url, b) for b in bodies]
        return [got if usage else got[0] for got in asyncio.run(run())]
    finally:
        server.close()


def _together(path: str, args: tuple, bodies: list[dict], seed: int) -> tuple[list, list, dict]:
    """All requests at once (a random arrival order, at small random offsets) against --parallel
    4 --spec 3: each one's tokens and usage, and the drafts /metrics counts."""
    server = ServerProcess(path, *args, *BASE, *SPEC)
    rnd = random.Random(seed)
    order = list(range(len(bodies)))
    rnd.shuffle(order)
    delays = [rnd.uniform(0, 0.05) for _ in bodies]
    try:
        async def one(http, i):
            await asyncio.sleep(delays[i])
            return i, await _complete(http, server.url, bodies[i])

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return dict(await asyncio.gather(*(one(http, i) for i in order)))
        got = asyncio.run(run())
        status = httpx.get(server.url + "/v1/status", timeout=10).json()["queue"]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.close()
    counts = {name: float(line.split()[-1]) for line in metrics.splitlines()
              for name in ("strata_draft_tokens", "strata_draft_tokens_accepted")
              if line.startswith(name + " ") or line.startswith(name + "_total ")}
    return ([got[i][0] for i in range(len(bodies))], [got[i][1] for i in range(len(bodies))],
            dict(status, **counts))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("like,args", [
    ("tiny", ("--cpu-ranks", "1")),
    ("tiny", ("--cpu-ranks", "2", "--layer-split", "2")),
    ("tiny-next", ("--cpu-ranks", "1")),
    ("tiny-next", ("--cpu-ranks", "2", "--layer-split", "4"))])
def test_eight_speculating_clients_in_one_batch_get_their_tokens_alone(synth, like, args):
    bodies = _bodies(like)
    want = _alone(synth[like], args, bodies)
    assert [len(w) for w in want] == [b["max_tokens"] for b in bodies]
    got, usage, status = _together(synth[like], args, bodies, seed=len(args))
    assert got == want
    accepted = [u["completion_tokens_details"]["accepted_prediction_tokens"] for u in usage]
    assert sum(accepted) > 0, usage
    assert status["strata_draft_tokens_accepted"] == sum(accepted) > 0, status
    assert status["strata_draft_tokens"] >= status["strata_draft_tokens_accepted"]
    # the steps carried several requests at once, a step in flight per stage; their windows
    # carried the drafts as rows of their own (a window is 1 + its drafts rows)
    assert status["batched_requests"] / status["batched_steps"] > 1.5, status
    assert status["batched_rows"] > status["batched_requests"], status
    _accepted_in_rows(status, sum(accepted))
    assert status["most_steps_in_flight"] == (2 if "--layer-split" in args else 1)


def _accepted_in_rows(status: dict, accepted: int) -> None:
    """The drafts accepted in batched windows were rows of them. The others were accepted while
    their request was alone (the last of the eight, once the others ended): it speculated on the
    last stage's own loop, as the one-request path does, its windows no batched step's rows."""
    assert status["batched_accepted"] <= accepted, status
    assert (status["batched_accepted"] > 0) == (accepted > 0), status   # most ran batched
    assert status["batched_rows"] >= status["batched_requests"] + status["batched_accepted"], \
        status


@pytest.mark.timeout(240)
def test_the_draft_model_drafts_for_each_request_of_a_batch(synth):
    """--draft-model on two stages, each request drafting in a draft session of its own: the
    file itself as its draft (every draft accepted), and the q8_0 file (whose drafts this
    synthetic model rejects: each request's draft session rolls back every step); tokens as
    alone without speculation either way."""
    args = ("--cpu-ranks", "2", "--layer-split", "2")
    bodies = _bodies("tiny")
    want = _alone(synth["tiny"], args, bodies)
    for draft in ("tiny", "tiny-q8"):
        got, usage, status = _together(synth["tiny"], args + ("--draft-model", synth[draft]),
                                       bodies, seed=3)
        assert got == want, draft
        drafted, accepted = status["strata_draft_tokens"], status["strata_draft_tokens_accepted"]
        assert drafted > 0 and accepted == (drafted if draft == "tiny" else 0), (draft, status)
        # several requests a step (on two stages they go as two groups, each about half of them,
        # fewer as they end)
        assert status["batched_requests"] / status["batched_steps"] > 1.25, status
        # the drafts rode in their requests' windows as rows (rejected ones too)
        assert status["batched_rows"] > status["batched_requests"], status
        _accepted_in_rows(status, accepted)


@pytest.mark.timeout(240)
def test_the_mtp_block_drafts_for_each_request_of_a_batch(tmp_path):
    """--draft mtp (a qwen3next file with its MTP block) on two stages: every request's tokens,
    drafts and acceptances are those it gets alone through the one-session path with the same
    drafter (whose tokens are --spec 0's: tests/test_mtp.py)."""
    from strata_dist.synth import write_synthetic
    path = str(tmp_path / "next-mtp.gguf")
    write_synthetic(path, like="tiny-next", quant="f32", seed=3, mtp=True)
    args = ("--cpu-ranks", "2", "--layer-split", "4", "--draft", "mtp")
    bodies = _bodies("next-mtp")
    alone = _alone(path, args + ("--spec", "3"), bodies, usage=True)
    got, usage, status = _together(path, args, bodies, seed=5)
    assert got == [ids for ids, _ in alone]
    assert [u["completion_tokens_details"] for u in usage] == \
        [u["completion_tokens_details"] for _, u in alone]
    assert status["strata_draft_tokens"] > 0, status


@pytest.mark.timeout(240)
def test_a_speculating_client_that_leaves_costs_the_others_nothing(synth):
    """Two stages of qwen3next, --parallel 4 --spec 3: a streamed client leaves after its first
    tokens while three others decode; its Cancel settles its window round the stages and its
    session comes free; the others get the tokens they get alone without speculation, and a
    request after them is served."""
    import json
    args = ("--cpu-ranks", "2", "--layer-split", "4")
    bodies = _bodies("tiny-next")[:4]
    leaving = dict(bodies[0], max_tokens=400, stream=True)
    want = _alone(synth["tiny-next"], args, bodies[1:])
    server = ServerProcess(synth["tiny-next"], *args, *BASE, *SPEC)
    try:
        async def leaver(http):
            async with http.stream("POST", server.url + "/v1/completions", json=leaving) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                        return "left"         # gone after its first tokens

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(leaver(http), *(
                    _complete(http, server.url, b) for b in bodies[1:]))
        left, *got = asyncio.run(run())
        assert left == "left" and [ids for ids, _ in got] == want
        sessions = []
        for _ in range(100):          # the leaver's session comes free once its Cancel is done
            sessions = httpx.get(server.url + "/v1/status", timeout=10).json()["queue"]["sessions"]
            if all(row["request"] is None for row in sessions):
                break
            asyncio.run(asyncio.sleep(0.1))
        assert all(row["request"] is None for row in sessions), sessions
        with httpx.Client(timeout=60) as http:
            r = http.post(server.url + "/v1/completions", json=dict(bodies[1], stream=False))
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want[0]
    finally:
        server.close()


# ---- the planner: B sessions' windows ----------------------------------------------------------

def test_each_session_keeps_its_window_state_priced_and_the_prediction_is_over_all_streams():
    """A recurrent stage keeps, per session, its state at its last window and that window's rows
    (Stage.windows, a record per session): with --parallel 4 --spec 4 the reserve holds four of
    them beside one window's many-row buffers (a batched step runs its windows one after
    another). The prediction is over the four streams: K = 0 a batched step of 4 rows, K > 0 each
    window's own time."""
    from test_plan_fixtures import hybrid_kinds, make_devices, make_shape

    from strata_dist.plan import PlanParams, make_plan
    from strata_dist.plan.pricing import (HANDOFF_DTYPE_BYTES, range_fixed_table,
                                          stage_fixed_bytes, verify_window_bytes)
    from strata_dist.plan.speculation import expected_yield, predict_spec, window_ms

    from protocol.batch import MAX_WINDOW_ROWS
    from strata_dist.plan.pricing import DECODE_ROWS
    from strata_dist.sampling.speculative import MAX_SPEC
    assert MAX_WINDOW_ROWS == DECODE_ROWS == MAX_SPEC + 1   # any --spec K's window crosses the wire
    shape = make_shape(n_layers=12, kinds=hybrid_kinds(12))
    lin = next(l for l in range(12) if shape.layer_kind[l] == "linear")
    att = next(l for l in range(12) if shape.layer_kind[l] == "attention")
    kept = shape.recurrent_bytes[lin] + 5 * shape.hidden * HANDOFF_DTYPE_BYTES
    assert verify_window_bytes(shape, lin, lin + 1, 5, 4) == shape.prompt_bytes(5) + 4 * kept
    assert verify_window_bytes(shape, att, att + 1, 5, 4) == shape.prompt_bytes(5)
    table = range_fixed_table(shape, 333, verify_rows=5, sessions=4)
    for lb in range(12):
        for le in range(lb + 1, 13):
            assert table[lb, le] == sum(stage_fixed_bytes(shape, 333, lb, le, verify_rows=5,
                                                          sessions=4))
    devs = make_devices([900, 900], bw=[300, 300])
    plans = {(b, rows): make_plan(shape, devs, cells=128, split=[6], order="as_given",
                                  params=PlanParams(verify_rows=rows, sessions=b))
             for b in (1, 4) for rows in (0, 5)}
    for i in range(2):
        st = plans[4, 5].stages[i]
        grown = st.reserve_bytes - plans[4, 0].stages[i].reserve_bytes
        assert grown == verify_window_bytes(shape, st.lb, st.le, 5, 4)
        assert grown - (plans[1, 5].stages[i].reserve_bytes
                        - plans[1, 0].stages[i].reserve_bytes) == 3 * (sum(
            shape.recurrent_bytes[l] for l in range(st.lb, st.le)
            if shape.layer_kind[l] == "linear") + 5 * shape.hidden * HANDOFF_DTYPE_BYTES)
    one, four = (predict_spec(plans[b, 5], shape, None, 4) for b in (1, 4))
    assert four.sessions == 4 and four.to_dict()["sessions"] == 4
    assert four.k0_tok_s == pytest.approx(4000 / window_ms(plans[4, 5], shape, None, 4))
    assert one.k0_tok_s == pytest.approx(1000 / plans[1, 5].predicted_ms_per_token)
    w = window_ms(plans[4, 5], shape, None, 5)
    assert four.tok_s(0.7) == pytest.approx(1000 * expected_yield(0.7, 4) / w)
    assert "over 4 sessions" in four.lines()[0] and "over" not in one.lines()[0]


@pytest.mark.parametrize("drafter", ["model", "model-next", "mtp"])
def test_a_draft_session_per_session_is_priced_as_carved(synth, tmp_path, drafter):
    """--parallel 4 with a drafter on the last stage: each request drafts in a draft session of
    its own, so the plan's drafter bytes grow by three sessions, each what the drafter carves (a
    qwen3next draft model's session with the checkpoint it keeps at its latest window)."""
    import json
    import subprocess
    import sys

    if drafter.startswith("model"):
        from strata_dist.rank.draft_model import DraftModel
        if drafter == "model":
            model, draft = synth["tiny"], synth["tiny-q8"]
        else:
            from strata_dist.synth import write_synthetic
            model, draft = synth["tiny-next"], str(tmp_path / "tiny-next-q8.gguf")
            write_synthetic(draft, like="tiny-next", quant="q8_0")
        flags = ["--draft-model", draft]
        carver = DraftModel(draft, "cpu", 256)
        for sid in range(4):          # each session drafts once: what it then keeps
            carver.draft(sid, list(range(5, 40)), 3, 0.0)
        sizes = [carver.stage.session(sid).nbytes + carver.stage.checkpoint_store(sid).nbytes
                 for sid in range(4)]
    else:
        from strata_dist.sampling.mtp_draft import MtpDrafter
        from strata_dist.synth import write_synthetic
        model, flags = str(tmp_path / "next-mtp.gguf"), ["--draft", "mtp"]
        write_synthetic(model, like="tiny-next", quant="f32", seed=3, mtp=True)
        from strata_dist.rank.stage import Stage, StageConfig
        last = Stage(StageConfig(model, "cpu", 0, 8, True, True, 256))   # the head it drafts with
        carver = MtpDrafter(model, "cpu", 256, last.model)
        sizes = [carver.session(sid).nbytes for sid in range(4)]

    def drafter_bytes(*more) -> int:
        r = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model,
                            "--cpu-ranks", "1", "--max-context", "256", "--spec", "3", *flags,
                            *more, "--plan-only", "--json"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["params"]["draft_cpu_bytes"]
    assert drafter_bytes("--parallel", "4") - drafter_bytes() == sum(sizes[1:]) > 0


def test_a_batch_past_the_graph_rows_is_priced_as_several_replays():
    """The decode graphs are captured for 1 .. DECODE_ROWS rows, so a batched step of B > 8 rows
    replays a stage's graph ceil(B / 8) times (backends/batched_decode.py step_rows), each replay
    reading the stage's weights again, and hands the B rows on once: --parallel 9 costs a step of
    8 rows plus one of 1, --parallel 16 two of 8, not one step of 9 or 16 rows."""
    from test_plan_fixtures import make_devices, make_shape

    from strata_dist.plan import PlanParams, make_plan
    from strata_dist.plan.pricing import DECODE_ROWS
    from strata_dist.plan.speculation import batched_step_ms, predict_spec, replay_rows, window_ms

    assert DECODE_ROWS == 8
    assert [replay_rows(b) for b in (1, 8, 9, 16, 17)] == [(1,), (8,), (8, 1), (8, 8), (8, 8, 1)]
    with pytest.raises(ValueError, match="rows 0"):
        replay_rows(0)
    shape = make_shape(n_layers=8, n_experts=16, top_k=2)
    one_card = {b: make_plan(shape, make_devices([4000], bw=[300]), cells=128, split="none",
                             params=PlanParams(sessions=b)) for b in (8, 9, 16)}
    for b, plan in one_card.items():   # one stage: no hand-off, a replay is a step of its rows
        assert batched_step_ms(plan, shape, None, b) == pytest.approx(
            sum(window_ms(plan, shape, None, r) for r in replay_rows(b)))
    assert batched_step_ms(one_card[8], shape, None, 8) == window_ms(one_card[8], shape, None, 8)
    nine = batched_step_ms(one_card[9], shape, None, 9)
    assert nine > window_ms(one_card[9], shape, None, 9)      # the second replay's weights
    pred = {b: predict_spec(plan, shape, None, 4) for b, plan in one_card.items()}
    assert pred[9].k0_tok_s == pytest.approx(9000 / nine)
    assert pred[16].k0_tok_s == pytest.approx(
        16000 / (2 * window_ms(one_card[16], shape, None, 8)))
    # a batch past 8 rows reads the weights once a replay: it gains over 8 rows less than 2x
    assert pred[16].k0_tok_s < 2 * pred[8].k0_tok_s
    assert "1 graph replay a step" in pred[8].lines()[0]
    assert "2 graph replays a step" in pred[9].lines()[0]
    assert "2 graph replays a step" in pred[16].lines()[0]

    # two hosts: the 16 rows cross the link once (their bytes), the tokens come back once, so
    # the second replay pays no hop's fixed cost, and no return
    two = make_plan(shape, make_devices([300, 300], bw=[300, 300], hosts=["a", "b"]), cells=128,
                    split=[4], order="as_given", params=PlanParams(sessions=16))
    assert len(two.stages) == 2
    p = two.params
    assert batched_step_ms(two, shape, None, 16) == pytest.approx(
        2 * window_ms(two, shape, None, 8) - 2 * (p.handoff_ms + p.link_ms))


def test_a_batch_on_a_stage_without_graph_replays_is_priced_as_one_pass():
    """Only a CUDA stage of a model without recurrent layers runs a batched step as graph replays
    of up to 8 rows (backends/batched_decode.py batch_replays); a CPU rank, and every stage of a
    qwen3next model, takes all B rows at once through the general path (Stage.run_batch), so its
    stage reads its weights once a step, whatever B, and --plan-only names no graph replay."""
    from test_plan_fixtures import hybrid_kinds, make_devices, make_shape

    from strata_dist.plan import PlanParams, make_plan
    from strata_dist.plan.speculation import batched_step_ms, predict_spec, window_ms

    shape = make_shape(n_layers=8, n_experts=16, top_k=2)
    cpu = make_plan(shape, make_devices([4000], bw=[100], kinds=["cpu"]), cells=128,
                    split="none", params=PlanParams(sessions=16))
    assert batched_step_ms(cpu, shape, None, 16) == pytest.approx(window_ms(cpu, shape, None, 16))
    line = predict_spec(cpu, shape, None, 4).lines()[0]
    assert "graph replay" not in line and "K = 0 batches their rows)" in line, line

    hybrid = make_shape(n_layers=8, n_experts=16, top_k=2, kinds=hybrid_kinds(8))
    gpu = make_plan(hybrid, make_devices([4000], bw=[300]), cells=128, split="none",
                    params=PlanParams(sessions=16))
    assert batched_step_ms(gpu, hybrid, None, 16) == pytest.approx(
        window_ms(gpu, hybrid, None, 16))
    assert "graph replay" not in predict_spec(gpu, hybrid, None, 4).lines()[0]

    # a GPU stage then a CPU stage: only the GPU stage's weights are read once a replay
    mixed = make_plan(shape, make_devices([300, 4000], bw=[300, 100], kinds=["cuda", "cpu"]),
                      cells=128, split=[4], order="as_given", params=PlanParams(sessions=16))
    assert [st.device.kind for st in mixed.stages] == ["cuda", "cpu"]
    every = batched_step_ms(mixed, shape, None, 16)
    assert window_ms(mixed, shape, None, 16) < every < 2 * window_ms(mixed, shape, None, 8)
    assert "2 graph replays a step" in predict_spec(mixed, shape, None, 4).lines()[0]
