"""A yarn-scaled file on the GPU (run on the GPU machine: pytest -m gpu): the fused q/k norm +
RoPE kernels of a prompt chunk and of the decode graph rotate by the session's tables, which carry
the file's scaling (models/common.py rope_tables); their logits against the numpy forward that
tests/test_rope_scaling.py holds to transformers' Qwen3MoeForCausalLM with the same scaling.

The prompt (300 tokens in chunks of 128, the last chunk past yarn's original context of 256) and
the decode steps after it (the decode graph, as decode runs) are compared apart, each failure
naming its largest difference and where; the same weights without the scaling run the same way
at the same tolerance, so a tolerance this model cannot meet fails both, and a scaling the GPU
gets wrong fails the yarn file alone. Every token takes all 8 experts (top-8 of 8): with top-2 the
first GPU run flipped a near-tie of the routing on 3 of 300 prompt rows, in the unscaled file as in
the yarn one (max |gpu - numpy| ~1 there), which says nothing about RoPE; weights over all experts
are continuous in the router's logits, so rounding moves logits by rounding alone."""
import numpy as np
import pytest
from gguf import GGUFValueType

from hf_fixtures import rope_scaled_twin, tiny_qwen3moe, write_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2            # absolute, on logits of magnitude ~5 (float32 kernels, f16 K/V both)
PROMPT, DECODED = 300, 8
YARN = {"rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "rope.scaling.original_context_length": (256, GGUFValueType.UINT32)}


def _differences(ref: np.ndarray, got: np.ndarray, what: str) -> tuple[float, str]:
    """The largest |got - ref| over rows of logits [n, vocab], and a line that says where: the
    row, the logits' magnitude there and how many rows' greedy tokens differ."""
    diff = np.abs(got - ref)
    row = int(diff.max(axis=1).argmax())
    flips = int((got.argmax(axis=1) != ref.argmax(axis=1)).sum())
    return float(diff.max()), (f"{what}: max |gpu - numpy| {diff.max():.3g} at row {row} "
                               f"(|logits| up to {np.abs(ref[row]).max():.3g} there); greedy "
                               f"tokens differ on {flips} of {len(ref)} rows")


@pytest.mark.parametrize("scaling", ["yarn", "none"])
def test_prompt_and_decode_on_gpu_match_numpy(tmp_path, scaling, f16_kv_reference,
                                              float32_prompt_kernels):
    from strata_dist.tools.single_process import SingleProcessRunner
    # 128-wide heads: the fused kernels' shape; an original context of 256 puts yarn's ramp
    # inside the head and the 300-token prompt past it; top-8 of 8 experts: no routing near-ties
    base = tiny_qwen3moe(21, hidden=256, top_k=8, n_experts=8, head_dim=128, n_layers=2)
    if scaling == "yarn":
        hf = rope_scaled_twin(base, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 256})
        path = write_gguf(hf, tmp_path / "yarn.gguf", "f32", metadata=YARN)
    else:
        path = write_gguf(base, tmp_path / "plain.gguf", "f32")
    ids = [int(x) for x in np.random.default_rng(21).integers(0, 320, PROMPT + DECODED)]
    cpu = SingleProcessRunner(path, "cpu", prompt_chunk=128, max_context=512)
    gpu = SingleProcessRunner(path, "cuda:0", prompt_chunk=128, max_context=512)
    assert gpu.decode_graph is not None, "the decode graph does not take this model"
    prompt = _differences(cpu.feed(ids[:PROMPT]), np.asarray(gpu.feed(ids[:PROMPT])),
                          f"{scaling}: the {PROMPT}-token prompt")
    ref = np.stack([cpu.feed([t])[-1] for t in ids[PROMPT:]])
    got = np.stack([np.asarray(gpu.decode_step([t])) for t in ids[PROMPT:]])
    decode = _differences(ref, got, f"{scaling}: {DECODED} decode steps (graph)")
    assert gpu.decode_graph.steps == DECODED
    said = f"{prompt[1]}; {decode[1]}; tolerance {TOLERANCE}"
    assert prompt[0] <= TOLERANCE and decode[0] <= TOLERANCE, said
