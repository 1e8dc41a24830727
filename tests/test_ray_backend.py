"""`strata-launch --backend ray`: the ranks as Ray actors in a placement group on a one-machine Ray
cluster of CPU ranks (the launcher starts the cluster itself), over the same ZeroMQ data plane.
Skips when Ray is not installed (the optional extra: pip install 'strata-dist[ray]')."""
import re
import time

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession, wait_gone
from strata_dist.tools.single_process import SingleProcessRunner

pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'strata-dist[ray]')")

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]


@pytest.mark.slow
def test_ray_cpu_ranks_equal_the_single_process(tmp_path):
    model = write_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=6), tmp_path / "m6.gguf", "f32")
    baseline = SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 16).tokens
    s = ServeSession(model, "--backend", "ray", "--cpu-ranks", "2", "--vram-budget", "1G",
                     "--layer-split", "3", "--prefill", str(CHUNK), "--max-context", "512",
                     timeout=120)
    try:
        deadline = time.monotonic() + 10   # stderr is read on a thread: it may lag stdout
        while True:
            err = "".join(s.stderr)
            pids = [int(p) for p in re.findall(r"on Ray node \S+ \(pid (\d+)\)", err)]
            if len(pids) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(pids) == 2, err
        ranks = [f for f in s.info_fields() if "rank" in f]
        assert [(r["lb"], r["le"]) for r in ranks] == [("0", "3"), ("3", "6")]
        out = s.gen(PROMPT, 16)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
    finally:
        assert s.close(timeout=60) == 0
    assert wait_gone(pids) == []   # the actors' rank processes are gone with the launch
