"""IncrementalDetokenizer: streamed text equals the full decode, and never shows a broken character."""

from __future__ import annotations

import random

import pytest

from ddtree.gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer
from ddtree.tokenization.tokenizer import Tokenizer


class _NoBytes(Tokenizer):
    """The same tokenizer without per-token bytes: forces the text (fallback) path."""

    def token_bytes(self, token_id):
        return None


@pytest.fixture(scope="module", params=["bytes", "text"])
def make_tok(request, tokenizer_dir, tok):
    if request.param == "bytes":
        return tok
    return _NoBytes(tokenizer_dir)


def _stream(tok, ids, rng, skip_special=False, max_batch=4):
    d = IncrementalDetokenizer(tok, skip_special=skip_special)
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randint(0, max_batch)  # 0: empty pushes happen too (a step with no text)
        pieces.append(d.push(ids[i : i + k]))
        i += k
    tail = d.flush()
    return pieces, tail


TEXTS = [
    "",
    "plain ascii text, nothing special.",
    "中文字符串，每个字都是三个字节。",
    "emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵 and a family 👩‍👩‍👧",
    "mixed: Grüße, Ωmega, Жж, 日本語, 한국어, العربية",
    "<think>reasoning</think>answer<|im_end|>",
    "\U0010ffff\u0000\ufeff edge code points",
]


@pytest.mark.parametrize("text", TEXTS)
def test_valid_text_streams_exactly_without_replacement(make_tok, text):
    tok = make_tok
    ids = tok.encode(text)
    rng = random.Random(len(text))
    for batch in (1, 2, 5):
        pieces, tail = _stream(tok, ids, rng, max_batch=batch)
        assert "".join(pieces) + tail == text == tok.decode(ids)
        assert not any(REPLACEMENT in p for p in pieces + [tail]), pieces
    # One token at a time, every piece is valid text on its own.
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push([i]) for i in ids) + d.flush() == text


def test_multibyte_split_across_tokens_is_held_back(tok):
    # The small vocabulary spells CJK and emoji byte by byte: check the split really happens.
    ids = tok.encode("😀")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert [d.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "😀"
    assert d.flush() == ""


def test_incomplete_tail_becomes_replacement_at_flush(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji
    d = IncrementalDetokenizer(tok)
    assert d.push(ids) == "ok "
    assert d.flush() == tok.decode(ids)[len("ok ") :]
    assert tok.decode(ids).endswith(REPLACEMENT)


@pytest.mark.parametrize("skip_special", [False, True])
def test_random_token_streams_match_full_decode(make_tok, skip_special):
    tok = make_tok
    rng = random.Random(1234 + skip_special)
    n_special = len(tok.special_ids)
    for trial in range(300 if make_tok.__class__ is Tokenizer else 60):
        n = rng.randint(0, 30)
        # Lean on the single-byte tokens (ids just after the specials) to get many invalid and
        # split UTF-8 sequences; mix in specials and arbitrary merges.
        ids = [
            rng.choice(
                [rng.randrange(tok.vocab_size), rng.randrange(n_special, n_special + 256), rng.randrange(n_special)]
            )
            for _ in range(n)
        ]
        pieces, tail = _stream(tok, ids, rng, skip_special=skip_special)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip_special), (trial, ids)


def test_random_valid_text_streams(tok):
    rng = random.Random(7)
    alphabet = "ab cé中😀👍🏽\n" + "".join(chr(rng.randrange(0x80, 0x2FFFF)) for _ in range(40))
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        text = "".join(c for c in text if not 0xD800 <= ord(c) < 0xE000)
        ids = tok.encode(text)
        pieces, tail = _stream(tok, ids, rng)
        assert "".join(pieces) + tail == text
        assert all(REPLACEMENT not in p for p in pieces)


def test_skip_special_and_bad_ids(tok):
    ids = tok.encode("<think>x</think>y<|im_end|>")
    d = IncrementalDetokenizer(tok, skip_special=True)
    assert d.push(ids) + d.flush() == "xy"
    d = IncrementalDetokenizer(tok)
    assert d.push(ids) + d.flush() == "<think>x</think>y<|im_end|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).push([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).push([-1])
