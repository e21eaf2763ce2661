"""Tokenizer of a checkpoint: text <-> ids, special tokens and the chat template.

A tokenizer directory holds `tokenizer_config.json` (specials, `added_tokens_decoder`,
`chat_template`), optionally a `chat_template.jinja` that overrides the config's template, and one of
two encodings behind a small backend interface:

- `tokenizer.json` (Hugging Face `tokenizers` format): `_HFBackend`;
- `tiktoken.model` (Kimi's format: one `base64(token bytes) rank` per line) when there is no
  `tokenizer.json`: `_TiktokenBackend`. Special tokens come by id from `added_tokens_decoder`; the
  ids from the end of the BPE ranks up to `num_reserved_special_tokens` (256, Kimi's) past it are all
  special, unnamed ones as `<|reserved_token_{id}|>`. The pre-tokenizer is Kimi's pattern
  (`KIMI_PAT_STR`, docs/design.md §9.1) unless tokenizer_config.json sets `pat_str`. No remote code runs.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import tiktoken
from tokenizers import Tokenizer as HFTokenizer

from ddtree.tokenization.chat_template import ChatTemplate, validate_messages, validate_tools
from ddtree.tokenization.literal_content import LiteralContent


class _Backend(Protocol):
    vocab_size: int
    special_tokens: dict[str, int]  # specials the encoding itself defines (beyond tokenizer_config's)

    def encode(self, text: str, allow_special: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_ids: frozenset[int]) -> str: ...
    def id_to_token(self, token_id: int) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def token_bytes(self, token_id: int) -> bytes | None: ...


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the character a byte-level BPE uses for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
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
        self._tok = HFTokenizer.from_file(str(path))
        # A second instance that treats special-token strings in the text as plain text. The flag is
        # per instance, so two instances keep encode() free of shared mutable state across threads.
        self._tok_plain = HFTokenizer.from_file(str(path))
        self._tok_plain.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, int] = {}
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


# Kimi's pre-tokenizer (tokenization_kimi.py `pat_str`): Han runs; words with an optional leading
# non-letter, cased letters and marks except Han (class intersection `&&`), English contractions; 1-3
# digits; punctuation runs; newlines; other whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's encode() cuts text into pieces of at most this many characters, and cuts runs of more than
# MAX_RUN_CHARS whitespace or non-whitespace characters, to bound the regex engine's work.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")


def load_tiktoken_ranks(path: pathlib.Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token bytes) rank` per line; ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not a `base64 rank` line ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1} (duplicates or holes)")
    return ranks


def _split_long_runs(text: str) -> Iterator[str]:
    """Kimi's pieces: at most MAX_ENCODE_CHARS characters, runs cut every MAX_RUN_CHARS characters."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[i : i + MAX_ENCODE_CHARS]
        start = 0
        for m in _LONG_RUN.finditer(piece):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                yield piece[start:cut]
                start = cut
        yield piece[start:]


class _TiktokenBackend:
    """`tiktoken.Encoding` over Kimi's `tiktoken.model` + tokenizer_config.json."""

    def __init__(self, path: pathlib.Path, config: dict):
        ranks = load_tiktoken_ranks(path)
        n_base = len(ranks)
        named: dict[int, str] = {}
        for id_str, entry in (config.get("added_tokens_decoder") or {}).items():
            token_id, content = int(id_str), (entry or {}).get("content")
            if content is None:
                continue
            if token_id < n_base:
                raise ValueError(
                    f"{path.parent}: added token {content!r} has id {token_id}, inside the BPE ranks 0..{n_base - 1}"
                )
            named[token_id] = content
        reserved = int(config.get("num_reserved_special_tokens", NUM_RESERVED_SPECIAL_TOKENS))
        top = max([n_base + reserved - 1, *named])
        specials: dict[str, int] = {}
        for token_id in range(n_base, top + 1):
            name = named.get(token_id, f"<|reserved_token_{token_id}|>")
            if name in specials:
                raise ValueError(f"{path.parent}: special token {name!r} has two ids, {specials[name]} and {token_id}")
            specials[name] = token_id
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "tiktoken",
            pat_str=config.get("pat_str", KIMI_PAT_STR),
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._ranks = ranks
        self._names = {i: name for name, i in specials.items()}
        self.special_tokens = specials
        self.vocab_size = top + 1
        self._byte_chars = {b: c for c, b in _byte_decoder().items()}
        self._char_bytes = _byte_decoder()

    def encode(self, text: str, allow_special: bool) -> list[int]:
        ids: list[int] = []
        for piece in _split_long_runs(text):
            if allow_special:
                ids += self._enc.encode(piece, allowed_special="all")
            else:
                ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def decode(self, ids: Sequence[int], skip_ids: frozenset[int]) -> str:
        if skip_ids:
            ids = [i for i in ids if i not in skip_ids]
        return self._enc.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """Specials by name; BPE tokens in the byte-level alphabet Hugging Face prints ('Ġworld')."""
        if token_id in self._names:
            return self._names[token_id]
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return "".join(self._byte_chars[b] for b in self._enc.decode_single_token_bytes(token_id))

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        if all(c in self._char_bytes for c in token):
            return self._ranks.get(bytes(self._char_bytes[c] for c in token))
        return self._ranks.get(token.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes | None:
        if not 0 <= token_id < self.vocab_size:
            return None
        return self._enc.decode_single_token_bytes(token_id)


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_backend(directory: pathlib.Path, config: dict) -> _Backend:
    json_path = directory / "tokenizer.json"
    if json_path.is_file():
        return _HFBackend(json_path)
    tiktoken_path = directory / "tiktoken.model"
    if tiktoken_path.is_file():
        return _TiktokenBackend(tiktoken_path, config)
    raise FileNotFoundError(f"{directory}: no tokenizer.json or tiktoken.model")


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
        self._backend = backend = _load_backend(directory, config)
        self.name = str(directory)
        self.vocab_size: int = backend.vocab_size
        self.model_max_length: int | None = config.get("model_max_length")

        specials: dict[str, int] = dict(backend.special_tokens)
        for id_str, entry in (config.get("added_tokens_decoder") or {}).items():
            if entry.get("special", True) and entry.get("content") is not None:
                specials[entry["content"]] = int(id_str)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
            content = _token_content(config.get(key))
            if content is not None and content not in specials:
                token_id = backend.token_to_id(content)
                if token_id is not None:
                    specials[content] = token_id
        self.special_tokens: dict[str, int] = specials  # name -> id
        self.special_ids: frozenset[int] = frozenset(specials.values())

        def resolve(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else self.token_id(content)

        self.bos_id = resolve("bos_token")
        self.eos_id = resolve("eos_token")
        self.pad_id = resolve("pad_token")
        template = _load_chat_template(directory, config)
        self.chat_template: ChatTemplate | None = ChatTemplate(template) if template else None
        self._literal = LiteralContent(specials) if specials else None
        if self._literal is not None and template:
            self._literal.check_template(template)

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
    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages with the checkpoint's template (see chat_template.ChatTemplate.render)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name or 'this tokenizer'} has no chat template")
        return self.chat_template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        allow_special_in_content: bool = False,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its ids. Text from the request (every string of `messages`, `tools`
        and the template variables) is encoded as plain text: a special-token string typed by a user
        becomes ordinary pieces, and only the template's own structure tokens are special ids
        (literal_content.py). `allow_special_in_content` restores the old behaviour: the rendered
        string encoded with every special-token string as its special id."""
        if allow_special_in_content or self._literal is None:
            text = self.apply_chat_template(messages, tools, add_generation_prompt, chat_template_kwargs, **kwargs)
            return text, self.encode(text, allow_special=True)
        validate_messages(messages)  # errors quote the request as given, not masked
        validate_tools(tools)
        literals: list[str] = []
        mask = self._literal.mask
        rendered = self.apply_chat_template(
            mask(messages, literals),
            mask(tools, literals),
            add_generation_prompt,
            mask(chat_template_kwargs, literals),
            **mask(kwargs, literals),
        )
        text_parts: list[str] = []
        ids: list[int] = []
        for segment, special in self._literal.split_rendered(rendered, literals):
            text_parts.append(segment)
            ids += [self.special_tokens[segment]] if special else self.encode(segment, allow_special=False)
        return "".join(text_parts), ids
