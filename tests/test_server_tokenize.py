"""`/tokenize`, `/detokenize`, `/v1/embeddings` and the latency histograms of `/metrics`, on a real
`strata-launch --port` with a CPU rank, through httpx and the official `openai` client: texts
round-trip through the model's tokenizer, bad ids are named, the key, Host and body-size rules of
the other endpoints hold, and each histogram counts a request."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import server_fixture, tiny_model_fixture
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

pytestmark = pytest.mark.timeout(60)

KEY = "sk-tokenize-3"
TEXTS = ["Hello, world!", "  two  spaces\nand a newline\t tab", "héllo wörld — ünïcode 🙂 日本語",
         "<|im_start|>user\nhi<|im_end|>", "", "the cat sat on the mat " * 40]


model = tiny_model_fixture("tokenize")
server = server_fixture("--cpu-ranks", "1", "--vram-budget", "1G", "--max-context", "4096",
                        api_key=KEY)


def post(server, path: str, body, **kw) -> httpx.Response:
    kw.setdefault("headers", server.headers)
    return httpx.post(server.url + path, json=body, timeout=10, **kw)


def test_tokenize_then_detokenize_round_trips(server, model):
    tok = GGUFTokenizer.from_gguf(model)
    for text in TEXTS:
        for key in ("content", "prompt"):
            r = post(server, "/tokenize", {key: text})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == tok.encode(text, add_special=False)
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
            back = post(server, "/detokenize", {"tokens": body["tokens"]})
            assert back.status_code == 200, back.text
            assert back.json()["content"] == text and back.json()["prompt"] == text
    special = post(server, "/tokenize", {"content": "<|im_start|>"}).json()["tokens"]
    assert special == [tok.tokens.index("<|im_start|>")]
    for flag in ("add_special", "add_special_tokens"):
        assert post(server, "/tokenize", {"content": "hi", flag: True}).status_code == 200


def test_bad_tokenize_input_is_400_naming_it(server):
    r = post(server, "/detokenize", {"tokens": [1, 2, 512]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tokens" and "tokens[2] = 512" in err["message"] \
        and "[0, 512)" in err["message"]
    r = post(server, "/detokenize", {"tokens": [1, -1]})
    assert r.status_code == 400 and "tokens[1] = -1" in r.json()["error"]["message"]
    for body, path, param in (({"tokens": [1, "x"]}, "/detokenize", "tokens"),
                              ({"tokens": "1 2"}, "/detokenize", "tokens"),
                              ({}, "/detokenize", "tokens"),
                              ({}, "/tokenize", "content"),
                              ({"content": 5}, "/tokenize", "content"),
                              ({"prompt": "a", "add_special": "yes"}, "/tokenize", "add_special"),
                              ([1, 2], "/tokenize", None)):
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.json())
    r = post(server, "/tokenize", {"content": "x" * (4096 * 32 + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_keeps_the_key_host_and_body_rules(server):
    for path, body in (("/tokenize", {"content": "a"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, headers={}).status_code == 401
        assert post(server, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = post(server, path, body, headers=dict(server.headers, Host="evil.example"))
        assert r.status_code == 421, path
        r = httpx.post(server.url + path, content=b'{"content": "' + b"a" * (33 * 2 ** 20) + b'"}',
                       headers=dict(server.headers, **{"Content-Type": "application/json"}),
                       timeout=30)
        assert r.status_code == 413, path


def test_embeddings_are_404_with_the_reason(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="tiny", input="hello")
    assert "defines no pooling" in e.value.body["message"]
    assert post(server, "/v1/embeddings", {"input": "x"}, headers={}).status_code == 401


def histogram_counts(server) -> dict[str, float]:
    r = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        if fam.type == "histogram":
            for s in fam.samples:
                if s.name.endswith("_count"):
                    out[s.name] = s.value
                elif s.name.endswith("_bucket"):
                    out[f"{s.name}{{le={s.labels['le']}}}"] = s.value
    return out


def test_latency_histograms_count_each_request(server):
    before = histogram_counts(server)
    client = server.client()
    n = 6
    stream = client.completions.create(model="tiny", prompt="hello there", max_tokens=n,
                                       stream=True, extra_body={"ignore_eos": True})
    assert sum(len(c.choices[0].text) >= 0 for c in stream if c.choices) >= 1
    after = histogram_counts(server)
    moved = {k: after[k] - before.get(k, 0) for k in after if k.endswith("_count")}
    assert moved == {"strata_queue_wait_seconds_count": 1,
                     "strata_time_to_first_token_seconds_count": 1,
                     "strata_inter_token_latency_seconds_count": n - 1,
                     "strata_request_latency_seconds_count": 1}, moved
    # buckets from milliseconds to minutes (requests) and to seconds (tokens)
    assert "strata_request_latency_seconds_bucket{le=0.005}" in after
    assert "strata_request_latency_seconds_bucket{le=600.0}" in after
    assert "strata_inter_token_latency_seconds_bucket{le=0.001}" in after
    assert after["strata_time_to_first_token_seconds_bucket{le=+Inf}"] \
        == after["strata_time_to_first_token_seconds_count"]
