"""Tensor parallelism of the target on CPU: 2 ranks over gloo (torch.multiprocessing spawn).

TP=2 and expert-parallel logits, argmax and taps match TP=1 (fp32) for prefill, decode, a tree verify and
a chunk with a subset of logits rows, through the real rank-0 handle (broadcast of the step) and the
real worker loop, eagerly and through every rank's static step (the same buckets, in lockstep). The
per-shard argmax combine equals torch.argmax of full logits, ties included; the shard plan agrees with the
shapes of the models built from it.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.multiprocessing as tmp
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.parallel.layers import combine_shard_argmax, shard_argmax
from ddtree.models.parallel.shard_plan import ShardPlan
from ddtree.models.parallel.step_message import FIRST_WORDS, decode, encode, from_runs, runs
from ddtree.models.parallel.tp_model import build_tp_model
from ddtree.tools.selftest.compare import assert_close
from tests.support.tp_ranks import NUM_SLOTS, WORLD, rank_main, scenario

CONFIGS = {
    # q_a/q_b, one dense layer then MoE with a shared expert
    "qlora": dict(DEFAULT_TARGET_CONFIG),
    # plain q_proj, attention biases (o_proj's is row-parallel: added once), 2 expert groups, all MoE
    "qproj_bias": {**DEFAULT_TARGET_CONFIG, "q_lora_rank": None, "attention_bias": True, "n_group": 2,
                   "topk_group": 1, "first_k_dense_replace": 0, "vocab_size": 1024},
}  # fmt: skip


def write_checkpoint(path: pathlib.Path, cfg: dict) -> pathlib.Path:
    write_random_target(path, cfg, seed=3)
    sd = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    for name, t in sd.items():
        if name.endswith(".bias") and "e_score" not in name:
            sd[name] = torch.randn(t.shape, generator=g) * 0.1  # make the row-parallel bias matter
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp(request.param), CONFIGS[request.param])
    out = ckpt / "tp.pt"
    tmp.spawn(rank_main, args=(str(ckpt), str(out)), nprocs=WORLD, join=True)
    model = load_target(ckpt, dtype=torch.float32)
    kv = model.new_kv_cache(NUM_SLOTS)
    ref = []
    for s in scenario(model.config.vocab_size):
        o = model.forward(s.input_ids, s.positions, s.meta, kv, s.logits_rows, s.tap_layer_ids)
        ref.append((o.logits, o.taps))
    return ref, torch.load(out)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_tp2_matches_tp1(case, ep, static):
    ref, results = case
    if static:  # prefill, decode and verify through every rank's static step; the chunk (other taps) eagerly
        assert results[("replays", ep)] == (3, 1)
    # The control path per step: one host broadcast of the fixed first buffer (every message here fits it),
    # no device broadcast (each rank fills its own bucket from the message), the buffer never grown.
    assert results[("control", ep, static)] == [(1, 0)] * 4
    assert results["first_buffer"] == {FIRST_WORDS}
    names = ["prefill", "decode", "tree verify", "chunk"]
    for name, (logits, taps), (tp_logits, tp_argmax, tp_taps) in zip(names, ref, results[(ep, static)]):
        if tp_logits is not None:
            assert_close(f"{name} logits", tp_logits, logits, abs_tol=1e-4)
        else:
            assert name == "chunk", "logits are gathered only when asked"
        assert torch.equal(tp_argmax, logits.argmax(dim=-1)), f"{name}: per-shard argmax != argmax of TP=1 logits"
        if taps is None:
            assert tp_taps is None
        else:
            assert_close(f"{name} taps", tp_taps, taps, abs_tol=1e-4)


def test_expert_parallel_matches_tensor_parallel(case):
    _, results = case
    for (tp_logits, tp_argmax, _), (ep_logits, ep_argmax, _) in zip(results[(False, False)], results[(True, False)]):
        assert torch.equal(tp_argmax, ep_argmax)
        if tp_logits is not None:
            assert_close("EP vs TP logits", ep_logits, tp_logits, abs_tol=1e-4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_combine_shard_argmax_is_argmax_with_ties(world):
    g = torch.Generator().manual_seed(world)
    V = 12 * world
    logits = torch.randint(-3, 3, (64, V), generator=g).float()  # many ties, across shard boundaries
    logits[0] = 1.0  # all tied: id 0
    logits[1] = float("-inf")
    logits[2, V // world] = logits[2, 0] = 9.0  # tie between rank 0 and rank 1: the lower id
    n = V // world
    parts = torch.stack([shard_argmax(logits[:, r * n : (r + 1) * n], r * n) for r in range(world)])
    assert torch.equal(combine_shard_argmax(parts), logits.argmax(dim=-1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("ep", [False, True])
def test_shard_plan_matches_local_shapes(name, ep):
    config = DeepseekV3Config.from_dict(CONFIGS[name])
    with torch.device("meta"):
        full = {n: t.shape for n, t in DeepseekV3ForCausalLM(config).state_dict().items()}
    held = {n: 0 for n in full}
    for rank in range(WORLD):
        plan = ShardPlan(config, rank, WORLD, ep)
        with torch.device("meta"):
            local = {n: t.shape for n, t in build_tp_model(plan, None).state_dict().items()}
        assert set(local) == {n for n in full if not plan.skip(n)}
        for n, shape in local.items():
            s = plan.slice_of(n)
            want = list(full[n])
            if s is not None:
                want[s.dim] = s.stop - s.start
            assert list(shape) == want, n
            held[n] += 1
    assert all(held.values()), "every tensor is held by some rank"


def test_step_message_round_trip():
    for s in scenario(512):
        d = decode(*encode(s))
        assert torch.equal(d.input_ids, s.input_ids) and torch.equal(d.positions, s.positions)
        assert (d.logits_rows is None) == (s.logits_rows is None)
        assert d.tap_layer_ids == s.tap_layer_ids and d.gather_logits == s.gather_logits
        for a, b in zip(d.meta.seqs, s.meta.seqs):
            assert (a.q_start, a.q_len) == (b.q_start, b.q_len)
            assert torch.equal(a.prefix_slots, b.prefix_slots) and torch.equal(a.new_slots, b.new_slots)
            assert torch.equal(a.visible_new(), b.visible_new())


@pytest.mark.parametrize("slots", [[], [7], list(range(10, 30)), [3, 4, 5, 9, 1, 2, 100, 101], "perm"])
def test_slot_runs_round_trip(slots):
    t = (
        torch.randperm(64, generator=torch.Generator().manual_seed(0))
        if slots == "perm"
        else torch.tensor(slots, dtype=torch.int64)
    )
    r = runs(t)
    assert r.numel() == 1 + 2 * int(r[0])
    assert torch.equal(from_runs(r[1:]), t)
