"""Gateway unit tests: the real GatewayServicer (via serve()) in front of a FAKE in-process verifier
that streams scripted token ids. Also the pieces of the output pipeline: stop strings and the Kimi K2
reasoning / tool-call parsers (streaming vs non-streaming twins)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import socket

import grpc
import pytest

from ddtree.config import GatewayConfig, add_config_flags, config_from_flags
from ddtree.gateway.api.server import StopMatcher, serve
from ddtree.gateway.parsers.kimi_k2_reasoning import KimiK2ReasoningParser, parse_reasoning
from ddtree.gateway.parsers.kimi_k2_tools import MARKERS, KimiK2ToolParser, ToolCall, merge_deltas, parse_tool_calls
from ddtree.protocol.ddtree.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.fakes import script_for, verifier_usage

IM_END, EOS = 2, 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway(fake_address: str, tokenizer_dir, **overrides):
    config = GatewayConfig(verifier=fake_address, max_prompt_chars=10_000, **overrides)
    config.validate()
    running = serve(config, tokenizer_dir=tokenizer_dir, announce=False)
    channel = grpc.insecure_channel(running.address)
    return running, channel, gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def gateway(fake, tokenizer_dir):
    running, channel, stub = _gateway(fake.address, tokenizer_dir)
    yield stub
    channel.close()
    running.stop(0)


@pytest.fixture(scope="module")
def dead_gateway(tokenizer_dir):
    running, channel, stub = _gateway(f"127.0.0.1:{_free_port()}", tokenizer_dir)
    yield stub
    channel.close()
    running.stop(0)


def _collect(chunks):
    chunks = list(chunks)
    calls = {}
    for c in chunks:
        for d in c.tool_calls:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = entry["id"] or d.id
            entry["name"] = entry["name"] or d.name
            entry["arguments"] += d.arguments_delta
    return dict(
        chunks=chunks,
        text="".join(c.text_delta for c in chunks),
        reasoning="".join(c.reasoning_delta for c in chunks),
        ids=[i for c in chunks for i in c.token_ids],
        steps=[s for c in chunks for s in c.steps],
        finish=[c.finish_reason for c in chunks if c.finish_reason],
        usage=chunks[-1].usage if chunks else None,
        calls=[calls[i] for i in sorted(calls)],
    )


def _complete(stub, prompt="Hello", timeout=10, **options):
    return _collect(
        stub.Complete(
            gateway_pb2.CompleteRequest(prompt=prompt, options=gateway_pb2.GenerationOptions(**options)),
            timeout=timeout,
        )
    )


USAGE = common_pb2.Usage(
    prompt_tokens=3,
    completion_tokens=9,
    verify_steps=4,
    avg_accept_length=2.25,
    accept_histogram=[0, 1, 2, 1],
    ttft_ms=12.5,
    decode_ms=40.0,
)
STREAM_TEXT = "Streaming 中文 and emoji 😀👍🏽 across tokens: ok."


# -- Complete: text, ids, steps, usage ------------------------------------------------------------------
@pytest.mark.parametrize("sizes", ["ones", "threes"])
def test_complete_streams_text_ids_steps_usage(gateway, fake, tok, sizes):
    ids = tok.encode(STREAM_TEXT)
    split = [1] * len(ids) if sizes == "ones" else [3] * (len(ids) // 3) + ([len(ids) % 3] if len(ids) % 3 else [])
    fake.reset(script_for(ids, split, finish="length", usage=USAGE))
    out = _complete(gateway, "Say something", max_tokens=100)
    assert out["text"] == STREAM_TEXT
    assert all("\ufffd" not in c.text_delta for c in out["chunks"])
    assert out["ids"] == ids
    assert len(out["chunks"]) == len(split)  # one chunk per verifier message
    assert [s.accept_length for s in out["steps"]] == split
    assert out["finish"] == ["length"] and out["chunks"][-1].finish_reason == "length"
    assert out["usage"] == USAGE
    assert {c.request_id for c in out["chunks"]} == {fake.requests[0].request_id}
    req = fake.requests[0]
    assert list(req.input_ids) == tok.encode("Say something")
    assert req.max_new_tokens == 100


def test_complete_maps_options_to_verifier_request(gateway, fake, tok):
    fake.reset(script_for([tok.encode("x")[0]]))
    _complete(
        gateway,
        "p",
        max_tokens=0,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=5,
        stop_token_ids=[100, IM_END],
        no_spec=True,
        budget=32,
    )
    req = fake.requests[-1]
    assert req.max_new_tokens == GatewayConfig().default_max_tokens  # 0 = server default
    assert math.isclose(req.sampling.temperature, 0.7, rel_tol=1e-6) and math.isclose(
        req.sampling.top_p, 0.9, rel_tol=1e-6
    )
    assert req.sampling.top_k == 40 and req.sampling.HasField("seed") and req.sampling.seed == 5
    assert list(req.stop_token_ids) == [100, IM_END, EOS] and not req.ignore_eos
    assert req.spec.no_spec and req.spec.budget == 32
    assert req.request_id.startswith("gw-")

    _complete(gateway, "p", ignore_eos=True, stop_token_ids=[100])
    req = fake.requests[-1]
    assert list(req.stop_token_ids) == [100] and req.ignore_eos and not req.sampling.HasField("seed")

    gateway_request = gateway_pb2.CompleteRequest(prompt="p", request_id="client-7")
    list(gateway.Complete(gateway_request, timeout=10))
    assert fake.requests[-1].request_id == "client-7"


def test_stop_token_is_reported_but_not_rendered(gateway, fake, tok):
    ids = tok.encode("Hello there") + [IM_END]
    fake.reset(script_for(ids, finish="stop", usage=USAGE))
    out = _complete(gateway)
    assert out["text"] == "Hello there"
    assert out["ids"] == ids
    assert out["finish"] == ["stop"]
    # With ignore_eos the verifier does not stop on it: a special token, skipped by default.
    fake.reset(script_for(ids, finish="length"))
    assert _complete(gateway, ignore_eos=True)["text"] == "Hello there"
    fake.reset(script_for(ids, finish="length"))
    assert _complete(gateway, ignore_eos=True, skip_special_tokens=False)["text"] == "Hello there<|im_end|>"


# -- stop strings -------------------------------------------------------------------------------------
def test_stop_string_across_chunks_aborts_verifier(gateway, fake, tok):
    text = "The answer is 42. END of the story, and more text after it."
    ids = tok.encode(text)
    fake.reset(script_for(ids, finish="length", usage=USAGE), delay_s=0.002)
    out = _complete(gateway, stop=["42. END"])
    assert out["text"] == "The answer is "
    assert out["finish"] == ["stop"]
    assert fake.aborts == [fake.requests[0].request_id]
    assert fake.sent < len(ids)  # the stream was cut before the verifier's end
    # Usage is the gateway's own: the prompt and the tokens it received, steps as reported.
    usage = out["usage"]
    assert usage.prompt_tokens == len(tok.encode("Hello"))
    assert usage.completion_tokens == len(out["ids"]) == len(out["steps"]) == usage.verify_steps
    assert usage.avg_accept_length == 1.0 and list(usage.accept_histogram) == [0, len(out["steps"])]
    # No released text ever contained the start of the stop string.
    assert all("42" not in c.text_delta for c in out["chunks"])


def test_stop_strings_earliest_wins_and_partial_is_released(gateway, fake, tok):
    ids = tok.encode("alpha beta gamma delta")
    fake.reset(script_for(ids, finish="length"))
    out = _complete(gateway, stop=["delta", "beta g"])
    assert out["text"] == "alpha " and out["finish"] == ["stop"]
    # A held-back partial match ("gam" of "gamut") that never completes is released in the end.
    fake.reset(script_for(ids, finish="length", usage=USAGE))
    out = _complete(gateway, stop=["gamut", "delta!"])
    assert out["text"] == "alpha beta gamma delta" and out["finish"] == ["length"]
    assert out["usage"] == USAGE and fake.aborts == []


def test_stop_string_in_last_message_needs_no_abort(gateway, fake, tok):
    ids = tok.encode("one two three")
    fake.reset(script_for(ids, [len(ids)], finish="length", usage=USAGE))
    out = _complete(gateway, stop=["two"])
    assert out["text"] == "one " and out["finish"] == ["stop"] and fake.aborts == []
    assert out["usage"] == USAGE


@pytest.mark.parametrize("mode", ["spec", "no_spec"])
def test_stop_string_and_length_report_avg_accept_length_alike(gateway, fake, tok, mode):
    """avg_accept_length is tokens per verify step over every step, with or without a tree: the same whether
    the verifier computed the usage (the request ran to its length) or the gateway did (it cut the stream
    at a stop string). A no_spec request reads 1.0 either way."""
    ids = tok.encode("one two three four five six seven eight nine ten eleven twelve thirteen")
    if mode == "spec":  # steps of 3, 1 (no tree: an AR step) and 2 tokens
        pattern, sizes = itertools.cycle([3, 1, 2]), []
        while sum(sizes) < len(ids):
            sizes.append(min(next(pattern), len(ids) - sum(sizes)))
    else:
        sizes = [1] * len(ids)
    script = script_for(ids, sizes, finish="length")
    for msg in script:
        if mode == "no_spec" or len(msg.token_ids) == 1:
            msg.steps[0].tree_nodes = 0
    prompt_tokens = len(tok.encode("Hello"))
    script[-1].usage.CopyFrom(verifier_usage(prompt_tokens, script))

    fake.reset(script)
    by_length = _complete(gateway, max_tokens=100)
    fake.reset(script)
    by_stop = _complete(gateway, max_tokens=100, stop=[" seven"])
    assert by_length["finish"] == ["length"] and by_length["usage"] == script[-1].usage
    assert by_stop["finish"] == ["stop"] and fake.aborts == [fake.requests[0].request_id]  # usage by the gateway
    assert len(by_stop["steps"]) < len(by_length["steps"])
    for out in (by_length, by_stop):
        lengths = [s.accept_length for s in out["steps"]]
        usage = out["usage"]
        assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == len(out["ids"]) == sum(lengths)
        assert usage.verify_steps == len(lengths)
        assert usage.avg_accept_length == pytest.approx(sum(lengths) / len(lengths))
        assert list(usage.accept_histogram) == [lengths.count(k) for k in range(max(lengths) + 1)]
        if mode == "no_spec":
            assert usage.avg_accept_length == 1.0 and list(usage.accept_histogram) == [0, len(lengths)]


@pytest.mark.parametrize("seed", range(5))
def test_stop_matcher_random_chunking(seed):
    rng = random.Random(seed)
    stops = ("ab", "cab", "xyz")
    for _ in range(300):
        text = "".join(rng.choice("abcxyz ") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        m, out, matched, prev = StopMatcher(stops), [], False, 0
        for c in cuts + [len(text)]:
            piece, matched = m.push(text[prev:c], final=c == len(text))
            out.append(piece)
            prev = c
            if matched:
                break
        hits = [p for p in (text.find(s) for s in stops) if p != -1]
        assert "".join(out) == (text[: min(hits)] if hits else text)
        assert matched == bool(hits)


# -- Chat: template, reasoning, tool calls ------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _chat(stub, messages, timeout=10, tools=None, kwargs=None, **options):
    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.ChatMessage(**m) for m in messages],
        options=gateway_pb2.GenerationOptions(**options),
        tools_json=json.dumps(tools) if tools is not None else "",
        chat_template_kwargs_json=json.dumps(kwargs) if kwargs is not None else "",
    )
    return _collect(stub.Chat(request, timeout=timeout))


def test_chat_renders_template_and_splits_reasoning(gateway, fake, tok):
    out_ids = tok.encode("Let me think. 2+2 is 4.</think>The answer is 4.") + [IM_END]
    fake.reset(script_for(out_ids, finish="stop", usage=USAGE))
    out = _chat(gateway, [{"role": "user", "content": "2+2?"}])
    expected_prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert expected_prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert list(fake.requests[-1].input_ids) == tok.encode(expected_prompt)
    assert out["reasoning"] == "Let me think. 2+2 is 4."
    assert out["text"] == "The answer is 4."
    assert out["finish"] == ["stop"] and out["usage"] == USAGE
    assert list(fake.requests[-1].stop_token_ids) == [IM_END, EOS]


def test_chat_thinking_off(gateway, fake, tok):
    fake.reset(script_for(tok.encode("Plain answer."), finish="length"))
    out = _chat(gateway, [{"role": "user", "content": "hi"}], kwargs={"thinking": False})
    assert tok.decode(fake.requests[-1].input_ids).endswith("<|im_middle|><think></think>")
    assert out["text"] == "Plain answer." and out["reasoning"] == ""


def test_chat_tool_calls(gateway, fake, tok):
    output = (
        "I should call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    fake.reset(script_for(tok.encode(output) + [IM_END], finish="stop"))
    history = [
        {"role": "user", "content": "Weather in Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [gateway_pb2.ToolCall(id="call_x", name="get_weather", arguments='{"city": "Lyon"}')],
        },
        {"role": "tool", "tool_call_id": "call_x", "content": "sunny"},
        {"role": "user", "content": "And Paris?"},
    ]
    out = _chat(gateway, history, tools=TOOLS)
    prompt = tok.decode(fake.requests[-1].input_ids)
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Lyon"}' in prompt
    assert "## Return of functions.get_weather:0\nsunny" in prompt
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS))
    assert out["reasoning"] == "I should call the tool."
    assert out["text"] == ""
    assert out["calls"] == [{"id": "functions.get_weather:1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert out["finish"] == ["tool_calls"]
    # Without declared tools nothing is parsed and the markers (special tokens) are skipped.
    fake.reset(script_for(tok.encode(output) + [IM_END], finish="stop"))
    out = _chat(gateway, [{"role": "user", "content": "hi"}])
    assert out["calls"] == [] and out["finish"] == ["stop"]
    assert out["text"] == 'functions.get_weather:1{"city": "Paris"}'
    fake.reset(script_for(tok.encode(output) + [IM_END], finish="stop"))
    out = _chat(gateway, [{"role": "user", "content": "hi"}], skip_special_tokens=False)
    assert out["text"].startswith("<|tool_calls_section_begin|>")


def test_reasoning_parser_off(fake, tokenizer_dir, tok):
    running, channel, stub = _gateway(fake.address, tokenizer_dir, reasoning_parser="none", tool_call_parser="none")
    try:
        fake.reset(script_for(tok.encode("thinking</think>answer"), finish="length"))
        out = _chat(stub, [{"role": "user", "content": "hi"}], tools=TOOLS)
        assert out["text"] == "thinkinganswer" and out["reasoning"] == "" and out["calls"] == []
        info = stub.GetInfo(gateway_pb2.GatewayInfoRequest(), timeout=5)
        assert (info.reasoning_parser, info.tool_call_parser) == ("none", "none")
    finally:
        channel.close()
        running.stop(0)
    with pytest.raises(ValueError, match="tool_call_parser 'nope' is not available"):
        serve(GatewayConfig(tool_call_parser="nope"), tokenizer_dir=tokenizer_dir, announce=False)
    with pytest.raises(ValueError, match="no tokenizer directory"):
        serve(GatewayConfig(), announce=False)


def test_deepseek_v3_tool_parser_selected_by_flag(fake, tokenizer_dir, tok):
    args = argparse.ArgumentParser()
    add_config_flags(args, GatewayConfig)
    config = config_from_flags(
        GatewayConfig,
        args.parse_args(["--tool-call-parser", "deepseek_v3", "--verifier", fake.address, "--http-port", "-1"]),
        environ={},
    )
    running = serve(config, tokenizer_dir=tokenizer_dir, announce=False)
    channel = grpc.insecure_channel(running.address)
    try:
        output = (
            "Use the tool.</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
            '\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        )
        fake.reset(script_for(tok.encode(output) + [IM_END], finish="stop"))
        history = [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [gateway_pb2.ToolCall(id="call_0", name="get_weather", arguments='{"city": "Oslo"}')],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "rain"},
        ]
        out = _chat(gateway_pb2_grpc.GatewayStub(channel), history, tools=TOOLS)
        assert (out["reasoning"], out["text"]) == ("Use the tool.", "Sure.")
        assert out["calls"] == [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert out["finish"] == ["tool_calls"]
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GatewayInfoRequest(), timeout=5)
        assert info.tool_call_parser == "deepseek_v3"
    finally:
        channel.close()
        running.stop(0)


# -- invalid input ------------------------------------------------------------------------------------
def _opts(**kw):
    return gateway_pb2.GenerationOptions(**kw)


USER = [gateway_pb2.ChatMessage(role="user", content="hi")]
INVALID = [
    ("chat", dict(messages=[]), "messages: must not be empty"),
    (
        "chat",
        dict(messages=[gateway_pb2.ChatMessage(role="robot", content="x")]),
        "messages[0].role: unknown role 'robot'",
    ),
    ("chat", dict(messages=[gateway_pb2.ChatMessage(content="x")]), "messages[0].role: is required"),
    (
        "chat",
        dict(messages=USER + [gateway_pb2.ChatMessage(role="tool", content="x")]),
        "messages[1].tool_call_id: is required for tool messages",
    ),
    (
        "chat",
        dict(
            messages=USER
            + [
                gateway_pb2.ChatMessage(
                    role="assistant", tool_calls=[gateway_pb2.ToolCall(id="c", name="f", arguments="{not json")]
                )
            ]
        ),
        "messages[1].tool_calls[0].function.arguments: not valid JSON",
    ),
    (
        "chat",
        dict(
            messages=USER
            + [gateway_pb2.ChatMessage(role="assistant", tool_calls=[gateway_pb2.ToolCall(id="c", arguments="{}")])]
        ),
        "messages[1].tool_calls[0].function.name: must not be empty",
    ),
    ("chat", dict(messages=USER, tools_json="[{"), "tools_json: not valid JSON"),
    ("chat", dict(messages=USER, tools_json="[" * 990 + "]" * 990), "tools_json is nested too deeply"),
    (
        "chat",
        dict(messages=USER, chat_template_kwargs_json='{"x": ' + "9" * 5000 + "}"),
        "chat_template_kwargs_json: a number of 5000 characters",
    ),
    ("chat", dict(messages=USER, tools_json='{"a": 1}'), "tools: must be a list, got dict"),
    (
        "chat",
        dict(messages=USER, tools_json='[{"type": "function", "function": {}}]'),
        "tools[0].function.name: is required",
    ),
    ("chat", dict(messages=USER, chat_template_kwargs_json="{oops"), "chat_template_kwargs_json: not valid JSON"),
    (
        "chat",
        dict(messages=USER, chat_template_kwargs_json="[1]"),
        "chat_template_kwargs_json: must be a JSON object, got list",
    ),
    (
        "chat",
        dict(messages=USER, chat_template_kwargs_json='{"thinking": "no"}'),
        "chat_template_kwargs.thinking: must be true or false, got 'no'",
    ),
    (
        "chat",
        dict(messages=USER, chat_template_kwargs_json='{"messages": []}'),
        "chat_template_kwargs.messages: reserved",
    ),
    (
        "chat",
        dict(messages=[gateway_pb2.ChatMessage(role="user", content="x" * 10_001)]),
        "messages and tools: 10005 characters, over the limit of 10000",  # role + content,
    ),
    (
        "chat",
        dict(messages=[gateway_pb2.ChatMessage(role="user", content="")] * 4097),
        "messages: at most 4096 messages, got 4097",
    ),
    (
        "chat",
        dict(messages=[gateway_pb2.ChatMessage(role="user", content="hi", name="n" * 257)]),
        "messages[0].name: 257 characters, over the limit of 256",
    ),
    (
        "chat",
        dict(
            messages=USER,
            tools_json=json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
        ),
        "tools: at most 128 tools, got 129",
    ),
    (
        "chat",
        dict(
            messages=[
                *USER,
                gateway_pb2.ChatMessage(
                    role="assistant", tool_calls=[gateway_pb2.ToolCall(id=f"c{i}", name="f") for i in range(129)]
                ),
            ]
        ),
        "messages[1].tool_calls: at most 128 tool calls per message, got 129",
    ),
    ("complete", dict(prompt=""), "prompt: must not be empty"),
    ("complete", dict(prompt="x" * 10_001), "prompt: 10001 characters, over the limit of 10000"),
    ("complete", dict(options=_opts(max_tokens=-1)), "options.max_tokens: must be >= 0 (0 = server default), got -1"),
    ("complete", dict(options=_opts(max_tokens=4097)), "options.max_tokens: must be <= 4096, got 4097"),
    ("complete", dict(options=_opts(temperature=-0.5)), "options.temperature: must be a finite number >= 0, got -0.5"),
    (
        "complete",
        dict(options=_opts(temperature=float("nan"))),
        "options.temperature: must be a finite number >= 0, got nan",
    ),
    (
        "complete",
        dict(options=_opts(temperature=float("inf"))),
        "options.temperature: must be a finite number >= 0, got inf",
    ),
    ("complete", dict(options=_opts(top_p=1.5)), "options.top_p: must be in (0, 1] (0 = unset), got 1.5"),
    ("complete", dict(options=_opts(top_p=-0.25)), "options.top_p: must be in (0, 1] (0 = unset), got -0.25"),
    ("complete", dict(options=_opts(top_p=float("nan"))), "options.top_p: must be in (0, 1] (0 = unset), got nan"),
    ("complete", dict(options=_opts(presence_penalty=3)), "options.presence_penalty: must be in [-2, 2], got 3.0"),
    ("complete", dict(options=_opts(repetition_penalty=-1)), "options.repetition_penalty: must be > 0 (0 = unset"),
    ("complete", dict(options=_opts(logit_bias={10**7: 1})), "options.logit_bias: token id 10000000 is outside"),
    ("complete", dict(options=_opts(logit_bias={5: 101})), "options.logit_bias.5: must be in [-100, 100], got 101.0"),
    ("complete", dict(options=_opts(allowed_token_ids=[-2])), "options.allowed_token_ids[0]: token id -2 is outside"),
    (
        "complete",
        dict(options=_opts(bad_words=["ok", ""])),
        "options.bad_words[1]: must not be empty or only whitespace",
    ),
    ("complete", dict(options=_opts(top_k=-1)), "options.top_k: must be >= 0 (0 = disabled), got -1"),
    ("complete", dict(options=_opts(budget=-3)), "options.budget: must be >= 0 (0 = server default), got -3"),
    ("complete", dict(options=_opts(stop=["ok", ""])), "options.stop[1]: must not be empty"),
    ("complete", dict(options=_opts(stop=["s"] * 17)), "options.stop: at most 16 stop strings, got 17"),
    ("complete", dict(options=_opts(stop=["s" * 1001])), "options.stop[0]: 1001 characters, over the limit of 1000"),
    (
        "complete",
        dict(options=_opts(stop_token_ids=[5, 4096])),
        "options.stop_token_ids[1]: token id 4096 is outside the vocabulary (size 4096)",
    ),
    (
        "complete",
        dict(options=_opts(stop_token_ids=[-1])),
        "options.stop_token_ids[0]: token id -1 is outside the vocabulary (size 4096)",
    ),
]


@pytest.mark.parametrize("rpc, fields, message", INVALID, ids=[m for _, _, m in INVALID])
def test_invalid_argument(gateway, fake, rpc, fields, message):
    fake.reset(script_for([5]))
    if rpc == "chat":
        call = gateway.Chat(gateway_pb2.ChatRequest(**fields), timeout=10)
    else:
        call = gateway.Complete(gateway_pb2.CompleteRequest(**{"prompt": "hi", **fields}), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(message), err.value.details()
    assert fake.requests == []  # nothing reached the verifier


def test_request_message_over_the_body_limit(gateway, fake):
    """A gRPC request larger than --max-body-bytes (8 MiB here) is refused before it is parsed."""
    fake.reset(script_for([5]))
    big = gateway_pb2.CompleteRequest(prompt="x" * (8 * 1024 * 1024 + 1))
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Complete(big, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fake.requests == []


def test_tokenize_rejects_bad_messages(gateway):
    with pytest.raises(grpc.RpcError) as err:
        gateway.Tokenize(
            gateway_pb2.TokenizeRequest(messages=[gateway_pb2.ChatMessage(role="x", content="y")]), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("messages[0].role: unknown role 'x'")
    with pytest.raises(grpc.RpcError) as err:
        gateway.Tokenize(gateway_pb2.TokenizeRequest(text="x" * 10_001), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "text: 10001 characters, over the limit of 10000"


# -- verifier failures, cancellation, deadlines ----------------------------------------------------------
def test_unavailable_when_verifier_is_down(dead_gateway):
    for call in (
        lambda: list(dead_gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=10)),
        lambda: list(dead_gateway.Chat(gateway_pb2.ChatRequest(messages=USER), timeout=10)),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "verifier at 127.0.0.1:" in err.value.details() and "unavailable" in err.value.details()


@pytest.mark.parametrize(
    "code, message",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 256 requests waiting"),
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt of 9000 tokens exceeds max_context 8192"),
        (grpc.StatusCode.INTERNAL, "kernel exploded"),
    ],
)
def test_verifier_errors_pass_through(gateway, fake, tok, code, message):
    ids = tok.encode("partial output")
    script = script_for(ids)
    script[-1].finish_reason = ""  # the error comes after some tokens
    fake.reset(script, error=(code, message))
    chunks = []
    with pytest.raises(grpc.RpcError) as err:
        for c in gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=10):
            chunks.append(c)
    assert (err.value.code(), err.value.details()) == (code, message)
    assert [i for c in chunks for i in c.token_ids] == ids


def test_stream_without_finish_reason_is_internal(gateway, fake, tok):
    script = script_for(tok.encode("abc"))
    script[-1].finish_reason = ""
    fake.reset(script)
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "without a finish_reason" in err.value.details()


def test_out_of_vocab_token_from_verifier_is_internal(gateway, fake):
    fake.reset(script_for([99999]))
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "outside the vocabulary" in err.value.details()


def test_client_cancel_cancels_verifier_call(gateway, fake, tok):
    # The verifier is slow (a long step): the cancellation must reach it while the gateway waits.
    # The fake's next message is 20 s away: a cancellation seen before then came through the gateway
    # (the margin is for a loaded machine; on an idle one it arrives in milliseconds).
    fake.reset(script_for(tok.encode("word " * 20)), delay_s=20.0)
    call = gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=60)
    first = next(call)
    assert first.token_ids
    call.cancel()
    assert fake.cancelled.wait(15), "the verifier call was not cancelled"
    assert fake.sent == 1


def test_deadline_is_propagated(gateway, fake, tok):
    fake.reset(script_for(tok.encode("ok")))
    _complete(gateway, timeout=7)
    remaining = fake.time_remaining[-1]
    assert remaining is not None and 0 < remaining <= 7.1  # grpc rounds the wire deadline up a little
    # Without a client deadline the verifier call has none either.
    list(gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi")))
    assert fake.time_remaining[-1] is None or fake.time_remaining[-1] > 1e6, fake.time_remaining[-1]
    # A client deadline that passes while the verifier is slow ends the call with DEADLINE_EXCEEDED.
    fake.reset(script_for(tok.encode("word " * 50)), delay_s=0.05)
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Complete(gateway_pb2.CompleteRequest(prompt="hi"), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.cancelled.wait(5)


# -- Tokenize, GetInfo ---------------------------------------------------------------------------------
def test_tokenize_text_and_messages(gateway, tok):
    r = gateway.Tokenize(gateway_pb2.TokenizeRequest(text="Hello 😀<|im_end|>"), timeout=5)
    assert list(r.token_ids) == tok.encode("Hello 😀<|im_end|>") and r.rendered == ""
    assert list(r.tokens) == [tok.id_to_token(i) for i in r.token_ids] and r.tokens[-1] == "<|im_end|>"
    messages = [
        gateway_pb2.ChatMessage(role="system", content="Be brief."),
        gateway_pb2.ChatMessage(role="user", content="hi"),
    ]
    r = gateway.Tokenize(gateway_pb2.TokenizeRequest(messages=messages, add_generation_prompt=True), timeout=5)
    expected = (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert r.rendered == expected and list(r.token_ids) == tok.encode(expected)
    r = gateway.Tokenize(gateway_pb2.TokenizeRequest(messages=messages), timeout=5)
    assert r.rendered.endswith("hi<|im_end|>")
    assert list(gateway.Tokenize(gateway_pb2.TokenizeRequest(), timeout=5).token_ids) == []


def test_get_info(gateway, dead_gateway, fake):
    info = gateway.GetInfo(gateway_pb2.GatewayInfoRequest(), timeout=5)
    assert info.model_id == "ddtree-demo" and info.verifier_address == fake.address
    assert info.vocab_size == 4096 and info.max_context == 1234
    assert (info.reasoning_parser, info.tool_call_parser) == ("kimi_k2", "kimi_k2")
    dead = dead_gateway.GetInfo(gateway_pb2.GatewayInfoRequest(), timeout=5)
    assert dead.max_context == 8192  # the tokenizer's model_max_length until the verifier answers


# -- parsers: streaming state machines vs their non-streaming twins -------------------------------------
def _chunks(text, rng):
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    out, prev = [], 0
    for c in cuts + [len(text)]:
        out.append(text[prev:c])
        prev = c
    return out


PARSER_ATOMS = list(MARKERS) + [
    "<think>",
    "</think>",
    "functions.get:0",
    "functions.a.b:12",
    "lookup",
    " ",
    '{"q": "<|x"}',
    "<",
    "<|tool_call",
    "<|tool_calls_sec",
    "</thi",
    "\n",
    "héllo 😀",
]


@pytest.mark.parametrize("seed", range(4))
def test_parsers_streaming_equals_non_streaming(seed):
    rng = random.Random(seed)
    for _ in range(800):
        text = "".join(rng.choice(PARSER_ATOMS) for _ in range(rng.randint(0, 14)))
        pieces = _chunks(text, rng)
        offset = rng.randint(0, 3)
        p = KimiK2ToolParser(offset)
        content, deltas = [], []
        for piece in pieces + [None]:
            c, d = p.push(piece) if piece is not None else p.finish()
            content.append(c)
            deltas += d
        assert ("".join(content), merge_deltas(deltas)) == parse_tool_calls(text, offset), (text, pieces)
        # Every call is announced (id + name) before any of its argument deltas.
        seen = set()
        for d in deltas:
            assert (d.index in seen) == (not d.id), d
            seen.add(d.index)

        in_reasoning = rng.random() < 0.5
        r = KimiK2ReasoningParser(in_reasoning)
        reasoning, content = [], []
        for piece in pieces + [None]:
            a, b = r.push(piece) if piece is not None else r.finish()
            reasoning.append(a)
            content.append(b)
        assert ("".join(reasoning), "".join(content)) == parse_reasoning(text, in_reasoning), (text, pieces)


def test_tool_parser_cases():
    text = (
        "Sure.<|tool_calls_section_begin|> <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|> lookup <|tool_call_argument_begin|>{}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert parse_tool_calls(text, 2) == (
        "Sure.",
        [
            ToolCall(0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
            ToolCall(1, "functions.lookup:3", "lookup", "{}"),
        ],
    )
    # Truncated output: a call whose id never completed is dropped, truncated arguments are kept.
    assert parse_tool_calls("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0")[1] == []
    assert parse_tool_calls('<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1')[1] == [
        ToolCall(0, "functions.f:0", "f", '{"a": 1')
    ]
    # Streaming: the name comes as soon as the id is complete, arguments as they arrive.
    p = KimiK2ToolParser()
    assert p.push("Hi<|tool_calls_sec") == ("Hi", [])
    content, deltas = p.push('tion_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a"')
    assert content == "" and [(d.index, d.id, d.name, d.arguments_delta) for d in deltas] == [
        (0, "functions.f:0", "f", ""),
        (0, "", "", '{"a"'),
    ]
    content, deltas = p.push(": 1}<|tool_call_e")
    assert [d.arguments_delta for d in deltas] == [": 1}"]
    assert p.push("nd|><|tool_calls_section_end|>") == ("", [])
    assert p.finish() == ("", [])


def test_reasoning_parser_cases():
    assert parse_reasoning("a<think>b</think>c") == ("b", "a" + "c")
    assert parse_reasoning("b</think>c", in_reasoning=True) == ("b", "c")
    assert parse_reasoning("truncated thought", in_reasoning=True) == ("truncated thought", "")
    assert parse_reasoning("no think here") == ("", "no think here")
    # A tool section ends reasoning and is handed on intact.
    assert parse_reasoning("plan<|tool_calls_section_begin|>x", in_reasoning=True) == (
        "plan",
        "<|tool_calls_section_begin|>x",
    )
    r = KimiK2ReasoningParser(in_reasoning=True)
    assert r.push("abc</th") == ("abc", "")
    assert r.push("ink>def") == ("", "def")
    assert r.finish() == ("", "")


def test_fake_script_helper_is_sane():
    msgs = script_for([1, 2, 3], [2, 1], finish="stop")
    assert [list(m.token_ids) for m in msgs] == [[1, 2], [3]] and msgs[-1].finish_reason == "stop"
    assert dataclasses.is_dataclass(GatewayConfig)
