"""OpenAI / vLLM request bodies as pydantic v2 models, and their policy: every field a vLLM or OpenAI
client may send is either implemented or refused with a 400 that names it (README "OpenAI parameters").

- Types are strict (`strict=True`): `"temperature": "x"`, `"max_tokens": 4.0` or `"stream": 1` are
  400s naming the field ("max_tokens: must be integer, got number"), as OpenAI and vLLM answer them.
  An integer is a valid number.
- Refused fields (`REFUSED`): accepted only at their neutral value (absent, null, or what changes
  nothing, e.g. n = 1, best_of = 1); anything else is a 400 saying why.
- Unknown fields are ignored with a warning log naming them, as vLLM does (clients send fields a
  server may not know; refusing them would break the official clients' newer fields).

`validate` returns the model of a body; `openai_protocol.parse_chat` / `parse_completion` turn it
into the pipeline's inputs. Every error is an `Invalid` (HTTP 400) whose message starts with the
field's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from ddtree.contract.request_params import OPENAI, http_fields
from ddtree.gateway.errors import Invalid
from ddtree.telemetry.logging import get_logger

_KINDS = {
    "int_type": "integer",
    "float_type": "number",
    "string_type": "string",
    "bool_type": "boolean",
    "list_type": "array",
    "dict_type": "object",
    "model_type": "object",
}
_log = get_logger("gateway.http")


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


class _TypeError(ValueError):
    """A JSON type error found by a before-validator; `at` is the path below the field ("[2]")."""

    def __init__(self, what: str, value: Any, at: str = ""):
        super().__init__(f"must be {what}, got {json_type(value)}")
        self.at = at


def _type_error(what: str, value: Any, where: str = "") -> _TypeError:
    return _TypeError(what, value, where)


def _union(*kinds: type, what: str, items: type | None = None) -> Callable[[Any], Any]:
    """A before-validator for a field of several JSON types (pydantic's own union errors name its
    internal branches); `items`: the element type a list must hold."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise _type_error(what, value)
        if items is not None and isinstance(value, list):
            for i, v in enumerate(value):
                if not isinstance(v, items) or isinstance(v, bool) and items is not bool:
                    raise _type_error(items.__name__.replace("str", "string").replace("int", "integer"), v, f"[{i}]")
        return value

    return check


Stop = Annotated[Any, BeforeValidator(_union(str, list, what="string or array of strings", items=str))]
ObjectOrString = Annotated[Any, BeforeValidator(_union(str, dict, what="string or object"))]


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(_Model):
    type: str


class ContentPart(_Model):
    type: str
    text: str | None = None


class FunctionCall(_Model):
    name: str | None = None
    arguments: ObjectOrString = None


class ToolCallIn(_Model):
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


Content = Annotated[Any, BeforeValidator(_union(str, list, what="string or array of content parts"))]


class ChatMessage(_Model):
    role: str | None = None
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name of reasoning_content
    tool_calls: list[ToolCallIn] | None = None


# The scalar parameters (temperature, top_p, penalties, budget, ...): one optional field each, typed by
# contract/request_params.py's table, which also holds their ranges and defaults.
_Params = create_model("_Params", __base__=_Model, **http_fields(OPENAI))


class Request(_Params):
    """The fields chat and completions share: the table's, and those below."""

    model: str | None = None
    max_tokens: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    spaces_between_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # logged with the request
    request_id: str | None = None  # vLLM's: the request id when no X-Request-Id header is sent
    n: int | None = None  # choices.py: n sequences, seed + i each
    # Logit masks (the verifier applies them per tree node, losslessly; openai_protocol._logit_masks)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Refused unless neutral (REFUSED says why).
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    response_format: ResponseFormat | None = None  # structured outputs (structured_outputs.py) ...
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None  # ... to here, and structured_outputs
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    priority: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class ChatCompletionRequest(Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: ObjectOrString = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    include_reasoning: bool | None = None
    reasoning_effort: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    echo: bool | None = None  # refused unless false (openai_protocol.parse_chat): completions echo
    functions: Any = None
    function_call: Any = None
    store: bool | None = None
    metadata: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(Request):
    prompt: Any = Field(default=None)
    suffix: str | None = None
    echo: bool | None = None
    logprobs: int | None = None
    prompt_embeds: Any = None


# field -> (is the value neutral?, why it is refused otherwise). {neutral} / {value} are filled in.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v == 1, "only 1 is supported, got {value}"),
    "use_beam_search": (lambda v: v is False, "beam search is not supported"),
    "length_penalty": (lambda v: v == 1, "only 1 (it applies to beam search, which is not supported)"),
    # response_format, structured_outputs and guided_json / _regex / _choice / _grammar /
    # _decoding_backend: structured_outputs.py
    "guided_whitespace_pattern": (lambda v: False, "not supported (use structured_outputs.disable_any_whitespace)"),
    "structural_tag": (lambda v: False, "not supported (structured outputs: json, regex, choice, grammar)"),
    "logits_processors": (lambda v: not v, "not supported (custom logits processors)"),
    "priority": (lambda v: v == 0, "not supported (requests are served first come, first served)"),
    "return_tokens_as_token_ids": (lambda v: v is False, "not supported"),
    "return_token_ids": (lambda v: v is False, "not supported"),
    "add_special_tokens": (lambda v: v is False, "only false: prompts are tokenized as given, no BOS/EOS added"),
    "cache_salt": (lambda v: False, "not supported (the prefix cache is shared by every request)"),
    "kv_transfer_params": (lambda v: False, "not supported (no disaggregated prefill)"),
    "vllm_xargs": (lambda v: False, "not supported"),
    "spaces_between_special_tokens": (lambda v: v is True, "only true (the default)"),
    # chat
    "include_reasoning": (
        lambda v: v is True,
        "only true (use separate_reasoning: false to keep reasoning in content)",
    ),
    "reasoning_effort": (lambda v: False, 'not supported (use chat_template_kwargs: {{"thinking": false}})'),
    "chat_template": (lambda v: False, "not supported (only the checkpoint's own chat template is served)"),
    "documents": (lambda v: False, "not supported"),
    "mm_processor_kwargs": (lambda v: False, "not supported (text only)"),
    "functions": (lambda v: False, "not supported (deprecated: use tools)"),
    "function_call": (lambda v: False, "not supported (deprecated: use tool_choice)"),
    "store": (lambda v: v is False, "not supported (nothing is stored)"),
    "metadata": (lambda v: False, "not supported (nothing is stored)"),
    "modalities": (lambda v: v == ["text"], 'only ["text"]'),
    "audio": (lambda v: False, "not supported (text only)"),
    "prediction": (lambda v: False, "not supported (predicted outputs)"),
    "web_search_options": (lambda v: False, "not supported"),
    # completions
    "suffix": (lambda v: not v, "not supported"),
    "prompt_embeds": (lambda v: False, "not supported"),
}


def _error_message(err: dict) -> str:
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), _TypeError):
        return f"{loc}{ctx['error'].at}: {ctx['error']}"
    if kind == "float_type" and isinstance(err["input"], int) and not isinstance(err["input"], bool):
        return f"{loc}: {err['input']} is out of range"
    if kind in _KINDS:
        return f"{loc}: must be {_KINDS[kind]}, got {json_type(err['input'])}"
    if kind == "missing":
        return f"{loc}: is required"
    return f"{loc}: {err['msg']}"


def _checked(model: type[_Model], body: dict, where: str = "") -> _Model:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message = _error_message(e.errors(include_url=False)[0])
        raise Invalid(f"{where}.{message}" if where else message) from None


def content_part(part: dict, where: str) -> ContentPart:
    """One part of a message's content array (`where` is its path, e.g. messages[0].content[1])."""
    return _checked(ContentPart, part, where)


def validate(model: type[_Model], body: dict) -> _Model:
    """The request model of `body`; Invalid naming the first bad field. Unknown fields are logged."""
    req = _checked(model, body)
    if req.model_extra:
        _log.warning("request_fields_ignored", fields=sorted(req.model_extra))
    for key, (neutral, why) in REFUSED.items():
        head, _, sub = key.partition(".")
        value = getattr(req, head, None)
        if sub and value is not None:
            value = getattr(value, sub, None)
        if value is not None and not neutral(value):
            raise Invalid(f"{key}: {why.format(value=value)}")
    return req
