"""Shared memory of the Triton kernels as Triton allocates it: each kernel compiled ahead of time for a CUDA
architecture (no GPU needed) at the configs it launches with on that architecture's budget, beside
kernels/shared_memory.py's estimate. Run without TRITON_INTERPRET (interpreted kernels do not compile):

    python -m tests.support.aot_shared_memory 120      # JSON rows: kernel, shared, estimate

tests/deploy/test_kernel_shared_memory.py runs it for sm_90 and sm_120.
"""

from __future__ import annotations

import functools
import json
import sys

import triton.language as tl

from ddtree.kernels.gemm import fp8 as fp8_gemm
from ddtree.kernels.gemm import int4 as int4_gemm
from ddtree.kernels.mla.plan import SEQ_FIELDS, MLAKernelConfig, mla_smem_bytes, smaller_mla_configs
from ddtree.kernels.mla.split import _mla_split_kernel
from ddtree.kernels.moe import fused as fm
from ddtree.kernels.moe import router
from ddtree.kernels.moe.configs import KINDS, default_config, smem_bytes
from ddtree.kernels.shared_memory import SMEM_PER_BLOCK, fit_config, stages_within
from scripts.bench.compile_launches import compile_for

BF16 = "*bf16"


def compiled_smem(kernel, arch: int, pointers: dict, consts: dict, floats=(), num_warps=4, num_stages=3) -> int:
    """metadata.shared of `kernel` compiled for sm_`arch`: pointers by name, constexprs, fp32 `floats`, i32 else;
    with the JIT's specialisation of a launch on real tensors: every pointer and every i32 (the strides and
    sizes of the Kimi shapes) divisible by 16, which is what lets Triton pipeline loads through shared memory."""
    sig = {p.name: "constexpr" if p.name in consts else pointers.get(p.name) or ("fp32" if p.name in floats else "i32")
           for p in kernel.params}  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or t == "i32"}
    return compile_for(kernel, sig, consts, arch, num_warps, num_stages, attrs).metadata.shared


def rows(arch: int) -> list[dict]:
    budget = SMEM_PER_BLOCK[f"sm_{arch}"]
    out = []

    def row(name, shared, estimate):
        out.append(dict(kernel=name, shared=shared, estimate=int(estimate)))

    # MLA split, Kimi latent widths, bf16 cache: the default fitted as mla_split launches it
    for block_m in (16, 32):
        size = functools.partial(_mla_size, block_m)
        c = fit_config(MLAKernelConfig(), smaller_mla_configs, size, budget)
        ptrs = dict(Q_LAT=BF16, Q_PE=BF16, KV=BF16, OUT=BF16, PART_O="*fp32", PART_LSE="*fp32")
        ptrs.update({n: "*i32" for n in ("SEQS", "TILES", "ITEMS", "TABLE", "NEW_SLOTS", "MASK_BITS")})
        consts = dict(NUM_HEADS=8, R=512, DR=64, BLOCK_R=512, BLOCK_DR=64, BLOCK_M=block_m, BLOCK_N=c.block_n,
                      PAGE_SIZE=1, DOT_PRECISION="tf32", BF16_VIA_FP32=False, SEQ_W=SEQ_FIELDS)  # fmt: skip
        shared = compiled_smem(_mla_split_kernel, arch, ptrs, consts, ("scale_log2",), c.num_warps, c.num_stages)
        row(f"mla split block_m {block_m} block_n {c.block_n} s{c.num_stages}", shared, size(c))
    # fused MoE at Kimi's TP-8 shapes (E 384, d 7168, I 256): decode, verify and prefill sizes
    E, d, inter, topk = 384, 7168, 256, 8
    ptr = {"bf16": (BF16,) * 3, "int4": (BF16, "*i32", BF16), "fp8": (BF16, "*fp8e4nv", "*fp32")}
    for kind in KINDS:
        a, w, sc = ptr[kind]
        for op, N, K in (("gate_up", inter, d), ("down", d, inter)):
            for M in (1, 256, 4096):
                c = default_config(kind, op, E, N, K, M, topk, smem_budget=budget)
                h = "*fp32" if kind == "fp8" else BF16  # fp8: h is fp32 (down's A, gate_up's OUT)
                pointers = dict(A=a if op == "gate_up" else h, W1=w, S1=sc, W2=w, S2=sc, OUT=h if op == "gate_up"
                                else "*fp32", SORTED="*i32", BLOCK_EXPERT="*i32", TOPK_W="*fp32")  # fmt: skip
                consts = dict(stride_wk=1, ROW_DIV=topk if op == "gate_up" else 1, GATE_UP=op == "gate_up",
                              KIND=fm._KIND[kind], GROUP=32, SCALE_BN=128, SCALE_BK=128, DOT=tl.bfloat16,
                              PRECISION="tf32", BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                              EVEN_K=K % c.block_k == 0, PAIRED=kind == "int4")  # fmt: skip
                shared = compiled_smem(fm._moe_gemm_kernel, arch, pointers, consts, (), c.num_warps, c.num_stages)
                row(f"fused moe {kind} {op} M{M} {c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages}", shared,
                    smem_bytes(c, kind, op))  # fmt: skip
    # the dense INT4 and FP8 GEMMs and the router at their launch tiles and stages
    for M, N in ((1, 7168), (300, 18432)):
        bm, bn, bk, after, s = int4_gemm.launch_tiles(M, N, 32, False, 2, budget)
        consts = dict(GROUP=32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_AFTER_DOT=after, DOT_PRECISION="tf32",
                      VIA_FP32=False, ROUND_BF16=False)  # fmt: skip
        shared = compiled_smem(int4_gemm._int4_gemm_kernel, arch, dict(X=BF16, W="*i32", S=BF16, Y=BF16), consts,
                               (), 4, s)  # fmt: skip
        row(f"int4 gemm M{M} N{N} s{s}", shared, int4_gemm.smem_bytes(bm, bn, bk, 2, s))
        bm, bn = fp8_gemm._gemm_tiles(M, N)
        s = stages_within(budget, functools.partial(fp8_gemm.smem_bytes, bm, bn, 128, 2))
        pointers = dict(X=BF16, B="*fp8e4nv", BS="*fp32", C=BF16)  # x bf16: quantized in the kernel
        consts = dict(SCALE_N=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, ROUND_E4M3=False, ROUND_BF16=False)
        shared = compiled_smem(fp8_gemm._fp8_gemm_kernel, arch, pointers, consts, ("eps",), 4, s)
        row(f"fp8 gemm M{M} N{N} s{s}", shared, fp8_gemm.smem_bytes(bm, bn, 128, 2, s))
    for n_rows in (1, 4096):
        _, e_blocks, splits = router.router_tiles(n_rows, 384, 7168, 132)
        smem = functools.partial(router.smem_bytes, router.BLOCK_M, router.BLOCK_E, 2, 2)
        s = stages_within(budget, smem)
        pointers = dict(X=BF16, W=BF16, BIAS="*fp32", PARTS="*fp32", SCORES="*fp32", TICKETS="*i32", OUT_W="*fp32",
                        OUT_IDS="*i64")  # fmt: skip
        consts = dict(TOP_K=8, K_PAD=8, N_GROUP=1, G_PAD=1, TOPK_GROUP=1, RENORMALIZE=True, E_BLOCKS=e_blocks,
                      SPLITS=splits, N_SPLITS=-(-7168 // router.K_SPLIT), BLOCK_M=router.BLOCK_M,
                      BLOCK_E=router.BLOCK_E, BLOCK_K=router.ROUTER_BLOCK_K, K_SPLIT=router.K_SPLIT, E_PAD=512)  # fmt: skip
        shared = compiled_smem(router._router_kernel, arch, pointers, consts, ("scaling",), 8, s)  # e_pad 512: 8 warps
        row(f"router rows {n_rows} s{s}", shared, smem(s))
    return out


def _mla_size(block_m: int, c: MLAKernelConfig) -> int:
    return mla_smem_bytes(c, block_m, 512, 64, 2)


if __name__ == "__main__":
    print(json.dumps(rows(int(sys.argv[1]))))
