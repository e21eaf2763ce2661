"""The tensor-parallel step message (services/models/parallel/step_message.py): one broadcast of the
group's fixed first buffer per step, the same buffer (FIRST_WORDS, never grown) on every rank over many
steps of varying sizes; a longer stream continues in CHUNK_WORDS broadcasts counted from its length; what
the other ranks decode equals what rank 0 sent. The wire is in-process here (the gloo ranks run in
tests/models/test_tp_model.py and the TP e2e tests)."""

from __future__ import annotations

import collections

import pytest
import torch

from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
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


def _random_step(g: torch.Generator) -> StepInputs:
    """1-6 sequences: AR rows, trees of up to 17 rows with masks, or prefill chunks of up to 600 rows."""
    seqs, at, slot = [], 0, 0
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        q = [1, int(torch.randint(2, 18, (1,), generator=g)), int(torch.randint(100, 600, (1,), generator=g))][kind]
        prefix = torch.arange(slot, slot + int(torch.randint(0, 3000, (1,), generator=g)))
        mask = (torch.rand(q, q, generator=g) < 0.5).tril() | torch.eye(q, dtype=torch.bool) if kind == 1 else None
        seqs.append(SeqAttention(at, q, prefix, torch.arange(9000 + at, 9000 + at + q), mask))
        at, slot = at + q, slot + 3000
    return StepInputs(torch.arange(at) % 97, torch.arange(at), AttentionMetadata(tuple(seqs)), None, (1, 2), True)


def _broadcasts(stream_words: int) -> int:
    """What the protocol claims: one first buffer, then ceil(rest / CHUNK_WORDS)."""
    return 1 + max(0, -(-(stream_words - sm.FIRST_WORDS) // sm.CHUNK_WORDS))


def test_fixed_buffer_and_broadcasts_per_step_over_varying_steps(monkeypatch):
    monkeypatch.setattr(sm, "CHUNK_WORDS", 700)  # a big step spans several continuation chunks, cheaply
    g = torch.Generator().manual_seed(5)
    wire: list = []
    r0, r1 = Rank(0, wire), Rank(1, wire)
    steps = [*scenario(512), _big_step(24, 17), *[_random_step(g) for _ in range(24)], *scenario(512)]
    buffers, counts = set(), collections.Counter()
    for s in steps:
        ints, masks = sm.encode(s)
        words = sm.HEADER + ints.numel() + -(-masks.numel() // 8)
        before = (r0.broadcasts, r1.broadcasts)
        assert send_step(r0, FORWARD, s) == _broadcasts(words)
        kind, got = recv_step(r1)
        assert kind == FORWARD and not wire
        _same(got, s)
        assert (r0.broadcasts - before[0], r1.broadcasts - before[1]) == (_broadcasts(words),) * 2
        counts[_broadcasts(words)] += 1
        for r in (r0, r1):
            assert r.step_buffer[0].numel() == sm.FIRST_WORDS
            buffers.add(r.step_buffer[0].data_ptr())
    assert len(buffers) == 2, "each rank reuses one first buffer, never a new or larger one"
    assert counts[1] >= 5 and counts[1] < len(steps) and max(counts) >= 3, counts  # small, long and chunked steps
    send_step(r0, CACHE, num_slots=12345)
    assert recv_step(r1) == (CACHE, 12345)
    send_step(r0, PING)
    assert recv_step(r1) == (PING, None)
    assert r0.broadcasts == r1.broadcasts


def test_an_unknown_kind_is_refused():
    wire: list = []
    r0, r1 = Rank(0, wire), Rank(1, wire)
    buf = sm.first_buffer(r0)
    buf[: sm.HEADER] = torch.tensor([99, 0, 0])
    r0.broadcast_cpu(buf)
    with pytest.raises(RuntimeError, match="unknown kind 99"):
        recv_step(r1)
