"""The fault drill: 20 rank kills at random points of generation -> 20 clear errors, no hang, and
after each one the service comes back (--restart-ranks) with the same tokens as before."""
import os
import random
import signal
import time

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession, rank_pids, wait_gone

PROMPT = [int(x) for x in np.random.default_rng(3).integers(0, 320, 20)]
KILLS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(41, n_layers=4), tmp_path_factory.mktemp("drill") / "m.gguf")


def _until(s, prefix, timeout):
    """Lines up to the first starting with `prefix` (bounded: no hang)."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        line = s.next_line(max(0.1, deadline - time.monotonic()))
        seen.append(line)
        if line.startswith(prefix):
            return seen


def _kill_during_generation(s, rng):
    """A long generation, SIGKILL of one of the 3 ranks at a random point of it, and the ERR that
    must follow within 30 s: (the rank PIDs before, the victim, the ERR line)."""
    pids = rank_pids(s)
    assert len(pids) == 3, pids
    s.send(f"GEN 1500 {' '.join(map(str, PROMPT))}")
    _until(s, "T ", 30)                              # generation is under way
    for _ in range(rng.randrange(0, 40)):            # a random point of it
        line = s.next_line(30)
        if line.startswith(("DONE", "ERR")):
            break
    victim = rng.choice(pids)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    err = _until(s, "ERR", 30)[-1]
    assert time.monotonic() - t0 < 30
    return pids, victim, err


@pytest.mark.slow
def test_twenty_kills_twenty_errors_and_the_same_tokens_after_each(model):
    rng = random.Random(7)
    s = ServeSession(model, "--cpu-ranks", "3", "--layer-split", "1,3", "--prefill", "8",
                     "--max-context", "2048", "--restart-ranks", str(KILLS))
    try:
        before = s.gen(PROMPT, 24)
        assert before["err"] is None and len(before["tokens"]) == 24
        errors = 0
        for i in range(KILLS):
            pids, victim, err = _kill_during_generation(s, rng)
            assert "rank" in err and ("killed" in err or "exited" in err or "nothing" in err), err
            errors += 1
            _until(s, "READY", 60)                           # the service is back
            assert wait_gone(pids) == []                     # the old ranks are all gone
            after = s.gen(PROMPT, 24)
            assert after["err"] is None, after["err"]
            assert after["tokens"] == before["tokens"], f"kill {i + 1}"
        assert errors == KILLS
    finally:
        s.close()


@pytest.mark.slow
def test_rejoin_twenty_kills_only_the_victim_is_replaced(model):
    """--rejoin: each kill fails the request in flight with ERR; the launcher starts that rank
    again and it rejoins while the other ranks keep running (their PIDs never change), and the
    next request is served with the same tokens."""
    rng = random.Random(11)
    s = ServeSession(model, "--cpu-ranks", "3", "--layer-split", "1,3", "--prefill", "8",
                     "--max-context", "2048", "--rejoin")
    try:
        before = s.gen(PROMPT, 24)
        assert before["err"] is None and len(before["tokens"]) == 24
        errors = 0
        for i in range(KILLS):
            pids, victim, err = _kill_during_generation(s, rng)
            assert "rank" in err and "killed" in err and "replacement" in err, err
            errors += 1
            after = s.gen(PROMPT, 24)                        # waits for the replacement
            assert after["err"] is None, after["err"]
            assert after["tokens"] == before["tokens"], f"kill {i + 1}"
            now = rank_pids(s)
            survivors = [p for p in pids if p != victim]
            assert len(now) == 3 and set(survivors) <= set(now), (pids, victim, now)
            assert wait_gone([victim]) == []
        assert errors == KILLS
    finally:
        s.close()


@pytest.mark.slow
def test_rejoin_retries_a_rank_that_cannot_load_until_it_can(model, tmp_path):
    """A replacement that dies before loading (here: its model file is gone) is started again
    with a growing delay; meanwhile each request gets ERR within the load timeout, and once the
    file is back the rank rejoins and the next request has the same tokens."""
    path = tmp_path / "m.gguf"
    path.write_bytes(open(model, "rb").read())
    s = ServeSession(str(path), "--cpu-ranks", "2", "--layer-split", "2", "--prefill", "8",
                     "--max-context", "2048", "--rejoin", "--load-timeout", "8")
    try:
        before = s.gen(PROMPT, 8)
        assert before["err"] is None
        path.rename(tmp_path / "gone.gguf")
        os.kill(rank_pids(s)[1], signal.SIGKILL)
        assert s.err_has("started rank 1 again", timeout=10)    # noticed while idle
        t0 = time.monotonic()
        out = s.gen(PROMPT, 8, timeout=60)
        assert out["err"] is not None and "no replacement has loaded within 8 s" in out["err"]
        assert time.monotonic() - t0 < 30
        (tmp_path / "gone.gguf").rename(path)
        deadline = time.monotonic() + 90
        while True:
            after = s.gen(PROMPT, 8, timeout=60)
            if after["err"] is None or time.monotonic() > deadline:
                break
        assert after["err"] is None, after["err"]
        assert after["tokens"] == before["tokens"]
    finally:
        s.close()
