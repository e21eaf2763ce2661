"""The fused-MoE measurements that `ddtree selftest gpu` and scripts/bench/bench_moe_kernels.py share: the
model shapes at TP 8 (and a tiny set for CPU dry runs), random expert weights of each storage kind, the
per-expert torch loop (the reference), CUDA-graph timing over several routings, and one point's row.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import torch

MODELS = {
    "kimi-k2.6": dict(E=384, topk=8, d=7168, I=256, group=32, block=(128, 128), kinds=("int4", "bf16")),
    "deepseek-v3": dict(E=256, topk=8, d=7168, I=256, group=32, block=(128, 128), kinds=("fp8", "bf16")),
}
TINY = {"tiny": dict(E=8, topk=2, d=64, I=32, group=16, block=(32, 32), kinds=("int4", "fp8", "bf16"))}
PEAK_GBPS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0), ("H20", 4000.0),
             ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0), ("L40S", 864.0),
             ("B200", 8000.0)]  # HBM peak by device-name substring, first match  # fmt: skip
TILES = [(16, 128, 4, 3), (16, 256, 4, 4), (32, 128, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
         (64, 128, 8, 4), (128, 64, 4, 3), (128, 128, 8, 3)]  # (block_n, block_k, warps, stages)  # fmt: skip
REPEATS = 8  # calls per graph, each with its own routing


@dataclasses.dataclass(frozen=True)
class Plan:
    repeats: int = REPEATS
    tiles: tuple = tuple(TILES)
    tune_all_kinds: bool = False  # default: tune each model's checkpoint format (its first kind) only


def random_weights(kind: str, E: int, N: int, K: int, dims: dict, device, gen):
    """Random ExpertWeights of `kind` built on the device (the values only matter for the output check):
    random stored values in the format's layout, not a quantized matrix (quantizing Kimi's experts would
    take longer than the measurement)."""
    from ddtree.kernels.weight_formats import BF16, FP8_BLOCK, INT4_PACK, weight_format

    make = {BF16: _random_float, INT4_PACK: _random_int4, FP8_BLOCK: _random_fp8}[weight_format(kind)]
    return make(kind, E, N, K, dims, device, gen)


def _random_float(kind: str, E: int, N: int, K: int, dims: dict, device, gen):
    from ddtree.kernels.moe.weights import ExpertWeights

    w = torch.randn(E, N, K, generator=gen, device=device) / K**0.5
    return ExpertWeights(kind, w.to(torch.bfloat16), N, K)


def _random_int4(kind: str, E: int, N: int, K: int, dims: dict, device, gen):
    from ddtree.kernels.moe.weights import ExpertWeights

    g = dims["group"]
    words = torch.randint(-(2**31), 2**31 - 1, (E, N, -(-K // 8)), generator=gen, device=device, dtype=torch.int32)
    scale = (torch.rand(E, N, -(-K // g), generator=gen, device=device) + 0.5) * (0.3 / K**0.5)
    return ExpertWeights(kind, words, N, K, scale.to(torch.bfloat16), group_size=g)


def _random_fp8(kind: str, E: int, N: int, K: int, dims: dict, device, gen):
    from ddtree.kernels.moe.weights import ExpertWeights

    bn, bk = dims["block"]
    q = (torch.randn(E, N, K, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(E, -(-N // bn), -(-K // bk), generator=gen, device=device) + 0.5) / (64 * K**0.5)
    return ExpertWeights(kind, q, N, K, scale, block=(bn, bk))


def dequantized_bf16(w) -> torch.Tensor:
    """[E, N, K] bf16: the same weights for the torch loop (one expert at a time, to bound the fp32 copy)."""
    return torch.stack([w.dequantize(e).to(torch.bfloat16) for e in range(w.num_experts)])


def routing(M: int, E: int, topk: int, device, gen):
    ids = torch.rand(M, E, generator=gen, device=device).topk(topk, dim=1).indices.to(torch.int32)
    weights = torch.rand(M, topk, generator=gen, device=device).softmax(dim=1)
    return ids, weights


def loop_moe(x, wg, wu, wd, topk_weights, topk_ids) -> torch.Tensor:
    """The per-expert torch loop (host syncs included) over bf16 weights [E, N, K]."""
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=wg.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // topk_ids.shape[1]
        xe = x[rows]
        h = torch.nn.functional.silu(xe @ wg[e].T) * (xe @ wu[e].T)
        out.index_add_(0, rows, (h @ wd[e].T).float() * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(x.dtype)


def timer(device):
    """fn -> median seconds: triton's do_bench (L2 flushed) on CUDA; one run on a CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e-3

    def cpu(fn):  # the dry run: once, interpreted (the caller warmed it up)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu


def time_calls(fns, device, measure) -> float:
    """Seconds per call of fns (each once, in order): one CUDA graph replay on a GPU, eager on a CPU."""
    for fn in fns:
        fn()  # compile and warm up outside the capture
    if device.type != "cuda":
        return measure(lambda: [fn() for fn in fns]) / len(fns)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return measure(graph.replay) / len(fns)


def weight_bytes(ws, topk_ids) -> int:
    """Bytes of gate + up + down (with scales) of the experts that got a pair."""
    active = int(torch.unique(topk_ids).numel())
    return active * sum(w.nbytes() for w in ws) // ws[0].num_experts


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denom = (a * a + b * b).sum().item()
    return 0.0 if denom == 0 else 1.0 - 2.0 * (a * b).sum().item() / denom


def make_calls(M: int, dims: dict, device, gen, repeats: int) -> list[tuple]:
    """`repeats` (x bf16 [M, d], topk_ids, topk_weights), each with its own routing."""
    return [(torch.randn(M, dims["d"], generator=gen, device=device).to(torch.bfloat16),
             *routing(M, dims["E"], dims["topk"], device, gen)) for _ in range(repeats)]  # fmt: skip


def time_fused(ws, calls, config, device, measure) -> float:
    from ddtree.kernels.moe.fused import fused_moe

    fns = [functools.partial(fused_moe, x, *ws, tw, ids, config=config) for x, ids, tw in calls]
    return time_calls(fns, device, measure)


def bench_point(name: str, kind: str, dims: dict, ws, bf, M: int, device, measure, peak_gbps, gen, plan) -> dict:
    from ddtree.kernels.moe.fused import fused_moe

    calls = make_calls(M, dims, device, gen, plan.repeats)
    t_graph = time_fused(ws, calls, None, device, measure)
    x, ids, tw = calls[0]
    t_eager = measure(functools.partial(fused_moe, x, *ws, tw, ids))
    t_loop = measure(functools.partial(loop_moe, x, *bf, tw, ids))
    err = cos_diff(fused_moe(x, *ws, tw, ids), loop_moe(x, *bf, tw, ids))
    nbytes = statistics.mean(weight_bytes(ws, c[1]) for c in calls)
    gbps = nbytes / t_graph / 1e9
    row = dict(model=name, kind=kind, E=dims["E"], topk=dims["topk"], d=dims["d"], I=dims["I"], M=M,
               fused_us=t_graph * 1e6, fused_eager_us=t_eager * 1e6, loop_bf16_us=t_loop * 1e6, weight_bytes=nbytes,
               gbps=gbps, pct_peak=100 * gbps / peak_gbps if peak_gbps else None, cos_diff_vs_loop=err,
               ok=err < (2e-2 if ws[0].fmt.quantizes_activations else 1e-4))  # fmt: skip
    pct = f"{row['pct_peak']:.0f}%" if peak_gbps else "-"
    print(f"{name:>12} {kind:>4} M={M:>4}: fused {row['fused_us']:9.1f} µs (eager {row['fused_eager_us']:9.1f})"
          f"  loop {row['loop_bf16_us']:10.1f} µs  {gbps:7.0f} GB/s {pct:>5}  cos diff {err:.1e}"
          f"{'' if row['ok'] else '  MISMATCH'}", flush=True)  # fmt: skip
    return row


def projections(kind: str, dims: dict, device, gen) -> list:
    """gate [E, I, d], up [E, I, d], down [E, d, I] of `kind`."""
    E, d, inter = dims["E"], dims["d"], dims["I"]
    return [random_weights(kind, E, n, kk, dims, device, gen) for n, kk in ((inter, d), (inter, d), (d, inter))]


def bench_model(name: str, dims: dict, ms, device, measure, peak_gbps, gen, plan: Plan) -> list[dict]:
    from ddtree.kernels.weight_formats import weight_format

    rows = []
    for kind in dims["kinds"]:
        ws = projections(kind, dims, device, gen)
        bf = [dequantized_bf16(w) for w in ws]
        rows += [bench_point(name, kind, dims, ws, bf, M, device, measure, peak_gbps, gen, plan) for M in ms]
    for r in rows:  # speedups against bf16 weights at the same point
        base = next((b for b in rows if not weight_format(b["kind"]).packed and b["M"] == r["M"]), None)
        r["speedup_vs_bf16_fused"] = base["fused_us"] / r["fused_us"] if base else None
        r["speedup_vs_loop"] = r["loop_bf16_us"] / r["fused_us"]
    return rows


def peak_for(name: str) -> float | None:
    return next((v for key, v in PEAK_GBPS if key in name), None)
