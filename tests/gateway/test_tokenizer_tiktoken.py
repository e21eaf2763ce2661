"""The tiktoken backend (Kimi's `tiktoken.model` + tokenizer_config.json): a small tokenizer in that
format, built here with Kimi-style special ids, through Tokenizer, the detokenizer and the gateway."""

from __future__ import annotations

import json
import random
import shutil

import grpc
import pytest

from ddtree.config import GatewayConfig
from ddtree.gateway.api.server import serve
from ddtree.gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer
from ddtree.protocol.ddtree.v1 import gateway_pb2, gateway_pb2_grpc
from ddtree.tokenization.default_tokenizer import write_default_tokenizer
from ddtree.tokenization.tokenizer import MAX_RUN_CHARS, Tokenizer
from tests.support.fakes import script_for, start_fake_verifier
from tests.support.tiktoken_dir import KIMI_SPECIALS, tiktoken_ranks, write_tiktoken_dir


@pytest.fixture(scope="module")
def tk_dir(tmp_path_factory):
    return write_tiktoken_dir(tmp_path_factory.mktemp("tiktoken") / "kimi")


@pytest.fixture(scope="module")
def tk(tk_dir):
    return Tokenizer(tk_dir[0])


def test_chosen_without_tokenizer_json(tk, tk_dir, tmp_path, tmp_path_factory):
    _, n = tk_dir
    assert tk.vocab_size == n + 256  # BPE ranks + Kimi's 256 reserved special ids
    assert tk.bos_id == n and tk.eos_id == n + 1 and tk.model_max_length == 4096
    # With a tokenizer.json beside it, tokenizer.json wins.
    both = tmp_path / "both"
    shutil.copytree(tk_dir[0], both)
    hf = tmp_path_factory.getbasetemp() / "default-tokenizer"  # shared with the other tokenizer tests
    if not (hf / "tokenizer_config.json").is_file():
        write_default_tokenizer(hf)
    shutil.copy(hf / "tokenizer.json", both / "tokenizer.json")
    assert Tokenizer(both).vocab_size == 4096


def test_kimi_special_tokens_are_single_tokens(tk, tk_dir):
    _, n = tk_dir
    for name, off in KIMI_SPECIALS.items():
        assert tk.encode(name) == [n + off], name
        assert tk.decode([n + off]) == name
        assert tk.token_id(name) == n + off and tk.id_to_token(n + off) == name
        assert tk.special_tokens[name] == n + off and tk.is_special(n + off)
        assert len(tk.encode(name, allow_special=False)) > 1  # as plain text: several tokens
        assert tk.decode(tk.encode(name, allow_special=False)) == name
    # Unnamed ids of the reserved range are specials too, named as Kimi names them.
    assert tk.decode([n + 5]) == f"<|reserved_token_{n + 5}|>" and tk.encode(f"<|reserved_token_{n + 5}|>") == [n + 5]
    assert len(tk.special_ids) == 256
    text = "hello<|im_end|> world<think>x</think>"
    ids = tk.encode(text)
    assert ids.count(n + 2) == 1 and n + 22 in ids and n + 23 in ids
    assert tk.decode(ids) == text
    assert tk.decode(ids, skip_special=True) == "hello worldx"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tk.decode([n + 256])


TEXTS = [
    "hello world, the functions.get_weather",
    "中文字符串 and Grüße",
    "emoji 😀😀👍🏽 flags 🇫🇷 family 👩‍👩‍👧",
    "numbers 12345 67890",
    "<|im_user|>user<|im_middle|>hi 😀<|im_end|>",
    "\U0010ffff\u0000 edge",
    "",
    "tabs\t\tand\n\nnewlines  \r\n end   ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_streamed_decode(tk, text):
    ids = tk.encode(text)
    assert tk.decode(ids) == text
    rng = random.Random(text)
    for _ in range(20):
        d, pieces, i = IncrementalDetokenizer(tk), [], 0
        while i < len(ids):
            k = rng.randint(0, 3)
            pieces.append(d.push(ids[i : i + k]))
            i += k
        pieces.append(d.flush())
        assert "".join(pieces) == text
        assert all(REPLACEMENT not in p for p in pieces) or REPLACEMENT in text


def test_emoji_split_across_tokens_is_held_back(tk):
    ids = tk.encode("😀")
    assert len(ids) == 3  # a token of its first 2 bytes, then one per byte
    d = IncrementalDetokenizer(tk)
    assert d.push(ids[:1]) == "" and d.push(ids[1:2]) == ""
    assert d.push(ids[2:]) == "😀"


def test_random_unicode_round_trip(tk):
    rng = random.Random(0)
    alphabet = [
        chr(c) for c in (*range(32, 127), *range(0xA0, 0x250), *range(0x4E00, 0x4E40), *range(0x1F600, 0x1F640))
    ]
    alphabet += ["\n", "\t", " ", "<|im_end|>", "<think>"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tk.decode(tk.encode(text)) == text


def test_pre_tokenizer_is_kimis(tk, tmp_path):
    ranks = tiktoken_ranks()
    o_han, five_digits = ranks["o中".encode()], ranks[b"12345"]
    ids = tk.encode("hello中文 12345")
    assert o_han not in ids and five_digits not in ids  # Han apart from letters; digits at most 3 at a time
    assert tk.decode(ids) == "hello中文 12345"
    # Control: one piece for the whole text, and BPE does form those tokens.
    plain, _ = write_tiktoken_dir(tmp_path / "plain", pat_str=r"[\s\S]+", template=False)
    ids = Tokenizer(plain).encode("hello中文 12345")
    assert o_han in ids and five_digits in ids


def test_long_runs_are_cut(tk):
    text = "a" * (MAX_RUN_CHARS * 2 + 7) + " " * (MAX_RUN_CHARS + 3) + "b"
    assert tk.decode(tk.encode(text)) == text


def test_chat_template_jinja(tk, tk_dir):
    _, n = tk_dir
    prompt = tk.apply_chat_template([{"role": "user", "content": "hello 😀"}])
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    ids = tk.encode(prompt)
    for name in ("<|im_user|>", "<|im_middle|>", "<|im_end|>", "<|im_assistant|>", "<think>"):
        assert n + KIMI_SPECIALS[name] in ids


def test_gateway_parses_tool_calls_with_tiktoken_ids(tk, tk_dir):
    fake, fake_server = start_fake_verifier()
    running = serve(GatewayConfig(verifier=fake.address, tokenizer=str(tk_dir[0]), http_port=-1), announce=False)
    try:
        output = (
            "check</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "中文"}<|tool_call_end|><|tool_calls_section_end|>'
        )
        ids = tk.encode(output) + [tk.token_id("<|im_end|>")]
        assert len(ids) < len(output)
        fake.reset(script_for(ids, finish="stop"))
        with grpc.insecure_channel(running.address) as ch:
            tools = json.dumps([{"type": "function", "function": {"name": "get_weather"}}])
            chunks = list(
                gateway_pb2_grpc.GatewayStub(ch).Chat(
                    gateway_pb2.ChatRequest(
                        messages=[gateway_pb2.ChatMessage(role="user", content="weather?")], tools_json=tools
                    ),
                    timeout=10,
                )
            )
        assert "".join(c.reasoning_delta for c in chunks) == "check"
        calls = [d for c in chunks for d in c.tool_calls]
        assert calls[0].id == "functions.get_weather:0" and calls[0].name == "get_weather"
        assert "".join(d.arguments_delta for d in calls) == '{"city": "中文"}'
        assert chunks[-1].finish_reason == "tool_calls"
        assert list(fake.requests[-1].stop_token_ids) == [tk.token_id("<|im_end|>"), tk.token_id("[EOS]")]
    finally:
        running.stop(0)
        fake_server.stop(0)
