"""`ddtree selftest invariance` (tools/selftest/invariance_check.py) as operators run it: on the CPU's torch path
it finds the rows that differ from their AR twins (that path is not row invariant: exit 1, the counts
printed), bad input is exit 2 with one line, `--kernels triton --tp 2` (interpreted, gloo) compares a
small tree's rows and prompts prefilled in random chunks bitwise equal (exit 0), and so does `--kernels triton
--static` (the trees through the static step), at TP 1 and at TP 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from tests.support import installed_env as env

TINY = {**DEFAULT_TARGET_CONFIG, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_target(tmp_path_factory.mktemp("tiny"), TINY, seed=11)


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddtree.cli", "selftest", "invariance", *args]
    return subprocess.run(cmd, cwd=env.ROOT, capture_output=True, text=True, timeout=600)


def test_cpu_torch_path_reports_its_differing_rows(tiny):
    res = _cli("--model", str(tiny), "--batches", "1,3", "--rows", "5", "--contexts", "20,30", "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    out = json.loads(res.stdout)
    trees = [c for c in out["cases"] if not c.get("prefill_chunks")]
    prompts = [c for c in out["cases"] if c.get("prefill_chunks")]
    assert sum(c["compared"] for c in trees) == 20 and [c["batch"] for c in prompts] == [1, 3], out
    # a prompt of 20 or 30 tokens: each row once against the whole prefill, its last 4 again against AR twins
    assert all(24 <= c["compared"] <= 34 * c["batch"] for c in prompts), out
    assert out["rows"] == 20 + out["prefill_rows"] == sum(c["compared"] for c in out["cases"]), out
    assert 0 < out["differing"] <= out["rows"] and 0 < out["max_abs_diff"] < 1e-4, out
    assert out["kernels"] == "torch" and out["device"] == "cpu"


def test_bad_input_is_exit_2(tiny, tmp_path):
    for args in (
        ["--model", str(tmp_path)],
        ["--model", str(tiny), "--rows", "0"],
        ["--model", str(tiny), "--tp", "0"],
        ["--model", str(tiny), "--batches", "2,0"],
    ):
        res = _cli(*args)
        assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_triton_path_at_tp2_rows_equal_their_twins(tiny):
    """The device path, interpreted, at TP 2 over gloo (the rank-order all-reduce): bitwise, exit 0."""
    res = _cli("--model", str(tiny), "--tp", "2", "--kernels", "triton", "--dtype", "bf16", "--batches", "2",
               "--rows", "3", "--contexts", "30")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    # trees: 2 x 3 rows; prompts: 2 x 30 rows prefilled in chunks + 2 x 4 AR twins
    assert "rows compared 74 (68 of them prompt rows prefilled in chunks), rows differing 0" in res.stdout


def test_triton_path_through_the_static_step_rows_equal_their_twins(tiny):
    """The trees verified through the static step (kernels/mla/static_plan.py), in the bucket of 2 sequences
    of 3 rows (the 2-row trees padded), interpreted, against eager AR twins: bitwise, exit 0. fp32: the
    interpreter computes bf16 in fp32 and rounds the result, which hides what a plan that is not row
    invariant changes (the former static plan, shared row tiles: 6 of these 10 rows differ in fp32, none in
    bf16)."""
    res = _cli("--model", str(tiny), "--kernels", "triton", "--dtype", "fp32", "--static", "--batches", "2",
               "--rows", "2,3", "--contexts", "30")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rows compared 10 (0 of them prompt rows prefilled in chunks), rows differing 0" in res.stdout
    assert "static step" in res.stdout


def test_triton_path_through_the_static_step_at_tp2_rows_equal_their_twins(tiny):
    """The static step at TP 2 (gloo, interpreted): both ranks build it over their KV replicas and replay rank
    0's tree steps in lockstep (the rank-order all-reduce inside); the AR twins run eager. Bitwise, exit 0."""
    res = _cli("--model", str(tiny), "--tp", "2", "--kernels", "triton", "--dtype", "fp32", "--static",
               "--batches", "2", "--rows", "2,3", "--contexts", "30")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rows compared 10 (0 of them prompt rows prefilled in chunks), rows differing 0" in res.stdout
    assert "TP 2" in res.stdout and "static step" in res.stdout


def test_row_invariance_off_is_the_checks_negative_control(tiny):
    """The same trees, contexts and kernels with the attention's throughput plan (`--row-invariant off`, as the
    verifier's flag): contexts past the 256-key split edge are split by the step's work, not by each row's
    context, and rows differ from their AR twins (exit 1); with the default plan none does (exit 0). The trees
    only (--prefill off; the prompts' negative control is in tests/models/test_row_invariance_model.py, at a
    32-key edge). fp32: the interpreter's bf16 rounds the fp32 result, which can hide a reduction-order
    difference."""
    args = ["--model", str(tiny), "--kernels", "triton", "--dtype", "fp32", "--batches", "1", "--rows", "3",
            "--contexts", "262", "--prefill", "off", "--json"]  # fmt: skip
    off, on = _cli(*args, "--row-invariant", "off"), _cli(*args)
    assert off.returncode == 1, off.stdout + off.stderr
    got = json.loads(off.stdout)
    assert got["rows"] == 3 and got["differing"] > 0 and got["row_invariant"] == "off", got
    assert on.returncode == 0 and json.loads(on.stdout)["differing"] == 0, on.stdout + on.stderr
