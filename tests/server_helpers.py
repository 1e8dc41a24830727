"""Driving a real `strata-launch --port 0` (real rank processes, real HTTP) from tests, and the
module fixtures the server test files share: a tiny synthetic model, a server over it, an OpenAI
client of that server and the model's tokenizer. A test file names its fixtures by assigning
them (`model = tiny_model_fixture("server")`, `server = server_fixture(*RANK_ARGS)`); each is
built once per test module, as each file's own fixtures were."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from launch_helpers import wait_or_kill

_URL_RE = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """A strata-launch HTTP server on a free port. `url` is known as soon as it listens (before
    the ranks have loaded); the constructor returns once /health answers 200, or right after
    the listen line when `wait=False` (ranks started by hand come later)."""

    def __init__(self, model: str, *args: str, api_key: str | None = None, env: dict | None = None,
                 timeout: float = 60.0, wait: bool = True, api_key_file: str | None = None):
        argv = [sys.executable, "-m", "launcher.cli", "--model", model, "--port", "0", *args]
        if api_key and api_key_file:      # the key reaches the server through a file
            with open(api_key_file, "w") as f:
                f.write(api_key + "\n")
            argv += ["--api-key-file", api_key_file]
        elif api_key:
            argv += ["--api-key", api_key]
        self.api_key, self.model = api_key, model
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=dict(os.environ, **(env or {})))
        self.stderr: list[str] = []
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        threading.Thread(target=lambda: self.proc.stdout.read(), daemon=True).start()
        self.url = self._wait_for(_URL_RE, timeout).group(1)
        if wait:
            self.wait_ready(timeout)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"strata-launch printed no {pattern.pattern!r} within {timeout} s; "
                                   f"stderr: {self.err_text()[-2000:]}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise EOFError(f"strata-launch ended (code {self.proc.poll()}); stderr: "
                               f"{self.err_text()[-2000:]}")
            m = pattern.search(line)
            if m:
                return m

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EOFError(f"strata-launch ended (code {self.proc.poll()}); stderr: "
                                   f"{self.err_text()[-2000:]}")
                if c.get(f"{self.url}/health").status_code == 200:
                    return
                time.sleep(0.05)
        raise TimeoutError(f"not ready within {timeout} s; stderr: {self.err_text()[-2000:]}")

    def err_text(self) -> str:
        return "".join(self.stderr)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", **kw)

    def close(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return wait_or_kill(self.proc, timeout)


# ---- requests the server test files share ---------------------------------------------------------
LONG = {"ignore_eos": True}              # a generation that runs until max_tokens
FRESH = {"cache_prompt": False}          # read the whole prompt (as a fresh --serve GEN does)


def long_stream(server, http: httpx.Client, max_tokens: int = 4000):
    """A streamed completion that runs to max_tokens (its prompt read whole); the response open."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True,
            **LONG, **FRESH}
    req = http.build_request("POST", f"{server.url}/v1/completions", json=body, headers=server.headers)
    return http.send(req, stream=True)


# ---- the shared module fixtures ------------------------------------------------------------------
# how a launcher may end after a terminate: on its own (0), as after Ctrl-C (130), by the signal
CLEAN_EXIT = (0, 130, -signal.SIGTERM)


def tiny_model_fixture(folder: str, popularity: str = "uniform", chat_template: str | None = None):
    """A module fixture: the path (str) of the tiny synthetic f32 model, written once under a
    fresh temporary folder named `folder`; its experts' popularity as write_synthetic takes it
    ("zipf:1.0": some experts far busier than others); `chat_template` in place of the synthetic
    tokenizer's own."""
    @pytest.fixture(scope="module")
    def model(tmp_path_factory) -> str:
        import strata_dist.synth.tokenizer as synth_tokenizer
        from strata_dist.synth import write_synthetic
        path = tmp_path_factory.mktemp(folder) / "tiny.gguf"
        with pytest.MonkeyPatch.context() as mp:
            if chat_template is not None:
                mp.setattr(synth_tokenizer, "CHAT_TEMPLATE", chat_template)
            write_synthetic(path, like="tiny", quant="f32", popularity=popularity)
        return str(path)
    return model


def server_fixture(*args: str, clean_exit: bool = False, **kw):
    """A module fixture: ServerProcess(model, *args, **kw) over the module's `model` fixture,
    ready when the first test gets it and closed after the module's last; with `clean_exit` the
    close must end the launcher cleanly (CLEAN_EXIT)."""
    @pytest.fixture(scope="module")
    def server(model):
        s = ServerProcess(model, *args, **kw)
        yield s
        code = s.close()
        if clean_exit:
            assert code in CLEAN_EXIT, s.err_text()[-2000:]
    return server


def client_fixture():
    """A module fixture: an OpenAI client of the module's `server` (no retries)."""
    @pytest.fixture(scope="module")
    def client(server):
        return server.client()
    return client


def tokenizer_fixture():
    """A module fixture: the tokenizer of the module's `model`."""
    @pytest.fixture(scope="module")
    def tok(model):
        from strata_dist.gguf_file.tokenizer import GGUFTokenizer
        return GGUFTokenizer.from_gguf(model)
    return tok


# ---- a model that calls a tool -------------------------------------------------------------------------
# A template in the tool format of Qwen3's (tools listed in the system turn, the answer's calls in
# <tool_call> blocks, tool results as <tool_response> in a user turn).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "For each call return <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
    "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}{{- '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# What the model answers to any chat: one token each (added to the vocabulary as Qwen's GGUFs add
# <tool_call>), then <|im_end|>.
TOOL_ANSWER = ("Checking.", "<tool_call>", '{"name":"get_weather",', '"arguments":{"city":"Paris"}}',
               "</tool_call>")


def write_tool_calling_model(path) -> None:
    """A tiny synthetic model whose greedy answer to every chat is TOOL_ANSWER: the layers add
    nothing to the residual stream (attention outputs and expert down-projections are zero), so
    the last position's hidden state is its token's embedding, and the output head maps each
    answer token's embedding (orthonormal ones) to the next answer token: a bigram chain started
    by the newline that ends the generation prompt. Everything else runs as on any model: the
    real ranks, sampler, detokenizer and server."""
    import gguf
    import numpy as np
    import pytest

    import strata_dist.synth.tokenizer as synth_tokenizer
    from strata_dist.synth import write_synthetic

    plain_vocab = synth_tokenizer.build_vocab

    def vocab_with_answer(n_vocab: int):
        v = plain_vocab(n_vocab)
        first = v.tokens.index("[PAD%d]" % (v.tokens.index("<|im_end|>") + 1))
        for k, text in enumerate(TOOL_ANSWER):
            v.tokens[first + k] = text
            v.token_types[first + k] = int(gguf.TokenType.USER_DEFINED)
        return v

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synth_tokenizer, "CHAT_TEMPLATE", TOOL_TEMPLATE)
        mp.setattr(synth_tokenizer, "build_vocab", vocab_with_answer)
        write_synthetic(path, like="tiny", quant="f32")
    reader = gguf.GGUFReader(str(path), "r+")
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    newline = "\u010a"      # the newline byte's character in the byte-level vocabulary
    chain = [tokens.index(newline)] + [tokens.index(t) for t in TOOL_ANSWER] \
        + [tokens.index("<|im_end|>")]
    tensors = {t.name: t.data for t in reader.tensors}
    embd, out = tensors["token_embd.weight"], tensors["output.weight"]
    basis, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((embd.shape[1], len(chain))))
    for k, tid in enumerate(chain):
        embd[tid] = basis[:, k] * 8.0
    out[:] = 0.0
    for k in range(len(chain) - 1):
        out[chain[k + 1]] = basis[:, k] * 8.0
    tensors["output_norm.weight"][:] = 1.0
    for name, data in tensors.items():
        if name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
            data[:] = 0.0
    reader.data.flush()
