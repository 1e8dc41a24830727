"""qwen35moe (Qwen3.5 MoE) files against transformers' Qwen3_5MoeForCausalLM (the reference nobody
here wrote), written by the rules of llama.cpp's converter (tests/hf_fixtures.py): prompt and
decode logits, greedy tokens from one process and from 2 CPU ranks, and files this build does not
run refused at start naming the key or tensor."""
import json

import numpy as np
import pytest
import torch

from hf_fixtures import qwen35moe_gguf_tensors, tiny_qwen35moe, write_qwen35moe_gguf
from launch_helpers import ServeSession
from launcher.cli import main as launch_main
from strata_dist.models import architecture_for, open_checked, qwen35moe
from strata_dist.tools.single_process import SingleProcessRunner

TOL = 1e-4
VOCAB = 320


def _ids(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(0, VOCAB, n)]


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=[(2, 4), (3, 6), (2, 2)], ids=lambda h: f"k{h[0]}-v{h[1]}")
def twin(request, tmp_path_factory):
    nk, nv = request.param
    hf = tiny_qwen35moe(nk + 7 * nv, n_k_heads=nk, n_v_heads=nv)
    return hf, write_qwen35moe_gguf(hf, tmp_path_factory.mktemp("q35") / "f32.gguf")


def test_file_opens_as_qwen35moe_on_the_qwen3next_geometry(twin):
    hf, path = twin
    gguf = open_checked(path)
    assert architecture_for(gguf) is qwen35moe
    g = qwen35moe.read_geometry(gguf)
    assert (g.n_k_heads, g.n_v_heads, g.n_rot) == (hf.config.linear_num_key_heads,
                                                  hf.config.linear_num_value_heads, 8)
    assert not g.fused_qkvz


def test_prompt_and_decode_logits_match_transformers(twin):
    hf, path = twin
    ids = _ids(3, 40)
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5                      # far from uniform: a wrong forward shows
    assert np.abs(SingleProcessRunner(path, prompt_chunk=7).logits(ids) - ref).max() <= TOL
    eng = SingleProcessRunner(path, prompt_chunk=16)
    eng.session.reset()
    got = [eng.feed(ids[:24])] + [eng.feed([t]) for t in ids[24:]]
    assert np.abs(np.concatenate(got) - ref).max() <= TOL


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return tiny_qwen35moe(1, n_layers=4), tmp_path_factory.mktemp("bad")


def test_value_heads_regroup_from_the_tiled_order(small):
    # nk = 2, r = 2: grouped heads (k0 v0, k0 v1, k1 v0, k1 v1) are stored at 0, 2, 1, 3
    hf, tmp = small
    g = qwen35moe.read_geometry(open_checked(write_qwen35moe_gguf(hf, tmp / "g.gguf")))
    assert qwen35moe.grouped_value_heads(g).tolist() == [0, 2, 1, 3]


def test_two_cpu_ranks_give_the_tokens_of_one_process_and_of_transformers(tmp_path):
    hf = tiny_qwen35moe(5)
    path = write_qwen35moe_gguf(hf, tmp_path / "m.gguf")
    prompt = _ids(9, 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    assert SingleProcessRunner(path, prompt_chunk=5).generate(prompt, 10).tokens == ref
    # stage 0 holds linear layers only, stage 1 the rest
    s = ServeSession(path, "--cpu-ranks", "2", "--layer-split", "3", "--prefill", "5",
                     "--max-context", "256")
    try:
        got = s.gen(prompt, 10)
    finally:
        assert s.close() == 0
    assert got["err"] is None, got["err"]
    assert got["tokens"] == ref


@pytest.mark.parametrize("case", ["no-sections", "extra-section", "flags", "no-alpha"])
def test_files_this_build_does_not_run_are_refused_naming_the_key(small, case, capsys):
    hf, tmp = small
    path = tmp / f"{case}.gguf"
    if case == "no-sections":
        write_qwen35moe_gguf(hf, path, sections="omit")
        want = "qwen35moe.rope.dimension_sections"
    elif case == "extra-section":
        write_qwen35moe_gguf(hf, path, sections=[1, 1, 1, 1])   # pair 3 falls in the extra one
        want = "qwen35moe.rope.dimension_sections"
    elif case == "flags":   # says layer 3 is recurrent: not the interval rule
        write_qwen35moe_gguf(hf, path, recurrent=[True, True, True, True])
        want = "qwen35moe.attention.recurrent_layers"
    else:
        write_qwen35moe_gguf(hf, path, drop=("blk.1.ssm_alpha.weight",))
        want = "blk.1.ssm_alpha.weight"
    assert launch_main(["--model", str(path), "--plan-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], err
    assert "Traceback" not in "\n".join(err)


def test_converter_layout_is_what_the_file_holds(small):
    # beta and alpha are separate [n_v, n_embd] tensors and there is no fused ssm_ba
    hf, _ = small
    names = qwen35moe_gguf_tensors(hf)
    assert names["blk.0.ssm_beta.weight"].shape == names["blk.0.ssm_alpha.weight"].shape == (4, 64)
    assert not any(".ssm_ba." in n or ".ssm_in." in n for n in names)


def test_a_plan_on_gpus_is_refused_at_start(small, capsys):
    # the rig's GPUs are planned without touching one: the refusal comes before any rank loads
    hf, tmp = small
    path = write_qwen35moe_gguf(hf, tmp / "gpu.gguf")
    rig = tmp / "rig.json"
    rig.write_text(json.dumps([{"name": "a", "total_mib": 4096, "free_mib": 4000}]))
    assert launch_main(["--model", path, "--inventory", str(rig), "--plan-only"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("warning: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and "CPU ranks only" in err[0], err
    assert launch_main(["--model", path, "--cpu-ranks", "2", "--plan-only"]) == 0
