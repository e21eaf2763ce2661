"""Structured outputs: the request's constraint as one llguidance grammar.

The gateway compiles, the verifier enforces: every form below becomes an llguidance grammar (JSON text,
`{"grammars": [...]}`) checked here, so a bad schema, regex or grammar is a 400 naming its field, and
sent in `GenerateRequest.grammar`; the verifier masks the target's choice at every tree node with it
(services/verifier/constraints/grammar.py).

- `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}`; `text` = none.
- vLLM: `structured_outputs` `{json | regex | choice | grammar (Lark) | json_object, disable_any_whitespace,
  disable_additional_properties, disable_fallback}`, and the older `guided_json` / `guided_regex` /
  `guided_choice` / `guided_grammar` (with `guided_decoding_backend` auto / guidance / llguidance).
- `tool_choice` `required` / a named function: the Kimi K2 tool-call section (the tool parser's syntax,
  parsers/kimi_k2_tools.py), each call's arguments constrained to its `parameters` schema.
- `tool_choice` `auto` with tools (and no other constraint): text, then optionally that section, whose
  calls can only name declared tools, with a JSON object as arguments, the declared schema for a tool
  marked `strict: true` (`auto_tool_grammar`). `parallel_tool_calls: false`: one call at most, any mode.

JSON is compact (`{"a":1,"b":[2,3]}`, llguidance's `whitespace_flexible: false`): vLLM allows any
whitespace unless `disable_any_whitespace`, which lets a weak model pad with whitespace until max_tokens;
here `disable_any_whitespace` is accepted and always in effect, and a schema's own `x-guidance`
(llguidance's options) is refused (400). A schema given as a JSON string is parsed with json_limits'
bounds (depth, number length, no NaN). At most one constraint per request; min_tokens must be 0 with one
(pipeline.py).
When the prompt opens a think block (Kimi's template with thinking on), the grammar lets the
reasoning run free up to `</think>` and constrains what follows, as vLLM's reasoning-aware structured
outputs do.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from ddtree.gateway.errors import Invalid
from ddtree.protocol.json_limits import JsonInputError, check_depth, load_json
from ddtree.tokenization.tokenizer import Tokenizer

BACKENDS = ("auto", "guidance", "llguidance")
MAX_FORCED_CALLS = 8  # tool_choice required: 1..8 calls (a bound, so a weak model cannot loop to max_tokens)
_SO_KEYS = {
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
    "disable_additional_properties",
    "disable_fallback",
    "whitespace_pattern",
    "structural_tag",
}


def _check(grammar: dict, field: str) -> dict:
    check_grammar(json.dumps({"grammars": [grammar]}), field)
    return grammar


def _schema(value: Any, field: str, closed: bool = False) -> dict:
    """A JSON schema (an object, or a JSON string of one, parsed with json_limits' bounds) as a grammar.
    The schema's `x-guidance` (llguidance's options) is the gateway's: a client's is refused."""
    try:
        if isinstance(value, str):
            value = load_json(value, field)
        else:
            check_depth(value, field)  # a schema object inside the body was bounded with the body
    except JsonInputError as e:  # "FIELD: ..." or "FIELD is nested too deeply ...": "FIELD: ..." for the 400's param
        raise Invalid(f"{field}: {str(e).removeprefix(field).removeprefix(':').strip()}") from None
    if isinstance(value, bool):  # true / false are schemas too; llguidance takes objects
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise Invalid(f"{field}: must be a JSON schema object, got {type(value).__name__}")
    if "x-guidance" in value:
        raise Invalid(f"{field}.x-guidance: not supported (the gateway sets llguidance's options)")
    schema = {**value, "x-guidance": {"whitespace_flexible": False}}
    if closed and schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return _check({"json_schema": schema}, field)


def _regex(value: Any, field: str) -> dict:
    if not isinstance(value, str):
        raise Invalid(f"{field}: must be string, got {type(value).__name__}")
    lark = json.loads(llguidance.LLMatcher.grammar_from_regex(value))["grammars"][0]["lark_grammar"]
    return _check({"lark_grammar": lark}, field)


def _choice(value: Any, field: str) -> dict:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise Invalid(f"{field}: must be a non-empty array of non-empty strings")
    return _check({"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in value)}, field)


def _lark(value: Any, field: str) -> dict:
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"{field}: must be a non-empty Lark grammar string")
    return _check({"lark_grammar": value}, field)


def _response_format(rf) -> dict | None:
    extra = rf.model_extra or {}
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return _schema({"type": "object"}, "response_format")
    if rf.type != "json_schema":
        raise Invalid(f"response_format.type: must be text, json_object or json_schema, got {rf.type!r}")
    spec = extra.get("json_schema")
    if not isinstance(spec, dict):
        raise Invalid("response_format.json_schema: is required (an object with name and schema)")
    if "name" in spec and not isinstance(spec["name"], str):
        raise Invalid("response_format.json_schema.name: must be string")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise Invalid("response_format.json_schema.strict: must be boolean")
    schema = spec.get("schema", {"type": "object"})
    return _schema(schema, "response_format.json_schema.schema")


def _structured_outputs(so: Any) -> dict | None:
    field = "structured_outputs"
    if not isinstance(so, dict):
        raise Invalid(f"{field}: must be object, got {type(so).__name__}")
    unknown = sorted(set(so) - _SO_KEYS)
    if unknown:
        raise Invalid(f"{field}.{unknown[0]}: not a structured_outputs field")
    for key in ("whitespace_pattern", "structural_tag"):
        if so.get(key) is not None:
            raise Invalid(f"{field}.{key}: not supported")
    forms = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(forms) != 1:
        raise Invalid(f"{field}: exactly one of json, regex, choice, grammar, json_object, got {len(forms)}")
    kind, value = forms[0], so[forms[0]]
    if kind == "json":
        return _schema(value, f"{field}.json", bool(so.get("disable_additional_properties")))
    if kind == "json_object":
        return _schema({"type": "object"}, f"{field}.json_object")
    if kind == "regex":
        return _regex(value, f"{field}.regex")
    if kind == "choice":
        return _choice(value, f"{field}.choice")
    return _lark(value, f"{field}.grammar")


def request_grammar(r) -> str:
    """The grammar of an OpenAI / vLLM request model's structured-output fields (openai_models.Request),
    "" for none; Invalid naming the field when bad or when more than one is set."""
    backend = r.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise Invalid(
            f"guided_decoding_backend: only {', '.join(BACKENDS)} (llguidance is the engine), got {backend!r}"
        )
    found = []
    if r.response_format is not None:
        g = _response_format(r.response_format)
        if g is not None:
            found.append(("response_format", g))
    if r.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(r.structured_outputs)))
    if r.guided_json is not None:
        found.append(("guided_json", _schema(r.guided_json, "guided_json")))
    if r.guided_regex is not None:
        found.append(("guided_regex", _regex(r.guided_regex, "guided_regex")))
    if r.guided_choice is not None:
        found.append(("guided_choice", _choice(r.guided_choice, "guided_choice")))
    if r.guided_grammar is not None:
        found.append(("guided_grammar", _lark(r.guided_grammar, "guided_grammar")))
    if len(found) > 1:
        raise Invalid(f"{found[1][0]}: only one structured output per request (also got {found[0][0]})")
    return _text([found[0][1]]) if found else ""


def _text(grammars: list[dict]) -> str:
    return json.dumps({"grammars": grammars}, separators=(",", ":"))


def check_grammar(grammar: str, field: str) -> None:
    """Invalid naming `field` when `grammar` (llguidance JSON or Lark text) does not compile."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise Invalid(f"{field}: {error.strip()}")


_MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def _marker_ids(tokenizer: Tokenizer) -> dict[str, str]:
    ids = {}
    for marker in _MARKERS:
        if marker not in tokenizer.special_tokens:
            raise Invalid(f"tool_choice: the tokenizer has no {marker} token (the Kimi K2 tool-call format)")
        ids[marker] = f"<[{tokenizer.special_tokens[marker]}]>"
    return ids


def _calls(tools: list[dict], name: str | None, ids: dict[str, str], schemas: bool) -> tuple[list[dict], str]:
    """(argument grammars, the Lark rule `call`) of the declared tools (only `name`'s when given): a call
    names a declared tool, and its arguments are its `parameters` schema (schemas=True, or the tool's
    `strict: true`), else any JSON object."""
    grammars, calls = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") if schemas or fn.get("strict") else None
        schema = _schema(params if params is not None else {"type": "object"}, f"tools[{i}].function.parameters")
        grammars.append({"name": f"args_{i}", **schema})
        head = json.dumps(f"functions.{fn.get('name')}:")
        calls.append(
            f"{ids['<|tool_call_begin|>']} {head} INDEX {ids['<|tool_call_argument_begin|>']} @args_{i} "
            f"{ids['<|tool_call_end|>']}"
        )
    if not calls:
        raise Invalid(f"tool_choice.function.name: no declared tool is named {name!r}")
    return grammars, "call: " + " | ".join(calls)


def tool_grammar(tools: list[dict], name: str | None, tokenizer: Tokenizer, parallel: bool = True) -> str:
    """A forced Kimi K2 tool-call section: one call of `name`, or (name None: tool_choice required) 1 to
    MAX_FORCED_CALLS calls of any declared tool (1 when not `parallel`), each call's arguments valid for its
    `parameters` schema."""
    ids = _marker_ids(tokenizer)
    grammars, call = _calls(tools, name, ids, schemas=True)
    repeat = "" if name is not None or not parallel else f"{{1,{MAX_FORCED_CALLS}}}"
    lark = "\n".join(
        [
            f"start: {ids['<|tool_calls_section_begin|>']} call{repeat} {ids['<|tool_calls_section_end|>']}",
            call,
            "INDEX: /[0-9]|[1-9][0-9]/",
        ]
    )
    grammar = _text([{"lark_grammar": lark}, *grammars])
    check_grammar(grammar, "tool_choice")
    return grammar


def auto_tool_grammar(tools: list[dict], tokenizer: Tokenizer, parallel: bool = True) -> str:
    """tool_choice auto: free text, and at most one Kimi K2 tool-call section whose calls name declared
    tools only (one call when not `parallel`); a call's arguments are a JSON object, its `parameters` schema
    when the tool is `strict`. Text may follow the section, so the grammar never ends by itself (min_tokens
    stays possible). Special tokens are never text: the section's markers appear only as the grammar
    places them."""
    ids = _marker_ids(tokenizer)
    grammars, call = _calls(tools, None, ids, schemas=False)
    repeat = "+" if parallel else ""
    lark = "\n".join(
        [
            f"start: TEXT? ({ids['<|tool_calls_section_begin|>']} call{repeat} "
            f"{ids['<|tool_calls_section_end|>']} TEXT?)?",
            call,
            "INDEX: /[0-9]|[1-9][0-9]/",
            "TEXT: /(?s:.+)/",
        ]
    )
    grammar = _text([{"lark_grammar": lark}, *grammars])
    check_grammar(grammar, "tools")
    return grammar


def after_reasoning(grammar: str, tokenizer: Tokenizer, field: str = "grammar") -> str:
    """`grammar` (already checked: check_grammar) behind a free reasoning block that ends at `</think>`
    (the prompt opened one). Invalid naming `field` when its shape does not allow the wrapping."""
    think_end = tokenizer.special_tokens.get("</think>")
    if think_end is None:
        return grammar
    try:
        parsed = json.loads(grammar)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        grammars = [{"lark_grammar": grammar}]  # Lark text
    else:
        grammars = parsed.get("grammars")
        if not isinstance(grammars, list) or not grammars or not all(isinstance(g, dict) for g in grammars):
            raise Invalid(f"{field}: grammars must be a non-empty array of grammar objects")
    first = grammars[0]
    name = first.get("name")
    if name is None:  # the answer's grammar gets a name the others do not use
        taken = {g.get("name") for g in grammars}
        name = next(f"answer{i or ''}" for i in range(len(grammars) + 1) if f"answer{i or ''}" not in taken)
    elif not isinstance(name, str) or not name.isidentifier():
        raise Invalid(f"{field}: grammars[0].name must be an identifier after a prompt that opens a think block")
    top = {"lark_grammar": f"start: REASONING <[{think_end}]> @{name}\nREASONING: /(?s:.*)/"}
    return _text([top, {**first, "name": name}, *grammars[1:]])
