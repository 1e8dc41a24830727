"""A cancel during a long prompt stops it between chunks on every stage, with real rank processes
(two CPU stages): `CANCEL` or a first SIGINT on `--serve` answers `DONE … cancelled` within 5 s
while the prompt has most of its chunks to go, and an HTTP client that leaves mid-prompt frees
the worker as fast. What the cancelled prompt left behind is reused only as far as the last
stage read it: the next GEN resumes there (a session with recurrent state: at 0) and its greedy
tokens equal a fresh launch's. And the
head paces the chunks, so a prompt of thousands of them no longer stalls the pipeline."""
import signal
import time
from dataclasses import replace

import httpx
import pytest

from launch_helpers import ServeSession
from server_helpers import ServerProcess

CONTEXT = 32768
# 1000 chunks of 32 tokens: tens of seconds on two CPU stages, so a cancel that waited for the
# prompt's end could not answer in time
LONG = [(7 * i) % 500 + 3 for i in range(CONTEXT - 768)]
CHUNK = 32
# the GEN after a cancel: the long prompt's start (more than was read before the cancel), then
# tokens of its own
FOLLOW = LONG[:1024] + [9, 10, 11]
ARGS = ("--cpu-ranks", "2", "--layer-split", "2", "--prefill", str(CHUNK),
        "--max-context", str(CONTEXT))
# the bound for a stop at depth; a cancel that waited for the prompt's end takes tens of
# seconds here, and a loaded two-core CI machine needs more than the ~0.3 s a quiet one does
CANCEL_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    from strata_dist.synth.moe import GEOMETRIES
    path = tmp_path_factory.mktemp("cancel") / "m.gguf"
    # the tiny geometry, trained to a context that holds the long prompt
    write_synthetic(path, like=replace(GEOMETRIES["tiny"], name="tiny-long",
                                       context_length=CONTEXT),
                    quant="f32", popularity="zipf:1.0", seed=0)
    return str(path)


@pytest.fixture(scope="module")
def follow_tokens(model):
    """FOLLOW's greedy tokens from a launch that never saw anything else."""
    s = ServeSession(model, *ARGS)
    try:
        out = s.gen(FOLLOW, 8)
    finally:
        s.close()
    assert out["done"][-1] == "length" and out["resume"] == 0, out
    return out["tokens"]


def _gen_line(ids: list[int], max_new: int) -> str:
    return f"GEN {max_new} {' '.join(map(str, ids))}"


def _cancel_mid_prompt(s: ServeSession, cancel) -> tuple[float, list[str], int]:
    """Start the long GEN, cancel it after its first few chunks: (seconds from the cancel to
    DONE, DONE's fields, the last prompt position reported)."""
    s.send(_gen_line(LONG, 4))
    seen, last_pos = 0, 0
    while seen < 5:
        line = s.next_line(30)
        assert not line.startswith(("ERR", "DONE", "T ")), line
        if line.startswith("PP "):
            seen += 1
            last_pos = int(line.split()[1])
    t0 = time.monotonic()
    cancel()
    while True:
        line = s.next_line(60)
        assert not line.startswith(("ERR", "T ")), line
        if line.startswith("PP "):
            last_pos = int(line.split()[1])
        elif line.startswith("DONE"):
            return time.monotonic() - t0, line.split()[1:], last_pos


def _check_follow(s: ServeSession, read_to: int, follow_tokens: list[int]) -> None:
    """The next GEN resumes where the last stage stopped reading, never past it, and reads on to
    the tokens a fresh launch gives."""
    assert 0 < read_to < 1024, read_to
    nxt = s.gen(FOLLOW, 8)
    assert nxt["done"][-1] == "length" and nxt["resume"] == read_to, nxt
    assert nxt["tokens"] == follow_tokens


@pytest.mark.parametrize("how", ["cancel-line", "sigint"])
def test_a_cancel_mid_prompt_answers_in_seconds_and_the_next_gen_is_right(model, follow_tokens,
                                                                       how):
    s = ServeSession(model, *ARGS)
    try:
        cancel = ((lambda: s.send("CANCEL")) if how == "cancel-line"
                  else (lambda: s.proc.send_signal(signal.SIGINT)))
        took, done, read_to = _cancel_mid_prompt(s, cancel)
        assert done[-1] == "cancelled" and done[0] == "0", done
        assert took < CANCEL_WITHIN_S, f"DONE came {took:.1f} s after the cancel"
        assert read_to < len(LONG) // 2, read_to    # stopped mid-prompt, not at its end
        _check_follow(s, read_to, follow_tokens)
        stats = s.stats()
        # the chunks queued behind the cancel were dropped, not computed, on both stages
        assert int(stats[1]["chunks"]) < len(LONG) // CHUNK // 2, stats
    finally:
        s.close()


def test_an_http_client_leaving_mid_prompt_frees_the_worker_in_seconds(model):
    server = ServerProcess(model, *ARGS)
    try:
        with httpx.Client(timeout=60.0) as c:
            body = {"model": "m", "prompt": LONG, "max_tokens": 4, "stream": True}
            with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                time.sleep(1.5)     # the prompt is being read (nothing streams meanwhile)
            t0 = time.monotonic()   # the client left
            short = c.post(f"{server.url}/v1/completions",
                           json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 4})
            took = time.monotonic() - t0
        assert short.status_code == 200, short.text
        assert short.json()["usage"]["completion_tokens"] == 4
        assert took < CANCEL_WITHIN_S, f"the next request took {took:.1f} s"
    finally:
        server.close()


def test_a_prompt_of_thousands_of_chunks_is_read_to_its_end(model):
    """The head sends chunks as the last stage reports them: 8,000 one-token chunks (more than
    the sockets queue, sent up front, with the progress of each piling up unread) are read and
    the GEN answered, every chunk reported."""
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2", "--prefill", "1",
                     "--max-context", str(CONTEXT))
    try:
        out = s.gen(LONG[:8000], 2, timeout=60)
        assert out["err"] is None and out["done"][-1] == "length", out
        assert len(out["pp"]) == 8000 and out["pp"][-1][0] == "8000"
    finally:
        s.close()


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("cancel-next") / "next.gguf"
    write_synthetic(path, like="tiny-next", quant="f32", popularity="zipf:1.0", seed=0)
    return str(path)


def test_a_recurrent_session_cancelled_mid_prompt_reads_the_next_gen_afresh(next_model):
    """qwen3next's linear-attention state is not positional: the first stage has read past what
    the last stage reported, so the next GEN resumes at 0 (no checkpoint lies before the cancel)
    and gives a fresh launch's tokens."""
    args = ("--cpu-ranks", "2", "--layer-split", "4", "--prefill", "2", "--max-context", "4096")
    prompt, follow = LONG[:4000], LONG[:600] + [9, 10, 11]
    fresh = ServeSession(next_model, *args)
    try:
        want = fresh.gen(follow, 8)
    finally:
        fresh.close()
    assert want["done"][-1] == "length", want
    s = ServeSession(next_model, *args)
    try:
        s.send(_gen_line(prompt, 4))
        seen = 0
        while seen < 5:
            line = s.next_line(30)
            assert not line.startswith(("ERR", "DONE", "T ")), line
            seen += line.startswith("PP ")
        s.send("CANCEL")
        while not (line := s.next_line(60)).startswith("DONE"):
            assert not line.startswith(("ERR", "T ")), line
        assert line.split()[-1] == "cancelled", line
        nxt = s.gen(follow, 8)
        assert nxt["err"] is None and nxt["resume"] == 0, nxt
        assert nxt["tokens"] == want["tokens"]
    finally:
        s.close()
