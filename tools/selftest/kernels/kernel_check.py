"""Part (a) of `ddtree selftest gpu`: every Triton kernel against its torch reference, timed.

- MLA attention (kernels/mla/attention.py): decode (1 query), tree verify (root + 16 / 64 nodes, random
  trees) and extend (a prefill chunk over a cached prefix, causal), against fp32 SDPA over the same
  gathered latents; the torch time is SDPA in the kernel's dtype (KV pre-gathered, so it excludes the
  gather it would need). Inputs and the SDPA reference: selftest/kernels/mla_bench.py.
- the fused latent write (kernels/mla/latent_write.py) against write_latent_ref (the torch ops it replaces).
- the dense FP8 block GEMM and INT4 group GEMM (kernels/gemm/fp8.py, kernels/gemm/int4.py) against
  kernels/gemm/dense_reference.py (fp32 on the CPU); the torch time is a bf16 matmul of the dequantized
  weight on the device.
- the fused MoE, bf16 / INT4 / FP8 weights: selftest/kernels/moe_bench.py's `bench_model` (CUDA-graph
  timing, cosine difference from the per-expert torch loop), its rows folded into this table.
- the router, fused residual add + RMSNorm, SiLU-and-mul and the queries' RoPE against their references
  (selftest/kernels/layer_kernel_check.py).
- the drafter's block forward as a CUDA graph against the eager one (draft_graph.py).

Every row: kernel, shape, kernel µs, torch µs, the bytes the call must move / kernel time (GB/s), ok.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from ddtree.tools.selftest.compare import assert_close
from ddtree.tools.selftest.draft_graph import draft_graph_cases
from ddtree.tools.selftest.kernels import mla_bench as mla
from ddtree.tools.selftest.kernels import moe_bench as moe
from ddtree.tools.selftest.kernels.layer_kernel_check import layer_kernel_cases


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    mla_dims: dict
    mla_cases: tuple  # (kind, batch, prefix, q_len)
    mla_config: dict  # MLAKernelConfig fields
    latent_tokens: tuple
    gemm_shapes: tuple  # (N, K)
    gemm_m: tuple
    fp8_block: tuple
    int4_group: int
    moe_models: dict
    moe_m: tuple
    moe_plan: object


def make_plan(dry_run: bool) -> KernelPlan:
    if dry_run:
        cases = [(k, b, p, q) for p in (16, 64) for k, b, q in (("decode", 1, 1), ("decode", 2, 1), ("verify", 1, 5),
                                                                 ("extend", 1, 8))]  # fmt: skip
        return KernelPlan(mla.TINY, tuple(cases), dict(block_m=16, block_n=16, min_split=16), (1, 5),
                          ((64, 64),), (1, 5), (32, 32), 16, moe.TINY, (1, 3), moe.Plan(1, tuple(moe.TILES[:2])))  # fmt: skip
    cases = [(k, b, p, q) for p in (128, 4096, 32768) for k, b, q in (("decode", 1, 1), ("decode", 8, 1),
             ("verify", 1, 17), ("verify", 1, 65), ("extend", 1, 512))]  # fmt: skip
    return KernelPlan(mla.KIMI, tuple(cases), {}, (1, 17, 512), ((12288, 1536), (7168, 8192)), (1, 16, 256),
                      (128, 128), 32, moe.MODELS, (1, 16, 128), moe.Plan(repeats=4))  # fmt: skip


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, corrupt: bool = False, **tol) -> tuple[bool, str]:
    """compare.py's assert_close as (ok, detail). corrupt: spoil the expected value first (the check's own
    test: a wrong result must fail)."""
    if corrupt:
        expected = expected.clone()
        expected.view(-1)[0] += 1.0 + 2 * expected.float().abs().max().item()
    try:
        assert_close(name, actual, expected, **tol)
    except AssertionError as e:
        return False, str(e)[:300]
    return True, ""


def _row(group, kernel, shape, us, ref_us, nbytes, ok, detail, peak) -> dict:
    gbs = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    return dict(group=group, kernel=kernel, shape=shape, us=us, torch_us=ref_us, bytes=nbytes, gbs=gbs,
                pct_peak=100 * gbs / peak if peak else None, ok=ok, detail=detail)  # fmt: skip


def mla_case(kind, batch, prefix, q_len, plan: KernelPlan, device, measure, peak, corrupt) -> dict:
    from ddtree.kernels.mla.attention import mla_attention
    from ddtree.kernels.mla.plan import MLAKernelConfig, MLASeq, plan_mla

    dims = plan.mla_dims
    H, r, dr, dtype = dims["heads"], dims["r"], dims["dr"], getattr(torch, dims["dtype"])
    gen = torch.Generator().manual_seed(prefix * 131 + batch * 7 + q_len)
    S = batch * (prefix + q_len) + 64
    slots = torch.randperm(S, generator=gen)
    seqs, masks = [], []
    for b in range(batch):
        own = slots[b * (prefix + q_len) : (b + 1) * (prefix + q_len)]
        mask = mla.random_tree_mask(q_len - 1, gen) if kind == "verify" else None
        seqs.append(MLASeq(q_len, prefix, own[:prefix], own[prefix:], mask))
        masks.append(torch.ones(q_len, q_len, dtype=torch.bool).tril() if mask is None else mask)
    kv = torch.randn(S, r + dr, generator=gen).to(device, dtype)
    q_lat = torch.randn(batch * q_len, H, r, generator=gen).to(device, dtype)
    q_pe = torch.randn(batch * q_len, H, dr, generator=gen).to(device, dtype)
    scale = 1.0 / math.sqrt(192)
    mla_plan = plan_mla(seqs, H, num_cache_slots=S, device=device, config=MLAKernelConfig(**plan.mla_config))
    out = mla_attention(q_lat, q_pe, kv, mla_plan, scale)
    t = measure(lambda: mla_attention(q_lat, q_pe, kv, mla_plan, scale))
    qq, k, v, mask = mla.sdpa_inputs(q_lat, q_pe, kv, seqs, masks, r)
    t_ref = measure(lambda: mla.run_sdpa(qq, k, v, mask, scale))
    ref = mla.run_sdpa(qq.float(), k.float(), v.float(), mask, scale).transpose(1, 2).reshape(out.shape)
    name = f"mla {kind} B{batch} P{prefix} q{q_len}"
    ok, detail = compare(name, out, ref.to(out.dtype), corrupt)
    elt = kv.element_size()
    nbytes = batch * (prefix + q_len) * (r + dr) * elt + batch * q_len * H * (2 * r + dr) * elt
    shape = f"B={batch} prefix={prefix} q={q_len} H={H} {r}+{dr} {dims['dtype']}"
    return _row("mla", f"mla {kind}", shape, t * 1e6, t_ref * 1e6, nbytes, ok, detail, peak)


def latent_write_case(T: int, plan: KernelPlan, device, measure, peak, corrupt) -> dict:
    from ddtree.kernels.mla.latent_write import write_latent
    from ddtree.kernels.reference import write_latent_ref

    r, dr, dtype = plan.mla_dims["r"], plan.mla_dims["dr"], getattr(torch, plan.mla_dims["dtype"])
    gen = torch.Generator().manual_seed(T)
    S = 4 * T + 8
    kv = torch.randn(S, r + dr, generator=gen).to(device, dtype)
    latent = (3 * torch.randn(T, r + dr, generator=gen)).to(device, dtype)
    slots = torch.randperm(S, generator=gen)[:T].to(device)
    pos = torch.randint(0, 32768, (T,), generator=gen).to(device)
    w = (1 + 0.2 * torch.randn(r, generator=gen)).to(device, dtype)
    inv = (1.0 / 10000.0 ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr)).to(device)
    got, want = kv.clone(), kv.clone()
    write_latent(got, latent, slots, pos, w, 1e-6, inv)
    write_latent_ref(want, latent, slots, pos, w, 1e-6, inv)
    ok, detail = compare(f"latent write T{T}", got, want, corrupt)
    t = measure(lambda: write_latent(got, latent, slots, pos, w, 1e-6, inv, check_slots=False))
    t_ref = measure(lambda: write_latent_ref(want, latent, slots, pos, w, 1e-6, inv))
    nbytes = 2 * T * (r + dr) * kv.element_size()  # latent read + cache rows written
    return _row("latent", "latent write", f"T={T} {r}+{dr} {plan.mla_dims['dtype']}", t * 1e6, t_ref * 1e6, nbytes,
                ok, detail, peak)  # fmt: skip


def gemm_cases(plan: KernelPlan, device, measure, peak, corrupt) -> list[dict]:
    from ddtree.kernels.gemm import dense_reference as ref
    from ddtree.kernels.gemm.fp8 import fp8_block_gemm
    from ddtree.kernels.gemm.int4 import int4_gemm
    from ddtree.kernels.quant_formats import (
        dequantize_fp8_block,
        dequantize_int4,
        quantize_fp8_block,
        quantize_int4_group,
    )

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for N, K in plan.gemm_shapes:
        gen = torch.Generator().manual_seed(N + K)
        w = torch.randn(N, K, generator=gen) / K**0.5
        q8, s8 = quantize_fp8_block(w, plan.fp8_block)
        p4, s4, _ = quantize_int4_group(w, plan.int4_group)
        w8 = dequantize_fp8_block(q8, s8, plan.fp8_block).to(device, dtype)
        w4 = dequantize_int4(p4, s4, plan.int4_group, K).to(device, dtype)
        q8, s8, p4, s4 = (t.to(device) for t in (q8, s8, p4, s4))
        for M in plan.gemm_m:
            x = torch.randn(M, K, generator=gen).to(device, dtype)
            for kind, group, fn, expected, w_deq, wbytes in (
                ("fp8", f"block {plan.fp8_block}", lambda: fp8_block_gemm(x, q8, s8, plan.fp8_block),  # noqa: B023
                 lambda: ref.fp8_block_gemm_reference(x, q8, s8, plan.fp8_block), w8, N * K + 4 * s8.numel()),  # noqa: B023
                ("int4", f"group {plan.int4_group}", lambda: int4_gemm(x, p4, s4, plan.int4_group),  # noqa: B023
                 lambda: ref.int4_gemm_reference(x, p4, s4, plan.int4_group), w4, N * K // 2 + 2 * s4.numel()),  # noqa: B023
            ):  # fmt: skip
                ok, detail = compare(f"{kind} gemm {M}x{N}x{K}", fn(), expected(), corrupt)
                t = measure(fn)
                t_ref = measure(lambda: x @ w_deq.T)  # noqa: B023
                nbytes = wbytes + (M * K + M * N) * x.element_size()
                rows.append(_row("gemm", f"{kind} gemm", f"M={M} N={N} K={K} {group}", t * 1e6, t_ref * 1e6, nbytes,
                                 ok, detail, peak))  # fmt: skip
    return rows


def moe_cases(plan: KernelPlan, device, peak) -> list[dict]:
    """moe_bench's points, as rows of this table (its own lines print as it goes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    measure = moe.timer(device)
    rows = []
    for name, dims in plan.moe_models.items():
        for r in moe.bench_model(name, dims, plan.moe_m, device, measure, peak, gen, plan.moe_plan):
            shape = f"{name} E={r['E']} top{r['topk']} d={r['d']} I={r['I']} M={r['M']}"
            rows.append(_row("moe", f"fused moe {r['kind']}", shape, r["fused_us"], r["loop_bf16_us"],
                             r["weight_bytes"], r["ok"], f"cos diff vs loop {r['cos_diff_vs_loop']:.1e}", peak))  # fmt: skip
    return rows


def _guarded(fn, kernel: str, shape: str) -> list[dict]:
    """fn()'s rows, or one failed row saying what raised (a compile error must not hide the other kernels)."""
    try:
        out = fn()
    except Exception as e:
        return [_row("error", kernel, shape, 0.0, 0.0, 0, False, f"raised {e!r}"[:300], None)]
    return out if isinstance(out, list) else [out]


def run_kernels(dry_run: bool, device: torch.device, corrupt: bool = False, log=print, deadline: float = float("inf"),
                on_row=lambda out: None) -> dict:  # fmt: skip
    """{device, peak_gbs, rows, mismatches, skipped}: a job (a shape, or a kernel's group of shapes) not started
    past `deadline` (perf_counter) is counted in skipped; on_row(out) after each job (the JSON saved)."""
    plan = make_plan(dry_run)
    measure = mla.timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    peak = moe.peak_for(name) or mla.peak_bandwidth_gbs(device) if device.type == "cuda" else None
    jobs = [(functools.partial(mla_case, *c, plan, device, measure, peak, corrupt), f"mla {c[0]}", f"{c}")
            for c in plan.mla_cases]  # fmt: skip
    jobs += [(functools.partial(latent_write_case, T, plan, device, measure, peak, corrupt), "latent write", f"T={T}")
             for T in plan.latent_tokens]  # fmt: skip
    jobs.append((functools.partial(gemm_cases, plan, device, measure, peak, corrupt), "dense gemm", "all"))
    jobs.append((functools.partial(moe_cases, plan, device, peak), "fused moe", "all"))
    part_row, part_compare = functools.partial(_row, peak=peak), functools.partial(compare, corrupt=corrupt)
    layer = functools.partial(layer_kernel_cases, dry_run, device, measure, part_row, part_compare)
    jobs.append((layer, "layer kernels", "all"))
    draft = functools.partial(draft_graph_cases, dry_run, device, measure, part_compare, part_row)
    jobs.append((draft, "draft graph", "all"))
    out = dict(device=name, peak_gbs=peak, rows=[], mismatches=0, skipped=0)
    for fn, kernel, shape in jobs:
        if time.perf_counter() > deadline:
            out["skipped"] += 1
            log(f"{kernel:<16} {shape:<52} skipped: past the deadline")
            continue
        for row in _guarded(fn, kernel, shape):
            out["rows"].append(row)
            out["mismatches"] += not row["ok"]
            log(format_row(row))  # (moe_bench also prints a line per point as it measures)
        on_row(out)
    return out


HEADER = f"{'kernel':<16} {'shape':<52} {'µs':>10} {'torch µs':>10} {'GB/s':>8} {'%peak':>6}  ok"


def format_row(r: dict) -> str:
    pct = f"{r['pct_peak']:.0f}" if r["pct_peak"] is not None else "-"
    flag = "ok" if r["ok"] else f"MISMATCH {r['detail'][:120]}"
    return (
        f"{r['kernel']:<16} {r['shape']:<52} {r['us']:>10.1f} {r['torch_us']:>10.1f} {r['gbs']:>8.1f} {pct:>6}  {flag}"
    )
