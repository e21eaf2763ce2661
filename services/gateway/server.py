"""Gateway service: the public gRPC API in front of the verifier.

A request's life: validate (INVALID_ARGUMENT with the field named) -> render the chat template ->
tokenize -> `Verifier.Generate` (server stream, deadline = the client's remaining time) -> per verifier
message: detokenize incrementally, hold back text that may be the start of a stop string, split
reasoning and tool calls -> one `GenerateChunk` per verifier message; the last one carries
finish_reason and usage.

- Stop tokens: the request's stop_token_ids plus `<|im_end|>` and `[EOS]` (unless ignore_eos). The
  token that stopped generation is reported in token_ids but not rendered into text.
- Stop strings: matched on the raw text across chunk boundaries; on a match the text is cut before
  it, the verifier request is aborted, and the answer finishes with "stop". Usage is then computed
  by the gateway from the steps seen (ttft/decode measured on the gateway's clock).
- A client that leaves cancels the verifier call (the verifier aborts the request). Verifier errors
  reach the client with their status code and message.
- Chat output goes through the reasoning parser (config.reasoning_parser) and, when the request
  declares tools, the tool-call parser (config.tool_call_parser); finish_reason "stop" becomes
  "tool_calls" when calls were parsed. Complete returns raw text.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
import uuid
from typing import Iterator

import grpc

from services.config import GatewayConfig
from services.gateway.chat_template import validate_tools
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.parsers.kimi_k2_reasoning import KimiK2ReasoningParser, starts_in_reasoning
from services.gateway.parsers.kimi_k2_tools import KimiK2ToolParser, ToolCallDelta
from services.gateway.tokenizer import Tokenizer
from services.protocol.ddtree.v1 import (common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2,
                                         verifier_pb2_grpc)
from services.protocol.server import GRPC_OPTIONS, RunningServer, start_server
from services.telemetry.logging import get_logger

REASONING_PARSERS = ("kimi_k2", "none")
TOOL_CALL_PARSERS = ("kimi_k2", "none")
EOS_TOKENS = ("<|im_end|>", "[EOS]")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
ABORT_TIMEOUT_S = 2.0
INFO_TIMEOUT_S = 1.0
# grpc reports an RPC without deadline as one ~forever away; anything beyond this is "no deadline".
_NO_DEADLINE_S = 1e7


class _Invalid(ValueError):
    """Bad request input; the message names the field."""


@dataclasses.dataclass(frozen=True)
class _Job:
    """A validated request, ready to send to the verifier."""
    request: verifier_pb2.GenerateRequest
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    chat: bool = False
    in_reasoning: bool = False  # the prompt opened a think block
    tools: bool = False         # the request declared tools
    tool_index_offset: int = 0  # tool calls earlier in the conversation


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to release, whether a stop string matched). After a match the stream
        is over: the text up to the match is returned and the rest dropped."""
        pending = self._pending + text
        hits = [p for p in (pending.find(s) for s in self._stops) if p != -1]
        if hits:
            self._pending = ""
            return pending[:min(hits)], True
        hold = 0
        if not final:
            for stop in self._stops:
                for k in range(min(len(stop) - 1, len(pending)), hold, -1):
                    if pending.endswith(stop[:k]):
                        hold = k
                        break
        self._pending = pending[len(pending) - hold:]
        return pending[:len(pending) - hold], False


class _OutputParsers:
    """Reasoning parser, then tool-call parser on its content; either may be absent."""

    def __init__(self, reasoning: KimiK2ReasoningParser | None, tools: KimiK2ToolParser | None):
        self._reasoning = reasoning
        self._tools = tools

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.calls > 0

    def push(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self._reasoning.push(text) if self._reasoning else ("", text)
        content, calls = self._tools.push(content) if self._tools else (content, [])
        return content, reasoning, calls

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self._tools:
            content, calls = self._tools.push(content)
            tail, more = self._tools.finish()
            content, calls = content + tail, calls + more
        return content, reasoning, calls


def validate_options(o: gateway_pb2.GenerationOptions, *, vocab_size: int, max_tokens_limit: int) -> None:
    """Raise _Invalid (a ValueError) naming the first bad field of GenerationOptions."""
    if o.max_tokens < 0:
        raise _Invalid(f"options.max_tokens: must be >= 0 (0 = server default), got {o.max_tokens}")
    if o.max_tokens > max_tokens_limit:
        raise _Invalid(f"options.max_tokens: must be <= {max_tokens_limit}, got {o.max_tokens}")
    if not math.isfinite(o.temperature) or o.temperature < 0:
        raise _Invalid(f"options.temperature: must be a finite number >= 0, got {o.temperature}")
    if o.top_p != 0 and not 0 < o.top_p <= 1:  # NaN fails the range test too
        raise _Invalid(f"options.top_p: must be in (0, 1] (0 = unset), got {o.top_p}")
    if o.top_k < 0:
        raise _Invalid(f"options.top_k: must be >= 0 (0 = disabled), got {o.top_k}")
    if o.budget < 0:
        raise _Invalid(f"options.budget: must be >= 0 (0 = server default), got {o.budget}")
    if len(o.stop) > MAX_STOP_STRINGS:
        raise _Invalid(f"options.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(o.stop)}")
    for i, s in enumerate(o.stop):
        if not s:
            raise _Invalid(f"options.stop[{i}]: must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise _Invalid(f"options.stop[{i}]: {len(s)} characters, over the limit of {MAX_STOP_CHARS}")
    if len(o.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _Invalid(f"options.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(o.stop_token_ids)}")
    for i, t in enumerate(o.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise _Invalid(f"options.stop_token_ids[{i}]: token id {t} is outside the vocabulary "
                           f"(size {vocab_size})")


def _message_dict(m: gateway_pb2.ChatMessage) -> dict:
    """A proto ChatMessage as the dict the chat template takes (empty strings = absent)."""
    d: dict = {"role": m.role, "content": m.content}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                           for c in m.tool_calls]
    return d


def _usage_from_steps(prompt_tokens: int, completion_tokens: int, steps: list[common_pb2.StepStats],
                      ttft_ms: float, decode_ms: float) -> common_pb2.Usage:
    spec = [s for s in steps if s.tree_nodes > 0]
    histogram = [0] * (max((s.accept_length for s in spec), default=0) + 1)
    for s in spec:
        histogram[s.accept_length] += 1
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, verify_steps=len(steps),
        avg_accept_length=sum(s.accept_length for s in spec) / len(spec) if spec else 0.0,
        accept_histogram=histogram if spec else [], ttft_ms=ttft_ms, decode_ms=decode_ms)


def _client_timeout(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return max(remaining, 0.001)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The Gateway RPCs over one tokenizer and one verifier stub."""

    def __init__(self, tokenizer: Tokenizer, verifier: verifier_pb2_grpc.VerifierStub, config: GatewayConfig):
        if config.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {config.reasoning_parser!r} is not available "
                             f"(choose from {', '.join(REASONING_PARSERS)})")
        if config.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {config.tool_call_parser!r} is not available "
                             f"(choose from {', '.join(TOOL_CALL_PARSERS)})")
        self._tok = tokenizer
        self._verifier = verifier
        self._config = config
        self._eos_ids = tuple(tokenizer.special_tokens[t] for t in EOS_TOKENS if t in tokenizer.special_tokens)
        self._max_context: int | None = None
        self._log = get_logger("gateway")

    # -- RPCs --------------------------------------------------------------------------------------
    def Chat(self, request: gateway_pb2.ChatRequest, context) -> Iterator[gateway_pb2.GenerateChunk]:
        try:
            job = self._chat_job(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self._stream(job, context)

    def Complete(self, request: gateway_pb2.CompleteRequest, context) -> Iterator[gateway_pb2.GenerateChunk]:
        try:
            job = self._complete_job(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self._stream(job, context)

    def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:
        try:
            if request.messages:
                rendered = self._render([_message_dict(m) for m in request.messages], None,
                                        request.add_generation_prompt, {})
                text = rendered
            else:
                rendered, text = "", request.text
                self._check_prompt_chars(len(text), "text")
            ids = self._tok.encode(text)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gateway_pb2.TokenizeResponse(token_ids=ids, tokens=[self._tok.id_to_token(i) for i in ids],
                                            rendered=rendered)

    def GetInfo(self, request: gateway_pb2.GatewayInfoRequest, context) -> gateway_pb2.GatewayInfo:
        c = self._config
        return gateway_pb2.GatewayInfo(model_id=c.model_id, verifier_address=c.verifier,
                                       vocab_size=self._tok.vocab_size, max_context=self._verifier_max_context(),
                                       reasoning_parser=c.reasoning_parser, tool_call_parser=c.tool_call_parser)

    # -- request preparation -------------------------------------------------------------------------
    def _chat_job(self, request: gateway_pb2.ChatRequest) -> _Job:
        if not request.messages:
            raise _Invalid("messages: must not be empty")
        tools = None
        if request.tools_json.strip():
            try:
                tools = json.loads(request.tools_json)
            except json.JSONDecodeError as e:
                raise _Invalid(f"tools_json: not valid JSON ({e.msg} at char {e.pos})") from None
            tools = validate_tools(tools)
        kwargs = {}
        if request.chat_template_kwargs_json.strip():
            try:
                kwargs = json.loads(request.chat_template_kwargs_json)
            except json.JSONDecodeError as e:
                raise _Invalid(f"chat_template_kwargs_json: not valid JSON ({e.msg} at char {e.pos})") from None
            if not isinstance(kwargs, dict):
                raise _Invalid(f"chat_template_kwargs_json: must be a JSON object, got {type(kwargs).__name__}")
            for key in ("thinking", "preserve_thinking"):
                if key in kwargs and not isinstance(kwargs[key], bool):
                    raise _Invalid(f"chat_template_kwargs.{key}: must be true or false, got {kwargs[key]!r}")
        messages = [_message_dict(m) for m in request.messages]
        self._check_prompt_chars(sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages),
                                 "messages")
        prompt = self._render(messages, tools, True, kwargs)
        history_calls = sum(len(m.get("tool_calls", ())) for m in messages)
        return self._job(request.options, request.request_id, self._tok.encode(prompt), chat=True,
                         in_reasoning=starts_in_reasoning(prompt), tools=bool(tools),
                         tool_index_offset=history_calls)

    def _complete_job(self, request: gateway_pb2.CompleteRequest) -> _Job:
        if not request.prompt:
            raise _Invalid("prompt: must not be empty")
        self._check_prompt_chars(len(request.prompt), "prompt")
        return self._job(request.options, request.request_id, self._tok.encode(request.prompt))

    def _render(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict) -> str:
        prompt = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               chat_template_kwargs=kwargs)
        self._check_prompt_chars(len(prompt), "rendered chat prompt")
        return prompt

    def _check_prompt_chars(self, n: int, what: str) -> None:
        if n > self._config.max_prompt_chars:
            raise _Invalid(f"{what}: {n} characters, over the limit of {self._config.max_prompt_chars}")

    def _job(self, options: gateway_pb2.GenerationOptions, request_id: str, input_ids: list[int],
             **kwargs) -> _Job:
        o = options
        validate_options(o, vocab_size=self._tok.vocab_size, max_tokens_limit=self._config.max_tokens_limit)
        if not input_ids:
            raise _Invalid("prompt: encodes to no tokens")
        stop_ids = list(dict.fromkeys([*o.stop_token_ids, *(() if o.ignore_eos else self._eos_ids)]))
        sampling = common_pb2.SamplingParams(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k)
        if o.HasField("seed"):
            sampling.seed = o.seed
        request = verifier_pb2.GenerateRequest(
            request_id=request_id or f"gw-{uuid.uuid4().hex}", input_ids=input_ids, sampling=sampling,
            max_new_tokens=o.max_tokens or self._config.default_max_tokens, ignore_eos=o.ignore_eos,
            stop_token_ids=stop_ids, spec=common_pb2.SpecOptions(no_spec=o.no_spec, budget=o.budget))
        return _Job(request=request, stop_strings=tuple(o.stop), stop_ids=frozenset(stop_ids), **kwargs)

    # -- generation --------------------------------------------------------------------------------
    def _stream(self, job: _Job, context) -> Iterator[gateway_pb2.GenerateChunk]:
        """Run a job; translate failures into status codes (exceptions never reach grpc raw)."""
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            yield from self._generate(job, context)
        except grpc.RpcError as e:
            if not context.is_active():
                return  # the client left; its cancellation already cancelled the verifier call
            error = self._verifier_error(e)
        except Exception as e:  # a bug or a protocol violation of the verifier, never silent
            self._log.exception("request_failed", request_id=job.request.request_id)
            error = (grpc.StatusCode.INTERNAL, f"gateway: {type(e).__name__}: {e}")
        if error is not None:
            self._log.warning("request_error", request_id=job.request.request_id, code=error[0].name,
                              message=error[1])
            context.abort(*error)

    def _verifier_error(self, e: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return code, f"verifier at {self._config.verifier} is unavailable: {details}"
        return code, details

    def _generate(self, job: _Job, context) -> Iterator[gateway_pb2.GenerateChunk]:
        rid = job.request.request_id
        started = time.monotonic()
        call = self._verifier.Generate(job.request, timeout=_client_timeout(context))
        context.add_callback(call.cancel)  # client gone (or RPC over) -> verifier call cancelled
        detok = IncrementalDetokenizer(self._tok)
        stops = StopMatcher(job.stop_strings)
        parsers = _OutputParsers(
            KimiK2ReasoningParser(job.in_reasoning) if job.chat and self._config.reasoning_parser == "kimi_k2" else None,
            KimiK2ToolParser(job.tool_index_offset) if job.tools and self._config.tool_call_parser == "kimi_k2" else None)
        steps: list[common_pb2.StepStats] = []
        completion = 0
        first_token_at = last_token_at = None

        for msg in call:
            ids = list(msg.token_ids)
            if ids:
                last_token_at = time.monotonic()
                first_token_at = first_token_at or last_token_at
            completion += len(ids)
            steps.extend(msg.steps)
            final = bool(msg.finish_reason)
            text_ids = ids[:-1] if final and msg.finish_reason == "stop" and ids and ids[-1] in job.stop_ids else ids
            text = detok.push(text_ids) + (detok.flush() if final else "")
            text, matched = stops.push(text, final=final)
            chunk = gateway_pb2.GenerateChunk(request_id=rid, token_ids=ids, steps=msg.steps)
            self._fill_text(chunk, *parsers.push(text))
            if not (final or matched):
                yield chunk
                continue
            if matched and not final:
                self._abort(rid)
                call.cancel()
            self._fill_text(chunk, *parsers.finish())
            reason = "stop" if matched else msg.finish_reason
            chunk.finish_reason = "tool_calls" if reason == "stop" and parsers.called_tools else reason
            if final and msg.HasField("usage"):
                chunk.usage.CopyFrom(msg.usage)
            else:  # the gateway ended the request itself (stop string) or the verifier sent no usage
                ttft_ms = (first_token_at - started) * 1000.0 if first_token_at else 0.0
                decode_ms = (last_token_at - first_token_at) * 1000.0 if first_token_at else 0.0
                chunk.usage.CopyFrom(_usage_from_steps(len(job.request.input_ids), completion, steps,
                                                       ttft_ms, decode_ms))
            self._log.info("request_done", request_id=rid, prompt_tokens=len(job.request.input_ids),
                           completion_tokens=completion, finish_reason=chunk.finish_reason,
                           wall_ms=round((time.monotonic() - started) * 1000.0, 1))
            yield chunk
            return
        raise RuntimeError(f"verifier stream of {rid} ended without a finish_reason")

    def _abort(self, request_id: str) -> None:
        """Tell the verifier to drop a request now (best effort: cancelling the stream, which follows,
        makes it abort as well)."""
        try:
            self._verifier.Abort(verifier_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError as e:
            self._log.warning("abort_failed", request_id=request_id, code=e.code().name, message=e.details())

    @staticmethod
    def _fill_text(chunk: gateway_pb2.GenerateChunk, text: str, reasoning: str,
                   calls: list[ToolCallDelta]) -> None:
        chunk.text_delta += text
        chunk.reasoning_delta += reasoning
        chunk.tool_calls.extend(gateway_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name,
                                                          arguments_delta=c.arguments_delta) for c in calls)

    def _verifier_max_context(self) -> int:
        """The verifier's max_context, asked once it answers; the tokenizer's limit until then."""
        if self._max_context is None:
            try:
                info = self._verifier.GetInfo(verifier_pb2.VerifierInfoRequest(), timeout=INFO_TIMEOUT_S)
                self._max_context = info.max_context
            except grpc.RpcError:
                return self._tok.model_max_length or 0
        return self._max_context


def serve(config: GatewayConfig, tokenizer_dir: str | pathlib.Path | None = None,
          announce: bool = True) -> RunningServer:
    """Start the gateway on config.host:config.port. The tokenizer is config.tokenizer, or
    `tokenizer_dir` when that is empty (the caller resolves the default)."""
    path = config.tokenizer or tokenizer_dir
    if not path:
        raise ValueError("gateway: no tokenizer directory (set --tokenizer / DDTREE_TOKENIZER)")
    tokenizer = Tokenizer(path)
    channel = grpc.insecure_channel(config.verifier, options=GRPC_OPTIONS)
    servicer = GatewayServicer(tokenizer, verifier_pb2_grpc.VerifierStub(channel), config)

    def register(server: grpc.Server) -> list[str]:
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    running = start_server("gateway", register, config.host, config.port, config.max_workers, config.grace_s,
                           on_stop=channel.close, announce=announce)
    get_logger("gateway").info("gateway_ready", address=running.address, verifier=config.verifier,
                               tokenizer=str(path), vocab_size=tokenizer.vocab_size)
    return running
