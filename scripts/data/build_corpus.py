"""Deterministic training corpus for the demo target, from what a stock Debian + Python 3.11 machine has
offline: (a) code, the standard library's own sources; (b) English prose, the interactive help topics,
the standard library's docstrings, then GNU info manuals and English man pages when installed; (c)
synthetic chats in the Kimi K2 format (reasoning sections, tool declarations, tool calls and results)
rendered with our chat template from a seeded RNG.

    python -m scripts.data.build_corpus OUT_DIR [--code-mb 12 --prose-mb 10 --chat-mb 6]

Writes `train_{kind}.txt` and `heldout_{kind}.txt` for kind in code, prose, chat (documents joined by the
`[EOS]` special-token text, which no source document contains) and `manifest.json` (sizes, document
counts, sha256 of every file, the sources used). A document is held out when its sha256 falls in the
first `heldout` fraction of the hash space, so splits never overlap and do not depend on order.
Sources are read in sorted order and the RNG is seeded: the same machine gives the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import pathlib
import re
import sysconfig
import time

from ddtree.tokenization.default_tokenizer import help_topic_texts
from ddtree.training.corpus import EOS, KINDS
from scripts.data import synthetic_chats

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}
MAX_FILE_BYTES = 150_000
MIN_FILE_BYTES = 300
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
FORBIDDEN = ("[EOS]", "<|im_", "<think>", "</think>", "<|tool_")  # special-token text never occurs in sources


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _clean(text: str) -> str | None:
    if any(s in text for s in FORBIDDEN):
        return None
    return text.replace("\r\n", "\n").strip("\n") + "\n"


def _by_hash(paths: list[pathlib.Path], root: pathlib.Path) -> list[pathlib.Path]:
    """A fixed, well-mixed order that does not depend on the directory listing order."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def _take(docs, budget: int, clean: bool = True) -> list[str]:
    out, size = [], 0
    for doc in docs:
        if size >= budget:
            break
        doc = (_clean(doc) if clean else doc) if doc else None
        if doc:
            out.append(doc)
            size += len(doc.encode())
    return out


# ---- code ---------------------------------------------------------------------------------------------
def stdlib_sources(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    root = root or stdlib_dir()
    files = [
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and MIN_FILE_BYTES <= p.stat().st_size <= MAX_FILE_BYTES
    ]
    return _by_hash(files, root)


def code_docs(budget: int) -> list[str]:
    def read():
        for p in stdlib_sources():
            try:
                yield p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    return _take(read(), budget)


# ---- prose --------------------------------------------------------------------------------------------
def help_topics() -> list[str]:
    """The values of `topics = {...}` in pydoc_data/topics.py, in key order, without importing it."""
    return help_topic_texts(stdlib_dir() / "pydoc_data" / "topics.py")


def docstrings(source: str, min_chars: int = 120) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= min_chars:
                out.append(doc)
    return out


def module_docstring_docs() -> list[str]:
    """One document per stdlib module: its long docstrings joined by blank lines."""
    docs = []
    for p in stdlib_sources():
        try:
            found = docstrings(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if found:
            docs.append("\n\n".join(found))
    return docs


_ROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),
    (re.compile(r"\\s[+-]?\d"), ""),
    (re.compile(r"\\\(em|\\\(en"), "-"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((oq|cq|aq)"), "'"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[-e]"), lambda m: "-" if m.group() == "\\-" else "\\"),
    (re.compile(r"\\[&|^0~ ]"), " "),
    (re.compile(r"\\\*\(..|\\\*."), ""),
    (re.compile(r"\\c$"), ""),
]
_TEXT_MACROS = {
    ".SH": "\n",
    ".SS": "\n",
    ".B": "",
    ".I": "",
    ".BR": "",
    ".IR": "",
    ".RB": "",
    ".RI": "",
    ".BI": "",
    ".IB": "",
    ".SM": "",
    ".Nm": "",
    ".Nd": "",
    ".Sh": "\n",
    ".Ss": "\n",
}
_BREAK_MACROS = {".PP", ".LP", ".P", ".TP", ".IP", ".sp", ".br", ".HP", ".Pp"}


def roff_to_text(src: str) -> str:
    """A rough man(7) -> plain text: keep the words, drop formatting; good enough for language modelling."""
    lines = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\"')):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            if macro in _BREAK_MACROS:
                lines.append("")
                if macro == ".IP" and rest:
                    lines.append(rest.strip('"').split('"')[0])
                continue
            if macro not in _TEXT_MACROS:
                continue
            line = _TEXT_MACROS[macro] + " ".join(w.strip('"') for w in re.findall(r'"[^"]*"|\S+', rest))
        for pattern, repl in _ROFF_ESCAPES:
            line = pattern.sub(repl, line)
        lines.append(line.rstrip())
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def man_docs() -> list[str]:
    root = pathlib.Path("/usr/share/man")
    files = [p for s in MAN_SECTIONS if (root / s).is_dir() for p in (root / s).iterdir() if p.is_file()]
    out = []
    for p in _by_hash(files, root) if files else []:
        try:
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if text.startswith(".so "):  # alias page
            continue
        text = roff_to_text(text)
        if len(text) >= 400 and text.isascii():
            out.append(text)
        if len(out) >= 5000:
            break
    return out


def info_docs() -> list[str]:
    """GNU info manuals, one document per node."""
    root = pathlib.Path("/usr/share/info")
    files = sorted(p for p in root.glob("*.info*.gz")) if root.is_dir() else []
    out = []
    for p in files:
        try:
            text = gzip.decompress(p.read_bytes()).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        for node in text.split("\x1f"):
            node = node.strip()
            if len(node) >= 400 and node.isascii() and not node.startswith("Tag Table"):
                out.append(node)
    return out


def prose_docs(budget: int) -> tuple[list[str], dict[str, int]]:
    """Help topics and docstrings first (every Python has them), then info manuals and man pages."""
    out, counts = [], {}
    for name, source in (
        ("pydoc_topics", help_topics),
        ("stdlib_docstrings", module_docstring_docs),
        ("info", info_docs),
        ("man", man_docs),
    ):
        left = budget - sum(len(d.encode()) for d in out)
        if left <= 0:
            break
        docs = _take(source(), left)
        counts[name] = len(docs)
        out.extend(docs)
    return out, counts


# ---- splits and output --------------------------------------------------------------------------------
def is_heldout(doc: str, fraction: float) -> bool:
    return int(_digest(doc)[:8], 16) < fraction * 16**8


def build(
    out_dir: str | pathlib.Path,
    code_mb: float = 12,
    prose_mb: float = 10,
    chat_mb: float = 6,
    heldout: float = 0.03,
    seed: int = 0,
) -> dict:
    start = time.time()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mb = 1_000_000
    code = code_docs(int(code_mb * mb))
    prose, prose_sources = prose_docs(int(prose_mb * mb))
    chat = _take(
        synthetic_chats.generate(
            seed,
            functions=synthetic_chats.functions_from_sources(code),
            paragraphs=synthetic_chats.paragraphs_from_prose(prose),
        ),
        int(chat_mb * mb),
        clean=False,
    )
    manifest: dict = {
        "version": 1,
        "seed": seed,
        "heldout_fraction": heldout,
        "python": sysconfig.get_python_version(),
        "separator": EOS,
        "prose_sources": prose_sources,
        "files": {},
    }
    for kind, docs in zip(KINDS, (code, prose, chat)):
        parts = {
            "train": [d for d in docs if not is_heldout(d, heldout)],
            "heldout": [d for d in docs if is_heldout(d, heldout)],
        }
        for split, chosen in parts.items():
            name = f"{split}_{kind}.txt"
            data = EOS.join(chosen).encode("utf-8")
            (out / name).write_bytes(data)
            manifest["files"][name] = {
                "documents": len(chosen),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    manifest["seconds"] = round(time.time() - start, 1)
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--code-mb", type=float, default=12)
    ap.add_argument("--prose-mb", type=float, default=10)
    ap.add_argument("--chat-mb", type=float, default=6)
    ap.add_argument("--heldout", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    m = build(a.out_dir, a.code_mb, a.prose_mb, a.chat_mb, a.heldout, a.seed)
    for name, f in m["files"].items():
        print(f"{name:20s} {f['documents']:6d} docs {f['bytes'] / 1e6:8.2f} MB  {f['sha256'][:12]}")
    print(f"prose sources {m['prose_sources']}; total {m['total_bytes'] / 1e6:.1f} MB in {m['seconds']} s")


if __name__ == "__main__":
    main()
