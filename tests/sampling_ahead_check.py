"""A GPU runner's greedy generation whose sampler reads the row (a repetition penalty, a bias)
without a GPU: strata_dist.tools.single_process on the numpy stand-ins for CuPy (tests/fake_cupy), its
decode graph's kernels launched as no-ops. What runs is the Python around them: which steps are
launched ahead, and whether the sampler then reads a row a step ahead has already overwritten
(StepLogits raises). Nothing numeric is checked (the kernels do not run).

Run as its own process with tests/fake_cupy first on the path (tests/test_sample_ops.py does).
Prints one JSON line."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_abi_check import install_kernels  # noqa: E402


class _NoKernel:
    kernel = type("Function", (), {"ptr": 0})()     # what kernels/pdl.py reads
    max_dynamic_shared_size_bytes = 48 << 10

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        pass


def main() -> int:
    install_kernels(lambda source, kernel, device=0, defines=(): _NoKernel())
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.sampling.sampler import SamplingParams
    from strata_dist.tools.single_process import SingleProcessRunner

    out = {}
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=2), Path(d) / "m.gguf", "f16")
        r = SingleProcessRunner(str(path), "cuda:0", prompt_chunk=32, max_context=128)
        out["graph"] = type(r.decode_graph).__name__ if r.decode_graph is not None else None
        for name, params in (("plain", SamplingParams()),
                             ("repetition", SamplingParams(repetition_penalty=1.3)),
                             ("bias", SamplingParams(logit_bias=((3, 1.0),)))):
            before = r.decode_graph.ahead_taken
            try:
                got = r.generate([1, 2, 3, 4], 6, params)
                out[name] = {"tokens": len(got.tokens),
                             "ahead_taken": r.decode_graph.ahead_taken - before}
            except Exception as e:       # noqa: BLE001 (the report names it)
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
