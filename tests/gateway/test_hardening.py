"""Hardening of the gateway's HTTP API, against a FAKE verifier (tests/support/fakes.py):

- a body sent as text/plain, a form or multipart (what a web page may send cross-origin without a CORS
  preflight) is a 415 on every JSON route; application/json, or no content type, is read;
- API keys on the gateway without a service token (or mutual TLS) between the services: a warning at start;
- a stream cut by a verifier failure ends every unfinished choice with finish_reason "error", then the
  error event, then [DONE] (and the official client raises);
- /tokenize takes a message's content as a list of text parts, as chat does.
"""

from __future__ import annotations

import http.client
import json

import grpc
import openai
import pytest
from structlog.testing import capture_logs

from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


def _post(address: str, path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    headers = {"Content-Type": content_type} if content_type is not None else {}
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"])
def test_simple_request_content_types_are_415(gw, fake, tok, path):
    body = json.dumps({"messages": USER, "prompt": "hi", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):  # fmt: skip
        fake.reset(script_for(tok.encode("ok")))
        status, data = _post(gw.http_address, path, body, ctype)
        assert status == 415, (ctype, data)
        assert b"application/json" in data and fake.requests == []


def test_json_and_untyped_bodies_are_read(gw, fake, tok):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for ctype in ("application/json", "application/json; charset=utf-8", None):
        fake.reset(script_for(tok.encode("ok")))
        status, data = _post(gw.http_address, "/v1/completions", body, ctype)
        assert status == 200 and json.loads(data)["choices"][0]["text"] == "ok", (ctype, data)


def test_keys_without_a_service_token_warn_at_start(fake, tokenizer_dir):
    for extra, warned in [({"api_key": "k"}, True), ({"api_key": "k", "service_token": "s"}, False), ({}, False)]:
        with capture_logs() as logs:
            running = serve_gateway(fake, tokenizer_dir, **extra)
            next(running)
            next(running, None)  # stops it
        found = [e for e in logs if e["event"] == "services_unauthenticated"]
        assert bool(found) == warned, extra
        if warned:
            assert found[0]["log_level"] == "warning" and "DDTREE_SERVICE_TOKEN" in found[0]["message"]


def _events(data: bytes) -> list:
    out = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_a_stream_cut_by_a_failure_ends_with_finish_reason_error(gw, fake, tok):
    ids = tok.encode("partial answer")
    fake.reset(script_for(ids, finish="length")[:-1], error=(grpc.StatusCode.INTERNAL, "verifier: crashed"))
    body = json.dumps({"messages": USER, "stream": True, "n": 2, "max_tokens": 20}).encode()
    status, data = _post(gw.http_address, "/v1/chat/completions", body, "application/json")
    events = _events(data)
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert "verifier: crashed" in events[-2]["error"]["message"]
    finished = {c["index"]: c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]}
    assert finished == {0: "error", 1: "error"}

    fake.reset(script_for(ids, finish="length")[:-1], error=(grpc.StatusCode.INTERNAL, "verifier: crashed"))
    client = openai_client(gw)
    seen = []
    with pytest.raises(openai.APIError, match="verifier: crashed"):
        for chunk in client.completions.create(model=MODEL, prompt="hi", stream=True, max_tokens=20):
            seen += [c.finish_reason for c in chunk.choices]
    assert seen[-1] == "error"


def test_tokenize_takes_content_parts(gw, fake, tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    ids = []
    for content in (parts, "Hello\nworld"):
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        status, data = _post(gw.http_address, "/tokenize", body, "application/json")
        assert status == 200, data
        ids.append(json.loads(data)["tokens"])
    assert ids[0] == ids[1]
