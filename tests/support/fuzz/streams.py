"""Streams as a client sees them (every chunk timed), over gRPC and HTTP SSE; the workload prompts and their
undisturbed (reference) outputs; the canary."""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time

import grpc

from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.fuzz.common import MODEL, FuzzStack, Report, run_threads


@dataclasses.dataclass
class StreamResult:
    """One streamed answer as the client saw it. status: the HTTP status or the gRPC code name (OK when the
    stream ended normally); error: the details of a failure, or of an SSE error event."""

    status: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish_reason: str = ""
    error: str = ""
    error_code: int = 0  # the `code` of an SSE error event
    started: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)  # arrival of every chunk with tokens or text
    ended: float = 0.0
    tree_nodes: int = 0  # drafted nodes verified over the whole answer (gRPC only)

    @property
    def ttft(self) -> float:
        return (self.times[0] - self.started) if self.times else float("nan")

    @property
    def total(self) -> float:
        return self.ended - self.started

    @property
    def max_gap(self) -> float:
        """The longest wait for the next chunk, the wait for the first one included."""
        points = [self.started, *self.times]
        return max((b - a for a, b in zip(points, points[1:])), default=0.0)

    def spans(self, t: float) -> bool:
        """Whether the stream was still running at time t (it had a chunk after t)."""
        return bool(self.times) and self.times[-1] > t


def grpc_stream(
    address: str, rpc: str, request, timeout: float = 120.0, keep: threading.Event | None = None, r=None
) -> StreamResult:
    """A Gateway Chat / Complete stream, timed; filled into `r` as it arrives when given. `keep` cleared
    = cancel after the next chunk (a client that leaves)."""
    r = r or StreamResult()
    r.started = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        call = getattr(gateway_pb2_grpc.GatewayStub(ch), rpc)(request, timeout=timeout)
        try:
            for chunk in call:
                if chunk.token_ids or chunk.text_delta or chunk.reasoning_delta:
                    r.times.append(time.monotonic())
                r.tokens += chunk.token_ids
                r.text += chunk.text_delta
                r.reasoning += chunk.reasoning_delta
                r.tree_nodes += sum(s.tree_nodes for s in chunk.steps)
                r.finish_reason = chunk.finish_reason or r.finish_reason
                if keep is not None and not keep.is_set():
                    call.cancel()
            r.status = "OK"
        except grpc.RpcError as e:
            r.status, r.error = e.code().name, e.details() or ""
    r.ended = time.monotonic()
    return r


def http_stream(address: str, path: str, body: dict, timeout: float = 120.0, r=None) -> StreamResult:
    """A `"stream": true` request read event by event (chat: content + reasoning_content; completions: text)."""
    r = r or StreamResult()
    r.started = time.monotonic()
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        resp = conn.getresponse()
        r.status = str(resp.status)
        if resp.status != 200:
            r.error = resp.read()[:2000].decode(errors="replace")
            return r
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error, r.error_code = event["error"].get("message", ""), int(event["error"].get("code") or 0)
                continue
            for c in event.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                thought = (c.get("delta") or {}).get("reasoning_content") or ""
                if piece or thought:
                    r.times.append(time.monotonic())
                r.text += piece
                r.reasoning += thought
                r.finish_reason = c.get("finish_reason") or r.finish_reason
    except (OSError, http.client.HTTPException) as e:
        r.error = r.error or f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        r.ended = time.monotonic()
    return r


# -- workload and references -----------------------------------------------------------------------------
PROMPTS = ("def parse(", "class Stack:", "import json\n", "The river", "for i in range(", "Hello", "# utils\n", "if x")


def complete_request(prompt: str, tokens: int, request_id: str = "", no_spec: bool = False):
    opts = gateway_pb2.GenerationOptions(max_tokens=tokens, temperature=0, ignore_eos=True, no_spec=no_spec)
    return gateway_pb2.CompleteRequest(prompt=prompt, options=opts, request_id=request_id)


def completion_body(prompt: str, tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


class References:
    """Greedy outputs of the workload prompts, computed once per length on the undisturbed stack."""

    def __init__(self, stack: FuzzStack):
        self.stack = stack
        self._refs: dict[tuple[str, int], StreamResult] = {}

    def get(self, prompts, tokens: int) -> list[StreamResult]:
        missing = [p for p in dict.fromkeys(prompts) if (p, tokens) not in self._refs]
        results = run_threads([lambda p=p: grpc_stream(self.stack.gateway, "Complete", complete_request(p, tokens))
                               for p in missing])  # fmt: skip
        for p, res in zip(missing, results):
            if isinstance(res, Exception):
                raise res
            if res.status != "OK" or len(res.tokens) != tokens:
                raise RuntimeError(
                    f"reference run of {p!r} failed: {res.status} {res.error} ({len(res.tokens)} tokens)"
                )
            self._refs[(p, tokens)] = res
        return [self._refs[(p, tokens)] for p in prompts]


def workload_stream(stack: FuzzStack, i: int, prompt: str, tokens: int, **kw) -> StreamResult:
    """Even i: gRPC Complete; odd i: HTTP /v1/completions (SSE)."""
    if i % 2 == 0:
        return grpc_stream(stack.gateway, "Complete", complete_request(prompt, tokens), **kw)
    return http_stream(stack.http, "/v1/completions", completion_body(prompt, tokens), **kw)


def same_output(result: StreamResult, ref: StreamResult, over_grpc: bool) -> bool:
    """gRPC: the same token ids; HTTP: the same text."""
    return result.tokens == ref.tokens if over_grpc else (result.text == ref.text and bool(result.text))


# -- the canary ------------------------------------------------------------------------------------------
CANARY_MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
CANARY_TOKENS = 48


class Canary:
    """One greedy chat request, over gRPC (token ids, text, reasoning) and HTTP SSE (text, reasoning). Its
    first answers are the baseline; every later run, on any stack of the same model, must equal them."""

    def __init__(self, report: Report):
        self.report = report
        self.baseline: dict | None = None

    @staticmethod
    def _run(stack: FuzzStack) -> dict:
        msgs = [gateway_pb2.ChatMessage(**m) for m in CANARY_MESSAGES]
        opts = gateway_pb2.GenerationOptions(max_tokens=CANARY_TOKENS, temperature=0, ignore_eos=True)
        g = grpc_stream(stack.gateway, "Chat", gateway_pb2.ChatRequest(messages=msgs, options=opts))
        body = {"model": MODEL, "messages": CANARY_MESSAGES, "max_tokens": CANARY_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        h = http_stream(stack.http, "/v1/chat/completions", body)
        return {
            "grpc": {"status": g.status, "tokens": g.tokens, "text": g.text, "reasoning": g.reasoning},
            "http": {"status": h.status, "text": h.text, "reasoning": h.reasoning, "error": h.error},
        }

    def record_baseline(self, stack: FuzzStack) -> None:
        out = self._run(stack)
        if (
            out["grpc"]["status"] != "OK"
            or out["http"]["status"] != "200"
            or len(out["grpc"]["tokens"]) != CANARY_TOKENS
        ):
            raise RuntimeError(f"the canary's baseline run failed: {out}")
        self.baseline = out
        agree = (out["grpc"]["text"], out["grpc"]["reasoning"]) == (out["http"]["text"], out["http"]["reasoning"])
        if not agree:
            self.report.fail("canary", "the canary's gRPC and HTTP answers differ", grpc=out["grpc"], http=out["http"])

    def check(self, stack: FuzzStack, phase: str) -> bool:
        out = self._run(stack)
        identical = out == self.baseline
        self.report.canary_runs.append({"phase": phase, "identical": identical})
        if not identical:
            self.report.fail(phase, "the canary changed", baseline=self.baseline, got=out)
        return identical


class CanaryLoop:
    """Runs the canary over and over in a background thread while a phase runs (`with CanaryLoop(...)`)."""

    def __init__(self, canary: Canary, stack: FuzzStack, phase: str):
        self.canary, self.stack, self.phase = canary, stack, phase
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.canary.check(self.stack, f"{self.phase} (during)")

    def __enter__(self) -> CanaryLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
