"""The demo tokenizer: a byte-level BPE (vocabulary 8192) trained on the demo corpus's training splits.

    python -m ddtree.training.tokenizer_training CORPUS_DIR OUT_DIR [--vocab-size 8192]

Same layout, special tokens (Kimi K2 + `[MASK]`, ids 0..16) and chat template as
`services/tokenization/default_tokenizer.py`; only the training texts and the vocabulary size differ. Special-token
text in the chats is cut out before training so that no merge spans a special token.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from ddtree.tokenization.default_tokenizer import SPECIAL_TOKENS, _write_atomic, tokenizer_config
from ddtree.training.corpus import KINDS, read_documents

VOCAB_SIZE = 8192
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def training_texts(corpus_dir: str | pathlib.Path) -> list[str]:
    texts = []
    for kind in KINDS:
        for doc in read_documents(corpus_dir, "train", kind):
            texts.extend(piece for piece in _SPECIAL_RE.split(doc) if piece)
    return texts


def train(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token!r} got id {tokenizer.token_to_id(token)}, expected {i}")
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    return tokenizer


def write_tokenizer(
    corpus_dir: str | pathlib.Path, out_dir: str | pathlib.Path, vocab_size: int = VOCAB_SIZE
) -> pathlib.Path:
    """Train on `corpus_dir` and write tokenizer.json + tokenizer_config.json into `out_dir`."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train(training_texts(corpus_dir), vocab_size)
    _write_atomic(out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="train the demo byte-level BPE on a corpus built by scripts.build_corpus")
    ap.add_argument("corpus_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    a = ap.parse_args(argv)
    print(write_tokenizer(a.corpus_dir, a.out_dir, a.vocab_size))


if __name__ == "__main__":
    main()
