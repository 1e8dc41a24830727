"""Every kernel launch of the GPU path, checked against its kernel's C signature without a GPU.

Run as its own process with tests/fake_cupy first on the path (tests/test_launch_abi.py does):
the GPU backend's Python runs on numpy stand-ins, and `strata_dist.kernels.function` hands out
kernels that run nothing but check each launch: the number of arguments, each scalar's numpy
type against the parameter's C type (a Python int where the kernel takes an `int` would reach it
as 64 bits), a device array or address for every pointer, and the launch limits (1,024 threads a
block, 65,535 blocks in y and z, 48 KiB of dynamic shared memory unless the kernel was allowed more
through `max_dynamic_shared_size_bytes`, at most sm_90's 227 KiB). The signatures come from the
sources as nvcc preprocesses them (the macro-built kernels expanded).

Prints one JSON line: {"scenarios": {name: {kernel: launches}}, "graphs": {...}, "grids": {name:
{expert kernel: grid widths}}, "step_launches": {name: a one-row decode step's launches with the
graph ops that made them}, "step_layers": {name: whether each of the graph's layers is linear},
"errors": [...]}."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import cupy as cp
import strata_dist.kernels as kernels

_KERNEL = re.compile(r'extern "C" __attribute__\(\(global\)\)\s+void\s+'
                     r'(?:__attribute__\(\(launch_bounds\((?:[^()]|\([^()]*\))*\)\)\)\s*)?'
                     r'(\w+)\s*\(([^)]*)\)', re.S)     # bounds may call a constexpr function
_SCALARS = {"int": np.int32, "float": np.float32, "long long": np.int64, "i64": np.int64,
            "u64": np.uint64, "unsigned long long": np.uint64, "u32": np.uint32,
            "unsigned int": np.uint32}


def signatures(nvcc: str) -> dict[tuple[str, str], list[str]]:
    """(source, kernel) -> its parameters, from each kernel source preprocessed by nvcc."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for src in kernels.sources():
            pre = Path(d) / f"{src.name}.i"
            subprocess.run([nvcc, "-E", "-arch=sm_90", "--std=c++17", "-x", "cu", str(src), "-o",
                            str(pre)], check=True, capture_output=True, timeout=300)
            for name, params in _KERNEL.findall(pre.read_text()):
                out[(src.name, name)] = [p.strip() for p in params.split(",") if p.strip()]
    return out


MAX_SHARED_OPTIN = 227 << 10    # sm_90's shared memory a block may be allowed
# the decode graph's expert launches: kernel -> the grid widths launched (the blocks over n_ff or
# n_embd, which the integer path's builds size from KernelShape.gate_up_block / down_block)
GRIDS: dict[str, set[int]] = collections.defaultdict(set)
# while not None: the kernel names launched, in order, each op of the graph's layer ops
# (backends/graph_ops.py) marked before its launches as "op:<name>" (a one-row step's capture)
STEP_LAUNCHES: list[str] | None = None


def scalar_type(param: str):
    words = [w for w in param.replace("const", " ").replace("__restrict__", " ").split()]
    return _SCALARS.get(" ".join(words[:-1]))


class CheckedKernel:
    """A kernel that checks its launches (into `errors`) and counts them (into `counts`)."""

    def __init__(self, source: str, name: str, params: list[str], counts, errors):
        self.source, self.name, self.params = source, name, params
        self.counts, self.errors = counts, errors
        self.kernel = type("Function", (), {"ptr": 0})()     # what kernels/pdl.py reads
        self._max_shared = 48 << 10

    # CuPy's RawKernel attribute: the dynamic shared memory a launch may ask for
    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_shared

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value) -> None:
        if not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_SHARED_OPTIN:
            self.errors.append(f"{self.name}: max_dynamic_shared_size_bytes = {value!r}")
        self._max_shared = int(value)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.counts[self.name] += 1
        if STEP_LAUNCHES is not None:
            STEP_LAUNCHES.append(self.name)
        if self.name.startswith(("moe_gate_up_", "moe_down_")) and "_rows" not in self.name:
            GRIDS[self.name].add(int(tuple(grid)[0]))
        at = f"{self.name}{tuple(grid)}x{tuple(block)}"
        if len(args) != len(self.params):
            self.errors.append(f"{at}: {len(args)} arguments for {len(self.params)} parameters "
                               f"({', '.join(self.params)})")
            return
        for param, arg in zip(self.params, args):
            if "*" in param:
                if not isinstance(arg, (cp.ndarray, np.uint64)):
                    self.errors.append(f"{at}: {param!r} got {type(arg).__name__}")
            else:
                want = scalar_type(param)
                if want is None or type(arg) is not want:
                    self.errors.append(f"{at}: {param!r} got {type(arg).__name__}, not "
                                       f"{getattr(want, '__name__', want)}")
        dims = tuple(grid) + tuple(block)
        if any(not isinstance(v, (int, np.integer)) or v < 1 for v in dims):
            self.errors.append(f"{at}: grid and block must be positive integers")
        elif (int(np.prod(block)) > 1024 or any(v > 65535 for v in tuple(grid)[1:])
              or shared_mem > self._max_shared):
            self.errors.append(f"{at}: beyond the launch limits (shared {shared_mem} B)")


def install(nvcc: str, counts, errors) -> None:
    sigs = signatures(nvcc)

    def function(source, kernel, device=0, defines=()):
        if (source, kernel) not in sigs:
            errors.append(f"{kernel} is not a kernel of {source}")
            return CheckedKernel(source, kernel, [], counts, errors)
        return CheckedKernel(source, kernel, sigs[(source, kernel)], counts, errors)

    install_kernels(function)


def install_kernels(function) -> None:
    """`function(source, kernel, device, defines)` hands out every kernel the GPU path launches,
    programmatic launches included (call before the backends import strata_dist.kernels)."""
    kernels.function = function
    import strata_dist.kernels.pdl as pdl

    class Programmatic:                # the programmatic launches, through the same check
        def launch(self, kernel, grid, block, args, stream_ptr, shared_mem=0):
            kernel(grid, block, args, shared_mem=shared_mem)
    pdl.ProgrammaticLauncher = Programmatic


def recorded_step(runner, ids) -> tuple[list[str], list[bool]] | None:
    """The launches of one decode step on a runner whose graph for len(ids) rows is not captured
    yet (its capture runs every launch), each op of the model's ops protocol (the type of
    layer_step's `ops`) marked before the launches the graph's ops class makes for it, and the
    graph's layers (whether each is a linear layer); None, the step run, where the runner has no
    decode graph (the general path)."""
    global STEP_LAUNCHES
    import typing
    graph = runner.decode_graph
    if graph is None:
        runner.decode_step(ids)
        return None
    is_linear = getattr(graph.g, "is_linear", lambda layer: False)
    layers = [bool(is_linear(layer)) for layer in range(graph.lb, graph.le)]
    ops_class = graph.layer_ops
    protocol = typing.get_type_hints(graph.layer_step)["ops"]
    names = [n for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")]
    own = {n: ops_class.__dict__.get(n) for n in names}

    def marked(name, f):
        def op(self, *args):
            STEP_LAUNCHES.append(f"op:{name}")
            return f(self, *args)
        return op
    STEP_LAUNCHES = []
    try:
        for n in names:
            setattr(ops_class, n, marked(n, getattr(ops_class, n)))
        runner.decode_step(ids)
        return STEP_LAUNCHES, layers
    finally:
        STEP_LAUNCHES = None
        for n, f in own.items():
            if f is None:
                delattr(ops_class, n)       # inherited: the base class's again
            else:
                setattr(ops_class, n, f)


def stage_run(scenarios, graphs, counts, path) -> None:
    from strata_dist.rank.stage import Stage, StageConfig
    os.environ["STRATA_HOST_MAPPED"] = "1"
    try:
        st = Stage(StageConfig(model_path=str(path), device="cuda:0", lb=0, le=2, first=True,
                               last=False, max_context=512,
                               # not expert 0, the one the stand-ins' routing picks
                               cache_pairs=[(l, e) for l in range(2) for e in range(8, 16)],
                               loan_slots=4))
        st.session(0)
        st.begin_prompt()
        h = st.run(0, 0, ids=list(range(1, 65)), prompt=True)
        st.end_prompt()
        st.run(0, 64, ids=[5], prompt=False)
        st.run(0, 65, ids=[6, 7, 8], prompt=False)
        assert st.tiers.counters["streamed"] > 0 and h.shape == (64, 256), st.tiers.counters
    finally:
        os.environ.pop("STRATA_HOST_MAPPED")
    name = "qwen3moe stage, half cached, loan, host-mapped misses"
    graphs[name] = type(st.decode_graph).__name__ if st.decode_graph is not None else None
    scenarios[name] = dict(counts)
    counts.clear()


def batch_run(scenarios, graphs, counts, path) -> None:
    """Two stages caching every pair: ten sessions' prompts, then one batched step of the ten at
    different positions through both decode graphs (replays of 8 and 2 rows; the last stage's
    every-row logits); rows the graph cannot take are refused (the general path runs them)."""
    from strata_dist.rank.stage import Stage, StageConfig
    stages = [Stage(StageConfig(model_path=str(path), device="cuda:0", lb=lb, le=le,
                                first=lb == 0, last=le == 4, max_context=512,
                                cache_pairs=[(l, e) for l in range(lb, le) for e in range(16)]))
              for lb, le in ((0, 2), (2, 4))]
    lengths, order = (7, 30, 2, 5, 9, 11, 3, 4, 6, 8), [2, 0, 9, 1, 4, 3, 8, 5, 7, 6]
    for sid, n in enumerate(lengths):
        stages[1].run(sid, 0, hidden=stages[0].run(sid, 0, ids=list(range(1, n + 1)),
                                                   prompt=True), prompt=True)
    pos = [lengths[s] for s in order]
    h = stages[0].run_batch(order, pos, ids=list(range(5, 15)))
    logits = stages[1].run_batch(order, pos, hidden=h)
    assert h.shape == (10, 256) and logits.shape == (10, 320), (h.shape, logits.shape)
    assert [st.tiers.counters["graph_steps"] for st in stages] == [1, 1]
    assert sorted(stages[1].decode_graph.graphs) == [(2, True), (8, True)]
    g, s0 = stages[0].decode_graph, stages[0].session(0)
    ten = [stages[0].session(s) for s in order]
    assert [(r.n, r.sessions) for r in g.batch_replays(ten, pos)] == [(8, tuple(ten[:8])),
                                                                      (2, tuple(ten[8:]))]
    assert [r.n for r in g.batch_replays([s0, s0], [8, 9])] == [2]
    assert g.batch_replays([s0, s0], [8, 10]) is None        # a session's rows not consecutive
    assert g.batch_replays([s0], [512]) is None              # past the session's cells
    name = "qwen3moe stages, a batched step of ten sessions"
    graphs[name] = type(stages[1].decode_graph).__name__
    scenarios[name] = dict(counts)
    counts.clear()


def main() -> int:
    nvcc = sys.argv[1]
    counts, errors = collections.Counter(), []
    install(nvcc, counts, errors)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_fixtures import tiny_qwen3moe, write_gguf
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    from strata_dist.tools.single_process import SingleProcessRunner

    scenarios, graphs, grids, step_launches, step_layers = {}, {}, {}, {}, {}
    prompt = [int(x) for x in np.random.default_rng(11).integers(0, 320, 300)]

    def run(name, path, **kw):
        env = kw.pop("env", {})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            r = SingleProcessRunner(path, "cuda:0", prompt_chunk=128, max_context=512, **kw)
            r.prefill(prompt)
            step = recorded_step(r, [5])
            if step is not None:
                step_launches[name], step_layers[name] = step
            r.decode_step([5, 6, 7])
            r.generate([1, 2, 3, 4, 5], 4)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        graphs[name] = type(r.decode_graph).__name__ if r.decode_graph is not None else None
        scenarios[name] = dict(counts)
        grids[name] = {k: sorted(v) for k, v in GRIDS.items()}
        counts.clear()
        GRIDS.clear()

    with tempfile.TemporaryDirectory() as d:
        for dtype in ("q8_0", "f16"):
            path = write_gguf(tiny_qwen3moe(7, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                            n_layers=3), Path(d) / f"moe-{dtype}.gguf", dtype)
            run(f"qwen3moe {dtype}", path)
            run(f"qwen3moe {dtype}, q8_0 K/V", path, kv_type="q8_0")
            run(f"qwen3moe {dtype}, array prompt steps", path,
                env={"STRATA_FUSED_PROMPT_OPS": "0"})
        # a q5_k_m file's experts (Q5_K gate/up, Q5_K and Q6_K down rows of 256 columns) with
        # the integer path of Q5_K and Q6_K (the default) and without it (KernelShape int_q5_k /
        # int_q6_k 0)
        import dataclasses
        from strata_dist.synth import GEOMETRIES, write_synthetic
        k_mix = Path(d) / "moe-q5_k_m.gguf"
        write_synthetic(k_mix, like=dataclasses.replace(
            GEOMETRIES["tiny"], name="tiny-k", n_embd=256, n_head=2, n_head_kv=1, head_dim=128,
            n_ff_exp=256), quant="q5_k_m", popularity="zipf:1.0")
        run("qwen3moe q5_k_m", k_mix)
        run("qwen3moe q5_k_m, int_q5_k=0,int_q6_k=0", k_mix,
            env={"STRATA_KERNEL_SHAPE": "int_q5_k=0,int_q6_k=0"})
        # i-quant files (every expert IQ4_XS, IQ3_S or IQ2_XXS; 512 columns in, 256 out: the
        # router's reserved slice needs n_embd 512 below 4 bits) with the default build (their
        # integer path's switches on), and IQ4_XS's with the switches 0 too (the float path)
        iq_off = "int_iq4_xs=0,int_iq3_s=0,int_iq2_xxs=0"
        for quant in ("iq4_xs", "iq3_s", "iq2_xxs"):
            iq = Path(d) / f"moe-{quant}.gguf"
            write_synthetic(iq, like=dataclasses.replace(
                GEOMETRIES["tiny"], name="tiny-iq", n_embd=512, n_head=4, n_head_kv=1,
                head_dim=128, n_ff_exp=256), quant=quant, popularity="zipf:1.0")
            run(f"qwen3moe {quant}", iq)
            if quant == "iq4_xs":
                run(f"qwen3moe iq4_xs, {iq_off}", iq, env={"STRATA_KERNEL_SHAPE": iq_off})
        q8 = Path(d) / "moe-q8_0.gguf"
        run("qwen3moe q8_0, routed on the host", q8,
            env={"STRATA_DEVICE_ROUTING": "0"})
        run("qwen3moe q8_0, the general path", q8,
            env={"STRATA_GROUPED_EXPERTS": "0", "STRATA_FLASH_PREFILL": "0",
                 "STRATA_F16_PROMPT_GEMM": "0"})
        # a stage whose cache holds half its pairs: the prompt borrows the cache's tail and
        # streams its misses from pinned host memory, the decode graph reads them in place
        path = write_gguf(tiny_qwen3moe(9, hidden=256, head_dim=128, top_k=4, n_experts=16,
                                        n_layers=4), Path(d) / "stage.gguf", "q8_0")
        stage_run(scenarios, graphs, counts, path)
        batch_run(scenarios, graphs, counts, path)
        path = write_next(tiny_qwen3next(21, hidden=128, head_dim=256, n_head=4, n_kv=2,
                                         n_k_heads=2, n_v_heads=4, head_k_dim=32, head_v_dim=32,
                                         top_k=4, n_experts=16), Path(d) / "next.gguf", "q8_0")
        run("qwen3next q8_0", path)
        run("qwen3next q8_0, q8_0 K/V", path, kv_type="q8_0")
        # --kv-resident below the context with q8_0 K/V: the `_q8_ring` builds of both
        # architectures (tests/kv_resident_abi_check.py checks their pointer tables)
        run("qwen3next q8_0, q8_0 K/V, kv-resident", path, kv_type="q8_0", kv_resident=164)
        run("qwen3moe f16, q8_0 K/V, kv-resident", Path(d) / "moe-f16.gguf", kv_type="q8_0",
            kv_resident=164)
        run("qwen3next q8_0, blocked delta rule", path, env={"STRATA_GDN_KERNELS": "0"})
        run("qwen3next q8_0, GDN token loop", path, env={"STRATA_GDN_KERNELS": "steps"})
    print(json.dumps({"scenarios": scenarios, "graphs": graphs, "grids": grids,
                      "step_launches": step_launches, "step_layers": step_layers,
                      "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
