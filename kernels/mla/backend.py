"""`TritonMLAAttention`: the "triton" attention backend of services/models/layers/attention.py.

The model calls `write_latent` (the fused latent KV write, mla/latent_write.py) and `attend` once per layer
with the same AttentionMetadata. The kernel plan (mla/plan.py) is built from the metadata's host slot
tables by `prepare`, before the forward (the verifier's batch does it), and kept in `meta.prepared`
with its device buffers (one host -> device copy); the latent write takes its slots from the plan too, so
a forward only reads device buffers. A metadata nobody prepared is planned at its first use.
"""

from __future__ import annotations

import torch

from ddtree.kernels.mla.attention import mla_attention
from ddtree.kernels.mla.latent_write import write_latent
from ddtree.kernels.mla.plan import MLAKernelConfig, MLAPlan, MLASeq, plan_mla
from ddtree.kernels.mla.static_plan import MLAStaticLayout


class TritonMLAAttention:
    name = "triton"

    def __init__(self, config: MLAKernelConfig | None = None):
        self.config = config or MLAKernelConfig()

    def static_layout(self, bucket, num_heads: int, cache_slots: int, device: torch.device) -> MLAStaticLayout:
        """Its part of a static batch (models/runtime/static_batch.py): the plan of a bucket in fixed buffers."""
        return MLAStaticLayout(bucket, num_heads, cache_slots, device, self.config)

    def prepare(self, meta, num_heads: int, kv_cache: torch.Tensor) -> MLAPlan:
        """The plan of `meta` (AttentionMetadata) for `num_heads` heads over kv_cache ([L, S, W] or [S, W]),
        built once and kept in meta.prepared; meta.write_slots is then its device copy of the new slots."""
        key = (num_heads, kv_cache.device, kv_cache.shape[-2], self.config)
        got = meta.prepared.get(self.name)
        if got is not None and got[0] == key:
            return got[1]
        seqs = [MLASeq(s.q_len, s.prefix_slots.numel(), s.prefix_slots, s.new_slots, s.new_mask) for s in meta.seqs]
        plan = plan_mla(seqs, num_heads, page_size=1, num_cache_slots=kv_cache.shape[-2], device=kv_cache.device,
                        config=self.config)  # fmt: skip
        meta.prepared[self.name] = (key, plan)
        meta.prepared["write_slots"] = plan.new_slots[: plan.num_tokens]  # int32 [T] on the device
        return plan

    def plan(self, meta, num_heads: int, kv_layer: torch.Tensor) -> MLAPlan:
        """The plan of `meta` (prepare's, or made now)."""
        return self.prepare(meta, num_heads, kv_layer)

    def write_latent(self, kv_layer, latent, slots, positions, norm, rope) -> None:
        """kv_layer[slots] = [norm(c_kv) ; rope(k_pe)] in one launch (mla/latent_write.py); slots come from the
        verifier's page tables, which hand out each slot once (and the plan checked their range), so the
        device bounds check (a sync) is off."""
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
