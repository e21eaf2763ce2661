"""Default tokenizer (deterministic training, specials), Tokenizer round trips, Kimi K2 chat template."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from ddtree.tokenization.chat_template import ChatTemplate, render_chat, validate_messages
from ddtree.tokenization.default_tokenizer import (
    KIMI_K2_CHAT_TEMPLATE,
    MASK_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
)
from tests.support.paths import REPO


# -- training ---------------------------------------------------------------------------------------
def _train_in_subprocess(out_dir, rayon_threads: str) -> None:
    # A fresh process gets fresh Rust hash seeds; a different thread count changes the work split.
    env = dict(os.environ, RAYON_NUM_THREADS=rayon_threads, PYTHONHASHSEED=rayon_threads)
    code = "import sys; from ddtree.tokenization.default_tokenizer import write_default_tokenizer as w; w(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(out_dir)], cwd=REPO, env=env, check=True, timeout=120)


def test_training_is_deterministic(tokenizer_dir, tmp_path):
    for threads in ("1", "2"):
        out = tmp_path / f"run{threads}"
        _train_in_subprocess(out, threads)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (out / name).read_bytes() == (tokenizer_dir / name).read_bytes(), (
                f"{name} differs (threads={threads})"
            )


def test_vocab_and_special_ids(tok, tokenizer_dir):
    assert tok.vocab_size == VOCAB_SIZE == 4096
    assert SPECIAL_TOKENS[14] == MASK_TOKEN == "[MASK]"
    expected = [
        "[BOS]",
        "[EOS]",
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "[MASK]",
        "[PAD]",
        "[UNK]",
    ]
    assert list(SPECIAL_TOKENS) == expected
    for i, token in enumerate(expected):
        assert tok.token_id(token) == i
        assert tok.special_tokens[token] == i
        assert tok.encode(token) == [i], f"{token} is not a single token"
        assert tok.decode([i]) == token
        assert tok.decode([i], skip_special=True) == ""
    assert tok.special_ids == frozenset(range(17))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 15)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "[BOS]" and config["eos_token"] == "[EOS]" and config["pad_token"] == "[PAD]"
    assert config["model_max_length"] == tok.model_max_length > 0
    assert {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()} == dict(enumerate(expected))
    assert config["chat_template"] == KIMI_K2_CHAT_TEMPLATE
    with pytest.raises(KeyError):
        tok.token_id("<|not_a_token|>")


def test_specials_inside_text(tok):
    ids = tok.encode("hi<|im_end|>there[MASK]")
    assert 2 in ids and 14 in ids
    plain = tok.encode("hi<|im_end|>there[MASK]", allow_special=False)
    assert not set(plain) & tok.special_ids
    assert tok.decode(plain) == "hi<|im_end|>there[MASK]"


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        "abc XYZ 0123 \n\t  ",
        "你好世界中文字符",
        "😀🎉👍🏽🇫🇷",
        "éàüßñøΩЖж",
        "\u0000\u200d\ufeff\U0010ffff",
        "<|im_end|>[BOS]<think>",
        "def f(x):\n    return x  # ok\r\n",
    ]
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append(chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)])))
        else:
            out.append(rng.choice(rng.choice(pools)))
    return "".join(out)


def test_round_trip_unicode(tok):
    rng = random.Random(0)
    for n in (0, 1, 2, 5, 40, 300):
        for _ in range(20):
            text = _random_text(rng, n)
            ids = tok.encode(text)
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert tok.decode(ids) == text
            assert tok.decode(tok.encode(text, allow_special=False)) == text
    text = "Grüße 🙂 — 中文 and emoji 👩‍👩‍👧"
    assert tok.decode(tok.encode(text)) == text


def test_token_bytes_match_decode(tok):
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        assert b is not None
        assert b.decode("utf-8", errors="replace") == tok.decode([i])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


# -- chat template ----------------------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "need the tool",
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp": 21}'},
]
TOOLS_JSON = (
    '[{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
)


def test_template_tool_conversation(tok):
    expected = (
        "<|im_system|>tool_declare<|im_middle|>" + TOOLS_JSON + "<|im_end|>"
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>need the tool</think>Checking."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 21}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == expected
    # Arguments given as an object are dumped as JSON; ids already in Kimi form are kept.
    conv = [dict(m) for m in CONVERSATION]
    conv[2] = dict(
        conv[2],
        tool_calls=[
            {
                "id": "functions.get_weather:7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    )
    conv[3] = dict(conv[3], tool_call_id="functions.get_weather:7")
    assert tok.apply_chat_template(conv, tools=TOOLS) == expected.replace(":0", ":7")


def test_template_thinking_on_off_and_history():
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
    ]
    head = (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>hello<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
    )
    gen = "<|im_assistant|>assistant<|im_middle|>"
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, history) == head + gen + "<think>"
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, history, thinking=True) == head + gen + "<think>"
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, history, thinking=False) == head + gen + "<think></think>"
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, history, add_generation_prompt=False) == head
    kept = render_chat(KIMI_K2_CHAT_TEMPLATE, history, add_generation_prompt=False, preserve_thinking=True)
    assert kept == head.replace("<think></think>hello", "<think>greet back</think>hello")
    # A final assistant turn (no tool call) is the last "plain" one: history up to it loses reasoning.
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, history[:2], add_generation_prompt=False).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>hello<|im_end|>"
    )
    named = render_chat(KIMI_K2_CHAT_TEMPLATE, [{"role": "user", "content": "x", "name": "bob"}], thinking=False)
    assert "<|im_user|>bob<|im_middle|>x<|im_end|>" in named


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], r"^messages: must not be empty$"),
        ("hi", r"^messages: must be a list, got str$"),
        (["hi"], r"^messages\[0\]: must be an object, got str$"),
        ([{"content": "x"}], r"^messages\[0\]\.role: is required$"),
        ([{"role": "robot", "content": "x"}], r"^messages\[0\]\.role: unknown role 'robot'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], r"^messages\[1\]\.content: is required$"),
        ([{"role": "user", "content": 3}], r"^messages\[0\]\.content: must be a string, got int$"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            r"^messages\[0\]\.content: must be a string, got list$",
        ),
        ([{"role": "user", "content": "x", "name": 5}], r"^messages\[0\]\.name: must be a string, got int$"),
        ([{"role": "tool", "content": "x"}], r"^messages\[0\]\.tool_call_id: is required for tool messages$"),
        ([{"role": "user", "content": "x", "tool_calls": []}], r"^messages\[0\]\.tool_calls: only assistant messages"),
        (
            [{"role": "user", "content": "x", "reasoning_content": "r"}],
            r"^messages\[0\]\.reasoning_content: only assistant",
        ),
        ([{"role": "assistant", "tool_calls": "x"}], r"^messages\[0\]\.tool_calls: must be a list, got str$"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
            r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            r"^messages\[0\]\.tool_calls\[0\]\.function\.name: is required$",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
            r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: must be a JSON string or an object, got int$",
        ),
    ],
)
def test_template_validation(messages, message):
    with pytest.raises(ValueError, match=message):
        validate_messages(messages)
    with pytest.raises(ValueError, match=message):
        render_chat(KIMI_K2_CHAT_TEMPLATE, messages)


def test_template_validation_tools_and_kwargs():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"^tools: must be a list, got dict$"):
        render_chat(KIMI_K2_CHAT_TEMPLATE, user, tools={"name": "f"})
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name: is required$"):
        render_chat(KIMI_K2_CHAT_TEMPLATE, user, tools=[{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.messages: reserved"):
        render_chat(KIMI_K2_CHAT_TEMPLATE, user, chat_template_kwargs={"messages": []})
    assert render_chat(KIMI_K2_CHAT_TEMPLATE, user, chat_template_kwargs={"thinking": False}).endswith(
        "<think></think>"
    )
    # An assistant turn that only calls tools may omit its content.
    calls_only = user + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    assert "functions.f:0<|tool_call_argument_begin|>{}" in render_chat(KIMI_K2_CHAT_TEMPLATE, calls_only)


def test_template_sandbox_and_errors():
    with pytest.raises(ValueError, match="chat template: boom"):
        ChatTemplate("{{ raise_exception('boom') }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate("{% if %}")
    with pytest.raises(ValueError, match="chat template"):  # the sandbox blocks attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ValueError, match="chat template"):  # immutable: no mutation of inputs
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    assert (
        ChatTemplate("{{ tools | tojson }}").render(
            [{"role": "user", "content": "x"}], tools=[{"function": {"name": "f", "description": "é<>"}}]
        )
        == '[{"function": {"name": "f", "description": "é<>"}}]'
    )
