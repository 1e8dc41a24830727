"""The model's own tokenizer and chat template, read from the GGUF's `tokenizer.*` metadata.

* `tokenizer.ggml.model = "gpt2"` (byte-level BPE: Qwen, Llama 3, GPT-2 …): a `tokenizers` BPE built
  from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, split first by the regex that
  `tokenizer.ggml.pre` names (the table `PRE_TOKENIZERS`; an unknown name falls back to GPT-2's
  regex with a warning), decoded with the byte-level decoder.
* `tokenizer.ggml.model = "llama"` (SentencePiece BPE: Llama 2, Mistral …): a BPE with byte fallback
  whose merges come from the scores (a merge's rank is its result's score, as llama.cpp ranks them),
  `▁` for spaces.
* Any other vocabulary type is refused with a message naming it.

Tokens of type CONTROL are special added tokens (matched whole in any text, skipped when decoding
for output); USER_DEFINED tokens are matched whole but printed.

The chat template is `tokenizer.chat_template`, rendered by jinja2 in a sandbox with what Hugging
Face templates expect (`raise_exception`, `strftime_now`, `tojson`, `bos_token`, `eos_token`,
`add_generation_prompt`; strata_dist/gguf_file/template_sandbox.py). A file without one gets ChatML, the
format of the Qwen family.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .reader import GGUFError, GGUFModel
from .template_sandbox import TemplateError, compile_template, render_template

log = logging.getLogger("strata.tokenizer")

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = None   # the byte-level pre-tokenizer's own regex

# tokenizer.ggml.pre -> split regex (names as llama.cpp's convert_hf_to_gguf.py writes them)
PRE_TOKENIZERS: dict[str, str | None] = {
    "qwen2": _QWEN2, "qwen35": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "llama3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
    "gpt2": _GPT2, "default": _GPT2, "gpt-2": _GPT2, "olmo": _GPT2, "phi-2": _GPT2,
    "jina-es": _GPT2, "jina-de": _GPT2, "stablelm2": _GPT2, "mpt": _GPT2, "starcoder": _GPT2,
    "refact": _GPT2, "codeshell": _GPT2, "smollm": _GPT2,
}

# A ChatML template (the Qwen family's format), for files that carry none.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TokenizerError(ValueError):
    """A GGUF whose tokenizer cannot be built; the message names the file and the key."""


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    eot: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool


class GGUFTokenizer:
    """Encode, decode and render chat prompts exactly as the model file says."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[str], types: list[int],
                 special: SpecialIds, chat_template: str | None, kind: str, pre: str | None,
                 source: str = ""):
        self.tk = tokenizer
        self.tokens = tokens
        self.types = types
        self.special = special
        self.chat_template_source = chat_template
        self.kind, self.pre, self.source = kind, pre, source

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, model: GGUFModel | str | os.PathLike) -> "GGUFTokenizer":
        g = model if isinstance(model, GGUFModel) else GGUFModel(model)
        kind = g.metadata("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError(f"{g.path}: no tokenizer in the file (metadata key "
                                 "'tokenizer.ggml.model' is missing)")
        tokens = g.metadata_array("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{g.path}: tokenizer.ggml.tokens is missing or empty")
        types = g.metadata_array("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TokenizerError(f"{g.path}: tokenizer.ggml.token_type has {len(types)} entries "
                                 f"for {len(tokens)} tokens")

        def ident(key: str) -> int | None:
            v = g.metadata(f"tokenizer.ggml.{key}")
            if v is None:
                return None
            v = int(v)
            if not 0 <= v < len(tokens):
                raise TokenizerError(f"{g.path}: tokenizer.ggml.{key} = {v} is outside the "
                                     f"vocabulary [0, {len(tokens)})")
            return v

        pre = g.metadata("tokenizer.ggml.pre")
        if kind == "gpt2":
            merges = g.metadata_array("tokenizer.ggml.merges")
            if not merges:
                raise TokenizerError(f"{g.path}: a gpt2 (byte-level BPE) vocabulary needs "
                                     "tokenizer.ggml.merges, which is missing or empty")
            tk = _byte_level_bpe(tokens, merges, pre)
            add_bos_default = False
        elif kind == "llama":
            scores = g.metadata_array("tokenizer.ggml.scores")
            if not scores or len(scores) != len(tokens):
                raise TokenizerError(f"{g.path}: a llama (SentencePiece) vocabulary needs "
                                     "tokenizer.ggml.scores, one per token")
            unk = ident("unknown_token_id")
            tk = _sentencepiece_bpe(tokens, scores, types, unk,
                                    bool(g.metadata("tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True
        else:
            raise TokenizerError(f"{g.path}: tokenizer.ggml.model '{kind}' is not supported "
                                 "(supported: gpt2 byte-level BPE, llama SentencePiece BPE)")
        _add_specials(tk, tokens, types)
        special = SpecialIds(bos=ident("bos_token_id"), eos=ident("eos_token_id"),
                             eot=ident("eot_token_id"), pad=ident("padding_token_id"),
                             add_bos=bool(g.metadata("tokenizer.ggml.add_bos_token", add_bos_default)),
                             add_eos=bool(g.metadata("tokenizer.ggml.add_eos_token", False)))
        return cls(tk, tokens, [int(t) for t in types], special, g.metadata("tokenizer.chat_template"),
                   kind, pre, g.path)

    # ---- encode / decode ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings in it (`<|im_start|>`) become their ids;
        `add_special` adds BOS/EOS where the file asks for them. TextError when `text` is not
        valid Unicode (a lone surrogate: JSON's "\\ud800", or bytes that are not UTF-8 in argv)."""
        check_text(text)
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special:
            s = self.special
            if s.add_bos and s.bos is not None and (not ids or ids[0] != s.bos):
                ids = [s.bos] + ids
            if s.add_eos and s.eos is not None:
                ids = ids + [s.eos]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    @cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation: end-of-sequence and end-of-turn."""
        return tuple(sorted({i for i in (self.special.eos, self.special.eot) if i is not None}))

    def token_text(self, i: int) -> str:
        return self.tokens[i]

    # ---- chat ------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        return self.chat_template_source or CHATML_TEMPLATE

    @property
    def has_own_template(self) -> bool:
        return bool(self.chat_template_source)

    @cached_property
    def compiled_template(self):
        return compile_template(self.chat_template)

    def chat_context(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list | None = None, extra: dict | None = None) -> dict:
        """What the template sees: `extra` (chat_template_kwargs), then the names it may not set."""
        s = self.special
        ctx = dict(extra or {})
        ctx.update(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                   bos_token=self.tokens[s.bos] if s.bos is not None else "",
                   eos_token=self.tokens[s.eos] if s.eos is not None else "")
        return ctx

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs: Any) -> str:
        """The template's text, rendered in this process (the HTTP server renders in a bounded
        child instead: strata_dist/server/templates.py)."""
        return render_template(self.compiled_template,
                               self.chat_context(messages, add_generation_prompt, tools, kwargs))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """The chat prompt's ids: the template's text, with BOS added only if the text lacks it."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special=True)

    def incremental(self, context: Sequence[int] = ()) -> "IncrementalDecoder":
        return IncrementalDecoder(self, context)


class TextError(ValueError):
    """Text the tokenizer cannot read: not valid Unicode."""


def check_text(text: str) -> None:
    """TextError naming the first character that UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TextError(f"not valid Unicode text: a lone surrogate (U+{ord(text[e.start]):04X}) at "
                        f"character {e.start}; bytes that are not UTF-8 decode to these") from None


class IncrementalDecoder:
    """Text deltas for a stream of token ids. A delta is held back while it ends in an incomplete
    UTF-8 sequence (U+FFFD), and words are decoded with a few tokens of left context so that a
    SentencePiece leading space is kept. The concatenated deltas equal the decoded text."""

    CONTEXT = 4

    def __init__(self, tok: GGUFTokenizer, context: Sequence[int] = ()):
        self.tok = tok
        self.ids: list[int] = list(context)[-self.CONTEXT:]
        self.prefix = 0                 # decode window start
        self.read = len(self.ids)       # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read >= len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        if final:
            self.prefix = self.read = len(self.ids)
        return ""


# ---- builders ----------------------------------------------------------------------------------------

def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)   # a duplicate string keeps its first id
    return vocab


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = _vocab(tokens)
    pairs, skipped = [], []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"merge {m!r} is not two parts separated by a space")
        if a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
        else:
            skipped.append(m)
    if skipped:
        # llama.cpp loads such files (it never produces the missing token); so do we, without
        # the merges that could only produce a token the vocabulary lacks
        log.warning("%d merge(s) of tokenizer.ggml.merges use or make a token missing from the "
                    "vocabulary (first: %r); skipped", len(skipped), skipped[0])
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    name = pre or "default"
    if name not in PRE_TOKENIZERS:
        log.warning("tokenizer.ggml.pre '%s' is not known here: splitting with GPT-2's regex", name)
    regex = PRE_TOKENIZERS.get(name)
    if regex is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: int | None,
                       add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: the merge whose result scores highest goes first."""
    vocab = _vocab(tokens)
    mergeable = {t for t, ty in zip(tokens, types) if ty in (NORMAL, USER_DEFINED, UNUSED)}
    ranked = []
    for t, i in vocab.items():
        if len(t) < 2 or t not in mergeable:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), i, vocab[a], (a, b)))
    ranked.sort()
    unk_token = tokens[unk] if unk is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[r[3] for r in ranked], unk_token=unk_token,
                              fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁",
                                                prepend_scheme="first" if add_space_prefix else "never",
                                                split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def _add_specials(tk: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


# ---- chat templates ------------------------------------------------------------------------------------
# compiled and rendered in strata_dist/gguf_file/template_sandbox.py (the HTTP server renders in its child
# process, with a deadline and bounds)


def message_text(content: Any) -> str:
    """OpenAI message content (a string, or a list of parts) as the template's string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"message content part of type '{kind}' is not supported "
                                    "(text only)")
        return "".join(out)
    raise TemplateError(f"message content must be a string or a list of text parts, "
                        f"got {type(content).__name__}")


def load_tokenizer(path: str | os.PathLike) -> GGUFTokenizer:
    try:
        return GGUFTokenizer.from_gguf(path)
    except GGUFError as e:
        raise TokenizerError(str(e)) from None


__all__ = ["GGUFTokenizer", "IncrementalDecoder", "TokenizerError", "TemplateError",
           "CHATML_TEMPLATE", "PRE_TOKENIZERS", "load_tokenizer", "message_text",
           "compile_template", "render_template"]

