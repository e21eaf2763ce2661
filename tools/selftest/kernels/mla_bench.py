"""The MLA kernel measurements that `ddtree selftest gpu` and scripts/bench/bench_kernels.py share: the
shapes (Kimi K2 at TP 8, absorbed form; a tiny fp32 set for CPU dry runs), random tree masks, torch SDPA
over the same gathered latents (the reference), the device timer and the device's peak bandwidth.
"""

from __future__ import annotations

import statistics
import time

import torch

KIMI = dict(heads=8, r=512, dr=64, dtype="bfloat16")
TINY = dict(heads=2, r=64, dr=16, dtype="float32")


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask [n+1, n+1] of a random tree with parent(i) < i (root = row 0)."""
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i in range(1, n + 1):
        mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        mask[i, i] = True
    return mask


def sdpa_inputs(q_lat, q_pe, kv, seqs, masks, r: int):
    """Dense batched tensors for torch SDPA: q [B, H, q, r+dr], k [B, 1, L, r+dr], v [B, 1, L, r], mask."""
    B, q = len(seqs), seqs[0].q_len
    P = seqs[0].prefix_len
    idx = torch.stack([torch.cat([s.prefix_table, s.new_slots]) for s in seqs]).to(kv.device)  # [B, L]
    k = kv[idx][:, None]  # [B, 1, L, r+dr]
    qq = torch.cat([q_lat, q_pe], dim=-1).view(B, q, q_lat.shape[1], -1).transpose(1, 2)  # [B, H, q, r+dr]
    mask = torch.ones(B, 1, q, P + q, dtype=torch.bool, device=kv.device)
    mask[:, 0, :, P:] = torch.stack(masks).to(kv.device)
    return qq, k, k[..., :r], mask


def run_sdpa(qq, k, v, mask, scale):
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except RuntimeError:  # a backend without grouped-query support: expand the one latent head
        H = qq.shape[1]
        return F.scaled_dot_product_attention(qq, k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1),
                                              attn_mask=mask, scale=scale)  # fmt: skip


def timer(device: torch.device):
    """fn -> median seconds: triton's do_bench (L2 flushed) on CUDA, a few wall-clock runs on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3

    def cpu(fn):
        fn()
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    return cpu


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return None
