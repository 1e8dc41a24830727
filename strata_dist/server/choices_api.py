"""A reply's choices in the OpenAI wire format: each choice's text, finish reason and, when asked,
its logprobs (chat: `logprobs.content[...]`; completions: `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`, with echo the prompt's tokens first)."""
from __future__ import annotations

from typing import Any, Callable

from ..sampling.sampler import TokenLogprob
from ..gguf_file.tokenizer import GGUFTokenizer
from .worker import Choice, Result

MAX_CHOICES = 16               # `n`: choices per request
MAX_COMPLETION_LOGPROBS = 5    # completions' `logprobs`: alternatives per token


def token_text(tok: GGUFTokenizer, token_id: int) -> str:
    """The text of one token as it stands in the output (special tokens by their name)."""
    return tok.decode([token_id], skip_special=False)


# ---- chat ---------------------------------------------------------------------------------------------

def _chat_entry(tok: GGUFTokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(tok: GGUFTokenizer, entries: list[TokenLogprob] | None) -> dict | None:
    if entries is None:
        return None
    return {"content": [dict(_chat_entry(tok, e.token_id, e.logprob),
                             top_logprobs=[_chat_entry(tok, t, lp)
                                           for t, lp in zip(e.top_ids, e.top_logprobs)])
                        for e in entries],
            "refusal": None}


def chat_choices(tok: GGUFTokenizer, r: Result, message_of) -> list[dict]:
    """`message_of(choice)`: (the assistant message, the finish reason) of one choice."""
    out = []
    for c in r.choices:
        message, finish = message_of(c)
        out.append({"index": c.index, "message": message, "logprobs": chat_logprobs(tok, c.logprobs),
                    "finish_reason": finish, "token_ids": c.token_ids})
    return out


def chat_chunk_logprobs(tok: GGUFTokenizer, entries: list[TokenLogprob] | None) -> dict | None:
    return chat_logprobs(tok, entries)


# ---- completions --------------------------------------------------------------------------------------

def completion_logprobs(tok: GGUFTokenizer, entries: list[TokenLogprob], offset: int,
                        prompt: tuple[list[int], list[TokenLogprob]] | None = None) -> dict:
    """The legacy format. `offset`: where the first token's text starts in the reply's text;
    `prompt` (echo): the prompt's ids and the logprobs of all but its first token, listed first."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict | None] = []
    text_offset: list[int] = []

    def add(token_id: int, e: TokenLogprob | None) -> None:
        nonlocal offset
        text = token_text(tok, token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        token_logprobs.append(None if e is None else e.logprob)
        top_logprobs.append(None if e is None else
                            {token_text(tok, t): lp for t, lp in zip(e.top_ids, e.top_logprobs)})

    if prompt is not None:
        ids, entries_of_prompt = prompt
        add(ids[0], None)     # the first token has no context to be predicted from
        for t, e in zip(ids[1:], entries_of_prompt):
            add(t, e)
    for e in entries:
        add(e.token_id, e)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def completion_choices(tok: GGUFTokenizer, r: Result, prompts: list[list[int]],
                       echo_texts: list[str] | None, prompt_chars: list[int]) -> list[dict]:
    """Per prompt of the request: its ids, and with echo (`echo_texts`) its text, which each of
    its choices' text starts with; `prompt_chars`: its length in characters."""
    out = []
    for c in r.choices:
        logprobs: Any = None
        if c.logprobs is not None:
            prompt = (prompts[c.prompt], c.prompt_logprobs or []) if echo_texts is not None \
                else None
            logprobs = completion_logprobs(tok, _kept(c), 0 if prompt else prompt_chars[c.prompt],
                                           prompt)
        text = c.text if echo_texts is None else echo_texts[c.prompt] + c.text
        out.append({"index": c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "token_ids": c.token_ids})
    return out


def completion_chunk_logprobs(tok: GGUFTokenizer, entries: list[TokenLogprob] | None,
                              offset: int) -> dict | None:
    return None if entries is None else completion_logprobs(tok, entries, offset)


def _kept(c: Choice) -> list[TokenLogprob]:
    return (c.logprobs or [])[:len(c.token_ids)]


class EchoChunks:
    """A streamed completion's `echo`: each choice's prompt text comes as a chunk of its own before
    the choice's generated text, with logprobs (when asked) the prompt's tokens' as the whole
    reply lists them (the first one's null); the choice's text offsets then go on after them, as
    the whole reply's do. `parsed`: the request (openai_api.Parsed, which imports this module);
    `chunk(index, text, logprobs)` writes one chunk."""

    def __init__(self, parsed: Any, tok: GGUFTokenizer,
                 chunk: Callable[[int, str, dict | None], str]):
        self.parsed, self.tok, self.chunk = parsed, tok, chunk
        self.sent: set[int] = set()
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}   # per prompt: its first choice's
        self.starts: dict[int, int] = {}      # per choice: where its generated text's offsets start

    def prompt_read(self, index: int, entries: list[TokenLogprob] | None) -> list[str]:
        """Choice `index` read its prompt, whose tokens' logprobs are `entries`: its echo now."""
        self.prompt_logprobs[index // self.parsed.spec.n] = list(entries or [])
        return self.before(index)

    def before(self, index: int, entries: list[TokenLogprob] | None = None) -> list[str]:
        """The echo chunk of choice `index` if it has not gone yet (`entries`: the prompt's
        logprobs, where no `prompt_read` gave them)."""
        texts = self.parsed.echo_texts
        if texts is None or index in self.sent:
            return []
        self.sent.add(index)
        p = index // self.parsed.spec.n
        logprobs = None
        if self.parsed.spec.logprobs.prompt:
            ids = self.parsed.spec.prompts[p][0]
            logprobs = completion_logprobs(self.tok, [], 0,
                                           (ids, self.prompt_logprobs.get(p, entries or [])))
            self.starts[index] = sum(len(t) for t in logprobs["tokens"])
        return [self.chunk(index, texts[p], logprobs)]

    def text_start(self, index: int) -> int:
        """Where choice `index`'s generated text starts, in characters (text offsets)."""
        return self.starts.get(index, self.parsed.text_start(index))
