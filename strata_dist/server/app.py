"""The HTTP app (Starlette on uvicorn): the OpenAI endpoints, /health, /v1/status, /metrics and
the Monitor page. Handlers never touch the coordinator: they queue a Job on the Worker and read
its events."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import openai_api as oa
from .choices_api import EchoChunks, token_text
from . import tokenize_api
from .history import StatusHistory
from .hosts import HostCheck
from .metrics import make_registry, render
from .monitor import PAGE
from .status import MemoryProbe, RankView, status_value
from .templates import RenderCancelled, TemplateRenderer
from .tools import ToolCallStream
from .worker import Job, NotReady, QueueFull, Worker

log = logging.getLogger("strata.server")

MAX_BODY_BYTES = 32 * 2 ** 20
# a request body from which nothing arrives this long is dropped (408): a client that stalls
# mid-body would otherwise hold its connection and its reader forever
BODY_IDLE_S = 10.0
DISCONNECT_POLL_S = 0.25
# Parsed JSON costs up to ~70 bytes a value (31 MiB of `[],` is 770 MB of empty lists): a body is
# refused before it is parsed past this many `,`, `[` and `{` (each value but the first comes with
# one; strings included, as counting outside them would cost a scan of its own), or 8 per context
# token where that is more (a prompt of token ids)
MIN_JSON_SEPARATORS = 65536


def json_separators(raw: bytes | bytearray) -> int:
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


@dataclass
class ServerContext:
    """Everything the handlers read. `views`/`plan` are filled in once the launch has loaded."""
    worker: Worker
    model_id: str
    model_info: dict
    api_key: str | None = None
    loading: Callable[[], dict] = lambda: {}
    plan: Any = None
    views: list[RankView] = field(default_factory=list)
    memory: MemoryProbe | None = None
    started: float = field(default_factory=time.time)
    limits: oa.Limits | None = None
    renderer: TemplateRenderer | None = None
    hosts: HostCheck = field(default_factory=lambda: HostCheck(("*",)))

    def set_loaded(self, plan, views: list[RankView]) -> None:
        self.plan, self.views = plan, views
        self.memory = MemoryProbe(views)

    def status(self) -> dict:
        snap = self.worker.snapshot()
        memory = self.memory.read(snap.get("rank_gauges")) if self.memory else {}
        loading = self.loading() if snap["state"] == "loading" else None
        value = status_value(model=self.model_info, plan=self.plan, views=self.views,
                             snapshot=snap, memory=memory, loading=loading, started=self.started,
                             recent_requests=self.worker.recent_requests())
        if self.renderer is not None:
            value["chat_templates"] = self.renderer.stats()
        return value


def _error(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(ctx: ServerContext):
    registry = make_registry(ctx.status, ctx.worker.latency)
    if not ctx.limits:
        raise ValueError("ServerContext.limits must be set")
    model_ids = ctx.limits.model_ids
    history = StatusHistory(ctx.worker, lambda: ctx.memory)   # the Monitor's charts
    history.start()

    def given_key(request: Request) -> str | None:
        given = None
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        elif request.headers.get("x-api-key"):
            given = request.headers["x-api-key"]
        elif request.url.path == "/" and request.query_params.get("api_key"):
            given = request.query_params["api_key"]
        return given

    def key_ok(request: Request) -> bool:
        if ctx.api_key is None:
            return True
        given = given_key(request)
        return given is not None and hmac.compare_digest(given.encode(), ctx.api_key.encode())

    def authorize(request: Request) -> None:
        if not key_ok(request):
            raise oa.ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                              type="authentication_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    async def json_body(request: Request) -> dict:
        too_big = oa.ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                              code="request_too_large")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_big
        # counted as it arrives: a chunked upload has no Content-Length to refuse it by
        raw = bytearray()
        chunks = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), BODY_IDLE_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise oa.ApiError(408, f"the request body stalled: nothing arrived for "
                                       f"{BODY_IDLE_S:g} s after {len(raw)} bytes",
                                  code="request_timeout") from None
            if len(raw) + len(chunk) > MAX_BODY_BYTES:
                raise too_big
            raw += chunk
        most = max(MIN_JSON_SEPARATORS, 8 * ctx.limits.ctx)
        separators = json_separators(raw)
        if separators > most:
            raise oa.ApiError(413, f"the request body holds more than {most} JSON values (it has "
                                   f"{separators} ',', '[' and '{{', strings included)",
                              code="request_too_large")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise oa.ApiError(400, "the request body is nested too deeply",
                              code="invalid_json") from None
        except ValueError as e:   # malformed JSON, bad UTF-8, an integer of thousands of digits
            raise oa.ApiError(400, f"the request body is not valid JSON: {e}",
                              code="invalid_json") from None
        if not isinstance(body, dict):
            raise oa.ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def cache_salt(request: Request, requested: str) -> str:
        """Whose cached prompt state a request may reuse: the same API key's and `cache_salt`'s
        (hashed: the worker keeps it, not the key)."""
        key = given_key(request) if ctx.api_key is not None else ""
        return hashlib.sha256(f"{key}\0{requested}".encode("utf-8", "surrogatepass")).hexdigest()

    # ---- endpoints -------------------------------------------------------------------------------
    async def health(request: Request) -> Response:
        """200 only when a request would be served now. Anyone may ask (probes send no key, nor
        always the listen address as Host); the details (load progress and launcher lines, the
        error, the queue) only a caller who may read /v1/status sees."""
        snap = ctx.worker.snapshot()
        state = snap["state"]
        error = snap.get("error")
        if state == "ready" and snap.get("lost"):
            # rejoin: a stage rank is lost; requests wait for its replacement, and fail if it
            # does not load (a replaced or damaged model file, say)
            state = "rejoining"
            error = "; ".join(f"rank {r} is lost ({why}); requests wait for its replacement"
                              for r, why in sorted(snap["lost"].items()))
        body: dict[str, Any] = {"status": state}
        if key_ok(request) and ctx.hosts.allows(request.headers.get("host")):
            if state == "loading":
                body["loading"] = ctx.loading()
            if error:
                body["error"] = error
            if state == "ready":
                body["queue"] = snap["queue"]
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [_model_card(ctx)]})

    async def model_one(request: Request) -> Response:
        authorize(request)
        mid = request.path_params["model"]
        if mid not in model_ids:
            raise oa.ApiError(404, f"the model '{mid}' does not exist", param="model",
                              code="model_not_found")
        return JSONResponse(_model_card(ctx))

    async def status(request: Request) -> Response:
        authorize(request)
        return JSONResponse(ctx.status())

    async def status_history(request: Request) -> Response:
        authorize(request)
        since = request.query_params.get("since")
        t = None
        if since is not None:
            try:
                t = float(since)
            except ValueError:
                t = math.nan
            if not math.isfinite(t):
                raise oa.ApiError(400, f"since must be a time in seconds since the epoch, got "
                                       f"{since[:100]!r}", param="since", code="invalid_value")
        return JSONResponse(history.value(t))

    async def metrics(request: Request) -> Response:
        authorize(request)
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def monitor(request: Request) -> Response:
        authorize(request)
        return HTMLResponse(PAGE)

    async def tokenize(request: Request) -> Response:
        authorize(request)
        body = await json_body(request)
        # on a worker thread: a long text takes a while to tokenize
        return JSONResponse(await run_in_threadpool(tokenize_api.tokenize, body, ctx.limits))

    async def detokenize(request: Request) -> Response:
        authorize(request)
        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(tokenize_api.detokenize, body, ctx.limits))

    async def embeddings(request: Request) -> Response:
        authorize(request)
        raise oa.ApiError(404, tokenize_api.NO_EMBEDDINGS, type="not_found",
                          code="embeddings_not_supported")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def generate(request: Request, kind: str) -> Response:
        authorize(request)
        body = await json_body(request)
        parse = oa.parse_chat if kind == "chat" else oa.parse_completion
        # tokenizing a long prompt (and rendering a chat template) on a worker thread keeps the
        # event loop answering others; a client that leaves meanwhile stops the render
        left = threading.Event()
        parsing = asyncio.ensure_future(run_in_threadpool(parse, body, ctx.limits, left.is_set))
        try:
            while True:
                done, _ = await asyncio.wait({parsing}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    left.set()
        except asyncio.CancelledError:
            left.set()
            raise
        try:
            parsed = parsing.result()
        except RenderCancelled:
            return Response(status_code=499)
        except oa.ApiError as e:
            ctx.worker.refused_before_queue(e.status)
            raise
        if left.is_set():
            return Response(status_code=499)
        parsed.spec.cache_salt = cache_salt(request, parsed.spec.cache_salt)
        events: asyncio.Queue = asyncio.Queue()
        job = Job(parsed.spec, asyncio.get_running_loop(), events)
        try:
            ctx.worker.submit(job)
        except QueueFull as e:
            wait_s = ctx.worker.retry_after_s()
            raise oa.ApiError(429, f"{e}; retry in {wait_s} s", type="rate_limit_error",
                              code="queue_full", headers={"Retry-After": str(wait_s)}) from None
        except NotReady as e:
            raise oa.ApiError(503, f"not ready: {e}", type="server_error",
                              code="unavailable") from None
        created = oa.now()
        if parsed.stream:
            return StreamingResponse(_sse(job, parsed, kind, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, job, parsed, kind, created)

    async def _collect(request: Request, job: Job, parsed: oa.Parsed, kind: str,
                       created: int) -> Response:
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() - checked >= DISCONNECT_POLL_S:   # tokens may flow without pause
                    checked = loop.time()
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)
                if ev is None or ev.kind == "delta":
                    continue
                if ev.kind == "done":
                    answer = oa.chat_response if kind == "chat" else oa.completion_response
                    return JSONResponse(answer(job.id, created, ev.result, parsed,
                                               ctx.limits.tok))
                if ev.kind == "error":
                    return _error(oa.ApiError(ev.status, ev.message,
                                              type="server_error" if ev.status >= 500
                                              else "invalid_request_error", code=ev.code))
        except asyncio.CancelledError:
            job.cancel()
            raise

    async def _sse(job: Job, parsed: oa.Parsed, kind: str, created: int):
        def line(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        model = parsed.model
        # with tools, the text goes through the tool-call parser: a chunk per delta it gives, the
        # token ids of text it holds back riding on the next chunk
        tool_stream = ToolCallStream() if parsed.parse_tools else None
        held_ids: list[int] = []
        chars: dict[int, int] = {}     # per choice: the characters of its tokens' texts so far
        echo = EchoChunks(parsed, ctx.limits.tok, lambda index, text, logprobs: line(
            oa.completion_chunk(job.id, model, created, text, index=index, logprobs=logprobs)))

        def tool_chunks(deltas: list[dict], ids: list[int]):
            held_ids.extend(ids)
            for d in deltas:
                yield line(oa.chat_chunk(job.id, model, created, d, token_ids=held_ids[:]))
                held_ids.clear()

        try:
            if kind == "chat":
                for index in range(parsed.spec.n):
                    yield line(oa.chat_chunk(job.id, model, created,
                                             {"role": "assistant", "content": ""}, index=index))
            while True:
                ev = await job.events.get()
                if ev.kind == "prompt":        # its logprobs (echo): the echoed prompt goes now
                    for chunk_line in echo.prompt_read(ev.index, ev.logprobs):
                        yield chunk_line
                elif ev.kind == "delta":
                    for chunk_line in echo.before(ev.index):
                        yield chunk_line
                    if tool_stream is not None:
                        for chunk_line in tool_chunks(tool_stream.push(ev.text), ev.token_ids):
                            yield chunk_line
                    else:
                        # offsets count each token's text, as the whole reply's do
                        # (choices_api.completion_logprobs), not the text sent so far
                        at = chars.get(ev.index, 0)
                        chars[ev.index] = at + sum(len(token_text(ctx.limits.tok, e.token_id))
                                                   for e in ev.logprobs or ())
                        logprobs = oa.chunk_logprobs(kind, ctx.limits.tok, ev.logprobs,
                                                     echo.text_start(ev.index) + at)
                        if kind == "chat":
                            yield line(oa.chat_chunk(job.id, model, created, {"content": ev.text},
                                                     token_ids=ev.token_ids, index=ev.index,
                                                     logprobs=logprobs))
                        else:
                            yield line(oa.completion_chunk(job.id, model, created, ev.text,
                                                           token_ids=ev.token_ids, index=ev.index,
                                                           logprobs=logprobs))
                elif ev.kind == "done":
                    r = ev.result
                    chunk = oa.chat_chunk if kind == "chat" else oa.completion_chunk
                    first = {} if kind == "chat" else ""
                    for c in r.choices:
                        for chunk_line in echo.before(c.index, c.prompt_logprobs):
                            yield chunk_line
                        finish = c.finish_reason
                        if tool_stream is not None:     # one choice only (openai_api: 'n')
                            for chunk_line in tool_chunks(tool_stream.finish(), []):
                                yield chunk_line
                            if tool_stream.calls:
                                finish = oa.tool_finish(finish)
                        yield line(chunk(job.id, model, created, first, finish=finish,
                                         token_ids=held_ids or None, index=c.index))
                    if parsed.include_usage:
                        yield line(chunk(job.id, model, created, first, usage_value=oa.usage(r),
                                         empty=True))
                    yield "data: [DONE]\n\n"
                    return
                elif ev.kind == "error":
                    err = oa.ApiError(ev.status, ev.message, type="server_error"
                                      if ev.status >= 500 else "invalid_request_error", code=ev.code)
                    yield line(err.body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel()   # the client left (or the stream ended: then this is a no-op)

    async def on_api_error(request: Request, exc: oa.ApiError) -> Response:
        return _error(exc)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": {"message": msg, "type": kind, "param": None,
                                       "code": str(exc.status_code)}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "param": None, "code": "internal"}},
                            status_code=500)

    routes = [
        Route("/", monitor, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_one, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/v1/status/history", status_history, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        oa.ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
    return _HostGuard(app, ctx)


class _HostGuard:
    """Requests under a Host that is not on the allow-list get 421 (DNS rebinding: hosts.py);
    /health answers anyone, with its status only."""

    def __init__(self, app, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") != "/health":
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                         if k == b"host"), None)
            if not self.ctx.hosts.allows(host):
                err = oa.ApiError(421, f"this server does not answer for Host {host[:200]!r}; it "
                                       f"answers for {self.ctx.hosts.shown} (--allowed-hosts)",
                                  code="misdirected_request")
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.model_id, "object": "model", "created": int(ctx.started),
            "owned_by": "strata-dist", "context_length": ctx.limits.ctx if ctx.limits else None,
            "meta": ctx.model_info}
