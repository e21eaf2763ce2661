"""Builds one target forward from a step's work items (work_items.py: tree verifies, prefill chunks).

Every item becomes one SeqAttention: its new tokens get KV slots from the sequence's page table (page
size 1: fresh slots; page size P: the positions after the committed tokens, see page_table.py), its
queries see the whole committed prefix, and among the new tokens its own mask (tree or causal). What
each item needs from the LM head (`ItemHead`) goes to the target with the inputs; how it is computed,
on one device or tensor parallel, is the target's business (target.py). The target prepares the
attention's device buffers (the Triton plan, the write slots, the masks) from the host slot tables
before its forward (`prepare`), so that the forward reads nothing back to the host.
The forward taps the drafter's layers plus those of any Features request in the batch (feature_taps.py);
each item's output holds the drafter's columns (`taps`) and the request's own (`feature_taps`).
"""

from __future__ import annotations

import torch

from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.verifier.drafting.feature_taps import split_taps, step_tap_layers
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.sequence_lifecycle import drop_scratch, reserve_rows
from ddtree.verifier.step.commit import ItemOutput
from ddtree.verifier.step.target import ForwardInputs, Target
from ddtree.verifier.step.work_items import WorkItem


def kv_needed(items: list[WorkItem]) -> int:
    """KV slots (whole pages) run_batch will allocate for `items`."""
    return sum(it.seq.table.pages_needed(it.rows) * it.seq.table.page_size for it in items)


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
            item_ids, item_pos, mask = item.forward_rows()
            ids.append(item_ids)
            pos.append(item_pos)
            q_len, read = item.rows, item.logit_rows()
            logit_rows.append(torch.arange(row + q_len - read, row + q_len))
            slots = reserve_rows(seq, pool, q_len)
            allocated.append(seq)
            seqs.append(SeqAttention(q_start=row, q_len=q_len, prefix_slots=seq.slots, new_slots=slots, new_mask=mask))
            row += q_len
    except Exception:
        for seq in allocated:
            drop_scratch(seq, pool)
        raise
    device = pool.cache.device
    rows = torch.cat(logit_rows) if logit_rows else torch.empty(0, dtype=torch.int64)
    layers = step_tap_layers(tap_layer_ids, [item.seq.params.feature_taps for item in items])
    ids_host, pos_host = torch.cat(ids), torch.cat(pos)
    T = ids_host.shape[0]
    packed = torch.cat([ids_host, pos_host, rows]).to(device)  # one host -> device copy
    inputs = ForwardInputs(
        packed[:T],
        packed[T : 2 * T],
        AttentionMetadata(seqs=tuple(seqs)),
        pool.cache,
        packed[2 * T :],
        layers,
        host=(ids_host, pos_host, rows),
    )
    heads = [item.head() for item in items]
    try:
        with torch.inference_mode():
            prepare = getattr(target, "prepare", None)  # the attention's device buffers, built before the forward
            if prepare is not None:
                prepare(inputs)
            taps, per_item = target.run(inputs, heads)
    except Exception:
        for seq in allocated:
            drop_scratch(seq, pool)
        raise
    results = []
    for item, sa, (item_logits, item_argmax) in zip(items, seqs, per_item):
        item_taps = taps[sa.q_start : sa.q_start + sa.q_len] if taps is not None else None
        own, wanted = split_taps(item_taps, layers, tap_layer_ids, item.seq.params.feature_taps)
        results.append(ItemOutput(sa.new_slots, item_logits, own, item_argmax, wanted))
    return results
