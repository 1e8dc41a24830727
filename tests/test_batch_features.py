"""--parallel where it meets the other features: a batched row's routing counts once (in process
and through a served --expert-profile-out), and each batched row keeps its own grammar. (--spec
beside --parallel: tests/test_parallel_spec.py; --conversation-cache-mib beside it:
tests/test_parallel_conversations.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe
from hf_fixtures import write_gguf as write_moe_gguf
from strata_dist.rank.stage import Stage, StageConfig

CTX = 128


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=4),
                          tmp_path_factory.mktemp("batch") / "moe.gguf", "f32")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = str(tmp_path_factory.mktemp("batch") / "tiny.gguf")
    write_synthetic(path, like="tiny", quant="f32")
    return {"tiny": path}


def _through(stages, run):
    """Rows through every stage: run(stage, rows) with ids on the first, hidden rows after."""
    out = None
    for st in stages:
        out = run(st, out)
    return out


def test_a_batched_row_counts_its_routing_once(moe):
    """--expert-profile-out / the adaptive cache: a batched step counts each row's routing once,
    exactly as the one-row steps of the same tokens count theirs."""
    prompts, nxt = [[3, 4, 5], [9, 8, 7, 6, 5], [1]], [11, 12, 13]

    def stages():
        out = [Stage(StageConfig(model_path=moe, device="cpu", lb=lb, le=le, first=lb == 0,
                                 last=le == 4, max_context=CTX, count_routing=True))
               for lb, le in ((0, 2), (2, 4))]
        for sid, ids in enumerate(prompts):
            _through(out, lambda st, h: st.run(sid, 0, ids=ids if st.cfg.first else None,
                                               hidden=h, prompt=True))
        return out

    alone, batched = stages(), stages()
    for sid in range(len(prompts)):
        _through(alone, lambda st, h: st.run(sid, len(prompts[sid]),
                                             ids=[nxt[sid]] if st.cfg.first else None, hidden=h))
    order = [2, 0, 1]
    _through(batched, lambda st, h: st.run_batch(
        order, [len(prompts[s]) for s in order], ids=[nxt[s] for s in order] if st.cfg.first
        else None, hidden=h))
    for a, b in zip(alone, batched):
        layers = slice(a.cfg.lb, a.cfg.le)
        np.testing.assert_array_equal(b.routing.total[layers], a.routing.total[layers])
        # top_k 2 per row per layer: the prompts' rows and one decode row per session
        rows = sum(len(p) for p in prompts) + len(prompts)
        assert (b.routing.total[layers].sum(axis=1) == 2 * rows).all()


def test_each_batched_row_follows_its_own_grammar(synth):
    """Two requests in batched steps, one held to a JSON schema and one free: each gets the
    tokens it gets alone, and the held one's answer is valid under its schema."""
    import json

    from protocol import Token, Tokens
    from protocol.batch import BatchRows
    from protocol.messages import Sampling
    from strata_dist.models import architecture_for, open_checked
    from strata_dist.rank.stage_step import StageStep, To
    from strata_dist.gguf_file.tokenizer import GGUFTokenizer

    path = synth["tiny"]
    tok = GGUFTokenizer.from_gguf(path)
    n_layers = architecture_for(open_checked(path)).read_geometry(open_checked(path)).n_layers
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
              "required": ["c"], "additionalProperties": False}
    held = dict(max_new=24, grammar_kind="json_schema", grammar=json.dumps(schema))
    free = dict(max_new=12)
    prompts = {1: tok.encode('{"c":"red"} {"c":', add_special=False), 2: [5, 6, 7, 8, 9]}
    kinds = {1: held, 2: free}

    def new_step():
        return StageStep(Stage(StageConfig(path, "cpu", 0, n_layers, True, True, CTX)), rank=0,
                         last=True)

    alone = {}
    for rid in (1, 2):
        step, got = new_step(), []
        sent = step.step(Tokens(request_id=rid, session_id=0, pos=0, ids=prompts[rid],
                                sampling=Sampling(**kinds[rid])))
        while sent:
            got += [o.msg.token_id for o in sent if isinstance(o.msg, Token)]
            sent = [step.step(o.msg) for o in sent if o.to is To.FIRST]
            sent = sent[0] if sent else []
        alone[rid] = got
    step, got, last, step_id = new_step(), {1: [], 2: []}, {}, 10
    for rid, sid in ((1, 0), (2, 1)):
        out = step.step(Tokens(request_id=rid, session_id=sid, pos=0, ids=prompts[rid],
                               sampling=Sampling(**kinds[rid], head_steps=True)))
        (token,) = [o.msg for o in out if isinstance(o.msg, Token)]
        got[rid].append(token.token_id)
        if not token.done:
            last[rid] = (sid, token)
    while last:
        rids = sorted(last)
        rows = BatchRows(request_ids=rids, session_ids=[last[r][0] for r in rids],
                         positions=[last[r][1].pos for r in rids])
        step_id += 1
        out = step.step(Tokens(request_id=step_id, session_id=0, pos=0,
                               ids=[last[r][1].token_id for r in rids], batch=rows))
        assert all(isinstance(o.msg, Token) and o.to is To.HEAD for o in out), out
        for o in out:
            got[o.msg.request_id].append(o.msg.token_id)
            if o.msg.done:
                del last[o.msg.request_id]
            else:
                last[o.msg.request_id] = (last[o.msg.request_id][0], o.msg)
    assert got == alone
    assert json.loads(tok.decode(got[1]))["c"] in ("red", "blue")


@pytest.mark.timeout(120)
def test_a_served_profile_counts_each_batched_row_once(synth, tmp_path):
    """--parallel 3 with --expert-profile-out: three concurrent requests' routing, written at
    shutdown, is what the single-process forward counts for the same tokens (each prompt and
    its fed-back tokens, one row each), though their decode rows went through batched steps."""
    import asyncio

    import httpx

    from server_helpers import CLEAN_EXIT, ServerProcess
    from strata_dist.tools.profile_io import load_profile, record_profile
    from strata_dist.synth import GEOMETRIES

    path = tmp_path / "learnt.json"
    prompts = [[11, 12, 13] * 6, [40, 41] * 5, [7, 8, 9, 10] * 3]
    server = ServerProcess(synth["tiny"], "--cpu-ranks", "2", "--layer-split", "2",
                           "--vram-budget", "1G", "--max-context", "512", "--prefill", "8",
                           "--parallel", "3", "--expert-profile-out", str(path))
    try:
        async def one(http, ids):
            r = await http.post(server.url + "/v1/completions", json={
                "model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        async def all_at_once():
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        replies = asyncio.run(all_at_once())
        with httpx.Client(timeout=10) as http:
            status = http.get(server.url + "/v1/status").json()["queue"]
        assert status["batched_requests"] > status["batched_steps"] > 0   # requests shared steps
        assert status["batched_rows"] == status["batched_requests"]      # no --spec: a row each
    finally:
        assert server.close() in CLEAN_EXIT
    g = GEOMETRIES["tiny"]
    learnt = load_profile(path, g.n_layer, g.n_expert).counts
    fed = [p + r[:-1] for p, r in zip(prompts, replies)]
    np.testing.assert_array_equal(learnt, record_profile(synth["tiny"], fed).counts)
