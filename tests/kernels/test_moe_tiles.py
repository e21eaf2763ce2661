"""The fused MoE's committed tile table (kernels/moe/tiles.py, kernels/moe_configs/sm_*.json): one tile per
device class and weight shape whatever the rows, used by fused_moe; every tile computes the reference's
result (interpreted, ragged shapes, INT4 and FP8) and compiles for its class within the limits; INT4 nibbles
reach the dot's dtype by integer ops (kernels/gemm/int4_dequant.py) with the fp32 path's values; the
instruction counts the table records are the compiled kernel's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.triton_env import DEVICE, INTERPRET, triton_interpret_env  # noqa: F401  (before kernels are imported)

# isort: split
import triton
import triton.language as tl

from ddtree.kernels.gemm.int4_dequant import int4_dequant
from ddtree.kernels.moe import fused as fm
from ddtree.kernels.moe import tiles as moe_tiles
from ddtree.kernels.moe.reference import fused_moe_reference
from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.shared_memory import SMEM_PER_BLOCK
from ddtree.tools.selftest.compare import assert_close
from tests.kernels.test_kernels_fused_moe import Case, _fp8_oracle, _inputs, _on_device
from tests.support import installed_env as env

# The deployments' shapes (Kimi K2.6 INT4 group 32, DeepSeek-V3 FP8 128 x 128 blocks, TP 8: d 7168, I 256)
KIMI = {"int4": dict(group_size=32), "fp8": dict(block=(128, 128))}


def _meta(kind: str, E: int, N: int, K: int) -> ExpertWeights:
    """Expert weights of this format and shape on the meta device (the table is keyed by format and shape)."""
    if kind == "int4":
        w = torch.empty(E, N, -(-K // 8), dtype=torch.int32, device="meta")
        s = torch.empty(E, N, -(-K // 32), dtype=torch.bfloat16, device="meta")
    else:
        w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="meta")
        s = torch.empty(E, -(-N // 128), -(-K // 128), dtype=torch.float32, device="meta")
    return ExpertWeights(kind, w, N, K, s, **KIMI[kind])


@pytest.mark.parametrize("cls", moe_tiles.CLASSES)
def test_each_class_has_one_tile_per_shape_whatever_the_rows(cls):
    table = moe_tiles.load(cls)
    raw = json.loads(moe_tiles.table_path(cls).read_text())
    assert raw["device_class"] == cls and raw["model"]["block_m"] == 16
    for kind in ("int4", "fp8"):
        E = 384 if kind == "int4" else 256
        gate, down = _meta(kind, E, 256, 7168), _meta(kind, E, 7168, 256)
        gu, dn = moe_tiles.table_configs(cls, gate, down)
        assert (gu, dn) == (table[f"{kind}/gate_up/N256/K7168/{_q(kind)}"], table[f"{kind}/down/N7168/K256/{_q(kind)}"])
        assert gu.block_m == dn.block_m == 16  # one padding unit for both GEMMs, any M
    for key, entry in raw["tiles"].items():
        assert set(entry) >= {"config", "registers", "spill_bytes", "shared_bytes", "modeled_us", "floor_us"}, key
        assert entry["spill_bytes"] <= 64 and entry["shared_bytes"] <= SMEM_PER_BLOCK[cls], key
    assert moe_tiles.table_configs(cls, _meta("int4", 8, 64, 64), _meta("int4", 8, 64, 64)) is None  # no entry


def _q(kind: str) -> str:
    return "g32" if kind == "int4" else "b128x128"


def test_fused_moe_launches_the_table_tile_for_every_row_count(monkeypatch):
    """On a device of a class (faked here), fused_moe's tiles are the table's at 1, 17 and 4096 rows alike."""
    monkeypatch.setattr(fm, "_device_class", lambda x: "sm_90")
    gate, down = _meta("int4", 384, 256, 7168), _meta("int4", 384, 7168, 256)
    expected = moe_tiles.table_configs("sm_90", gate, down)
    for M in (1, 17, 4096):
        x = torch.empty(M, 7168, dtype=torch.bfloat16, device="meta")
        assert fm._configs(None, x, gate, down, 8, False) == expected
    assert moe_tiles.device_class((9, 0)) == "sm_90" and moe_tiles.device_class((12, 0)) == "sm_120"
    assert moe_tiles.device_class((8, 0)) is None


TILED = [
    Case("int4_ragged", "int4", 8, 2, 7, d=200, inter=72, group=32),  # K % BLOCK_K != 0, N % BLOCK_N != 0
    Case("fp8_ragged", "fp8", 8, 2, 7, d=200, inter=72, block=(32, 128)),
]


@pytest.mark.parametrize("case", TILED, ids=str)
@pytest.mark.parametrize("cls", moe_tiles.CLASSES)
def test_table_tiles_compute_the_reference(case, cls):
    """Each class's Kimi tile pair launched on ragged shapes (several N and K tiles, partial ones)."""
    E = 384 if case.kind == "int4" else 256
    tiles = moe_tiles.table_configs(cls, _meta(case.kind, E, 256, 7168), _meta(case.kind, E, 7168, 256))
    x, gate, up, down, weights, ids, emap = _inputs(case)
    got = fm.fused_moe(*_on_device(x, gate, up, down, weights, ids, emap), config=tiles).cpu()
    expected = fused_moe_reference(x, gate, up, down, weights, ids, emap)
    if case.kind == "int4":
        assert_close(f"{case.name} {cls}", got, expected)
    else:  # fp8 quantizes x and h as served: the oracle with that quantization, as test_kernels_fused_moe
        assert_close(f"{case.name} {cls}", got, _fp8_oracle(x, gate, up, down, weights, ids, emap))


@triton.jit
def _nibbles_kernel(S, OUT, BITS):
    n = tl.arange(0, 16)
    s = tl.load(S + tl.arange(0, 4))
    tl.store(OUT + n[:, None] * 4 + tl.arange(0, 4)[None, :], int4_dequant(n[:, None], s[None, :], tl.float32))
    tl.store(BITS + n, (n | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True))


def test_int4_nibbles_reach_the_dot_dtype_exactly():
    """int4_dequant's fp32 row (the interpreter's; bf16 / fp16 rows share the scheme): every nibble times a
    bf16 scale equals the fp32 product, and the bf16 bit pattern 0x4300 | n is 128 + n for every n."""
    scale = torch.tensor([0.0078125, 1.5, -3.25e-3, 17.0], dtype=torch.bfloat16)
    out = torch.empty(16, 4, device=DEVICE)
    bits = torch.empty(16, dtype=torch.bfloat16, device=DEVICE)
    _nibbles_kernel[(1,)](scale.to(DEVICE), out, bits)
    nib = torch.arange(16)
    assert torch.equal(out.cpu(), (nib[:, None] - 8).float() * scale.float()[None, :])
    assert torch.equal(bits.cpu().float(), 128.0 + nib.float())


def test_every_tile_compiles_for_its_class_without_spills():
    """The committed tiles compiled ahead of time for sm_90 and sm_120 (ptxas, no GPU): at most 64 bytes of
    spills and shared memory within the class's per-block budget (a subprocess: here kernels are interpreted);
    the SASS counts an entry records (the roofline prices the INT4 experts by them) are the kernel's today,
    under the Triton that wrote the table."""
    cmd = [sys.executable, "-m", "scripts.bench.moe_tile_table", "--check"]
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(cmd, cwd=env.ROOT, env=clean, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    compiled = {cls: rows for line in res.stdout.splitlines() for cls, rows in json.loads(line).items()}
    assert set(compiled) == set(moe_tiles.CLASSES)
    for cls, rows in compiled.items():
        assert {r["key"] for r in rows} == set(moe_tiles.load(cls))
        raw = json.loads(moe_tiles.table_path(cls).read_text())
        for r in rows:
            assert r["stack_bytes"] <= 64 and r["shared_bytes"] <= SMEM_PER_BLOCK[cls], (cls, r)
            assert 0 < r["registers"] <= 255, (cls, r)
            entry = raw["tiles"][r["key"]]
            if "sass_loop" in entry and raw["triton"] == triton.__version__:
                assert (r["sass_total"], r["sass_loop"]) == (entry["sass_total"], entry["sass_loop"]), (cls, r)
