"""A yarn-scaled file on the GPU (run on the GPU machine: pytest -m gpu): the fused q/k norm +
RoPE kernels of a prompt chunk and of the decode graph rotate by the session's tables, which carry
the file's scaling (models/common.py rope_tables); their logits against the numpy forward that
tests/test_rope_scaling.py holds to transformers' Qwen3MoeForCausalLM with the same scaling."""
import numpy as np
import pytest
from gguf import GGUFValueType

from hf_fixtures import rope_scaled_twin, tiny_qwen3moe, write_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def test_yarn_prompt_and_decode_on_gpu_match_numpy(tmp_path, f16_kv_reference,
                                                   float32_prompt_kernels):
    from strata_dist.single_process import SingleProcessRunner
    # 128-wide heads: the fused kernels' shape; an original context of 256 puts yarn's ramp
    # inside the head and the 300-token prompt past it
    base = tiny_qwen3moe(21, hidden=256, top_k=2, head_dim=128, n_layers=2)
    hf = rope_scaled_twin(base, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256})
    path = write_gguf(hf, tmp_path / "yarn.gguf", "f32", metadata={
        "rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "rope.scaling.original_context_length": (256, GGUFValueType.UINT32)})
    ids = [int(x) for x in np.random.default_rng(21).integers(0, 320, 308)]
    got = {}
    for device in ("cpu", "cuda:0"):
        eng = SingleProcessRunner(path, device, prefill_chunk=128, max_context=512)
        eng.session.reset()
        got[device] = np.concatenate([eng.feed(ids[:300])] + [eng.feed([t]) for t in ids[300:]])
    assert np.abs(got["cuda:0"] - got["cpu"]).max() <= 1e-2
