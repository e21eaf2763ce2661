"""Tool calls constrained by the request's tools (services/gateway/structured_outputs.py, pipeline.chat_job).

- Under `tool_choice: auto` the grammar the verifier enforces (its mask at every tree node) lets a tool-call
  section name declared tools only, with JSON-object arguments, the declared schema for a `strict` tool;
  `parallel_tool_calls: false` lets it hold one call. 50 seeded walks of an adversarial "model" under the
  mask (it tries to call undeclared tools, break the arguments, call twice; where the mask refuses its
  token it takes a random allowed one), parsed by the production Kimi K2 tool parser: no undeclared name,
  every argument a JSON object, strict arguments valid for their schema (jsonschema), one call at most
  without parallel calls.
- Through the gateway over a FAKE verifier (the official openai and anthropic clients): the grammar that
  reaches the verifier accepts a declared call and refuses an undeclared one, a second call without
  parallel calls, and nothing is constrained without tools.
"""

from __future__ import annotations

import json
import random

import anthropic
import jsonschema
import llguidance
import numpy as np
import pytest

from ddtree.gateway.parsers.kimi_k2_tools import parse_tool_calls
from ddtree.gateway.structured_outputs import auto_tool_grammar, tool_grammar
from ddtree.tokenization.grammar_vocab import ll_tokenizer
from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}},
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    },
]
DECLARED = {"get_weather", "search"}


def _call(name: str, args: str, index: int = 0) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def _section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


# What the adversarial model tries to write.
ATTEMPTS = [
    "Let me check. " + _section(_call("get_currency", '{"from": "EUR"}')),
    _section(_call("get_weather", '{"city": 5, "extra": true}')),
    _section(_call("get_weather", '{"city":"Paris"}'), _call("get_weather", '{"city":"Lyon"}', 1)),
    _section(_call("search", "not json at all")),
    _section(_call("weather", '{"city":"Oslo"}')),
    "Just an answer, no tools.",
    _section(_call("search", '{"q":"x"}'), _call("get_time", "{}", 1)),
]


@pytest.fixture(scope="module")
def ll(tok):
    return ll_tokenizer(tok)


def _allowed(matcher) -> np.ndarray:
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)


def _walk(tok, ll, grammar: str, attempt: str, rng: random.Random, max_steps: int = 400) -> str:
    """The text an adversarial model writes under the grammar's mask: its attempt's next token when allowed,
    else a random allowed token (special tokens and JSON punctuation favoured, so that sections and
    arguments close); after the attempt, until the grammar accepts with the section closed or text written."""
    m = llguidance.LLMatcher(ll, grammar)
    script, out = tok.encode(attempt, allow_special=True), []
    favoured = {tok.special_tokens[t] for t in ("<|tool_call_end|>", "<|tool_calls_section_end|>")}
    favoured |= {i for i in range(tok.vocab_size) if not tok.is_special(i) and tok.decode([i]) in ('"', "}", '"}')}
    eos = tok.eos_id if tok.eos_id is not None else tok.special_tokens["<|im_end|>"]
    for _ in range(max_steps):
        allowed = _allowed(m)
        if script:
            want = script.pop(0)
            if allowed[want]:
                assert m.consume_token(want), m.get_error()
                out.append(want)
                continue
        elif m.is_accepting():
            break
        ids = [i for i in np.flatnonzero(allowed[: tok.vocab_size]).tolist() if i != eos]
        assert ids, "the grammar allows nothing before it accepts"
        good = [i for i in ids if i in favoured]
        choice = rng.choice(good) if good and rng.random() < 0.7 else rng.choice(ids)
        assert m.consume_token(choice), m.get_error()
        out.append(choice)
    return tok.decode(out, skip_special=False)


def test_fifty_seeded_walks_under_auto_never_call_an_undeclared_tool(tok, ll):
    calls_seen = 0
    for seed in range(50):
        rng = random.Random(seed)
        parallel = seed % 3 != 0
        grammar = auto_tool_grammar(TOOLS, tok, parallel=parallel)
        attempt = ATTEMPTS[seed % len(ATTEMPTS)]
        text = _walk(tok, ll, grammar, attempt, rng)
        _, calls = parse_tool_calls(text)
        assert parallel or len(calls) <= 1, (seed, text)
        for c in calls:
            assert c.name in DECLARED, (seed, text)
            args = json.loads(c.arguments)
            assert isinstance(args, dict), (seed, text)
            if c.name == "get_weather":
                jsonschema.validate(args, WEATHER_SCHEMA)
        calls_seen += len(calls)
    assert calls_seen >= 30  # the walks did call tools: the checks above were not vacuous


def test_required_without_parallel_calls_is_one_call(tok, ll):
    grammar = tool_grammar(TOOLS, None, tok, parallel=False)
    m = llguidance.LLMatcher(ll, grammar)
    two = _section(_call("get_weather", '{"city":"Paris"}'), _call("search", '{"q":"x"}', 1))
    ids = tok.encode(two, allow_special=True)
    consumed = 0
    while consumed < len(ids) and m.consume_token(ids[consumed]):
        consumed += 1
    assert tok.decode(ids[:consumed], skip_special=False).endswith("<|tool_call_end|>")  # refused at the 2nd call


# -- through the gateway --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


def _accepts(tok, ll, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    return all(m.consume_token(t) for t in tok.encode(text, allow_special=True)) and m.is_accepting()


def test_the_verifier_gets_the_auto_grammar(gw, fake, tok, ll):
    client = openai_client(gw)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    no_think = {"chat_template_kwargs": {"thinking": False}}
    good = "Sure. " + _section(_call("get_weather", '{"city":"Paris"}'))
    two = _section(_call("get_weather", '{"city":"Paris"}'), _call("search", '{"q":"x"}', 1))
    undeclared = _section(_call("get_currency", "{}"))
    for parallel in (True, False):
        fake.reset(script_for(tok.encode("ok")))
        client.chat.completions.create(
            model=MODEL, messages=user, tools=TOOLS, parallel_tool_calls=parallel, extra_body=no_think
        )
        grammar = fake.requests[-1].grammar
        assert grammar and _accepts(tok, ll, grammar, good) and _accepts(tok, ll, grammar, "plain text")
        assert not _accepts(tok, ll, grammar, undeclared)
        assert _accepts(tok, ll, grammar, two) == parallel
    fake.reset(script_for(tok.encode("ok")))
    client.chat.completions.create(model=MODEL, messages=user, extra_body=no_think)
    assert fake.requests[-1].grammar == ""  # no tools: nothing constrained
    fake.reset(script_for(tok.encode("ok")))
    client.chat.completions.create(model=MODEL, messages=user, tools=TOOLS, tool_choice="none", extra_body=no_think)
    assert fake.requests[-1].grammar == ""
    fake.reset(script_for(tok.encode("ok")))  # thinking on: the constraint starts after </think>
    client.chat.completions.create(model=MODEL, messages=user, tools=TOOLS)
    assert _accepts(tok, ll, fake.requests[-1].grammar, "Hmm.</think>" + good)
    assert not _accepts(tok, ll, fake.requests[-1].grammar, "Hmm.</think>" + undeclared)


def test_anthropic_strict_and_disable_parallel_tool_use(gw, fake, tok, ll):
    claude = anthropic.Anthropic(base_url=f"http://{gw.http_address}", api_key="none", max_retries=0, timeout=20)
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA, "strict": True}]
    fake.reset(script_for(tok.encode("ok")))
    claude.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=tools,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Weather?"}],
    )
    grammar = fake.requests[-1].grammar
    assert _accepts(tok, ll, grammar, _section(_call("get_weather", '{"city":"Paris"}')))
    assert not _accepts(tok, ll, grammar, _section(_call("get_weather", '{"town":"Paris"}')))  # strict: the schema
    two = _section(_call("get_weather", '{"city":"Paris"}'), _call("get_weather", '{"city":"Lyon"}', 1))
    assert not _accepts(tok, ll, grammar, two)
