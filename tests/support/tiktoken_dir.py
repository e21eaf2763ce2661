"""A small tokenizer in Kimi's tiktoken format (tiktoken.model + tokenizer_config.json) with Kimi-style special ids."""

from __future__ import annotations

import base64
import json

from ddtree.tokenization.default_tokenizer import KIMI_K2_CHAT_TEMPLATE

# Offsets from the first special id, as in Kimi K2 (163584 + offset; docs/design.md §9.1).
KIMI_SPECIALS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}


# Multi-byte tokens, each added with all its prefixes so BPE can reach it. "o中" comes first (lowest
# ranks): only a pre-tokenizer that separates Han from Latin letters keeps it out of "hello中".
WORDS = [
    "o中".encode(),
    b"hello",
    b" world",
    b" the",
    b"functions",
    b".get",
    b"_weather",
    b"12345",
    "中文".encode(),
    "Grüße".encode(),
    "😀".encode()[:2],
    b'{"',
    b'":',
    b' "',
]


def tiktoken_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        for k in range(2, len(word) + 1):
            ranks.setdefault(word[:k], len(ranks))
    return ranks


def write_tiktoken_dir(directory, pat_str: str | None = None, template: bool = True):
    directory.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks()
    (directory / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    )
    n = len(ranks)
    config = {
        "added_tokens_decoder": {
            str(n + off): {"content": name, "special": True} for name, off in KIMI_SPECIALS.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "model_max_length": 4096,
    }
    if pat_str is not None:
        config["pat_str"] = pat_str
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template:
        (directory / "chat_template.jinja").write_text(KIMI_K2_CHAT_TEMPLATE)
    return directory, n
