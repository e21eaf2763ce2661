"""OpenAI responses (docs/design.md §9.4), independent of the web framework: the answer of a chat or
completion request (`chat_response`, `completion_response`), its stream chunks (`ChatStream`,
`CompletionStream`), usage and error JSON. The requests are openai_protocol.py's.

A stream that fails after it started ends each unfinished choice with finish_reason "error", then the
error event, then [DONE]. Streams with `stream_options.continuous_usage_stats` (and include_usage) carry `usage` on every chunk
(that choice's completion tokens so far, as vLLM). Completions with `echo` start each choice with the
prompt (`Echo`); with max_tokens 0 that is all, finish_reason "length", 0 completion tokens.

Responses carry the OpenAI fields plus `spec` (speculative statistics of the answer: verify_steps,
avg_accept_length, accept_histogram[k] = steps that committed k tokens, ttft_ms, decode_ms measured by
the verifier). Streams send it on the chunk that carries finish_reason. usage has
prompt_tokens_details.cached_tokens (prompt tokens the verifier's prefix cache held); with `n` choices
it counts the prompt once and sums the completion tokens.
"""

from __future__ import annotations

import dataclasses

from ddtree.gateway.api.openai_logprobs import (
    PromptLogprobsStream,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_field,
    prompt_logprobs_json,
)
from ddtree.gateway.generation import Result
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2


@dataclasses.dataclass(frozen=True)
class Echo:
    """What a completion's `echo` puts ahead of each choice's output (vLLM's shapes)."""

    text: str  # the prompt as text
    first_id: int  # the prompt's first token: no entry scores it
    top: int | None  # logprobs N: the prompt tokens' entries ahead of the output's; None: no logprobs
    output: bool = True  # False (max_tokens 0): the prompt alone; the one token generated for it is dropped


# -- responses -------------------------------------------------------------------------------------------
def usage_json(u: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sum_usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """The usage of n choices of one prompt, as OpenAI counts it: the prompt once, the completions summed.
    cached_tokens: what every choice took from the cache (the least); the spec statistics over all
    steps of all choices (ttft / decode: the slowest choice's)."""
    if len(usages) == 1:
        return usages[0]
    hist = [0] * max(len(u.accept_histogram) for u in usages)
    for u in usages:
        for k, v in enumerate(u.accept_histogram):
            hist[k] += v
    steps = sum(u.verify_steps for u in usages)
    return common_pb2.Usage(
        prompt_tokens=usages[0].prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        verify_steps=steps,
        avg_accept_length=sum(k * v for k, v in enumerate(hist)) / steps if steps else 0.0,
        accept_histogram=hist,
        ttft_ms=max(u.ttft_ms for u in usages),
        decode_ms=max(u.decode_ms for u in usages),
        cached_tokens=min(u.cached_tokens for u in usages),
    )


def spec_json(u: common_pb2.Usage) -> dict:
    return {
        "verify_steps": u.verify_steps,
        "avg_accept_length": round(u.avg_accept_length, 4),
        "accept_histogram": list(u.accept_histogram),
        "ttft_ms": round(u.ttft_ms, 3),
        "decode_ms": round(u.decode_ms, 3),
    }


def error_json(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape; `code` defaults to the status (a string such as context_length_exceeded where
    OpenAI names one)."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
        504: "timeout",
    }
    kind = kinds.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}}


def field_of(message: str) -> str | None:
    """The field an error message names ("messages[0].role: ..." -> "messages[0].role")."""
    head, sep, _ = message.partition(": ")
    return head if sep and " " not in head else None


class EventStream:
    """OpenAI stream chunks of one request's n choices: start(), then events((index, chunk)) per
    GenerateChunk of choice `index`. Each choice's finish chunk carries its own spec; the usage chunk
    (include_usage) comes once, after the last choice finished, summed (sum_usage). `strings` (a
    TokenStrings) when the request asked for logprobs."""

    def __init__(
        self,
        rid: str,
        model: str,
        created: int,
        include_usage: bool,
        obj: str,
        n: int = 1,
        strings=None,
        continuous_prompt_tokens: int | None = None,
    ):
        """continuous_prompt_tokens: the prompt's tokens when every chunk carries usage (continuous_usage_stats)."""
        self.rid, self.model, self.created, self.include_usage, self.obj = rid, model, created, include_usage, obj
        self.n, self.strings = n, strings
        self._usages: dict[int, common_pb2.Usage] = {}
        self.prompt = PromptLogprobsStream(strings) if strings and strings.prompt else None
        self.continuous_prompt_tokens = continuous_prompt_tokens
        self.generated = [0] * n  # completion tokens of each choice so far

    def _chunk(self, choices: list, **extra) -> dict:
        chunk = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": choices}
        prompt = self.continuous_prompt_tokens
        if prompt is not None and choices and "usage" not in extra:
            done = sum(self.generated[c["index"]] for c in choices)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return {**chunk, **extra}

    def count(self, index: int, c: gateway_pb2.GenerateChunk) -> None:
        self.generated[index] += len(c.token_ids)

    def failed(self) -> list[dict]:
        """After a failure mid-stream: a last chunk with finish_reason "error" for each choice that had not
        finished (then the error event and [DONE]), so no choice ends without a finish reason."""
        return [self._chunk([self._ended(i, "error")]) for i in range(self.n) if i not in self._usages]

    def _ended(self, index: int, finish_reason: str) -> dict:
        raise NotImplementedError

    def _final(self, index: int, choice: dict, usage: common_pb2.Usage) -> list[dict]:
        out = [self._chunk([choice], spec=spec_json(usage))]
        self._usages[index] = usage
        if self.include_usage and len(self._usages) == self.n:
            out.append(self._chunk([], usage=usage_json(sum_usage([self._usages[i] for i in range(self.n)]))))
        return out


class ChatStream(EventStream):
    """chat.completion.chunk events in OpenAI order, per choice: role; content / reasoning_content
    deltas (with their tokens' logprobs); tool calls (id + name first, then argument fragments);
    finish_reason (+ spec); then usage; (then [DONE])."""

    def __init__(self, rid: str, model: str, created: int, include_usage: bool, n: int = 1, strings=None, **usage):
        super().__init__(rid, model, created, include_usage, "chat.completion.chunk", n, strings, **usage)

    def _delta(self, index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _ended(self, index: int, finish_reason: str) -> dict:
        return self._delta(index, {}, finish_reason)

    def start(self) -> list[dict]:
        return [self._chunk([self._delta(i, {"role": "assistant", "content": ""})]) for i in range(self.n)]

    def events(self, item: tuple[int, gateway_pb2.GenerateChunk]) -> list[dict]:
        index, c = item
        self.count(index, c)
        out = []
        prompt = self.prompt.take(index, c) if self.prompt else None
        if prompt is not None:  # choice 0's whole prompt_logprobs, ahead of its text: once (openai_logprobs.py)
            out.append(self._chunk([self._delta(index, {})], prompt_logprobs=prompt))
        delta = {}
        if c.reasoning_delta:  # both names: vLLM's current clients read `reasoning`, older ones `reasoning_content`
            delta["reasoning"] = delta["reasoning_content"] = c.reasoning_delta
        if c.text_delta:
            delta["content"] = c.text_delta
        logprobs = chat_logprobs(self.strings, c.token_ids, c.logprobs) if self.strings and c.logprobs else None
        if delta or logprobs:  # a chunk's tokens may render no text yet (a held-back stop string, a split character)
            out.append(self._chunk([self._delta(index, delta, logprobs=logprobs)]))
        for d in c.tool_calls:
            if d.id:
                call = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            else:
                call = {"index": d.index, "function": {"arguments": d.arguments_delta}}
            out.append(self._chunk([self._delta(index, {"tool_calls": [call]})]))
            if d.id and d.arguments_delta:
                more = {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments_delta}}]}
                out.append(self._chunk([self._delta(index, more)]))
        if c.finish_reason:
            out += self._final(index, self._delta(index, {}, c.finish_reason), c.usage)
        return out


class CompletionStream(EventStream):
    """text_completion events per choice: (prompt_logprobs); (echo: the prompt); text deltas (with their
    tokens' logprobs); finish_reason (+ spec); then usage; (then [DONE]). With prompt_logprobs (or echo with
    logprobs) every choice shows choice 0's, ahead of its text: the other choices' chunks that come before
    choice 0's entries are all in are held until then (usually a few steps' worth, those of one prefill; at
    most their whole answers, when the verifier admits choice 0 last: choices.check_size counts them)."""

    def __init__(
        self,
        rid: str,
        model: str,
        created: int,
        include_usage: bool,
        n: int = 1,
        strings=None,
        echo: Echo | None = None,
        **usage,
    ):
        super().__init__(rid, model, created, include_usage, "text_completion", n, strings, **usage)
        self.echo = echo
        self._offsets = [0] * n  # text_offset of each choice's next token
        self._held: list[tuple[int, gateway_pb2.GenerateChunk]] = []  # choices 1.. while choice 0's pieces are due
        self._echoed = [False] * n
        wants_pieces = self.prompt is not None or (echo is not None and echo.top is not None)
        self._pieces = PromptLogprobsStream(strings) if wants_pieces else None
        self._prompt_pieces: list = []  # choice 0's, once in

    def _choice(self, index: int, text: str, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _ended(self, index: int, finish_reason: str) -> dict:
        return self._choice(index, "", finish_reason)

    def start(self) -> list[dict]:
        return []

    def _echo(self, index: int) -> dict:
        echo, logprobs = self.echo, None
        if echo.top is not None:
            logprobs = echo_logprobs(self.strings, echo.first_id, self._prompt_pieces, echo.top)
            self._offsets[index] = sum(len(t) for t in logprobs["tokens"])
        self._echoed[index] = True
        return self._chunk([self._choice(index, echo.text, logprobs=logprobs)])

    def events(self, item: tuple[int, gateway_pb2.GenerateChunk]) -> list[dict]:
        index, c = item
        if index and self._pieces and self._pieces.pending:
            self._held.append(item)
            return []
        out = []
        pieces = self._pieces.take_pieces(index, c) if self._pieces else None
        if pieces is not None:
            self._prompt_pieces = pieces
            if self.prompt is not None:  # choice 0's whole prompt_logprobs on every choice, ahead of its text
                shown = prompt_logprobs_json(self.strings, pieces)
                out += [self._chunk([{**self._choice(i, ""), "prompt_logprobs": shown}]) for i in range(self.n)]
        if self.echo and not self._echoed[index] and not (self._pieces and self._pieces.pending):
            out.append(self._echo(index))
        output = self.echo is None or self.echo.output
        if output:
            self.count(index, c)
        logprobs = None
        if output and self.strings and self.strings.output and c.logprobs:
            logprobs = completion_logprobs(self.strings, c.token_ids, c.logprobs, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in logprobs["tokens"])
        if output and (c.text_delta or logprobs):
            out.append(self._chunk([self._choice(index, c.text_delta, logprobs=logprobs)]))
        if c.finish_reason:
            reason, usage = (c.finish_reason, c.usage) if output else ("length", _prompt_only(c.usage))
            out += self._final(index, self._choice(index, "", reason), usage)
        if pieces is not None:
            held, self._held = self._held, []
            for h in held:
                out += self.events(h)
        return out


def _prompt_only(u: common_pb2.Usage) -> common_pb2.Usage:
    """The usage of an echo with max_tokens 0: the token generated for the prompt's log-probs is not counted."""
    out = common_pb2.Usage()
    out.CopyFrom(u)
    out.completion_tokens = 0
    return out


def _spec_and_usage(results: list[Result], prompt_only: bool = False) -> dict:
    usage = sum_usage([_prompt_only(r.usage) if prompt_only else r.usage for r in results])
    return {"usage": usage_json(usage), "spec": spec_json(usage)}


def chat_response(rid: str, model: str, created: int, results: list[Result], strings=None) -> dict:
    choices = []
    for index, r in enumerate(results):
        message: dict = {
            "role": "assistant",
            "content": r.text or None,  # null when the answer is only reasoning or tool calls
            "reasoning": r.reasoning or None,
            "reasoning_content": r.reasoning or None,
        }
        if r.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in r.tool_calls
            ]
        logprobs = chat_logprobs(strings, r.token_ids, r.logprobs) if strings and strings.output else None
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": r.finish_reason})
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        **_spec_and_usage(results),
        **prompt_logprobs_field(strings, results[0].prompt_logprobs),  # vLLM's: on the response, once
    }


def completion_response(
    rid: str, model: str, created: int, results: list[Result], strings=None, echo: Echo | None = None
) -> dict:
    pieces = results[0].prompt_logprobs  # choice 0's (choices.choice_jobs)
    prompt = prompt_logprobs_field(strings, pieces)
    head = echo_logprobs(strings, echo.first_id, pieces, echo.top) if echo and echo.top is not None else None
    output = echo is None or echo.output
    choices = []
    for index, r in enumerate(results):
        logprobs = None
        if strings and strings.output:
            offset = sum(len(t) for t in head["tokens"]) if head else 0
            logprobs = completion_logprobs(strings, r.token_ids if output else [], r.logprobs, offset)
            logprobs = join_logprobs(head, logprobs) if head else logprobs
        choices.append(
            {
                "index": index,
                "text": (echo.text if echo else "") + (r.text if output else ""),
                "logprobs": logprobs,
                "finish_reason": r.finish_reason if output else "length",
                **prompt,  # vLLM's: on each choice
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        **_spec_and_usage(results, prompt_only=not output),
    }
