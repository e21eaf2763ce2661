"""CPU time of one MoE layer: the old per-expert loop against the grouped path (services/models/deepseek_v3/moe_grouped.py).

    python -m scripts.bench.bench_moe_cpu [--rows 1 17 136] [--repeats 30] [--threads N]

Models: the demo target (checkpoints/demo/target when present, else a random model of its config) and a
tiny K2-shaped MoE (64 experts, top 8, d 512, expert width 128; Kimi K2 has 384, top 8, 7168, 2048), its
routed experts as they are (fp32), INT4 (group 32) and FP8 (128x128 blocks). Per model, kind and number
of rows: the fastest wall time (of --repeats interleaved rounds) of the whole MoE layer (router + routed + shared experts) for
- `loop`: the per-expert loop the model had before (one nn.Linear triple per expert that got a token, on
  weights dequantized at load: what the old loader kept in memory);
- `grouped_mm`: tokens sorted by expert, one torch._grouped_mm per projection (packed weights dequantized
  per call for the experts present);
- `bmm`: the same with a zero-padded torch.bmm over the experts present.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.weight_formats import weight_format
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, random_target_state_dict
from ddtree.models.deepseek_v3 import moe_grouped
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.moe import DeepseekV3MoE

DEMO_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "demo" / "target"
K2_TINY = {**DEFAULT_TARGET_CONFIG, "hidden_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 64,
           "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "num_hidden_layers": 2, "vocab_size": 256}  # fmt: skip


def demo_moe() -> tuple[str, DeepseekV3MoE]:
    if (DEMO_DIR / "model.safetensors").exists():
        from ddtree.models.checkpoint.loader import load_target

        model = load_target(DEMO_DIR, dtype=torch.float32)
        return "demo (checkpoints/demo)", model.model.layers[model.config.first_k_dense_replace].mlp
    from ddtree.tools.train_target import DEMO_TARGET_CONFIG

    return "demo (random, demo config)", _random_moe(DEMO_TARGET_CONFIG)


def _random_moe(cfg: dict) -> DeepseekV3MoE:
    config = DeepseekV3Config.from_dict(cfg)
    model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(random_target_state_dict(config, seed=0))
    return model.model.layers[config.first_k_dense_replace].mlp.eval()


def packed(w: ExpertWeights, kind: str) -> ExpertWeights:
    """The same fp32 expert weights quantized to `kind` (what a quantized checkpoint would hold: INT4 groups
    of 32, FP8 128x128 blocks)."""
    fmt = weight_format(kind)
    if not fmt.packed:
        return w
    q, s = fmt.quantize(w.weight, 32, (128, 128))
    group = 32 if fmt.grouped else 0
    return ExpertWeights(kind, q, w.out_features, w.in_features, s, group_size=group)


def old_loop(experts: list[nn.Module], x, weights, idx) -> torch.Tensor:
    """The routed part of DeepseekV3MoE.forward before the stacked experts (verbatim but for `experts`)."""
    out = torch.zeros_like(x)
    flat_idx = idx.flatten()
    order = flat_idx.argsort(stable=True)
    counts = torch.bincount(flat_idx, minlength=len(experts)).tolist()
    token_of, slot_of = order // idx.shape[1], order % idx.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, pos = token_of[start : start + n], slot_of[start : start + n]
        start += n
        y = experts[e](x[tok]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class _Expert(nn.Module):
    def __init__(self, g, u, d):
        super().__init__()
        self.g, self.u, self.d = g, u, d

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.g)) * F.linear(x, self.u), self.d)


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """ms per call of each fn: the fastest of `repeats` rounds, the fns interleaved within a round (on a
    shared machine the minimum is the steadiest estimate, and interleaving spreads the noise evenly)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1e3 * t for name, t in best.items()}


def layer_fns(moe: DeepseekV3MoE, experts: list[nn.Module], ws, x, weights, idx) -> dict:
    """The whole MoE layer (routing precomputed) by each method."""

    def grouped(method: str):
        return lambda: moe.shared_experts(x) + moe_grouped.grouped_moe(x, *ws, weights, idx, method=method)

    loop = lambda: moe.shared_experts(x) + old_loop(experts, x, weights, idx)  # noqa: E731
    return {"loop": loop, "grouped_mm": grouped("grouped_mm"), "bmm": grouped("bmm")}


@torch.no_grad()
def bench(name: str, moe: DeepseekV3MoE, rows: list[int], repeats: int, kinds: tuple[str, ...]) -> None:
    fp32 = [p.expert_weights() for p in moe.experts.projections()]
    d = moe.experts.hidden_size
    print(f"\n{name}: {moe.experts.num_experts} experts, top {moe.gate.top_k}, d {d}, "
          f"width {moe.experts.intermediate_size}; ms per MoE layer (best of {repeats})")  # fmt: skip
    print(f"  {'kind':<6}{'rows':>6}{'loop':>10}{'grouped_mm':>12}{'bmm':>10}   speed-up grouped_mm vs loop")
    g = torch.Generator().manual_seed(0)
    for kind in kinds:
        ws = [packed(w, kind) for w in fp32]
        dense = [torch.stack([w.dequantize(e) for e in range(w.num_experts)]) for w in ws]  # the old loader's copy
        experts = [_Expert(dense[0][e], dense[1][e], dense[2][e]) for e in range(len(dense[0]))]
        for m in rows:
            x = torch.randn(m, d, generator=g)
            weights, idx = moe.gate(x)
            fns = layer_fns(moe, experts, ws, x, weights, idx)
            t = timed(fns, repeats)
            label = kind if weight_format(kind).packed else "fp32"
            print(f"  {label:<6}{m:>6}{t['loop']:>10.3f}{t['grouped_mm']:>12.3f}{t['bmm']:>10.3f}   "
                  f"x{t['loop'] / t['grouped_mm']:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 17, 136])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 activations")
    name, moe = demo_moe()
    bench(name, moe, args.rows, args.repeats, ("bf16",))
    bench("K2-shaped tiny", _random_moe(K2_TINY), args.rows, args.repeats, ("bf16", "int4", "fp8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
