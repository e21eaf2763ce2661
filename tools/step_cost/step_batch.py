"""The work of one measured verify step: B decoding sequences with C tokens each in a latent KV pool
filled with random latents (nothing is prefilled through the model), each verifying a tree of R rows
(the root and R - 1 drafted nodes; R = 1 is an AR decode step), as the verifier's scheduler hands them
to services/verifier/step/batch.py `run_batch`.

The tree is best-first shaped like a drafter's: the first half of its nodes a chain (the drafter's
likeliest continuation), the rest hung under earlier nodes, siblings with distinct tokens. Its shape
changes the attention masks and the greedy accept walk, not the forward's arithmetic.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from ddtree.contract.sampling_params import SamplingConfig
from ddtree.contract.token_tree import EMPTY_TREE, TokenTree
from ddtree.verifier.kv.kv_pool import LatentKVPool
from ddtree.verifier.sequence import GenerateParams, Sequence
from ddtree.verifier.sequence_lifecycle import place_decoding
from ddtree.verifier.step.batch import run_batch
from ddtree.verifier.step.work_items import VerifyItem


@dataclasses.dataclass(frozen=True)
class StepShape:
    rows: int  # R: 1 root + R - 1 tree nodes (1 = AR decode)
    context: int  # C: committed tokens per sequence, in the KV cache
    batch: int = 1  # B sequences
    taps: tuple[int, ...] = ()  # layers tapped for the drafter


def drafted_tree(nodes: int, vocab: int, seed: int) -> TokenTree:
    if nodes == 0:
        return EMPTY_TREE
    g = random.Random(seed)
    parents, depths, tokens = [], [], []
    for i in range(1, nodes + 1):
        parent = i - 1 if i <= nodes // 2 + 1 else g.randrange(0, i)
        used = {t for t, p in zip(tokens, parents) if p == parent}
        token = g.choice([t for t in range(min(vocab, 4096)) if t not in used])
        parents.append(parent)
        depths.append(0 if parent == 0 else depths[parent - 1])
        depths[-1] += 1
        tokens.append(token)
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))


@dataclasses.dataclass
class StepWork:
    pool: LatentKVPool
    items: list[VerifyItem]
    taps: tuple[int, ...]

    def run(self, target):
        """One step through the verifier's batch path; the step's slots are freed after (not committed),
        so every repetition sees the same context."""
        try:
            return run_batch(target, self.pool, self.items, self.taps)
        finally:
            for item in self.items:
                item.seq.table.trim(self.pool)


def make_step_work(config, shape: StepShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> StepWork:
    """`config`: the logical model config (layers, vocab, cache width)."""
    if shape.rows < 1 or shape.context < 0 or shape.batch < 1:
        raise ValueError(f"rows {shape.rows} (>= 1), context {shape.context} (>= 0), batch {shape.batch} (>= 1)")
    slots = shape.batch * (shape.context + shape.rows)
    pool = LatentKVPool(config.num_hidden_layers, slots, config.kv_cache_width, dtype, device)
    if device.type != "meta":  # meta (the roofline's shapes-only step): no values
        gen = torch.Generator(device=device).manual_seed(seed)
        pool.cache.normal_(generator=gen)  # latents of the committed tokens (and of the scratch, overwritten)
    host = random.Random(seed)
    items = []
    for b in range(shape.batch):
        context = tuple(host.randrange(config.vocab_size) for _ in range(shape.context))
        params = GenerateParams(
            request_id=f"bench-step-{b}",
            input_ids=context or (0,),
            sampling=SamplingConfig(),
            max_new_tokens=1 << 20,
            stop_token_ids=frozenset(),
            use_spec=shape.rows > 1,
            budget=shape.rows - 1,
        )
        seq = Sequence(params, page_size=pool.page_size)
        place_decoding(seq, pool, list(context), host.randrange(config.vocab_size))
        items.append(VerifyItem(seq, drafted_tree(shape.rows - 1, config.vocab_size, seed + b)))
    return StepWork(pool, items, shape.taps)
