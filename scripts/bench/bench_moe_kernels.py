"""Fused MoE kernels (issue 16) on one GPU at Kimi K2.6 / DeepSeek-V3 TP-8 shapes.

    python -m scripts.bench.bench_moe_kernels --moe [--out runs/bench_moe.json]   # a few minutes on one H200
    python -m scripts.bench.bench_moe_kernels --moe --autotune                      # + sweep tiles, write the table
    python -m scripts.bench.bench_moe_kernels --moe --dry-run --out /tmp/x.json     # CPU: tiny shapes, interpreted
    python -m scripts.bench.bench_moe_kernels --moe --compile-only [--arch 90]      # no GPU: build for sm_90, report
                                                                               # registers / spills / shared memory

Shapes (TP 8 shards the intermediate size, every expert is local): Kimi K2.6 E = 384 experts, top-8,
d = 7168, I = 2048 / 8 = 256, INT4 group 32; DeepSeek-V3 E = 256, top-8, same d and I, FP8 blocks
128 x 128; both also with bf16 weights. M = 1 .. 256 tokens, routed uniformly at random.

Per point: fused_moe's time (a CUDA graph of several calls with different routings, so that weights come
from HBM, not L2; median of triton's do_bench), the same call eager (Python and launch overhead
included), the per-expert torch loop over bf16 copies of the weights (the models' path without a fused
kernel), the bytes of weights the call must read (gate + up + down of each expert with a pair, scales
included), achieved GB/s and % of the device's peak (by name, or --peak-gbps), and the cosine difference
from the loop's output (fp8 also quantizes activations, so a larger one is expected there).

--autotune sweeps block_m x (block_n, block_k, warps, stages) per GEMM at M in TUNE_M (gate_up with the
default down, then down with the best gate_up), keeps the fastest block_m for the sum and writes
kernels/moe/tables/<device>.json (or --table), which fused_moe reads from then on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import torch

from ddtree.tools.selftest.kernels.moe_bench import (
    MODELS,
    TILES,
    TINY,
    Plan,
    bench_model,
    make_calls,
    peak_for,
    projections,
    time_fused,
    timer,
)

M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TUNE_M = (1, 4, 16, 64, 256)


def tune_point(kind: str, dims: dict, ws, M: int, device, measure, gen, plan, log: list) -> tuple:
    """(gate_up config, down config) fastest at M: per block_m, gate_up over the tiles with the default
    down, then down with that gate_up; the block_m with the fastest pair wins."""
    from ddtree.kernels.moe.configs import MoeTileConfig, default_config

    E, k, d, inter = dims["E"], dims["topk"], dims["d"], dims["I"]
    calls = make_calls(M, dims, device, gen, plan.repeats)

    def run(gu, dn) -> float:
        try:
            return time_fused(ws, calls, (gu, dn), device, measure)
        except Exception as e:  # e.g. out of shared memory for this tile
            log.append(dict(kind=kind, M=M, gate_up=dataclasses.asdict(gu), down=dataclasses.asdict(dn),
                            error=repr(e)[:200]))  # fmt: skip
            return float("inf")

    best = None
    for bm in [b for b in (16, 32, 64) if b == 16 or M * k / E >= b / 8]:
        dn0 = dataclasses.replace(default_config(kind, "down", E, d, inter, M, k), block_m=bm)
        cands = sorted({MoeTileConfig(bm, *t) for t in plan.tiles}, key=str)
        gu = min(cands, key=lambda c: run(c, dn0))
        dn = min(cands, key=lambda c: run(gu, c))  # noqa: B023  (called at once)
        t = run(gu, dn)
        log.append(dict(kind=kind, M=M, block_m=bm, us=t * 1e6, gate_up=dataclasses.asdict(gu),
                        down=dataclasses.asdict(dn)))  # fmt: skip
        print(f"  tune {kind} M={M:>4} block_m {bm}: {t * 1e6:8.1f} µs  gate_up {gu}  down {dn}", flush=True)
        if best is None or t < best[0]:
            best = (t, gu, dn)
    return best[1], best[2]


def autotune(name: str, dims: dict, ms, device, measure, gen, plan: Plan) -> tuple[dict, list[dict]]:
    """{table key: {M: MoeTileConfig}} for both GEMMs of the tuned kinds, and the sweep's log."""
    from ddtree.kernels.moe.configs import table_key

    E, d, inter = dims["E"], dims["d"], dims["I"]
    table, log = {}, []
    for kind in dims["kinds"] if plan.tune_all_kinds else dims["kinds"][:1]:
        ws = projections(kind, dims, device, gen)
        for M in ms:
            gu, dn = tune_point(kind, dims, ws, M, device, measure, gen, plan, log)
            table.setdefault(table_key(kind, "gate_up", E, inter, d), {})[M] = gu
            table.setdefault(table_key(kind, "down", E, d, inter), {})[M] = dn
    return table, log


def compile_report(models: dict, ms, arch: int) -> list[dict]:
    """AOT-compile both GEMMs of each kind at the default configs of the model shapes for CUDA `arch`, with
    the JIT's specialisations (unit K stride, 16-divisible pointers / strides), plus the small kernels:
    compile errors show here, and cuobjdump gives registers, stack bytes (spills) and shared memory."""
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from ddtree.kernels.moe import align as ma
    from ddtree.kernels.moe import fused as fm
    from ddtree.kernels.moe.configs import default_config
    from ddtree.kernels.weight_formats import BF16, FP8_BLOCK, INT4_PACK, weight_format

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    target = GPUTarget("cuda", arch, 32)
    aligned = {"stride_am", "stride_we", "stride_wn", "stride_om", "N", "K", "stride_xm"}
    rows = []

    def build(name, fn, sig, consts, warps=4, stages=3):
        full = {**sig, **{k: "constexpr" for k in consts}}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in full.items()
                 if t.startswith("*") or n in aligned}  # fmt: skip
        k = compile(ASTSource(fn, full, consts, attrs), target=target, options=dict(num_warps=warps, num_stages=stages))
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
        rows.append(dict(kernel=name, arch=arch, num_warps=warps, num_stages=stages, registers=regs,
                         stack_bytes=stack, shared_bytes=k.metadata.shared))  # fmt: skip
        print(f"sm_{arch} {name:>44}: {regs:>3} registers, {stack:>4} stack bytes, {k.metadata.shared:>6} shared",
              flush=True)  # fmt: skip

    i32 = "i32"
    ptr = {  # (x, weight, scale) pointers by format
        BF16: ("*bf16", "*bf16", "*bf16"),
        INT4_PACK: ("*bf16", "*i32", "*bf16"),
        FP8_BLOCK: ("*bf16", "*fp8e4nv", "*fp32"),  # x as stored: the GEMMs quantize it (and h, fp32) to e4m3
    }
    for dims in models.values():
        E, k, d, inter = dims["E"], dims["topk"], dims["d"], dims["I"]
        for kind in dims["kinds"]:
            fmt = weight_format(kind)
            a, w, sc = ptr[fmt]
            for op, N, K in (("gate_up", inter, d), ("down", d, inter)):
                for M in ms:
                    cfg = default_config(kind, op, E, N, K, M, k)
                    bk = min(cfg.block_k, dims["block"][1]) if fmt.block_scaled else cfg.block_k
                    fp32_h = fmt.quantizes_activations  # h is kept fp32 (A of down, OUT of gate_up)
                    sig = dict(A="*fp32" if fp32_h and op == "down" else a, W1=w, S1=sc, W2=w, S2=sc,
                               OUT="*bf16" if op == "gate_up" and not fp32_h else "*fp32", SORTED="*i32",
                               BLOCK_EXPERT="*i32", TOPK_W="*fp32", num_pairs=i32, N=i32, K=i32, stride_am=i32,
                               stride_we=i32, stride_wn=i32, stride_se=i32, stride_sn=i32, stride_sk=i32,
                               stride_om=i32)  # fmt: skip
                    # PAIRED: INT4 words in the device path's pair order (kernels/quant_formats.py)
                    consts = dict(stride_wk=1, ROW_DIV=k if op == "gate_up" else 1, GATE_UP=op == "gate_up",
                                  KIND=fmt.kernel_id, GROUP=dims["group"], SCALE_BN=dims["block"][0],
                                  SCALE_BK=dims["block"][1], DOT=tl.bfloat16, PRECISION="tf32", BLOCK_M=cfg.block_m,
                                  BLOCK_N=cfg.block_n, BLOCK_K=bk, EVEN_K=K % bk == 0,
                                  PAIRED=fmt is INT4_PACK)  # fmt: skip
                    name = f"{kind} {op} E{E} M{M} {cfg.block_m}x{cfg.block_n}x{bk}"
                    build(name, fm._moe_gemm_kernel, sig, consts, cfg.num_warps, cfg.num_stages)
        be = triton.next_power_of_2(E)
        build(f"align count E{E}", ma._count_kernel, dict(IDS="*i32", EXPERT_MAP="*i32", LOCAL="*i32", COUNTS="*i32",
              num_pairs=i32, num_global=i32), dict(E=E, HAS_MAP=True, CHUNK=256, SUB=ma._sub_chunk(be),
              BLOCK_E=be))  # fmt: skip
        build(f"align offsets E{E}", ma._offsets_kernel, dict(COUNTS="*i32", BASE="*i32", BLOCK_END="*i32",
              NUM_PADDED="*i32", SORTED="*i32", num_chunks=i32, num_pairs=i32), dict(E=E, BLOCK_M=16, BLOCK_E=be,
              BLOCK_C=max(1, min(16, 4096 // be)), PAD_TILE=min(16, max(1, 4096 // be))), warps=8)  # fmt: skip
        build(f"align scatter E{E}", ma._scatter_kernel, dict(LOCAL="*i32", BASE="*i32", BLOCK_END="*i32",
              SORTED="*i32", BLOCK_EXPERT="*i32", num_pairs=i32, num_chunks=i32, num_blocks=i32),
              dict(E=E, BLOCK_M=16, CHUNK=256, SUB=ma._sub_chunk(be), BLOCK_E=be, BLOCK_B=max(1, 4096 // be)))  # fmt: skip
    build("top-k sum", fm._moe_sum_kernel, dict(Y="*fp32", LOCAL="*i32", OUT="*bf16", M=i32, N=i32, stride_om=i32),
          dict(TOPK=8, BLOCK_T=16, BLOCK_N=256, ROUND_BF16=True))  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", action="store_true", help="benchmark the fused MoE kernels (the only suite here)")
    p.add_argument("--autotune", action="store_true", help="sweep tiles and write the config table")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_moe.json"))
    p.add_argument("--table", type=pathlib.Path, default=None, help="table path (default kernels/moe/tables/<dev>)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--m", default="", help="comma-separated token counts (default 1 .. 256)")
    p.add_argument("--peak-gbps", type=float, default=0.0, help="device peak bandwidth, GB/s (default: by name)")
    p.add_argument("--tune-all-kinds", action="store_true", help="--autotune bf16 too, not only int4 / fp8")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU under TRITON_INTERPRET=1")
    p.add_argument("--compile-only", action="store_true", help="compile for --arch and report; needs no GPU")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only (90 = H100/H200)")
    args = p.parse_args(argv)
    if not args.moe:
        p.error("choose a suite: --moe")
    if args.compile_only:
        models = {m: MODELS[m] for m in args.models.split(",") if m}
        rows = compile_report(models, [int(v) for v in args.m.split(",") if v] or [1, 256], args.arch)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(compile=rows), indent=1))
        print(f"saved {args.out}")
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_kernels: the fused MoE benchmark needs a CUDA device (none is visible); on a CPU only "
              "--dry-run runs, interpreted", file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton / the kernels are imported
    device = torch.device("cuda" if cuda and not args.dry_run else "cpu")
    from ddtree.kernels.moe import configs as moe_configs

    models = TINY if args.dry_run else {m: MODELS[m] for m in args.models.split(",") if m}
    ms = [int(v) for v in args.m.split(",") if v] or ([1, 3] if args.dry_run else list(M_LIST))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    peak = args.peak_gbps or (peak_for(name) if device.type == "cuda" else None)
    print(f"device {name}: peak {peak or 0:.0f} GB/s; models {', '.join(models)}; M {ms}", flush=True)
    measure = timer(device)
    plan = Plan(1, tuple(TILES[:2]), args.tune_all_kinds) if args.dry_run else Plan(tune_all_kinds=args.tune_all_kinds)
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    result = dict(device=name, peak_gbps=peak, torch=torch.__version__, triton=_triton_version(), rows=[])
    if args.autotune:
        tune_ms = ms if args.dry_run else [m for m in TUNE_M if not args.m or m in ms] or ms
        tables, logs = {}, []
        for model, dims in models.items():
            table, log = autotune(model, dims, tune_ms, device, measure, gen, plan)
            tables.update(table)
            logs += log
        path = args.table or moe_configs.device_table_path(name)
        moe_configs.save_table(path, tables, name, triton=_triton_version())
        result.update(table=str(path), autotune=logs)
        print(f"wrote {path}", flush=True)
    for model, dims in models.items():
        result["rows"] += bench_model(model, dims, ms, device, measure, peak, gen, plan)
    result["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"saved {args.out} ({result['wall_s']:.0f} s)")
    return 0 if all(r["ok"] for r in result["rows"]) else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
