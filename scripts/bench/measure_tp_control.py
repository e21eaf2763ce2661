"""The TP-N verifier's per-step control path, counted for one rank of Kimi K2.6 at TP 8 (docs/performance.md).

    python -m scripts.bench.measure_tp_control [--context 8192] [--tp 8] [--sms 132]

For an AR step (1 row) and a 17-row tree of one sequence at `--context` committed tokens (one run of
slots, as the pool hands out a context), and for a 512-row prefill chunk (`--prefill-chunk`'s default):
- now (counted): the step message packed by `step_message.encode` and sent by `send_step` through a
  counting group: host broadcasts and their bytes; device broadcasts are 0 (tests/models/test_tp_model.py
  counts them through the real ranks);
- before (the protocol replaced in issue 49, from the bucket sizes the code gives): one gloo broadcast of
  the whole message buffer (1024 words at first, doubled past the longest message since start, so after
  any 512-row prefill chunk at least 2048 words), then one NCCL broadcast per tensor of the bucket's static
  batch (Triton MLA backend: the packed step buffer alone), its size from `MLAStaticLayout` for the bucket
  the default buckets pick (keys doubling from 512) and `--sms` programs (H200: 132).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.kernels.mla.plan import MLAKernelConfig
from ddtree.kernels.mla.static_plan import MLAStaticLayout
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.parallel import step_message as sm
from ddtree.models.runtime.static_batch import Bucket
from ddtree.models.runtime.static_shapes import doubling_sizes
from ddtree.verifier.step.tree_mask import tree_mask

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kimi_k26_config.json"
OLD_INITIAL_WORDS = 1024  # the replaced buffer's first capacity


class CountingGroup:
    """send_step's side of a TPGroup: counts broadcasts and their bytes, sends nothing."""

    def __init__(self):
        self.step_buffer, self.broadcasts, self.bytes = [None], 0, 0

    def broadcast_cpu(self, x: torch.Tensor) -> torch.Tensor:
        self.broadcasts += 1
        self.bytes += x.numel() * x.element_size()
        return x


def step(rows: int, context: int, taps: tuple[int, ...]) -> sm.StepInputs:
    """One sequence: `rows` new rows (a chain-shaped tree's mask when rows > 1) after `context` slots."""
    mask = None
    if rows > 1:
        parents = tuple(range(rows - 1))  # nodes 1..rows-1 under the root chain: a full [rows, rows] mask
        mask = tree_mask(TokenTree(token_ids=(5,) * (rows - 1), parents=parents, depths=tuple(range(1, rows))))
    seq = SeqAttention(0, rows, torch.arange(context), torch.arange(context, context + rows), mask)
    return sm.StepInputs(torch.zeros(rows, dtype=torch.int64), torch.arange(context, context + rows),
                         AttentionMetadata((seq,)), None, taps, False)  # fmt: skip


def prefill(rows: int, taps: tuple[int, ...]) -> sm.StepInputs:
    seq = SeqAttention(0, rows, torch.arange(0), torch.arange(rows))
    return sm.StepInputs(torch.zeros(rows, dtype=torch.int64), torch.arange(rows), AttentionMetadata((seq,)),
                         torch.tensor([rows - 1]), taps, False)  # fmt: skip


def stream_words(s: sm.StepInputs) -> int:
    ints, masks = sm.encode(s)
    return sm.HEADER + ints.numel() + -(-masks.numel() // 8)


def now(s: sm.StepInputs) -> dict:
    g = CountingGroup()
    sm.send_step(g, sm.FORWARD, s)
    return {"host_broadcasts": g.broadcasts, "host_bytes": g.bytes, "device_broadcasts": 0, "device_bytes": 0,
            "message_words": stream_words(s)}  # fmt: skip


def before(s: sm.StepInputs, rows: int, context: int, heads: int, sms: int, after_prefill_words: int) -> dict:
    capacity = max(OLD_INITIAL_WORDS, 1 << (max(stream_words(s), after_prefill_words) - 1).bit_length())
    keys = next(k for k in doubling_sizes(512, 1 << 20) if k >= context + rows)
    bucket = Bucket(1, rows, keys)
    layout = MLAStaticLayout(
        bucket, heads, context + rows + 1, torch.device("cpu"), MLAKernelConfig(target_programs=sms)
    )
    words = 2 * bucket.tokens + (layout.int_words + 1) // 2  # StaticBatch's packed buffer, int64 words
    return {"host_broadcasts": 1, "host_bytes": 8 * capacity, "device_broadcasts": 1, "device_bytes": 8 * words,
            "bucket": [bucket.batch, bucket.rows, bucket.keys]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--sms", type=int, default=132, help="the device's SMs (H200: 132)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    args = ap.parse_args()
    text = json.loads(CONFIG.read_text())["text_config"]
    heads = text["num_attention_heads"] // args.tp
    taps = (1, 12, 23, 34, 45)  # a DFlash drafter's tapped layers: a few words, whichever they are
    chunk_words = stream_words(prefill(args.prefill_chunk, taps))
    out = {"context": args.context, "tp": args.tp, "heads_per_rank": heads, "prefill_chunk_words": chunk_words,
           "prefill_chunk_now": now(prefill(args.prefill_chunk, taps))}  # fmt: skip
    for name, rows in (("ar", 1), ("tree17", 17)):
        s = step(rows, args.context, taps)
        out[name] = {"now": now(s), "before": before(s, rows, args.context, heads, args.sms, chunk_words)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
