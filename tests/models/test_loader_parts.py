"""The loader reads large plain tensors in row parts and unmaps the files before a read would take the
mapped bytes past MAX_MAPPED_BYTES (issue 16: a rank's peak memory near its own bytes). With both bounds
made tiny, every tensor equals a whole-tensor load, at TP 1 and for each rank of TP 2, and no read ever
starts with more than the bound already mapped."""

from __future__ import annotations

import pytest
import torch

from ddtree.models.checkpoint import loader
from ddtree.models.checkpoint.files import CheckpointFiles
from ddtree.models.parallel.process_group import TPGroup
from ddtree.models.parallel.tp_model import load_tp_model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _tiny_bounds(monkeypatch) -> list[tuple[int, int]]:
    """Parts of 4 KB, at most 16 KB mapped; records (mapped bytes before each read, bytes it read)."""
    reads: list[tuple[int, int]] = []
    real_read = CheckpointFiles.read

    def read(self, name, rows=None, cols=None):
        before = self.mapped_bytes
        out = real_read(self, name, rows, cols)
        reads.append((before, self.mapped_bytes - before))
        return out

    monkeypatch.setattr(loader, "READ_PART_BYTES", 4 << 10)
    monkeypatch.setattr(loader, "MAX_MAPPED_BYTES", 16 << 10)
    monkeypatch.setattr(CheckpointFiles, "read", read)
    return reads


def test_row_parts_equal_whole_reads_at_tp1(default_ckpt, monkeypatch):
    whole = _state(loader.load_target(default_ckpt.target, torch.float32))
    reads = _tiny_bounds(monkeypatch)
    parts = _state(loader.load_target(default_ckpt.target, torch.float32))
    assert parts.keys() == whole.keys()
    for name in whole:
        assert torch.equal(parts[name], whole[name]), name
    embed = whole["model.embed_tokens.weight"]
    assert embed.nbytes > 64 * (4 << 10)  # so the embedding really was read in many parts
    assert len(reads) > len(whole) + 64
    # A read starts with at most the bound mapped (the files were unmapped first when it would exceed).
    assert max(before for before, _ in reads) <= 16 << 10


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parts_equal_whole_reads_per_tp2_rank(default_ckpt, monkeypatch, rank):
    tp = TPGroup(rank, 2, None, None)  # loading needs no process group
    whole = _state(load_tp_model(default_ckpt.target, tp, dtype=torch.float32))
    _tiny_bounds(monkeypatch)
    parts = _state(load_tp_model(default_ckpt.target, tp, dtype=torch.float32))
    for name in whole:
        assert torch.equal(parts[name], whole[name]), name
