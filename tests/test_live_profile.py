"""A routing profile learnt while serving (--expert-profile-out): real CPU ranks through the
launcher count their layers' routing; the file, written periodically and at shutdown, is the
format --expert-profile reads, and a restart's plan caches the experts the traffic used."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launch_helpers import ServeSession, rank_pids, wait_gone
from strata_dist.tools.profile_io import load_profile, record_profile
from strata_dist.synth import GEOMETRIES, write_synthetic

TINY = GEOMETRIES["tiny"]
L, E = TINY.n_layer, TINY.n_expert
PROMPTS = [[11, 12, 13] * 6, [40, 41] * 5]
MAX_NEW = 12
RANKS = ("--cpu-ranks", "2", "--layer-split", "2", "--no-remote-auto", "--expert-cache", "3",
         "--prefill", "8", "--max-context", "512")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("live-profile") / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="q8_0", popularity="uniform", seed=0)
    return str(path)


def _plan_pairs(model: str, *flags: str) -> list[set]:
    """Each stage's cached pairs in the plan strata-launch makes with `flags`."""
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, *RANKS,
                          "--plan-only", "--json", *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [{tuple(p) for p in st["pairs"]} for st in json.loads(out.stdout)["stages"]]


def test_served_routing_is_saved_and_the_next_plan_caches_it(model, tmp_path):
    path = tmp_path / "learnt.json"
    s = ServeSession(model, *RANKS, "--expert-profile-out", str(path),
                     "--expert-profile-every", "0.5")
    try:
        replies = []
        for prompt in PROMPTS:
            out = s.gen(prompt, MAX_NEW)
            assert out["err"] is None, out["err"]
            replies.append(out["tokens"])
        deadline = time.monotonic() + 10     # written while serving, not only at the end
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert path.exists()
    finally:
        assert s.close() == 0
    learnt = load_profile(path, L, E).counts
    # the same traffic through the single-process forward, counted by its routing hook: each
    # prompt and its fed-back tokens (the last token of a reply is never fed back)
    fed = [p + r[:-1] for p, r in zip(PROMPTS, replies)]
    np.testing.assert_array_equal(learnt, record_profile(model, fed).counts)
    assert json.loads(path.read_text())["meta"]["learnt"] == "live"

    # restarted with it: each stage's cache is a hottest set of its layers' pairs (ties aside)
    for (lb, le), pairs in zip([(0, 2), (2, 4)], _plan_pairs(model, "--expert-profile",
                                                            str(path))):
        held = np.zeros((L, E), dtype=bool)
        for layer, expert in pairs:
            held[layer, expert] = True
        own = learnt[lb:le]
        assert own[held[lb:le]].min() > 0
        assert own[held[lb:le]].min() >= own[~held[lb:le]].max()
    # and a plan without it would not have (the uniform ranking)
    assert _plan_pairs(model) != _plan_pairs(model, "--expert-profile", str(path))


def test_a_replaced_rank_keeps_its_predecessors_routing_in_the_profile(model, tmp_path):
    """A rank killed and replaced (--rejoin) counts from zero; the profile adds its counts to
    what the lost process had counted, so no layer's history is lost."""
    path = tmp_path / "learnt.json"
    s = ServeSession(model, *RANKS, "--rejoin", "--expert-profile-out", str(path),
                     "--expert-profile-every", "0.2")

    def per_layer():
        return np.array(json.loads(path.read_text())["counts"]).sum(axis=1)
    try:
        fed = 0    # rows read: each prompt and its fed-back tokens
        for prompt in PROMPTS:
            out = s.gen(prompt, MAX_NEW)
            assert out["err"] is None
            fed += len(prompt) + len(out["tokens"]) - 1
        deadline = time.monotonic() + 10   # a write after the last request's counts came back
        while not (path.exists() and per_layer().sum() == L * TINY.n_expert_used * fed) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        before = per_layer()
        pid = rank_pids(s)[1]
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid])
        for _ in range(30):    # requests fail until the replacement is Ready
            if s.gen([50, 51], 2)["err"] is None:
                break
            time.sleep(0.5)
        deadline = time.monotonic() + 10
        while per_layer()[2:].sum() <= before[2:].sum() and time.monotonic() < deadline:
            time.sleep(0.1)
        after = per_layer()
    finally:
        assert s.close() == 0
    assert (after >= before).all(), (before, after)
    assert (after[2:] > before[2:]).all(), (before, after)    # the replacement's layers


@pytest.mark.parametrize("flag,value,message", [
    ("--expert-profile-out", "/nonexistent-folder/p.json",
     "error: --expert-profile-out /nonexistent-folder/p.json: its folder /nonexistent-folder is "
     "not a writable folder"),
    ("--expert-profile-every", "0", "error: --expert-profile-every 0: expected seconds > 0"),
])
def test_a_bad_profile_flag_is_one_error_line(model, flag, value, message):
    p = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--serve", flag,
                        value], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [message]


# ---- speculative decoding: only the rows that stand are counted ---------------------------------

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from hf_fixtures import tiny_qwen3moe, write_gguf as write_moe
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    d = tmp_path_factory.mktemp("spec-profile")
    return {"moe": str(write_moe(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=4),
                                 d / "moe.gguf", "f32")),
            "next": str(write_next(tiny_qwen3next(2, tied=True, n_layers=4), d / "next.gguf",
                                   "f32"))}


@pytest.mark.parametrize("arch", ["moe", "next"])
def test_speculation_counts_only_the_rows_that_stand(hf_models, arch, tmp_path):
    """--spec: a verify window's rows of rejected drafts, and the rows a qwen3next stage runs
    again to roll its state back, are no token of the traffic: the profile equals the routing of
    the prompts and the tokens fed back, counted by the single-process forward."""
    model, path = hf_models[arch], tmp_path / "learnt.json"
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, 40, 60)] for _ in range(2)]
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G",
                     "--prefill", "8", "--max-context", "512", "--expert-profile-out", str(path),
                     "--spec", "4")
    try:
        replies, drafted, accepted = [], 0, 0
        for prompt in prompts:
            out = s.gen(prompt, 30)
            assert out["err"] is None and out["done"][-1] == "length", out
            replies.append(out["tokens"])
            drafted += int(out["stats"][-1]["drafted"])
            accepted += int(out["stats"][-1]["accepted"])
        assert drafted > accepted > 0                  # windows both accepted and rejected
    finally:
        assert s.close() == 0
    learnt = load_profile(path, 4, json.loads(path.read_text())["n_experts"]).counts
    fed = [p + r[:-1] for p, r in zip(prompts, replies)]
    np.testing.assert_array_equal(learnt, record_profile(model, fed).counts)


def test_the_adapt_clock_ticks_by_the_rows_that_stand(hf_models):
    """A window of 5 rows of which 2 stand (the next step comes at its third row): the counts and
    the adaptive cache's token clock are those of 2 one-row steps."""
    from strata_dist.rank.stage import Stage, StageConfig

    def stage():
        return Stage(StageConfig(hf_models["next"], "cpu", 0, 4, True, True, 128,
                                 adapt_every=1000, adapt_swaps=1))
    prompt = list(range(3, 19))
    spec, plain = stage(), stage()
    for st in (spec, plain):
        st.run(0, 0, ids=prompt, prompt=True)
    at = len(prompt)
    spec.run(0, at, ids=[7, 9, 30, 31, 32], all_rows=True)   # 7 and 9 stand
    for i, t in enumerate([7, 9]):
        plain.run(0, at + i, ids=[t])
    for st in (spec, plain):
        st.run(0, at + 2, ids=[11])
    np.testing.assert_array_equal(spec.routing.total, plain.routing.total)
    np.testing.assert_array_equal(spec.routing.counts, plain.routing.counts)
    assert spec.routing.tokens == plain.routing.tokens == len(prompt) + 3
