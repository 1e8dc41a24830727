"""benchmarks/bench_rows.py end to end without a GPU: the backend's Python on the numpy stand-ins
for CuPy (tests/fake_cupy) with kernels that run nothing (tests/prompt_bytes_check.py), on a
one-layer file, so the next GPU call does not spend device time on a harness that breaks. The
times it prints there are the stand-ins' events (no measurement); the routing, work items and
the table are the benchmark's own."""
import subprocess
import sys
from pathlib import Path

from hf_fixtures import tiny_qwen3moe, write_gguf
from stand_ins import stand_in_env

HERE = Path(__file__).resolve().parent
RUN = """
import sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {bench!r})
import prompt_bytes_check
prompt_bytes_check.install()
import bench_rows
sys.argv = ["bench_rows.py", "--model", {model!r}, "--tokens", "64,256", "--reps", "2"]
sys.exit(bench_rows.main())
"""


def test_bench_rows_prints_every_launch_of_a_layer(tmp_path):
    model = write_gguf(tiny_qwen3moe(3, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                     n_layers=1), tmp_path / "m.gguf", "q8_0")
    env = stand_in_env()
    code = RUN.format(tests=str(HERE), bench=str(HERE.parent / "benchmarks"), model=str(model))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "16 experts top-4" in out and "tensor cores" in out, out
    for n in (64, 256):
        assert f"{n} rows: {n * 4} pairs" in out, out
    for launch in ("group (count, items, scatter)", "rows_to_half (x)", "gate/up + SwiGLU",
                   "rows_to_half (act)", "down", "the layer"):
        assert out.count(launch) == 2, (launch, out)
    assert out.count("TFLOP/s") == 4, out
