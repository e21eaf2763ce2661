"""Tokenizer of a checkpoint: text <-> ids, special tokens and the chat template.

A tokenizer directory holds `tokenizer.json` (Hugging Face `tokenizers` format) and
`tokenizer_config.json` (specials, `added_tokens_decoder`, `chat_template`), optionally a
`chat_template.jinja` that overrides the config's template. The encoding itself sits behind a small
backend interface (`_HFBackend`) so a tiktoken backend (Kimi's `tiktoken.model`) can be added beside it.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Protocol, Sequence

from services.gateway.chat_template import ChatTemplate


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str, allow_special: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_ids: frozenset[int]) -> str: ...
    def id_to_token(self, token_id: int) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def token_bytes(self, token_id: int) -> bytes | None: ...


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the character a byte-level BPE uses for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class _HFBackend:
    """`tokenizers.Tokenizer` from tokenizer.json. Byte-level BPE decoders get exact per-token bytes."""

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        # A second instance that treats special-token strings in the text as plain text. The flag is
        # per instance, so two instances keep encode() free of shared mutable state across threads.
        self._tok_plain = HFTokenizer.from_file(str(path))
        self._tok_plain.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        decoder = json.loads(path.read_text(encoding="utf-8")).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._bytes: list[bytes] | None = None

    def encode(self, text: str, allow_special: bool) -> list[int]:
        tok = self._tok if allow_special else self._tok_plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_ids: frozenset[int]) -> str:
        if skip_ids:
            ids = [i for i in ids if i not in skip_ids]
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes the ByteLevel decoder produces for this token, or None if not byte-level."""
        if not self._byte_level:
            return None
        if self._bytes is None:
            table = _byte_decoder()
            out: list[bytes] = []
            for i in range(self.vocab_size):
                token = self._tok.id_to_token(i)
                if token is None:  # a hole in the id space decodes to nothing
                    out.append(b"")
                elif all(c in table for c in token):
                    out.append(bytes(table[c] for c in token))
                else:  # the ByteLevel decoder passes such tokens (added tokens) through as UTF-8
                    out.append(token.encode("utf-8"))
            self._bytes = out
        if not 0 <= token_id < len(self._bytes):
            return None
        return self._bytes[token_id]


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_backend(directory: pathlib.Path) -> _Backend:
    json_path = directory / "tokenizer.json"
    if json_path.is_file():
        return _HFBackend(json_path)
    # NOTE: a tiktoken backend (tiktoken.model, Kimi's own format) goes here.
    raise FileNotFoundError(f"{directory}: no tokenizer.json")


def _load_chat_template(directory: pathlib.Path, config: dict) -> str | None:
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # HF allows [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class Tokenizer:
    """Tokenizer of one checkpoint directory: `Tokenizer(dir)`. Thread-safe: every method reads
    immutable state only."""

    def __init__(self, directory: str | os.PathLike):
        directory = pathlib.Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self._backend = backend = _load_backend(directory)
        self.name = str(directory)
        self.vocab_size: int = backend.vocab_size
        self.model_max_length: int | None = config.get("model_max_length")

        specials: dict[str, int] = {}
        for id_str, entry in (config.get("added_tokens_decoder") or {}).items():
            if entry.get("special", True) and entry.get("content") is not None:
                specials[entry["content"]] = int(id_str)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
            content = _token_content(config.get(key))
            if content is not None and content not in specials:
                token_id = backend.token_to_id(content)
                if token_id is not None:
                    specials[content] = token_id
        self.special_tokens: dict[str, int] = specials           # name -> id
        self.special_ids: frozenset[int] = frozenset(specials.values())

        def resolve(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else self.token_id(content)

        self.bos_id = resolve("bos_token")
        self.eos_id = resolve("eos_token")
        self.pad_id = resolve("pad_token")
        template = _load_chat_template(directory, config)
        self.chat_template: ChatTemplate | None = ChatTemplate(template) if template else None

    # -- ids ---------------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`, no BOS added. With allow_special, special-token strings in the text
        become their special ids; without, they are encoded as plain text."""
        return self._backend.encode(text, allow_special)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. Raises ValueError for ids outside the vocab."""
        ids = list(ids)
        self.check_ids(ids)
        return self._backend.decode(ids, self.special_ids if skip_special else frozenset())

    def check_ids(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")

    def token_id(self, name: str) -> int:
        """Id of a token given by its text (e.g. "<|im_end|>"); KeyError if it is not one token."""
        if name in self.special_tokens:
            return self.special_tokens[name]
        token_id = self._backend.token_to_id(name)
        if token_id is None:
            raise KeyError(f"{name!r} is not a token of {self.name or 'this tokenizer'}")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of an id (byte-level pieces such as 'Ġworld', as HF prints them)."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """Exact bytes of one token when the backend can tell (byte-level BPE, tiktoken), else None."""
        return self._backend.token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- chat --------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                            **kwargs: Any) -> str:
        """Render messages with the checkpoint's template (see chat_template.ChatTemplate.render)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name or 'this tokenizer'} has no chat template")
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         chat_template_kwargs=chat_template_kwargs, **kwargs)
