"""What a prompt chunk's buffers really take on the GPU path, against what the plan prices for them.

Run as its own process with tests/fake_cupy first on the path (tests/test_prompt_bytes.py does):
the GPU backend's Python runs on numpy stand-ins whose arrays count their bytes while they live
(fake_cupy track_start / track_stop), kernels replaced by stand-ins that run nothing. For each
architecture, one GPU-path runner reads a first chunk (sessions, graphs and tables allocated),
then one more chunk of each size under tracking: the peak bytes live at once.
Two chunk sizes give the buffers' bytes per token (the slope) and their fixed part; the plan's
`prompt_bytes_per_token` (model_shape.py) is what a loan or a stage's own prompt buffers are sized
by. Kernels are not run (so routing picks the first experts), which changes no buffer's size.

Prints one JSON line: {arch: {"priced_per_token", "per_token", "fixed", "peaks": {chunk: bytes}}}."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import cupy as cp


# two geometries an architecture, the smallest the GPU kernels take and one with other ratios of
# heads, experts and widths: the price is a function of the geometry, not a fit to one file
MOE_GEOMETRIES = {
    "qwen3moe": dict(hidden=256, head_dim=128, top_k=4, n_experts=16),
    "qwen3moe, 8 of 32 experts": dict(hidden=512, head_dim=128, top_k=8, n_experts=32),
}
NEXT_GEOMETRIES = {
    "qwen3next": dict(hidden=128, head_dim=256, n_head=4, n_kv=2, n_k_heads=2, n_v_heads=4,
                      head_k_dim=32, head_v_dim=32, top_k=4, n_experts=16),
    "qwen3next, 8 heads": dict(hidden=256, head_dim=256, n_head=8, n_kv=2, n_k_heads=2,
                               n_v_heads=8, head_k_dim=64, head_v_dim=64, top_k=8,
                               n_experts=32),
}


def measure(path: Path, chunks: tuple[int, ...]) -> dict:
    from strata_dist.gguf_model import GGUFModel
    from strata_dist.model_shape import model_shape
    from strata_dist.single_process import SingleProcessRunner
    top = max(chunks)
    runner = SingleProcessRunner(path, "cuda:0", prefill_chunk=top, max_context=4 * top + 64)
    runner.prefill(list(range(1, top + 1)))             # the first chunk: everything set up
    peaks = {}
    for n in chunks:
        runner.prefill_chunk = n
        cp.track_start()
        runner.prefill([(7 * i) % 300 + 1 for i in range(n)])
        peak, _ = cp.track_stop()
        peaks[n] = peak
    lo, hi = min(chunks), max(chunks)
    per_token = (peaks[hi] - peaks[lo]) / (hi - lo)
    shape = model_shape(GGUFModel(str(path)), "cuda")
    return {"priced_per_token": shape.prompt_bytes_per_token, "per_token": per_token,
            "fixed": peaks[lo] - per_token * lo, "peaks": peaks}


class Kernel:
    """A kernel that runs nothing (the buffers' sizes do not depend on the values)."""

    def __init__(self):
        self.kernel = type("Function", (), {"ptr": 0})()     # what kernels/pdl.py reads
        self.max_dynamic_shared_size_bytes = 48 << 10

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        pass


def install() -> None:
    from launch_abi_check import install_kernels
    install_kernels(lambda source, kernel, device=0, defines=(): Kernel())


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    install()
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, geo in MOE_GEOMETRIES.items():
            path = write_gguf(tiny_qwen3moe(7, n_layers=2, **geo), Path(d) / f"{name}.gguf",
                              "q8_0")
            out[name] = measure(path, (64, 256))
        for name, geo in NEXT_GEOMETRIES.items():
            path = write_next(tiny_qwen3next(21, **geo), Path(d) / f"{name}.gguf", "q8_0")
            out[name] = measure(path, (64, 256))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
