"""The demo corpus builder is deterministic and its held-out splits never overlap training; the demo
tokenizer trained on it keeps the Kimi special tokens at their fixed ids."""

from __future__ import annotations

import json

import pytest

from ddtree.tokenization.default_tokenizer import SPECIAL_TOKENS
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.training.corpus import EOS, KINDS, read_documents
from ddtree.training.tokenizer_training import write_tokenizer
from scripts.data.build_corpus import build, roff_to_text

SMALL = dict(code_mb=0.3, prose_mb=0.2, chat_mb=0.15, heldout=0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    build(d / "a", **SMALL)
    return d / "a"


def test_two_builds_are_identical(corpus, tmp_path):
    build(tmp_path / "b", **SMALL)
    names = sorted(p.name for p in corpus.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (corpus / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_splits_are_disjoint_and_nonempty(corpus):
    manifest = json.loads((corpus / "manifest.json").read_text())
    for kind in KINDS:
        train, held = read_documents(corpus, "train", kind), read_documents(corpus, "heldout", kind)
        assert train and held, kind
        assert not set(train) & set(held), kind
        assert manifest["files"][f"train_{kind}.txt"]["documents"] == len(train)
    for kind in ("code", "prose"):
        assert not any(EOS in d or "<|im_" in d for d in read_documents(corpus, "train", kind))


def test_chats_are_kimi_format(corpus):
    chats = read_documents(corpus, "train", "chat")
    assert all(c.startswith("<|im_system|>") and c.endswith("<|im_end|>") for c in chats)
    text = "".join(chats)
    for marker in (
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>functions.",
        "<|tool_call_argument_begin|>{",
        "## Return of functions.",
        "<|im_system|>tool_declare",
    ):
        assert marker in text, marker
    assert "<think></think>" in text  # some turns with thinking off


def test_roff_to_text():
    src = '.TH LS 1\n.SH NAME\nls \\- list directory contents\n.\\" comment\n.B \\-a\ndo not ignore entries\n'
    assert roff_to_text(src) == "NAME\nls - list directory contents\n-a\ndo not ignore entries"


def test_tokenizer_on_corpus(corpus, tmp_path):
    out = write_tokenizer(corpus, tmp_path / "tok", vocab_size=600)
    tok = Tokenizer(out)
    assert tok.vocab_size == 600
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_id(name) == i
    chat = read_documents(corpus, "heldout", "chat")[0]
    ids = tok.encode(chat)
    assert ids[0] == tok.token_id("<|im_system|>") and tok.decode(ids) == chat
    assert tok.chat_template is not None
