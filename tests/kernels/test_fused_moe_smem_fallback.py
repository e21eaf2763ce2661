"""The fused MoE tile fallback (kernels/moe/fused.py launch_with_fallback, moe/configs.py smaller_configs) and
default_config's cap on fp32 tiles, on the CPU.

On an H200 an fp32 model with INT4 experts and a 1024-token prefill chunk got default_config's 64x128x128
tiles with 4 stages, which need 278528 bytes of shared memory (the limit: 232448), and the first launch
raised OutOfResources. Here launches are faked (or the interpreted kernel is wrapped) to raise the real
OutOfResources above a shared memory estimate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401  (before kernels are imported)

# isort: split
from ddtree.kernels.moe import configs as mc
from ddtree.kernels.moe import fused as fm
from ddtree.kernels.moe.configs import MoeTileConfig, default_config, smaller_configs
from ddtree.kernels.moe.reference import fused_moe_reference
from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.quant_formats import quantize_int4_group
from ddtree.tools.selftest.compare import assert_close

OutOfResources = fm.OutOfResources
CRASH = ("int4", "gate_up", 64, 2048, 7168, 1024, 8)  # kind, op, E, N = I, K = d, M, topk of the H200 crash


def _estimate(c: MoeTileConfig, a_bytes: int = 4) -> int:
    """default_config's shared memory estimate: the A and W tiles of every stage."""
    return c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * a_bytes


def _fake_launch(limit: int, calls: list):
    def launch(c: MoeTileConfig) -> None:
        calls.append(c)
        if _estimate(c) > limit:
            raise OutOfResources(_estimate(c), limit, "shared memory")

    return launch


def test_smaller_configs_order():
    """Stages down to 1, then block_k halved to 16, then block_n halved to 16; block_m and warps kept."""
    got = [(c.block_n, c.block_k, c.num_stages) for c in smaller_configs(MoeTileConfig(64, 128, 128, 8, 4))]
    assert got == [(128, 128, 3), (128, 128, 2), (128, 128, 1), (128, 64, 1), (128, 32, 1), (128, 16, 1),
                   (64, 16, 1), (32, 16, 1), (16, 16, 1)]  # fmt: skip
    assert list(smaller_configs(MoeTileConfig(16, 16, 16, 4, 1))) == []
    small = [(c.block_n, c.block_k) for c in smaller_configs(MoeTileConfig(32, 32, 32, 4, 1))]
    assert small == [(32, 16), (16, 16)]


@pytest.mark.parametrize("block_m", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("block_n,block_k,stages", [(256, 256, 8), (64, 32, 3), (16, 128, 2), (128, 16, 1)])
def test_smaller_configs_invariants(block_m, block_n, block_k, stages):
    """Each step shrinks one field; block_m never changes (the alignment is built with it), nothing goes
    below 16, and a block_k dividing an fp8 scale block still divides it."""
    cfg = MoeTileConfig(block_m, block_n, block_k, 8, stages)
    prev = cfg
    for c in smaller_configs(cfg):
        assert c.block_m == block_m and c.num_warps == 8
        assert c.block_n >= 16 and c.block_k >= 16 and c.num_stages >= 1
        changed = [f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(prev, f.name)]
        assert len(changed) == 1 and getattr(c, changed[0]) < getattr(prev, changed[0]), (prev, c)
        assert block_k % c.block_k == 0  # so it divides any fp8 scale block the first one divides
        prev = c
    assert (prev.block_n, prev.block_k, prev.num_stages) == (16, 16, 1)


def test_launch_with_fallback_takes_the_first_config_that_fits_and_remembers_it():
    cfg, cache, calls = MoeTileConfig(64, 128, 128, 8, 4), {}, []
    launch = _fake_launch(100 * 1024, calls)  # 96 KiB a stage: 1 stage fits
    first = fm.launch_with_fallback(launch, cfg, cache, "key")
    assert first == MoeTileConfig(64, 128, 128, 8, 1)
    assert calls == [cfg, *list(smaller_configs(cfg))[:3]] and cache == {"key": first}
    calls.clear()
    assert fm.launch_with_fallback(launch, cfg, cache, "key") == first
    assert calls == [first], "the second call goes straight to the remembered config"
    calls.clear()
    assert fm.launch_with_fallback(launch, cfg, cache, "other key") == first and len(calls) == 4
    assert fm.launch_with_fallback(_fake_launch(10**9, calls), cfg, {}, "key") == cfg  # fits: no fallback


def test_launch_with_fallback_raises_naming_the_configs_tried():
    cfg, cache, calls = MoeTileConfig(64, 32, 32, 4, 2), {}, []
    with pytest.raises(OutOfResources, match="shared memory .*tried 64x32x32 w4 s2, 64x32x32 w4 s1, .*64x16x16 w4 s1"):
        fm.launch_with_fallback(_fake_launch(1024, calls), cfg, cache, "key")
    assert calls == [cfg, *smaller_configs(cfg)] and cache == {}


def test_default_config_caps_stages_for_fp32_dots():
    """The crash shape with fp32 activations stays under the 160 KiB estimate; only num_stages changes."""
    bf16, fp32 = default_config(*CRASH), default_config(*CRASH, a_bytes=4)
    assert _estimate(fp32) <= 160 * 1024 < _estimate(bf16, 4)
    assert fp32 == dataclasses.replace(bf16, num_stages=fp32.num_stages)
    assert mc.get_config(*CRASH, None, 4) == fp32
    for kind in mc.KINDS:
        for op in mc.OPS:
            for M in (1, 17, 256, 1024, 4096):
                c = default_config(kind, op, 64, 2048, 7168, M, 8, a_bytes=4)
                assert _estimate(c) <= 160 * 1024, c


@pytest.mark.parametrize("shape,expected", [
    (("bf16", "gate_up", 4, 256, 7168, 1, 8), (16, 16, 64, 4, 3)),
    (("int4", "gate_up", 384, 256, 7168, 1, 8), (16, 16, 128, 4, 3)),
    (("int4", "down", 384, 7168, 256, 1, 8), (16, 64, 128, 4, 3)),
    (("fp8", "gate_up", 256, 256, 7168, 32, 8), (16, 64, 128, 4, 3)),
    (("bf16", "down", 64, 2048, 1408, 96, 6), (16, 64, 64, 4, 3)),
    (("int4", "gate_up", 64, 2048, 7168, 256, 8), (32, 64, 128, 4, 3)),
    (("bf16", "down", 64, 7168, 2048, 256, 8), (32, 64, 64, 4, 3)),
    (CRASH, (64, 128, 128, 8, 4)),
    (("int4", "down", 64, 7168, 2048, 1024, 8), (64, 128, 128, 8, 4)),
    (("bf16", "gate_up", 4, 256, 7168, 4096, 8), (64, 16, 64, 4, 4)),
])  # fmt: skip
def test_default_config_for_16_bit_activations_is_unchanged(shape, expected):
    """The configs default_config gave before it took a_bytes (the default, 2)."""
    assert default_config(*shape) == default_config(*shape, a_bytes=2) == MoeTileConfig(*expected)


def test_fused_moe_falls_back_and_matches_the_reference(monkeypatch):
    """fused_moe (fp32 x, int4 experts) with a kernel whose launches raise OutOfResources above 8 KiB:
    each GEMM steps down to 1 stage, then to block_k 64; the result is right and the next call launches
    the fitted configs only."""
    monkeypatch.setattr(fm, "_FITTED", {})
    kernel, seen, limit = fm._moe_gemm_kernel, [], 8 * 1024
    real_run = kernel.run

    def run(*args, **kw):
        c = MoeTileConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"])
        seen.append((kw["GATE_UP"], c))
        if _estimate(c) > limit:
            raise OutOfResources(_estimate(c), limit, "shared memory")
        return real_run(*args, **kw)

    monkeypatch.setattr(kernel, "run", run)
    E, topk, M, d, inter, group = 16, 2, 17, 44, 20, 16
    gen = torch.Generator().manual_seed(0)

    def weights(N, K):
        w = torch.randn(E, N, K, generator=gen) / K**0.5
        packed = [quantize_int4_group(w[e], group)[:2] for e in range(E)]
        return ExpertWeights("int4", torch.stack([p for p, _ in packed]), N, K,
                             torch.stack([s for _, s in packed]), group_size=group)  # fmt: skip

    gate, up, down = weights(inter, d), weights(inter, d), weights(d, inter)
    x = torch.randn(M, d, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)])
    tw = torch.rand(M, topk, generator=gen) + 0.1
    on = lambda w: dataclasses.replace(w, weight=w.weight.to(DEVICE), scale=w.scale.to(DEVICE))  # noqa: E731
    args = (x.to(DEVICE), on(gate), on(up), on(down), tw.to(DEVICE), ids.to(DEVICE))

    got = fm.fused_moe(*args).cpu()
    start = default_config("int4", "gate_up", E, inter, d, M, topk, a_bytes=4)
    assert (start.block_m, start.block_k, start.num_stages) == (16, 128, 3) and _estimate(start) > limit
    fitted = dataclasses.replace(start, block_k=64, num_stages=1)
    assert [c for gu, c in seen if gu] == [start, *list(smaller_configs(start))[:3]] and seen[3][1] == fitted
    assert sorted(set(fm._FITTED.values()), key=str) == [fitted]  # down's default is the same config here
    assert_close("fallback", got, fused_moe_reference(x, gate, up, down, tw, ids))
    seen.clear()
    assert torch.equal(fm.fused_moe(*args).cpu(), got)
    assert seen == [(True, fitted), (False, fitted)]
    # A config given by the caller (the autotuner's candidates) is launched as is: no silent shrinking.
    seen.clear()
    with pytest.raises(OutOfResources):
        fm.fused_moe(*args, config=start)
    assert seen == [(True, start)]
