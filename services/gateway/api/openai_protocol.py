"""OpenAI request parsing and response formatting (docs/design.md §9.4), independent of the web framework.

Parsing validates a JSON body against its request model (openai_models.py: pydantic, one policy per
field) and turns it into the pipeline's inputs; every bad, refused or wrongly typed field raises
`Invalid` (HTTP 400) naming the field.

Penalties and logit masks (presence_penalty, frequency_penalty, logit_bias; vLLM's repetition_penalty,
allowed_token_ids, bad_words) go to the verifier, which applies them to every tree node losslessly.
Supported beyond the OpenAI basics: vLLM's top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, add_generation_prompt, continue_final_message,
chat_template_kwargs (e.g. {"thinking": false}), request_id, SGLang's separate_reasoning, and the
ddtree extensions `budget` (tree node budget) and `no_spec` (plain autoregressive decoding). What is
refused, and why: openai_models.REFUSED (and README "OpenAI parameters"). Structured outputs
(response_format, structured_outputs, guided_*) become GenerationOptions.grammar (structured_outputs.py);
tool_choice required / a named function, a forced tool call (pipeline.chat_job).

logprobs (chat: logprobs + top_logprobs; completions: logprobs N) set GenerationOptions.top_logprobs,
0..20, and vLLM's prompt_logprobs (both) GenerationOptions.prompt_logprobs, 0..20; the answer's shapes
are openai_logprobs.py's. `n` runs n choices (choices.py). The responses (answers, stream chunks,
errors) are openai_responses.py's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ddtree.contract.request_params import INT32_MAX, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, copy_http
from ddtree.gateway.api.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Request,
    content_part,
    json_type,
    validate,
)
from ddtree.gateway.choices import check_n
from ddtree.gateway.errors import Invalid
from ddtree.gateway.structured_outputs import request_grammar
from ddtree.protocol.ddtree.v1 import gateway_pb2


# -- requests ---------------------------------------------------------------------------------
@dataclasses.dataclass
class ChatParams:
    model: str | None
    messages: list[dict]
    options: gateway_pb2.GenerationOptions
    tools: list | None
    tool_choice: str
    chat_template_kwargs: dict | None
    separate_reasoning: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM's)
    parallel_tool_calls: bool = True  # false: at most one tool call
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    request_id: str | None = None
    user: str | None = None
    n: int = 1


@dataclasses.dataclass
class CompletionParams:
    model: str | None
    prompt: str | list[int]
    options: gateway_pb2.GenerationOptions
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    request_id: str | None = None
    user: str | None = None
    n: int = 1
    echo: bool = False  # the prompt ahead of each choice's text (and its tokens' logprobs with logprobs)
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs alone, no output
    prompt_logprobs_shown: bool = False  # the client asked for vLLM's prompt_logprobs (echo may ask alone)


def _in(key: str, value: int | None, lo: int, hi: int) -> int | None:
    if value is not None and not lo <= value <= hi:
        raise Invalid(f"{key}: must be in [{lo}, {hi}], got {value}")
    return value


def _options(r: Request, limit: int | None, max_tokens: int | None, key: str) -> gateway_pb2.GenerationOptions:
    """The sampling and stopping fields as GenerationOptions: the plain ones by the parameter table
    (request_params.copy_http), the rest here (the pipeline checks the whole again as the wire's shape)."""
    o = gateway_pb2.GenerationOptions()
    if max_tokens is not None:
        o.max_tokens = _in(key, max_tokens, 1, limit or INT32_MAX)  # limit: Pipeline.max_tokens_limit
    copy_http(r, o, Invalid)
    o.stop.extend([r.stop] if isinstance(r.stop, str) else r.stop or [])
    for i, t in enumerate(r.stop_token_ids or []):
        if not 0 <= t <= INT32_MAX:
            raise Invalid(f"stop_token_ids[{i}]: token id {t} is outside the vocabulary")
    o.stop_token_ids.extend(r.stop_token_ids or [])
    o.grammar = request_grammar(r)  # response_format, structured_outputs, guided_*: "" when none
    _logit_masks(r, o)
    return o


def _logit_masks(r: Request, o: gateway_pb2.GenerationOptions) -> None:
    """Logit masks, with OpenAI's / vLLM's ranges; token ids are checked against the vocabulary and
    bad_words tokenized by the pipeline (validate_options, Pipeline._job)."""
    for key, bias in (r.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise Invalid(f"logit_bias.{key}: keys must be token ids (integers as strings), got {key!r}") from None
        if not 0 <= token <= INT32_MAX:
            raise Invalid(f"logit_bias.{key}: token id {token} is outside the vocabulary")
        if not math.isfinite(bias):
            raise Invalid(f"logit_bias.{key}: must be a finite number, got {bias}")
        o.logit_bias[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))  # vLLM clamps to [-100, 100]
    if r.allowed_token_ids is not None:
        if not r.allowed_token_ids:
            raise Invalid("allowed_token_ids: must not be empty (omit it to allow every token)")
        for i, t in enumerate(r.allowed_token_ids):
            if not 0 <= t <= INT32_MAX:
                raise Invalid(f"allowed_token_ids[{i}]: token id {t} is outside the vocabulary")
        o.allowed_token_ids.extend(r.allowed_token_ids)
    for i, word in enumerate(r.bad_words or []):
        if not word.strip():
            raise Invalid(f"bad_words[{i}]: must not be empty or only whitespace")
    o.bad_words.extend(r.bad_words or [])


def _content(value: Any, where: str) -> str | None:
    """A message's content: a string, null, or an array of text parts (joined with newlines)."""
    if not isinstance(value, list):
        return value
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise Invalid(f"{where}[{j}]: must be object, got {json_type(part)}")
        p = content_part(part, f"{where}[{j}]")
        if p.type != "text":
            raise Invalid(f"{where}[{j}].type: {p.type!r} is not supported (text parts only)")
        texts.append(p.text or "")
    return "\n".join(texts)


def _message(m: ChatMessage, i: int) -> dict:
    d: dict = {
        "role": "system" if m.role == "developer" else m.role,
        "content": _content(m.content, f"messages[{i}].content"),
    }
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if m.tool_calls is not None:
        d["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    return d


def chat_messages(messages: Any) -> list[dict]:
    """A chat's messages as parse_chat reads them (content parts joined), for /tokenize."""
    r = validate(ChatCompletionRequest, {"messages": messages})
    return [_message(m, i) for i, m in enumerate(r.messages)]


def _tool_choice(value: Any) -> str:
    """auto | none | required, or a named function as "function:NAME" (pipeline.chat_job)."""
    if value is None:
        return "auto"
    if isinstance(value, dict):
        fn = value.get("function")
        if value.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Invalid('tool_choice: a named tool is {"type": "function", "function": {"name": NAME}}')
        return f"function:{fn['name']}"
    if value not in ("auto", "none", "required"):
        raise Invalid(f"tool_choice: must be auto, none, required or a named function, got {value!r}")
    return value


def _stream(r: Request) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): vLLM's continuous_usage_stats counts with include_usage only."""
    include = bool(r.stream_options and r.stream_options.include_usage)
    return bool(r.stream), include, include and bool(r.stream_options.continuous_usage_stats)


def _chat_logprobs(r: ChatCompletionRequest, o: gateway_pb2.GenerationOptions) -> None:
    top = _in("top_logprobs", r.top_logprobs, 0, MAX_TOP_LOGPROBS)
    if top and not r.logprobs:
        raise Invalid("top_logprobs: needs logprobs: true")
    if r.logprobs:
        o.top_logprobs = top or 0


def parse_chat(body: dict, max_tokens_limit: int | None) -> ChatParams:
    r = validate(ChatCompletionRequest, body)
    max_tokens, key = r.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = r.max_tokens, "max_tokens"
    if r.echo:
        raise Invalid("echo: not supported on chat (use /v1/completions, which echoes the prompt)")
    stream, include_usage, continuous = _stream(r)
    options = _options(r, max_tokens_limit, max_tokens, key)
    _chat_logprobs(r, options)
    return ChatParams(
        model=r.model,
        messages=[_message(m, i) for i, m in enumerate(r.messages)],
        options=options,
        tools=r.tools,
        tool_choice=_tool_choice(r.tool_choice),
        chat_template_kwargs=r.chat_template_kwargs,
        separate_reasoning=r.separate_reasoning is not False,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        parallel_tool_calls=r.parallel_tool_calls is not False,
        add_generation_prompt=r.add_generation_prompt is not False,
        continue_final_message=bool(r.continue_final_message),
        request_id=r.request_id,
        user=r.user,
        n=check_n(r.n),
    )


def _prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise Invalid("prompt: is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise Invalid(f"prompt: one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, list):
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool):
                raise Invalid(f"prompt[{i}]: must be integer (a token id), got {json_type(t)}")
            if not 0 <= t <= INT32_MAX:
                raise Invalid(f"prompt[{i}]: token id {t} is outside the vocabulary")
    elif not isinstance(prompt, str):
        raise Invalid(f"prompt: must be string or array of token ids, got {json_type(prompt)}")
    return prompt


def parse_completion(body: dict, max_tokens_limit: int | None) -> CompletionParams:
    r = validate(CompletionRequest, body)
    stream, include_usage, continuous = _stream(r)
    prompt_only = r.max_tokens == 0
    if prompt_only and not r.echo:
        raise Invalid("max_tokens: 0 needs echo: true (the prompt's log-probabilities alone), got 0")
    options = _options(r, max_tokens_limit, 1 if prompt_only else r.max_tokens, "max_tokens")
    shown = options.HasField("prompt_logprobs")
    if r.logprobs is not None:
        options.top_logprobs = _in("logprobs", r.logprobs, 0, MAX_TOP_LOGPROBS)
        if r.echo:  # the prompt tokens' entries: the verifier's prompt log-probabilities, `logprobs` most likely
            if shown and options.prompt_logprobs != r.logprobs:
                raise Invalid(f"prompt_logprobs: must equal logprobs ({r.logprobs}) with echo, got {r.prompt_logprobs}")
            options.prompt_logprobs = r.logprobs
    return CompletionParams(
        model=r.model,
        prompt=_prompt(r.prompt),
        options=options,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        request_id=r.request_id,
        user=r.user,
        n=check_n(r.n),
        echo=bool(r.echo),
        prompt_only=prompt_only,
        prompt_logprobs_shown=shown,
    )
