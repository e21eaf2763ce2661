"""`TritonMLAAttention`: the "triton" attention backend of services/models/attention.py.

The model calls `write_latent` (the fused latent KV write, latent_write.py) and `attend` once per layer
with the same AttentionMetadata; the kernel plan (mla_plan.py) is packed on the first call of a forward
and reused by the others (the backend remembers the last metadata object through a weak reference, so
nothing is written onto the frozen metadata).
"""

from __future__ import annotations

import weakref

import torch

from .latent_write import write_latent
from .mla_attention import mla_attention
from .mla_plan import MLAKernelConfig, MLAPlan, MLASeq, plan_mla


class TritonMLAAttention:
    name = "triton"

    def __init__(self, config: MLAKernelConfig | None = None):
        self.config = config or MLAKernelConfig()
        self._last: tuple[weakref.ref, tuple, MLAPlan] | None = None

    def plan(self, meta, num_heads: int, kv_layer: torch.Tensor) -> MLAPlan:
        """The plan of `meta` (AttentionMetadata), packed once and reused while meta is the same object."""
        key = (num_heads, kv_layer.device, kv_layer.shape[0])
        if self._last is not None and self._last[0]() is meta and self._last[1] == key:
            return self._last[2]
        seqs = [MLASeq(s.q_len, s.prefix_slots.numel(), s.prefix_slots, s.new_slots, s.new_mask) for s in meta.seqs]
        plan = plan_mla(seqs, num_heads, page_size=1, num_cache_slots=kv_layer.shape[0], device=kv_layer.device,
                        config=self.config)  # fmt: skip
        self._last = (weakref.ref(meta), key, plan)
        return plan

    def write_latent(self, kv_layer, latent, slots, positions, norm, rope) -> None:
        """kv_layer[slots] = [norm(c_kv) ; rope(k_pe)] in one launch (latent_write.py); slots come from the
        verifier's page tables, which hand out each slot once, so the device bounds check (a sync) is off."""
        write_latent(
            kv_layer,
            latent.contiguous(),
            slots.to(kv_layer.device),
            positions.to(kv_layer.device),
            norm.weight,
            norm.eps,
            rope.inv_freq,
            rope.attention_factor,
            check_slots=False,
        )

    def attend(
        self,
        q_lat: torch.Tensor,  # [T, H, r]
        q_pe: torch.Tensor,  # [T, H, dr]
        kv_layer: torch.Tensor,  # [S, r + dr]
        meta,  # AttentionMetadata
        scale: float,
    ) -> torch.Tensor:  # o_lat [T, H, r]
        return mla_attention(q_lat, q_pe, kv_layer, self.plan(meta, q_lat.shape[1], kv_layer), scale)
