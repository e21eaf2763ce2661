"""The OpenAI / vLLM parameter policy of the HTTP API (services/gateway/api/openai_models.py), with the
official `openai` client against the real gateway in front of a FAKE verifier (tests/support/fakes.py), so
answers are exact: every refused field is a 400 naming it, type errors are 400s, implemented fields
reach the verifier or change the text as vLLM's do, usage carries cached_tokens, X-Request-Id is
honoured and returned. tests/e2e/test_gateway_http_stack.py::test_vllm_params_on_the_real_stack runs the
verifier-side ones (min_tokens, min_p, cached_tokens) through the real services."""

from __future__ import annotations

import http.client
import json

import grpc
import openai
import pytest

from ddtree.gateway.api.openai_models import REFUSED
from ddtree.protocol.ddtree.v1 import common_pb2
from tests.support.fakes import openai_client, script_for, serve_gateway

MODEL = "ddtree-demo"
IM_END = 2
USER = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def gw(fake, tokenizer_dir):
    yield from serve_gateway(fake, tokenizer_dir, max_prompt_chars=10_000)


@pytest.fixture(scope="module")
def client(gw):
    return openai_client(gw)


# A value that is not neutral, per refused field; the chat body (completions: the prompt body) carries it.
NOT_NEUTRAL = {
    "best_of": 2,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "guided_whitespace_pattern": " ",  # structured outputs themselves: tests/verifier/test_structured_outputs.py
    "structural_tag": "{}",
    "logits_processors": ["m.f"],
    "priority": 1,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "add_special_tokens": True,
    "cache_salt": "s",
    "kv_transfer_params": {},
    "vllm_xargs": {},
    "spaces_between_special_tokens": False,
    "include_reasoning": False,
    "reasoning_effort": "low",
    "chat_template": "{{ x }}",
    "documents": [{"text": "d"}],
    "mm_processor_kwargs": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "store": True,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "suffix": "end",
    "prompt_embeds": "AAAA",
}
COMPLETION_ONLY = {"suffix", "prompt_embeds"}
CHAT_ONLY = {
    "include_reasoning",
    "reasoning_effort",
    "chat_template",
    "documents",
    "mm_processor_kwargs",
    "functions",
    "function_call",
    "store",
    "metadata",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
}


def test_every_refused_field_has_a_case():
    assert set(NOT_NEUTRAL) == set(REFUSED)


def _body(key: str, value) -> dict:
    head, _, sub = key.partition(".")
    return {head: {sub: value}} if sub else {head: value}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_refused_fields_are_400_naming_the_field(client, fake, key):
    fake.reset(script_for([5]))
    value = NOT_NEUTRAL[key]
    if key == "logprobs":  # chat: a boolean; completions: an integer
        calls = [("chat", True), ("completions", 1)]
    else:
        calls = [(api, value) for api in ("chat", "completions")]
    for api, v in calls:
        if api == "chat" and key in COMPLETION_ONLY or api == "completions" and key in CHAT_ONLY:
            continue
        extra = _body(key, v)
        with pytest.raises(openai.BadRequestError) as err:
            if api == "chat":
                client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
            else:
                client.completions.create(model=MODEL, prompt="a", extra_body=extra)
        body = err.value.body
        assert body["param"] == key and body["message"].startswith(f"{key}: "), body
        assert body["type"] == "invalid_request_error" and err.value.status_code == 400
    assert fake.requests == []  # nothing reached the verifier


def test_neutral_values_are_accepted(client, fake, tok):
    neutral = {
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1,
        "logprobs": False,
        "top_logprobs": 0,
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
        "spaces_between_special_tokens": True,
        "add_special_tokens": False,
        "use_beam_search": False,
        "store": False,
        "a_field_nobody_knows": {"x": 1},  # unknown: ignored with a warning log, as vLLM does
        "chat_template_kwargs": {"thinking": False},
    }
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    r = client.chat.completions.create(model=MODEL, messages=USER, extra_body=neutral)
    assert r.choices[0].message.content == "ok"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"temperature": "x"}, "temperature: must be number, got string"),
        ({"max_tokens": 4.0}, "max_tokens: must be integer, got number"),
        ({"max_tokens": True}, "max_tokens: must be integer, got boolean"),
        ({"top_p": 0}, "top_p: must be in (0, 1], got 0"),
        ({"top_p": 1.01}, "top_p: must be in (0, 1]"),
        ({"min_p": 1.5}, "min_p: must be in [0, 1]"),
        ({"min_tokens": -1}, "min_tokens: must be in [0, "),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens: must be <= max_tokens (8), got 9"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens: must be boolean, got string"),
        ({"stop": [1]}, "stop[0]: must be string, got integer"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage: must be boolean, got integer"),
        ({"continue_final_message": True}, "continue_final_message: cannot be true while add_generation_prompt"),
        ({"presence_penalty": 2.5}, "presence_penalty: must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty: must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0}, "repetition_penalty: must be > 0 (1 = off), got 0"),
        ({"repetition_penalty": "x"}, "repetition_penalty: must be number, got string"),
        ({"logit_bias": {"a": 1}}, "logit_bias.a: keys must be token ids (integers as strings), got 'a'"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5: must be number, got string"),
        ({"logit_bias": {"9999999": 1}}, "logit_bias: token id 9999999 is outside the vocabulary (size "),
        ({"logit_bias": [5]}, "logit_bias: must be object, got array"),
        ({"allowed_token_ids": []}, "allowed_token_ids: must not be empty (omit it to allow every token)"),
        ({"allowed_token_ids": [3, 9999999]}, "allowed_token_ids[1]: token id 9999999 is outside the vocabulary"),
        ({"allowed_token_ids": ["3"]}, "allowed_token_ids[0]: must be integer, got string"),
        ({"bad_words": [" "]}, "bad_words[0]: must not be empty or only whitespace"),
        ({"bad_words": "x"}, "bad_words: must be array, got string"),
    ],
)
def test_type_and_range_errors_are_400(client, fake, extra, message):
    fake.reset(script_for([5]))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    assert message in err.value.body["message"] and err.value.body["param"] == message.split(":")[0]
    assert fake.requests == []


def test_truncate_prompt_tokens_keeps_the_last_k_tokens(client, fake, tok):
    """vLLM's truncate_prompt_tokens: the verifier gets the prompt's last k tokens, the very request that
    sending those k token ids as the prompt makes; chat cuts the rendered prompt. -1 = the model's
    maximum context (the fake's 1234: these prompts are shorter, so uncut); over it, 0 or < -1: 400."""
    prompt = "one two three four five six seven eight nine ten"
    ids, k = tok.encode(prompt), 4
    assert len(ids) > k
    sent = []
    for kwargs in (
        dict(prompt=prompt, extra_body={"truncate_prompt_tokens": k}),
        dict(prompt=ids[-k:]),  # the reference: the truncated prompt sent directly
        dict(prompt=prompt, extra_body={"truncate_prompt_tokens": -1}),
    ):
        fake.reset(script_for(tok.encode("ok")))
        r = client.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert r.choices[0].text == "ok"
        sent.append(fake.requests[-1])
    assert list(sent[0].input_ids) == ids[-k:] == list(sent[1].input_ids)
    assert (sent[0].sampling, sent[0].max_new_tokens) == (sent[1].sampling, sent[1].max_new_tokens)
    assert list(sent[2].input_ids) == ids
    fake.reset(script_for(tok.encode("ok")))
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, echo=True, extra_body={"truncate_prompt_tokens": k}
    )
    assert r.choices[0].text == tok.decode(ids[-k:]) + "ok"  # echo shows the prompt the model read
    chat = []
    for extra in ({}, {"truncate_prompt_tokens": k}):
        fake.reset(script_for(tok.encode("ok")))
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=extra)
        chat.append(list(fake.requests[-1].input_ids))
    assert len(chat[0]) > k and chat[1] == chat[0][-k:]
    fake.reset(script_for([5]))
    for value, message in (
        (5000, "truncate_prompt_tokens: must be <= the maximum context (1234), got 5000"),
        (0, "truncate_prompt_tokens: 0 would leave no prompt"),
        (-2, "truncate_prompt_tokens: must be in [-1, 2147483647], got -2"),
        ("3", "truncate_prompt_tokens: must be integer, got string"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, extra_body={"truncate_prompt_tokens": value})
        assert err.value.body["message"].startswith(message) and err.value.body["param"] == "truncate_prompt_tokens"
    assert fake.requests == []


def test_sampling_fields_reach_the_verifier(client, fake, tok):
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.completions.create(
        model=MODEL, prompt="a", max_tokens=7, extra_body={"min_p": 0.25, "min_tokens": 3, "top_k": -1}
    )
    s = fake.requests[-1].sampling
    assert (round(s.min_p, 6), s.min_tokens, s.top_k, fake.requests[-1].max_new_tokens) == (0.25, 3, 0, 7)


def test_penalties_and_logit_masks_reach_the_verifier(client, fake, tok):
    """Chat and completions alike: the penalties as sent, logit_bias clamped to [-100, 100] (vLLM's rule),
    bad_words tokenized without and with a leading space (bad_words.py); the verifier applies them."""
    extra = {
        "presence_penalty": 0.8,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"5": 150, "6": -3},
        "allowed_token_ids": [5, 6, 7],
        "bad_words": ["hello", " world"],
    }
    words = [tok.encode("hello"), tok.encode(" hello"), tok.encode("world"), tok.encode(" world")]
    for api in ("chat", "completions"):
        fake.reset(script_for(tok.encode("ok"), finish="length"))
        if api == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="a", extra_body=extra)
        s = fake.requests[-1].sampling
        assert [round(v, 6) for v in (s.presence_penalty, s.frequency_penalty, s.repetition_penalty)] == [
            0.8,
            -0.5,
            1.3,
        ]
        assert dict(s.logit_bias) == {5: 100.0, 6: -3.0} and list(s.allowed_token_ids) == [5, 6, 7]
        got = [list(w.ids) for w in s.bad_words]
        assert got[0] == words[0] and got[-1] == words[3] and all(w in words for w in got), got
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.completions.create(model=MODEL, prompt="a")
    s = fake.requests[-1].sampling
    assert (s.repetition_penalty, s.presence_penalty, len(s.logit_bias), len(s.bad_words)) == (0, 0, 0, 0)


def test_include_stop_str_in_output_and_min_tokens(client, fake, tok):
    text = "one END two END three"
    for extra, want in [
        ({}, "one "),
        ({"include_stop_str_in_output": True}, "one END"),
        # The text of the first min_tokens tokens is not searched: the first END is kept.
        ({"min_tokens": len(tok.encode("one END t"))}, "one END two "),
    ]:
        for stream in (False, True):
            fake.reset(script_for(tok.encode(text), finish="length"))
            kwargs = {"model": MODEL, "prompt": "a", "stop": ["END"], "extra_body": extra}
            if stream:
                got = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
            else:
                got = client.completions.create(**kwargs).choices[0].text
            assert got == want, (extra, stream)


def test_skip_special_tokens(client, fake, tok):
    ids = tok.encode("a") + [tok.special_tokens["<|tool_call_begin|>"]] + tok.encode("b")
    fake.reset(script_for(ids, finish="length"))
    assert client.completions.create(model=MODEL, prompt="x").choices[0].text == "ab"
    fake.reset(script_for(ids, finish="length"))
    kept = client.completions.create(model=MODEL, prompt="x", extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "a<|tool_call_begin|>b"


def test_cached_tokens_in_usage(client, fake, tok):
    usage = common_pb2.Usage(prompt_tokens=30, completion_tokens=2, cached_tokens=24)
    fake.reset(script_for(tok.encode("ok"), finish="length", usage=usage))
    r = client.chat.completions.create(model=MODEL, messages=USER)
    assert r.usage.prompt_tokens_details.cached_tokens == 24
    fake.reset(script_for(tok.encode("ok"), finish="length", usage=usage))
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24
    # The gateway ends the stream itself (a stop string): the count comes from the verifier's first message.
    script = script_for(tok.encode("one END two"), finish="length", usage=usage)
    script[0].usage.CopyFrom(common_pb2.Usage(prompt_tokens=30, cached_tokens=16))
    fake.reset(script)
    r = client.completions.create(model=MODEL, prompt="a", stop=["END"])
    assert r.choices[0].text == "one " and r.usage.prompt_tokens_details.cached_tokens == 16


def test_x_request_id(gw, client, fake, tok):
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "chatcmpl-trace-42"
    assert fake.requests[-1].request_id == "trace-42"
    # The body's request_id (vLLM's field) when no header is sent; a fresh id otherwise, returned too.
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="a", extra_body={"request_id": "b-1"})
    assert raw.headers["x-request-id"] == "b-1" and raw.parse().id == "cmpl-b-1"
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    host, port = gw.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "stream": True}))
    resp = conn.getresponse()
    rid, data = resp.getheader("x-request-id"), resp.read().decode()
    conn.close()
    assert rid.startswith("gw-") and f'"id":"cmpl-{rid}"' in data
    with pytest.raises(openai.BadRequestError, match="X-Request-Id: must be 1-256 printable ASCII"):
        client.completions.create(model=MODEL, prompt="a", extra_headers={"X-Request-Id": "a b"})
    # The id is already running on the verifier: 409.
    fake.reset([], error=(grpc.StatusCode.ALREADY_EXISTS, "request_id 'dup' is already running"))
    with pytest.raises(openai.ConflictError, match="already running"):
        client.completions.create(model=MODEL, prompt="a", extra_headers={"X-Request-Id": "dup"})


def test_continue_final_message_and_add_generation_prompt(client, fake, tok):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    fake.reset(script_for(tok.encode(" 4."), finish="length"))
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    prompt = tok.decode(fake.requests[-1].input_ids)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think></think>The answer is"), prompt
    assert r.choices[0].message.content == " 4."
    fake.reset(script_for(tok.encode("ok"), finish="length"))
    client.chat.completions.create(model=MODEL, messages=messages, extra_body={"add_generation_prompt": False})
    assert tok.decode(fake.requests[-1].input_ids).endswith("The answer is<|im_end|>")
    with pytest.raises(openai.BadRequestError, match="the last message must be the assistant's"):
        client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"continue_final_message": True, "add_generation_prompt": False}
        )


def test_models_carry_max_model_len(client):
    assert client.models.list().data[0].model_extra["max_model_len"] == 1234  # the fake's max_context
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 1234


DEEP = "[" * 100_000 + "]" * 100_000
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"guided_json": DEEP}, "guided_json", "nested too deeply"),
        ({"structured_outputs": {"json": '{"maximum": NaN}'}}, "structured_outputs.json", "NaN is not a JSON number"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": '{"maximum": 1' + "0" * 200 + "}"}}},
            "response_format.json_schema.schema",
            "a number of 201 characters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "x-guidance": "a"}},
                }
            },
            "response_format.json_schema.schema.x-guidance",
            "not supported",
        ),
        (
            {"guided_json": {"type": "object", "x-guidance": {"whitespace_flexible": True}}},
            "guided_json.x-guidance",
            "not supported",
        ),
        ({"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens", "must be 0 with a structured output"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "min_tokens": 1},
            "min_tokens",
            "must be 0 with a structured output or a forced tool call",
        ),
    ],
)
def test_structured_output_inputs_are_400(client, fake, extra, param, message):
    fake.reset(script_for([5]))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    assert message in err.value.body["message"] and err.value.body["param"] == param, err.value.body
    assert fake.requests == []


@pytest.mark.parametrize("grammar", ['{"grammars":[]}', '{"grammars":["x"]}', '{"grammars":[{"lark_grammar":1}]}'])
def test_grpc_malformed_grammar_after_think_is_invalid_argument(gw, fake, grammar):
    """The prompt opens a think block (thinking on), so the grammar is wrapped after </think>: a
    malformed one is INVALID_ARGUMENT naming options.grammar, never UNKNOWN."""
    from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc

    fake.reset(script_for([5]))
    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="x")],
        options=gateway_pb2.GenerationOptions(grammar=grammar),
    )
    with grpc.insecure_channel(gw.address) as channel, pytest.raises(grpc.RpcError) as err:
        list(gateway_pb2_grpc.GatewayStub(channel).Chat(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("options.grammar: ")
    assert fake.requests == []


def test_grpc_grammar_after_think_keeps_its_name(gw, fake, tok):
    from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc

    fake.reset(script_for(tok.encode("ok"), finish="length"))
    grammar = json.dumps({"grammars": [{"name": "main", "lark_grammar": 'start: "ok"'}]})
    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="x")],
        options=gateway_pb2.GenerationOptions(grammar=grammar),
    )
    with grpc.insecure_channel(gw.address) as channel:
        list(gateway_pb2_grpc.GatewayStub(channel).Chat(request))
    sent = json.loads(fake.requests[-1].grammar)["grammars"]
    assert sent[0]["lark_grammar"].startswith("start: REASONING <[") and "@main" in sent[0]["lark_grammar"]
    assert sent[1] == {"name": "main", "lark_grammar": 'start: "ok"'}


def test_a_grammar_is_checked_once(client, gw, fake, tok, monkeypatch):
    """HTTP: structured_outputs checks each field; the pipeline does not check the grammar again."""
    import llguidance

    from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc

    calls = []
    validate = llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", lambda g: calls.append(g) or validate(g))
    fake.reset(script_for(tok.encode("a"), finish="length"))
    client.chat.completions.create(model=MODEL, messages=USER, extra_body={"guided_choice": ["a", "b"]})
    assert len(calls) == 1 and fake.requests[-1].grammar
    calls.clear()
    fake.reset(script_for(tok.encode("a"), finish="length"))
    with grpc.insecure_channel(gw.address) as channel:
        options = gateway_pb2.GenerationOptions(grammar='start: "a"')
        list(gateway_pb2_grpc.GatewayStub(channel).Complete(gateway_pb2.CompleteRequest(prompt="x", options=options)))
    assert calls == ['start: "a"']
