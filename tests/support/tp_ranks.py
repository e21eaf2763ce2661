"""Two CPU ranks over gloo running a fixed step scenario through the real rank-0 handle and worker loop (TP model
tests), eagerly and through each rank's static step."""

from __future__ import annotations

import collections
import functools
import os

import torch

from ddtree.contract.token_tree import TokenTree
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.parallel.process_group import destroy_tp, init_tp
from ddtree.models.parallel.step_message import StepInputs
from ddtree.models.parallel.tp_model import TensorParallelModel, load_tp_model
from ddtree.tools.step_cost.collectives import count_collectives
from ddtree.verifier.step.static_step import StaticPlan, make_buckets, make_static_step
from ddtree.verifier.step.tree_mask import tree_input_ids, tree_mask, tree_positions
from ddtree.verifier.tp_worker import worker_loop

WORLD = 2


NUM_SLOTS = 64


def slots(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.int64)


def scenario(vocab: int) -> list[StepInputs]:
    """Prefill two sequences, decode both, verify a tree on one while the other decodes, then a
    prefill chunk that wants only its last row's logits (and no full logits: argmax only)."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    empty = slots(0, 0)
    taps = (0, 2)
    a, b = ids(9), ids(6)
    prefill = StepInputs(
        torch.cat([a, b]),
        torch.cat([slots(0, 9), slots(0, 6)]),
        AttentionMetadata((SeqAttention(0, 9, empty, slots(0, 9)), SeqAttention(9, 6, empty, slots(20, 26)))),
        None,
        taps,
        True,
    )
    decode_ = StepInputs(
        ids(2),
        torch.tensor([9, 6]),
        AttentionMetadata(
            (SeqAttention(0, 1, slots(0, 9), slots(9, 10)), SeqAttention(1, 1, slots(20, 26), slots(26, 27)))
        ),
        None,
        taps,
        True,
    )
    tree = TokenTree(token_ids=(11, 12, 13, 14, 15), parents=(0, 0, 1, 1, 3), depths=(1, 1, 2, 2, 3))
    tree_ids = tree_input_ids(tree, 7)
    verify = StepInputs(
        torch.cat([tree_ids, ids(1)]),
        torch.cat([tree_positions(tree, 10), torch.tensor([7])]),
        AttentionMetadata(
            (
                SeqAttention(0, 6, slots(0, 10), slots(30, 36), tree_mask(tree)),
                SeqAttention(6, 1, slots(20, 27), slots(27, 28)),
            )
        ),
        None,
        taps,
        True,
    )
    chunk = StepInputs(
        ids(4),
        slots(0, 4),
        AttentionMetadata((SeqAttention(0, 4, empty, slots(40, 44)),)),
        torch.tensor([3]),
        (),
        False,
    )
    return [prefill, decode_, verify, chunk]


# The static step of the static runs: buckets that hold the prefill, decode and verify steps (the chunk
# taps no layer, so it runs eagerly on every rank); no graphs on the CPU.
STATIC_PLAN = StaticPlan(make_buckets((1, 2), (1, 9), (16, 32)), graphs=False)
STATIC_TAPS = (0, 2)


def rank_main(rank: int, ckpt: str, out: str) -> None:
    """Each of (expert parallel, static step) in turn; rank 0 saves {(ep, static): [(logits, argmax, taps)]},
    {("replays", ep): static steps run}, {("control", ep, static): per step (host broadcasts, device
    broadcasts)} and {"first_buffer": its words after every run}."""
    torch.set_num_threads(1)
    tp = init_tp(WORLD, rank, torch.device("cpu"), timeout_s=60, init_method=f"file://{out}.store")
    results = {}
    for ep in (False, True):
        for static in (False, True):
            model = load_tp_model(ckpt, tp, expert_parallel=ep, dtype=torch.float32)
            if rank > 0:
                worker_loop(model, tp, static_plan=STATIC_PLAN if static else None)  # until rank 0 closes
                continue
            runner = TensorParallelModel(model, tp, ping_interval_s=30)
            kv = model.new_kv_cache(NUM_SLOTS)
            runner.replicate_kv(kv)
            if static:
                pad = NUM_SLOTS - 1  # no step of the scenario uses it
                runner.start_static(
                    pad, STATIC_TAPS, functools.partial(make_static_step, STATIC_PLAN, model, kv, pad, STATIC_TAPS)
                )
            outs, control = [], []
            for s in scenario(model.config.vocab_size):
                calls = collections.Counter()
                with count_collectives(calls):
                    outs.append(runner.forward(s.input_ids, s.positions, s.meta, kv, s.logits_rows, s.tap_layer_ids,
                                               gather_logits=s.gather_logits))  # fmt: skip
                control.append((calls["broadcast_cpu"], calls["broadcast_device"]))
            results[("control", ep, static)] = control
            results.setdefault("first_buffer", set()).add(tp.step_buffer[0].numel())
            if static:
                results[("replays", ep)] = (runner.static.replays, runner.static.fallbacks)
            runner.close()
            results[(ep, static)] = [(o.logits, o.argmax, o.taps) for o in outs]
    if rank == 0:
        torch.save(results, out)
    destroy_tp()
    os._exit(0)  # skip the interpreter's teardown of gloo's threads, which sometimes aborts (std::terminate)
