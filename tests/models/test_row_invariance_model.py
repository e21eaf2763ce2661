"""Row invariance of the whole verify forward on the device path (Triton kernels and the row-invariant GEMMs,
interpreted on the CPU, bf16): every row of a verify tree, beside another sequence, has the logits of its AR
twin bit for bit (the same token decoded alone at batch 1 after its ancestors, each decoded alone;
tools/selftest/invariance.py). A Kimi-shaped checkpoint (INT4 routed experts, bf16 elsewhere) and an FP8
block checkpoint (every projection FP8), 3 layers (a dense one, two MoE ones), trees of 17 and 9 rows and a
decode in one step, contexts that cross the attention's 32-key split edge. Interpreted forwards are slow,
so the shapes are the smallest that keep every kernel in play; the kernels' own grids (batches 1, 3, 8,
trees of 9 and 17, the negative control) are in tests/kernels/test_row_invariance_*.py.

The CPU's torch path (fp32, BLAS GEMMs) is not row invariant; the test of that states it.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ddtree.kernels.mla.backend import TritonMLAAttention
from ddtree.kernels.mla.plan import MLAKernelConfig
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.layers.layer_kernels import make_layer_kernels
from ddtree.tools.selftest.invariance import Tree, compare_prefill_rows, compare_tree_rows, random_tree
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

TINY = {**DEFAULT_TARGET_CONFIG, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4}  # fmt: skip
SPLITS = MLAKernelConfig(block_n=16, min_split=32, max_splits=4)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    return write_random_target(tmp_path_factory.mktemp("tiny"), TINY, seed=11)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    return write_random_target(tmp_path_factory.mktemp("tiny3"), {**TINY, "num_hidden_layers": 3}, seed=11)


def _device_model(path, dtype=torch.bfloat16):
    model = load_target(path, dtype=dtype, device=DEVICE, attention_backend="triton").eval()
    model.layer_kernels = make_layer_kernels("triton")
    model.attn_backend = TritonMLAAttention(SPLITS)
    return model


def _case(seed: int) -> tuple[list[list[int]], list[Tree]]:
    """Trees of 17 and 9 rows over contexts of 23 and 37 tokens (their rows' contexts cross 32 and 40 = 32 + 8)
    and a decode row (a tree of one row) over 29 tokens, in one step."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (23, 37, 29)]
    return contexts, [random_tree(n, TINY["vocab_size"], rng) for n in (17, 9, 1)]


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_tree_rows_equal_ar_twins_on_the_device_path(kind, three_layers, tmp_path):
    path = quantize_checkpoint(three_layers, tmp_path / kind, kind, fp8_block=(32, 32))
    got = compare_tree_rows(_device_model(path), *_case(seed=5))
    assert got.rows == 27 and got.differing == 0, got


def test_cpu_torch_path_is_not_row_invariant(fp32_checkpoint):
    """The claim's boundary (README): the CPU's fp32 torch path is not bitwise row invariant (MKL's GEMM
    reduces a row differently at 1, 2-3 and 4+ rows), only within fp32 rounding of it."""
    model = load_target(fp32_checkpoint, dtype=torch.float32).eval()
    got = compare_tree_rows(model, *_case(seed=5))
    assert got.differing > 0 and got.max_abs_diff < 1e-4, got


@pytest.mark.parametrize("row_invariant", [True, False])
def test_prefill_chunk_rows_equal_one_whole_prefill_and_their_ar_twins(row_invariant, fp32_checkpoint):
    """Two prompts of 45 and 38 tokens (past the 32-key split edge) prefilled in random chunks beside each
    other, every row against the prompt prefilled whole and alone, its last 4 rows against their AR twins
    (tools/selftest/invariance.compare_prefill_rows): bitwise with the row-invariant plan; with the
    throughput plan (the negative control) rows differ. fp32: the interpreter's bf16 rounds the fp32 result,
    which can hide a reduction-order difference."""
    model = _device_model(fp32_checkpoint, dtype=torch.float32)
    model.attn_backend = TritonMLAAttention(dataclasses.replace(SPLITS, row_invariant=row_invariant, target_programs=4))
    rng = random.Random(3)
    contexts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (45, 38)]
    got = compare_prefill_rows(model, contexts, rng)
    assert got.rows == 45 + 38 + 2 * 4, got
    assert (got.differing == 0) if row_invariant else (got.differing > 0), got
