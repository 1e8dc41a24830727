"""A prompt chunk's buffers on the GPU path against the fixed layout the plan prices them by.

Run as its own process with tests/fake_cupy first on the path (tests/test_prompt_bytes.py does):
the GPU backend's Python runs on numpy stand-ins whose arrays count their bytes while they live
(fake_cupy track_start / track_stop; a view of the workspace is not new memory), kernels replaced
by stand-ins that run nothing (but the router's, which spreads the rows over the experts). For each architecture at two geometries:
- the single-process runner (every expert resident: routed and grouped on the device) reads a
  first chunk, then one chunk of each size under tracking;
- a stage caching all but one expert of each layer, lending the loan the plan prices for its chunk, reads
  prompt chunks: a short one grouped on the host, longer ones grouped on the device, the misses
  streamed through the workspace by both;
- a stage caching every expert, lending nothing, reads two chunks through its own buffers: the
  layout less its stream buffer.
Reported: the layout's bytes carved and the plan's price for the chunk (ModelShape.prompt_bytes),
the bytes allocated outside the workspace at each chunk size, the workspace's buffers written,
its overflow, and the layout's names.

Prints one JSON line: {arch: {"runner": {...}, "stage": {...}, "layout": [names]}}."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import cupy as cp


# two geometries an architecture, the smallest the GPU kernels take and one with other ratios of
# heads, experts and widths: the layout is a function of the geometry, not a fit to one file
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
CHUNKS = (64, 256)


def _ids(n: int) -> list[int]:
    return [(7 * i) % 300 + 1 for i in range(n)]


def measure_runner(path: Path, shape) -> dict:
    from strata_dist.tools.single_process import SingleProcessRunner
    top = max(CHUNKS)
    runner = SingleProcessRunner(path, "cuda:0", prompt_chunk=top, max_context=4 * top + 64)
    runner.prefill(list(range(1, top + 1)))             # the first chunk: everything set up
    ws = runner.workspace
    outside, taken = {}, set()
    for n in CHUNKS:
        runner.prompt_chunk = n
        ws.taken.clear()
        cp.track_start()
        runner.prefill(_ids(n))
        outside[n], _ = cp.track_stop()
        taken |= ws.taken
    return {"carved": ws.nbytes, "priced": shape.prompt_bytes(top), "outside": outside,
            "taken": sorted(taken), "overflow": ws.overflow_bytes}


def _read_prompts(st, sizes) -> tuple:
    """One prompt of each size in `sizes` read by stage `st` (session 0, one after the other),
    each under tracking: (the last prompt's workspace, bytes allocated outside the workspace per
    size, the workspace buffers written, the next position)."""
    outside, taken, pos, ws = {}, set(), 0, None
    for m in sizes:
        st.begin_prompt()
        ws = st._workspace
        cp.track_start()
        st.run(0, pos, ids=_ids(m), prompt=True)
        outside[m], _ = cp.track_stop()
        taken |= ws.taken
        st.end_prompt()
        pos += m
    return ws, outside, taken, pos


def measure_stage(path: Path, shape) -> dict:
    from strata_dist.plan.lend import loan_slots
    from strata_dist.rank.stage import Stage, StageConfig
    n = CHUNKS[0]
    slots = loan_slots(n, shape.prompt_bytes, min(shape.blob_bytes))
    # every expert but the first of each layer cached (the tiny files' attention outweighs their
    # experts, so a loan takes most of the cache): the loan's pairs and the first experts stream
    half = [(l, e) for l in range(shape.n_layers) for e in range(1, shape.n_experts)]
    if slots >= len(half):
        raise SystemExit(f"a {n}-token loan takes {slots} slots, the stage caches {len(half)}")
    st = Stage(StageConfig(str(path), "cuda:0", 0, shape.n_layers, True, True, 4 * n,
                           cache_pairs=half, loan_slots=slots, prompt_chunk=n))
    st.session(0)
    # a 2-token chunk is grouped on the host (too short to stream every miss of a layer); the
    # longer ones on the device, their misses streamed through the workspace
    ws, outside, taken, pos = _read_prompts(st, (2, n // 2, n))
    out = {"carved": ws.nbytes, "priced": shape.prompt_bytes(n),
           "lent": slots * min(shape.blob_bytes), "outside": outside, "taken": sorted(taken),
           "overflow": int(st.tiers.counters["loan_overflow_bytes"]),
           "streamed": int(st.tiers.counters["streamed"])}
    # a prompt of one short chunk borrows only the slots its rows' layout takes
    m = n // 4
    st.begin_prompt(rows=m)
    short = {"rows": m, "lent_slots": len(st.cache.lent), "plan_slots": slots,
             "want_slots": loan_slots(m, shape.prompt_bytes, min(shape.blob_bytes)),
             "carved": st._workspace.nbytes, "priced": shape.prompt_bytes(m)}
    st.run(0, pos, ids=_ids(m), prompt=True)
    st.end_prompt()
    short["overflow"] = int(st.tiers.counters["loan_overflow_bytes"])
    short["resident_after"] = int((st.cache.slot_of >= 0).sum())
    short["cached"] = len(half)
    out["short"] = short
    return out


def measure_resident_stage(path: Path, shape) -> dict:
    """A stage whose cache holds every pair and lends nothing: its own buffers, the layout less
    the stream buffer (ModelShape.resident_prompt_bytes), allocated once."""
    from strata_dist.rank.stage import Stage, StageConfig
    n = CHUNKS[0]
    every = [(l, e) for l in range(shape.n_layers) for e in range(shape.n_experts)]
    st = Stage(StageConfig(str(path), "cuda:0", 0, shape.n_layers, True, True, 4 * n,
                           cache_pairs=every, prompt_chunk=n))
    st.session(0)
    ws, outside, taken, _ = _read_prompts(st, (n // 2, n))
    return {"carved": ws.nbytes, "priced": shape.resident_prompt_bytes(n),
            "own": st.own_prompt_bytes, "outside": outside, "taken": sorted(taken),
            "overflow": int(st.tiers.counters["loan_overflow_bytes"]),
            "streamed": int(st.tiers.counters["streamed"]),
            "layout": [b.name for b in st.prompt_layout.buffers]}


def measure(path: Path) -> dict:
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.models.shape import model_shape
    from strata_dist.plan.workspace import PromptLayout
    shape = model_shape(GGUFModel(str(path)), "cuda")
    return {"runner": measure_runner(path, shape), "stage": measure_stage(path, shape),
            "resident_stage": measure_resident_stage(path, shape),
            "layout": [row[0] for row in PromptLayout.from_list(shape.prompt_layout).to_list()],
            "priced_per_token": shape.prompt_bytes_per_token}


class Kernel:
    """A kernel that runs nothing (the buffers' sizes do not depend on the values), but for the
    router's top-k, which picks experts (row + rank) % n_expert at equal weights: the buffers it
    writes are reused memory, whose old bytes would be no expert at all."""

    def __init__(self, name: str):
        self.name = name
        self.kernel = type("Function", (), {"ptr": 0})()     # what kernels/pdl.py reads
        self.max_dynamic_shared_size_bytes = 48 << 10

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if self.name == "route_rows":
            _, n, n_expert, k, _, ids, wts = args
            n, n_expert, k = int(n), int(n_expert), int(k)
            ids[...] = (cp.arange(n)[:, None] + cp.arange(k)[None, :]) % n_expert
            wts[...] = 1.0 / k


def install() -> None:
    from launch_abi_check import install_kernels
    install_kernels(lambda source, kernel, device=0, defines=(): Kernel(kernel))


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    install()
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, geo in MOE_GEOMETRIES.items():
            path = write_gguf(tiny_qwen3moe(7, n_layers=4, **geo), Path(d) / f"{name}.gguf",
                              "q8_0")
            out[name] = measure(path)
        for name, geo in NEXT_GEOMETRIES.items():
            # 16 layers: the loan (its streamed misses live through the chunk) leaves cache
            path = write_next(tiny_qwen3next(21, n_layers=16, **geo), Path(d) / f"{name}.gguf",
                              "q8_0")
            out[name] = measure(path)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
