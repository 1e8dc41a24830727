"""Speculative decoding (`--spec K --draft ngram`, strata_dist/sampling/speculative.py).

- the n-gram drafter on histories worked out by hand;
- a verify window's rows have the bits of one-row decode steps on CPU stages (both
  architectures), so greedy tokens cannot depend on speculation;
- greedy tokens of real launches (rank processes, sockets) with --spec 4 equal the single
  process's, 1 and 2 stages, qwen3moe and qwen3next (whose recurrent state is rolled back inside
  windows: the stages say how many rows they ran again), with drafts both accepted and rejected;
- penalties, bias and logprobs apply per verified row exactly as without speculation;
- sampled: the rejection step draws from the target distribution (chi-square against the
  softmax written out here), and a tiny model's sampled continuations follow the same
  distribution with and without speculation;
- bad flag values are refused at start with both values named."""
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from hf_fixtures import tiny_qwen3moe, write_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from launch_helpers import ServeSession
from server_helpers import ServerProcess
from test_plan_fixtures import hybrid_kinds, make_devices, make_shape
from protocol import Token, Tokens
from protocol.messages import Sampling
from strata_dist.models import architecture_for, open_checked
from strata_dist.plan import PlanParams, make_plan
from strata_dist.plan.pricing import range_fixed_table, stage_fixed_bytes, verify_window_bytes
from strata_dist.sampling.sampler import Sampler, SamplingParams
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.sampling.speculative import draw_against, ngram_draft
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep, To
from strata_dist.synth import write_synthetic
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

CTX = 256
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return str(write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6),
                          tmp_path_factory.mktemp("spec") / "moe.gguf", "f32"))


@pytest.fixture(scope="module")
def nxt(tmp_path_factory):
    # tied embeddings: a tiny model that repeats itself often enough for drafts to be accepted
    return str(write_next_gguf(tiny_qwen3next(2, tied=True, n_layers=4),
                               tmp_path_factory.mktemp("spec") / "next.gguf", "f32"))


# ---- the drafter --------------------------------------------------------------------------------

def test_ngram_draft_continues_the_longest_earlier_suffix():
    h = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    # [1, 2] was followed by 3 twice; then [1, 2, 3] by 4 and by 5 (a tie: the latest, 5, with
    # probability 1/2); then [1, 2, 3, 5] by 1
    assert ngram_draft(h, 3) == [3, 5, 1]
    assert ngram_draft(h, 1) == [3]
    assert ngram_draft(h, 3, min_p=0.6) == [3]     # 5's share 0.5 stops the drafting
    assert ngram_draft([1, 2, 3], 4) == []          # no suffix occurred before: no draft
    assert ngram_draft(h, 0) == []


# ---- numerics: a window's rows are one-row steps -------------------------------------------------

@pytest.mark.parametrize("arch", ["moe", "nxt"])
def test_window_rows_have_the_bits_of_one_row_steps(arch, request):
    path = request.getfixturevalue(arch)
    n_layers = 6 if arch == "moe" else 4
    stage = Stage(StageConfig(path, "cpu", 0, n_layers, True, True, CTX))
    for session in (0, 1):
        stage.run(session, 0, ids=PROMPT, prompt=True)
    window = [3, 7, 11, 13, 17]
    rows = stage.run(0, len(PROMPT), ids=window, all_rows=True)
    for i, t in enumerate(window):
        one = stage.run(1, len(PROMPT) + i, ids=[t])
        assert np.array_equal(rows[i], one), f"row {i} differs by {np.abs(rows[i] - one).max()}"


# ---- greedy tokens through real launches ------------------------------------------------------

@pytest.mark.parametrize("arch,split", [("moe", ""), ("moe", "3"), ("nxt", ""), ("nxt", "2")])
def test_greedy_tokens_equal_without_speculation(arch, split, request):
    path = request.getfixturevalue(arch)
    want = SingleProcessRunner(path, prompt_chunk=16, max_context=CTX).generate(PROMPT, 60).tokens
    args = ["--cpu-ranks", "2" if split else "1", "--prefill", "16", "--max-context", str(CTX),
            "--vram-budget", "1G", "--gpu-order", "as_given", "--spec", "4"]
    s = ServeSession(path, *args, *(["--layer-split", split] if split else []))
    try:
        out = s.gen(PROMPT, 60)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == list(want)
        drafted, accepted = int(out["stats"][-1]["drafted"]), int(out["stats"][-1]["accepted"])
        assert 0 < accepted < drafted          # both paths of the window ran
        stats = s.stats()
        last = stats[max(stats)]
        assert (int(last["spec_drafted"]), int(last["spec_accepted"])) == (drafted, accepted)
        if arch == "nxt":   # every stage holds linear layers: each rolled its state back
            assert all(int(f["window_rerun_rows"]) > 0 for f in stats.values())
        # a second turn reads on from where the windows left the session
        follow = PROMPT + out["tokens"] + [7, 8, 9]
        again = s.gen(follow, 8)
        assert again["err"] is None and int(again["resume"]) == len(PROMPT) + 59
        assert again["tokens"] == list(SingleProcessRunner(path, prompt_chunk=16, max_context=CTX)
                                       .generate(follow, 8).tokens)
    finally:
        assert s.close() == 0


def test_a_cancelled_request_reports_its_drafts(moe):
    """A request that ends by a cancel (a stop string, a client gone, CANCEL) still reports the
    drafts it verified and accepted: the last stage's final Token carries them to the head."""
    s = ServeSession(moe, "--cpu-ranks", "1", "--prefill", "16", "--max-context", str(CTX),
                     "--vram-budget", "1G", "--spec", "4")
    try:
        s.send(f"GEN {CTX - len(PROMPT) - 1} {' '.join(map(str, PROMPT))}")
        n, stats = 0, None
        while not (line := s.next_line(30)).startswith(("DONE", "ERR")):
            n += line.startswith("T ")
            if n == 10 and line.startswith("T "):
                s.send("CANCEL")
            if line.startswith("STATS drafted="):
                stats = dict(f.split("=") for f in line.split()[1:])
        assert line.startswith("DONE") and line.endswith("cancelled"), line
        rank = s.stats()[0]    # the session's only request: the rank's totals are its own
        assert int(rank["spec_drafted"]) > 0
        assert stats == {"drafted": rank["spec_drafted"], "accepted": rank["spec_accepted"]}
    finally:
        assert s.close() == 0


# ---- in process: one stage that is first and last, its next steps handed back by hand ----------

def _run(step: StageStep, request_id: int, sampling: Sampling, prompt=PROMPT,
         pos: int = 0) -> list[Token]:
    """One request whose prompt is read from `pos` (the session holds the rows before)."""
    tokens: list[Token] = []
    sent = step.step(Tokens(request_id=request_id, session_id=0, pos=pos, ids=prompt[pos:],
                            sampling=sampling))
    while True:
        tokens += [o.msg for o in sent if o.to is To.HEAD and isinstance(o.msg, Token)]
        nxt = [o.msg for o in sent if o.to is To.FIRST]
        if not nxt:
            return tokens
        sent = step.step(nxt[0])


def seeded_continuations(step: StageStep, prompt: list[int], temperature: float,
                         spec_tokens: tuple[int, ...], n: int):
    """n seeded 3-token continuations of `prompt` for each K of `spec_tokens`, each reading the
    prompt's last row again then decoding: ({K: [(2nd, 3rd token)]}, drafted, accepted)."""
    _run(step, 1, Sampling(max_new=0), prompt)       # the session holds the prompt's KV
    draws = {k: [] for k in spec_tokens}
    drafted = accepted = 0
    for k in spec_tokens:
        for i in range(n):
            out = _run(step, 10_000 * (k + 1) + i,
                       Sampling(temperature=temperature, seed=i + 7919 * k, max_new=3,
                                spec_tokens=k, prompt_ids=prompt), prompt, pos=len(prompt) - 1)
            draws[k].append(tuple(t.token_id for t in out[1:]))
            drafted += out[-1].drafted
            accepted += out[-1].accepted
    return draws, drafted, accepted


def assert_drawn_alike(a_draws: list[tuple], b_draws: list[tuple]) -> None:
    """Each position's tokens of two sets of draws pass a contingency chi-square at 1e-3."""
    for position in (0, 1):
        a = [d[position] for d in a_draws]
        b = [d[position] for d in b_draws]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        common = table.sum(axis=0) >= 10      # rare tokens pooled: the test wants >= 5 expected
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        assert chi2_contingency(table).pvalue > 1e-3, position


def test_penalties_bias_and_logprobs_apply_per_verified_row(moe):
    step = StageStep(Stage(StageConfig(moe, "cpu", 0, 6, True, True, CTX)), rank=0, last=True)
    kw = dict(max_new=40, frequency_penalty=-0.3, presence_penalty=0.2, repetition_penalty=0.95,
              logit_bias_ids=[14],
              logit_bias_values=[-1.5], logprobs=True, top_logprobs=3, prompt_ids=PROMPT)
    plain = _run(step, 1, Sampling(**kw))
    spec = _run(step, 2, Sampling(**kw, spec_tokens=4))
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    assert [(t.logprob, t.top_ids) for t in spec] == [(t.logprob, t.top_ids) for t in plain]
    assert spec[-1].accepted > 0 and plain[-1].drafted == 0


def test_a_grammar_masks_each_verified_row(tmp_path):
    path = str(tmp_path / "syn.gguf")
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0")
    tok = GGUFTokenizer.from_gguf(path)
    schema = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 6},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"], "additionalProperties": False}
    # JSON in the prompt: the drafter finds its quotes, keys and colons there
    prompt = tok.encode('{"n":"ab","c":"red"} {"n":"xy","c":"blue"} {"n":"', add_special=False)
    gguf = open_checked(path)
    n_layers = architecture_for(gguf).read_geometry(gguf).n_layers
    step = StageStep(Stage(StageConfig(path, "cpu", 0, n_layers, True, True, CTX)), rank=0,
                     last=True)
    kw = dict(max_new=48, grammar_kind="json_schema", grammar=json.dumps(schema),
              prompt_ids=prompt)
    for extra in ({}, {"temperature": 1.0, "seed": 3}):
        plain = _run(step, 1 + 10 * len(extra), Sampling(**kw, **extra), prompt)
        spec = _run(step, 2 + 10 * len(extra), Sampling(**kw, **extra, spec_tokens=4), prompt)
        assert spec[-1].reason == "stop" and spec[-1].drafted > 0
        answer = json.loads(tok.decode([t.token_id for t in spec]))
        assert set(answer) == {"n", "c"} and answer["c"] in ("red", "blue")
        if not extra:     # greedy: the very tokens of a one-row step each
            assert [t.token_id for t in spec] == [t.token_id for t in plain]
            assert spec[-1].accepted > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=1),
                                    SamplingParams(temperature=1.3, top_k=5, seed=2,
                                                   logit_bias=((3, 0.7),))])
def test_rejection_draws_follow_the_target_distribution(params):
    rng = np.random.default_rng(0)
    row = rng.normal(size=12).astype(np.float32)
    row[4] = row.max() + 0.3                # the draft: the most likely token, p ~ 0.3
    # the target, written out: bias, temperature, top-k, softmax
    z = row.astype(np.float64)
    for t, b in params.logit_bias:
        z[t] += b
    keep = np.argsort(-z, kind="stable")[:params.top_k or len(z)]
    p = np.zeros(len(z))
    p[keep] = np.exp((z[keep] - z[keep].max()) / params.temperature)
    p /= p.sum()
    sampler, n = Sampler(params), 20000
    drawn = np.bincount([draw_against(sampler, row, 4) for _ in range(n)], minlength=len(z))
    assert drawn[p == 0].sum() == 0
    assert chisquare(drawn[p > 0], p[p > 0] * n).pvalue > 1e-3
    assert 0.1 < drawn[4] / n < 0.9         # the draft was both accepted and rejected


@pytest.fixture(scope="module")
def moe3(tmp_path_factory):
    """3 layers: its greedy tokens fall into a loop of two tokens, which the drafter then offers."""
    return str(write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=3),
                          tmp_path_factory.mktemp("spec") / "moe3.gguf", "f32"))


def test_sampled_continuations_follow_one_distribution_with_and_without_speculation(moe3):
    """Many seeded 3-token continuations of a tiny model at temperature 0.3: the second and third
    tokens (drawn from a window's rows when a draft was made) are distributed alike."""
    step = StageStep(Stage(StageConfig(moe3, "cpu", 0, 3, True, True, CTX)), rank=0, last=True)
    # a history holding the tokens the model likes, so most first tokens have a draft after them
    prompt = PROMPT + list(SingleProcessRunner(moe3, prompt_chunk=16, max_context=CTX)
                           .generate(PROMPT, 40).tokens)
    draws, drafted, accepted = seeded_continuations(step, prompt, 0.3, (0, 4), 600)
    assert drafted > 300 and 40 < accepted < drafted - 40   # drafts made, accepted, rejected
    assert_drawn_alike(draws[0], draws[4])


# ---- the HTTP server: usage, /metrics, the request list ------------------------------------------

def test_server_reports_drafts_per_request(tmp_path):
    path = str(tmp_path / "syn.gguf")
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0")
    prompt = [11, 300, 42, 7, 199, 23, 400, 5, 77, 310, 2, 64, 128, 9, 251, 33, 18, 444, 90] * 2
    want = SingleProcessRunner(path, prompt_chunk=8).generate(prompt, 24).tokens
    s = ServerProcess(path, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                      "--max-context", "1024", "--gpu-order", "as_given", "--prefill", "8",
                      "--spec", "4")
    try:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"model": "syn", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                             "ignore_eos": True}).json()
        assert r["choices"][0]["token_ids"] == list(want)
        details = r["usage"]["completion_tokens_details"]
        accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        assert accepted > 0
        assert (r["timings"]["draft_tokens"], r["timings"]["draft_tokens_accepted"]) == (
            accepted + rejected, accepted)
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert f"strata_draft_tokens_total {float(accepted + rejected)}" in metrics
        assert f"strata_draft_tokens_accepted_total {float(accepted)}" in metrics
        row = httpx.get(f"{s.url}/v1/status", timeout=10).json()["recent_requests"][0]
        assert (row["draft_tokens"], row["draft_tokens_accepted"]) == (accepted + rejected, accepted)
    finally:
        s.close()


# ---- the planner prices a verify window on every stage ------------------------------------------

def test_verify_window_is_priced_on_every_stage():
    shape = make_shape(n_layers=12, kinds=hybrid_kinds(12))
    linear = [l for l in range(12) if shape.layer_kind[l] == "linear"]
    attention = [l for l in range(12) if shape.layer_kind[l] == "attention"]
    # 5 rows: the prompt buffers of 5 tokens, and with linear layers their state and the rows
    l = linear[0]
    assert verify_window_bytes(shape, l, l + 1, 5) == (shape.prompt_bytes(5) + shape.recurrent_bytes[l]
                                                       + 5 * shape.hidden * 4)
    a = attention[0]
    assert verify_window_bytes(shape, a, a + 1, 5) == shape.prompt_bytes(5)
    assert verify_window_bytes(shape, 0, 12, 1) == verify_window_bytes(shape, 0, 12, 0) == 0
    table = range_fixed_table(shape, 777, verify_rows=5)
    plain = range_fixed_table(shape, 777)
    for lb in range(12):
        for le in range(lb + 1, 13):
            assert table[lb, le] == sum(stage_fixed_bytes(shape, 777, lb, le, verify_rows=5))
            assert table[lb, le] - plain[lb, le] == verify_window_bytes(shape, lb, le, 5)
    devs = make_devices([600, 600], bw=[300, 300])
    base = make_plan(shape, devs, cells=256, split=[6], order="as_given")
    spec = make_plan(shape, devs, cells=256, split=[6], order="as_given",
                     params=PlanParams(verify_rows=5))
    for b, st in zip(base.stages, spec.stages):
        assert st.reserve_bytes - b.reserve_bytes == verify_window_bytes(shape, st.lb, st.le, 5) > 0


# ---- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,said", [
    (["--spec", "-1"], "--spec -1: K must be in [0, 7]"),
    (["--spec", "9"], "--spec 9: K must be in [0, 7]"),
    (["--spec", "2", "--draft", "bigram"], "--draft 'bigram': the drafters are ngram"),
    (["--spec", "2", "--spec-min-p", "1.5"], "--spec-min-p 1.5: P must be in [0, 1]"),
])
def test_bad_spec_flags_are_refused_at_start(moe, flags, said):
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", moe, "--cpu-ranks", "1",
                        "--serve", *flags], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {said}"), r.stderr
