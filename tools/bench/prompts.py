"""Prompts of an exact length in tokens, by kind of text.

  padding  one sentence repeated (the field case's padding prompts; the easiest text to draft)
  code     Python source: the standard library's modules, or `heldout_code.txt` of --corpus
  prose    English prose: the standard library's docstrings, or `heldout_prose.txt` of --corpus

With a corpus dir (`python -m scripts.data.build_corpus` writes `heldout_{kind}.txt`, documents separated by
[EOS]) any kind with such a file can be used (e.g. chat). Text is read in a fixed order, so every run
and machine builds the same prompts for the same tokenizer; prompt i is tokens [i*C, (i+1)*C) of the
kind's token stream.
"""

from __future__ import annotations

import ast
import pathlib
import sysconfig
from collections.abc import Iterator

PADDING = (
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly, "
    "and the padding goes on in the same words. "
)
EOS_TEXT = "[EOS]"
BUILTIN_KINDS = ("padding", "code", "prose")


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def _stdlib_code() -> Iterator[str]:
    for path in _stdlib_files():
        yield path.read_text(encoding="utf-8", errors="replace")


def _stdlib_prose() -> Iterator[str]:
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:  # skip one-liners: prose, not labels
                    yield doc + "\n\n"


def documents(kind: str, corpus: pathlib.Path | None = None) -> Iterator[str]:
    if kind == "padding":
        while True:
            yield PADDING * 16
    if corpus is not None and (corpus / f"heldout_{kind}.txt").is_file():
        for doc in (corpus / f"heldout_{kind}.txt").read_text(encoding="utf-8").split(EOS_TEXT):
            if doc.strip():
                yield doc
        return
    if kind == "code":
        yield from _stdlib_code()
    elif kind == "prose":
        yield from _stdlib_prose()
    elif corpus is not None:
        raise ValueError(f"no {corpus / f'heldout_{kind}.txt'}")
    else:
        raise ValueError(f"unknown kind {kind!r}: {' | '.join(BUILTIN_KINDS)}, or any heldout_KIND.txt of --corpus")


def make_prompts(tokenizer, kind: str, context: int, count: int, corpus: pathlib.Path | None = None) -> list[list[int]]:
    """`count` prompts of exactly `context` tokens of `kind` text."""
    if context < 1 or count < 1:
        raise ValueError(f"context and count must be >= 1, got {context} and {count}")
    need = context * count
    ids: list[int] = []
    for doc in documents(kind, corpus):
        ids += tokenizer.encode(doc, allow_special=False)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"{kind} text gives {len(ids)} tokens, {count} prompt(s) of {context} need {need}")
    return [ids[i * context : (i + 1) * context] for i in range(count)]


def prompt_grid(tokenizer, kinds: list[str], contexts: list[int], n: int, corpus: str) -> dict[tuple[str, int], list]:
    """(kind, context) -> n prompts of exactly `context` tokens of that kind of text (corpus "" = the
    standard library): what `bench context`, `bench twopoint` and `diagnose` sweep over."""
    where = pathlib.Path(corpus) if corpus else None
    return {(k, c): make_prompts(tokenizer, k, c, n, where) for k in kinds for c in contexts}
