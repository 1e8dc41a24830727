"""GPU checks (run on the GPU machine: pytest -m gpu). CuPy against numpy on the tiny reference
models, and a synthetic Qwen3-30B-A3B-geometry Q8_0 file loading and generating."""
import os

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed,hidden,top_k,n_experts,dtype", [
    (0, 64, 2, 8, "f32"), (1, 64, 8, 16, "f16"), (2, 256, 2, 8, "q8_0"), (3, 256, 8, 16, "q8_0")])
def test_cupy_logits_match_numpy(tmp_path, seed, hidden, top_k, n_experts, dtype, f16_kv_reference,
                                 float32_prompt_kernels):
    """The prompt in float32 throughout (float32_prompt_kernels): Q8_0 dense matrices decoded
    exactly (their f16 GEMM, the GPU default, is test_gpu_prompt_ops.py's
    test_quantized_dense_matrices_on_tensor_cores) and the row kernels' FMA build (the
    tensor-core build rounds rows to f16, which flipped a near-tie of the top-8 model's routing,
    measured 2026-12-02: 0.075 on one row, 1.8e-4 with FMA; test_gpu_kernels.py tests both
    builds against numpy)."""
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_gguf(tiny_qwen3moe(seed, hidden=hidden, top_k=top_k, n_experts=n_experts),
                      tmp_path / "m.gguf", dtype)
    ids = [int(x) for x in np.random.default_rng(seed).integers(0, 320, 48)]
    ref = SingleProcessRunner(path, "cpu").logits(ids)
    got = SingleProcessRunner(path, "cuda:0").logits(ids)
    assert np.abs(got - ref).max() <= 1e-2


def test_a_quantized_head_is_decoded_a_slice_at_a_time(tmp_path, monkeypatch):
    """A quantized matrix larger than the f16 scratch (a Q4_K_M file's head: 600 MB as f16) is
    multiplied a slice of rows at a time: the logits stay those of the whole matrix within f16
    rounding, with the same greedy token, and the device never holds its whole f16 copy."""
    import strata_dist.ops.linear as linear
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_gguf(tiny_qwen3moe(4, hidden=256, top_k=2, n_experts=8), tmp_path / "m.gguf",
                      "q8_0")
    ids = [int(x) for x in np.random.default_rng(4).integers(0, 320, 24)]
    whole = SingleProcessRunner(path, "cuda:0").logits(ids)[-1]
    monkeypatch.setattr(linear, "F16_SCRATCH_BYTES", 64 * 256 * 2)   # 64 of the head's 320 rows
    runner = SingleProcessRunner(path, "cuda:0")
    calls = []
    real = linear.gemm_f16_slices
    monkeypatch.setattr(linear, "gemm_f16_slices",
                        lambda be, x, w, out: calls.append(w.shape) or real(be, x, w, out))
    sliced = runner.logits(ids)[-1]
    assert (320, 256) in calls
    assert np.abs(sliced - whole).max() <= 1e-3 * max(1.0, np.abs(whole).max())
    assert int(np.argmax(sliced)) == int(np.argmax(whole))


@pytest.mark.skipif(not os.environ.get("STRATA_BIG_MODEL_DIR"),
                    reason="set STRATA_BIG_MODEL_DIR to a folder with ~35 GB free")
def test_synth_qwen3_30b_q8_0_generates_on_gpu():
    from strata_dist.tools.single_process import SingleProcessRunner
    from strata_dist.synth import write_synthetic
    path = os.path.join(os.environ["STRATA_BIG_MODEL_DIR"], "qwen3-30b-a3b-q8_0.gguf")
    if not os.path.exists(path):
        write_synthetic(path, like="qwen3-30b-a3b", quant="q8_0", popularity="zipf:1.0", seed=0)
    eng = SingleProcessRunner(path, "cuda:0", max_context=1024)
    res = eng.generate(list(range(1, 33)), 16)
    assert len(res.tokens) == 16 and all(0 <= t < eng.model.g.n_vocab for t in res.tokens)
    print(f"30B q8_0: prompt {res.prompt_ms:.0f} ms, decode {res.decode_ms:.0f} ms for 16 tokens")


@pytest.mark.parametrize("seed,top_k,n_experts", [(0, 2, 8), (1, 8, 16)])
def test_cupy_qwen3next_matches_numpy(tmp_path, seed, top_k, n_experts, f16_kv_reference,
                                      float32_prompt_kernels):
    """The hybrid forward (GDN + gated attention + shared expert) on CuPy, prefill in chunks and
    decode steps, against numpy. Q8_0 matrices stay as stored on the GPU and decode exactly, with
    float32 activations and K/V stored in f16 by both (f16_kv_reference), so the two runs compute
    the same numbers up to float32 rounding (3e-5 seen with f32 K/V on both). F16 dense paths round activations to f16 in every projection; on qwen3next that alone
    moves these tiny random models' logits by 1e-2..1e0 (the GDN input projection is the most
    sensitive; reproduced on numpy by rounding the same way), so they are not a test of this code."""
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    from strata_dist.tools.single_process import SingleProcessRunner
    path = write_next(tiny_qwen3next(seed, hidden=128, top_k=top_k, n_experts=n_experts),
                      tmp_path / "next.gguf", "q8_0")
    ids = [int(x) for x in np.random.default_rng(seed).integers(0, 320, 40)]
    cpu = SingleProcessRunner(path, "cpu", prompt_chunk=16)
    ref = np.concatenate([cpu.feed(ids[:32])] + [cpu.feed([t]) for t in ids[32:]])
    gpu = SingleProcessRunner(path, "cuda:0", prompt_chunk=16)
    got = np.concatenate([gpu.feed(ids[:32])] + [gpu.feed([t]) for t in ids[32:]])
    assert np.abs(got - ref).max() <= 1e-3


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_cuda_qwen3next_stage_loads_and_carves_what_is_priced(tmp_path, dtype):
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.models.shape import model_shape
    from strata_dist.plan.pricing import session_bytes, weights_bytes
    from strata_dist.rank.stage import Stage, StageConfig
    path = write_next(tiny_qwen3next(5, hidden=128), tmp_path / "next.gguf", dtype)
    shape = model_shape(GGUFModel(path), "cuda")
    for lb, le in [(0, 3), (3, 4), (2, 8)]:     # linear only, attention only, mixed
        stage = Stage(StageConfig(path, "cuda:0", lb, le, lb == 0, le == 8, 128))
        stage.session(0)
        assert stage.weights_bytes == weights_bytes(shape, lb, le, lb == 0, le == 8)
        assert stage.session_bytes() == session_bytes(shape, 128, lb, le)


def test_calibrate_prices_in_place_reads_by_tier(tmp_path):
    """`strata-dist calibrate --device cuda:0`: the hand-off through CUDA IPC (between two ranks
    on this card, and between two cards where there are two), and a kernel
    reading expert blobs in place from pinned host memory (host_gbs) into a file a launch plans
    with; host memory is read slower than the card's own, and peer_gbs is measured only where a
    second card has peer access."""
    import json
    import subprocess
    import sys
    out = tmp_path / "cal.json"
    done = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", "--device",
                           "cuda:0", "--rounds", "200", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    content = json.loads(out.read_text())
    params, measured = content["params"], content["measured"]
    assert measured["handoff_path"] == "ipc"
    assert 1 < params["host_gbs"] < measured["device_read_gbs"], content
    assert params["shared_card_handoff_ms"] > 0           # two ranks taking turns on this card
    assert ("handoff_ms" in params) == (cp.cuda.runtime.getDeviceCount() > 1), content
    two = cp.cuda.runtime.getDeviceCount() > 1 and cp.cuda.runtime.deviceCanAccessPeer(0, 1)
    assert ("peer_gbs" in params) == bool(two), content
    from strata_dist.tools.calibrate import load_calibration
    assert load_calibration(str(out))["host_gbs"] == params["host_gbs"]
