"""--parallel B's scheduler is fair: no running stream starves behind a 16K-token prompt.

A real `strata-launch --port` on a CPU rank and real streaming HTTP clients: two streams decode
while a third request's 16,384-token prompt is read. The prompt goes a chunk per decode step
(strata_dist/head/batch_scheduler.py), so each stream's longest wait for a token while it is read is
about one chunk's reading and one step, never the whole prompt's. The bound is in chunks, measured
on this run (the prompt's own reading time over its chunk count), not in seconds: a loaded machine
slows chunks and tokens alike."""
from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from server_helpers import ServerProcess
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

LONG = 16_384
CHUNK = 512          # --prefill: 32 chunks of prompt
STREAMS = 2
# a stream's longest gap, in chunk times: one chunk and one decode step alternate, so about one;
# generous for a loaded 2-core machine (one after another, the gap is all 32)
GAP_CHUNKS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny geometry with one layer of one attention head: a 16K prompt's attention on CPU
    ranks takes seconds, not minutes."""
    import dataclasses

    from strata_dist.synth import write_synthetic
    from strata_dist.synth.moe import GEOMETRIES
    path = str(tmp_path_factory.mktemp("fair") / "tiny.gguf")
    write_synthetic(path, like=dataclasses.replace(GEOMETRIES["tiny"], name="tiny-one-head",
                                                   n_layer=1, n_head=1, n_head_kv=1),
                    quant="f32")
    return path


@pytest.mark.timeout(120)
def test_streams_keep_getting_tokens_while_a_16k_prompt_is_read(tiny):
    server = ServerProcess(tiny, "--cpu-ranks", "1", "--vram-budget", "1G", "--max-context",
                           str(LONG + 1024), "--prefill", str(CHUNK), "--parallel",
                           str(STREAMS + 1))
    try:
        stamps: list[list[float]] = [[] for _ in range(STREAMS)]
        started = [threading.Event() for _ in range(STREAMS)]
        done = threading.Event()

        # each stream's every token is one whole character: the server sends a token as soon as
        # its text is whole, and a random model's byte tokens would hold some back, in bursts
        word = GGUFTokenizer.from_gguf(tiny).encode("x", add_special=False)
        assert len(word) == 1

        def stream(i: int) -> None:
            body = {"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 4000,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "logit_bias": {str(word[0]): 100}}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                        stamps[i].extend([time.monotonic()] * n)
                        started[i].set()
                    if done.is_set():
                        return      # the client leaves: its request is cancelled

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        long = [int(x) for x in np.random.default_rng(1).integers(10, 300, LONG)]
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": long, "max_tokens": 1, "temperature": 0})
        t1 = time.monotonic()
        done.set()
        for t in threads:
            t.join(60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == LONG and r.json()["timings"]["prompt_read"] == LONG
    finally:
        server.close()
    chunks = -(-LONG // CHUNK)
    chunk_s = (t1 - t0) / chunks          # one chunk's reading (and a step beside it), this run
    for i in range(STREAMS):
        during = [s for s in stamps[i] if t0 <= s <= t1]
        gaps = np.diff([t0, *during, t1])
        # about a token per chunk read; with the prompt read first, none until its end
        assert len(during) >= chunks // 2, (i, len(during), chunks)
        assert gaps.max() <= GAP_CHUNKS * chunk_s, (i, gaps.max(), chunk_s)
