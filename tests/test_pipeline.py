"""The distributed pipeline on CPU ranks: real rank processes, real ZeroMQ sockets.

Greedy tokens of 1-4 stages equal the single process; each stage loads and carves exactly what
the plan priced; a killed rank fails the request with a message and leaves no process; a second
turn resumes the session."""
import os
import signal
import time

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession, rank_pids, wait_gone
from strata_dist.tools.single_process import SingleProcessRunner

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]  # 3 chunks of 16


@pytest.fixture(scope="module")
def model6(tmp_path_factory):
    """6 layers, so 4 stages can have several shapes (single-layer stages among them)."""
    return write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6),
                      tmp_path_factory.mktemp("pipe") / "m6.gguf", "f32")


@pytest.fixture(scope="module")
def baseline(model6):
    return SingleProcessRunner(model6, prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 64).tokens


@pytest.mark.parametrize("split", ["", "3", "1,5", "2,3,4", "1,2,5"])
def test_greedy_tokens_equal_single_process(model6, baseline, split):
    n = len(split.split(",")) + 1 if split else 1
    args = ["--cpu-ranks", str(n), "--prefill", str(CHUNK), "--max-context", "512",
            "--gpu-order", "as_given", "--vram-budget", "1G"]
    if split:
        args += ["--layer-split", split]
    s = ServeSession(model6, *args)
    try:
        out = s.gen(PROMPT, 64)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        assert len(out["pp"]) == 3 and out["pp"][-1][:2] == ["40", "40"]
        assert out["done"][:2] == ["64", "40"] and out["done"][-1] == "length"
        ranks = [f for f in s.info_fields() if "rank" in f]
        bounds = [0] + [int(k) for k in split.split(",") if k] + [6]
        assert [(int(r["lb"]), int(r["le"])) for r in ranks] == list(zip(bounds, bounds[1:]))
    finally:
        assert s.close() == 0


def test_second_turn_resumes_and_equals_a_fresh_read(model6):
    s = ServeSession(model6, "--cpu-ranks", "2", "--layer-split", "3", "--prefill", str(CHUNK),
                     "--max-context", "512")
    try:
        first = s.gen(PROMPT, 8)
        follow = PROMPT + first["tokens"] + [7, 8, 9]
        second = s.gen(follow, 8)
        assert second["resume"] == len(PROMPT) + len(first["tokens"]) - 1
        assert second["done"][1] == str(len(follow) - second["resume"])
    finally:
        s.close()
    # The single process doing the same two turns on one session.
    eng = SingleProcessRunner(model6, prompt_chunk=CHUNK, max_context=512)
    assert first["tokens"] == eng.generate(PROMPT, 8).tokens
    again = eng.generate(follow, 8, resume=True)
    assert again.reused == second["resume"]
    assert second["tokens"] == again.tokens


def test_kill_a_rank_mid_generation(model6):
    s = ServeSession(model6, "--cpu-ranks", "3", "--layer-split", "2,4", "--prefill", str(CHUNK),
                     "--max-context", "4096")
    pids = rank_pids(s)
    assert len(pids) == 3
    s.send(f"GEN 4000 {' '.join(map(str, PROMPT))}")
    while not s.next_line(30).startswith("T"):
        pass
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    line = s.next_line(30)
    while line.startswith("T"):
        line = s.next_line(30)
    assert line.startswith("ERR") and "rank 1" in line, line
    assert time.monotonic() - t0 < 30
    assert s.proc.wait(timeout=30) != 0
    assert wait_gone(pids) == []


def test_sigterm_stops_every_rank(model6):
    s = ServeSession(model6, "--cpu-ranks", "2", "--layer-split", "3")
    pids = rank_pids(s)
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(timeout=30)
    assert wait_gone(pids) == []


def test_weight_slice_kill_switch_loads_every_layer(model6):
    on = ServeSession(model6, "--cpu-ranks", "2", "--layer-split", "3")
    off = ServeSession(model6, "--cpu-ranks", "2", "--layer-split", "3",
                       env={"STRATA_WEIGHT_SLICE": "0"})
    try:
        w_on = [float(f["weights_mib"]) for f in on.info_fields() if "rank" in f]
        w_off = [float(f["weights_mib"]) for f in off.info_fields() if "rank" in f]
        assert w_off[0] == w_off[1] > max(w_on)
        assert off.gen(PROMPT, 8)["tokens"] == on.gen(PROMPT, 8)["tokens"]
    finally:
        on.close()
        off.close()
