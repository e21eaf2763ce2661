"""`ddtree bench step` end to end on the CPU, as a command (each run its own process: an emulated rank
joins a one-rank torch.distributed group, and --kernels triton must set TRITON_INTERPRET before triton
loads): the Kimi K2.6 rank shard of TP 8 at reduced depth from its config, the demo target at TP 1 and
as a TP-2 shard, a Kimi-shaped INT4 checkpoint at TP 1 (tree and AR), as an expert-parallel shard, at
real TP 2 (two processes over gloo) and with the Triton kernels interpreted. The reports are checked for their keys and for what the model's
shape fixes (layers, shard sizes, all-reduces per step); the counts themselves are the subject of
tests/tools/test_op_count.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ddtree.cli import main
from ddtree.models.parallel.process_group import TPGroup
from ddtree.tools.selftest import kimi_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
KIMI_CONFIG = ROOT / "docs" / "kimi_k26_config.json"
DEMO_TARGET = ROOT / "checkpoints" / "demo" / "target"
KEYS = {
    "host_syncs_per_step", "ops_per_step", "ops_per_moe_layer", "ops_per_moe_layer_mean", "ops_per_dense_layer",
    "triton_launches_per_step", "all_reduces_per_step", "step_ms", "device", "rows", "context", "batch", "tp",
    "emulate_tp", "layers", "moe_layers", "dense_layers", "forward", "host_sync_sites", "top_ops", "config",
    "graphs_unavailable", "kernels",
}  # fmt: skip


def bench_step(tmp_path, *args: str, timeout: float = 600) -> dict:
    out = tmp_path / f"step-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it (--kernels triton)
    res = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "bench", "step", *args, "--device", "cpu", "--repeat", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert KEYS <= report.keys(), KEYS - report.keys()
    assert report["device"] == "cpu" and report["step_ms"]["eager"] > 0
    assert report["step_ms"]["graphs"] is None and "CUDA" in report["graphs_unavailable"]
    assert report["layers"] == report["moe_layers"] + report["dense_layers"]
    assert 0 <= report["forward"]["host_syncs"] <= report["host_syncs_per_step"]
    assert 0 < report["forward"]["ops"] <= report["ops_per_step"]
    assert sum(s["count"] for s in report["host_sync_sites"]) == report["host_syncs_per_step"]
    if report["moe_layers"]:
        assert 0 < report["ops_per_moe_layer_mean"] <= report["ops_per_moe_layer"]
    return report


def _kimi_int4(tmp_path_factory, experts: int) -> pathlib.Path:
    """A Kimi-shaped INT4 checkpoint (kimi_k25 layout, compressed-tensors experts): 3 layers (one dense)."""
    out = tmp_path_factory.mktemp(f"kimi-int4-{experts}")
    kimi_checkpoint.main(["--out", str(out), "--layers", "3", "--experts", str(experts), "--hidden", "256",
                          "--vocab", "1024", "--heads", "4", "--q-lora", "64", "--kv-lora", "64", "--moe-width", "64",
                          "--dense-width", "256", "--no-vision"])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory) -> pathlib.Path:
    return _kimi_int4(tmp_path_factory, 8)


def test_the_kimi_k26_rank_shard_of_tp8_at_reduced_depth(tmp_path):
    r = bench_step(tmp_path, "--config", str(KIMI_CONFIG), "--random-weights", "--emulate-tp", "8", "--layers", "2",
                   "--rows", "3", "--context", "16", "--warmup", "0", "--json")  # fmt: skip
    assert (r["emulate_tp"], r["tp"], r["rows"], r["context"], r["layers"], r["moe_layers"]) == (8, 1, 3, 16, 2, 1)
    c = r["config"]
    assert (c["hidden_size"], c["heads"], c["local_heads"]) == (7168, 64, 8)
    assert (c["routed_experts"], c["local_experts"], c["local_expert_width"], c["expert_kind"]) == (
        384,
        384,
        256,
        "int4",
    )
    assert (c["vocab_size"], c["local_vocab"]) == (163840, 20480)
    assert r["all_reduces_per_step"] == 2 * r["layers"] + 1  # after attention and MLP, and the embedding
    assert r["all_gathers_per_step"] == 1  # the sharded argmax
    assert r["triton_launches_per_step"] == 0  # the CPU's own path


def test_the_demo_target_at_tp1_and_as_a_tp2_shard(tmp_path):
    r = bench_step(tmp_path, "--model", str(DEMO_TARGET), "--rows", "17", "--context", "32", "--warmup", "0")
    assert (r["emulate_tp"], r["rows"], r["layers"], r["all_reduces_per_step"]) == (1, 17, 5, 0)
    assert r["config"]["local_heads"] == r["config"]["heads"]
    shard = bench_step(tmp_path, "--model", str(DEMO_TARGET), "--rows", "17", "--context", "32", "--warmup", "0",
                       "--emulate-tp", "2")  # fmt: skip
    assert shard["config"]["local_heads"] * 2 == shard["config"]["heads"]
    assert shard["config"]["local_vocab"] * 2 == shard["config"]["vocab_size"]
    assert shard["all_reduces_per_step"] == 2 * shard["layers"] + 1


def test_a_kimi_shaped_int4_checkpoint_tree_ar_and_expert_parallel(tmp_path, kimi_int4):
    tree = bench_step(tmp_path, "--model", str(kimi_int4), "--rows", "17", "--context", "32", "--warmup", "0")
    assert (tree["layers"], tree["moe_layers"], tree["config"]["expert_kind"]) == (3, 2, "int4")
    ar = bench_step(tmp_path, "--model", str(kimi_int4), "--rows", "1", "--context", "32", "--warmup", "0")
    assert ar["rows"] == 1 and ar["ops_per_moe_layer"] > 0
    ep = bench_step(tmp_path, "--model", str(kimi_int4), "--rows", "17", "--context", "32", "--warmup", "0",
                    "--emulate-tp", "2", "--expert-parallel")  # fmt: skip
    assert (ep["config"]["local_experts"], ep["config"]["routed_experts"], ep["expert_parallel"]) == (4, 8, True)
    assert ep["all_reduces_per_step"] == 2 * ep["layers"] + 1


@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_real_tp_2_ranks_count_what_the_emulated_rank_counts(tmp_path, kimi_int4, ep):
    """--tp 2 spawns rank 1 (gloo) and measures rank 0: the same shard, so the same ops per layer and 0 host
    syncs inside the forward as --emulate-tp 2, and the same collectives (now with a peer)."""
    extra = ["--expert-parallel"] if ep else []
    args = ["--model", str(kimi_int4), "--rows", "17", "--context", "32", "--warmup", "0", *extra]
    real = bench_step(tmp_path, *args, "--tp", "2")
    emulated = bench_step(tmp_path, *args, "--emulate-tp", "2")
    assert (real["tp"], real["emulate_tp"]) == (2, 1) and real["config"]["local_heads"] * 2 == real["config"]["heads"]
    assert real["forward"]["host_syncs"] == 0 == emulated["forward"]["host_syncs"]
    # the real rank's all-reduces are ordered (row invariance: an all-gather and a rank-order sum): their own
    # ops on top of the emulated rank's one-rank all_reduce, 2 a layer
    extra = TPGroup(0, 2, None, None).reduce_ops(2)
    for key in ("all_reduces_per_step", "all_gathers_per_step"):
        assert real[key] == emulated[key], key
    for key in ("ops_per_moe_layer", "ops_per_dense_layer"):
        assert real[key] == emulated[key] + 2 * extra, key
    assert real["forward"]["ops"] == emulated["forward"]["ops"] + real["all_reduces_per_step"] * extra


def test_the_triton_kernels_interpreted_count_once_each(tmp_path, kimi_int4):
    pytest.importorskip("triton")
    r = bench_step(tmp_path, "--model", str(kimi_int4), "--rows", "3", "--context", "8", "--layers", "2",
                   "--kernels", "triton", "--warmup", "0")  # fmt: skip
    assert r["kernels"] == "triton" and r["config"]["attention_backend"] == "TritonMLAAttention"
    # at least the fused MoE's two expert GEMMs in the MoE layer and the attention kernel in each layer
    assert r["triton_launches_per_step"] >= 2 * r["moe_layers"] + r["layers"]
    # every launch once; outside the forward only the LM head's GEMM (the verifier's head runs it on the
    # forward's hidden rows, target.py; with the Triton kernels it is kernels/gemm/dense.py)
    assert r["forward"]["triton_launches"] + 1 == r["triton_launches_per_step"]


@pytest.fixture(scope="module")
def kimi_int4_64(tmp_path_factory) -> pathlib.Path:
    """The issue's Kimi-shaped INT4 checkpoint: 64 routed experts, top 8."""
    return _kimi_int4(tmp_path_factory, 64)


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory) -> pathlib.Path:
    from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
    from tests.support.quantized_checkpoints import quantize_checkpoint

    src = write_random_target(tmp_path_factory.mktemp("fp32"), DEFAULT_TARGET_CONFIG, seed=0)
    return quantize_checkpoint(src, tmp_path_factory.mktemp("fp8"), "fp8")


# Context 512: two prefix splits of min_split 256 per row, so the MLA merge launches as at long contexts. A
# 17-row tree at TP 1, TP 2 and expert parallel, and AR at TP 1 (a decode row launches no more than a tree).
@pytest.mark.parametrize(("shard", "rows"), [("tp1", 17), ("tp1", 1), ("tp2", 17), ("ep2", 17)],
                         ids=["tp1-verify17", "tp1-decode", "tp2-verify17", "ep2-verify17"])  # fmt: skip
def test_the_device_path_launches_at_most_30_ops_per_moe_layer_and_never_syncs(tmp_path, kimi_int4_64, rows, shard):
    """The device path counted (Triton kernels interpreted, each launch once): at most 30 ops per MoE layer
    and 0 host syncs inside the forward, at TP 1, as a rank of TP 2 over gloo, and expert parallel."""
    pytest.importorskip("triton")
    extra = {"tp1": [], "tp2": ["--emulate-tp", "2"], "ep2": ["--emulate-tp", "2", "--expert-parallel"]}[shard]
    r = bench_step(tmp_path, "--model", str(kimi_int4_64), "--rows", str(rows), "--context", "512",
                   "--kernels", "triton", "--warmup", "0", *extra)  # fmt: skip
    assert any(t["op"] == "_mla_merge_kernel" for t in r["top_ops"]), "no split crossed: the merge was not counted"
    assert r["config"]["expert_kind"] == "int4" and r["config"]["routed_experts"] == 64 and r["moe_layers"] == 2
    assert r["ops_per_moe_layer"] <= 30, r["moe_layer_parts"]
    assert r["forward"]["host_syncs"] == 0 and r["triton_launches_per_step"] > 0


def test_the_fp8_device_path_launches_at_most_30_ops_per_moe_layer_and_never_syncs(tmp_path, fp8_target):
    """FP8 block checkpoints: 0 host syncs inside the forward and at most 30 ops per MoE layer, as for INT4
    experts: the activations are quantized inside the GEMMs (each FP8 linear one launch, the fused MoE's
    grouped GEMMs too), no quantization kernel of their own."""
    pytest.importorskip("triton")
    r = bench_step(tmp_path, "--model", str(fp8_target), "--rows", "17", "--context", "512", "--layers", "2",
                   "--kernels", "triton", "--warmup", "0")  # fmt: skip
    assert r["config"]["expert_kind"] == "fp8" and r["moe_layers"] > 0
    assert r["forward"]["host_syncs"] == 0
    assert r["ops_per_moe_layer"] <= 30, r["moe_layer_parts"]
    ops = {t["op"]: t["count"] for t in r["top_ops"]}
    assert ops["_fp8_gemm_kernel"] > 0 and ops["_moe_gemm_kernel"] > 0, ops
    assert not [op for op in ops if "quant" in op], ops  # a quantizer of its own would launch once per GEMM: a top op


def test_refusals_are_one_line_errors(capsys):
    for args, words in (
        (["--config", str(KIMI_CONFIG)], "--random-weights"),
        (["--model", str(DEMO_TARGET), "--tp", "2", "--emulate-tp", "2"], "exclude each other"),
        (["--model", str(DEMO_TARGET), "--expert-parallel"], "--emulate-tp"),
    ):
        assert main(["bench", "step", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
