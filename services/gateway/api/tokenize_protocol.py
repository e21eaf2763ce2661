"""vLLM's utility routes, as a vLLM user calls them: POST /tokenize, POST /detokenize, GET /version.

    POST /tokenize    {"prompt": str, "add_special_tokens"?: bool}                       (a completion prompt)
                   or {"messages": [...], "add_generation_prompt"?: bool, "tools"?: [...],
                       "chat_template_kwargs"?: {...}}                                    (a chat, rendered)
                   -> {"count": n, "max_model_len": L, "tokens": [ids], "token_strs"?: [...]}
                      ("return_token_strs": true adds token_strs)
    POST /detokenize  {"tokens": [ids]} -> {"prompt": str}
    GET  /version     -> {"version": "<ddtree-serve version>"}

The ids are exactly those a request would send to the verifier: a chat goes through the same template
and the same plain-text encoding of request strings (`Pipeline.render`). `model` may name the served
model; any other field is refused (400 naming it), never ignored. The prompt's special-token strings
are special ids, as in a completion; `add_special_tokens` is accepted for vLLM clients and changes
nothing, since this tokenizer adds no BOS to a completion prompt (the chat template writes its own).
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any

PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "tools", "chat_template_kwargs", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
MAX_DETOKENIZE_IDS = 1_000_000


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None = None  # a completion prompt, or
    messages: list | None = None  # a chat
    add_generation_prompt: bool = True
    tools: list | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _only(body: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ValueError(f"{extra[0]}: not a field of {what} (fields: {', '.join(sorted(allowed))})")


def _typed(body: dict, key: str, kind: type, name: str, default=None):
    value = body.get(key, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{key}: must be {name}, got {_json_type(value)}")
    return value


def parse_tokenize(body: dict) -> TokenizeRequest:
    """ValueError naming the field for a malformed request."""
    model = _typed(body, "model", str, "a string")
    strs = bool(_typed(body, "return_token_strs", bool, "true or false", False))
    if "messages" in body:
        _only(body, CHAT_FIELDS, "a chat /tokenize request")
        return TokenizeRequest(
            model=model,
            messages=_typed(body, "messages", list, "an array"),
            add_generation_prompt=_typed(body, "add_generation_prompt", bool, "true or false", True),
            tools=_typed(body, "tools", list, "an array"),
            chat_template_kwargs=_typed(body, "chat_template_kwargs", dict, "an object"),
            return_token_strs=strs,
        )
    if "prompt" not in body:
        raise ValueError("prompt: is required (or messages, for a chat)")
    _only(body, PROMPT_FIELDS, "a prompt /tokenize request")
    _typed(body, "add_special_tokens", bool, "true or false", True)
    prompt = _typed(body, "prompt", str, "a string")
    return TokenizeRequest(model=model, prompt=prompt, return_token_strs=strs)


def parse_detokenize(body: dict, vocab_size: int) -> tuple[str | None, list[int]]:
    """(model, ids); ValueError naming the field."""
    _only(body, DETOKENIZE_FIELDS, "a /detokenize request")
    model = _typed(body, "model", str, "a string")
    if "tokens" not in body:
        raise ValueError("tokens: is required")
    ids = _typed(body, "tokens", list, "an array of token ids")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise ValueError(f"tokens: at most {MAX_DETOKENIZE_IDS} ids, got {len(ids)}")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"tokens[{i}]: must be an integer, got {_json_type(t)}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"tokens[{i}]: token id {t} is outside the vocabulary (size {vocab_size})")
    return model, ids


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    out: dict = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if token_strs is not None:
        out["token_strs"] = token_strs
    return out


def version() -> dict:
    try:
        return {"version": metadata.version("ddtree-serve")}
    except metadata.PackageNotFoundError:  # a checkout run without installing
        return {"version": "unknown"}
