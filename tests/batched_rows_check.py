"""A batched decode step's last stage on a GPU, without a GPU: a qwen3moe Stage on the numpy
stand-ins for CuPy (tests/fake_cupy), its decode graph's kernels launched as no-ops, and known
logits written into the graph's logits rows after each replay (what the output kernel would
leave there). What runs is the Python around the kernels (backends/batched_decode.py step_rows,
rank/stage_step.py): the order of the replays' launches and waits, what is copied back to the
host, and each row's token as the last stage draws it from the rows left on the card.

Run as its own process with tests/fake_cupy first on the path (tests/test_batched_rows.py does).
Prints one JSON line."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_abi_check import install_kernels  # noqa: E402
from sampling_ahead_check import _NoKernel  # noqa: E402

SESSIONS = 10                 # two replays: 8 rows and 2
NAN_ROW, NO_FINITE_ROW = 3, 6


def known_rows(n: int, vocab: int, seed: int) -> np.ndarray:
    """The logits the check writes for a replay of n rows: distinct random rows, one with a NaN
    and one with no finite logit where the step's rows reach them."""
    return np.random.default_rng(seed).standard_normal((n, vocab)).astype(np.float32) * 4


class _GreedyRows(_NoKernel):
    """sample_rows.cu greedy_rows's facts of each row, computed as its tests hold the kernel to
    them (numpy's argmax: tests/test_sample_rows_host.py, tests/test_gpu_batched_decode.py)."""

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        rows, n_vocab, n, out = args
        logits = np.asarray(rows).reshape(int(n), int(n_vocab))
        best = logits.argmax(axis=1)
        out[0] = best
        out[1] = np.isfinite(logits[np.arange(int(n)), best])
        out[2] = np.isnan(logits).any(axis=1)


def main() -> int:
    install_kernels(lambda source, kernel, device=0, defines=():
                    _GreedyRows() if kernel == "greedy_rows" else _NoKernel())
    import cupy
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from protocol import Error, Token, Tokens
    from protocol.batch import BatchRows
    from protocol.messages import Sampling
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.rank.stage_step import StageStep
    from strata_dist.sampling.sampler import Sampler, SamplingParams

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=2), Path(d) / "m.gguf", "f16")
        stage = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=0, le=2, first=True,
                                  last=True, max_context=128,
                                  cache_pairs=[(l, e) for l in range(2) for e in range(16)]))
        g = stage.decode_graph
        out["graph"] = type(g).__name__ if g is not None else None
        vocab = g.g.n_vocab
        step = StageStep(stage, rank=0, last=True)
        samplings = [Sampling(max_new=4, head_steps=True) if i % 2 == 0 else
                     Sampling(max_new=4, head_steps=True, temperature=0.8, top_p=0.9, seed=i)
                     for i in range(SESSIONS)]
        for sid in range(SESSIONS):      # each request's prompt (its first token drawn there)
            step.step(Tokens(request_id=100 + sid, session_id=sid, pos=0, ids=[1, 2, 3],
                             sampling=samplings[sid]))

        events, written = [], []
        launch, wait = g._launch_step, g._wait

        def launch_and_write(rows, ids, hidden, slot, **kw):
            got = launch(rows, ids, hidden, slot, **kw)
            events.append(f"launch {slot}")
            values = known_rows(rows.n, vocab, seed=len(written))
            at = sum(len(w) for w in written)
            for r in range(rows.n):
                if at + r == NAN_ROW:
                    values[r, 5] = np.nan
                if at + r == NO_FINITE_ROW:
                    values[r, :] = -np.inf
            written.append(values)
            g.logits_rows[:rows.n] = values      # what the output kernel leaves
            return got

        def logged_wait(slot, n):
            events.append(f"wait {slot}")
            return wait(slot, n)
        g._launch_step, g._wait = launch_and_write, logged_wait
        copies = []
        asnumpy = cupy.asnumpy

        def logged_asnumpy(x, *a, **kw):
            copies.append(int(np.asarray(x).size))
            return asnumpy(x, *a, **kw)
        cupy.asnumpy = logged_asnumpy

        order = list(range(SESSIONS))[::-1]
        batch = BatchRows(request_ids=[100 + s for s in order], session_ids=order,
                          positions=[3] * SESSIONS)
        sent = step.step(Tokens(request_id=999, session_id=0, pos=0, ids=[7] * SESSIONS,
                                batch=batch))
        cupy.asnumpy = asnumpy
        out["events"] = events
        out["largest_copy_back"] = max(copies) if copies else 0
        out["vocab"] = vocab
        rows = np.concatenate(written)
        want = {}
        for i, sid in enumerate(order):
            row = rows[i]
            if i == NAN_ROW:
                want[100 + sid] = "NaN"
            elif i == NO_FINITE_ROW:
                want[100 + sid] = "not numbers"
            else:
                p = samplings[sid]
                host = Sampler(SamplingParams(temperature=p.temperature, top_p=p.top_p,
                                              seed=p.seed))
                host(np.zeros(vocab, dtype=np.float32))    # its prompt's draw came first
                want[100 + sid] = host(row)
        got = {}
        for o in sent:
            if isinstance(o.msg, Token):
                got[o.msg.request_id] = o.msg.token_id
            elif isinstance(o.msg, Error):
                got[o.msg.request_id] = ("NaN" if "are NaN" in o.msg.message else
                                         "not numbers" if "not numbers" in o.msg.message
                                         else o.msg.message)
        out["tokens_as_host_draws"] = got == want
        out["got"], out["want"] = {str(k): v for k, v in got.items()}, \
            {str(k): v for k, v in want.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
