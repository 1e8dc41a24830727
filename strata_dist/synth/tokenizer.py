"""The tokenizer a synthetic GGUF carries: a small byte-level BPE in Qwen's (GPT-2) conventions.

Layout of the vocabulary, padded to exactly the model's n_vocab:
  * the 256 byte-level single-character tokens (GPT-2 `bytes_to_unicode`, in GPT-2's id order),
  * the result of each merge of `MERGES`, in merge order (every merge's parts precede it),
  * the specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (CONTROL),
  * `[PAD{i}]` (UNUSED) up to n_vocab, as llama.cpp names the padding of Qwen's vocabulary.

`tokenizer.ggml.model = "gpt2"`, `pre = "qwen2"`, so both llama.cpp and a `tokenizers` BPE built from
the file's tokens and merges encode with it. Any text encodes (byte fallback is the 256 byte tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import gguf

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"  # as in Qwen3's GGUFs

# A ChatML template like Qwen's, without tools or thinking.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Frequent English pairs, in the order a BPE trainer would find them ('Ġ' is the space byte).
# Each part must be a byte token or the result of an earlier merge (checked by `_check`).
MERGES = tuple("""
Ġ t|h e|i n|r e|o n|Ġt he|e r|Ġ s|a t|Ġ w|Ġ o|e n|Ġ c|i t|i s|a n|o r|e s|Ġ b|e d|Ġ f|in g|Ġ p|o u
|Ġ a|a l|a r|Ġt o|Ġ m|Ġo f|Ġ in|Ġ d|Ġ h|Ġ an|Ġan d|i c|a s|l e|t h|Ġt h|i on|o m|l l|en t|Ġ n|Ġ l|s t
|Ġ re|v e|Ġ e|r o|l y|Ġb e|Ġ g|Ġ T|c t|Ġ S|i d|o t|Ġ I|u t|e t|Ġ A|Ġ i|Ġ is|Ġ on|i m|a m|o w|a y|a d
|s e|Ġth at|Ġ C|i g|Ġf or|a c|Ġ y|v er|u r|Ġ u|l d|Ġs t|Ġ M|' s|Ġ he|Ġ it|at ion|it h|i r|c e
|Ġy ou|i l|Ġ B|Ġw h|o l|Ġ P|Ġw ith|Ġ 1|t er|c h|Ġa s|Ġw e|Ġ (|n d|i ll|Ġ D|i f|Ġ 2|a g|er s
""".replace("\n", "").split("|"))


@dataclass(frozen=True)
class SynthVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int


@lru_cache(maxsize=1)
def bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's byte → printable character table, as the tuple of characters in GPT-2's id order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return tuple(chr(c) for c in cs)


def _check(byte_tokens: tuple[str, ...]) -> list[str]:
    """The merge results in order; raises if a merge uses a part not yet in the vocabulary."""
    known = set(byte_tokens)
    results = []
    for m in MERGES:
        a, b = m.split(" ")
        if a not in known or b not in known:
            raise AssertionError(f"merge {m!r} uses a part not in the vocabulary")
        if a + b in known:
            raise AssertionError(f"merge {m!r} produces a duplicate token {a + b!r}")
        known.add(a + b)
        results.append(a + b)
    return results


def build_vocab(n_vocab: int) -> SynthVocab:
    byte_tokens = bytes_to_unicode()
    merged = _check(byte_tokens)
    tokens = list(byte_tokens) + merged + list(SPECIALS)
    n_real = len(tokens)
    if n_vocab < n_real:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the synthetic tokenizer's {n_real} tokens")
    types = [int(gguf.TokenType.NORMAL)] * (n_real - len(SPECIALS)) + [int(gguf.TokenType.CONTROL)] * len(SPECIALS)
    tokens += [f"[PAD{i}]" for i in range(n_real, n_vocab)]
    types += [int(gguf.TokenType.UNUSED)] * (n_vocab - n_real)
    return SynthVocab(tokens=tokens, token_types=types, merges=list(MERGES),
                      bos_id=tokens.index(BOS), eos_id=tokens.index(EOS), pad_id=tokens.index(PAD))


def add_tokenizer(writer: gguf.GGUFWriter, n_vocab: int) -> SynthVocab:
    """Write the tokenizer.* metadata of the synthetic vocabulary into `writer`."""
    v = build_vocab(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.token_types)
    writer.add_token_merges(v.merges)  # non-empty: gguf-py silently drops empty arrays
    writer.add_bos_token_id(v.bos_id)
    writer.add_eos_token_id(v.eos_id)
    writer.add_pad_token_id(v.pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return v
