"""A fake in-process verifier for gateway tests: streams scripted token ids, records what it was sent.

Used by the gateway tests over gRPC and HTTP: the `fake` fixture (tests/conftest.py) is one per test module,
and `serve_gateway` starts a gateway over it."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from ddtree.protocol.server import start_server

# What a Kimi-K2 model writes (the demo tokenizer's markers; kimi_k2 reasoning and tool parsers), for the
# fake's scripts: reasoning, then an answer; reasoning, then two calls of the tool `get_weather`.
REASONING_OUT = "Let me think. 2+2 is 4.</think>The answer is 4."
TOOL_OUT = (
    "I should call the tool.</think><|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Lyon"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


@dataclasses.dataclass
class _Run:
    """What one test scripted and what the fake saw during it. Generate binds the run current at its
    start, so a stream left over from an earlier test cannot touch a later test's record."""

    script: list
    error: tuple | None = None  # (code, message): abort after streaming the script
    delay_s: float = 0.0  # wait before every message but the first
    requests: list = dataclasses.field(default_factory=list)
    aborts: list = dataclasses.field(default_factory=list)
    time_remaining: list = dataclasses.field(default_factory=list)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    sent: int = 0


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams the current run's script for every Generate (its prompt_logprobs messages only to a request
    that asks for them, as the verifier); records what it was sent."""

    def __init__(self, max_context: int = 1234):
        self.run = _Run([])
        self.max_context = max_context  # GetInfo's; set it before a gateway first asks (the gateway keeps it)
        self.max_new_tokens_limit = 4096  # GetInfo's too: the gateway's cap on max_tokens

    def reset(self, script, error=None, delay_s=0.0):
        self.run = _Run(script, error, delay_s)

    def __getattr__(self, name):  # fake.requests, fake.sent, ... read the current run
        return getattr(self.__dict__["run"], name)

    def Generate(self, request, context):
        run = self.run
        run.requests.append(request)
        run.time_remaining.append(context.time_remaining())
        over, done = threading.Event(), threading.Event()  # done: the script ran to its end

        def ended():  # gRPC calls this when the call ends, for whatever reason
            over.set()  # wakes the waits below
            if not done.is_set():  # ended before the script did: cancelled, by the client or its deadline
                run.cancelled.set()  # (also when gRPC stops pulling messages while this generator waits at a yield)

        context.add_callback(ended)
        asks = request.HasField("prompt_logprobs")
        for i, msg in enumerate(m for m in run.script if asks or not m.HasField("prompt_logprobs")):
            if i and run.delay_s:
                # Woken by the callback, with a poll of the call's state as a second way to see a cancel.
                until = time.monotonic() + run.delay_s
                while not over.wait(min(0.2, max(until - time.monotonic(), 0))) and context.is_active():
                    if time.monotonic() >= until:
                        break
            if not context.is_active():
                run.cancelled.set()
                return
            run.sent += 1
            yield msg
        done.set()
        if run.error:
            context.abort(*run.error)

    def Abort(self, request, context):
        self.run.aborts.append(request.request_id)
        return verifier_pb2.AbortResponse(request_id=request.request_id)

    def GetInfo(self, request, context):
        return verifier_pb2.VerifierInfo(
            model_id="fake", max_context=self.max_context, max_new_tokens_limit=self.max_new_tokens_limit
        )


def script_for(ids, sizes=None, finish="length", usage=None, request_id="r"):
    """Split `ids` into GenerateResponse messages of the given sizes (default 1 each); the last one
    carries finish_reason and usage. Each message reports one StepStats."""
    sizes = sizes or [1] * len(ids)
    assert sum(sizes) == len(ids)
    msgs, pos = [], 0
    for step, n in enumerate(sizes):
        msgs.append(
            verifier_pb2.GenerateResponse(
                request_id=request_id,
                token_ids=ids[pos : pos + n],
                steps=[
                    common_pb2.StepStats(
                        step=step, context_tokens=10 + pos, tree_nodes=8, accept_length=n, verify_ms=1.5, total_ms=2.0
                    )
                ],
            )
        )
        pos += n
    if not msgs:
        msgs.append(verifier_pb2.GenerateResponse(request_id=request_id))
    msgs[-1].finish_reason = finish
    if usage is not None:
        msgs[-1].usage.CopyFrom(usage)
    return msgs


def verifier_usage(prompt_tokens: int, msgs) -> common_pb2.Usage:
    """The usage the real verifier sends at the end of a request that streamed `msgs`: its own `usage_of`
    over a finished sequence that took these steps (timings left at 0)."""
    from ddtree.verifier.rpc.server import usage_of  # torch: only the tests that call this import it

    seq = types.SimpleNamespace(
        prompt_len=prompt_tokens,
        generated=[t for m in msgs for t in m.token_ids],
        accept_lengths=[s.accept_length for m in msgs for s in m.steps],
        arrival=0.0,
        first_token_time=None,
        last_token_time=None,
    )
    return usage_of(seq)


def start_fake_verifier(name: str = "fake-verifier"):
    """(servicer, RunningServer) on a free loopback port; servicer.address is set."""
    servicer = FakeVerifier()

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return ["ddtree.v1.Verifier"]

    running = start_server(name, register, "127.0.0.1", 0, 16, 0.2, announce=False)
    servicer.address = running.address
    return servicer, running


def serve_gateway(fake: FakeVerifier, tokenizer_dir, **config):
    """A generator fixture body: a gateway (RunningServer) over the fake verifier, stopped afterwards."""
    from ddtree.config import GatewayConfig
    from ddtree.gateway.api.server import serve

    cfg = GatewayConfig(verifier=fake.address, **config)
    cfg.validate()
    running = serve(cfg, tokenizer_dir=tokenizer_dir, announce=False)
    yield running
    running.stop(0)


def openai_client(gw, api_key: str = "none"):
    """The official openai client on a gateway's HTTP API (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=f"http://{gw.http_address}/v1", api_key=api_key, max_retries=0, timeout=20)


def stub_engine_info(model_id: str, hidden: int, vocab: int = 4096, block_size: int = 8) -> dict:
    """The `info()` of a test drafter engine served by the production Drafter server: one tapped layer,
    no window, budgets 8 / 64, no sequence held."""
    return dict(
        model_id=model_id,
        block_size=block_size,
        mask_token_id=14,
        target_layer_ids=[0],
        window=0,
        default_budget=8,
        max_budget=64,
        hidden_size=hidden,
        vocab_size=vocab,
        active_sequences=0,
    )
