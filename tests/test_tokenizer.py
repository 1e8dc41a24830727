"""The tokenizer and chat template read from a GGUF: the synthetic model's byte-level BPE (Qwen2
pre-tokenizer) and a SentencePiece vocabulary, each checked against transformers' own GGUF
tokenizer loader; ChatML fallback; sandboxed templates; streaming detokenization."""
from __future__ import annotations

import random

import gguf
import numpy as np
import pytest

from strata_dist.synth import write_synthetic
from strata_dist.synth.tokenizer import CHAT_TEMPLATE, build_vocab
from strata_dist.gguf_file.tokenizer import (CHATML_TEMPLATE, GGUFTokenizer, TemplateError, TokenizerError,
                                   message_text)

TEXTS = [
    "Hello the world, it's 12345 <|im_start|>user\nthat is in the  house",
    "  leading spaces and trailing   ",
    "I'll say: they've gone; we'd LOVE it. DON'T!",
    "tabs\tand\r\nwindows lines\n\n\nthree",
    "ünïcødé — 漢字かな カタカナ 한국어 emoji 🤖🚀 and ½ ² ١٢٣",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "numbers 3.14159 1,000,000 2024-01-01 0x1F",
    "",
]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32")
    return path


@pytest.fixture(scope="module")
def tok(synth):
    return GGUFTokenizer.from_gguf(synth)


def _vocab_gguf(path, model="gpt2", pre="qwen2", template=None, merges=True, extra=None):
    """A GGUF carrying only a tokenizer (and one tensor), like a converter writes it."""
    v = build_vocab(400)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    if merges:
        w.add_token_merges(v.merges + (merges if isinstance(merges, list) else []))
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(v.eos_id)
    if template is not None:
        w.add_chat_template(template)
    for k, val in (extra or {}).items():
        w.add_string(k, val)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spm_gguf(path):
    """A small SentencePiece (llama) vocabulary: byte tokens, controls and scored pieces."""
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "a", "n", "s", "i", ",", "▁t", "he", "▁the",
              "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "in", "▁in", "an",
              "▁an", "▁and", "st", "▁s"]
    scores = [0.0] * len(toks)
    for i, p in enumerate(pieces):
        toks.append(p)
        types.append(1)
        scores.append(-float(i))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(toks), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- byte-level BPE ----------------------------------------------------------------------------------

def test_synth_tokenizer_metadata(tok):
    assert tok.kind == "gpt2" and tok.pre == "qwen2" and tok.vocab_size == 512
    assert tok.tokens[tok.special.eos] == "<|im_end|>" and tok.stop_ids == (tok.special.eos,)
    assert not tok.special.add_bos
    assert tok.chat_template == CHAT_TEMPLATE and tok.has_own_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special=False) == text


def test_special_tokens_are_single_ids_and_skipped_when_decoding(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    start, end = tok.tokens.index("<|im_start|>"), tok.tokens.index("<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.decode(ids) == "user\nhi"


def test_merges_apply(tok):
    # "Ġthe" is a merge result in the synthetic vocabulary: " the" is one token
    assert tok.encode(" the") == [tok.tokens.index("Ġthe")]
    assert tok.encode("the") != [tok.tokens.index("Ġthe")]


def test_qwen2_split_digits_one_by_one(tok, tmp_path):
    pieces = [p for p, _ in tok.tk.pre_tokenizer.pre_tokenize_str("abc 12345")]
    assert pieces == ["abc", "Ġ", "1", "2", "3", "4", "5"]
    llama3 = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "l3.gguf", pre="llama-bpe"))
    pieces = [p for p, _ in llama3.tk.pre_tokenizer.pre_tokenize_str("abc 12345")]
    assert pieces == ["abc", "Ġ", "123", "45"]


def test_equals_transformers_gguf_tokenizer(synth, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(synth.parent), gguf_file=synth.name)
    rng = random.Random(3)
    alphabet = "abcdefghij THE the in 0123 ,.;'!?\n\té漢🤖"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
                     for _ in range(40)]
    for text in texts:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False,
                                                                   add_generation_prompt=True)


# ---- SentencePiece ----------------------------------------------------------------------------------

def test_sentencepiece_vocabulary(tmp_path):
    path = _spm_gguf(tmp_path / "spm.gguf")
    tok = GGUFTokenizer.from_gguf(path)
    text = "hello the world, and in the west 漢\n"
    ids = tok.encode(text)
    assert ids[0] == 1                                 # add_bos defaults on for llama vocabularies
    assert [tok.tokens[i] for i in ids[1:5]] == ["▁hello", "▁the", "▁world", ","]
    assert "<0xE6>" in [tok.tokens[i] for i in ids]    # byte fallback for what no piece spells
    assert tok.decode(ids) == text
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for t in (text, "the hello world", "sand stand in an"):
        assert tok.encode(t) == hf.encode(t), t


def test_unsupported_vocabularies_are_refused(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 'bert' is not supported"):
        GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "bert.gguf", model="bert"))
    with pytest.raises(TokenizerError, match="merges"):
        GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "nomerge.gguf", merges=False))


def test_unknown_pre_tokenizer_falls_back_to_gpt2(tmp_path, caplog):
    tok = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "odd.gguf", pre="some-new-model"))
    assert "some-new-model" in caplog.text
    assert tok.decode(tok.encode("it's 42 ok")) == "it's 42 ok"


def test_merges_into_tokens_the_vocabulary_lacks_are_skipped(tmp_path, caplog):
    """llama.cpp loads a file whose merges name a token missing from the vocabulary; so do we."""
    path = _vocab_gguf(tmp_path / "merges.gguf", merges=["Ġthe zzqx", "zzqx Ġthe"])
    tok = GGUFTokenizer.from_gguf(path)
    assert "2 merge(s)" in caplog.text and "zzqx" in caplog.text
    assert tok.decode(tok.encode("it's the end")) == "it's the end"


# ---- chat templates -------------------------------------------------------------------------------

def test_chatml_fallback_when_the_file_has_no_template(tmp_path):
    tok = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "notpl.gguf"))
    assert not tok.has_own_template and tok.chat_template == CHATML_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) \
        == "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids.count(tok.tokens.index("<|im_start|>")) == 2


def test_template_features_and_raise_exception(tmp_path):
    tpl = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
           "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n"
           "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
           "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    tok = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "tpl.gguf", template=tpl))
    out = tok.apply_chat_template([{"role": "user", "content": "héllo"}],
                                  tools=[{"name": "f", "note": "ü"}])
    assert out == '<|endoftext|>USER: héllo\n[{"name": "f", "note": "ü"}]ASSISTANT:'
    with pytest.raises(TemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_templates_run_sandboxed(tmp_path):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "evil.gguf", template=evil))
    with pytest.raises(TemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    broken = "{% for m in messages %}"
    tok = GGUFTokenizer.from_gguf(_vocab_gguf(tmp_path / "broken.gguf", template=broken))
    with pytest.raises(TemplateError, match="does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_message_content_parts():
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert message_text(None) == ""
    with pytest.raises(TemplateError, match="image_url"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}])


# ---- streaming detokenization ---------------------------------------------------------------------

@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_deltas_add_up(tok, text):
    ids = tok.encode(text)
    dec = tok.incremental()
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)   # a split character is held back, not mangled


def test_incremental_with_sentencepiece_keeps_the_leading_space(tmp_path):
    tok = GGUFTokenizer.from_gguf(_spm_gguf(tmp_path / "spm.gguf"))
    prompt, gen = tok.encode("hello"), tok.encode("the world", add_special=False)
    dec = tok.incremental(prompt)
    assert "".join([dec.push(i) for i in gen] + [dec.flush()]) == " the world"
