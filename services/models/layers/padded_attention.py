"""The torch backend's attention over a static batch (static_batch.py): keys as a padded slot table.

Layout of a bucket (B sequences, Q rows, K keys each):

    write_slots int32 [B·Q]      a real row's new slot; a padding row's is the pool's pad slot
    key_slots   int32 [B, K]     the prefix slots, then the sequence's new slots, then the pad slot
    key_bias    bf16  [B, Q, K]  added to the fp32 scores: 0 where a row sees a key, -inf where not
                                 (padding, the causal or tree mask); bf16 holds 0 and -inf exactly

Every row sees key 0 (a real row does anyway: the first prefix key, or the root), so no row is all -inf
and the pad slot only ever holds finite latents. Attention is absorbed MLA as in attention.py, batched
over sequences: one gather of every sequence's keys, one bmm for the scores of all heads and rows, one
masked softmax, one bmm for the values.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedKeys:
    """What the torch backend's `attend` reads for a static batch (its `prepared["torch"]`)."""

    key_slots: torch.Tensor  # int32 [B, K]
    key_bias: torch.Tensor  # bf16 [B, Q, K]


class PaddedKeysLayout:
    """The torch backend's part of a static batch: its int32 tables (in the step's packed buffer) and its
    bf16 key bias (a buffer of its own, staged on the host)."""

    def __init__(self, bucket, device: torch.device):
        self.bucket = bucket
        B, Q, K = bucket.batch, bucket.rows, bucket.keys
        self.int_words = B * Q + B * K
        self._bias_host = torch.zeros(B, Q, K, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
        self._bias = torch.zeros(B, Q, K, dtype=torch.bfloat16, device=device)

    def bind(self, ints: torch.Tensor) -> dict:
        """The prepared entries over the device tables `ints` (int32 [int_words])."""
        B, Q, K = self.bucket.batch, self.bucket.rows, self.bucket.keys
        return {
            "torch": PaddedKeys(ints[B * Q :].view(B, K), self._bias),
            "write_slots": ints[: B * Q],
        }

    def pack(self, ints: torch.Tensor, seqs, pad_slot: int) -> None:
        """Write the tables of `seqs` (SeqAttention, at most B) into the host `ints` and the host bias."""
        B, Q, K = self.bucket.batch, self.bucket.rows, self.bucket.keys
        write, keys, bias = ints[: B * Q], ints[B * Q :].view(B, K), self._bias_host
        write.fill_(pad_slot)
        keys.fill_(pad_slot)
        bias.fill_(float("-inf"))
        bias[:, :, 0] = 0.0
        for i, s in enumerate(seqs):
            P, n = s.prefix_slots.numel(), s.q_len
            write[i * Q : i * Q + n] = s.new_slots
            keys[i, :P] = s.prefix_slots
            keys[i, P : P + n] = s.new_slots
            bias[i, :n, :P] = 0.0
            bias[i, :n, P : P + n] = torch.where(s.visible_new().cpu(), 0.0, float("-inf"))

    def upload(self) -> None:
        self._bias.copy_(self._bias_host, non_blocking=True)

    def device_tensors(self) -> list[torch.Tensor]:
        return [self._bias]


def attend_padded(
    q_lat: torch.Tensor,  # [T, H, r] T = B·Q
    q_pe: torch.Tensor,  # [T, H, dr]
    kv_layer: torch.Tensor,  # [S, r + dr], this step's rows written
    keys: PaddedKeys,
    scale: float,
) -> torch.Tensor:  # o_lat [T, H, r], dtype of q_lat
    T, H, r = q_lat.shape
    B, Q, K = keys.key_bias.shape
    qf = torch.cat([q_lat, q_pe], dim=-1).float() * scale  # [T, H, r + dr]
    kv = kv_layer.index_select(0, keys.key_slots.flatten()).view(B, K, -1).float()  # [B, K, r + dr]
    scores = torch.bmm(qf.view(B, Q * H, -1), kv.transpose(1, 2)).view(B, Q, H, K) + keys.key_bias[:, :, None, :]
    probs = torch.softmax(scores, dim=-1).view(B, Q * H, K)
    return torch.bmm(probs, kv[:, :, :r]).view(T, H, r).to(q_lat.dtype)
