"""The draft model of speculative decoding (`--spec K --draft-model FILE.gguf`,
strata_dist/rank/draft_model.py).

- greedy tokens of real launches (rank processes, sockets) with --spec 4 --draft-model D equal the
  single process's, 1 and 2 stages: D the target itself (every draft accepted) and D the same
  weights at q8_0 (drafts accepted and rejected, the draft's KV rolled back);
- a qwen3next draft model rolls its recurrent state back by its checkpoint and reads the accepted
  tokens again; the tokens stay those of one-row steps;
- sampled: the acceptance rule min(1, p/q) with the residual max(0, p - q) draws from the target
  distribution (chi-square against the softmax written out here), and a tiny model's sampled
  continuations follow one distribution with and without the draft model;
- the planner prices the draft on the last stage (--plan-only shows it; a budget it overflows is
  refused naming the sizes), and bad combinations and vocabularies are refused at start."""
import copy
import json
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hf_fixtures import tiny_qwen3moe, write_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from launch_helpers import ServeSession
from protocol.messages import Sampling
from strata_dist.rank.draft_model import DraftModel, plan_bytes
from strata_dist.sampling.sampler import Sampler, SamplingParams
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.sampling.speculative import draw_against
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.rank.stage_step import StageStep
from strata_dist.synth import write_synthetic
from test_speculative import CTX, PROMPT, _run, assert_drawn_alike, seeded_continuations

MIB = 1 << 20


def _noisy(model, scale: float):
    """A copy of `model` whose every weight moved by noise of `scale` times its spread: a draft
    of one vocabulary whose logits are near the target's, not equal."""
    out = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in out.parameters():
            if p.numel() > 1:
                p.add_(scale * p.std() * torch.randn_like(p))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The target (f32), its weights written again at q8_0 (one vocabulary, close logits), and
    a noisier draft (the sampled test wants rejections)."""
    d = tmp_path_factory.mktemp("draft")
    model = tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6)
    return {"target": str(write_gguf(model, d / "moe.gguf", "f32")),
            "q8": str(write_gguf(model, d / "moe_q8.gguf", "q8_0")),
            "noisy": str(write_gguf(_noisy(model, 0.3), d / "noisy.gguf", "f32"))}


# ---- greedy tokens through real launches ------------------------------------------------------

@pytest.mark.parametrize("draft,split", [("self", ""), ("self", "3"), ("q8", ""), ("q8", "3")])
def test_greedy_tokens_equal_without_speculation(files, draft, split):
    target = files["target"]
    draft_path = target if draft == "self" else files["q8"]
    want = SingleProcessRunner(target, prompt_chunk=16, max_context=CTX).generate(PROMPT, 40).tokens
    args = ["--cpu-ranks", "2" if split else "1", "--prefill", "16", "--max-context", str(CTX),
            "--vram-budget", "1G", "--gpu-order", "as_given", "--spec", "4",
            "--draft-model", draft_path]
    s = ServeSession(target, *args, *(["--layer-split", split] if split else []))
    try:
        out = s.gen(PROMPT, 40)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == list(want)
        drafted, accepted = int(out["stats"][-1]["drafted"]), int(out["stats"][-1]["accepted"])
        if draft == "self":
            assert accepted == drafted > 30       # the target drafts its own tokens
        else:
            assert 0 < accepted < drafted         # both paths of the window ran
        last = s.stats()[max(s.stats())]
        assert (int(last["spec_drafted"]), int(last["spec_accepted"])) == (drafted, accepted)
        # a second turn: the draft session follows the conversation where it now goes
        follow = PROMPT + out["tokens"] + [7, 8, 9]
        again = s.gen(follow, 8)
        assert again["err"] is None
        assert again["tokens"] == list(SingleProcessRunner(target, prompt_chunk=16,
                                                           max_context=CTX)
                                       .generate(follow, 8).tokens)
    finally:
        assert s.close() == 0


def test_qwen3next_target_and_draft_across_two_stages(tmp_path):
    """Both roll-backs at once: the target's stages re-run a window's accepted rows, the draft
    restores its checkpoint; the tokens are those of the single process."""
    model = tiny_qwen3next(2, tied=True, n_layers=4)
    target = str(write_next_gguf(model, tmp_path / "next.gguf", "f32"))
    draft = str(write_next_gguf(_noisy(model, 0.05), tmp_path / "noisy.gguf", "f32"))
    want = SingleProcessRunner(target, prompt_chunk=16, max_context=CTX).generate(PROMPT, 48).tokens
    s = ServeSession(target, "--cpu-ranks", "2", "--layer-split", "2", "--prefill", "16",
                     "--max-context", str(CTX), "--vram-budget", "1G", "--gpu-order", "as_given",
                     "--spec", "4", "--draft-model", draft)
    try:
        out = s.gen(PROMPT, 48)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == list(want)
        drafted, accepted = int(out["stats"][-1]["drafted"]), int(out["stats"][-1]["accepted"])
        assert 0 < accepted < drafted
        stats = s.stats()
        assert all(int(f["window_rerun_rows"]) > 0 for f in stats.values())
        assert int(stats[max(stats)]["draft_rerun_rows"]) > 0
    finally:
        assert s.close() == 0


# ---- qwen3next as the draft: recurrent state rolled back by its checkpoint ----------------------

def test_a_qwen3next_draft_rolls_its_state_back(tmp_path):
    model = tiny_qwen3next(2, tied=True, n_layers=4)
    target = str(write_next_gguf(model, tmp_path / "next.gguf", "f32"))
    # the draft: the same weights, each moved by noise of 5% of its spread (about half its
    # drafts are then accepted, and windows end inside their drafts)
    draft = str(write_next_gguf(_noisy(model, 0.05), tmp_path / "noisy.gguf", "f32"))
    drafter = DraftModel(draft, "cpu", CTX)
    step = StageStep(Stage(StageConfig(target, "cpu", 0, 4, True, True, CTX)), rank=0, last=True,
                     draft_model=drafter)
    plain = _run(step, 1, Sampling(max_new=60, prompt_ids=PROMPT))
    spec = _run(step, 2, Sampling(max_new=60, spec_tokens=4, prompt_ids=PROMPT))
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    assert 0 < spec[-1].accepted < spec[-1].drafted
    # rejected drafts: the draft's state came back from its checkpoint, accepted rows read again
    assert step.counters["draft_rerun_rows"] == drafter.rerun_rows > 0
    assert drafter.stage.checkpoint_counters()["checkpoint_restores"] > 0


@pytest.mark.parametrize("arch", ["moe", "next"])
def test_a_rolled_back_draft_session_drafts_as_a_fresh_one(files, tmp_path, arch):
    """After a window that accepted one draft of four, the draft session (rolled back: KV by
    position, recurrent state by its checkpoint) drafts what a fresh one that read the whole
    conversation drafts, with the same distributions."""
    if arch == "moe":
        path = files["q8"]
    else:
        path = str(write_next_gguf(tiny_qwen3next(2, tied=True, n_layers=4),
                                   tmp_path / "next.gguf", "f32"))
    sampled = SamplingParams(temperature=0.8, top_k=40)
    used = DraftModel(path, "cpu", CTX)
    first, _ = used.draft(0, PROMPT, 4, 0.0)
    assert len(first) == 4
    other = next(t for t in range(3, 300) if t != first[1])
    # the window ended at its second draft; then the head sent one more token (a turn's text)
    history = PROMPT + first[:1] + [other, 7]
    rolled, rolled_q = used.draft(0, history, 4, 0.0, sampled, np.random.default_rng(1))
    assert used.rerun_rows == (1 if arch == "next" else 0)   # the accepted draft read again
    fresh, fresh_q = DraftModel(path, "cpu", CTX).draft(0, history, 4, 0.0, sampled,
                                                        np.random.default_rng(1))
    assert rolled == fresh and len(fresh) == 4
    for (ids_a, p_a), (ids_b, p_b) in zip(rolled_q, fresh_q):
        assert np.array_equal(ids_a, ids_b) and np.allclose(p_a, p_b, atol=1e-6)


# ---- sampled: the acceptance rule of a drafter with a distribution ------------------------------

@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=1),
                                    SamplingParams(temperature=1.3, top_k=5, seed=2)])
def test_acceptance_against_q_draws_from_the_target_distribution(params):
    rng = np.random.default_rng(0)
    row = rng.normal(size=12)
    # the target, written out: temperature, top-k, softmax
    keep = np.argsort(-row, kind="stable")[:params.top_k or len(row)]
    p = np.zeros(len(row))
    p[keep] = np.exp((row[keep] - row[keep].max()) / params.temperature)
    p /= p.sum()
    # the drafter's q: another distribution, over every token (some outside the target's top-k)
    q = np.exp(rng.normal(size=12))
    q /= q.sum()
    q_ids = np.arange(12)
    sampler, draft_rng, n = Sampler(params), np.random.default_rng(9), 20000
    drawn, accepted = np.zeros(12, dtype=int), 0
    for _ in range(n):
        x = int(draft_rng.choice(12, p=q))
        tok = draw_against(sampler, row.astype(np.float32), x, (q_ids, q))
        drawn[tok] += 1
        accepted += tok == x
    assert drawn[p == 0].sum() == 0
    assert chisquare(drawn[p > 0], p[p > 0] * n).pvalue > 1e-3
    # the acceptance rate is sum min(p, q)
    assert abs(accepted / n - np.minimum(p, q).sum()) < 0.02


def test_sampled_continuations_follow_one_distribution_with_the_draft(files):
    """Many seeded 3-token continuations at temperature 0.5: the second and third tokens (drawn
    from a window's rows against the noisy draft's q) are distributed as without speculation."""
    target = files["target"]
    step = StageStep(Stage(StageConfig(target, "cpu", 0, 6, True, True, CTX)), rank=0, last=True,
                     draft_model=DraftModel(files["noisy"], "cpu", CTX))
    draws, drafted, accepted = seeded_continuations(step, PROMPT, 0.5, (0, 2), 500)
    assert drafted > 300 and 40 < accepted < drafted - 40   # drafts made, accepted, rejected
    assert_drawn_alike(draws[0], draws[2])


# ---- the planner ---------------------------------------------------------------------------------

def _launch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_the_plan_prices_the_draft_on_the_last_stage(files):
    target, draft = files["target"], files["q8"]
    base = ["--model", target, "--cpu-ranks", "2", "--layer-split", "3", "--max-context", "256",
            "--vram-budget", "1G", "--plan-only", "--json", "--spec", "4"]
    plain = json.loads(_launch(*base).stdout)
    r = _launch(*base, "--draft-model", draft)
    assert r.returncode == 0, r.stderr
    priced = json.loads(r.stdout)
    want = plan_bytes(draft, "cpu", None, 256)
    assert priced["params"]["draft_bytes"] == want > 0
    reserve = [(a["reserve_bytes"], b["reserve_bytes"])
               for a, b in zip(plain["stages"], priced["stages"])]
    assert reserve[0][0] == reserve[0][1]                 # not on the first stage
    assert reserve[1][1] - reserve[1][0] == want          # on the last, the draft's bytes
    table = _launch(*base[:-3], "--plan-only", "--spec", "4", "--draft-model", draft).stdout
    assert f"draft model (--draft-model): {want / MIB:.1f} MiB" in table


def test_a_draft_that_does_not_fit_is_refused_naming_its_size(files):
    target, draft = files["target"], files["q8"]
    need = plan_bytes(draft, "cpu", None, 256)
    base = ["--model", target, "--cpu-ranks", "1", "--max-context", "256", "--plan-only",
            "--spec", "4", "--prefill", "16"]
    # what the stage needs without the draft, then a budget half a draft above it
    said = _launch(*base, "--vram-budget", "4M").stderr
    plain_mib = float(re.search(r"needs ([0-9.]+) MiB", said).group(1))
    budget = f"{int((plain_mib + need / MIB / 2) * 1024)}K"
    assert _launch(*base, "--vram-budget", budget).returncode == 0
    r = _launch(*base, "--vram-budget", budget, "--draft-model", draft)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("error: "), r.stderr
    assert "needs" in lines[-1] and (f"(the draft model's {need / MIB:.1f} MiB, --draft-model, "
                                     "among them)") in lines[-1], lines[-1]


# ---- refusals at start ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
    """A synthetic model with a tokenizer, the same file with token 1 spelled otherwise, and a
    model of another vocabulary size."""
    d = tmp_path_factory.mktemp("vocab")
    syn = d / "syn.gguf"
    write_synthetic(syn, like="tiny", quant="f32", popularity="zipf:1.0")
    data = bytearray(syn.read_bytes())
    key = b"tokenizer.ggml.tokens"
    first = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4 + 8
    n = struct.unpack_from("<Q", data, first)[0]
    second = first + 8 + n
    data[second + 8] = ord("Z") if data[second + 8] != ord("Z") else ord("Y")
    (d / "respelled.gguf").write_bytes(bytes(data))
    small = write_gguf(tiny_qwen3moe(3, n_layers=2, vocab=256), d / "small.gguf", "f32")
    return {"syn": str(syn), "respelled": str(d / "respelled.gguf"), "small": str(small)}


@pytest.mark.parametrize("case", ["draft ngram", "draft model", "spec 0", "respelled", "size",
                                  "missing"])
def test_bad_draft_flags_are_refused_at_start(files, vocabularies, tmp_path, case):
    target, q8 = files["target"], files["q8"]
    flags, said = {
        "draft ngram": (["--spec", "4", "--draft", "ngram", "--draft-model", q8],
                        [f"--draft ngram and --draft-model {q8}"]),
        "draft model": (["--spec", "4", "--draft", "model"],
                        ["--draft model: name the draft model with --draft-model FILE.gguf"]),
        "spec 0": (["--draft-model", q8], [f"--draft-model {q8} with --spec 0"]),
        "respelled": (["--spec", "4", "--draft-model", vocabularies["respelled"]],
                      [f"--draft-model {vocabularies['respelled']}: token 1 is", "in the model "
                       f"{vocabularies['syn']}"]),
        "size": (["--spec", "4", "--draft-model", vocabularies["small"]],
                 [f"--draft-model {vocabularies['small']}: its vocabulary has 256 tokens",
                  f"the model {target}'s has 320"]),
        "missing": (["--spec", "4", "--draft-model", str(tmp_path / "none.gguf")],
                    [f"--draft-model {tmp_path / 'none.gguf'}: "]),
    }[case]
    model = vocabularies["syn"] if case == "respelled" else target
    r = _launch("--model", model, "--cpu-ranks", "1", "--serve", *flags)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for s in said:
        assert s in lines[0], lines[0]
