"""Every Triton kernel's configs against the shared memory of the GPUs it is deployed on, on the CPU.

Budgets: kernels/shared_memory.py's, per block: sm_90 (H100 / H200) and sm_100 227 KiB, sm_120 (RTX PRO 6000
Blackwell) 99 KiB. For each kernel with a tl.dot (the fused MoE's grouped GEMM, the MLA split kernel, the INT4
and FP8 GEMMs, the router's logits) the config it launches with on a device of that budget (its default
fitted to the budget, or a tuned table's entry) fits by the estimate (shared_memory.py's formula, over a
grid of shapes); and, compiled ahead of time for sm_90 and sm_120 as Triton allocates it (`metadata.shared`
of the compiled kernel, no GPU needed), each kernel at the Kimi shapes fits and the estimate is not below
it. The kernels without a dot (MLA merge, latent write, RMSNorm, SiLU-and-mul, MoE align) keep no operand
tiles in shared memory.

And the MLA split kernel, like the fused MoE, shrinks at launch when the device answers OutOfResources
(one mechanism, shared_memory.launch_with_fallback): faked here above a limit, the result is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ddtree.kernels.gemm import fp8 as fp8_gemm
from ddtree.kernels.gemm import int4 as int4_gemm
from ddtree.kernels.mla import split as mla_split
from ddtree.kernels.mla.attention import mla_attention
from ddtree.kernels.mla.plan import MLAKernelConfig, MLASeq, mla_smem_bytes, plan_mla, smaller_mla_configs
from ddtree.kernels.moe import configs as moe_configs
from ddtree.kernels.moe import router
from ddtree.kernels.moe.configs import KINDS, M_BUCKETS, OPS, default_config, load_table, smem_bytes
from ddtree.kernels.reference import mla_attention_ref
from ddtree.kernels.shared_memory import SMEM_PER_BLOCK, OutOfResources, fit_config, stages_within
from ddtree.tools.selftest.compare import assert_close
from tests.support.paths import REPO
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

ARCHS = sorted(SMEM_PER_BLOCK)
# (E, hidden, moe_intermediate) of Kimi K2.x and DeepSeek-V3, and a small MoE
MOE_MODELS = {"kimi": (384, 7168, 2048), "deepseek_v3": (256, 7168, 2048), "small": (64, 2048, 1408)}
TABLE_ARCHS = {r"H100|H200|H800|GH200": "sm_90", r"B200|B300|GB200": "sm_100", r"RTX PRO 6000|RTX 50": "sm_120"}


def _moe_shapes():
    for E, d, inter in MOE_MODELS.values():
        for tp in (1, 2, 4, 8):
            yield E, d, inter // tp


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_moe_default_configs_fit(arch):
    budget = SMEM_PER_BLOCK[arch]
    checked = 0
    for E, d, inter in _moe_shapes():
        for kind in KINDS:
            for op, (N, K) in zip(OPS, ((inter, d), (d, inter))):
                for M in M_BUCKETS:
                    for a_bytes in (2, 4):
                        c = default_config(kind, op, E, N, K, M, 8, a_bytes, smem_budget=budget)
                        assert smem_bytes(c, kind, op, a_bytes) <= budget, (arch, kind, op, E, N, K, M, a_bytes, c)
                        checked += 1
    assert checked > 1000


def test_fused_moe_fitting_changes_only_what_does_not_fit():
    """On sm_90 the heuristic's bf16 configs already fit (unchanged); on sm_120 the largest ones shrink, in
    smaller_configs' order (stages first)."""
    shape = ("int4", "gate_up", 64, 2048, 7168, 1024, 8)
    big = default_config(*shape)
    assert default_config(*shape, smem_budget=SMEM_PER_BLOCK["sm_90"]) == big
    small = default_config(*shape, smem_budget=SMEM_PER_BLOCK["sm_120"])
    assert smem_bytes(big, "int4", "gate_up") > SMEM_PER_BLOCK["sm_120"] >= smem_bytes(small, "int4", "gate_up")
    assert small in list(moe_configs.smaller_configs(big)) and small.block_m == big.block_m


def test_fused_moe_tables_fit_their_device():
    """A tuned table (kernels/moe_configs/<device>.json) was tuned on its device: each entry fits that
    device's architecture, named by the table's device."""
    for path in sorted(moe_configs.TABLE_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        if "device_class" in raw:  # moe_tiles' committed table of a device class (sm_90.json, sm_120.json)
            for key, entry in raw["tiles"].items():
                kind, op = key.split("/")[:2]
                c = moe_configs.MoeTileConfig(**entry["config"])
                assert smem_bytes(c, kind, op) <= SMEM_PER_BLOCK[raw["device_class"]], (path.name, key, c)
            continue
        device = raw["device"]
        arch = next((a for pattern, a in TABLE_ARCHS.items() if re.search(pattern, device)), None)
        assert arch, f"{path.name}: device {device!r} has no known shared memory budget (add it to TABLE_ARCHS)"
        for key, by_m in load_table(path).items():
            kind, op = key.split("/")[:2]
            for m, c in by_m.items():
                assert smem_bytes(c, kind, op) <= SMEM_PER_BLOCK[arch], (path.name, key, m, c)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_bytes", [2, 4])
def test_mla_split_default_config_fits(arch, kv_bytes):
    """Kimi / DeepSeek latent widths (r 512, dr 64): the default fitted to the budget as mla_split launches
    it, at every block_m a plan can give (capped by the rows of the largest sequence). A bf16 / fp16 cache
    fits everywhere; an fp32 one on sm_120 needs MLAKernelConfig(block_m=16) (block_m is the plan's)."""
    budget = SMEM_PER_BLOCK[arch]
    default = MLAKernelConfig()
    block_ms = (16,) if kv_bytes == 4 and arch == "sm_120" else (16, default.block_m)
    for block_m in block_ms:
        fitted = fit_config(default, smaller_mla_configs, _mla_size(block_m, kv_bytes), budget)
        assert _mla_size(block_m, kv_bytes)(fitted) <= budget, (arch, block_m, fitted)
        assert fitted.block_m == default.block_m


def _mla_size(block_m: int, kv_bytes: int):
    return lambda c: mla_smem_bytes(c, block_m, 512, 64, kv_bytes)


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_gemm_and_router_launch_configs_fit(arch):
    budget = SMEM_PER_BLOCK[arch]
    for M in (1, 7, 16, 64, 300, 4096):
        for N in (64, 576, 7168, 18432):
            for group, per_channel in ((32, False), (128, False), (7168, True), (24, False)):
                for x_bytes in (2, 4):
                    bm, bn, bk, _, s = int4_gemm.launch_tiles(M, N, group, per_channel, x_bytes, budget)
                    assert int4_gemm.smem_bytes(bm, bn, bk, x_bytes, s) <= budget, (arch, M, N, group, x_bytes)
            bm, bn = fp8_gemm._gemm_tiles(M, N)
            for x_bytes in (2, 4):  # the activation tile as loaded (bf16 / fp16, fp32), quantized in the kernel
                smem = functools.partial(fp8_gemm.smem_bytes, bm, bn, 128, x_bytes)
                assert smem(stages_within(budget, smem)) <= budget, (arch, M, N, x_bytes)
    smem = functools.partial(router.smem_bytes, router.BLOCK_M, router.BLOCK_E, 2, 4)  # one tile, any rows and E
    assert smem(stages_within(budget, smem)) <= budget, arch


def test_mla_split_shrinks_on_out_of_resources(monkeypatch):
    """A split kernel whose launches raise OutOfResources above a limit: the launch steps down (stages, then
    block_n), the output equals the reference, and the next call starts from the config that launched."""
    monkeypatch.setattr(mla_split, "_FITTED", {})
    kernel, seen = mla_split._mla_split_kernel, []
    real_run = kernel.run
    cfg = MLAKernelConfig(block_m=16, block_n=64, num_stages=2, min_split=32, target_programs=16)
    limit = mla_smem_bytes(dataclasses.replace(cfg, block_n=16, num_stages=1), 16, 64, 16, 4)

    def run(*args, **kw):
        c = dataclasses.replace(cfg, block_n=kw["BLOCK_N"], num_warps=kw["num_warps"], num_stages=kw["num_stages"])
        seen.append(c)
        need = mla_smem_bytes(c, kw["BLOCK_M"], kw["BLOCK_R"], kw["BLOCK_DR"], 4)
        if need > limit:
            raise OutOfResources(need, limit, "shared memory")
        return real_run(*args, **kw)

    monkeypatch.setattr(kernel, "run", run)
    gen = torch.Generator().manual_seed(0)
    H, r, dr, S = 4, 64, 16, 400
    kv = torch.randn(S, r + dr, generator=gen)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    seqs = [MLASeq(5, 300, torch.arange(300), torch.arange(300, 305), mask), MLASeq(1, 40, torch.arange(340, 380),
            torch.tensor([390]))]  # fmt: skip
    q_lat, q_pe = torch.randn(6, H, r, generator=gen), torch.randn(6, H, dr, generator=gen)
    plan = plan_mla(seqs, H, num_cache_slots=S, device=DEVICE, config=cfg)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    got = mla_attention(on(q_lat), on(q_pe), on(kv), plan, 0.2).cpu()
    assert seen == [cfg, *smaller_mla_configs(cfg)][: len(seen)] and seen[-1].block_n == 16
    assert_close("mla fallback", got, mla_attention_ref(q_lat, q_pe, kv, seqs, 0.2))
    fitted = seen[-1]
    seen.clear()
    assert torch.equal(mla_attention(on(q_lat), on(q_pe), on(kv), plan, 0.2).cpu(), got)
    assert seen == [fitted]


# ---- compiled ahead of time: Triton's own allocation (a subprocess: here the kernels are interpreted) ----


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 120])
def test_compiled_kernels_fit_and_the_estimate_bounds_them(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "tests.support.aot_shared_memory", str(arch)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    budget = SMEM_PER_BLOCK[f"sm_{arch}"]
    assert len(rows) == 2 + 18 + 4 + 2 and {r["kernel"].split()[0] for r in rows} == {
        "mla",
        "fused",
        "int4",
        "fp8",
        "router",
    }
    for r in rows:
        assert r["shared"] <= budget, f"sm_{arch} {r['kernel']}: {r['shared']} B of shared memory > {budget}"
        assert r["shared"] <= r["estimate"], f"sm_{arch} {r['kernel']}: the estimate {r['estimate']} < {r['shared']}"
