"""benchmarks/profile_decode.py --rows N without a GPU: the whole profile (the one-row part, then
the batched step's) on a tiny qwen3moe file, on the numpy stand-ins for CuPy (tests/fake_cupy),
its decode graph's kernels launched as no-ops. After each launch of a step's rows, each row's
logits get one known best token, a function of the row's position (what the output kernel would
leave), so the rows' next ids can be followed from step to step.

What it records beside the printed profile: every kernel each step of the graph launched (by row
count and output kind, captured or eager), and the rows (sessions, positions, ids) that reached
step_rows and replay_kernel_times. Run as its own process with tests/fake_cupy first on the path
(tests/test_profile_rows.py does); arguments: N, and optionally a kernel shape
(STRATA_KERNEL_SHAPE, e.g. matvec_accs=16). Prints one JSON line."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "benchmarks"))

from batched_rows_check import _GreedyRows  # noqa: E402
from launch_abi_check import install_kernels  # noqa: E402
from sampling_ahead_check import _NoKernel  # noqa: E402

CONTEXT, STEPS = 128, 3
LAUNCHED: list[str] | None = None     # the kernels of the step being queued, in order


def best_token(pos: int, n_vocab: int) -> int:
    """The greedy token the check makes a row at `pos` give."""
    return (17 * pos + 5) % n_vocab


class _Recorded(_NoKernel):
    def __init__(self, name: str):
        self.name = name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if LAUNCHED is not None:
            LAUNCHED.append(self.name)


def main() -> int:
    n = int(sys.argv[1])
    if len(sys.argv) > 2:          # read by compute_options when the graph is built
        os.environ["STRATA_KERNEL_SHAPE"] = sys.argv[2]
    install_kernels(lambda source, kernel, device=0, defines=():
                    _GreedyRows() if kernel == "greedy_rows" else _Recorded(kernel))
    import cupy
    import profile_decode
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.backends.cuda_decode import DecodeGraph

    steps: list[dict] = []       # each _enqueue: its rows, output kind, graph or eager, kernels
    calls: list[dict] = []       # each step_rows call
    timed: list[dict] = []       # each replay_kernel_times call
    session_no: dict[int, int] = {}

    def rows_of(replays) -> dict:
        sessions = [s for r in replays for s in r.sessions]
        return {"sessions": [session_no.setdefault(id(s), len(session_no)) for s in sessions],
                "positions": [int(p) for r in replays for p in r.positions],
                "replays": [r.n for r in replays]}

    enqueue, launch_step = DecodeGraph._enqueue, DecodeGraph._launch_step
    step_rows, replay_times = DecodeGraph.step_rows, DecodeGraph.replay_kernel_times

    def recorded_enqueue(self, rows, every_row=False):
        global LAUNCHED
        LAUNCHED = []
        try:
            enqueue(self, rows, every_row)
        finally:
            steps.append({"rows": rows, "every_row": bool(every_row),
                          "graph": bool(self.use_graph), "kernels": LAUNCHED})
            LAUNCHED = None

    def launch_and_write(self, rows, *args, **kw):
        out = launch_step(self, rows, *args, **kw)
        if kw.get("every_row"):
            self.logits_rows[:rows.n] = 0
            for r, pos in enumerate(rows.positions):
                self.logits_rows[r, best_token(pos, self.g.n_vocab)] = 1
        return out

    def recorded_step_rows(self, replays, ids=None, hidden=None):
        calls.append({**rows_of(replays), "ids": [int(i) for i in ids]})
        return step_rows(self, replays, ids=ids, hidden=hidden)

    def recorded_replay_times(self, rows, ids=None, hidden=None, repeat=1):
        timed.append({**rows_of([rows]), "ids": [int(i) for i in ids]})
        return replay_times(self, rows, ids=ids, hidden=hidden, repeat=repeat)

    DecodeGraph._enqueue, DecodeGraph._launch_step = recorded_enqueue, launch_and_write
    DecodeGraph.step_rows, DecodeGraph.replay_kernel_times = (recorded_step_rows,
                                                              recorded_replay_times)
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        model = tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16, n_layers=2)
        vocab = model.config.vocab_size
        path = write_gguf(model, Path(d) / "m.gguf", "f16")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = profile_decode.main(["--model", str(path), "--device", "cuda:0",
                                      "--context", str(CONTEXT), "--steps", str(STEPS),
                                      "--rows", str(n), "--popularity", "uniform",
                                      "--out", str(Path(d) / "records")])
        record_path = next((Path(d) / "records").glob("profile-*.json"))
        out["record"] = json.loads(record_path.read_text())
        out["record_name"] = record_path.name
        out.update(
            rc=rc, printed=printed.getvalue(), steps=steps, calls=calls, timed=timed,
            vocab=vocab, n_steps=STEPS,
            prompt_lengths=[len(p) for p in profile_decode.row_prompts(n, vocab)],
            first_ids=profile_decode.first_row_ids(n, vocab),
            next_ids=[[best_token(p, vocab) for p in c["positions"]] for c in calls],
            # the stand-ins' time between any two events (a timed launch's, in ms)
            event_ms=cupy.cuda.get_elapsed_time(None, None),
            families={name: profile_decode.kernel_family(name)
                      for s in steps for name in s["kernels"]})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
