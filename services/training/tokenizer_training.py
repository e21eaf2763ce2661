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

from ddtree.tokenization.default_tokenizer import SPECIAL_TOKENS, _write_atomic, tokenizer_config, train_bpe
from ddtree.training.corpus import KINDS, read_documents

VOCAB_SIZE = 8192
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def training_texts(corpus_dir: str | pathlib.Path) -> list[str]:
    texts = []
    for kind in KINDS:
        for doc in read_documents(corpus_dir, "train", kind):
            texts.extend(piece for piece in _SPECIAL_RE.split(doc) if piece)
    return texts


def write_tokenizer(
    corpus_dir: str | pathlib.Path, out_dir: str | pathlib.Path, vocab_size: int = VOCAB_SIZE
) -> pathlib.Path:
    """Train on `corpus_dir` and write tokenizer.json + tokenizer_config.json into `out_dir`."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(training_texts(corpus_dir), vocab_size)
    _write_atomic(out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="train the demo byte-level BPE on a corpus built by scripts.data.build_corpus"
    )
    ap.add_argument("corpus_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    a = ap.parse_args(argv)
    print(write_tokenizer(a.corpus_dir, a.out_dir, a.vocab_size))


if __name__ == "__main__":
    main()
