"""OpenAI's Responses API (`POST /v1/responses`, services/gateway/api/responses_api.py) with the official openai
client against the gateway over a FAKE verifier (tests/support/fakes.py): text with reasoning, function
calls, the stream's events, function-call items and their outputs as input, the limit, and the 400s."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.fakes import REASONING_OUT, TOOL_OUT, openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
IM_END = 2
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


def _prompt(fake, tok) -> str:
    return tok.decode(list(fake.requests[-1].input_ids), skip_special=False)


def test_text_with_reasoning(client, fake, tok):
    fake.reset(script_for(tok.encode(REASONING_OUT) + [IM_END], finish="stop"))
    r = client.responses.create(model=MODEL, input="2+2?", instructions="Be brief.", max_output_tokens=64)
    assert r.status == "completed" and r.output_text == "The answer is 4."
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think. 2+2 is 4."
    assert r.usage.output_tokens == len(tok.encode(REASONING_OUT)) + 1 and r.usage.input_tokens > 0
    prompt = _prompt(fake, tok)
    assert "Be brief." in prompt and "2+2?" in prompt and fake.requests[-1].max_new_tokens == 64


def test_function_calls_and_their_outputs(client, fake, tok):
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    r = client.responses.create(model=MODEL, input="Weather in Paris and Lyon?", tools=TOOLS)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert fake.requests[-1].grammar  # under auto, the call section names declared tools only

    fake.reset(script_for(tok.encode("Got it.</think>It is sunny.") + [IM_END], finish="stop"))
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
    ]
    r = client.responses.create(model=MODEL, input=follow, tools=TOOLS)
    assert r.output_text == "It is sunny." and "sunny, 21 C" in _prompt(fake, tok)


def test_stream_events(client, fake, tok):
    fake.reset(script_for(tok.encode(TOOL_OUT) + [IM_END], finish="stop"))
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "I should call the tool."
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"city": "Lyon"}]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call", "function_call"]

    fake.reset(script_for(tok.encode(REASONING_OUT), finish="length"))
    events = list(client.responses.create(model=MODEL, input="2+2?", stream=True, max_output_tokens=50))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "The answer is 4." and events[-1].type == "response.incomplete"


def test_the_limit_and_the_400s(client, fake, tok):
    fake.reset(script_for(tok.encode("abc"), finish="length"))
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    fake.reset(script_for(tok.encode("abc"), finish="length"))  # guidellm's body: vLLM's ignore_eos, stop null
    client.responses.create(model=MODEL, input="x", max_output_tokens=3, extra_body={"ignore_eos": True, "stop": None})
    assert fake.requests[-1].ignore_eos
    for extra, message in [
        ({"previous_response_id": "resp_1"}, "previous_response_id: not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type: only function tools"),
        ({"store": True}, "store: only False"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type: 'image' items are not supported"),
    ]:
        fake.reset(script_for([5]))
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="x", extra_body=extra)
        assert err.value.body["message"].startswith(message), err.value.body
        assert fake.requests == []
