"""Part (a) of `ddtree selftest gpu`, the drafter's row: the DFlash draft block forward replayed as a CUDA graph
(services/drafter/static_draft.py) against the eager forward_blocks, with µs.

A random drafter of Kimi width (hidden 7168, 6 taps of 7168, block 8, 32 heads / 8 KV heads of 128,
5 layers, bf16) is made on the device; for S sequences with contexts of C rows, the graph's output
(copy-in of the contexts included in its time) must match forward_blocks' hidden states within the
model dtype's tolerances (compare.py; bf16 on the GPU, fp32 in the dry run). `us` is the static
step (copy-in + replay), `torch us` the eager forward, GB/s the contexts' K/V copied in per µs.
The dry run uses a tiny drafter on the CPU, where the static buffers run without a graph. One more row runs a
causal head (JetSpec: causal block, block 16, its first layer sliding over half the window), whose masks the
graph builds on the device.
"""

from __future__ import annotations

import torch

from ddtree.drafter.static_draft import StaticDraft, draft_buckets
from ddtree.models.dflash.config import DFlashConfig, RopeConfig
from ddtree.models.dflash.model import DFlashDraftModel

KIMI_WIDTH = dict(hidden=7168, layers=5, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=163840, window=2048)
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, window=32)
TAPS, BLOCK = (1, 12, 24, 35, 47, 58), 8


def make_drafter(dims: dict, device: torch.device, block: int = BLOCK, **attention) -> DFlashDraftModel:
    cfg = DFlashConfig(**attention,
        hidden_size=dims["hidden"], intermediate_size=dims["ffn"], num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
        vocab_size=dims["vocab"], block_size=block, mask_token_id=dims["vocab"] - 2, target_layer_ids=TAPS,
        target_hidden_size=dims["hidden"], num_target_layers=61, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=50000.0), max_position_embeddings=262144,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(cfg)
    for name, p in model.named_parameters():  # unit-variance outputs, as write_random_drafter
        with torch.no_grad():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(dtype).eval()


def draft_graph_cases(dry_run: bool, device: torch.device, measure, compare, row) -> list[dict]:
    dims = TINY if dry_run else KIMI_WIDTH
    window = dims["window"]
    points = [(1, window // 2), (4, window)] if dry_run else [(1, 2048), (8, 2048), (16, 1024)]
    rows = _cases(make_drafter(dims, device), window, points, device, measure, compare, row, "")
    sliding = ("sliding_attention",) + ("full_attention",) * (dims["layers"] - 1)
    causal = make_drafter(dims, device, 16, causal_head=True, layer_types=sliding, sliding_window=window // 2)
    return rows + _cases(causal, window, points[-1:], device, measure, compare, row, " causal")


def _cases(model, window: int, points, device, measure, compare, row, kind: str) -> list[dict]:
    cfg, block = model.config, model.config.block_size
    static = StaticDraft(model, draft_buckets(16, window), block, model.dtype, graphs=device.type == "cuda")
    static.capture()
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)  # inputs made on the device (GBs of features)
    for S, C in points:
        with torch.inference_mode():
            feats = torch.randn(S * C, cfg.feature_size, generator=gen, device=device).to(model.dtype)
            kv = model.context_kv(feats, torch.arange(C, device=device).repeat(S))
            del feats
            contexts = [[(k[s * C : (s + 1) * C], v[s * C : (s + 1) * C]) for k, v in kv] for s in range(S)]
            embeds = torch.randn(S, block, cfg.hidden_size, generator=gen, device=device).to(model.dtype)
            positions = (C + torch.arange(block))[None, :].repeat(S, 1).to(device)
            want = model.forward_blocks(embeds, positions, contexts)
            got = static.run(embeds, positions, contexts)
            ok, detail = compare(f"draft block{kind} S{S} C{C}", got, want)  # the model dtype's tolerances
            call = (embeds, positions, contexts)
            t = measure(lambda call=call: static.run(*call))
            t_ref = measure(lambda call=call: model.forward_blocks(*call))
        per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
        dtype = str(model.dtype).removeprefix("torch.")
        shape = f"S={S} C={C} B={block} h={cfg.hidden_size} L={cfg.num_hidden_layers} {dtype}{kind}"
        ctx_bytes = S * C * per_row  # the contexts' K/V copied in
        rows.append(row("draft", "draft graph", shape, t * 1e6, t_ref * 1e6, ctx_bytes, ok, detail))
    return rows
