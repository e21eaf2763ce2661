"""The "triton" attention backend end to end: model logits, the services' tokens, the benchmark's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch

import ddtree.kernels.mla.backend
from ddtree.kernels.mla.backend import TritonMLAAttention
from ddtree.kernels.mla.plan import MLAKernelConfig
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, random_target_state_dict
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import (
    AttentionMetadata,
    SeqAttention,
    make_attention_backend,
    resolve_attention_backend,  # fmt: skip
)
from ddtree.tools.selftest.compare import assert_close
from tests.support.paths import REPO
from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401,I001  (before kernels are imported)

SPLITTY = MLAKernelConfig(block_m=16, block_n=16, min_split=16, target_programs=64)  # splits even at prefix 20


@pytest.fixture(scope="module")
def model():
    config = DeepseekV3Config.from_dict(DEFAULT_TARGET_CONFIG)
    m = DeepseekV3ForCausalLM(config)
    m.load_state_dict(random_target_state_dict(config, seed=3))
    return m.eval().to(DEVICE)


def _chain_tree_mask(n: int) -> torch.Tensor:
    """[root, n nodes]: node 1..3 a chain under the root, the rest children of node 1 (a small bushy tree)."""
    parents = [0, 1, 2] + [1] * (n - 3)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(parents[:n], start=1):
        mask[i] = mask[p]
        mask[i, i] = True
    return mask


def _forwards(model, backend) -> list[torch.Tensor]:
    """Two forwards on a fresh cache: 3 prefills, then extend (A) + tree verify (B) + decode (C)."""
    model.attn_backend = backend
    cache = model.new_kv_cache(256)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(256, generator=gen)
    lens = {"A": 20, "B": 12, "C": 8}
    taken = 0

    def take(n):
        nonlocal taken
        taken += n
        return slots[taken - n : taken]

    prefix = {k: take(n) for k, n in lens.items()}
    ids = torch.randint(2, 4000, (40,), generator=gen)
    empty = torch.empty(0, dtype=torch.int64)
    seqs, row = [], 0
    for k, n in lens.items():
        seqs.append(SeqAttention(row, n, empty, prefix[k]))
        row += n
    pos1 = torch.cat([torch.arange(n) for n in lens.values()])
    out1 = model(ids[:row].to(DEVICE), pos1.to(DEVICE), AttentionMetadata(tuple(seqs)), cache)

    mask = _chain_tree_mask(6)
    depth = mask.sum(1) - 1
    new = {"A": take(10), "B": take(7), "C": take(1)}
    seqs = (SeqAttention(0, 10, prefix["A"], new["A"]),  # extend: causal over 10 tokens after 20
            SeqAttention(10, 7, prefix["B"], new["B"], mask),  # tree verify over 12
            SeqAttention(17, 1, prefix["C"], new["C"]))  # decode over 8  # fmt: skip
    pos2 = torch.cat([torch.arange(20, 30), 12 + depth, torch.tensor([8])])
    out2 = model(ids[:18].to(DEVICE), pos2.to(DEVICE), AttentionMetadata(seqs), cache)
    return [out1.logits, out2.logits]


@pytest.mark.parametrize("config", [None, SPLITTY], ids=["default", "many_splits"])
def test_model_logits_match_torch_backend(model, config, monkeypatch):
    """Mixed batch (prefill, extend over a cached prefix, tree verify, decode): same logits as "torch"."""
    packed = []
    real_plan = ddtree.kernels.mla.backend.plan_mla
    monkeypatch.setattr(ddtree.kernels.mla.backend, "plan_mla", lambda *a, **k: packed.append(1) or real_plan(*a, **k))
    expected = _forwards(model, make_attention_backend("torch"))
    got = _forwards(model, TritonMLAAttention(config) if config else make_attention_backend("triton"))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_close(f"forward {i} logits", g, e)
    assert len(packed) == 2, "the plan must be packed once per forward, not once per layer"


def test_backend_factory():
    assert make_attention_backend("triton").name == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="resolve 'auto'"):
        make_attention_backend("auto")


def test_row_invariant_off_gives_the_throughput_plan(default_ckpt):
    """`ddtree verifier --row-invariant off` (TP 1 here; tp_worker loads its ranks by the same call): the loaded
    model's Triton attention plans a tree step with the throughput plan, whose split comes from the step's
    work, while the default plans its rows as decodes split by their own context."""
    from ddtree.config import VerifierConfig
    from ddtree.kernels.mla.plan import MLASeq, plan_mla
    from ddtree.verifier.engine import _load

    assert make_attention_backend("triton").config.row_invariant
    plans = {}
    for flag in ("on", "off"):
        config = VerifierConfig(attention_backend="triton", row_invariant=flag, model=str(default_ckpt.target))
        model, _ = _load(config, str(default_ckpt.target))
        assert model.attn_backend.config.row_invariant is (flag == "on")
        P, n = 300, 17  # three sequences' trees of 17 rows over 300 committed tokens
        seqs = [MLASeq(n, P, torch.arange(P), torch.arange(P + n * b, P + n * (b + 1)), torch.eye(n, dtype=torch.bool))
                for b in range(3)]  # fmt: skip
        plans[flag] = plan_mla(seqs, 4, num_cache_slots=P + 3 * n, config=model.attn_backend.config)
    assert plans["on"].split_len == 256 and plans["off"].split_len > 300, (
        plans["on"].split_len,
        plans["off"].split_len,
    )


# ---- through the services -------------------------------------------------------------------------------


@pytest.mark.slow
def test_verifier_tokens_identical_with_triton_backend(default_ckpt, tmp_path):
    """Two AR verifiers on the default checkpoint, torch and triton (interpreted): the same greedy tokens."""
    from ddtree.launcher import start_service
    from ddtree.protocol.ddtree.v1 import verifier_pb2, verifier_pb2_grpc

    common = ["verifier", "--model", str(default_ckpt.target), "--port", "0", "--threads", "1",
              "--prefill-chunk", "16", "--kv-tokens", "512", "--max-context", "256"]  # fmt: skip
    procs = {name: start_service(f"verifier-{name}", [*common, "--attention-backend", name], tmp_path,
                                 env={"TRITON_INTERPRET": "1"} if name == "triton" else None)
             for name in ("torch", "triton")}  # fmt: skip
    try:
        prompt = [(7 * i + 3) % 4000 + 2 for i in range(37)]  # 3 prefill chunks: extend over a cached prefix
        tokens = {}
        for name, proc in procs.items():
            req = verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=6, ignore_eos=True)
            with grpc.insecure_channel(proc.address) as ch:
                tokens[name] = [t for msg in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=300)
                                for t in msg.token_ids]  # fmt: skip
        assert len(tokens["torch"]) == 6
        assert tokens["triton"] == tokens["torch"]
    finally:
        for proc in procs.values():
            assert proc.stop() == 0, proc.log_tail()


# ---- the benchmark ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_kernels_dry_run(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench_kernels", "--dry-run", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {(r["kind"], r["batch"], r["prefix"]) for r in result["rows"]} == {
        (k, b, p) for k in ("decode", "tree4") for b in (1, 2) for p in (16, 64)
    }
    assert all(r["ok"] and r["triton_us"] > 0 and r["sdpa_us"] > 0 for r in result["rows"])
    assert set(result["summary"]["ratio_long_over_short"]) == {"decode_b1", "decode_b2", "tree4_b1", "tree4_b2"}
    assert result["latent_write"] and "t(64)/t(16)" in " ".join(result["summary"]["targets"])


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """Ahead-of-time build for sm_90 (no GPU needed): GPU-only compile errors show up on the CPU CI, and the
    default block sizes must fit in registers (no stack spills) at the Kimi shapes."""
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench_kernels", "--compile-only", "--arch", "90",
                          "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["compile"]
    assert {r["kernel"] for r in rows} >= {"split block_m 32 page 1", "split block_m 16 page 16", "merge",
                                            "latent_write"}  # fmt: skip
    assert all(r["stack_bytes"] == 0 for r in rows), rows
