"""`ddtree bench step --device-model`: the full-depth Kimi K2.6 TP-8 rank's roofline from shapes alone (meta
tensors, a few seconds on a CPU), its JSON keys, and the bytes of each kernel against a count written here
from the config's sizes alone (not from the model's modules, nor from tools/roofline/launch_costs.py).

The count follows the roofline's conventions (launch_costs.py): each tensor a launch touches once; gathers
move their rows; the routed experts hit under uniformly random routing. Where a kernel's bytes depend on a
plan it makes itself (the MoE's padded pair list, attention's split partials), the count bounds that part."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ddtree.kernels.gemm.dense import gemm_tiles
from ddtree.tools.roofline.devices import DEVICES
from tests.tools.test_bench_step import DEMO_TARGET, KIMI_CONFIG, ROOT

ROWS, CONTEXT, TP = 17, 8192, 8
BF16, FP32, I32, I64 = 2, 4, 4, 8
# cuBLAS or the row-invariant Triton GEMM (its K chunks, then their ordered sum when it splits K)
GEMM_KERNELS = {"mm", "addmm", "_dense_gemm_kernel", "_dense_gemm_sum_kernel"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("roofline") / "h200.json"
    res = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "bench", "step", "--config", str(KIMI_CONFIG), "--random-weights",
         "--emulate-tp", str(TP), "--device-model", "h200", "--rows", str(ROWS), "--context", str(CONTEXT), "--json",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


def sizes() -> dict:
    c = json.loads(pathlib.Path(KIMI_CONFIG).read_text())["text_config"]
    return dict(
        d=c["hidden_size"], L=c["num_hidden_layers"], dense=c["first_k_dense_replace"], E=c["n_routed_experts"],
        k=c["num_experts_per_tok"], I=c["moe_intermediate_size"] // TP, S=c["moe_intermediate_size"] * c["n_shared_experts"] // TP,
        F=c["intermediate_size"] // TP, H=c["num_attention_heads"] // TP, q=c["q_lora_rank"], r=c["kv_lora_rank"],
        dr=c["qk_rope_head_dim"], nope=c["qk_nope_head_dim"], v=c["v_head_dim"], V=c["vocab_size"] // TP,
        group=c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"],
    )  # fmt: skip


def gemm(m: int, n: int, k: int) -> int:
    """x [m, k] + W [n, k] read, y [m, n] written, all bf16; with K in S > 1 chunks (kernels/gemm/dense.py's
    rule on the H200's SMs) the fp32 partials [S, m, n] too, written then read by the sum."""
    splits = gemm_tiles(1, n, k, DEVICES["h200"].sms)[1]
    return (m * k + n * k + m * n) * BF16 + (2 * splits * m * n * FP32 if splits > 1 else 0)


def expected_bytes() -> dict[tuple[str, str], int]:
    """(kernel, site) -> bytes per step, counted from the config (R rows of one sequence, TP 8)."""
    s, R = sizes(), ROWS
    d, E, k, moe = s["d"], s["E"], s["k"], s["L"] - s["dense"]
    splits = -(-d // 512)  # kernels/moe/router.py: 512-column K splits, each its own program at 17 rows
    return {
        ("_router_kernel", "layers.mlp.gate"): moe
        * (
            R * d * BF16
            + E * d * BF16
            + E * FP32  # x, W (bf16, as stored), correction bias
            + 2 * R * E * FP32
            + 2 * splits * R * E * FP32  # scores and split partials: written, read back
            + R * k * (FP32 + I64)  # weights, ids
        ),
        ("gemm", "layers.self_attn.fused_qkv_a_proj_with_mqa"): s["L"] * gemm(R, s["q"] + s["r"] + s["dr"], d),
        ("gemm", "layers.self_attn.q_b_proj"): s["L"] * gemm(R, s["H"] * (s["nope"] + s["dr"]), s["q"]),
        ("gemm", "layers.self_attn.o_proj"): s["L"] * gemm(R, d, s["H"] * s["v"]),
        ("gemm", "layers.mlp.shared_experts.gate_up_proj"): moe * gemm(R, 2 * s["S"], d),
        ("gemm", "layers.mlp.shared_experts.down_proj"): moe * gemm(R, d, s["S"]),
        ("gemm", "layers.mlp.gate_up_proj"): s["dense"] * gemm(R, 2 * s["F"], d),
        ("gemm", "layers.mlp.down_proj"): s["dense"] * gemm(R, d, s["F"]),
        ("gemm", "lm_head"): gemm(R, s["V"], d),
        # the layers' norms: layer 0's input norm alone (x, out), every other one fused with the residual add
        ("_rms_norm_kernel", "layers"): (2 * s["L"] - 1) * (4 * R * d * BF16 + d * BF16)
        + (2 * R * d * BF16 + d * BF16),
        ("_rms_norm_kernel", "layers.self_attn"): s["L"] * (2 * R * s["q"] * BF16 + s["q"] * BF16),  # q_a_layernorm
        ("_rms_norm_kernel", "step"): 4 * R * d * BF16 + d * BF16,  # the final norm, with the last residual
        ("_latent_write_kernel", "layers.self_attn"): s["L"]
        * (
            2 * R * (s["r"] + s["dr"]) * BF16 + R * (I32 + I64) + s["r"] * BF16 + s["dr"] // 2 * FP32
        ),  # latent in, cache rows out, slots (int32) + positions, kv_a_layernorm, inv_freq
        ("_rope_kernel", "layers.self_attn"): s["L"] * (2 * R * s["H"] * s["dr"] * BF16 + 2 * R * s["dr"] // 2 * FP32),
        ("_silu_mul_kernel", "layers.mlp.shared_experts"): moe * 3 * R * s["S"] * BF16,
        ("_silu_mul_kernel", "layers.mlp"): s["dense"] * 3 * R * s["F"] * BF16,
    }


def bytes_at(report: dict, name: str, site: str) -> int:
    names = GEMM_KERNELS if name == "gemm" else {name}
    found = [k["bytes"] for k in report["kernels"] if k["name"] in names and k["site"] == site]
    assert found, f"no {name} at {site}"
    return sum(found)


def test_the_full_depth_rank_reports_its_roofline(report):
    assert report["layers"] == sizes()["L"] and report["rows"] == ROWS and report["context"] == CONTEXT
    for key in ("kernels", "step_floor_ms", "step_modeled_ms", "collectives", "device_model"):
        assert key in report, key
    assert report["device_model"] == DEVICES["h200"].name
    for k in report["kernels"]:
        assert {"name", "site", "launches", "bytes", "flops", "ctas", "floor_us", "modeled_us"} <= k.keys(), k
        assert k["launches"] >= 1 and k["bytes"] >= 0 and 0 <= k["floor_us"] <= k["modeled_us"], k
    kernels = sum(k["modeled_us"] for k in report["kernels"]) + sum(c["modeled_us"] for c in report["collectives"])
    assert report["step_modeled_ms"] == pytest.approx(kernels / 1e3, abs=2e-3)
    assert 0 < report["step_floor_ms"] < report["step_modeled_ms"]
    assert sum(c["count"] for c in report["collectives"] if c["name"] == "all_reduce") == 2 * sizes()["L"] + 1


@pytest.mark.parametrize("key", list(expected_bytes()), ids=lambda k: f"{k[0]}@{k[1]}")
def test_bytes_per_kernel_equal_the_count_from_shapes(report, key):
    assert bytes_at(report, *key) == expected_bytes()[key]


def test_routed_experts_bytes_follow_random_routing(report):
    """The INT4 experts' weights of the experts hit (E (1 - (1 - k/E)^R)), the activations and outputs; the
    padded pair list and routing weights the kernel reads beside them are bounded."""
    s, R = sizes(), ROWS
    d, E, k, inter, moe = s["d"], s["E"], s["k"], s["I"], s["L"] - s["dense"]
    hit = E * (1 - (1 - k / E) ** R)
    packed = lambda n, kk: n * kk // 2 + n * (kk // s["group"]) * BF16  # noqa: E731  (int4 nibbles + bf16 scales)
    P = R * k
    gate_up = hit * 2 * packed(inter, d) + R * d * BF16 + P * inter * BF16  # x in, h out (bf16)
    down = hit * packed(d, inter) + P * inter * BF16 + P * d * FP32  # h in, y out (fp32)
    main = moe * (gate_up + down)
    got = bytes_at(report, "_moe_gemm_kernel", "layers.mlp.experts")
    index = moe * 2 * (I32 * (P + E * 128) + P * FP32)  # per GEMM: the pair list (<= P + E x BLOCK_M), weights
    assert main <= got <= main + index, (got, main)


def test_attention_reads_the_latent_prefix_once_per_layer(report):
    s, R = sizes(), ROWS
    q = R * s["H"] * (s["r"] + s["dr"]) * BF16
    kv = (CONTEXT + R) * (s["r"] + s["dr"]) * BF16
    split = next(k for k in report["kernels"] if k["name"] == "_mla_split_kernel")
    partials = split["ctas"] * 64 * (s["r"] + 1) * FP32 + split["ctas"] * 4 * I64  # <= 64-row tiles, items
    assert s["L"] * (q + kv) <= split["bytes"] <= s["L"] * (q + kv + partials + R * s["H"] * s["r"] * BF16)


def test_the_router_fills_the_device_within_its_budget(report):
    """Item 2's goal: the router's modeled time at 17 rows <= 0.4 ms per step on H200, its grid >= the SMs."""
    router = next(k for k in report["kernels"] if k["name"] == "_router_kernel")
    assert router["ctas"] >= DEVICES["h200"].sms and router["modeled_us"] <= 400


def test_the_int4_experts_are_priced_by_their_tiles_instructions(report):
    """Item 3: the INT4 experts' issue is what the launched tile's SASS counts (the sm_90 table, since the
    wrappers choose as on an H200), and their modeled time at 17 rows is within 1.3x their floor."""
    from ddtree.kernels.moe import tiles as moe_tiles
    from ddtree.tools.roofline import launch_costs

    table = json.loads(moe_tiles.table_path("sm_90").read_text())["tiles"]
    for key, op in (("int4/gate_up/N256/K7168/g32", True), ("int4/down/N7168/K256/g32", False)):
        c, n, k = table[key]["config"], int(key.split("/")[2][1:]), int(key.split("/")[3][1:])
        a = dict(GATE_UP=op, GROUP=32, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_K=c["block_k"],
                 num_warps=c["num_warps"], num_stages=c["num_stages"])  # fmt: skip
        assert launch_costs._int4_issue(a, "int4", n, k) == table[key]["issue_per_element"]
        assert launch_costs._int4_issue(a, "int4", n, k + 64) == launch_costs.INT4_ISSUE_OPS  # no entry
    moe = next(k for k in report["kernels"] if k["name"] == "_moe_gemm_kernel")
    assert moe["modeled_us"] <= 1.3 * moe["floor_us"], moe


def test_measured_times_land_on_their_kernels():
    """kernel_times.attach_measured on a profile: Triton kernels by name (a kernel at two sites shares its time
    by modeled time), everything else summed as other, pct_of_floor = floor / measured."""
    from ddtree.tools.roofline.kernel_times import attach_measured

    rows = [
        dict(name="_rms_norm_kernel", site="layers", floor_us=2.0, modeled_us=30.0),
        dict(name="_rms_norm_kernel", site="layers.self_attn", floor_us=1.0, modeled_us=10.0),
        dict(name="_router_kernel", site="layers.mlp.gate", floor_us=80.0, modeled_us=140.0),
        dict(name="mm", site="lm_head", floor_us=60.0, modeled_us=61.0),
    ]
    roofline = dict(kernels=rows, collectives=[dict(name="all_reduce", modeled_us=9.0)])
    times = {"_rms_norm_kernel": 20.0, "_router_kernel": 160.0, "nvjet_tst_64x8_64x16": 70.0, "ncclDevKernel": 12.0}
    out = attach_measured(roofline, times)
    got = {(r["name"], r["site"]): r for r in out["kernels"]}
    assert got["_rms_norm_kernel", "layers"]["measured_us"] == 15.0
    assert got["_rms_norm_kernel", "layers.self_attn"]["measured_us"] == 5.0
    assert got["_router_kernel", "layers.mlp.gate"]["pct_of_floor"] == 50.0
    assert "measured_us" not in got["mm", "lm_head"]
    assert out["measured"] == dict(kernels_ms=0.262, triton_ms=0.18, other_ms=0.082, other_modeled_ms=0.07)


def test_a_checkpoint_is_modeled_from_its_config(tmp_path):
    """--device-model with --model DIR reads the checkpoint's config.json alone (no weight is loaded)."""
    out = tmp_path / "demo.json"
    res = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "bench", "step", "--model", str(DEMO_TARGET), "--device-model",
         "rtx-pro-6000", "--rows", "1", "--context", "64", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["device_model"] == DEVICES["rtx-pro-6000"].name and report["ranks"] == 1
    assert report["collectives"] == [] and report["step_modeled_ms"] > report["step_floor_ms"] > 0
    assert "modeled on NVIDIA RTX PRO 6000" in res.stdout
