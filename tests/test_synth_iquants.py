"""The synth's i-quant file types: each tensor's type for qwen3-30b-a3b and qwen3-next-80b-a3b (planned,
not written) against a table written out from the reference quantizer's rules, the 30B IQ4_XS plan
against a published file's size, random valid blocks of every i-quant type, and small files of every
i-quant file type written, read back with gguf-py, decoded, run by the CPU forward and split into
shards."""
from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.synth import GEOMETRIES, SynthGeometry, parse_popularity, reserved_width, write_synthetic
from strata_dist.synth import blocks
from strata_dist.synth.ftypes import FILE_TYPES
from strata_dist.synth.moe import plan_moe
from strata_dist.synth.next import NEXT_GEOMETRIES, NextSynthGeometry, plan_next

T = gguf.GGMLQuantizationType
UNIFORM = parse_popularity("uniform")
IQ_FILE_TYPES = ["iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s",
                 "iq3_m", "iq4_nl", "iq4_xs"]
F32_KINDS = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", "output_norm")

# qwen3-30b-a3b under each i-quant file type (48 layers, 128 experts, n_gqa 8, every row a
# multiple of 256: nothing falls back). Written from the reference's rules, without importance
# matrix for iq3_xs, iq3_s, iq3_m, iq4_nl, iq4_xs and with one for the rest (they need one):
#   default   iq2_s -> IQ2_XS and iq2_m -> IQ2_S (the reference maps them so), iq3_xs/iq3_m -> IQ3_S
#   embd      iq1_*, iq2_xxs, iq2_xs: Q2_K; iq2_s, iq2_m, iq3_xxs: IQ3_S
#   output    Q5_K for iq1_*, iq2_*, iq3_xxs; Q6_K otherwise
#   attn_v    Q4_K (iq1/iq2/iq3: n_gqa >= 4, or 4+ experts), Q5_K for iq4_*
#   attn_q/k  iq3_xs: IQ3_XXS, iq3_xxs: IQ2_S
#   attn_out  iq1_*: IQ2_XXS, iq2_s/iq2_m/iq3_xxs: IQ3_S, iq3_m: Q4_K
#   ffn_down  the first 48/8 = 6: iq1/iq2_xxs/iq2_xs Q2_K, iq2_s/iq2_m IQ3_S, iq3_m Q4_K, iq4_* Q5_K
#   gate/up   iq3_xs: IQ3_XXS in layers 6 .. 41
DEFAULT = {"iq1_s": T.IQ1_S, "iq1_m": T.IQ1_M, "iq2_xxs": T.IQ2_XXS, "iq2_xs": T.IQ2_XS, "iq2_s": T.IQ2_XS,
           "iq2_m": T.IQ2_S, "iq3_xxs": T.IQ3_XXS, "iq3_xs": T.IQ3_S, "iq3_s": T.IQ3_S, "iq3_m": T.IQ3_S,
           "iq4_nl": T.IQ4_NL, "iq4_xs": T.IQ4_XS}
EMBD = {"iq1_s": T.Q2_K, "iq1_m": T.Q2_K, "iq2_xxs": T.Q2_K, "iq2_xs": T.Q2_K, "iq2_s": T.IQ3_S,
        "iq2_m": T.IQ3_S, "iq3_xxs": T.IQ3_S}
Q5K_OUTPUT = {"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs"}
QK = {"iq3_xs": T.IQ3_XXS, "iq3_xxs": T.IQ2_S}
ATTN_OUT = {"iq1_s": T.IQ2_XXS, "iq1_m": T.IQ2_XXS, "iq2_s": T.IQ3_S, "iq2_m": T.IQ3_S,
            "iq3_xxs": T.IQ3_S, "iq3_m": T.Q4_K}
FIRST_DOWNS = {"iq1_s": T.Q2_K, "iq1_m": T.Q2_K, "iq2_xxs": T.Q2_K, "iq2_xs": T.Q2_K, "iq2_s": T.IQ3_S,
               "iq2_m": T.IQ3_S, "iq3_m": T.Q4_K, "iq4_nl": T.Q5_K, "iq4_xs": T.Q5_K}


def _kind(name: str) -> tuple[str, int]:
    parts = name.split(".")
    return (parts[2], int(parts[1])) if parts[0] == "blk" else (parts[0], -1)


def expected_30b(ftype: str, kind: str, layer: int) -> T:
    base = DEFAULT[ftype]
    if kind in F32_KINDS:
        return T.F32
    if kind == "token_embd":
        return EMBD.get(ftype, base)
    if kind == "output":
        return T.Q5_K if ftype in Q5K_OUTPUT else T.Q6_K
    if kind == "attn_v":
        return T.Q5_K if ftype.startswith("iq4") else T.Q4_K
    if kind in ("attn_q", "attn_k"):
        return QK.get(ftype, base)
    if kind == "attn_output":
        return ATTN_OUT.get(ftype, base)
    if kind == "ffn_down_exps":
        return FIRST_DOWNS.get(ftype, base) if layer < 6 else base
    if kind in ("ffn_gate_exps", "ffn_up_exps") and ftype == "iq3_xs" and 6 <= layer < 42:
        return T.IQ3_XXS
    return base


@pytest.mark.parametrize("ftype", IQ_FILE_TYPES)
def test_30b_iquant_types_follow_the_rule_table(ftype):
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], ftype, UNIFORM, 0)
    got = {t.name: t.ggml_type for t in tensors}
    assert got == {n: expected_30b(ftype, *_kind(n)) for n in got}
    assert FILE_TYPES[ftype].file_type == getattr(gguf.LlamaFileType, "MOSTLY_" + ftype.upper())


def test_30b_iq3_s_plan_by_tensor_class():
    """The issue's example, counted: attn_v Q4_K (n_gqa 8 >= 4), output Q6_K, all else IQ3_S."""
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], "iq3_s", UNIFORM, 0)
    kinds: dict[str, set] = {}
    for t in tensors:
        kinds.setdefault(_kind(t.name)[0], set()).add(t.ggml_type)
    assert kinds.pop("attn_v") == {T.Q4_K} and kinds.pop("output") == {T.Q6_K}
    assert {k: v for k, v in kinds.items() if k not in F32_KINDS} == \
           {k: {T.IQ3_S} for k in ("token_embd", "attn_q", "attn_k", "attn_output", "ffn_gate_exps",
                                   "ffn_up_exps", "ffn_down_exps")}
    assert sum(t.nbytes for t in tensors) == pytest.approx(13.293e9, rel=1e-4)


# A published Qwen3-30B-A3B IQ4_XS ("default embed and output", 16.6e9 bytes, three significant
# figures): the no-importance-matrix rules' Q5_K in the first 6 ffn_down layers are 0.19 GB of it.
PUBLISHED_30B_IQ4_XS = 16.6e9


def test_30b_iq4_xs_plan_is_the_size_of_the_published_file():
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], "iq4_xs", UNIFORM, 0)
    assert sum(t.nbytes for t in tensors) == pytest.approx(PUBLISHED_30B_IQ4_XS, rel=0.004)


@pytest.mark.parametrize("ftype", ["iq2_xxs", "iq2_m", "iq3_s"])
def test_next_80b_counts_ffn_down_tensors_in_file_order(ftype):
    """qwen3next: attn_qkv is attn_v's kind (Q4_K, n_gqa 8); the 2-bit class raises the first
    n_layer/8 = 6 ffn_down tensors in (layer, name) order, and a layer holds two (the experts' and
    the shared expert's): layers 0..2 only, where a rule by layer would raise 0..5."""
    tensors, _ = plan_next(NEXT_GEOMETRIES["qwen3-next-80b-a3b"], ftype, UNIFORM, 0)
    got = {t.name: t.ggml_type for t in tensors}
    base = DEFAULT[ftype]
    raised = {"iq2_xxs": T.Q2_K, "iq2_m": T.IQ3_S}.get(ftype, base)
    for il in range(48):
        v = f"blk.{il}.attn_qkv.weight" if (il + 1) % 4 else f"blk.{il}.attn_v.weight"
        assert got[v] == T.Q4_K, v
        for down in ("ffn_down_exps", "ffn_down_shexp"):
            assert got[f"blk.{il}.{down}.weight"] == (raised if il < 3 else base), (il, down)
        assert got[f"blk.{il}.ffn_gate_exps.weight"] == got[f"blk.{il}.ffn_gate_shexp.weight"] == base
    assert got["output.weight"] == (T.Q5_K if ftype in Q5K_OUTPUT else T.Q6_K)


# ---------------------------------------------------------------- blocks

@pytest.mark.parametrize("t", blocks.IQUANT_TYPES, ids=lambda t: t.name)
def test_random_iquant_blocks_are_valid_centred_and_edit_as_asked(t):
    rows = blocks.random_rows(t, np.random.SFC64(3), 256, 768, 0.03)
    w = gguf.quants.dequantize(rows, t).reshape(256, 768)
    assert np.isfinite(w).all() and 0.028 < w.std() < 0.032 and abs(w.mean()) < 0.0005
    granule = blocks.column_granule(t)
    assert granule == (32 if t in (T.IQ4_NL, T.IQ4_XS) else 256)
    for n in (32, 96, 256, 512):
        edited = rows.copy()
        if n % granule:
            with pytest.raises(ValueError, match=t.name):
                blocks.zero_first_columns(t, edited, n)
            continue
        blocks.zero_first_columns(t, edited, n)
        e = gguf.quants.dequantize(edited, t).reshape(256, 768)
        assert not e[:, :n].any() and np.array_equal(e[:, n:], w[:, n:])
    emb = blocks.random_rows(t, np.random.SFC64(4), 64, 768, 1.0)
    blocks.set_channel(t, emb, 1.0, 4.0)
    e = gguf.quants.dequantize(emb, t).reshape(64, 768)
    a = blocks.channel_value(t, 1.0, 4.0)
    assert (e[:, 0] == a).all() and a > 1.2
    assert 0.9 < e[:, 1:].std() < 1.1


# ---------------------------------------------------------------- files

# The smallest geometries whose every row holds 256-wide blocks (tiny's 64-wide rows fall back to
# IQ4_NL), with the reserved slice of 256 columns the i-quants need at most half of n_embd.
WIDE = SynthGeometry("wide-iq", n_layer=2, n_embd=512, n_head=4, n_head_kv=1, head_dim=64, n_expert=16,
                     n_expert_used=4, n_ff_exp=256, n_vocab=512, context_length=4096)
WIDE_NEXT = NextSynthGeometry("wide-iq-next", n_layer=4, n_embd=512, n_head=4, n_head_kv=1, head_dim=64,
                              n_expert=16, n_expert_used=4, n_ff_exp=256, n_ff_shexp=256, n_vocab=512,
                              n_k_heads=2, n_v_heads=4, head_k_dim=64, head_v_dim=64,
                              context_length=4096, rope_base=1e6)


def _generate(path, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model", str(path),
                           "--max-new", "4", "--prompt-ids", "1,2,3"], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "STRATA_CACHE_DIR": str(tmp_path)})


def _read_back(path, types: dict[str, str], res: int) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        assert t.tensor_type.name == types[t.name], t.name
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        assert np.isfinite(w).all(), t.name
        out[t.name] = w
    # the routing law's slice: the experts read none of it and ffn_down writes none
    assert not out["blk.0.ffn_gate_exps.weight"][:, :, :res].any()
    assert not out["blk.1.ffn_up_exps.weight"][:, :, :res].any()
    assert not out["blk.1.ffn_down_exps.weight"][:, :res, :].any()
    assert len(set(out["token_embd.weight"][:, 0].tolist())) == 1
    return out


@pytest.mark.parametrize("ftype", IQ_FILE_TYPES)
def test_small_iquant_files_read_back_decode_and_keep_the_reserved_slice(tmp_path, ftype):
    s = write_synthetic(tmp_path / "w.gguf", WIDE, quant=ftype, seed=5)
    res = reserved_width(WIDE, ftype)
    assert res == (32 if ftype.startswith("iq4") else 256)
    _read_back(s.path, s.types, res)
    default = FILE_TYPES[ftype].default.name
    assert s.types["blk.1.ffn_gate_exps.weight"] in (default, "IQ3_XXS")
    r = gguf.GGUFReader(s.path)
    assert r.fields["general.file_type"].contents() == int(FILE_TYPES[ftype].file_type)


@pytest.mark.parametrize("ftype", ["iq3_s", "iq2_xxs"])
def test_small_next_iquant_files_read_back_and_keep_the_reserved_slice(tmp_path, ftype):
    s = write_synthetic(tmp_path / "n.gguf", WIDE_NEXT, quant=ftype, seed=5)
    res = reserved_width(WIDE_NEXT, ftype)
    out = _read_back(s.path, s.types, res)
    assert not out["blk.0.ffn_gate_shexp.weight"][:, :res].any()
    assert s.types["blk.0.ffn_gate_exps.weight"] == FILE_TYPES[ftype].default.name


def test_tiny_iq3_s_falls_back_to_iq4_nl_and_generates(tmp_path):
    """tiny's 64-wide rows hold no 256-wide block: IQ3_S falls back to IQ4_NL (its 8 experts give
    attn_v/attn_k Q8_0 and attn_output Q5_K, falling back to Q5_1; the output Q8_0)."""
    s = write_synthetic(tmp_path / "tiny-iq3_s.gguf", "tiny", quant="iq3_s", seed=2)
    kinds = {_kind(n)[0]: t for n, t in s.types.items()}
    assert kinds["ffn_gate_exps"] == kinds["ffn_down_exps"] == kinds["attn_q"] == kinds["token_embd"] == "IQ4_NL"
    assert kinds["attn_v"] == kinds["attn_k"] == kinds["output"] == "Q8_0" and kinds["attn_output"] == "Q5_1"
    done = _generate(s.path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().split(",")) == 4


@pytest.mark.parametrize("geometry,ftype", [(WIDE, "iq3_s"), (WIDE, "iq1_m"), (WIDE_NEXT, "iq2_xxs")],
                         ids=["moe-iq3_s", "moe-iq1_m", "next-iq2_xxs"])
def test_cpu_forward_runs_iquant_files(tmp_path, geometry, ftype):
    """The CPU ranks decode i-quant weights through gguf-py: generate runs the file."""
    s = write_synthetic(tmp_path / "w.gguf", geometry, quant=ftype, seed=7)
    done = _generate(s.path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().split(",")) == 4


def test_iq3_s_shards_hold_the_unsplit_files_tensors(tmp_path):
    whole = write_synthetic(tmp_path / "whole.gguf", WIDE_NEXT, quant="iq3_s", seed=9)
    split = write_synthetic(tmp_path / "split.gguf", WIDE_NEXT, quant="iq3_s", seed=9, split_max_size="2M")
    assert len(split.shards) >= 3 and split.shards[0].name.endswith("-00001-of-%05d.gguf" % len(split.shards))
    one, many = GGUFModel(str(whole.path)), GGUFModel(str(split.shards[0]))
    assert sorted(one.tensors) == sorted(many.tensors)
    for name in one.tensors:
        assert one.tensors[name].ggml_type == many.tensors[name].ggml_type
        np.testing.assert_array_equal(one.raw(name), many.raw(name))
    a, b = _generate(whole.path, tmp_path), _generate(split.shards[0], tmp_path)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
