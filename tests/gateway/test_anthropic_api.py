"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` client: the real gateway in front of a FAKE verifier that streams scripted token ids, so
thinking, tool use, stop sequences and errors are exact; the last test runs it on the real stack."""

from __future__ import annotations

import http.client
import json
import socket
import time

import anthropic
import grpc
import openai
import pytest

from ddtree.protocol.ddtree.v1 import common_pb2
from tests.support.fakes import REASONING_OUT, TOOL_OUT, script_for, serve_gateway

KEY = "sk-anthropic-test"
MODEL = "ddtree-demo"
IM_END = 2
USAGE = common_pb2.Usage(
    prompt_tokens=3, completion_tokens=9, verify_steps=4, avg_accept_length=2.25, accept_histogram=[0, 1, 2, 1]
)
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    fake.max_context = 4096  # thinking with a budget needs max_tokens > 1024 (Anthropic's minimum budget)
    yield from serve_gateway(
        fake, tokenizer_dir, max_prompt_chars=10_000, max_prompt_tokens=1500, max_body_bytes=64 * 1024, api_key=KEY
    )


@pytest.fixture(scope="module")
def client(gw):
    return anthropic.Anthropic(base_url=f"http://{gw.http_address}", api_key=KEY, max_retries=0, timeout=20)


def _user(text="2+2?"):
    return [{"role": "user", "content": text}]


def _prompt(fake, tok) -> str:
    return tok.decode(fake.requests[-1].input_ids)


def _http(address, path, body, headers=None):
    """(status, body bytes) of one raw POST; the key goes as x-api-key unless headers say otherwise."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    sent = {"Content-Type": "application/json", "x-api-key": KEY, **(headers or {})}
    payload = body if isinstance(body, (str, bytes)) else json.dumps(body)
    conn.request("POST", path, body=payload, headers={k: v for k, v in sent.items() if v is not None})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _sse(data: bytes) -> list[tuple[str, dict]]:
    """(event name, data) pairs of an Anthropic stream; every event line names its data's type."""
    out = []
    for block in data.decode().strip().split("\n\n"):
        name, payload = block.split("\n")
        assert name.startswith("event: ") and payload.startswith("data: "), block
        event = json.loads(payload[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        out.append((event["type"], event))
    return out


# -- answers: thinking, text, usage, the template switches ----------------------------------------------------
def test_message_with_thinking(client, fake, tok):
    fake.reset(script_for(tok.encode(REASONING_OUT) + [IM_END], finish="stop", usage=USAGE))
    r = client.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=_user())
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (r.content[0].thinking, r.content[0].signature, r.content[1].text) == (
        "Let me think. 2+2 is 4.",
        "",
        "The answer is 4.",
    )
    assert (r.role, r.type, r.model, r.stop_reason, r.stop_sequence) == (
        "assistant",
        "message",
        MODEL,
        "end_turn",
        None,
    )
    assert (r.usage.input_tokens, r.usage.output_tokens) == (3, 9) and r.id.startswith("msg_")
    assert r.model_extra["spec"]["avg_accept_length"] == 2.25
    prompt = _prompt(fake, tok)
    assert prompt.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>2+2?")
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert fake.requests[-1].max_new_tokens == 64

    # thinking disabled: the template closes the think block in the prompt; the answer is one text block.
    fake.reset(script_for(tok.encode("Plain."), finish="length"))
    r = client.messages.create(
        model=MODEL,
        max_tokens=5,
        messages=_user(),
        thinking={"type": "disabled"},
        system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}],
    )
    assert [(b.type, b.text) for b in r.content] == [("text", "Plain.")] and r.stop_reason == "max_tokens"
    prompt = _prompt(fake, tok)
    assert prompt.startswith("<|im_system|>system<|im_middle|>One.\nTwo.<|im_end|>")
    assert prompt.endswith("<|im_middle|><think></think>")
    # thinking enabled with a budget: the template opens the think block.
    fake.reset(script_for(tok.encode(REASONING_OUT), finish="length"))
    r = client.messages.create(
        model=MODEL, max_tokens=2048, messages=_user(), thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert _prompt(fake, tok).endswith("<|im_middle|><think>") and r.content[0].type == "thinking"


def test_stream_event_sequence(gw, client, fake, tok):
    fake.reset(script_for(tok.encode(REASONING_OUT) + [IM_END], finish="stop", usage=USAGE))
    status, data = _http(gw.http_address, "/v1/messages", {"max_tokens": 64, "messages": _user(), "stream": True})
    assert status == 200
    events = _sse(data)
    kinds = [k for k, _ in events]
    # message_start, ping, a thinking block, a text block, message_delta, message_stop, nothing else.
    n_thinking = kinds.index("content_block_stop") - 3
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and n_thinking >= 1
    assert kinds[3 : 3 + n_thinking] == ["content_block_delta"] * n_thinking
    rest = kinds[3 + n_thinking :]
    assert rest[:2] == ["content_block_stop", "content_block_start"] and rest[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(rest[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": len(fake.requests[-1].input_ids), "output_tokens": 0}
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    blocks = [e for k, e in events if k == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [(0, "thinking"), (1, "text")]
    deltas = [e for k, e in events if k == "content_block_delta"]
    thinking = "".join(d["delta"]["thinking"] for d in deltas if d["index"] == 0)
    text = "".join(d["delta"]["text"] for d in deltas if d["index"] == 1)
    assert (thinking, text) == ("Let me think. 2+2 is 4.", "The answer is 4.")
    assert {d["delta"]["type"] for d in deltas if d["index"] == 0} == {"thinking_delta"}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 3, "output_tokens": 9}

    # The client's stream helper folds the same events into the same message as the non-streaming call.
    fake.reset(script_for(tok.encode(REASONING_OUT) + [IM_END], finish="stop", usage=USAGE))
    with client.messages.stream(model=MODEL, max_tokens=64, messages=_user()) as s:
        streamed_text = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed_text == "The answer is 4."
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == thinking
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 9


# -- tool use ---------------------------------------------------------------------------------------------------
def test_tool_use_round_trip(client, fake, tok):
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    question = _user("Weather in Paris and Lyon?")
    r = client.messages.create(model=MODEL, max_tokens=128, messages=question, tools=TOOLS)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use", "tool_use"]
    assert r.content[0].thinking == "I should call the tool."
    assert [(b.id, b.name, b.input) for b in r.content[1:]] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}),
        ("functions.get_weather:1", "get_weather", {"city": "Lyon"}),
    ]
    prompt = _prompt(fake, tok)
    declared = json.loads(prompt.split("tool_declare<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0])
    assert declared == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]

    # The results go back as tool_result blocks; the assistant turn (blocks as the client got them) is
    # rendered with its reasoning and calls, and new ids continue the count.
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    history = question + [
        {"role": "assistant", "content": r.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": r.content[1].id, "content": "rain"},
                {
                    "type": "tool_result",
                    "tool_use_id": r.content[2].id,
                    "content": [{"type": "text", "text": "no such city"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    r2 = client.messages.create(model=MODEL, max_tokens=128, messages=history, tools=TOOLS)
    prompt = _prompt(fake, tok)
    assert (
        "<|im_assistant|>assistant<|im_middle|><think>I should call the tool.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    ) in prompt
    assert "## Return of functions.get_weather:0\nrain<|im_end|>" in prompt
    assert "## Return of functions.get_weather:1\nError: no such city<|im_end|>" in prompt
    assert prompt.endswith(
        "<|im_user|>user<|im_middle|>And tomorrow?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    assert r2.stop_reason == "tool_use" and len(r2.content) == 3

    # Anthropic's own ids (toolu_...) are renamed to Kimi's form, and their results follow them.
    fake.reset(script_for(tok.encode("Sunny."), finish="length"))
    client.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=TOOLS,
        messages=question
        + [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "sun"}]},
        ],
    )
    prompt = _prompt(fake, tok)
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}" in prompt
    assert "## Return of functions.get_weather:0\nsun" in prompt and "toolu_01A" not in prompt


def test_tool_use_stream(gw, client, fake, tok):
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    body = {"max_tokens": 128, "messages": _user("Weather?"), "tools": TOOLS, "stream": True}
    events = _sse(_http(gw.http_address, "/v1/messages", body)[1])
    blocks = [e for k, e in events if k == "content_block_start"]
    assert [b["content_block"] for b in blocks] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "functions.get_weather:1", "name": "get_weather", "input": {}},
    ]
    args = {1: "", 2: ""}
    for k, e in events:
        if k == "content_block_delta" and e["index"] in args:
            assert e["delta"]["type"] == "input_json_delta"
            args[e["index"]] += e["delta"]["partial_json"]
    assert args == {1: '{"city": "Paris"}', 2: '{"city": "Lyon"}'}
    # Each block stops before the next starts.
    order = [(k, e["index"]) for k, e in events if k in ("content_block_start", "content_block_stop")]
    assert order == [(k, i) for i in range(3) for k in ("content_block_start", "content_block_stop")]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    with client.messages.stream(model=MODEL, max_tokens=128, messages=_user("Weather?"), tools=TOOLS) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}, {"city": "Lyon"}]

    # tool_choice none: the tools are not declared and nothing is parsed as a call.
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    r = client.messages.create(model=MODEL, max_tokens=8, messages=_user(), tools=TOOLS, tool_choice={"type": "none"})
    assert "tool_declare" not in _prompt(fake, tok)
    assert r.stop_reason == "end_turn" and "tool_use" not in [b.type for b in r.content]


# -- stop sequences, parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "section"),
    [({"type": "any"}, "call{1,8}"), ({"type": "tool", "name": "get_weather"}, "call <")],
)
def test_tool_choice_any_and_tool_force_the_call(client, fake, tok, choice, section):
    """any = OpenAI's required (1 to 8 calls), tool = one call of that tool: both through the forced
    tool-call grammar (structured_outputs.tool_grammar), behind the think block the prompt opened."""
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    r = client.messages.create(model=MODEL, max_tokens=128, messages=_user(), tools=TOOLS, tool_choice=choice)
    assert r.stop_reason == "tool_use" and [b.input for b in r.content if b.type == "tool_use"][0] == {"city": "Paris"}
    grammars = json.loads(fake.requests[-1].grammar)["grammars"]
    assert "REASONING" in grammars[0]["lark_grammar"] and section in grammars[1]["lark_grammar"]
    assert grammars[2]["json_schema"]["required"] == ["city"]


def test_stop_sequences(gw, client, fake, tok):
    out = "The answer is 42. END of the story."
    fake.reset(script_for(tok.encode(out), finish="length"), delay_s=0.002)
    r = client.messages.create(
        model=MODEL, max_tokens=64, messages=_user(), stop_sequences=["never", "42. END"], thinking={"type": "disabled"}
    )
    assert [b.text for b in r.content] == ["The answer is "]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "42. END")
    assert fake.aborts == [fake.requests[-1].request_id]
    # Two stop sequences in the output: the earlier one ends it, whatever their order in the request.
    fake.reset(script_for(tok.encode(out), finish="length"))
    r = client.messages.create(
        model=MODEL, max_tokens=64, messages=_user(), stop_sequences=["story", "answer"], thinking={"type": "disabled"}
    )
    assert (r.content[0].text, r.stop_sequence) == ("The ", "answer")
    # Streaming: the message_delta names it.
    fake.reset(script_for(tok.encode(out), finish="length"))
    body = {"max_tokens": 64, "messages": _user(), "stop_sequences": ["END"], "stream": True}
    body["thinking"] = {"type": "disabled"}
    events = _sse(_http(gw.http_address, "/v1/messages", body)[1])
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert text == "The answer is 42. " and events[-2][1]["delta"] == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
    }
    # An end-of-turn token with stop sequences that never matched: end_turn, no stop_sequence.
    fake.reset(script_for(tok.encode("fine") + [IM_END], finish="stop"))
    r = client.messages.create(
        model=MODEL, max_tokens=64, messages=_user(), stop_sequences=["zzz"], thinking={"type": "disabled"}
    )
    assert (r.content[0].text, r.stop_reason, r.stop_sequence) == ("fine", "end_turn", None)


def test_parameters_reach_the_verifier(client, fake, tok):
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.messages.create(
        model=MODEL,
        max_tokens=33,
        messages=_user(),
        stop_sequences=["x"],
        metadata={"user_id": "agent-7"},
        service_tier="auto",
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},  # the current client no longer lists them
    )
    req = fake.requests[-1]
    assert req.max_new_tokens == 33 and abs(req.sampling.temperature - 0.5) < 1e-6
    assert abs(req.sampling.top_p - 0.9) < 1e-6 and req.sampling.top_k == 40
    assert list(req.stop_token_ids) == [IM_END, 1] and not req.ignore_eos
    # cache_control is accepted on blocks and tools (the prefix cache needs no hint) and changes nothing.
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    cached = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    tools = [dict(TOOLS[0], cache_control={"type": "ephemeral"})]
    client.messages.create(model=MODEL, max_tokens=4, messages=_user(), system=cached, tools=tools)
    with_hint = list(fake.requests[-1].input_ids)
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.messages.create(model=MODEL, max_tokens=4, messages=_user(), system="Be brief.", tools=TOOLS)
    assert list(fake.requests[-1].input_ids) == with_hint
    # Anthropic's defaults: temperature 1, top_p 1, no top-k.
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.messages.create(model=MODEL, max_tokens=4, messages=_user())
    req = fake.requests[-1]
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.max_new_tokens) == (1.0, 1.0, 0, 4)


def test_count_tokens(client, fake, tok):
    messages = _user("Weather in Paris?")
    n = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS, system="Be brief.")
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=TOOLS, system="Be brief.")
    assert n.input_tokens == len(fake.requests[-1].input_ids) > 20
    fewer = client.messages.count_tokens(model=MODEL, messages=messages)
    assert fewer.input_tokens < n.input_tokens  # no tool declarations, the default system prompt


# -- keys and errors ---------------------------------------------------------------------------------------------
def test_keys(gw, fake, tok):
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    bearer = anthropic.Anthropic(base_url=f"http://{gw.http_address}", auth_token=KEY, max_retries=0, timeout=20)
    r = bearer.messages.create(model=MODEL, max_tokens=4, messages=_user(), thinking={"type": "disabled"})
    assert r.content[0].text == "ok"
    fake.reset([])
    wrong = anthropic.Anthropic(base_url=f"http://{gw.http_address}", api_key="wrong", max_retries=0, timeout=20)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=_user())
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    status, data = _http(gw.http_address, "/v1/messages", {"max_tokens": 4, "messages": _user()}, {"x-api-key": None})
    assert status == 401 and "x-api-key" in json.loads(data)["error"]["message"]
    assert fake.requests == []


BAD = [
    ("malformed JSON", '{"messages": [', 400, "request body is not valid JSON"),
    ("no max_tokens", {"messages": _user()}, 400, "max_tokens: is required"),
    ("max_tokens 0", {"messages": _user(), "max_tokens": 0}, 400, "max_tokens: must be in [1, "),
    ("max_tokens float", {"messages": _user(), "max_tokens": 4.0}, 400, "max_tokens: must be an integer, got number"),
    (
        "temperature string",
        {"messages": _user(), "max_tokens": 4, "temperature": "hot"},
        400,
        "temperature: must be a number",
    ),
    ("top_p 0", {"messages": _user(), "max_tokens": 4, "top_p": 0}, 400, "top_p: must be in (0, 1]"),
    ("no messages", {"max_tokens": 4}, 400, "messages: is required"),
    ("empty messages", {"max_tokens": 4, "messages": []}, 400, "messages: must not be empty"),
    (
        "unknown field",
        {"max_tokens": 4, "messages": _user(), "n": 2},
        400,
        "n: not supported in a Messages request (fields: max_tokens, messages, metadata",
    ),
    ("container", {"max_tokens": 4, "messages": _user(), "container": "c"}, 400, "container: not supported"),
    (
        "system role",
        {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        400,
        "messages[0].role: must be 'user' or 'assistant'",
    ),
    (
        "image",
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "messages[0].content[0].type: 'image' blocks are not supported",
    ),
    (
        "prefill",
        {"max_tokens": 4, "messages": _user() + [{"role": "assistant", "content": "The"}]},
        400,
        "messages[1]: a final assistant turn (prefill) is not supported",
    ),
    (
        "orphan tool_result",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
        },
        400,
        "messages[0].content[0].tool_use_id: 't1' answers no tool_use",
    ),
    (
        "tool_use input not an object",
        {
            "max_tokens": 4,
            "messages": _user()
            + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]
            + _user(),
        },
        400,
        "messages[1].content[0].input: must be an object, got string",
    ),
    (
        "tool_choice any without tools",
        {"max_tokens": 4, "messages": _user(), "tool_choice": {"type": "any"}},
        400,
        "tool_choice.type: 'any' needs tools",
    ),
    (
        "tool_choice tool unknown",
        {"max_tokens": 4, "messages": _user(), "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        400,
        "tool_choice.name: no declared tool is named 'nope'",
    ),
    (
        "tool_choice tool without name",
        {"max_tokens": 4, "messages": _user(), "tools": TOOLS, "tool_choice": {"type": "tool"}},
        400,
        "tool_choice.name",
    ),
    (
        "tool_choice any with min_tokens-free grammar but a name",
        {"max_tokens": 4, "messages": _user(), "tools": TOOLS, "tool_choice": {"type": "any", "name": "get_weather"}},
        400,
        "tool_choice.name",
    ),
    (
        "server tool",
        {"max_tokens": 4, "messages": _user(), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "tools[0].type: server tool 'web_search_20250305' is not supported",
    ),
    (
        "tool schema",
        {"max_tokens": 4, "messages": _user(), "tools": [{"name": "f", "input_schema": {"type": "banana"}}]},
        400,
        "tools[0].input_schema.type: must be one of",
    ),
    (
        "tool name",
        {"max_tokens": 4, "messages": _user(), "tools": [{"name": "a b", "input_schema": {}}]},
        400,
        "tools[0].name:",
    ),
    (
        "thinking budget",
        {"max_tokens": 4096, "messages": _user(), "thinking": {"type": "enabled", "budget_tokens": 100}},
        400,
        "thinking.budget_tokens: must be >= 1024",
    ),
    (
        "thinking budget over max_tokens",
        {"max_tokens": 1024, "messages": _user(), "thinking": {"type": "enabled", "budget_tokens": 1024}},
        400,
        "thinking.budget_tokens: must be less than max_tokens (1024)",
    ),
    (
        "stop_sequences",
        {"max_tokens": 4, "messages": _user(), "stop_sequences": [""]},
        400,
        "stop_sequences[0]: must be 1 to",
    ),
    (
        "cache_control",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": 1}]}],
        },
        400,
        "messages[0].content[0].cache_control: must be an object, got number",
    ),
    (
        "metadata",
        {"max_tokens": 4, "messages": _user(), "metadata": {"tag": "x"}},
        400,
        "metadata.tag: not supported in metadata (fields: user_id)",
    ),
    (
        "model",
        {"model": "claude-opus-4", "max_tokens": 4, "messages": _user()},
        404,
        "model 'claude-opus-4' does not exist",
    ),
]


@pytest.mark.parametrize("body, status, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(gw, fake, body, status, message):
    fake.reset([])
    got, data = _http(gw.http_address, "/v1/messages", body)
    error = json.loads(data)
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert (got, error["type"], error["error"]["type"]) == (status, "error", kind), error
    assert message in error["error"]["message"], error
    assert fake.requests == []


def test_errors_through_the_client(client, fake, tok):
    fake.reset([])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=_user(), tool_choice={"type": "tool", "name": "nope"}, tools=TOOLS
        )
    assert e.value.status_code == 400 and "tool_choice.name" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-x", messages=_user())
    assert fake.requests == []


def test_verifier_errors(gw, fake, tok):
    fake.reset([], error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 256 requests waiting"))
    for stream in (False, True):
        status, data = _http(gw.http_address, "/v1/messages", {"max_tokens": 4, "messages": _user(), "stream": stream})
        assert status == 429 and json.loads(data) == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "queue full: 256 requests waiting"},
        }
    # After the stream started: an error event ends it.
    script = script_for(tok.encode("partial"))
    script[-1].finish_reason = ""
    fake.reset(script, error=(grpc.StatusCode.UNAVAILABLE, "verifier going away"))
    body = {"max_tokens": 64, "messages": _user(), "stream": True, "thinking": {"type": "disabled"}}
    status, data = _http(gw.http_address, "/v1/messages", body)
    events = _sse(data)
    assert status == 200 and events[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "verifier going away"}},
    )
    assert "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta") == "partial"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_verifier_call(gw, fake, tok, stream):
    fake.reset(script_for(tok.encode("word " * 40)), delay_s=0.5)
    host, port = gw.http_address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    payload = json.dumps({"max_tokens": 100, "messages": _user(), "stream": stream}).encode()
    sock.sendall(
        f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    if stream:
        received = b""
        while b"content_block_delta" not in received:  # the first tokens arrived
            received += sock.recv(65536)
    else:
        time.sleep(0.3)  # the request is running
    sock.close()
    assert fake.cancelled.wait(5), "the verifier call was not cancelled"
    assert fake.sent < 40
    deadline = time.monotonic() + 5
    while gw.router.snapshot()[0]["outstanding"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.router.snapshot()[0]["outstanding"] == 0


# -- the real stack ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_messages_on_the_real_stack(oracle_stack):
    base = f"http://{oracle_stack.gateway_http}"
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    kwargs = {"model": MODEL, "max_tokens": 12, "messages": messages, "extra_body": {"temperature": 0}}
    r = client.messages.create(**kwargs)
    assert r.stop_reason in ("end_turn", "max_tokens") and 1 <= r.usage.output_tokens <= 12
    assert r.usage.input_tokens == client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert r.model_extra["spec"]["verify_steps"] >= 1
    answer = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content]

    # Streaming, greedy: the same blocks.
    with client.messages.stream(**kwargs) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == answer
    assert (final.stop_reason, final.usage.output_tokens) == (r.stop_reason, r.usage.output_tokens)

    # The OpenAI route gives the same answer for the same request.
    oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    c = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    m = c.choices[0].message
    expected = [("thinking", m.model_extra.get("reasoning_content")), ("text", m.content)]
    assert answer == [(k, v) for k, v in expected if v]
    assert c.usage.completion_tokens == r.usage.output_tokens
