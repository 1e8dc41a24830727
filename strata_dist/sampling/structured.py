"""Structured output: a grammar that decides, token by token, which tokens the sampler may draw.

A request's grammar is a JSON schema (`response_format` json_schema / json_object) or a Lark grammar
(the `grammar` field; a GBNF text is converted to Lark first). The HTTP server checks it up front
(`check_grammar`, on its own tokenizer); the grammar's text travels to the last stage in the
request's `Sampling` (protocol/PROTOCOL.md), where a `GrammarMatcher` per request, each step:
masks the step's logits to the tokens the grammar allows (its packed bitmask, expanded where the
row is: on the card for a GPU stage), lets the sampler draw from what is left, and advances on the
drawn token. The answer ends when the grammar has nothing left to add (the matcher stops), or when
a stop token is drawn where the grammar accepts (only then does the mask allow one).

The grammar engine is llguidance: one wheel with no dependency of its own, JSON schema and Lark
grammars, and masks that take microseconds on a 152K-token vocabulary (docs/ARCHITECTURE.md,
"Structured output"). Its tokenizer is built from the model's own (strata_dist/gguf_file/tokenizer.py) once
per process and model, as building it reads the whole vocabulary.
"""
from __future__ import annotations

import json
import threading

import llguidance
import numpy as np

from ..ops import sample as sample_ops
from ..gguf_file.tokenizer import GGUFTokenizer

GRAMMAR_KINDS = ("json_schema", "lark")
# JSON with one fixed separator and no free whitespace: a grammar that allows any whitespace lets a
# model spend its whole answer on newlines (a weak or random model does), never closing the object.
# A schema's own "x-guidance" options still override these.
JSON_DEFAULTS = {"whitespace_flexible": False}
# "any JSON object", the grammar of response_format json_object
ANY_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A grammar the engine refuses, or a matcher that can go no further; the message is the
    engine's own."""


def compile_grammar(kind: str, text: str) -> str:
    """The engine's grammar for a request's `kind` ("json_schema" or "lark") and its text."""
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"the schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, got "
                               f"{type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
    if kind == "lark":
        try:
            return llguidance.grammar_from("grammar", text)   # Lark as is; GBNF converted to Lark
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
    raise GrammarError(f"grammar kind {kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")


_tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def engine_tokenizer(tok: GGUFTokenizer) -> llguidance.LLTokenizer:
    """The engine's tokenizer for the model's, built once per process and model file (building it
    reads the whole vocabulary: about 0.4 s for 152K tokens). A grammar may end where one of the
    model's stop tokens (end of sequence, end of turn) is drawn."""
    key = (str(tok.source), tok.vocab_size)
    with _tokenizers_lock:
        found = _tokenizers.get(key)
        if found is None:
            stops = list(tok.stop_ids)
            found = _tokenizers[key] = llguidance.LLTokenizer(
                tok.tk.to_str(), n_vocab=tok.vocab_size, eos_token=stops or None)
        return found


def check_grammar(kind: str, text: str, tok: GGUFTokenizer) -> None:
    """Raise GrammarError (the engine's message) if the engine refuses the grammar for this model."""
    error = llguidance.LLMatcher.validate_grammar(compile_grammar(kind, text), engine_tokenizer(tok))
    if error:
        raise GrammarError(error)


class GrammarMatcher:
    """One request's grammar on the last stage. Built for nothing: the engine's tokenizer and the
    matcher are made at the first `allowed_row`, so that any failure is the request's error."""

    def __init__(self, kind: str, text: str, tokenizer_of):
        """`tokenizer_of()` gives the model's GGUFTokenizer (read once per process)."""
        self.kind, self.text, self._tokenizer_of = kind, text, tokenizer_of
        self._matcher: llguidance.LLMatcher | None = None

    def _start(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            grammar = compile_grammar(self.kind, self.text)
            try:
                tokenizer = engine_tokenizer(self._tokenizer_of())
            except (ValueError, OSError, RuntimeError) as e:
                raise GrammarError(f"the model's tokenizer: {e}") from None
            self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            self._raise_if_failed()
        return self._matcher

    def _raise_if_failed(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar: {self._matcher.get_error()}")

    def bitmask_words(self, n_vocab: int) -> np.ndarray:
        """The grammar's allowed next tokens as the engine packs them: host uint32 words, token i
        bit i % 32 of word i // 32 (a few KiB: what a device uploads and expands,
        sample_ops.allowed_tokens). Raises GrammarError when none of a row's `n_vocab` tokens is
        allowed."""
        m = self._start()
        words = np.frombuffer(m.compute_bitmask(), dtype="<u4").astype(np.uint32)
        self._raise_if_failed()
        if not sample_ops.any_allowed(words, n_vocab):
            raise GrammarError("the grammar allows no token of this model here")
        return words

    def allowed(self, n_vocab: int) -> np.ndarray:
        """Which of a logits row's `n_vocab` tokens the grammar allows next (bool, host); a row
        longer than the vocabulary: the rest never."""
        return sample_ops.allowed_tokens(np, self.bitmask_words(n_vocab), n_vocab)

    def advance(self, token_id: int) -> bool:
        """Take the drawn token; True when the grammar is finished (it adds nothing more)."""
        m = self._start()
        if not m.consume_token(token_id):
            self._raise_if_failed()
            raise GrammarError(f"the grammar does not allow token {token_id} here")
        return m.is_stopped()


_gguf_tokenizers: dict[str, GGUFTokenizer] = {}


def model_tokenizer(gguf) -> GGUFTokenizer:
    """The model's tokenizer from its GGUF (a GGUFModel), read once per process and file."""
    key = str(gguf.path)
    with _tokenizers_lock:
        found = _gguf_tokenizers.get(key)
        if found is None:
            found = _gguf_tokenizers[key] = GGUFTokenizer.from_gguf(gguf)
        return found
