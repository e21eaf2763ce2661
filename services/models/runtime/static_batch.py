"""A step's inputs at a static shape: the tensors a captured forward reads, filled from one host buffer.

A bucket is (batch B, rows per sequence Q, keys per sequence K). Sequence i of a step owns rows
[i·Q, i·Q + Q) of the T = B·Q rows; its first q_i rows are real, the rest padding, and the sequences
past the step's count are padding entirely. Every row attends to at least one key, so every value the
forward computes is finite: a padding row writes its latent to the pool's pad slot (which no real row
sees) and sees only that slot. The forward is the model's own (`DeepseekV3ForCausalLM.forward`); what
differs is the metadata it is given: a `StaticMetadata` whose attention state the backend laid out for
the bucket (`backend.static_layout`), in device buffers whose addresses never change, so that a CUDA
graph captured over them replays any step that fits.

Per step `fill` writes ids, positions and the backend's tables (write slots, key slots / MLA plan,
masks) into one pinned host buffer and copies it to the device in one transfer (the torch backend adds
its bf16 key bias, a second copy). The buffer is int64 (ids and positions, as the embedding and the
latent write take them); the tables are its tail read as int32.
"""

from __future__ import annotations

import dataclasses

import torch

from ddtree.models.layers.attention import AttentionMetadata


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    batch: int  # B sequences
    rows: int  # Q rows per sequence
    keys: int  # K keys per sequence (prefix + rows)

    @property
    def tokens(self) -> int:
        return self.batch * self.rows


def make_buckets(batch_sizes, row_sizes, key_sizes) -> tuple[Bucket, ...]:
    return tuple(sorted(Bucket(b, q, k) for b in batch_sizes for q in row_sizes for k in key_sizes if k >= q))


@dataclasses.dataclass(frozen=True, eq=False)
class StaticMetadata:
    """The attention metadata of a static batch: what the forward reads (`num_tokens`, `write_slots`, and
    the backend's state in `prepared`), no per-sequence Python objects."""

    num_tokens: int  # T = B·Q
    prepared: dict  # the backend's name -> its state; "write_slots" -> int [T] device view
    seqs: tuple = ()

    @property
    def write_slots(self) -> torch.Tensor:
        return self.prepared["write_slots"]


class StaticBatch:
    """One bucket's device inputs and their host staging (see the module docstring)."""

    def __init__(self, bucket: Bucket, pad_slot: int, backend, num_heads: int, cache_slots: int, device):
        self.bucket, self.pad_slot = bucket, pad_slot
        device = torch.device(device)
        T = bucket.tokens
        self.layout = backend.static_layout(bucket, num_heads, cache_slots, device)
        words = 2 * T + (self.layout.int_words + 1) // 2  # int64 words
        pin = device.type == "cuda"
        self._host = torch.zeros(words, dtype=torch.int64, pin_memory=pin)
        self._device = torch.zeros(words, dtype=torch.int64, device=device)
        self.input_ids = self._device[:T]  # int64 [T]
        self.positions = self._device[T : 2 * T]  # int64 [T]
        self.meta = StaticMetadata(T, self.layout.bind(_tables(self._device, T, self.layout.int_words)))
        self.all_rows = torch.arange(T, device=device)
        self._copied = None  # CUDA: the event after the last upload (the host buffer is in flight until then)
        self.fill_empty()

    def step_tensors(self) -> list[torch.Tensor]:
        """The device tensors a step changes (the packed buffer, the layout's own), in a fixed order: what a
        tensor-parallel rank 0 broadcasts into the other ranks' batches of the same bucket."""
        return [self._device, *self.layout.device_tensors()]

    def device_tensors(self) -> list[torch.Tensor]:
        """Every device tensor the batch owns (what a graph's pool does not hold): the packed buffer, the
        layout's own, the all-rows index."""
        return [self._device, *self.layout.device_tensors(), self.all_rows]

    def fill_empty(self) -> None:
        """Every row padding: what warm-up and capture run (finite values everywhere)."""
        self._fill_host(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), ())
        self._upload()

    def fill(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy one step (rows in the eager order of `meta`) into the buffers; returns int64 [T_real] on the
        host: each real row's row in the bucket."""
        where = self._fill_host(ids.cpu(), positions.cpu(), meta.seqs)
        self._upload()
        return where

    def _fill_host(self, ids: torch.Tensor, positions: torch.Tensor, seqs) -> torch.Tensor:
        b = self.bucket
        T, Q = b.tokens, b.rows
        if self._copied is not None:  # the previous step's copy must have left the pinned buffer
            self._copied.synchronize()
        host = self._host
        host[: 2 * T].zero_()
        where = []
        for i, s in enumerate(seqs):
            r0 = i * Q
            host[r0 : r0 + s.q_len] = ids[s.q_start : s.q_start + s.q_len]
            host[T + r0 : T + r0 + s.q_len] = positions[s.q_start : s.q_start + s.q_len]
            where.append(torch.arange(r0, r0 + s.q_len))
        self.layout.pack(_tables(host, T, self.layout.int_words), seqs, self.pad_slot)
        return torch.cat(where) if where else torch.zeros(0, dtype=torch.int64)

    def _upload(self) -> None:
        self._device.copy_(self._host, non_blocking=True)
        self.layout.upload()
        if self._device.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def forward(self, model, kv_cache: torch.Tensor, taps: tuple[int, ...]):
        """The model's forward over these buffers: (final-normed hidden [T, d], taps [T, F] or None)."""
        out = model.forward(self.input_ids, self.positions, self.meta, kv_cache, tap_layer_ids=taps, hidden_only=True)
        return out.hidden, out.taps


def _tables(buffer: torch.Tensor, T: int, words: int) -> torch.Tensor:
    """int32 [words]: the tail of an int64 step buffer after its 2·T ids and positions, as int32."""
    return buffer[2 * T :].view(torch.int32)[:words]
