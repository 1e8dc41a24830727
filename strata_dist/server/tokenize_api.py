"""`/tokenize` and `/detokenize` with the model's own tokenizer, and why `/v1/embeddings` is absent.

Both request shapes clients send are read: `{"content": text}` and `{"prompt": text}`, and
`add_special` or `add_special_tokens`; the answers carry both names too (`tokens` with `count` and
`max_model_len`; `content` and `prompt`)."""
from __future__ import annotations

from ..gguf_file.tokenizer import TextError
from .openai_api import ApiError, Limits, _bad, _is_int, _utf8_len

# The served family (Qwen3 MoE decoders) defines no pooling of its hidden states into one vector:
# any vector this server returned would be one it made up.
NO_EMBEDDINGS = ("this server has no embeddings: the model family it serves (a decoder-only "
                 "mixture of experts) defines no pooling of its hidden states into an embedding")


def tokenize(body: dict, lim: Limits) -> dict:
    key = "content" if "content" in body else "prompt"
    text = body.get(key)
    if text is None:
        raise ApiError(400, "'content' (or 'prompt') is required", param="content",
                       code="missing_required_parameter")
    if not isinstance(text, str):
        raise _bad(key, f"'{key}' must be a string, got {type(text).__name__}", "invalid_type")
    add_key = "add_special" if "add_special" in body else "add_special_tokens"
    add_special = body.get(add_key, False)
    if not isinstance(add_special, bool):
        raise _bad(add_key, f"'{add_key}' must be true or false, got {add_special!r}",
                   "invalid_type")
    # tokenizing costs hundreds of bytes of memory per byte of text: the prompt bound applies
    lim.check_prompt_bytes(_utf8_len(text), key, f"'{key}'")
    try:
        ids = lim.tok.encode(text, add_special=add_special)
    except TextError as e:
        raise _bad(key, f"'{key}' is {e}") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": lim.ctx}


def detokenize(body: dict, lim: Limits) -> dict:
    ids = body.get("tokens")
    if ids is None:
        raise ApiError(400, "'tokens' is required", param="tokens",
                       code="missing_required_parameter")
    if not isinstance(ids, list):
        raise _bad("tokens", f"'tokens' must be a list of token ids, got {type(ids).__name__}",
                   "invalid_type")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise _bad("tokens", f"tokens[{i}] must be an integer token id, got {t!r}",
                       "invalid_type")
        if not 0 <= t < lim.n_vocab:
            raise _bad("tokens", f"tokens[{i}] = {t} is outside the vocabulary [0, {lim.n_vocab})")
    # special tokens' text included: the text tokenizes back to the same ids
    text = lim.tok.decode(ids, skip_special=False)
    return {"content": text, "prompt": text}
