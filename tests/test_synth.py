"""strata_dist.synth: synthetic qwen3moe GGUFs (format, tokenizer, streaming, determinism, popularity)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_dist.synth import (GEOMETRIES, Popularity, SynthGeometry, parse_popularity,
                               reserved_width, top_k_inclusion, write_synthetic)
from strata_dist.synth.writer import inclusion_targets
from strata_dist.synth.tokenizer import CHAT_TEMPLATE

T = gguf.GGMLQuantizationType
TINY = GEOMETRIES["tiny"]
# Wide enough for Q4_K rows (multiples of 256) and a realistic router (128 experts, top-8).
WIDE = SynthGeometry("wide", n_layer=2, n_embd=512, n_head=4, n_head_kv=2, head_dim=64, n_expert=128,
                     n_expert_used=8, n_ff_exp=256, n_vocab=8192)
LAYER_SHAPES = {  # numpy shapes (GGUF ne reversed), as llama.cpp's qwen3moe expects them
    "attn_norm": lambda g: (g.n_embd,),
    "attn_q": lambda g: (g.n_head * g.head_dim, g.n_embd),
    "attn_k": lambda g: (g.n_head_kv * g.head_dim, g.n_embd),
    "attn_v": lambda g: (g.n_head_kv * g.head_dim, g.n_embd),
    "attn_output": lambda g: (g.n_embd, g.n_head * g.head_dim),
    "attn_q_norm": lambda g: (g.head_dim,),
    "attn_k_norm": lambda g: (g.head_dim,),
    "ffn_norm": lambda g: (g.n_embd,),
    "ffn_gate_inp": lambda g: (g.n_expert, g.n_embd),
    "ffn_gate_exps": lambda g: (g.n_expert, g.n_ff_exp, g.n_embd),
    "ffn_up_exps": lambda g: (g.n_expert, g.n_ff_exp, g.n_embd),
    "ffn_down_exps": lambda g: (g.n_expert, g.n_embd, g.n_ff_exp),
}


def _tensors(path: Path) -> tuple[gguf.GGUFReader, dict[str, gguf.ReaderTensor]]:
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def _np_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))


def _deq(t: gguf.ReaderTensor) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(_np_shape(t))


def _field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0", "q4_k"])
def test_tiny_file_opens_with_all_tensors_and_metadata(tmp_path, quant):
    s = write_synthetic(tmp_path / "tiny.gguf", "tiny", quant=quant, seed=1)
    assert s.bytes_written == (tmp_path / "tiny.gguf").stat().st_size < 2_000_000
    assert not list(tmp_path.glob("*.part"))
    r, ts = _tensors(tmp_path / "tiny.gguf")
    g = TINY
    expected = {"token_embd.weight": (g.n_vocab, g.n_embd), "output_norm.weight": (g.n_embd,),
                "output.weight": (g.n_vocab, g.n_embd)}
    for il in range(g.n_layer):
        expected.update({f"blk.{il}.{k}.weight": f(g) for k, f in LAYER_SHAPES.items()})
    assert {n: _np_shape(t) for n, t in ts.items()} == expected
    assert s.n_params == sum(int(np.prod(v)) for v in expected.values())

    dense = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_k": T.F16}[quant]  # q4_k: the legacy mix
    experts = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_k": T.Q8_0}[quant]  # 64-wide rows: no Q4_K
    for n, t in ts.items():
        if n.endswith(("norm.weight", "ffn_gate_inp.weight")):
            assert t.tensor_type == T.F32, n
        elif "_exps" in n:
            assert t.tensor_type == experts, n
        else:
            assert t.tensor_type == dense, n

    assert _field(r, "general.architecture") == "qwen3moe"
    md = {k: _field(r, "qwen3moe." + k) for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "expert_count", "expert_used_count")}
    assert md == {"block_count": 4, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 32,
                  "expert_feed_forward_length": 32, "attention.head_count": 4, "attention.head_count_kv": 2,
                  "attention.key_length": 16, "attention.value_length": 16, "expert_count": 8,
                  "expert_used_count": 2}
    assert _field(r, "qwen3moe.rope.freq_base") == pytest.approx(1e6)
    assert _field(r, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert _field(r, "general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7, "q4_k": 15}[quant]
    ranks = np.array(_field(r, "strata.synth.expert_rank")).reshape(g.n_layer, g.n_expert)
    assert (ranks == s.expert_rank).all()
    assert all(sorted(row) == list(range(g.n_expert)) for row in ranks)


def test_tokenizer_metadata_is_consistent_and_loads_in_tokenizers(tmp_path):
    write_synthetic(tmp_path / "t.gguf", "tiny", quant="q8_0")
    r, ts = _tensors(tmp_path / "t.gguf")
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    merges = _field(r, "tokenizer.ggml.merges")
    assert _field(r, "tokenizer.ggml.model") == "gpt2" and _field(r, "tokenizer.ggml.pre") == "qwen2"
    assert len(tokens) == len(types) == _np_shape(ts["token_embd.weight"])[0] == TINY.n_vocab
    assert len(set(tokens)) == len(tokens)
    assert len(merges) >= 30
    vocab = {tok: i for i, tok in enumerate(tokens)}
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, m
    assert tokens[_field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[_field(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert tokens[_field(r, "tokenizer.ggml.padding_token_id")] == "<|endoftext|>"
    assert _field(r, "tokenizer.ggml.add_bos_token") is False
    assert [types[vocab[s]] for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [3, 3, 3]
    assert types[vocab["!"]] == 1 and types[-1] == 5 and tokens[-1] == f"[PAD{TINY.n_vocab - 1}]"

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "Hello the world, and then 2 ünïcode"
    enc = tok.encode(text)
    assert vocab["Ġthe"] in enc.ids and vocab["Ġand"] in enc.ids
    assert tok.decode(enc.ids) == text
    for m in merges:  # every merge is reachable: its result's text encodes to that one token
        word = m.replace(" ", "")
        assert tok.encode(word.replace("Ġ", " ")).tokens == [word], m

    import jinja2
    template = _field(r, "tokenizer.chat_template")
    assert template == CHAT_TEMPLATE
    out = jinja2.Template(template).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("quant", ["q8_0", "q4_k", "f16"])
def test_expert_blocks_have_sane_statistics_and_reserved_slice(tmp_path, quant):
    s = write_synthetic(tmp_path / "w.gguf", WIDE, quant=quant)
    _, ts = _tensors(tmp_path / "w.gguf")
    want = {"q8_0": T.Q8_0, "q4_k": T.Q4_K, "f16": T.F16}[quant]
    res = reserved_width(WIDE, quant)
    assert res == (129 if quant == "f16" else 160)  # 1 + n_expert, in whole blocks when quantized
    assert s.tensor_types["ffn_gate_exps.weight"] == want.name
    for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = ts[f"blk.1.{kind}.weight"]
        assert t.tensor_type == want
        w = _deq(t)
        body = w[:, res:, :] if kind == "ffn_down_exps" else w[:, :, res:]
        assert 0.02 < body.std() < 0.05 and abs(body.mean()) < 0.002, (kind, body.std(), body.mean())
        # the reserved slice: down does not write it, gate/up do not read it
        edge = w[:, :res, :] if kind == "ffn_down_exps" else w[:, :, :res]
        assert not edge.any(), kind
    assert not _deq(ts["blk.0.attn_output.weight"])[:res].any()
    for n in ("blk.0.attn_norm.weight", "output_norm.weight"):
        norm = _deq(ts[n])
        assert not norm[:res].any() and (norm[res:] == 1).all()
    router = _deq(ts["blk.0.ffn_gate_inp.weight"])
    assert not router[:, res:].any() and router[:, 1:res].any()


def test_q4_k_reserved_slice_spanning_a_whole_super_block(tmp_path):
    g = SynthGeometry("many", n_layer=1, n_embd=768, n_head=2, n_head_kv=1, head_dim=64, n_expert=300,
                      n_expert_used=8, n_ff_exp=32, n_vocab=512)
    write_synthetic(tmp_path / "m.gguf", g, quant="q4_k")
    _, ts = _tensors(tmp_path / "m.gguf")
    res = reserved_width(g, "q4_k")
    assert res == 320
    gate = ts["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == T.Q4_K and ts["blk.0.ffn_down_exps.weight"].tensor_type == T.Q8_0  # 32-wide
    w = _deq(gate)
    assert not w[:, :, :res].any() and (w[:, :, res:res + 32] != 0).mean() > 0.8


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    def sha(name: str, seed: int) -> str:
        write_synthetic(tmp_path / name, "tiny", quant="q4_k", popularity="zipf:1.2", seed=seed)
        return hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    assert sha("a.gguf", 7) == sha("b.gguf", 7)
    assert sha("c.gguf", 8) != sha("a.gguf", 7)


def test_progress_reports_up_to_the_file_size(tmp_path):
    seen: list[tuple[int, int]] = []
    s = write_synthetic(tmp_path / "p.gguf", "tiny", progress=lambda done, total: seen.append((done, total)))
    done = [d for d, _ in seen]
    assert done == sorted(done) and {t for _, t in seen} == {s.bytes_written} and done[-1] <= s.bytes_written
    assert s.bytes_written - done[-1] < 32  # only the final alignment padding follows the last report


def test_failed_write_leaves_no_file(tmp_path):
    def boom(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_synthetic(tmp_path / "x.gguf", "tiny", progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_streaming_memory_stays_far_below_file_size(tmp_path):
    # A fresh process, so the peak RSS is this write's; small chunks show memory is O(chunk), not O(file).
    script = textwrap.dedent(f"""
        import json, resource, sys
        from strata_dist import synth as S
        from strata_dist.synth import writer
        writer.CHUNK_BYTES = 4 << 20
        g = S.SynthGeometry("medium", n_layer=2, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128,
                            n_expert=64, n_expert_used=8, n_ff_exp=512, n_vocab=8192)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s = S.write_synthetic({str(tmp_path / "med.gguf")!r}, g, "q8_0", "zipf:1.0")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"bytes": s.bytes_written, "growth": (after - before) * 1024}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["bytes"] > 200_000_000
    assert m["growth"] < m["bytes"] / 5, m


# ---------------------------------------------------------------- popularity

def _route(path: Path, layer: int, hidden: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Top-k experts of every vocabulary row at `layer`, as a forward computes them: the hidden state
    (default: the embedding row, i.e. layer 0's residual) → RMSNorm with ffn_norm → router → top-k."""
    r, ts = _tensors(path)
    k = int(_field(r, "qwen3moe.expert_used_count"))
    h = _deq(ts["token_embd.weight"]) if hidden is None else hidden
    x = h / np.sqrt((h * h).mean(1, keepdims=True) + 1e-6) * _deq(ts[f"blk.{layer}.ffn_norm.weight"])
    logits = x @ _deq(ts[f"blk.{layer}.ffn_gate_inp.weight"]).T
    top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    freq = np.bincount(top.ravel(), minlength=logits.shape[1]) / top.size
    return top, freq, k


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.parametrize("geometry,popularity", [(TINY, "zipf:1.0"), (WIDE, "zipf:1.0"), (WIDE, "zipf:2")],
                         ids=["tiny-zipf1", "wide-zipf1", "wide-zipf2"])
def test_zipf_popularity_follows_target_ranks(tmp_path, geometry, popularity):
    s = write_synthetic(tmp_path / "z.gguf", geometry, quant="q8_0", popularity=popularity, seed=3)
    k = geometry.n_expert_used
    # the law: share of rank r ∝ r^-S, where an expert can be in at most PI_CAP of the tokens' top-k
    target = inclusion_targets(s.popularity.shares(geometry.n_expert), k) / k
    for layer in range(2):
        _, freq, _ = _route(tmp_path / "z.gguf", layer)
        by_rank = freq[s.expert_rank[layer]]
        assert _spearman(by_rank, -np.arange(len(by_rank))) > 0.8, by_rank
        assert 0.5 * np.abs(by_rank - target).sum() < 0.06, (by_rank, target)  # total variation
    assert (s.expert_rank[0] != s.expert_rank[1]).any()  # which expert is hot changes per layer


@pytest.mark.parametrize("geometry", [TINY, WIDE], ids=["tiny", "wide"])
def test_uniform_popularity_is_near_uniform(tmp_path, geometry):
    write_synthetic(tmp_path / "u.gguf", geometry, quant="q8_0", popularity="uniform", seed=3)
    _, freq, _ = _route(tmp_path / "u.gguf", 0)
    mean = 1 / len(freq)
    assert np.abs(freq - mean).max() < 0.35 * mean, freq


def test_routing_ignores_what_blocks_add_to_the_residual(tmp_path):
    # Deeper layers see embedding + attention and expert outputs; those outputs are zero on the
    # reserved slice (checked above on the tensors), so any such addition leaves routing unchanged.
    write_synthetic(tmp_path / "d.gguf", WIDE, quant="q8_0", popularity="zipf:1.0", seed=5)
    _, ts = _tensors(tmp_path / "d.gguf")
    emb = _deq(ts["token_embd.weight"])
    res = reserved_width(WIDE, "q8_0")
    delta = np.random.default_rng(0).standard_normal(emb.shape).astype(np.float32) * 5
    delta[:, :res] = 0
    delta += np.random.default_rng(1).standard_normal(emb.shape[1]).astype(np.float32) * 3 * (np.arange(emb.shape[1]) >= res)
    top0, _, _ = _route(tmp_path / "d.gguf", 1)
    top1, _, _ = _route(tmp_path / "d.gguf", 1, hidden=emb + delta)
    assert (np.sort(top0, 1) == np.sort(top1, 1)).mean() > 0.999


def test_top_k_inclusion_matches_sampling():
    mu = np.random.default_rng(0).normal(0, 1.5, 32)
    z = np.random.default_rng(1).standard_normal((40000, 32))
    top = np.argpartition(-(z + mu), 3, axis=1)[:, :4]
    sampled = np.bincount(top.ravel(), minlength=32) / len(z)
    got = top_k_inclusion(mu, 4)
    assert got.sum() == pytest.approx(4, abs=1e-3) and np.abs(got - sampled).max() < 0.015


def test_parse_popularity():
    assert parse_popularity("uniform") == Popularity("uniform")
    assert parse_popularity(" Zipf:1.5 ") == Popularity("zipf", 1.5)
    assert str(parse_popularity("zipf:1")) == "zipf:1"
    p = parse_popularity("zipf:0.8").shares(16)
    assert p.sum() == pytest.approx(1) and (np.diff(p) < 0).all()
    for bad in ("", "zipf", "zipf:", "zipf:abc", "zipf:-1", "zipf:nan", "zipf:inf", "zipf:100", "powerlaw:1"):
        with pytest.raises(ValueError, match="popularity"):
            parse_popularity(bad)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="geometry"):
        write_synthetic(tmp_path / "x.gguf", "qwen3-1t")
    with pytest.raises(ValueError, match="quant"):
        write_synthetic(tmp_path / "x.gguf", "tiny", quant="q5_k")
    with pytest.raises(ValueError, match="popularity"):
        write_synthetic(tmp_path / "x.gguf", "tiny", popularity="zipf:x")
    with pytest.raises(ValueError, match="too narrow"):
        write_synthetic(tmp_path / "x.gguf", SynthGeometry("narrow", 1, 64, 4, 2, 16, 64, 8, 32, 512))
    assert list(tmp_path.iterdir()) == []


def test_refuses_when_the_disk_is_too_small(tmp_path, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 100 << 10))
    with pytest.raises(ValueError, match=r"needs 0\.3 MiB, .* has 0\.1 MiB free"):
        write_synthetic(tmp_path / "x.gguf", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_real_geometries_match_the_published_configs():
    g = GEOMETRIES["qwen3-30b-a3b"]
    assert (g.n_layer, g.n_embd, g.n_expert, g.n_expert_used, g.n_ff_exp, g.n_head, g.n_head_kv,
            g.head_dim, g.n_vocab, g.context_length) == (48, 2048, 128, 8, 768, 32, 4, 128, 151936, 40960)
    g = GEOMETRIES["qwen3-235b-a22b"]
    assert (g.n_layer, g.n_embd, g.n_expert, g.n_expert_used, g.n_ff_exp, g.n_head, g.n_head_kv,
            g.head_dim, g.n_vocab) == (94, 4096, 128, 8, 1536, 64, 4, 128, 151936)
