"""Prompt loans on GPU ranks: the chunk's buffers and its streamed experts come from the lent
tail of the stage's own cache (not CuPy's pool), and the tokens equal a run that never lent."""
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CHUNK = 32
N_LAYERS, N_EXPERTS, TOP_K = 8, 64, 4
PROMPT = [int(x) for x in np.random.default_rng(9).integers(0, 320, 150)]   # 5 chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(17, hidden=256, top_k=TOP_K, n_experts=N_EXPERTS,
                                    n_layers=N_LAYERS),
                      tmp_path_factory.mktemp("gpuloans") / "m.gguf", "q8_0")


@pytest.fixture(scope="module")
def model128(tmp_path_factory):
    """The same geometry with 128-wide heads: the prompt path's own attention kernels take it
    (16-wide heads take the array attention, whose tiles allocate as they go)."""
    return write_gguf(tiny_qwen3moe(17, hidden=256, top_k=TOP_K, n_experts=N_EXPERTS,
                                    n_layers=N_LAYERS, head_dim=128),
                      tmp_path_factory.mktemp("gpuloans128") / "m.gguf", "q8_0")


@pytest.fixture(scope="module")
def baseline(model):
    from strata_dist.tools.single_process import SingleProcessRunner
    return SingleProcessRunner(model, "cuda:0", prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 32).tokens


def test_gpu_loans_keep_the_tokens_and_hold_the_prompt_buffers(model, baseline):
    # caches of 240 of a stage's 256 pairs: the floor of 128 leaves room to lend a chunk's
    # buffers, whose stream buffer alone holds a layer's 64 blobs
    s = ServeSession(model, "--gpus", "0,0", "--layer-split", "4", "--prefill", str(CHUNK),
                     "--max-context", "512", "--gpu-order", "as_given", "--no-remote-auto",
                     env={"STRATA_STAGE_CACHE_SLOTS": "240"}, timeout=120)
    try:
        out = s.gen(PROMPT, 32, timeout=120)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        for r in s.stats().values():
            assert int(r["loans"]) == 1 and int(r["refilled_slots"]) > 0, r
            assert int(r["streamed"]) > 0, r
            assert int(r["loan_peak_bytes"]) > 0, r
            assert int(r.get("loan_live_at_refill", 0)) == 0, r
        # decode reads the refilled slots. The session resumes at a chunk boundary, so its
        # chunks are those of a fresh read (a resume inside a chunk reads rows in other chunk
        # sizes: its dense GEMMs may round otherwise). One short chunk: a loan of its rows
        ids = PROMPT[:2 * CHUNK] + [11, 12, 13, 14, 15]
        again = s.gen(ids, 32, timeout=120)
        assert again["resume"] == 2 * CHUNK and again["err"] is None, again
        from strata_dist.tools.single_process import SingleProcessRunner
        assert again["tokens"] == SingleProcessRunner(model, "cuda:0", prompt_chunk=CHUNK,
                                         max_context=512).generate(ids, 32).tokens
    finally:
        assert s.close() == 0


def _loan(model, chunk: int) -> int:
    """The slots the plan lends a chunk of this file (its prompt layout over the smallest blob)."""
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.models.shape import model_shape
    from strata_dist.plan.lend import loan_slots
    shape = model_shape(GGUFModel(str(model)), "cuda")
    return loan_slots(chunk, shape.prompt_bytes, min(shape.blob_bytes))


def test_a_lent_prompt_chunk_takes_almost_nothing_from_cupys_pool(model128):
    """The same chunk read without a loan or workspace (every buffer from CuPy's pool) and with
    the loan the plan prices (the layout carved from it), counting what the stage asks of CuPy's
    allocator: without, every activation; with, only the rows handed on."""
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.rank.stage import Stage, StageConfig
    ids = PROMPT[:CHUNK]
    pool = cp.get_default_memory_pool()
    asked = {}
    for loan in (0, _loan(model128, CHUNK)):
        st = Stage(StageConfig(model_path=str(model128), device="cuda:0", lb=0, le=3, first=True,
                               last=False, max_context=512, cache_pairs=[(l, e) for l in range(3)
                                                                        for e in range(60)],
                               loan_slots=loan, prompt_chunk=CHUNK if loan else 0))
        st.session(0)
        requests = []

        def counting(nbytes):
            requests.append(nbytes)
            return pool.malloc(nbytes)

        with cp.cuda.using_allocator(counting):
            st.begin_prompt()
            h = st.run(0, 0, ids=ids, prompt=True)
        cp.cuda.Device(0).synchronize()
        asked[loan] = sum(requests)
        st.end_prompt()
        if loan:
            c = st.tiers.counters
            assert c["loan_peak_bytes"] > 0 and c["streamed"] > 0, c
            assert c["loan_overflow_bytes"] == 0 and c["loan_live_at_refill"] == 0, c
        del st, h
    rows = CHUNK * int(GGUFModel(str(model128)).arch_metadata("embedding_length")) * 4
    assert asked[0] > 4 * rows, asked
    assert asked[max(asked)] <= rows + 4096, asked


@pytest.mark.parametrize("device_routing", ["0", "1"])
def test_grouped_expert_kernels_match_numpy_and_ignore_the_tiers(model, monkeypatch,
                                                                f16_kv_reference, device_routing):
    """STRATA_GROUPED_EXPERTS=1 (every expert computation through ops/moe.py): a
    prompt's logits stay within numpy's tolerance, and a stage that streams half its experts
    through a loan reads the prompt into the same bits as one that caches them all. With
    STRATA_DEVICE_ROUTING=1 both group on the device, the half stage computing its misses a
    streamed batch at a time (its last, short chunk on the host); with 0 both on the host: the
    same bits still, and every pair counted once by the tier that computed it."""
    from strata_dist.tools.single_process import SingleProcessRunner
    from strata_dist.rank.stage import Stage, StageConfig
    monkeypatch.setenv("STRATA_GROUPED_EXPERTS", "1")
    monkeypatch.setenv("STRATA_DEVICE_ROUTING", device_routing)
    monkeypatch.setenv("STRATA_F16_PROMPT_GEMM", "0")       # this file's Q8_0 dense matrices exact
    eng = SingleProcessRunner(model, "cuda:0", prompt_chunk=CHUNK, max_context=512)
    assert eng.backend._rows is not None
    ref = SingleProcessRunner(model, "cpu", prompt_chunk=CHUNK, max_context=512).feed(PROMPT)[-1]
    got = np.asarray(eng.feed(PROMPT)[-1])
    assert np.abs(got - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max())
    every = [(l, e) for l in range(N_LAYERS) for e in range(N_EXPERTS)]
    stages = {name: Stage(StageConfig(model_path=str(model), device="cuda:0", lb=0, le=N_LAYERS,
                                      first=True, last=True, max_context=512, cache_pairs=pairs,
                                      loan_slots=loan, prompt_chunk=CHUNK))
              for name, pairs, loan in (("all", every, 0),
                                        ("half", [p for p in every if p[1] % 2 == 0],
                                         max(40, _loan(model, CHUNK))))}
    logits = {}
    for name, st in stages.items():
        out = None
        for c in range(0, len(PROMPT), CHUNK):
            if c == 0:
                st.begin_prompt()
            out = st.run(0, c, ids=PROMPT[c:c + CHUNK], prompt=True)
        st.end_prompt()
        logits[name] = np.asarray(out)
    c = stages["half"].tiers.counters
    assert c["streamed"] > 0
    assert (c["prompt_layers_on_device"] > 0) == (device_routing == "1"), c
    assert c["hits"] + c["host"] == N_LAYERS * len(PROMPT) * TOP_K and c["host"] > 0, c
    assert eng.backend._device_routing == (device_routing == "1")
    assert np.array_equal(logits["all"], logits["half"])


def test_a_32k_prompt_stays_inside_the_budget_the_plan_priced(tmp_path):
    """A 32,768-token prompt (chunks of 4,096) on one GPU rank whose budget caches part of the
    experts, with 128-wide heads (the flash kernel's, as the real files have): the device's NVML
    peak never passes what the rank held before its first carve (its CUDA context) plus the budget
    the plan gave the stage (its weights, session at 33K cells, cache, reserves and prompt buffers
    all priced inside it), and nothing overflowed the loan into
    CuPy's pool. The allowance on top is the cuBLAS workspace and graph memory created after the
    carve (64 MiB)."""
    import json
    import re
    import subprocess
    import sys
    import threading
    import pynvml
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    model = write_gguf(tiny_qwen3moe(17, hidden=256, top_k=TOP_K, n_experts=N_EXPERTS,
                                     n_layers=N_LAYERS, head_dim=128), tmp_path / "m.gguf",
                       "q8_0")
    # the smallest of these budgets that plans with part of the experts off the card (f16 KV, the
    # GPU default, caches 57 of 384 at 360M and 258 at 380M; float32 KV plans from 480M, 283)
    stage = None
    for budget in ("360M", "380M", "400M", "440M", "480M", "520M"):
        args = ["--gpus", "0", "--vram-budget", budget, "--max-context", "33280", "--prefill",
                "4096", "--no-remote-auto"]
        planned = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", str(model),
                                  *args, "--plan-only", "--json"], capture_output=True, text=True,
                                 timeout=300, cwd=root)
        if planned.returncode == 0:
            [stage] = json.loads(planned.stdout)["stages"]
            if stage["cache_slots"] < N_LAYERS * N_EXPERTS:
                break
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert stage["cache_slots"] < N_LAYERS * N_EXPERTS, stage    # part of the experts off the card
    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = lambda: pynvml.nvmlDeviceGetMemoryInfo(dev).used      # noqa: E731
    total = pynvml.nvmlDeviceGetMemoryInfo(dev).total
    peak, stop = [used()], threading.Event()

    def sample():
        while not stop.wait(0.01):
            peak[0] = max(peak[0], used())

    s = ServeSession(model, *args, timeout=300)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        prompt = [int(x) for x in np.random.default_rng(33).integers(0, 320, 32768)]
        out = s.gen(prompt, 4, "stats=1", timeout=600)
        assert out["err"] is None, out["err"]
        stats = out["stats"]
        assert stats and all("loan_overflow_bytes" in r for r in stats), stats
        assert sum(int(r["loan_overflow_bytes"]) for r in stats) == 0, stats
    finally:
        stop.set()
        sampler.join(timeout=5)
        s.close()
    m = re.search(r"rank 0 device memory free: ([\d.]+) MiB before loading", s.err())
    assert m, s.err()[-2000:]
    before_carve = total - float(m.group(1)) * 2**20        # the device's use with the context
    # what the plan puts on the stage's card, by its own sum (plan.Plan.left_bytes): weights,
    # session, reserves, its own prompt buffers and its cache (the loan inside it)
    priced = sum(int(stage[k]) for k in ("weights_bytes", "session_bytes", "reserve_bytes",
                                         "own_prompt_bytes", "cache_bytes"))
    allowed = before_carve + priced + (64 << 20)
    assert peak[0] <= allowed, (f"peak {peak[0] / 2**20:.0f} MiB, allowed {allowed / 2**20:.0f} "
                                f"MiB (priced {priced / 2**20:.0f} MiB)")
