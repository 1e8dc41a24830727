"""Serving a launch over HTTP: the listener starts first (so /health answers 503 with the load
progress while the ranks load), then the calling thread loads the launch and becomes the worker
that owns the coordinator until Ctrl-C, SIGTERM or a dead rank."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable

from ..head.coordinator import RankFailure
from ..head.session import HeadSession
from ..gguf_file.tokenizer import GGUFTokenizer
from .app import ServerContext, create_app
from .hosts import WILDCARD_BINDS, HostCheck, default_allowed_hosts, parse_allowed_hosts
from .openai_api import Limits
from .status import is_loopback, rank_views
from .templates import TemplateRenderer
from .worker import Worker

LISTEN_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
# a connection whose request line and headers have not all arrived this long after it opened (or
# after its previous response) is closed: a client that stalls inside its headers would otherwise
# hold the connection forever (a stalled body gets 408: app.py BODY_IDLE_S)
HEADERS_S = 10.0


def header_deadline_protocol():
    """uvicorn's h11 protocol with a deadline on each request's headers. A request has begun
    once the protocol holds a new cycle; the deadline armed at the connection's start or at a
    response's end closes the connection only when no request began since."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline(self.cycle)

        def on_response_complete(self) -> None:
            finished = self.cycle      # a pipelined request may begin inside the call below
            super().on_response_complete()
            self._arm_header_deadline(finished)

        def _arm_header_deadline(self, cycle) -> None:
            self.loop.call_later(HEADERS_S, self._headers_due, cycle)

        def _headers_due(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class ServeError(ValueError):
    """A server that cannot start (the address is taken, a bad flag): exit 2."""


def listen_socket(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class HttpThread:
    """uvicorn on its own thread, on a socket bound by us (so a taken port is a clear error)."""

    def __init__(self, app, sock: socket.socket):
        import uvicorn
        self.sock = sock
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=5, timeout_graceful_shutdown=2,
                                http=header_deadline_protocol())
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)
        self.failed: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            self.failed = e

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not self.server.started:
            if self.failed is not None or not self.thread.is_alive():
                raise ServeError(f"the HTTP server did not start: {self.failed!r}")
            if time.monotonic() > deadline:
                raise ServeError(f"the HTTP server did not start within {LISTEN_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(STOP_TIMEOUT_S)
        try:
            self.sock.close()
        except OSError:
            pass


def serve_launch(launch, *, model_path: str, n_vocab: int, arch: str, n_layers: int, ctx: int,
                 host: str, port: int, api_key: str | None, queue_size: int,
                 gpu_of_rank: dict[int, int] | None = None,
                 info_lines: Callable | None = None, say=None,
                 prompt_cache_every: int | None = None,
                 relaunch: Callable | None = None, restarts: int = 0,
                 allowed_hosts: str | None = None, spec=None, parallel: int = 1) -> int:
    """Serve until interrupted. `launch` is the launcher's Launch (start(), plan, ready,
    coordinator, cfg.ranks). When a rank dies, the request in flight and the queue fail (503),
    /health answers 503 with the error, and up to `restarts` times `relaunch()` (which stops the
    old ranks) gives a fresh launch that is loaded and served; after that RankFailure propagates
    to the caller (which stops the ranks). The HTTP listener is stopped here in every case.
    `allowed_hosts`: --allowed-hosts (hosts.py; None: the listen address and localhost).
    `parallel`: --parallel, the requests served at once (a session each on every stage)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    tok = GGUFTokenizer.from_gguf(launch.gguf)
    if tok.vocab_size > n_vocab:
        raise ServeError(f"{model_path}: the tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocabulary is {n_vocab}")
    stem = os.path.basename(model_path)
    model_id = stem[:-5] if stem.endswith(".gguf") else stem
    worker = Worker(tok, ctx, n_vocab, queue_size)
    t0 = time.monotonic()
    last_line = {"text": ""}
    current = [launch]            # the launch being loaded or served (a restart replaces it)

    def loading() -> dict:
        launch = current[0]
        coord, plan = launch.coordinator, launch.plan
        ready = len(launch.ready)
        n_ranks = getattr(launch, "n_ranks", len(launch.cfg.ranks))   # known once ranks register
        phase = "starting" if coord is None else "registering" if plan is None else "loading"
        return {"phase": phase, "ranks_total": n_ranks, "ranks_ready": ready,
                "progress": round(ready / n_ranks, 3) if n_ranks else 0.0,
                "elapsed_s": round(time.monotonic() - t0, 3), "message": last_line["text"]}

    info = {"id": model_id, "path": os.path.abspath(model_path), "arch": arch, "layers": n_layers,
            "n_vocab": n_vocab, "context": ctx, "tokenizer": tok.kind, "pre_tokenizer": tok.pre,
            "chat_template": "file" if tok.has_own_template else "chatml (fallback)"}
    hosts = parse_allowed_hosts(allowed_hosts) if allowed_hosts is not None else None
    # the chat template is the model file's (`tokenizer.chat_template`, else ChatML): rendered in
    # bounded child processes (templates.py)
    renderer = TemplateRenderer(tok.chat_template)
    sctx = ServerContext(worker=worker, model_id=model_id, model_info=info, api_key=api_key,
                         loading=loading, renderer=renderer,
                         limits=Limits((model_id, stem), ctx, n_vocab, tok, renderer))
    app = create_app(sctx)
    sock = listen_socket(host, port)
    bound = sock.getsockname()
    sctx.hosts = (HostCheck(hosts) if hosts else HostCheck(
        default_allowed_hosts(host, bound[1]),
        addresses_on=bound[1] if host in WILDCARD_BINDS else None))
    shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"http://{shown_host}:{bound[1]}"
    http = HttpThread(app, sock)
    http.start()
    if not is_loopback(host) and not api_key:
        say(f"warning: --host {host} serves beyond this machine without --api-key")
    say(f"listening on {url} (loading; /health answers 503 until ready)")

    def load(launch) -> None:
        progress = _Progress(loading, say)
        echo = launch.echo

        def echo_line(line: str) -> None:
            last_line["text"] = line
            progress.write(line) if progress.bar is not None else echo(line)

        launch.echo = echo_line
        try:
            progress.start()
            plan = launch.start()
        finally:
            progress.close()
            launch.echo = echo
        sctx.set_loaded(plan, rank_views(plan, launch.coordinator.ranks, launch.ready, gpu_of_rank))
        sessions = [HeadSession(launch.coordinator, ctx, plan.prompt_chunk, n_vocab, None, session_id=i,
                                keep_conversations=any(s.conversation_bytes for s in plan.stages),
                                conversations_in_host=any(s.conversation_in == "host"
                                                          for s in plan.stages),
                                **({} if prompt_cache_every is None
                                   else {"checkpoint_every": prompt_cache_every}),
                                **({} if spec is None else {"spec": spec}))
                    for i in range(parallel)]
        if info_lines is not None:
            for line in info_lines(plan):
                say(line)
        # --parallel: while others decode, a prompt reads a chunk per decode step
        worker.attach(sessions[0], sessions[1:], prompt_budget=plan.prompt_chunk)
        say(f"ready: serving {model_id} on {url} (OpenAI API under /v1, Monitor at /, "
            f"{time.monotonic() - t0:.1f} s to load)")

    renderer.warm()
    try:
        load(launch)
        done = 0
        while True:
            try:
                worker.run()
                return 0
            except RankFailure as e:
                if relaunch is None or done >= restarts:
                    raise
                done += 1
                say(f"warning: {e}; restarting every rank ({done} of {restarts}); /health "
                    f"answers 503 with the error until they are ready")
                worker.reload()
                current[0] = relaunch()
                load(current[0])
    except BaseException as e:
        if worker.state in ("loading", "ready"):
            worker.fail(f"{type(e).__name__}: {e}" if not str(e) else str(e))
        raise
    finally:
        worker.stop()
        http.stop()
        renderer.close()


class _Progress:
    """Load progress on the console: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, loading: Callable[[], dict], say):
        self.loading, self.say = loading, say
        self.bar = None
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def start(self) -> None:
        if not sys.stderr.isatty():
            return
        from tqdm import tqdm
        st = self.loading()
        self.bar = tqdm(total=st["ranks_total"], desc="loading", unit="rank", file=sys.stderr,
                        leave=False, dynamic_ncols=True)
        self.thread = threading.Thread(target=self._poll, name="load-progress", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.wait(0.2):
            st = self.loading()
            self.bar.set_description(st["phase"])
            self.bar.n = st["ranks_ready"]
            self.bar.refresh()

    def write(self, line: str) -> None:
        from tqdm import tqdm
        tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(2.0)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
