"""The tensor-parallel step message (services/models/parallel/step_message.py): one broadcast of the
group's message buffer per step, every rank's buffer of the same capacity; a message too long for it is
preceded by GROW and both sides grow in lockstep; what the other ranks decode equals what rank 0 sent.
The wire is in-process here (the gloo ranks run in tests/models/test_tp_model.py and the TP e2e tests)."""

from __future__ import annotations

import torch

from ddtree.models.attention import AttentionMetadata, SeqAttention
from ddtree.models.parallel import step_message as sm
from ddtree.models.parallel.step_message import CACHE, FORWARD, PING, StepInputs, recv_step, send_step
from tests.support.tp_ranks import scenario


class Rank:
    """A TPGroup's message side: its buffer and broadcast_cpu over a shared in-process wire."""

    def __init__(self, rank: int, wire: list):
        self.rank, self.wire, self.step_buffer, self.broadcasts = rank, wire, [None], 0

    def broadcast_cpu(self, x: torch.Tensor) -> torch.Tensor:
        self.broadcasts += 1
        if self.rank == 0:
            self.wire.append(x.clone())
        else:
            sent = self.wire.pop(0)
            assert sent.shape == x.shape, "the ranks' buffers must have the same capacity"
            x.copy_(sent)
        return x


def _same(a: StepInputs, b: StepInputs) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
    assert (a.logits_rows is None) == (b.logits_rows is None)
    assert a.logits_rows is None or torch.equal(a.logits_rows, b.logits_rows)
    assert a.tap_layer_ids == b.tap_layer_ids and a.gather_logits == b.gather_logits
    for x, y in zip(a.meta.seqs, b.meta.seqs, strict=True):
        assert (x.q_start, x.q_len) == (y.q_start, y.q_len)
        assert torch.equal(x.prefix_slots, y.prefix_slots) and torch.equal(x.new_slots, y.new_slots)
        assert torch.equal(x.visible_new(), y.visible_new())


def _big_step(n_seqs: int, q: int) -> StepInputs:
    """n_seqs trees of q rows each, scattered prefixes: longer than the first buffer."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(n_seqs):
        prefix = torch.randperm(4096, generator=g)[:40]  # no runs: 2 ints per slot
        mask = torch.rand(q, q, generator=g) < 0.5
        mask = mask.tril() | torch.eye(q, dtype=torch.bool)
        seqs.append(SeqAttention(i * q, q, prefix, torch.arange(5000 + i * q, 5000 + (i + 1) * q), mask))
    T = n_seqs * q
    return StepInputs(torch.arange(T), torch.arange(T) + 40, AttentionMetadata(tuple(seqs)), None, (1,), False)


def test_one_broadcast_per_step_and_lockstep_growth():
    wire: list = []
    r0, r1 = Rank(0, wire), Rank(1, wire)
    steps = [*scenario(512), _big_step(24, 17), *scenario(512)]
    for s in steps:
        before = r0.broadcasts
        send_step(r0, FORWARD, s)
        kind, got = recv_step(r1)
        assert kind == FORWARD
        _same(got, s)
        grew = r0.broadcasts - before == 2
        assert r0.broadcasts - before == 1 or grew
        assert r0.step_buffer[0].numel() == r1.step_buffer[0].numel()
        assert not wire
    assert r0.step_buffer[0].numel() > sm.INITIAL_WORDS  # the big step grew both buffers, once
    assert r0.broadcasts == len(steps) + 1 and r1.broadcasts == r0.broadcasts
    send_step(r0, CACHE, num_slots=12345)
    assert recv_step(r1) == (CACHE, 12345)
    send_step(r0, PING)
    assert recv_step(r1) == (PING, None)
