"""Builds one target forward from a step's work: tree verifies (AR = empty tree) and prefill chunks.

Every item becomes one SeqAttention: its new tokens get KV slots from the sequence's page table (page
size 1: fresh slots; page size P: the positions after the committed tokens, see page_table.py), its
queries see the whole committed prefix, and among the new tokens a verify item sees only ancestors
(tree mask) while a prefill chunk is causal. Positions: verify = start + depth (siblings share one),
prefill = absolute. On one device the forward returns final-normed rows and the LM head runs here: along
the accept walk for greedy trees, over every row for sampled trees and a prompt's last row; a
tensor-parallel model returns per-shard argmax (and logits only when some row is sampled).
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.models.attention import AttentionMetadata, SeqAttention
from ddtree.models.parallel.tp_model import TensorParallelModel
from ddtree.verifier.greedy_head import greedy_walk_choices
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.sequence import Sequence
from ddtree.verifier.tree_mask import tree_input_ids, tree_mask, tree_positions


@dataclasses.dataclass(frozen=True)
class VerifyItem:
    seq: Sequence
    tree: TokenTree  # empty tree = one AR step


@dataclasses.dataclass(frozen=True)
class PrefillItem:
    seq: Sequence
    start: int  # prompt[start:end] is this chunk
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.prompt_len


WorkItem = VerifyItem | PrefillItem


@dataclasses.dataclass(frozen=True)
class ItemOutput:
    item: WorkItem
    new_slots: torch.Tensor  # int64 [q_len], slots the new tokens were written to
    logits: torch.Tensor | None  # fp32 [q_len, V] for verify; [1, V] for a last prefill chunk; else None
    taps: torch.Tensor | None  # [q_len, F] tapped features of the new tokens (None without taps)
    argmax: torch.Tensor | None = None  # int64, one per logits row, when the forward gives it (tensor parallel)


def q_len_of(item: WorkItem) -> int:
    return item.tree.n + 1 if isinstance(item, VerifyItem) else item.end - item.start


def kv_needed(items: list[WorkItem]) -> int:
    """KV slots (whole pages) run_batch will allocate for `items`."""
    return sum(it.seq.table.pages_needed(q_len_of(it)) * it.seq.table.page_size for it in items)


def run_batch(model, pool: LatentKVPool, items: list[WorkItem], tap_layer_ids: tuple[int, ...]) -> list[ItemOutput]:
    """One forward for all items. Slots are allocated here (in the sequences' page tables); the caller
    commits them, or trims the tables."""
    ids, pos, seqs, logit_rows, allocated = [], [], [], [], []
    row = 0
    try:
        for item in items:
            seq = item.seq
            if isinstance(item, VerifyItem):
                ids.append(tree_input_ids(item.tree, seq.root))
                pos.append(tree_positions(item.tree, seq.context_len))
                mask = tree_mask(item.tree)
                q_len = item.tree.n + 1
                logit_rows.append(torch.arange(row, row + q_len))
            else:
                ids.append(torch.tensor(seq.params.input_ids[item.start : item.end], dtype=torch.int64))
                pos.append(torch.arange(item.start, item.end, dtype=torch.int64))
                mask = None
                q_len = item.end - item.start
                if item.is_last:
                    logit_rows.append(torch.tensor([row + q_len - 1]))
            slots = seq.table.extend(pool, q_len)
            allocated.append(seq)
            seqs.append(SeqAttention(q_start=row, q_len=q_len, prefix_slots=seq.slots, new_slots=slots, new_mask=mask))
            row += q_len
    except Exception:
        for seq in allocated:
            seq.table.trim(pool)
        raise
    device = pool.cache.device
    rows = torch.cat(logit_rows) if logit_rows else torch.empty(0, dtype=torch.int64)
    meta = AttentionMetadata(seqs=tuple(seqs))
    lazy = not isinstance(model, TensorParallelModel)  # greedy rows: the LM head along the walk only
    try:
        with torch.inference_mode():
            out = model.forward(
                torch.cat(ids).to(device),
                torch.cat(pos).to(device),
                meta,
                pool.cache,
                logits_rows=rows.to(device),
                tap_layer_ids=tap_layer_ids,
                **({"hidden_only": True} if lazy else _tp_kwargs(model, items)),
            )
            per_item = _split_rows(items, seqs, out)
            if lazy:
                per_item = _heads(model, items, per_item)
    except Exception:
        for seq in allocated:
            seq.table.trim(pool)
        raise
    taps = out.taps
    results = []
    for item, sa, (item_logits, item_argmax) in zip(items, seqs, per_item):
        item_taps = taps[sa.q_start : sa.q_start + sa.q_len] if taps is not None else None
        results.append(ItemOutput(item, sa.new_slots, item_logits, item_taps, item_argmax))
    return results


def _split_rows(items: list[WorkItem], seqs: list[SeqAttention], out) -> list[tuple]:
    """Per item (logits or final-normed hidden rows, argmax) of its requested rows; (None, None) for none."""
    blocks, lrow = [], 0
    rows = out.hidden if out.hidden is not None else out.logits
    for item, sa in zip(items, seqs):
        n = sa.q_len if isinstance(item, VerifyItem) else (1 if item.is_last else 0)
        block = rows[lrow : lrow + n] if n and rows is not None else None
        argmax = out.argmax[lrow : lrow + n] if n and out.argmax is not None else None
        blocks.append((block, argmax))
        lrow += n
    return blocks


def _heads(model, items: list[WorkItem], hidden: list[tuple]) -> list[tuple]:
    """From final-normed rows to what commit needs, per item (logits, argmax): the argmax along the accept
    walk for greedy trees (greedy_head.py), full fp32 logits for sampled trees and a prompt's last row."""
    out: list[tuple] = []
    for item, (rows, _) in zip(items, hidden):
        if _walks(item):
            out.append((None, None))  # filled below, all greedy trees together
        else:
            out.append((None if rows is None else model.compute_logits(rows), None))
    greedy = [i for i, item in enumerate(items) if _walks(item)]
    if greedy:
        walks = greedy_walk_choices(
            [items[i].tree for i in greedy], [hidden[i][0] for i in greedy], model.compute_logits
        )
        for i, choices in zip(greedy, walks):
            out[i] = (None, choices)
    return out


def _walks(item: WorkItem) -> bool:
    return isinstance(item, VerifyItem) and item.seq.params.sampling.greedy


def _tp_kwargs(model, items: list[WorkItem]) -> dict:
    """A tensor-parallel model keeps the logits sharded and returns the argmax per row; it gathers the
    full logits only when some row is sampled at temperature > 0."""
    if not isinstance(model, TensorParallelModel):
        return {}
    return {"gather_logits": any(not it.seq.params.sampling.greedy for it in items)}
