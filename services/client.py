"""A client of the Gateway service: what `ddtree generate` and `ddtree demo` run.

It streams one chat or completion request, prints text as it arrives (optionally), and summarises the
speculative statistics the verifier measured per step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.contract.step_record import STEP_FIELDS
from ddtree.contract.usage import avg_accept_length
from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from ddtree.protocol.server import GRPC_OPTIONS


class GatewayError(ValueError):
    """A request the gateway refused or could not serve, in one line that names the failing hop: the
    gateway unreachable, or the gateway answering with the failure of the verifier behind it; with the gRPC
    status and message (what `ddtree generate` prints, exit status 2)."""


def _gateway_answers(gateway: str, timeout_s: float = 3.0) -> bool:
    """Whether the gateway's server answers a health check now (any status: it is up)."""
    try:
        with grpc.insecure_channel(gateway, options=GRPC_OPTIONS) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return True
    except grpc.RpcError:
        return False


def _rpc_failure(gateway: str, err: grpc.RpcError, answered: bool) -> GatewayError:
    """answered: the gateway sent part of the answer already (then it is up whatever the status says)."""
    code = err.code().name if err.code() else "UNKNOWN"
    details = " ".join((err.details() or "").split())  # one line
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        # The gateway passes the verifier's UNAVAILABLE through: ask the gateway itself whether it is up.
        if answered or _gateway_answers(gateway):
            return GatewayError(
                f"the gateway at {gateway} is up, but the verifier behind it failed: {code}: {details or code}"
            )
        return GatewayError(f"gateway at {gateway} is unreachable ({details or code}); is it running?")
    if err.code() == grpc.StatusCode.UNAUTHENTICATED:
        return GatewayError(f"gateway at {gateway} refused the API key: {details} (--api-key-file or DDTREE_API_KEY)")
    return GatewayError(f"gateway at {gateway}: {code}: {details}")


@dataclasses.dataclass
class GenerateResult:
    text: str
    reasoning: str
    token_ids: list[int]
    steps: list[dict]
    finish_reason: str
    usage: dict
    ttft_s: float  # client-side: request sent to first token received
    decode_s: float  # client-side: first token to last chunk

    def spec(self) -> dict:
        lengths = [s["accept_length"] for s in self.steps]
        hist: dict[int, int] = {}
        for n in lengths:
            hist[n] = hist.get(n, 0) + 1
        return {
            "steps": len(lengths),
            "accept_lengths": lengths,
            "avg_accept_length": avg_accept_length(lengths),
            "histogram": {str(k): hist[k] for k in sorted(hist)},
        }

    def step_ms(self) -> dict:
        n = max(len(self.steps), 1)
        return {k: sum(s[k] for s in self.steps) / n for k in ("draft_ms", "verify_ms", "transport_ms", "total_ms")}

    def to_json(self) -> dict:
        tokens = self.usage.get("completion_tokens", len(self.token_ids))
        return {
            "text": self.text,
            "reasoning": self.reasoning,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "spec": self.spec(),
            "step_ms": self.step_ms(),
            "timing": {
                "ttft_s": self.ttft_s,
                "decode_s": self.decode_s,
                "decode_tokens_per_s": (tokens - 1) / self.decode_s if self.decode_s > 0 and tokens > 1 else 0.0,
            },
        }


def _usage_dict(u) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "verify_steps": u.verify_steps,
        "avg_accept_length": u.avg_accept_length,
        "accept_histogram": list(u.accept_histogram),
        "server_ttft_ms": u.ttft_ms,
        "server_decode_ms": u.decode_ms,
    }


def generate(
    gateway: str,
    prompt: str,
    *,
    chat: bool = True,
    options: gateway_pb2.GenerationOptions | None = None,
    on_text: Callable[[str], None] | None = None,
    on_reasoning: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
    chat_template_kwargs_json: str = "",
    api_key: str = "",
) -> GenerateResult:
    """One streamed request (api_key: sent as `authorization: Bearer KEY`, '' = none); GatewayError (a
    ValueError, one line) when the gateway refuses, is unreachable, or the verifier behind it fails."""
    progress = {"answered": False}
    try:
        return _generate(
            gateway,
            prompt,
            chat,
            options,
            on_text,
            on_reasoning,
            timeout_s,
            chat_template_kwargs_json,
            api_key,
            progress,
        )
    except grpc.RpcError as err:
        raise _rpc_failure(gateway, err, progress["answered"]) from None


def _generate(
    gateway, prompt, chat, options, on_text, on_reasoning, timeout_s, chat_template_kwargs_json, api_key, progress
):
    options = options or gateway_pb2.GenerationOptions()
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    with grpc.insecure_channel(gateway, options=GRPC_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        if chat:
            req = gateway_pb2.ChatRequest(
                messages=[gateway_pb2.ChatMessage(role="user", content=prompt)],
                options=options,
                chat_template_kwargs_json=chat_template_kwargs_json,
            )
            stream = stub.Chat(req, timeout=timeout_s, metadata=metadata)
        else:
            request = gateway_pb2.CompleteRequest(prompt=prompt, options=options)
            stream = stub.Complete(request, timeout=timeout_s, metadata=metadata)
        t0 = time.perf_counter()
        first = last = None
        text, reasoning, ids, steps, finish, usage = [], [], [], [], "", {}
        for chunk in stream:
            progress["answered"] = True
            now = time.perf_counter()
            if chunk.token_ids and first is None:
                first = now
            if chunk.token_ids:
                last = now
            ids.extend(chunk.token_ids)
            steps.extend({f: getattr(s, f) for f in STEP_FIELDS} for s in chunk.steps)
            if chunk.reasoning_delta:
                reasoning.append(chunk.reasoning_delta)
                if on_reasoning:
                    on_reasoning(chunk.reasoning_delta)
            if chunk.text_delta:
                text.append(chunk.text_delta)
                if on_text:
                    on_text(chunk.text_delta)
            if chunk.finish_reason:
                finish = chunk.finish_reason
                usage = _usage_dict(chunk.usage)
    first = first or time.perf_counter()
    return GenerateResult(
        "".join(text),
        "".join(reasoning),
        ids,
        steps,
        finish,
        usage,
        ttft_s=first - t0,
        decode_s=(last - first) if last else 0.0,
    )


def format_stats(result: GenerateResult) -> str:
    j = result.to_json()
    spec, ms, timing = j["spec"], j["step_ms"], j["timing"]
    hist = " ".join(f"{k}:{v}" for k, v in spec["histogram"].items())
    return (
        f"finish={result.finish_reason} tokens={j['usage'].get('completion_tokens', 0)} "
        f"steps={spec['steps']} avg_accept={spec['avg_accept_length']:.2f} histogram[{hist}]\n"
        f"step ms: draft {ms['draft_ms']:.1f} | verify {ms['verify_ms']:.1f} | transport {ms['transport_ms']:.1f} "
        f"| total {ms['total_ms']:.1f}    ttft {timing['ttft_s']:.3f}s  decode {timing['decode_tokens_per_s']:.1f} tok/s"
    )
