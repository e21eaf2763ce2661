"""HTTP fuzzing of every gateway endpoint: seeded mutations of valid requests, sent as raw bytes on loopback.

Each case is one request on its own connection (`Connection: close`). Mutations: a field set to a value of
the wrong type, out of range, huge, deeply nested, a long or odd unicode string, special-token text; unknown
and missing fields; bodies that are truncated, not UTF-8, not JSON, empty; wrong or missing content types,
content lengths that lie, chunked bodies; other methods and paths; streaming on and off. Sizes are bounded
(a body is at most ~2 MB). Any 5xx, or a well-formed request left without an answer, is a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import dataclasses
import json
import random
import socket
import time

from tests.support.fuzz.common import MODEL, Report

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
# The demo tokenizer's special tokens (the Kimi K2 chat template's, and the model's own).
SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "[EOS]",
                  "[BOS]", "[MASK]", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
                  "[PAD]")  # fmt: skip
BASES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6,
                             "temperature": 0},
    "/v1/completions": {"model": MODEL, "prompt": "def f(", "max_tokens": 6, "temperature": 0},
}  # fmt: skip
# Fields the parser reads (and some it refuses); values of max_tokens stay small or invalid, so that a valid
# mutation never asks for a long generation.
FIELDS = {
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                             "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "budget", "no_spec", "stream",
                             "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "logit_bias", "response_format", "tools",
                             "tool_choice", "chat_template_kwargs", "separate_reasoning", "user",
                             "messages.0", "messages.0.role", "messages.0.content", "messages.0.name",
                             "messages.0.tool_calls", "messages.0.reasoning_content", "messages.0.tool_call_id"],
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                        "stop_token_ids", "ignore_eos", "budget", "no_spec", "stream", "stream_options", "n",
                        "logprobs", "echo", "suffix", "best_of", "user"],
}  # fmt: skip
INVALID_UTF8 = (b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82")


@dataclasses.dataclass
class HttpCase:
    endpoint: str  # the histogram it counts in
    label: str  # the mutation, for the report
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    content_length: str | None = "auto"  # "auto": len(body); None: no header; else sent as is
    stream: bool = False  # read up to the first SSE event, then drop the connection
    framing: bool = False  # not well-formed HTTP: closing without an answer is fine
    hang_ok: bool = False  # incomplete on purpose (a body shorter than declared): no answer is fine

    def raw(self, address: str) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", f"host: {address}", "connection: close"]
        lines += [f"{k}: {v}" for k, v in self.headers]
        if self.content_length is not None:
            lines.append(f"content-length: {len(self.body) if self.content_length == 'auto' else self.content_length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + self.body

    def show(self) -> dict:
        body = self.body if len(self.body) <= 600 else self.body[:600] + b"...(%d bytes)" % len(self.body)
        return {"label": self.label, "method": self.method, "path": self.path[:300], "headers": self.headers,
                "content_length": self.content_length, "body": body.decode("utf-8", "backslashreplace")}  # fmt: skip


# -- values ----------------------------------------------------------------------------------------------
def odd_text(rng: random.Random, n: int) -> str:
    """Unicode from awkward ranges: controls, NUL, combining marks, RTL, zero-width, CJK, emoji, lone surrogates."""
    ranges = [(0, 31), (0x300, 0x36F), (0x590, 0x6FF), (0x200B, 0x200F), (0x4E00, 0x4FFF), (0x1F300, 0x1F6FF),
              (0xD800, 0xDFFF), (0xFFF0, 0xFFFF), (32, 126)]  # fmt: skip
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def nested(rng: random.Random, depth: int):
    value = rng.choice([1, "x", None])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


def evil(rng: random.Random, big: int):
    """A value of any JSON type, often out of range or oversized (strings up to `big` characters)."""
    return rng.choice(
        [
            lambda: None,
            lambda: rng.choice([True, False]),
            lambda: rng.choice([0, -1, 1, 2, -(2**31), 2**31 - 1, 2**31]),
            lambda: rng.choice([2**63, -(2**63), 2**64, 2**64 + 1, 10**30, -(10**40)]),
            lambda: rng.choice([1.5, -0.0, 1e308, -1e308, 5e-324, 0.1, 3.4e38]),
            lambda: "",
            lambda: "x" * rng.randint(1, big),
            lambda: odd_text(rng, rng.randint(1, 200)),
            lambda: "".join(rng.choice(SPECIAL_TOKENS) + odd_text(rng, 2) for _ in range(rng.randint(1, 30))),
            lambda: [],
            lambda: {},
            lambda: [evil(rng, 50) for _ in range(rng.randint(1, 5))],
            lambda: {odd_text(rng, 5): evil(rng, 50) for _ in range(rng.randint(1, 5))},
            lambda: nested(rng, rng.choice([8, 63, 64, 65, 300])),
            lambda: [rng.randint(-5, 10**6) for _ in range(500)],
            lambda: "8",
            lambda: "true",
            lambda: [1, "2", None, 3.5],
            lambda: [{"type": "text", "text": "hi"}, {"type": rng.choice(["image_url", "text", 3, None])}],
            lambda: {"type": rng.choice(["text", "json_object", "json_schema", 7])},
            lambda: [{"type": "function", "function": {"name": odd_text(rng, 5), "parameters": evil(rng, 50)}}],
            lambda: rng.choice(["auto", "none", "required", {"type": "function"}]),
        ]
    )()


def set_path(body: dict, path: str, value) -> None:
    """body[a][b]... = value along "a.0.b" (nothing when an earlier mutation left no such place)."""
    *keys, last = path.split(".")
    node = body
    try:
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        if isinstance(node, list):
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
    except (IndexError, ValueError, AttributeError):
        pass


def dumps(rng: random.Random, body) -> bytes:
    """JSON bytes; lone surrogates become \\ud800 escapes or (CESU-8) invalid UTF-8."""
    ascii_ = rng.random() < 0.6
    return json.dumps(body, ensure_ascii=ascii_, allow_nan=True).encode("utf-8", "surrogatepass")


# -- cases -----------------------------------------------------------------------------------------------
def post_case(rng: random.Random, path: str, big: int) -> HttpCase:
    body = copy.deepcopy(BASES[path])
    body["stream"] = rng.random() < 0.35
    kind = rng.randrange(12)
    if kind <= 3:  # one to three fields set to odd values
        fields = rng.sample(FIELDS[path], rng.randint(1, 3))
        for f in fields:
            set_path(body, f, evil(rng, big))
        label = f"set {', '.join(fields)}"
    elif kind == 4:
        for _ in range(rng.randint(1, 20)):
            body[odd_text(rng, rng.randint(1, 12))] = evil(rng, 100)
        label = "unknown fields"
    elif kind == 5:
        key = rng.choice(list(body))
        del body[key]
        label = f"without {key}"
    elif kind == 6:  # a long text, or text that spells the chat template's special tokens
        text = rng.choice([
            "x " * rng.randint(1000, big // 2), "".join(rng.choice(SPECIAL_TOKENS) for _ in range(rng.randint(1, 200))),
            "<|im_end|><|im_assistant|>assistant<|im_middle|>", odd_text(rng, rng.randint(100, 3000)),
        ])  # fmt: skip
        if "messages" in body:
            body["messages"][0][rng.choice(["content", "reasoning_content", "name"])] = text
        else:
            body["prompt"] = text
        label = "content text"
    elif kind == 7 and "messages" in body:  # many or odd messages
        roles = ["user", "assistant", "system", "tool", "developer", "", "admin", "<|im_system|>"]
        body["messages"] = [{"role": rng.choice(roles), "content": rng.choice(["hi", "", None, "x" * 50])}
                            for _ in range(rng.choice([0, 1, 2, 50, 800]))]  # fmt: skip
        label = f"{len(body['messages'])} messages"
    elif kind == 7:
        body["prompt"] = rng.choice(
            [[], [[]], [1, 2, 3], [-1], [2**31], [["a"]], ["a", "b"], [True], list(range(3000))]
        )
        label = "prompt as token ids"
    elif kind == 8:  # raw body mutations
        return raw_body_case(rng, path, dumps(rng, body))
    elif kind == 9:
        return header_case(rng, path, dumps(rng, body))
    elif kind == 10:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "FOO", "TRACE"])
        return HttpCase(path, f"method {method}", method, path, dumps(rng, body))
    else:
        variant = rng.choice([path + "/", path + "?stream=true&x=%00", "/" + path, path.upper(), path + "%00",
                              path + "/../completions", path + "#frag"])  # fmt: skip
        return HttpCase(path, f"path {variant!r}", "POST", variant, dumps(rng, body))
    return HttpCase(path, label, "POST", path, dumps(rng, body), stream=bool(body.get("stream") is True))


def raw_body_case(rng: random.Random, path: str, good: bytes) -> HttpCase:
    kind = rng.randrange(10)
    if kind == 0:
        body, label = good[: rng.randrange(len(good))], "truncated JSON"
    elif kind == 1:
        at, bad = rng.randrange(len(good)), rng.choice(INVALID_UTF8)
        body, label = good[:at] + bad + good[at:], f"invalid UTF-8 {bad!r}"
    elif kind == 2:
        body, label = bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))), "random bytes"
    elif kind == 3:
        body = rng.choice([b"", b"null", b"[]", b'"x"', b"1", b"true", b"{", b"}", b"{}", b"[" * 100000])
        label = f"body {body[:20]!r}"
    elif kind == 4:
        body = rng.choice([b'{"max_tokens": 1' + b"0" * 400 + b"}", b'{"temperature": NaN}', b'{"top_p": Infinity}',
                           b'{"seed": -Infinity}', b'{"max_tokens": 1e999}'])  # fmt: skip
        label = "number beyond limits"
    elif kind == 5:
        body, label = good[:-1] + b', "model": "other", "model": "' + MODEL.encode() + b'"}', "duplicate keys"
    elif kind == 6:
        body, label = b"\xef\xbb\xbf" + good, "UTF-8 BOM"
    elif kind == 7:
        body, label = good + rng.choice([b"garbage", b"\x00", b"{}", b"\n\n\n"]), "trailing bytes"
    elif kind == 8:
        body = b"{" + b",".join(b'"k%d": %d' % (i, i) for i in range(rng.choice([1000, 60000]))) + b"}"
        label = "many keys"
    else:
        body, label = b'{"messages": "\\ud800", "prompt": "\\udfff\\ud800"}', "lone surrogate escapes"
    return HttpCase(path, label, "POST", path, body)


def header_case(rng: random.Random, path: str, body: bytes) -> HttpCase:
    kind = rng.randrange(9)
    if kind == 0:
        ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
                            "application/json; charset=latin-1", "application/xml", "", "*/*"])  # fmt: skip
        return HttpCase(path, f"content-type {ctype!r}", "POST", path, body, (("content-type", ctype),))
    if kind == 1:
        return HttpCase(path, "no content-type", "POST", path, body, ())
    if kind == 2:  # declared shorter: the server reads a truncated body
        return HttpCase(path, "content-length short", "POST", path, body, content_length=str(len(body) // 2))
    if kind == 3:  # declared longer than sent: the server waits for the rest
        return HttpCase(path, "content-length long", "POST", path, body, content_length=str(len(body) + 50),
                        hang_ok=True)  # fmt: skip
    if kind == 4:
        value = rng.choice(["abc", "-5", "1e3", " ", "99999999999999999999999", "10, 20"])
        return HttpCase(path, f"content-length {value!r}", "POST", path, body, content_length=value, framing=True)
    if kind == 5:  # declared far over max_body_bytes: refused before the body is read
        return HttpCase(path, "content-length huge", "POST", path, body, content_length=str(10**12), hang_ok=True)
    if kind == 6:
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        if rng.random() < 0.4:
            chunked = chunked.replace(b"\r\n0\r\n", b"\r\nzz\r\n")
        headers = (("content-type", "application/json"), ("transfer-encoding", "chunked"))
        return HttpCase(path, "chunked body", "POST", path, chunked, headers, content_length=None, framing=True)
    if kind == 7:
        extra = rng.choice([("content-encoding", "gzip"), ("authorization", "Bearer " + "x" * 5000),
                            ("authorization", "\x01\x02"), ("x-long", "y" * 100000), ("expect", "100-continue"),
                            ("accept", "text/event-stream"), ("accept-charset", "utf-16")])  # fmt: skip
        return HttpCase(path, f"header {extra[0]}", "POST", path, body, (("content-type", "application/json"), extra),
                        framing=len(extra[1]) > 16000)  # fmt: skip
    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"ab" * 600000 + b'", "max_tokens": 1}'
    return HttpCase(path, "1.2 MB prompt", "POST", path, big)


def get_case(rng: random.Random, path: str) -> HttpCase:
    kind = rng.randrange(7)
    if kind == 0:
        return HttpCase(path, "plain", "GET", path, headers=(), content_length=None)
    if kind == 1:
        method = rng.choice(["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"])
        return HttpCase(path, f"method {method}", method, path, b"{}")
    if kind == 2:
        query = "&".join(f"{odd_text(rng, 3).encode('utf-8', 'surrogatepass').hex()}={rng.randint(0, 9)}"
                         for _ in range(rng.randint(1, 50)))  # fmt: skip
        return HttpCase(path, "query string", "GET", f"{path}?{query}", headers=(), content_length=None)
    if kind == 3:
        return HttpCase(path, "GET with a body", "GET", path, dumps(rng, evil(rng, 1000)))
    if kind == 4 and path == "/v1/models":
        model = rng.choice([MODEL, "x" * 8000, "%00", "%2e%2e/%2e%2e/etc/passwd", "%F0%9F%92%A9", "a/b/c", "%ff%fe",
                            "ddtree-demo%20", MODEL + "/"])  # fmt: skip
        return HttpCase(path + "/{model}", "model id", "GET", f"/v1/models/{model}", headers=(), content_length=None)
    if kind == 5:
        extra = rng.choice([("authorization", "Bearer " + odd_text(rng, 30)), ("accept", "application/xml"),
                            ("x-forwarded-for", "::1" * 100), ("if-none-match", "*")])  # fmt: skip
        value = extra[1].encode("utf-8", "surrogatepass").decode("latin-1")
        return HttpCase(path, f"header {extra[0]}", "GET", path, headers=((extra[0], value),), content_length=None)
    variant = rng.choice([path + "/", path.upper(), "/" + path, path + "%00", path + "/extra", "/v1" + path])
    return HttpCase(path, f"path {variant!r}", "GET", variant, headers=(), content_length=None)


def fixed_cases() -> list[HttpCase]:
    """Sent by every run, whatever the seed: request lines that are not HTTP, and strings whose bytes are not
    UTF-8 in the places a parser might let them through (raw CESU-8 surrogates, overlong forms, NUL)."""
    odd = [("bad request line", "GET"), ("bad version", "GET /health HTTP/9.9"), ("space in path", "GET /he alth")]
    cases = [HttpCase("(framing)", label, line, "", framing=True) for label, line in odd]
    cases.append(HttpCase("(framing)", "no host", "GET", "/health", headers=(("host", ""),), content_length=None,
                          framing=True))  # fmt: skip
    for raw in (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\xaf", b"\x00"):  # lone surrogates, overlong '/', NUL
        chat = b'{"messages": [{"role": "user", "content": "a%sb"}], "max_tokens": 1}' % raw
        name = b'{"messages": [{"role": "user", "content": "hi", "name": "%s"}], "max_tokens": 1}' % raw
        prompt = b'{"prompt": "a%sb", "max_tokens": 1}' % raw
        stop = b'{"prompt": "hi", "stop": ["%s"], "max_tokens": 1}' % raw
        for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", name),
                           ("/v1/completions", prompt), ("/v1/completions", stop)):  # fmt: skip
            cases.append(HttpCase(path, f"raw bytes {raw!r} in a string", "POST", path, body))
    return cases


# -- sending ---------------------------------------------------------------------------------------------
def send(address: str, case: HttpCase, timeout: float) -> tuple[str, bytes]:
    """(status, head + first part of the body). status: the HTTP status, or "no answer" / "timeout"."""
    host, port = address.rsplit(":", 1)
    data = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(case.raw(address))
        except OSError:  # the server answered (413) and closed before the whole body was sent
            pass
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and len(data) < 512 * 1024:
                piece = sock.recv(65536)
                if not piece:
                    break
                data += piece
                if case.stream and b"data: " in data.partition(b"\r\n\r\n")[2]:
                    break  # the stream started: leave (the gateway cancels the generation)
        except TimeoutError:
            if not data:
                return "timeout", b""
        except OSError:
            pass
    while data.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in data:  # an interim answer (100 Continue)
        data = data.partition(b"\r\n\r\n")[2]
    if not data.startswith(b"HTTP/"):
        return "no answer", data
    return data.split(b" ", 2)[1].decode(errors="replace"), data


def judge(report: Report, case: HttpCase, status: str, data: bytes) -> None:
    if not status.isdigit() and (case.framing or case.hang_ok):
        status = f"{status} ({'not HTTP' if case.framing else 'body incomplete'}: expected)"
    report.status("http", case.endpoint, status)
    head, _, body = data.partition(b"\r\n\r\n")
    if status.isdigit() and int(status) >= 500:
        report.fail("http fuzz", f"{case.endpoint}: HTTP {status}", request=case.show(),
                    response=data[:1500].decode(errors="replace"))  # fmt: skip
    elif b'"error"' in body and b"text/event-stream" in head and b'"code":5' in body:
        report.fail("http fuzz", f"{case.endpoint}: a 5xx error event in the stream", request=case.show(),
                    response=body[:1500].decode(errors="replace"))  # fmt: skip
    elif not status.isdigit() and "expected" not in status:
        report.fail("http fuzz", f"{case.endpoint}: {status}", request=case.show())


def run_http_fuzz(address: str, report: Report, rng: random.Random, n_post: int, workers: int, big: int) -> None:
    cases = fixed_cases()
    for path in ("/v1/chat/completions", "/v1/completions"):
        cases += [post_case(rng, path, big) for _ in range(n_post)]
    for path in ("/v1/models", "/health", "/metrics"):
        cases += [get_case(rng, path) for _ in range(max(8, n_post // 3))]
    rng.shuffle(cases)

    def one(case: HttpCase) -> None:
        timeout = 2.0 if case.hang_ok or case.framing else 60.0
        try:
            status, data = send(address, case, timeout)
        except OSError as e:
            status, data = f"connect error {type(e).__name__}", b""
        judge(report, case, status, data)

    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, cases))
