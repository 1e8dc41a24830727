"""strata_dist.synth file types and shards: each tensor's type per file type against a table written
from the reference quantizer's rules (tiny, qwen3-30b-a3b and qwen3-next-80b-a3b geometries, the big
ones planned without writing), random blocks of every type, and the shard layout read back."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_dist.synth import (GEOMETRIES, SynthGeometry, parse_popularity, parse_size,
                               reserved_width, write_synthetic)
from strata_dist.synth import blocks
from strata_dist.synth.ftypes import FILE_TYPES
from strata_dist.synth.moe import plan_moe
from strata_dist.synth.next import NEXT_GEOMETRIES, plan_next
from strata_dist.synth.writer import inclusion_targets

T = gguf.GGMLQuantizationType
UNIFORM = parse_popularity("uniform")
ROOT = Path(__file__).resolve().parents[1]

# The layers the rules give more bits in a 48-layer model: the first and last 6, and every third
# one from layer 8 (written out, not computed).
MORE_BITS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47}
F32_KINDS = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", "output_norm")


def _kind(name: str) -> tuple[str, int]:
    parts = name.split(".")
    return (parts[2], int(parts[1])) if parts[0] == "blk" else (parts[0], -1)


def expected_30b(ftype: str, kind: str, layer: int) -> T:
    """The table for qwen3-30b-a3b (48 layers, 128 experts, 32 q / 4 kv heads: n_gqa 8; every
    row a multiple of 256, so nothing falls back)."""
    if kind in F32_KINDS:
        return T.F32
    if ftype in ("f32", "f16", "bf16"):
        return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}[ftype]
    base = FILE_TYPES[ftype].default
    more = layer in MORE_BITS_48
    table = {
        "q4_k_m": {"attn_v": T.Q6_K if more else T.Q4_K, "ffn_down_exps": T.Q6_K if more else T.Q4_K},
        "q5_k_m": {"attn_v": T.Q6_K if more else T.Q5_K, "ffn_down_exps": T.Q6_K if more else T.Q5_K},
        "q4_k_s": {"attn_v": T.Q5_K if layer < 4 else T.Q4_K,
                   "ffn_down_exps": T.Q5_K if layer < 6 else T.Q4_K},
        "q3_k_m": {"attn_v": T.Q5_K if layer < 2 else T.Q4_K,
                   "ffn_down_exps": T.Q5_K if layer < 3 else T.Q4_K, "attn_output": T.Q4_K},
        "q3_k_l": {"attn_v": T.Q5_K, "ffn_down_exps": T.Q5_K, "attn_output": T.Q5_K},
        "q2_k": {"attn_v": T.Q4_K, "ffn_down_exps": T.Q3_K, "attn_output": T.Q3_K},
    }.get(ftype, {})
    if kind == "output":
        return T.Q8_0 if ftype == "q8_0" else T.Q6_K
    return table.get(kind, base)


# (the i-quant file types: tests/test_synth_iquants.py)
@pytest.mark.parametrize("ftype", [f for f in FILE_TYPES if f != "q4_k" and not f.startswith("iq")])
def test_30b_types_follow_the_rule_table(ftype):
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], ftype, UNIFORM, 0)
    got = {t.name: t.ggml_type for t in tensors}
    want = {n: expected_30b(ftype, *_kind(n)) for n in got}
    assert got == want
    if ftype == "q4_k_m":   # the description of a Q4_K_M file, counted
        downs = [got[f"blk.{il}.ffn_down_exps.weight"] for il in range(48)]
        assert downs.count(T.Q6_K) == 24 and got["token_embd.weight"] == T.Q4_K
        assert {got[f"blk.7.{k}.weight"] for k in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps",
                                                    "ffn_up_exps")} == {T.Q4_K}


# The sizes of the published qwen3-30b-a3b files of these types (decimal GB; q4_k_m: 17.28 GiB):
# a rule that moves a tensor class between types (ffn_down, the output) moves the total by more
# than the 0.3% allowed for the metadata and the quantizer's version.
PUBLISHED_30B_GB = {"q8_0": 32.48, "q6_k": 25.10, "q5_k_m": 21.74, "q5_k_s": 21.10,
                    "q4_k_m": 17.28 * 2 ** 30 / 1e9, "bf16": 61.10}


@pytest.mark.parametrize("ftype", list(PUBLISHED_30B_GB))
def test_30b_plan_is_the_size_of_the_published_file(ftype):
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], ftype, UNIFORM, 0)
    assert sum(t.nbytes for t in tensors) / 1e9 == pytest.approx(PUBLISHED_30B_GB[ftype], rel=0.003)


def test_legacy_q4_k_keeps_f16_dense_tensors():
    tensors, _ = plan_moe(GEOMETRIES["qwen3-30b-a3b"], "q4_k", UNIFORM, 0)
    got = {t.name: t.ggml_type for t in tensors}
    assert got["blk.0.ffn_down_exps.weight"] == got["blk.0.ffn_gate_exps.weight"] == T.Q4_K
    assert got["token_embd.weight"] == got["output.weight"] == got["blk.0.attn_v.weight"] == T.F16


# tiny: 64-wide rows (no 256-wide K block fits: Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
# Q6_K -> Q8_0), ffn_down rows of 32, 8 experts (attn_v and attn_k Q8_0; attn_output Q5_K for the
# K mixes), n_gqa 2, 4 layers (more bits: layers 2 and 3). Output: Q8_0 (its rows do not hold the
# default type's blocks) except where those blocks are 32 wide (Q6_K, falling back to Q8_0).
TINY_TABLE = {  # ftype: (token_embd, attn_q, attn_v/attn_k, attn_output, gate/up, down by layer)
    "q4_k_m": (T.Q5_0, T.Q5_0, T.Q8_0, T.Q5_1, T.Q5_0, (T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0)),
    "q3_k_m": (T.Q4_0, T.Q4_0, T.Q8_0, T.Q5_1, T.Q4_0, (T.Q5_0,) * 4),
    "q2_k": (T.Q4_0, T.Q4_0, T.Q8_0, T.Q5_1, T.Q4_0, (T.Q4_0,) * 4),
    "q5_k_s": (T.Q5_1, T.Q5_1, T.Q8_0, T.Q5_1, T.Q5_1, (T.Q5_1,) * 4),
    "q6_k": (T.Q8_0, T.Q8_0, T.Q8_0, T.Q8_0, T.Q8_0, (T.Q8_0,) * 4),
    "q4_0": (T.Q4_0, T.Q4_0, T.Q8_0, T.Q4_0, T.Q4_0, (T.Q4_0,) * 4),
    "q5_1": (T.Q5_1, T.Q5_1, T.Q8_0, T.Q5_1, T.Q5_1, (T.Q5_1,) * 4),
}


@pytest.mark.parametrize("ftype", list(TINY_TABLE))
def test_tiny_file_carries_the_fallback_and_eight_expert_rules(tmp_path, ftype):
    s = write_synthetic(tmp_path / "t.gguf", "tiny", quant=ftype, seed=2)
    r = gguf.GGUFReader(s.path)
    got = {t.name: t.tensor_type for t in r.tensors}
    embd, q, vk, out, gu, downs = TINY_TABLE[ftype]
    for n, t in got.items():
        kind, layer = _kind(n)
        want = {"token_embd": embd, "attn_q": q, "attn_k": vk, "attn_v": vk, "attn_output": out,
                "ffn_gate_exps": gu, "ffn_up_exps": gu, "output": T.Q8_0}.get(kind)
        want = downs[layer] if kind == "ffn_down_exps" else want
        assert t == (T.F32 if kind in F32_KINDS else want), n
    assert r.fields["general.file_type"].contents() == int(FILE_TYPES[ftype].file_type)


def test_next_80b_types_count_attn_qkv_with_attn_v():
    """qwen3next: the linear layers' attn_qkv is of attn_v's kind, so the running count of such
    tensors is the layer; the shared expert's ffn_down takes ffn_down's rule."""
    tensors, _ = plan_next(NEXT_GEOMETRIES["qwen3-next-80b-a3b"], "q4_k_m", UNIFORM, 0)
    got = {t.name: t.ggml_type for t in tensors}
    for il in range(48):
        more = T.Q6_K if il in MORE_BITS_48 else T.Q4_K
        v = f"blk.{il}.attn_qkv.weight" if (il + 1) % 4 else f"blk.{il}.attn_v.weight"
        assert got[v] == more, v
        assert got[f"blk.{il}.ffn_down_exps.weight"] == got[f"blk.{il}.ffn_down_shexp.weight"] == more
        assert got[f"blk.{il}.ffn_gate_inp_shexp.weight"] == T.F32     # [1, n_embd]: one dimension
        if (il + 1) % 4:
            assert got[f"blk.{il}.ssm_conv1d.weight"] == got[f"blk.{il}.ssm_a"] == T.F32
            assert got[f"blk.{il}.ssm_ba.weight"] == got[f"blk.{il}.ssm_out.weight"] == T.Q4_K
            assert got[f"blk.{il}.attn_gate.weight"] == T.Q4_K
    assert got["output.weight"] == T.Q6_K and got["token_embd.weight"] == T.Q4_K


# ---------------------------------------------------------------- blocks

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16]


def _deq(rows: np.ndarray, t: T, n_cols: int) -> np.ndarray:
    return gguf.quants.dequantize(rows.view(np.uint8), t).reshape(len(rows), n_cols)


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_are_valid_centred_and_edit_as_asked(t):
    rows = blocks.random_rows(t, np.random.SFC64(3), 256, 768, 0.03)
    w = _deq(rows, t, 768)
    assert np.isfinite(w).all() and 0.027 < w.std() < 0.033 and abs(w.mean()) < 0.0005
    for n in (32, 96, 160, 288):   # whole blocks, sub-blocks, both
        edited = rows.copy()
        blocks.zero_first_columns(t, edited, n)
        e = _deq(edited, t, 768)
        assert not e[:, :n].any()
        assert np.array_equal(e[:, n:], w[:, n:])          # nothing else moved
    emb = blocks.random_rows(t, np.random.SFC64(4), 64, 768, 1.0)
    blocks.set_channel(t, emb, 1.0, 4.0)
    e = _deq(emb, t, 768)
    a = blocks.channel_value(t, 1.0, 4.0)
    assert (e[:, 0] == a).all() and a > 1.2                 # one constant, above the others' std
    assert 0.9 < e[:, 1:].std() < 1.1


@pytest.mark.parametrize("ftype", ["q4_k_m", "q2_k", "q3_k_m"])
def test_quantized_embedding_keeps_the_routing_law(tmp_path, ftype):
    g = SynthGeometry("wide", n_layer=2, n_embd=512, n_head=4, n_head_kv=2, head_dim=64, n_expert=64,
                      n_expert_used=8, n_ff_exp=256, n_vocab=8192)
    s = write_synthetic(tmp_path / "w.gguf", g, quant=ftype, popularity="zipf:1.0", seed=3)
    r = gguf.GGUFReader(s.path)
    ts = {t.name: t for t in r.tensors}

    def deq(name: str) -> np.ndarray:
        t = ts[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
    emb = deq("token_embd.weight")
    assert ts["token_embd.weight"].tensor_type != T.F16 and len(set(emb[:, 0].tolist())) == 1
    res = reserved_width(g, ftype)
    assert not deq("blk.0.ffn_gate_exps.weight")[:, :, :res].any()
    assert not deq("blk.1.ffn_down_exps.weight")[:, :res, :].any()
    assert not deq("blk.0.attn_output.weight")[:res].any()
    target = inclusion_targets(s.popularity.shares(g.n_expert), g.n_expert_used) / g.n_expert_used
    for layer in range(2):
        x = emb / np.sqrt((emb * emb).mean(1, keepdims=True) + 1e-6) * deq(f"blk.{layer}.ffn_norm.weight")
        top = np.argsort(-(x @ deq(f"blk.{layer}.ffn_gate_inp.weight").T), axis=1)[:, :g.n_expert_used]
        freq = np.bincount(top.ravel(), minlength=g.n_expert) / top.size
        assert 0.5 * np.abs(freq[s.expert_rank[layer]] - target).sum() < 0.06


# ---------------------------------------------------------------- shards

def test_parse_size():
    assert parse_size("4G") == 4_000_000_000 and parse_size("500m") == 500_000_000
    assert parse_size("64K") == 64_000 and parse_size("1234") == 1234
    for bad in ("", "G", "-1G", "0M", "4T", "1.5G", "4 GB"):
        with pytest.raises(ValueError, match="split size"):
            parse_size(bad)


def _fields(r: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensor_bytes(paths: list[Path]) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    out = {}
    for p in paths:
        for t in gguf.GGUFReader(p).tensors:
            assert t.name not in out, t.name
            out[t.name] = (int(t.tensor_type), tuple(int(x) for x in t.shape), bytes(t.data.view(np.uint8)))
    return out


def test_shards_have_the_split_layout_and_the_unsplit_files_tensors(tmp_path):
    whole = write_synthetic(tmp_path / "whole.gguf", "tiny", quant="q4_k_m", seed=5)
    cap = 120_000
    s = write_synthetic(tmp_path / "m.gguf", "tiny", quant="q4_k_m", seed=5, split_max_size=cap)
    n = len(s.shards)
    assert n >= 3 and [p.name for p in s.shards] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert sorted(tmp_path.iterdir()) == sorted([*s.shards, whole.path])     # no .part left
    assert s.path == s.shards[0] and s.bytes_written == sum(p.stat().st_size for p in s.shards)
    readers = [gguf.GGUFReader(p) for p in s.shards]
    total = len(readers[0].tensors) and sum(len(r.tensors) for r in readers)
    unsplit = _fields(gguf.GGUFReader(whole.path))
    for i, r in enumerate(readers):
        f = r.fields
        assert f["split.no"].types == [gguf.GGUFValueType.UINT16] and f["split.no"].contents() == i
        assert f["split.count"].types == [gguf.GGUFValueType.UINT16] and f["split.count"].contents() == n
        assert f["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert f["split.tensors.count"].contents() == total
        meta = {k: v for k, v in _fields(r).items() if not k.startswith("split.")}
        assert meta == (unsplit if i == 0 else {}), i       # model metadata in the first shard only
        sizes = [gguf.GGUFWriter.ggml_pad(int(t.n_bytes), 32) for t in r.tensors]
        assert sizes and (sum(sizes) <= cap or len(sizes) == 1)
        if i + 1 < n:   # in order, and a shard closes only when the next tensor would pass the cap
            nxt = readers[i + 1].tensors[0]
            assert sum(sizes) + gguf.GGUFWriter.ggml_pad(int(nxt.n_bytes), 32) > cap
    order = [t.name for r in readers for t in r.tensors]
    assert order == [t.name for t in gguf.GGUFReader(whole.path).tensors]
    assert _tensor_bytes(s.shards) == _tensor_bytes([whole.path])


def test_a_tensor_over_the_cap_gets_a_shard_of_its_own(tmp_path):
    s = write_synthetic(tmp_path / "m.gguf", "tiny", quant="f32", split_max_size="20K")
    names = [[t.name for t in gguf.GGUFReader(p).tensors] for p in s.shards]
    assert names[0] == ["token_embd.weight"] and all(names)       # no shard without tensors
    assert gguf.GGUFReader(s.shards[0]).fields["split.no"].contents() == 0


def test_cli_writes_shards_and_refuses_bad_flags(tmp_path):
    def synth(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "synth", str(tmp_path / "c.gguf"),
                               "--quiet", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    ok = synth("--quant", "q3_k_m", "--split-max-size", "150K")
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-00001-of-00002.gguf", "c-00002-of-00002.gguf"]
    for args, says in ((["--quant", "q4_k_x"], "--quant q4_k_x: expected one of"),
                       (["--split-max-size", "4T"], "--split-max-size 4T: bad split size")):
        bad = synth(*args)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        assert bad.stderr.startswith("error: ") and says in bad.stderr, bad.stderr
    assert len(list(tmp_path.iterdir())) == 2


def test_cli_help_lists_every_file_type():
    """`synth --quant`'s help names each file type the synth accepts (its own table), the
    i-quant ones included."""
    from strata_dist.tools.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["synth"]
    text = next(a for a in sub._actions if a.dest == "quant").help
    listed = set(text.replace(",", " ").replace(":", " ").replace(";", " ").split())
    assert set(FILE_TYPES) <= listed, sorted(set(FILE_TYPES) - listed)
