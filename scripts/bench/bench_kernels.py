"""MLA attention kernels on one GPU at Kimi K2 TP8 shapes, beside torch SDPA (issue 5 item 7).

    python -m scripts.bench.bench_kernels --out runs/bench_kernels.json          # one GPU, under 5 minutes
    python -m scripts.bench.bench_kernels --out runs/bench_kernels.json --sweep  # + a block / split config sweep
    python -m scripts.bench.bench_kernels --dry-run --out /tmp/x.json            # CPU: tiny shapes, TRITON_INTERPRET=1
    python -m scripts.bench.bench_kernels --compile-only [--arch 90]             # no GPU needed: build for sm_90, show
                                                                         # registers / spills / shared memory

Shapes: 8 local heads, latent 512 + rope 64, bf16 (Kimi K2 / DeepSeek-V3 MLA at TP 8, absorbed form);
committed prefix 128 .. 32k tokens; decode (1 query per sequence) and tree verify with 16 and 64 nodes
(17 / 65 queries: root + nodes, random trees); batch 1 and 8 (every sequence the same prefix length).
The cache is page_size 1 with the sequences' slots scattered at random, as the pool leaves them.

Per shape: one layer's attention time (the plan is packed once per forward and not timed here; its host
cost is reported separately), the useful bytes it must read (latent rows + q + o; not the split
partials), achieved GB/s and % of the device's peak bandwidth, achieved TFLOP/s, and torch SDPA on the
same shapes (KV pre-gathered into dense tensors, so SDPA's time excludes the gather it would need).
Each output is checked against SDPA's. Then t(8k) / t(128) per (kind, batch), the two targets of issue 5
(tree16 batch 1: t(8k) <= 1.5 t(128); >= 60 % of peak bandwidth at 32k), and the fused latent write
against the torch ops it replaces. Times are medians of triton.testing.do_bench with the L2 flushed
between runs (each layer reads a different cache in a real model).

Roofline note: tree verify with 16 nodes has 136 query rows per latent row read: 136 × 2176 flops per
1152 bytes ≈ 257 flop/B, above an H100/H200's bf16 ridge (~300 / ~206 flop/B), so it is compute-bound
at every prefix length and its % of bandwidth is capped below 100 % by the tensor cores; decode
(8 rows, ~15 flop/B) is the bandwidth case.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time

import torch

from ddtree.tools.selftest.kernels.mla_bench import (
    KIMI,
    TINY,
    peak_bandwidth_gbs,
    random_tree_mask,
    run_sdpa,
    sdpa_inputs,
    timer,
)

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "B200": 2250.0}  # dense, by device-name substring  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # decode | tree16 | tree64
    batch: int
    prefix: int

    @property
    def q_len(self) -> int:
        return 1 if self.kind == "decode" else int(self.kind.removeprefix("tree")) + 1


def build(shape: Shape, dims: dict, device: torch.device, seed: int = 0):
    from ddtree.kernels.mla.plan import MLASeq

    gen = torch.Generator().manual_seed(seed)
    H, r, dr, dtype = dims["heads"], dims["r"], dims["dr"], getattr(torch, dims["dtype"])
    B, P, q = shape.batch, shape.prefix, shape.q_len
    S = B * (P + q) + 64
    slots = torch.randperm(S, generator=gen)
    seqs, masks = [], []
    for b in range(B):
        own = slots[b * (P + q) : (b + 1) * (P + q)]
        mask = None if shape.kind == "decode" else random_tree_mask(q - 1, gen)
        seqs.append(MLASeq(q, P, own[:P], own[P:], mask))
        masks.append(torch.ones(q, q, dtype=torch.bool).tril() if mask is None else mask)
    kv = torch.randn(S, r + dr, generator=gen).to(device, dtype)
    q_lat = torch.randn(B * q, H, r, generator=gen).to(device, dtype)
    q_pe = torch.randn(B * q, H, dr, generator=gen).to(device, dtype)
    return q_lat, q_pe, kv, seqs, masks


def copy_bandwidth_gbs(device: torch.device, measure) -> float | None:
    """Achievable device bandwidth: a 1 GiB device-to-device copy (read + write)."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / measure(lambda: dst.copy_(src)) / 1e9


def bench_shape(shape: Shape, dims: dict, device, measure, config, peak_gbs, time_sdpa: bool = True) -> dict:
    from ddtree.kernels.mla.attention import mla_attention
    from ddtree.kernels.mla.plan import plan_mla

    q_lat, q_pe, kv, seqs, masks = build(shape, dims, device)
    H, r, dr = dims["heads"], dims["r"], dims["dr"]
    scale = 1.0 / math.sqrt(192)  # qk_nope 128 + rope 64 (docs/design.md §5: not 576^-0.5)
    t0 = time.perf_counter()
    plan = plan_mla(seqs, H, num_cache_slots=kv.shape[0], device=device, config=config)
    plan_s = time.perf_counter() - t0
    t_triton = measure(lambda: mla_attention(q_lat, q_pe, kv, plan, scale))
    out = mla_attention(q_lat, q_pe, kv, plan, scale)

    qq, k, v, mask = sdpa_inputs(q_lat, q_pe, kv, seqs, masks, r)
    t_sdpa = measure(lambda: run_sdpa(qq, k, v, mask, scale)) if time_sdpa else float("nan")
    ref = run_sdpa(qq, k, v, mask, scale).transpose(1, 2).reshape(out.shape)
    err = (out.float() - ref.float()).abs().max().item()
    rel = err / max(ref.float().abs().max().item(), 1e-30)

    B, q, P = shape.batch, shape.q_len, shape.prefix
    elt = kv.element_size()
    useful = B * (P + q) * (r + dr) * elt + B * q * H * (r + dr) * elt + B * q * H * r * elt
    flops = B * q * H * (P + q) * 2 * (r + dr + r)
    block_r = max(16, 1 << (r - 1).bit_length())
    partials = 2 * plan.num_items * plan.block_m * block_r * 4 if plan.num_merge_tiles else 0  # written + read
    row = dict(kind=shape.kind, batch=B, prefix=P, q_len=q, triton_us=t_triton * 1e6, sdpa_us=t_sdpa * 1e6,
               plan_host_us=plan_s * 1e6, items=plan.num_items, tiles=plan.num_tiles, split_len=plan.split_len,
               block_m=plan.block_m, bytes=useful, partial_bytes=partials, gbs=useful / t_triton / 1e9, tflops=flops / t_triton / 1e12,
               max_abs_err_vs_sdpa=err, rel_err_vs_sdpa=rel, ok=rel < 3e-2)  # fmt: skip
    row["pct_peak_bw"] = 100 * row["gbs"] / peak_gbs if peak_gbs else None
    return row


def bench_latent_write(tokens: list[int], dims: dict, device, measure) -> list[dict]:
    from ddtree.kernels.mla.latent_write import write_latent
    from ddtree.kernels.reference import write_latent_ref

    r, dr, dtype = dims["r"], dims["dr"], getattr(torch, dims["dtype"])
    rows = []
    for T in tokens:
        S = 4 * T
        kv = torch.zeros(S, r + dr, dtype=dtype, device=device)
        latent = torch.randn(T, r + dr, device=device).to(dtype)
        slots = torch.randperm(S, device=device)[:T]
        pos = torch.randint(0, 32768, (T,), device=device)
        w = torch.ones(r, dtype=dtype, device=device)
        inv = 1.0 / 10000.0 ** (torch.arange(0, dr, 2, dtype=torch.float32, device=device) / dr)
        t_fused = measure(functools.partial(write_latent, kv, latent, slots, pos, w, 1e-6, inv, check_slots=False))
        t_torch = measure(functools.partial(write_latent_ref, kv, latent, slots, pos, w, 1e-6, inv))
        rows.append(dict(tokens=T, fused_us=t_fused * 1e6, torch_us=t_torch * 1e6, speedup=t_torch / t_fused))
    return rows


def print_table(rows: list[dict], peak_gbs) -> None:
    print(f"{'kind':>7} {'B':>2} {'prefix':>6} {'triton µs':>10} {'sdpa µs':>10} {'GB/s':>8} "
          f"{'%peak':>6} {'TFLOP/s':>8} {'items':>6} {'err':>8}")  # fmt: skip
    for x in rows:
        pct = f"{x['pct_peak_bw']:.0f}" if x["pct_peak_bw"] is not None else "-"
        print(f"{x['kind']:>7} {x['batch']:>2} {x['prefix']:>6} {x['triton_us']:>10.1f} {x['sdpa_us']:>10.1f} "
              f"{x['gbs']:>8.1f} {pct:>6} {x['tflops']:>8.1f} {x['items']:>6} "
              f"{x['rel_err_vs_sdpa']:>8.1e}{'' if x['ok'] else '  MISMATCH'}")  # fmt: skip


def summarise(rows: list[dict], short: int, long_: int, longest: int, peak_gbs) -> dict:
    by = {(x["kind"], x["batch"], x["prefix"]): x for x in rows}
    ratios = {}
    for kind, batch in sorted({(x["kind"], x["batch"]) for x in rows}):
        if (kind, batch, short) in by and (kind, batch, long_) in by:
            ratios[f"{kind}_b{batch}"] = by[kind, batch, long_]["triton_us"] / by[kind, batch, short]["triton_us"]
    flat = ratios.get("tree16_b1")
    bw = {f"{k}_b{b}": by[k, b, longest]["pct_peak_bw"] for k, b in (("decode", 1), ("decode", 8), ("tree16", 1))
          if (k, b, longest) in by}  # fmt: skip
    targets = {
        f"tree16_b1 t({long_})/t({short}) <= 1.5": dict(value=flat, met=None if flat is None else flat <= 1.5),
        f"decode_b1 % peak bandwidth at {longest} >= 60": dict(
            value=bw.get("decode_b1"), met=None if bw.get("decode_b1") is None else bw["decode_b1"] >= 60),
    }  # fmt: skip
    return dict(ratio_long_over_short=ratios, pct_peak_bw_longest=bw, targets=targets)


def sweep(dims, device, measure, peak_gbs, prefixes) -> list[dict]:
    from ddtree.kernels.mla.plan import MLAKernelConfig

    mid = 8192 if 8192 in prefixes else prefixes[len(prefixes) // 2]
    shapes = [Shape("tree16", 1, prefixes[0]), Shape("tree16", 1, mid), Shape("tree16", 1, prefixes[-1]),
              Shape("decode", 1, prefixes[-1])]  # fmt: skip
    out = []
    for bm in (16, 32, 64):
        for warps in (4, 8):
            for min_split in (128, 256, 512):
                cfg = MLAKernelConfig(block_m=bm, num_warps=warps, min_split=min_split)
                try:
                    rows = [bench_shape(s, dims, device, measure, cfg, peak_gbs, time_sdpa=False) for s in shapes]
                    times = {f"{s.kind}_b{s.batch}_{s.prefix}": x["triton_us"] for s, x in zip(shapes, rows)}
                    times["all_ok"] = all(x["ok"] for x in rows)
                except Exception as e:  # e.g. out of shared memory / registers for this block size
                    times = {"error": repr(e)[:200]}
                out.append(dict(config=dataclasses.asdict(cfg), us=times))
                print(f"  block_m {bm:>2} warps {warps} min_split {min_split:>3}: {times}", flush=True)
    return out


def compile_report(arch: int) -> list[dict]:
    """AOT-compile the kernels at the Kimi shapes for CUDA `arch` (no GPU needed): compile errors surface
    here, and cuobjdump gives registers, stack bytes (spills) and shared memory per kernel variant."""
    from ddtree.kernels.mla.latent_write import _latent_write_kernel
    from ddtree.kernels.mla.merge import CHUNK, MERGE_V, _mla_merge_kernel
    from ddtree.kernels.mla.plan import SEQ_FIELDS, MLAKernelConfig
    from ddtree.kernels.mla.split import _mla_split_kernel
    from scripts.bench.compile_launches import build

    cfg = MLAKernelConfig()
    H, r, dr = KIMI["heads"], KIMI["r"], KIMI["dr"]
    i32, ptr = "i32", "*bf16"
    split_sig = dict(Q_LAT=ptr, Q_PE=ptr, KV=ptr, SEQS="*i32", TILES="*i32", ITEMS="*i32", TABLE="*i32",
                     NEW_SLOTS="*i32", MASK_BITS="*i32", PART_O="*fp32", PART_LSE="*fp32", OUT=ptr,
                     stride_lt=i32, stride_lh=i32, stride_pt=i32, stride_ph=i32, stride_kv=i32, stride_ot=i32,
                     stride_oh=i32, scale_log2="fp32")  # fmt: skip
    merge_sig = dict(SEQS="*i32", TILES="*i32", MERGE_TILES="*i32", PART_O="*fp32", PART_LSE="*fp32", OUT=ptr,
                     stride_ot=i32, stride_oh=i32)  # fmt: skip
    write_sig = dict(LATENT=ptr, KV=ptr, SLOTS="*i64", POS="*i64", WEIGHT=ptr, INV_FREQ="*fp32", stride_lat=i32,
                     stride_kv=i32, eps="fp32", attention_factor="fp32")  # fmt: skip
    variants = [(f"split block_m {bm} page {ps}", _mla_split_kernel, split_sig,
                 dict(NUM_HEADS=H, R=r, DR=dr, BLOCK_R=r, BLOCK_DR=dr, BLOCK_M=bm, BLOCK_N=cfg.block_n,
                      PAGE_SIZE=ps, DOT_PRECISION="tf32", BF16_VIA_FP32=False, SEQ_W=SEQ_FIELDS), cfg.num_warps,
                 cfg.num_stages)
                for bm in (16, cfg.block_m) for ps in (1, 16)]  # fmt: skip
    variants.append(
        (
            "merge",
            _mla_merge_kernel,
            merge_sig,
            dict(NUM_HEADS=H, R=r, BLOCK_R=r, BLOCK_M=cfg.block_m, MERGE_V=MERGE_V, CHUNK=CHUNK, SEQ_W=SEQ_FIELDS),
            4,
            1,
        )
    )
    variants.append(
        (
            "latent_write",
            _latent_write_kernel,
            write_sig,
            dict(R=r, DR=dr, BLOCK_R=r, HALF_DR=dr // 2, IS_BF16=True),
            4,
            1,
        )
    )
    rows = []
    for name, fn, sig, consts, warps, stages in variants:
        usage = build(fn, {**sig, **{k: "constexpr" for k in consts}}, consts, arch, warps, stages)
        rows.append(dict(kernel=name, arch=arch, num_warps=warps, **usage))
        print(f"sm_{arch} {name:>24}: {usage['registers']} registers, {usage['stack_bytes']} stack bytes, "
              f"{usage['shared_bytes']} shared", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_kernels.json"))
    p.add_argument("--dry-run", action="store_true", help="tiny fp32 shapes; on a CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true", help="also time a grid of block / split configs")
    p.add_argument("--prefixes", default="", help="comma-separated prefix lengths (default 128 .. 32768)")
    p.add_argument("--peak-gbs", type=float, default=0.0, help="device peak bandwidth, GB/s (default: from the device)")
    p.add_argument("--compile-only", action="store_true", help="compile for --arch and report; needs no GPU")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only (90 = H100/H200)")
    args = p.parse_args(argv)
    if args.compile_only:
        rows = compile_report(args.arch)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(compile=rows), indent=1))
        return 0

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.dry_run:
            p.error("no CUDA device: only --dry-run runs on a CPU")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton / the kernels are imported
    device = torch.device("cuda" if cuda else "cpu")
    from ddtree.kernels.mla.plan import MLAKernelConfig

    if args.dry_run:
        dims, kinds, batches = TINY, ("decode", "tree4"), (1, 2)
        prefixes = [16, 64]
        config = MLAKernelConfig(block_m=16, block_n=16, min_split=16)
    else:
        dims, kinds, batches = KIMI, ("decode", "tree16", "tree64"), (1, 8)
        prefixes = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        config = MLAKernelConfig()
    if args.prefixes:
        prefixes = sorted(int(x) for x in args.prefixes.split(","))
    measure = timer(device)
    peak_gbs = args.peak_gbs or peak_bandwidth_gbs(device)
    name = torch.cuda.get_device_name(device) if cuda else "cpu (interpreted)"
    peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    copy_gbs = copy_bandwidth_gbs(device, measure)
    print(f"device {name}: peak {peak_gbs or 0:.0f} GB/s, copy {copy_gbs or 0:.0f} GB/s, "
          f"bf16 peak {peak_tflops or 0:.0f} TFLOP/s; dims {dims}; config {config}", flush=True)  # fmt: skip

    t_start = time.perf_counter()
    rows = []
    for kind in kinds:
        for batch in batches:
            for prefix in prefixes:
                rows.append(bench_shape(Shape(kind, batch, prefix), dims, device, measure, config, peak_gbs))
    print_table(rows, peak_gbs)
    summary = summarise(rows, prefixes[0], 8192 if 8192 in prefixes else prefixes[-1], prefixes[-1], peak_gbs)
    print(json.dumps(summary, indent=1))
    tokens = [b * Shape(k, b, 0).q_len for k in kinds for b in batches]
    latent = bench_latent_write(sorted(set(tokens)), dims, device, measure)
    for x in latent:
        print(f"latent write T={x['tokens']:>4}: fused {x['fused_us']:.1f} µs, torch ops {x['torch_us']:.1f} µs "
              f"({x['speedup']:.1f}x)")  # fmt: skip
    result = dict(device=name, peak_gbs=peak_gbs, copy_gbs=copy_gbs, peak_bf16_tflops=peak_tflops, dims=dims,
                  config=dataclasses.asdict(config), torch=torch.__version__, triton=_triton_version(),
                  rows=rows, summary=summary, latent_write=latent)  # fmt: skip
    if args.sweep:
        result["sweep"] = sweep(dims, device, measure, peak_gbs, prefixes)
    result["wall_s"] = time.perf_counter() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"saved {args.out} ({result['wall_s']:.0f} s)")
    return 0 if all(x["ok"] for x in rows) else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
