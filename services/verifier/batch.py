"""Builds one target forward from a step's work: tree verifies (AR = empty tree) and prefill chunks.

Every item becomes one SeqAttention: its new tokens get KV slots from the sequence's page table (page
size 1: fresh slots; page size P: the positions after the committed tokens, see page_table.py), its
queries see the whole committed prefix, and among the new tokens a verify item sees only ancestors
(tree mask) while a prefill chunk is causal. Positions: verify = start + depth (siblings share one),
prefill = absolute. What each item needs from the LM head (`ItemHead`) goes to the target with the
inputs; how it is computed, on one device or tensor parallel, is the target's business (target.py).
The forward taps the drafter's layers plus those of any Features request in the batch (feature_taps.py);
each item's output holds the drafter's columns (`taps`) and the request's own (`feature_taps`).
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.models.attention import AttentionMetadata, SeqAttention
from ddtree.verifier.feature_taps import split_taps, step_tap_layers
from ddtree.verifier.kv_pool import LatentKVPool
from ddtree.verifier.sequence import Sequence
from ddtree.verifier.target import ForwardInputs, ItemHead, Target
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

    @property
    def scores_prompt(self) -> bool:
        """A prompt_logprobs request: the LM head runs on every row (row p scores prompt token p + 1)."""
        return self.seq.params.prompt_logprobs is not None


WorkItem = VerifyItem | PrefillItem


@dataclasses.dataclass(frozen=True)
class ItemOutput:
    item: WorkItem
    new_slots: torch.Tensor  # int64 [q_len], slots the new tokens were written to
    logits: torch.Tensor | None  # fp32 [q_len, V] for verify and prompt_logprobs; [1, V] for a last prefill chunk
    taps: torch.Tensor | None  # [q_len, F] tapped features of the new tokens (None without taps)
    argmax: torch.Tensor | None = None  # int64 per row: the walk's rows (greedy tree) or every row (tensor parallel)
    feature_taps: torch.Tensor | None = None  # [q_len, len(feature_taps) * H]: a Features request's layers


def q_len_of(item: WorkItem) -> int:
    return item.tree.n + 1 if isinstance(item, VerifyItem) else item.end - item.start


def kv_needed(items: list[WorkItem]) -> int:
    """KV slots (whole pages) run_batch will allocate for `items`."""
    return sum(it.seq.table.pages_needed(q_len_of(it)) * it.seq.table.page_size for it in items)


def run_batch(
    target: Target, pool: LatentKVPool, items: list[WorkItem], tap_layer_ids: tuple[int, ...]
) -> list[ItemOutput]:
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
                if item.scores_prompt:
                    logit_rows.append(torch.arange(row, row + q_len))
                elif item.is_last:
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
    layers = step_tap_layers(tap_layer_ids, [item.seq.params.feature_taps for item in items])
    inputs = ForwardInputs(
        torch.cat(ids).to(device),
        torch.cat(pos).to(device),
        AttentionMetadata(seqs=tuple(seqs)),
        pool.cache,
        rows.to(device),
        layers,
    )
    heads = [_head(item, sa) for item, sa in zip(items, seqs)]
    try:
        with torch.inference_mode():
            taps, per_item = target.run(inputs, heads)
    except Exception:
        for seq in allocated:
            seq.table.trim(pool)
        raise
    results = []
    for item, sa, (item_logits, item_argmax) in zip(items, seqs, per_item):
        item_taps = taps[sa.q_start : sa.q_start + sa.q_len] if taps is not None else None
        own, wanted = split_taps(item_taps, layers, tap_layer_ids, item.seq.params.feature_taps)
        results.append(ItemOutput(item, sa.new_slots, item_logits, own, item_argmax, wanted))
    return results


def _head(item: WorkItem, sa: SeqAttention) -> ItemHead:
    """What item needs from the LM head: a verify reads all its rows, a prompt's last chunk its last row.
    Full logits when it samples, when min_tokens masks stop ids this step (the greedy walk shortcut
    reads argmaxes of unmasked rows), or when it reports logprobs (they read the accepted rows)."""
    greedy = not item.seq.wants_logits
    if isinstance(item, VerifyItem):
        return ItemHead(rows=sa.q_len, walk=item.tree if greedy else None, sampled=not greedy)
    if item.scores_prompt:  # full logits of every row, at TP N too (logprobs.prompt_logprobs)
        return ItemHead(rows=sa.q_len, walk=None, sampled=True)
    return ItemHead(rows=1 if item.is_last else 0, walk=None, sampled=not greedy)
