"""Every Triton kernel the deployments' verify step launches compiles for sm_90 (H100 / H200) as launched:
scripts/bench/compile_launches.py records the launches of `ddtree bench step` on the CPU with the wrappers
choosing as on the GPU, then builds each with Triton's own compiler and ptxas (no GPU needed). The
interpreted tests cannot see what only the GPU compiler refuses, nor shared memory past the device's. The
same recording counts the step's ops and host syncs as the GPU launches them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import installed_env as env

KIMI_CONFIG = env.ROOT / "docs" / "kimi_k26_config.json"
SHAPES = "1:1024,17:1024,256:1024"  # AR decode, a 17-row tree, a prefill chunk (larger MoE tiles)
# the bf16 linears: _dense_gemm_kernel over K chunks, then _dense_gemm_sum_kernel adds them in order
KIMI_KERNELS = {"_mla_split_kernel", "_mla_merge_kernel", "_latent_write_kernel", "_moe_gemm_kernel", "_rms_norm_kernel",
                "_router_kernel", "_rope_kernel", "_silu_mul_kernel", "_dense_gemm_kernel",
                "_dense_gemm_sum_kernel"}  # fmt: skip
HOT = {"_mla_split_kernel", "_moe_gemm_kernel", "_router_kernel"}  # where a spill would cost the step


def _compile(tmp_path, config) -> list[dict]:
    out = tmp_path / "compile.json"
    no_interpreter = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "scripts.bench.compile_launches", "--arch", "90", "--shapes", SHAPES, "--out", str(out),
         "--", "--config", str(config), "--random-weights", "--emulate-tp", "8", "--layers", "2"],
        cwd=env.ROOT, env=no_interpreter, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert all(r["fits"] and "error" not in r for r in rows), [r for r in rows if not r["fits"]]
    # issue 40's budget, counted as the GPU launches (not the interpreter's exact-fp32 stand-ins)
    steps = result["steps"]
    assert [(st["rows"], st["context"]) for st in steps] == [(1, 1024), (17, 1024), (256, 1024)]
    assert all(st["host_syncs_per_step"] == 0 and st["ops_per_moe_layer"] <= 30 for st in steps), steps
    return rows


@pytest.mark.slow
def test_the_kimi_k26_rank_kernels_compile_for_hopper_and_the_hot_ones_do_not_spill(tmp_path):
    rows = _compile(tmp_path, KIMI_CONFIG)
    assert {r["kernel"] for r in rows} >= KIMI_KERNELS
    moe = [r["constexprs"] for r in rows if r["kernel"] == "_moe_gemm_kernel"]
    assert {(c["KIND"], c["GATE_UP"]) for c in moe} == {(1, True), (1, False)}  # the INT4 experts, both GEMMs
    assert all(r["stack_bytes"] == 0 for r in rows if r["kernel"] in HOT), [r for r in rows if r["kernel"] in HOT]


@pytest.mark.slow
def test_the_deepseek_v3_fp8_rank_kernels_compile_for_hopper(tmp_path):
    raw = json.loads(KIMI_CONFIG.read_text())["text_config"]
    raw.update(n_routed_experts=256, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
               bos_token_id=0, eos_token_id=1, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]})  # fmt: skip
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    rows = _compile(tmp_path, config)
    assert {"_fp8_gemm_kernel", "_moe_gemm_kernel", "_mla_split_kernel"} <= {r["kernel"] for r in rows}
    assert any(r["constexprs"].get("KIND") == 2 for r in rows if r["kernel"] == "_moe_gemm_kernel")  # FP8 experts
