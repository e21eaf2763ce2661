"""Evaluate a target checkpoint on the held-out splits of a demo corpus.

    python -m scripts.eval.eval_target CKPT --corpus DIR [--out eval.json] [--ctx 1024] [--long 4096]

Prints and saves (JSON) the perplexity of each held-out kind over non-overlapping windows of --ctx tokens,
the perplexity over --long-token windows split by position bucket (does quality hold past the training
length, where YaRN takes over?), and greedy answers to a code prompt, a prose prompt, a chat prompt and a
tool prompt, decoded with the serving forward (absorbed MLA over the latent cache).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

from ddtree.gateway.parsers.kimi_k2_reasoning import parse_reasoning
from ddtree.gateway.parsers.kimi_k2_tools import parse_tool_calls
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.deepseek_v3.training_forward import training_forward
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.training.corpus import KINDS, read_documents
from scripts.data.synthetic_chats import _tool_spec

EMPTY = torch.empty(0, dtype=torch.int64)
CODE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'  # no trailing "\n": the BPE merges it with the indent
PROSE_PROMPT = "The standard library provides"
CHAT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain it briefly."
TOOL_PROMPT = "What's the weather like in Paris?"


def heldout_ids(tok: Tokenizer, corpus: pathlib.Path, kind: str) -> torch.Tensor:
    eos = tok.token_id("[EOS]")
    ids: list[int] = []
    for doc in read_documents(corpus, "heldout", kind):
        ids += tok.encode(doc, allow_special=True) + [eos]
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, ctx: int, max_windows: int, batch: int = 4) -> torch.Tensor:
    """Per-position mean NLL [ctx] over up to max_windows non-overlapping windows of ctx + 1 tokens."""
    n = min(max_windows, (len(ids) - 1) // ctx)
    if n == 0:
        return torch.empty(0)
    windows = torch.stack([ids[i * ctx : i * ctx + ctx + 1] for i in range(n)])  # [n, ctx + 1]
    total = torch.zeros(ctx)
    for b in range(0, n, batch):
        w = windows[b : b + batch]
        logits = training_forward(model, w[:, :-1]).logits  # [B, ctx, V] fp32
        nll = F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none")  # [B, ctx]
        total += nll.sum(0)
    return total / n


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding with the serving forward and a latent KV cache."""
    T = len(prompt_ids)
    cache = model.new_kv_cache(T + max_new)
    ids = torch.tensor(prompt_ids)
    meta = AttentionMetadata((SeqAttention(0, T, EMPTY, torch.arange(T)),))
    logits = model(ids, torch.arange(T), meta, cache, logits_rows=torch.tensor([T - 1])).logits
    out: list[int] = []
    for pos in range(T, T + max_new):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        meta = AttentionMetadata((SeqAttention(0, 1, torch.arange(pos), torch.tensor([pos])),))
        logits = model(torch.tensor([nxt]), torch.tensor([pos]), meta, cache).logits
    return out


def evaluate(
    ckpt: str | pathlib.Path,
    corpus: str | pathlib.Path,
    ctx: int = 1024,
    long_ctx: int = 4096,
    max_windows: int = 24,
    max_long_windows: int = 4,
    max_new: int = 128,
) -> dict:
    ckpt, corpus = pathlib.Path(ckpt), pathlib.Path(corpus)
    model = load_target(ckpt, dtype=torch.float32)
    tok = Tokenizer(ckpt)
    report: dict = {
        "checkpoint": str(ckpt),
        "ctx": ctx,
        "long_ctx": long_ctx,
        "perplexity": {},
        "long": {},
        "samples": {},
    }
    info = ckpt / "training_info.json"
    if info.exists():
        report["training_info"] = json.loads(info.read_text())
    buckets = 4
    for kind in KINDS:
        ids = heldout_ids(tok, corpus, kind)
        nll = window_nll(model, ids, ctx, max_windows)
        report["perplexity"][kind] = {
            "ppl": round(math.exp(nll.mean()), 3),
            "tokens": int(nll.numel() and min(max_windows, (len(ids) - 1) // ctx) * ctx),
        }
        long_nll = window_nll(model, ids, long_ctx, max_long_windows, batch=1)
        if long_nll.numel():
            size = long_ctx // buckets
            by_position = {
                f"{i * size}-{(i + 1) * size}": round(math.exp(long_nll[i * size : (i + 1) * size].mean()), 3)
                for i in range(buckets)
            }
            report["long"][kind] = {
                "ppl": round(math.exp(long_nll.mean()), 3),
                "ppl_by_position": by_position,
                "windows": min(max_long_windows, (len(ids) - 1) // long_ctx),
            }
    stop = {tok.token_id("[EOS]"), tok.token_id("<|im_end|>")}
    tools = [_tool_spec("get_weather")]
    prompts = {
        "code": CODE_PROMPT,
        "prose": PROSE_PROMPT,
        "chat": tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True),
        "tool": tok.apply_chat_template(
            [{"role": "user", "content": TOOL_PROMPT}], tools=tools, add_generation_prompt=True
        ),
    }
    for name, prompt in prompts.items():
        start = time.time()
        out = greedy(model, tok.encode(prompt, allow_special=True), max_new, stop)
        text = tok.decode(out)
        sample = {"prompt": prompt, "completion": text, "tokens": len(out), "seconds": round(time.time() - start, 2)}
        if name in ("chat", "tool"):  # what the gateway's Kimi parsers make of it (the prompt ends in <think>)
            reasoning, content = parse_reasoning(text.removesuffix("<|im_end|>"), in_reasoning=True)
            content, calls = parse_tool_calls(content)
            sample.update(
                reasoning=reasoning,
                content=content,
                tool_calls=[{"name": c.name, "arguments": c.arguments} for c in calls],
            )
        report["samples"][name] = sample
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="perplexity per held-out kind, at 4k context, and greedy samples")
    ap.add_argument("ckpt")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", default="", help="JSON report path (default: CKPT/eval.json)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=24, help="max windows per kind at --ctx")
    ap.add_argument("--long-windows", type=int, default=4, help="max windows per kind at --long")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    report = evaluate(a.ckpt, a.corpus, a.ctx, a.long, a.windows, a.long_windows, a.max_new)
    out = pathlib.Path(a.out) if a.out else pathlib.Path(a.ckpt) / "eval.json"
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    for kind, r in report["perplexity"].items():
        lng = report["long"].get(kind, {})
        print(
            f"{kind:6s} ppl@{a.ctx} {r['ppl']:9.3f}  ppl@{a.long} {lng.get('ppl', float('nan')):9.3f}  "
            f"by position {lng.get('ppl_by_position', {})}"
        )
    for name, s in report["samples"].items():
        print(f"\n--- {name} ({s['tokens']} tokens, {s['seconds']} s)\n{s['prompt']}\u2502{s['completion']}")
        if "reasoning" in s:
            print(
                f"    parsed: reasoning {s['reasoning']!r}\n            content {s['content']!r}\n"
                f"            tool calls {s['tool_calls']}"
            )
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
