"""Reading a training corpus: `{split}_{kind}.txt` files of documents joined by the `[EOS]` text.

`python -m scripts.data.build_corpus OUT_DIR` writes such a corpus (train and heldout splits of code, prose and
chat); `ddtree train target`, the tokenizer trainer and the evaluation scripts read it through here.
"""

from __future__ import annotations

import pathlib

EOS = "[EOS]"
KINDS = ("code", "prose", "chat")


def read_documents(corpus_dir: str | pathlib.Path, split: str, kind: str) -> list[str]:
    text = (pathlib.Path(corpus_dir) / f"{split}_{kind}.txt").read_text(encoding="utf-8")
    return [d for d in text.split(EOS) if d]
