"""Every scalar request parameter, defined once: name, type, range, default, what the wire's zero means,
and which public APIs carry it. The HTTP parsers (OpenAI's, Anthropic's, Responses') copy their rows
onto `GenerationOptions` by this table (`copy_value`, `copy_http`), the gateway checks a `GenerationOptions` by it
(`check_wire`), and the error messages come from it, so a range is written in one place.

Two shapes of one value: on HTTP a field is absent (None: the default) or a value, checked against its
range as sent; on the wire (proto3 `GenerationOptions`) a plain scalar's 0 may mean "unset" (`unset`
says what it means, e.g. top_p 0 = 1), which `check_wire` accepts. An `optional` proto field is checked
only when set. The proto's int32 bound is not repeated in a wire message (the type holds it).

Where a parameter goes on (`to`): the verifier's `GenerateRequest` carries it in `SamplingParams`
("sampling", then the verifier's `SamplingConfig` field of the same name), `SpecOptions` ("spec") or at its top
("request"), or the gateway applies it itself (""). The conversions run by this: gateway/job_request.py
(GenerationOptions -> GenerateRequest) and verifier/rpc/request_params.py (GenerateRequest -> GenerateParams).

Adding a parameter: a row here, its field in `proto/ddtree/v1/gateway.proto` (and, when the verifier applies
it, in `common.proto`'s `SamplingParams` / `SpecOptions` or `verifier.proto`'s `GenerateRequest`: same name),
the code that applies it (for "sampling" a `SamplingConfig` field of the same name), and its test.
Parameters with a shape of their own (max_tokens against the server's cap, stop strings, token-id lists,
logit_bias, grammars) are checked where they are parsed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # top_logprobs / logprobs: at most this many top tokens per output token (vLLM's default)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values (OpenAI's range; vLLM clamps to it)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's and vLLM's range)

# The public APIs: OpenAI's chat and completions, Anthropic's Messages, OpenAI's Responses, the gRPC one's
# GenerationOptions. An HTTP API's parser takes exactly its rows (copy_value); the others are refused there.
OPENAI, ANTHROPIC, RESPONSES, GRPC = "openai", "anthropic", "responses", "grpc"
# Where GenerateRequest carries a parameter: its SamplingParams, its SpecOptions, itself; GATEWAY: not sent on
SAMPLING, SPEC, REQUEST, GATEWAY = "sampling", "spec", "request", ""


@dataclasses.dataclass(frozen=True)
class Param:
    """One request parameter. Bounds are inclusive unless `lo_open` / `hi_open`; None = unbounded."""

    name: str
    kind: type  # int | float | bool (a bool has no range)
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    default: Any = None  # what HTTP sends on when the request leaves it out (None: nothing)
    unset: str = ""  # the wire's 0 when it is not a value: what it means ("0 = unset"); "" = 0 is a value
    off: str = ""  # the neutral value, said in messages ("1 = off")
    says: str = ""  # the range in words, when the bounds alone would not say it (temperature)
    apis: frozenset[str] = frozenset({OPENAI, GRPC})
    http_off: int | None = None  # HTTP's extra "off" value, sent on as the wire's 0 (vLLM's top_k -1)
    to: str = SAMPLING  # where the verifier request carries it: SAMPLING | SPEC | REQUEST, or GATEWAY (applied there)
    neutral: Any = None  # the value the wire's unset 0 stands for (top_p 1, repetition_penalty 1); None: 0 itself
    doc: str = ""

    def phrase(self, wire: bool) -> str:
        """The range in words: "in (0, 1]", ">= 0", "a finite number >= 0"."""
        if self.says:
            return self.says
        hi = None if self.hi is None or math.isinf(self.hi) or (wire and self.hi == INT32_MAX) else self.hi
        lo = _num(self.lo, self.kind) if self.lo is not None else None
        if hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        return f"in {'(' if self.lo_open else '['}{lo}, {_num(hi, self.kind)}{')' if self.hi_open else ']'}"

    def contains(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def check(self, value: Any, where: str, *, wire: bool = False, error: type[ValueError] = ValueError) -> Any:
        """`value` when it is in range (on the wire, 0 too when it means unset); else `error` whose
        message starts with `where`."""
        if self.kind is bool or (wire and self.unset and value == 0) or self.contains(value):
            return value
        off = f"{self.http_off} or {self.off}" if self.off and self.http_off is not None and not wire else self.off
        notes = [n for n in (self.unset if wire else "", off) if n]
        note = f" ({', '.join(notes)})" if notes else ""
        raise error(f"{where}: must be {self.phrase(wire)}{note}, got {value}")


def _num(x: float, kind: type) -> str:
    return str(int(x)) if kind is int else f"{x:g}"


_ALL = frozenset({OPENAI, ANTHROPIC, RESPONSES, GRPC})
_NOT_ANTHROPIC = frozenset({OPENAI, RESPONSES, GRPC})
PARAMS: dict[str, Param] = {
    p.name: p
    for p in (
        Param("temperature", float, 0, math.inf, hi_open=True, default=1.0, says="a finite number >= 0",
              apis=_ALL, doc="0 = greedy; HTTP's default is 1 (OpenAI's), the wire's 0 is greedy"),
        Param("top_p", float, 0, 1, lo_open=True, default=1.0, unset="0 = unset", neutral=1.0, apis=_ALL,
              doc="nucleus mass; 1 = off"),
        Param("top_k", int, 0, INT32_MAX, off="0 = disabled", apis=_ALL, http_off=-1,
              doc="HTTP also takes vLLM's -1 (off), sent on as 0"),
        Param("min_p", float, 0, 1, doc="keep tokens with p >= min_p * max p; 0 = off"),
        Param("seed", int, 0, UINT64_MAX, apis=_NOT_ANTHROPIC, doc="per-request seed (choices.py: seed + i for choice i)"),
        Param("min_tokens", int, 0, INT32_MAX, doc="no stop token or stop string before this many tokens"),
        Param("presence_penalty", float, -MAX_PENALTY, MAX_PENALTY),
        Param("frequency_penalty", float, -MAX_PENALTY, MAX_PENALTY),
        Param("repetition_penalty", float, 0, math.inf, lo_open=True, hi_open=True, unset="0 = unset",
              off="1 = off", neutral=1.0, doc="vLLM's: logit / it if > 0, else * it, for tokens in the prompt or output"),
        Param("top_logprobs", int, 0, MAX_TOP_LOGPROBS, apis=frozenset({GRPC}), to=REQUEST,
              doc="HTTP: chat's top_logprobs with logprobs true, completions' logprobs N (openai_protocol)"),
        Param("prompt_logprobs", int, 0, MAX_TOP_LOGPROBS, to=REQUEST, doc="vLLM's: the prompt tokens' logprobs"),
        Param("budget", int, 0, INT32_MAX, unset="0 = server default", to=SPEC, doc="ddtree: tree node budget"),
        Param("truncate_prompt_tokens", int, -1, INT32_MAX, to=GATEWAY,
              doc="vLLM's: keep only the last k prompt tokens; -1 = the model's maximum context"),
        Param("no_spec", bool, to=SPEC, doc="ddtree: plain autoregressive decoding"),
        Param("ignore_eos", bool, apis=_NOT_ANTHROPIC, to=REQUEST),
        Param("include_stop_str_in_output", bool, to=GATEWAY),
        Param("skip_special_tokens", bool, to=GATEWAY, doc="unset = true: special tokens never reach the text"),
    )
}  # fmt: skip


def for_api(api: str) -> Iterator[Param]:
    return (p for p in PARAMS.values() if api in p.apis)


def sent_to(where: str) -> tuple[Param, ...]:
    """The parameters the verifier request carries at `where` (SAMPLING, SPEC, REQUEST), in table order."""
    return tuple(p for p in PARAMS.values() if p.to == where)


def has_presence(message: Any, name: str) -> bool:
    """The proto field `name` is `optional` (set or not is known), e.g. seed, top_logprobs."""
    return message.DESCRIPTOR.fields_by_name[name].has_presence


def check_wire(options: Any, prefix: str, error: type[ValueError] = ValueError) -> None:
    """Every table parameter of a `GenerationOptions` (an `optional` field only when set)."""
    for p in for_api(GRPC):
        if p.kind is bool:
            continue
        field = options.DESCRIPTOR.fields_by_name[p.name]
        if field.has_presence and not options.HasField(p.name):
            continue
        p.check(getattr(options, p.name), f"{prefix}{p.name}", wire=True, error=error)


def copy_value(options: Any, name: str, value: Any, error: type[ValueError] = ValueError) -> None:
    """One parameter of an HTTP request (its JSON type checked by the parser) onto `GenerationOptions`,
    checked as sent: None gets the row's default, or stays unset; the row's `http_off` goes on as 0."""
    p = PARAMS[name]
    if value is None:
        value = p.default
    if value is None:
        return
    if p.http_off is not None and value == p.http_off:
        value = 0
    if p.kind is float:
        value = float(value)  # a JSON integer too: one wording ("got 1.0") on every API
    setattr(options, name, p.check(value, name, error=error))


def copy_http(request: Any, options: Any, error: type[ValueError] = ValueError) -> None:
    """The parameters of an OpenAI request model (chat, completions) onto `GenerationOptions`."""
    for p in for_api(OPENAI):
        copy_value(options, p.name, getattr(request, p.name, None), error)


def http_fields(api: str) -> dict[str, tuple[Any, None]]:
    """The table's parameters as optional fields of a pydantic request model (`create_model`)."""
    return {p.name: (p.kind | None, None) for p in for_api(api)}
