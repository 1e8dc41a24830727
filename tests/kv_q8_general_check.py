"""tests/test_gpu_kv_q8_mirror.py's general case on the host (tests/test_kv_q8_general_host.py runs
this as its own process with tests/fake_cupy first on the path): the CuPy backend's Python on
numpy stand-ins, every kernel switch off but the dense products (STRATA_DECODE_GRAPH,
STRATA_GROUPED_EXPERTS, STRATA_DEVICE_ROUTING, STRATA_FLASH_PREFILL, STRATA_FUSED_PROMPT_OPS,
STRATA_GDN_KERNELS all 0), so what runs is the general path's array code; the one kernel left,
decode.cu's dequant_rows (and its _f16 build), is emulated below with the kernel's arithmetic
for q8_0.

The mirror test's sequence, runner by runner:
- "graph": its prompt is the general path's under the compute options given (as the GPU
  runner's prefill is); its steps stand for the decode graph's: the numpy runner, float32 as
  the graph's matvecs are (that test's numpy case found the graph's writes within its write
  bound of numpy's), taking the prompt runner's recurrent state and K/V cells (a checkpoint and
  a copy of the q8_0 arrays);
- "reference": the general path under the options given, its K/V stores mirroring the graph's
  (tests/kv_mirror.py): it reads the graph's cells and records its own quantization of each
  write, compared after the prompt and after each of 40 steps.
Two sets of options:
- "default": those the mirror test's general case ran under on the H100 (issue 47): a q8_0
  matrix decoded to f16 and multiplied with the rows rounded to f16, the product rounded to f16
  (ops/linear.py gemm_f16), in the prompt and in the steps;
- "mirror": those that test builds its runners under now (its REFERENCE_OPTIONS:
  tests/conftest.py's float32_prompt_kernels, float32 GEMMs).

Prints one JSON line: {options: {"layers": the attention layers, "prompt": differences over the
prompt's cells, "steps": [differences a step]}}, each differences kv_mirror.code_differences'
fields, the worst over the attention layers' K and V."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

import cupy as cp

HERE = Path(__file__).resolve().parent
Q8_0, Q8_BYTES = 8, 34            # GGMLQuantizationType.Q8_0; bytes of a block of 32
STEPS = 40                        # the mirror test's general case's
KERNELS_OFF = {"STRATA_DECODE_GRAPH": "0", "STRATA_GROUPED_EXPERTS": "0",
               "STRATA_DEVICE_ROUTING": "0", "STRATA_FLASH_PREFILL": "0",
               "STRATA_FUSED_PROMPT_OPS": "0", "STRATA_GDN_KERNELS": "0"}


class DequantRows:
    """decode.cu's dequant_rows / dequant_rows_f16 for q8_0: each value d * q in float32 (d the
    block's f16 scale), the _f16 build's rounded to f16; the rows given, or all."""

    def __init__(self, name: str):
        self.name = name
        self.kernel = type("Function", (), {"ptr": 0})()     # what kernels/pdl.py reads

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if self.name not in ("dequant_rows", "dequant_rows_f16"):
            raise RuntimeError(f"kernel {self.name} launched with every kernel switch off: this "
                               f"check emulates only dequant_rows")
        raw, ggml_type, row_bytes, n_cols, rows, n_rows, out = args
        if int(ggml_type) != Q8_0:
            raise RuntimeError(f"dequant_rows of GGML type {int(ggml_type)}: this check emulates "
                               f"q8_0 ({Q8_0}) only")
        n_cols, n_rows, row_bytes = int(n_cols), int(n_rows), int(row_bytes)
        table = np.asarray(raw).view(np.uint8).reshape(-1, row_bytes)
        picked = table if isinstance(rows, np.uint64) else table[np.asarray(rows)]
        blocks = picked[:n_rows].reshape(n_rows, n_cols // 32, Q8_BYTES)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)     # [n, blocks, 1]
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        out[...] = (d * q).reshape(n_rows, n_cols).astype(out.dtype)


def worst(stores, cells: slice) -> dict:
    """kv_mirror.code_differences' fields, each the worst over the attention layers' K and V."""
    from kv_mirror import code_differences
    ds = [code_differences(s, cp.asnumpy, cells) for s in stores.values()]
    return {"scale_ulps": max(d["scale_ulps"] for d in ds),
            "code_max": max(d["code_max"] for d in ds),
            "code_share": max(d["code_share"] for d in ds)}


def measure(path: str, options: dict) -> dict:
    from kv_mirror import mirror_kv
    from strata_dist.tools.single_process import SingleProcessRunner
    from test_gpu_kv_q8_mirror import CHUNK, PROMPT

    from strata_dist.compute_options import installed, read_environment

    def general_path():
        """A general path runner whose backend is built under KERNELS_OFF + `options` (it reads
        the record in force when built)."""
        with installed(read_environment({**KERNELS_OFF, **options})):
            runner = SingleProcessRunner(path, "cuda:0", prompt_chunk=CHUNK, max_context=256,
                                         kv_type="q8_0")
        assert runner.backend.xp is cp
        runner.decode_graph = None
        return runner

    prompt, ref = general_path(), general_path()
    graph = SingleProcessRunner(path, "cpu", prompt_chunk=CHUNK, max_context=256, kv_type="q8_0")
    layers = ref.session.attention_layers
    prompt.prefill(PROMPT)
    graph.session.restore(prompt.session.save(len(PROMPT)))
    for mine, theirs in zip(graph.session.kv_rows(), prompt.session.kv_rows(), strict=True):
        mine.q[...], mine.scale[...] = cp.asnumpy(theirs.q), cp.asnumpy(theirs.scale)
    stores = mirror_kv(ref.session, graph.session, layers, cp.asarray)
    ref.prefill(PROMPT)
    out = {"layers": layers, "prompt": worst(stores, slice(0, len(PROMPT))), "steps": []}
    tok = 8
    for _ in range(STEPS):       # token 8, then the reference's greedy tokens
        pos = ref.session.n_past
        graph.decode_step([tok])
        tok = int(np.asarray(ref.decode_step([tok])).argmax())
        out["steps"].append(worst(stores, slice(pos, pos + 1)))
    return out


def main() -> int:
    sys.path.insert(0, str(HERE))
    from launch_abi_check import install_kernels
    install_kernels(lambda source, kernel, device=0, defines=(): DequantRows(kernel))
    from hf_next_fixtures import tiny_qwen3next, write_gguf
    from test_gpu_kv_q8_mirror import NEXT_GEOMETRY, REFERENCE_OPTIONS
    report = {}
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(tiny_qwen3next(49, **NEXT_GEOMETRY), Path(d) / "n.gguf", "q8_0")
        for name, options in (("default", {}), ("mirror", REFERENCE_OPTIONS)):
            report[name] = measure(path, options)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
