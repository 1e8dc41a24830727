"""The OpenAI wire format: request bodies checked and turned into a `GenSpec`, and the response
and stream-chunk bodies. Every refusal is an `ApiError` with OpenAI's error body."""
from __future__ import annotations

import json
import keyword
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..head.session import LogprobRequest
from ..sampling.sampler import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_K, MAX_TOP_LOGPROBS, SamplingParams
from ..gguf_file.template_sandbox import CONTEXT_NAMES, GLOBAL_NAMES, JINJA_NAMES, render_template
from ..gguf_file.tokenizer import GGUFTokenizer, TemplateError, TextError, message_text
from .structured_api import StructuredRequestError, structured_grammar
from .templates import RenderBusy, RenderUnavailable, TemplateLimit, TemplateRenderer
from .tool_grammar import forced_call_grammar
from .tools import ToolRequestError, check_message_tools, check_tools, parse_tool_text, tool_format
from .worker import GenSpec, Result
from .choices_api import (MAX_CHOICES, MAX_COMPLETION_LOGPROBS, chat_choices, completion_choices,
                          chat_chunk_logprobs, completion_chunk_logprobs)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256          # per stop string: the hold-back search per token is bounded by it
# names the renderer gives the template itself (and jinja2's own): chat_template_kwargs may not
# carry them
RESERVED_TEMPLATE_KWARGS = CONTEXT_NAMES + GLOBAL_NAMES + JINJA_NAMES
MAX_TEMPLATE_KWARGS = 64
MAX_CACHE_SALT_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# A prompt longer than (context tokens) x (the bytes of the vocabulary's longest token) cannot fit
# the context, whatever its tokens: it is refused before the tokenizer reads it (tokenizing costs
# hundreds of bytes of memory per byte of text). A vocabulary with longer tokens still counts at most
# this many bytes per token: real text averages under 8.
PROMPT_BYTES_PER_TOKEN = 32
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BATCH_PROMPTS = 64        # completions' `prompt` as a list: prompts per request


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Parsed:
    spec: GenSpec
    stream: bool
    include_usage: bool
    model: str
    parse_tools: bool = False     # the answer's <tool_call> blocks become tool_calls
    # completions, per prompt of the request: with `echo` its text, put before each of its
    # choices' text; its length in characters (where its choices' text offsets start)
    echo_texts: list[str] | None = None
    prompt_chars: list[int] = field(default_factory=list)

    def text_start(self, index: int) -> int:
        """Where choice `index`'s generated text starts, in characters (text offsets)."""
        return self.prompt_chars[index // self.spec.n] if self.prompt_chars else 0


class Limits:
    """What a request is checked against: the served model and its context; `renderer` renders
    chat prompts (child processes: templates.py)."""

    def __init__(self, model_ids: tuple[str, ...], ctx: int, n_vocab: int, tok: GGUFTokenizer,
                 renderer: TemplateRenderer | None = None):
        self.model_ids, self.ctx, self.n_vocab, self.tok = model_ids, ctx, n_vocab, tok
        self.renderer = renderer
        self.tool_format = tool_format(tok.chat_template)
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tok.tokens), default=1)
        self.bytes_per_token = max(1, min(longest, PROMPT_BYTES_PER_TOKEN))
        self.max_prompt_bytes = ctx * self.bytes_per_token

    def check_prompt_bytes(self, n_bytes: int, param: str, what: str) -> None:
        if n_bytes > self.max_prompt_bytes:
            raise ApiError(400, f"{what} is {n_bytes} bytes; this server reads at most "
                                f"{self.max_prompt_bytes} bytes of prompt text (its context of "
                                f"{self.ctx} tokens x {self.bytes_per_token} bytes per token)",
                           param=param, code="context_length_exceeded")


# ---- field readers ------------------------------------------------------------------------------------

def _bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, key: str, default=None, minimum: int | None = None,
         maximum: int | None = None):
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(key, f"'{key}' must be an integer, got {v!r}", "invalid_type")
    if minimum is not None and v < minimum:
        raise _bad(key, f"'{key}' must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise _bad(key, f"'{key}' must be <= {maximum}, got {v}")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"'{key}' must be a number, got {v!r}", "invalid_type")
    v = float(v)
    if v != v or v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(key, f"'{key}' must be in {rng}, got {v}")
    return v


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"'{key}' must be true or false, got {v!r}", "invalid_type")
    return v


def _stop_strings(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise _bad("stop", f"'stop' has {len(v)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(s == "" for s in v):
        raise _bad("stop", "'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise _bad("stop", f"'stop' strings may have at most {MAX_STOP_CHARS} characters")
    return tuple(v)


def _model(body: dict, lim: Limits) -> str:
    m = body.get("model")
    if m is None:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(m, str):
        raise _bad("model", f"'model' must be a string, got {m!r}", "invalid_type")
    if m not in lim.model_ids:
        raise ApiError(400, f"the model '{m}' does not exist here; this server serves "
                            f"'{lim.model_ids[0]}'", param="model", code="model_not_found")
    return m


def _unsupported(body: dict) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != (1 if body.get("n") is None else body.get("n")):
        raise _bad("best_of", f"'best_of' must equal 'n' (every choice is returned), got "
                              f"{best_of!r}", "unsupported_value")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "'suffix' is not supported", "unsupported_parameter")


def _sampling(body: dict, lim: "Limits") -> SamplingParams:
    temperature = _float(body, "temperature", 1.0, 0.0, 100.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, minimum=0, maximum=MAX_TOP_K)
    min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("seed", f"'seed' must be an integer, got {seed!r}", "invalid_type")
    if seed is not None and not -2 ** 63 <= seed < 2 ** 64:
        raise _bad("seed", f"'seed' {seed} is out of range")
    if seed is not None and seed < 0:
        seed = seed % 2 ** 64
    presence = _float(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY)
    frequency = _float(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY)
    repetition = _float(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                          presence_penalty=presence, frequency_penalty=frequency,
                          repetition_penalty=repetition, logit_bias=_logit_bias(body, lim))


def _logit_bias(body: dict, lim: "Limits") -> tuple[tuple[int, float], ...]:
    """`logit_bias` {"token id": bias in [-100, 100]}: added to the token's logit before sampling."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object of token id: bias", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise _bad("logit_bias", f"'logit_bias' has {len(v)} entries; at most "
                                 f"{MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12) or int(key) >= lim.n_vocab:
            raise _bad("logit_bias", f"'logit_bias' key {key[:32]!r} is not a token id in "
                                     f"[0, {lim.n_vocab})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"'logit_bias' value for {key} must be a number in "
                                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _chat_logprobs(body: dict) -> LogprobRequest:
    """Chat: `logprobs` true, with `top_logprobs` 0..20 alternatives per token."""
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top and not want:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return LogprobRequest(tokens=want, top=top)


def _completion_logprobs(body: dict) -> tuple[LogprobRequest, bool]:
    """Completions: `logprobs` 0..5 alternatives per token (null: none), `echo` the prompt (its
    tokens' logprobs too when logprobs are asked)."""
    echo = _bool(body, "echo")
    top = _int(body, "logprobs", None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    if top is None:
        return LogprobRequest(), echo
    return LogprobRequest(tokens=True, top=top, prompt=echo), echo


def _with_grammar(body: dict, lim: Limits, sampling: SamplingParams) -> SamplingParams:
    """Structured output: `response_format` / `grammar` checked (server/structured_api.py)."""
    try:
        kind, text = structured_grammar(body, lim.tok)
    except StructuredRequestError as e:
        raise _bad(e.param, str(e), e.code) from None
    return replace(sampling, grammar_kind=kind, grammar=text) if kind else sampling


def _with_tool_grammar(body: dict, grammar: str, sampling: SamplingParams) -> SamplingParams:
    """Forced tool calls: their grammar (server/tool_grammar.py) is the answer's, so a grammar of
    the request's own cannot apply beside it."""
    if not grammar:
        return sampling
    if sampling.grammar_kind:
        own = "grammar" if body.get("grammar") is not None else "response_format"
        raise _bad(own, f"'{own}' cannot apply with 'tool_choice' "
                        f"{json.dumps(body.get('tool_choice'))[:200]}: the answer is tool calls "
                        f"only, their arguments following the tools' schemas", "unsupported_value")
    return replace(sampling, grammar_kind="lark", grammar=grammar)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "'stream_options' must be an object", "invalid_type")
        include_usage = _bool(opts, "include_usage")
    return stream, include_usage


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _cache_salt(body: dict) -> str:
    """The request's own `cache_salt`: it reuses cached prompt state only from requests of the same
    salt (and the same API key: app.py adds the key)."""
    v = body.get("cache_salt")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _bad("cache_salt", f"'cache_salt' must be a string, got {type(v).__name__}",
                   "invalid_type")
    if len(v) > MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"'cache_salt' may have at most {MAX_CACHE_SALT_CHARS} characters")
    return v


def _check_prompt(ids: list[int], lim: Limits, param: str) -> None:
    if not ids:
        raise _bad(param, "the prompt is empty")
    bad = next((i for i in ids if not _is_int(i) or not 0 <= i < lim.n_vocab), None)
    if bad is not None:
        raise _bad(param, f"token id {bad!r} is outside the vocabulary [0, {lim.n_vocab})")
    if len(ids) >= lim.ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context holds "
                            f"{lim.ctx} (prompt + completion)", param=param,
                       code="context_length_exceeded")


def _max_new(body: dict, keys: tuple[str, ...], default: int | None, n_prompt: int, lim: Limits) -> int:
    value = None
    for k in keys:
        value = _int(body, k, None, minimum=0)
        if value is not None:
            break
    room = lim.ctx - n_prompt
    if value is None:
        value = room if default is None else default
    return min(value, room)


def _stop_ids(body: dict, lim: Limits) -> tuple[int, ...]:
    return () if _bool(body, "ignore_eos") else lim.tok.stop_ids


# ---- the two endpoints ---------------------------------------------------------------------------------

def _template_kwargs(body: dict) -> dict:
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
    if len(extra) > MAX_TEMPLATE_KWARGS:
        raise _bad("chat_template_kwargs", f"'chat_template_kwargs' has {len(extra)} keys; at most "
                                           f"{MAX_TEMPLATE_KWARGS} are allowed")
    taken = [k for k in RESERVED_TEMPLATE_KWARGS if k in extra]
    if taken:
        raise _bad("chat_template_kwargs", f"'chat_template_kwargs' may not set {', '.join(taken)}"
                                           f" (the server or the template language sets them)")
    for k in extra:
        if not k.isidentifier() or keyword.iskeyword(k) or k.startswith("__"):
            raise _bad("chat_template_kwargs", f"'chat_template_kwargs' key {k[:64]!r} is not a name "
                                               f"a template can read (letters, digits, _)")
    return extra


def _render(lim: Limits, context: dict, cancelled: Callable[[], bool] | None) -> str:
    """The chat prompt's text, bounded: at most the prompt bytes this server reads."""
    try:
        if lim.renderer is None:     # in this process: bounded in output, not in time
            return render_template(lim.tok.compiled_template, context, lim.max_prompt_bytes)
        return lim.renderer.render(context, lim.max_prompt_bytes, cancelled)
    except TemplateLimit as e:
        if e.kind == "output":
            raise ApiError(400, f"{e}: {lim.max_prompt_bytes} bytes (its context of {lim.ctx} "
                                f"tokens x {lim.bytes_per_token} bytes per token)", param="messages",
                           code="context_length_exceeded") from None
        raise ApiError(400, f"{e}; refused", param="messages", code="template_limit") from None
    except RenderBusy as e:     # a render takes milliseconds: a place frees within a second
        raise ApiError(429, f"the chat prompt cannot be rendered now: {e}; retry in 1 s",
                       type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except RenderUnavailable as e:
        raise ApiError(503, f"the chat prompt cannot be rendered now: {e}", type="server_error",
                       code="unavailable", headers={"Retry-After": "1"}) from None
    except TemplateError as e:
        raise _bad("messages", str(e), "invalid_messages") from None


def parse_chat(body: dict, lim: Limits, cancelled: Callable[[], bool] | None = None) -> Parsed:
    """`cancelled()` turns true when the client left: the render stops (RenderCancelled)."""
    model = _model(body, lim)
    _unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list", "invalid_type")
    clean = []
    n_bytes = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                                              f"{', '.join(ROLES)}, got {role!r}")
        try:
            content = message_text(m.get("content"))
        except TemplateError as e:
            raise _bad(f"messages[{i}].content", str(e)) from None
        n_bytes += _utf8_len(content)
        try:
            clean.append(dict(check_message_tools(i, m), role=role, content=content))
        except ToolRequestError as e:
            raise _bad(e.param, str(e), e.code) from None
    try:
        use = check_tools(body, lim.tool_format)
        tool_grammar = forced_call_grammar(use, lim.tok)
    except ToolRequestError as e:
        raise _bad(e.param, str(e), e.code) from None
    tools = use.tools
    extra = _template_kwargs(body)
    # the rest the template may write out: the messages' other fields, the tools, the kwargs
    try:
        rest = json.dumps([[{k: v for k, v in m.items() if k != "content"} for m in messages],
                           tools, extra], ensure_ascii=False)
    except (ValueError, RecursionError):
        raise _bad("messages", "the chat is nested too deeply") from None
    n_bytes += _utf8_len(rest)
    lim.check_prompt_bytes(n_bytes, "messages", "the chat's text")
    sampling = _with_tool_grammar(body, tool_grammar, _with_grammar(body, lim, _sampling(body, lim)))
    stream, include_usage = _stream(body)
    stops = _stop_strings(body)
    if stops and tool_grammar:
        # the call's own text holds newlines, braces and quotes: a stop string would cut it
        raise _bad("stop", "'stop' cannot be set with a forced tool call (tool_choice "
                   "'required' or a named function): it would cut the call", "unsupported_parameter")
    salt = _cache_salt(body)
    if body.get("echo") not in (None, False):
        raise _bad("echo", "'echo' is for /v1/completions; a chat reply has no prompt text",
                   "unsupported_parameter")
    logprobs = _chat_logprobs(body)
    n = _int(body, "n", 1, minimum=1, maximum=MAX_CHOICES)
    if n > 1 and use.parse:
        raise _bad("n", f"'n' must be 1 with 'tools' (got {n})", "unsupported_value")
    text = _render(lim, lim.tok.chat_context(clean, True, tools, extra), cancelled)
    lim.check_prompt_bytes(_utf8_len(text), "messages", "the chat prompt")
    try:
        ids = lim.tok.encode(text, add_special=True)
    except TextError as e:
        raise _bad("messages", f"the chat is {e}", "invalid_value") from None
    _check_prompt(ids, lim, "messages")
    max_new = _max_new(body, ("max_completion_tokens", "max_tokens"), None, len(ids), lim)
    spec = GenSpec(prompt_ids=ids, max_new=max_new, params=sampling, stop_ids=_stop_ids(body, lim),
                   stop_strings=stops, detok_context=_context(ids, lim),
                   cache_prompt=_bool(body, "cache_prompt", True), cache_salt=salt, n=n,
                   logprobs=logprobs)
    return Parsed(spec, stream, include_usage, model, use.parse)


def parse_completion(body: dict, lim: Limits,
                     cancelled: Callable[[], bool] | None = None) -> Parsed:
    model = _model(body, lim)
    _unsupported(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    batch = prompt if isinstance(prompt, list) and prompt and \
        all(isinstance(p, (str, list)) for p in prompt) else [prompt]
    if len(batch) > MAX_BATCH_PROMPTS:
        raise _bad("prompt", f"'prompt' is a batch of {len(batch)}; at most {MAX_BATCH_PROMPTS} "
                             f"prompts are allowed")
    params = ["prompt"] if len(batch) == 1 else [f"prompt[{i}]" for i in range(len(batch))]
    prompts = [_prompt_ids(p, lim, param) for p, param in zip(batch, params)]
    sampling = _with_grammar(body, lim, _sampling(body, lim))
    stream, include_usage = _stream(body)
    stops = _stop_strings(body)
    salt = _cache_salt(body)
    logprobs, echo = _completion_logprobs(body)
    n = _int(body, "n", 1, minimum=1, maximum=MAX_CHOICES)
    for ids, param in zip(prompts, params):
        _check_prompt(ids, lim, param)
    max_new = _max_new(body, ("max_tokens",), 16, min(len(ids) for ids in prompts), lim)
    spec = GenSpec(prompt_ids=prompts[0], max_new=max_new, params=sampling,
                   stop_ids=_stop_ids(body, lim), stop_strings=stops,
                   detok_context=_context(prompts[0], lim),
                   cache_prompt=_bool(body, "cache_prompt", True), cache_salt=salt, n=n,
                   logprobs=logprobs, later_prompts=[(ids, _context(ids, lim)) for ids in prompts[1:]])
    texts = [p if isinstance(p, str) else lim.tok.decode(ids, skip_special=False)
             if echo or logprobs.tokens else "" for p, ids in zip(batch, prompts)]
    return Parsed(spec, stream, include_usage, model, echo_texts=texts if echo else None,
                  prompt_chars=[len(t) for t in texts])


def _prompt_ids(prompt: Any, lim: Limits, param: str) -> list[int]:
    """One prompt: text (tokenized with the model's special tokens) or a list of token ids."""
    if isinstance(prompt, str):
        lim.check_prompt_bytes(_utf8_len(prompt), param, f"'{param}'")
        try:
            return lim.tok.encode(prompt, add_special=True)
        except TextError as e:
            raise _bad(param, f"'{param}' is {e}", "invalid_value") from None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise _bad(param, f"'{param}' must be a string or a list of token ids", "invalid_type")


def _context(ids: list[int], lim: Limits) -> tuple[int, ...]:
    # A SentencePiece word's leading space shows only after a token to its left.
    return tuple(ids[-4:]) if lim.tok.kind == "llama" else ()


# ---- responses -----------------------------------------------------------------------------------------

def usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.reused},
            # speculative decoding (--spec): the drafts verified, accepted or not
            "completion_tokens_details": {"accepted_prediction_tokens": r.accepted,
                                          "rejected_prediction_tokens": r.drafted - r.accepted}}


def chat_response(job_id: str, created: int, r: Result, parsed: Parsed,
                  tok: GGUFTokenizer) -> dict:
    def message_of(c) -> tuple[dict, str]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if parsed.parse_tools:
            content, calls = parse_tool_text(c.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = tool_finish(finish)
        return message, finish

    return {"id": f"chatcmpl-{job_id}", "object": "chat.completion", "created": created,
            "model": parsed.model, "system_fingerprint": None,
            "choices": chat_choices(tok, r, message_of),
            "usage": usage(r), "timings": r.timings()}


def tool_finish(finish_reason: str) -> str:
    """An answer that called tools ends with "tool_calls" (one cut by max_tokens stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def completion_response(job_id: str, created: int, r: Result, parsed: Parsed,
                        tok: GGUFTokenizer) -> dict:
    return {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created,
            "model": parsed.model, "system_fingerprint": None,
            "choices": completion_choices(tok, r, [ids for ids, _ in parsed.spec.prompts],
                                          parsed.echo_texts, parsed.prompt_chars),
            "usage": usage(r), "timings": r.timings()}


def chat_chunk(job_id: str, model: str, created: int, delta: dict, finish: str | None = None,
               token_ids: list[int] | None = None, usage_value: dict | None = None,
               empty: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    choices = [] if empty else [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish, "token_ids": token_ids or []}]
    out = {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk", "created": created,
           "model": model, "system_fingerprint": None, "choices": choices}
    if usage_value is not None:
        out["usage"] = usage_value
    return out


def completion_chunk(job_id: str, model: str, created: int, text: str, finish: str | None = None,
                     token_ids: list[int] | None = None, usage_value: dict | None = None,
                     empty: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    choices = [] if empty else [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish, "token_ids": token_ids or []}]
    out = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None, "choices": choices}
    if usage_value is not None:
        out["usage"] = usage_value
    return out


def chunk_logprobs(kind: str, tok: GGUFTokenizer, entries, offset: int) -> dict | None:
    """A streamed delta's logprobs (`offset`: where its text starts in its choice's text)."""
    if kind == "chat":
        return chat_chunk_logprobs(tok, entries)
    return completion_chunk_logprobs(tok, entries, offset)


def now() -> int:
    return int(time.time())
