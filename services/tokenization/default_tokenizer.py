"""The demo tokenizer: a 4096-token byte-level BPE trained on text every Python install ships.

`write_default_tokenizer(dir)` trains it with the `tokenizers` library and writes `tokenizer.json` and
`tokenizer_config.json` (specials, Kimi K2 chat template). Training is deterministic: the corpus is a
fixed, ordered list of standard-library sources, their docstrings and the `pydoc_data` help topics,
read in that order, so the same Python version gives the same bytes on every machine.

The special tokens are those of Kimi K2 (docs/design.md §9.1) plus the drafter's `[MASK]`, at fixed ids 0..16.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 8192
MASK_TOKEN = "[MASK]"
BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
IM_END = "<|im_end|>"

# id i = SPECIAL_TOKENS[i]; the order is part of the checkpoint format.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END,
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    MASK_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
)

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi K2 structure (docs/design.md §9.2): K2-Thinking history rules (assistant turns up to the last one without
# tool calls get an empty <think></think>, later ones keep reasoning_content; `preserve_thinking` keeps it
# everywhere, as K2.6 does) and the K2.5 generation prompt (prefilled `<think>`, or `<think></think>` when
# `thinking` is false). No newlines between messages, no BOS. Every literal is an expression so template
# whitespace never leaks into the prompt.
KIMI_K2_CHAT_TEMPLATE = (
    """\
{%- macro role_header(message) -%}
  {%- if message['role'] == 'user' -%}
    {{- '<|im_user|>' -}}
  {%- elif message['role'] == 'assistant' -%}
    {{- '<|im_assistant|>' -}}
  {%- else -%}
    {{- '<|im_system|>' -}}
  {%- endif -%}
  {{- (message.get('name') or message['role']) ~ '<|im_middle|>' -}}
{%- endmacro -%}
{%- macro render_tool_calls(message, ns) -%}
  {{- '<|tool_calls_section_begin|>' -}}
  {%- for tool_call in message['tool_calls'] -%}
    {%- set fn = tool_call['function'] -%}
    {%- set call_id = tool_call.get('id') or ('functions.' ~ fn['name'] ~ ':' ~ ns.tool_idx) -%}
    {%- set ns.tool_idx = ns.tool_idx + 1 -%}
    {{- '<|tool_call_begin|>' ~ call_id ~ '<|tool_call_argument_begin|>' -}}
    {%- if fn['arguments'] is string -%}
      {{- fn['arguments'] -}}
    {%- else -%}
      {{- fn['arguments'] | tojson -}}
    {%- endif -%}
    {{- '<|tool_call_end|>' -}}
  {%- endfor -%}
  {{- '<|tool_calls_section_end|>' -}}
{%- endmacro -%}
{%- set ns = namespace(last_plain_assistant=-1, tool_idx=0) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}
    {%- set ns.last_plain_assistant = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_system|>tool_declare<|im_middle|>' ~ (tools | tojson) ~ '<|im_end|>' -}}
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
  {{- '<|im_system|>system<|im_middle|>"""
    + DEFAULT_SYSTEM_PROMPT
    + """<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
  {{- role_header(message) -}}
  {%- if message['role'] == 'assistant' -%}
    {%- if loop.index0 > ns.last_plain_assistant or preserve_thinking is true -%}
      {{- '<think>' ~ (message.get('reasoning_content') or '') ~ '</think>' -}}
    {%- else -%}
      {{- '<think></think>' -}}
    {%- endif -%}
    {{- message.get('content') or '' -}}
    {%- if message.get('tool_calls') -%}
      {{- render_tool_calls(message, ns) -}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {{- '## Return of ' ~ message['tool_call_id'] ~ '\\n' ~ (message.get('content') or '') -}}
  {%- else -%}
    {{- message.get('content') or '' -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_assistant|>assistant<|im_middle|>' -}}
  {%- if thinking is defined and not thinking -%}
    {{- '<think></think>' -}}
  {%- else -%}
    {{- '<think>' -}}
  {%- endif -%}
{%- endif -%}
"""
)

# Corpus: a fixed list, read in this order (paths relative to the standard library directory). Files a
# stripped-down install lacks are skipped, which changes the result only on such installs.
CORPUS_FILES: tuple[str, ...] = (
    "argparse.py",
    "ast.py",
    "asyncio/events.py",
    "asyncio/tasks.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "concurrent/futures/_base.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "doctest.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "html/parser.py",
    "http/client.py",
    "inspect.py",
    "ipaddress.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "locale.py",
    "logging/__init__.py",
    "mailbox.py",
    "optparse.py",
    "pathlib.py",
    "pdb.py",
    "pickle.py",
    "pprint.py",
    "random.py",
    "shlex.py",
    "shutil.py",
    "smtplib.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "uuid.py",
    "zipfile.py",
)
# Plain English prose: the interactive help topics (Python reference manual excerpts).
PROSE_FILE = "pydoc_data/topics.py"


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    docs = []
    for node in ast.walk(tree):  # breadth-first, in a fixed order for a given source
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
    return docs


def help_topic_texts(path: pathlib.Path) -> list[str]:
    """The values of `topics = {...}` in pydoc_data/topics.py, in key order, without importing it."""
    if not path.is_file():
        return []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            items = [
                (k.value, v.value)
                for k, v in zip(node.value.keys, node.value.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str)
            ]
            return [text for _, text in sorted(items)]
    return []


def corpus(root: pathlib.Path | None = None) -> list[str]:
    """The training texts, in order: each source file, then its docstrings, then the prose."""
    root = stdlib_dir() if root is None else root
    texts: list[str] = []
    for rel in CORPUS_FILES:
        path = root / rel
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        texts.append(source)
        texts.extend(_docstrings(source))
    texts.extend(help_topic_texts(root / PROSE_FILE))
    return texts


def train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE of `vocab_size` tokens over texts, the special tokens at ids 0..16 (as Kimi K2 names them)."""
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


def tokenizer_config() -> dict:
    """The tokenizer_config.json contents (Hugging Face layout)."""
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": [
            t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, MASK_TOKEN)
        ],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "mask_token": MASK_TOKEN,
        "chat_template": KIMI_K2_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_default_tokenizer(directory: str | os.PathLike) -> pathlib.Path:
    """Train the demo tokenizer and write tokenizer.json + tokenizer_config.json into `directory`
    (created if needed). Returns the directory. Files are written atomically (temp file + rename)."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(corpus())
    _write_atomic(out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    return out


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    import sys

    print(write_default_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "."))
