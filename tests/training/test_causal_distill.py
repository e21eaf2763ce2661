"""Training a causal head by forward-KL distillation (`ddtree train drafter --causal-head --loss kl`).

The teacher rows are the target's own logits (a plain prefill over the generated sequence gives the same);
the KL equals a brute-force sum over the vocabulary (full teacher) or over the renormalised top-K; a smoke
run trains a causal, shifted head whose loss falls and whose export loads as such; --loss kl over a
verifier (whose Features RPC carries no logits) is refused.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.tools.train_drafter import add_arguments
from ddtree.training.drafter_data import TargetRunner, TokenStream, sample_windows
from ddtree.training.drafter_forward import block_hidden, block_inputs, block_labels, block_teacher, sample_anchors
from ddtree.training.drafter_loss import block_kl_loss, depth_weights
from ddtree.training.drafter_trainer import DrafterTrainer

VOCAB = 96
TINY = {
    **DEFAULT_TARGET_CONFIG,
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "n_routed_experts": 4,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
HEAD = {"causal_head": True, "draft_shift": True}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and much faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = write_random_target(tmp_path_factory.mktemp("target"), TINY, seed=4)
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * 10  # confident, as a trained target
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def streams():
    g = torch.Generator().manual_seed(1)
    return {"code": TokenStream("code", torch.randint(2, VOCAB - 1, (8_000,), generator=g), None)}


def test_teacher_rows_are_the_targets_logits(target_dir, streams):
    target = load_target(target_dir)
    prompts = sample_windows(streams, 2, 10, torch.Generator().manual_seed(2), prompts=True)
    runner = TargetRunner(target, (0, 2), torch.float32, teacher_topk=0)
    batch = runner.generate(prompts, 12)
    plain = runner.prefill_batch(batch.ids)  # one forward over the whole result
    rows = slice(batch.anchor_lo - 1, None)
    torch.testing.assert_close(batch.teacher[:, rows], plain.teacher[:, rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(batch.teacher_ids[:, rows, 0], batch.greedy[:, rows])  # sorted: the argmax first
    top = TargetRunner(target, (0, 2), torch.float32, teacher_topk=5).generate(prompts, 12)
    torch.testing.assert_close(top.teacher[:, rows], batch.teacher[:, rows, :5])


@pytest.mark.parametrize("topk", [0, 7])
def test_kl_loss_is_the_brute_force_kl(target_dir, streams, tmp_path, topk: int):
    target = load_target(target_dir)
    model = load_drafter(write_random_drafter(tmp_path / "d", TINY, seed=6, block_size=6, attention=HEAD))
    cfg = model.config
    prompts = sample_windows(streams, 2, 8, torch.Generator().manual_seed(3), prompts=True)
    batch = TargetRunner(target, cfg.target_layer_ids, torch.float32, teacher_topk=topk).generate(prompts, 16)
    anchors = sample_anchors(batch.anchor_lo, batch.ids.shape[1] - 5, 3, 2, torch.Generator().manual_seed(5))
    embeds = target.model.embed_tokens.weight.detach()[block_inputs(batch.ids, anchors, 6, cfg.mask_token_id)]
    head = target.lm_head.weight.detach()
    tau = 2.0
    with torch.no_grad():
        hidden = block_hidden(model, batch.taps, embeds, anchors)
        out = block_kl_loss(
            model,
            hidden,
            head,
            block_teacher(batch.teacher, anchors, 6),
            block_teacher(batch.teacher_ids, anchors, 6),
            block_labels(batch.greedy, anchors, 6),
            depth_weights(6, 0.0),
            tau,
        )
    total, n = 0.0, 0
    for s in range(2):
        for j, a in enumerate(anchors[s].tolist()):
            for d in range(1, 6):
                slot = d - 1  # draft_shift: slot d - 1 predicts depth d
                q = torch.log_softmax(model.compute_logits(hidden[s, j, slot][None], head)[0] / tau, -1)
                vals, ids = batch.teacher[s, a + d - 1], batch.teacher_ids[s, a + d - 1]
                p = torch.softmax(vals / tau, -1)
                total += tau**2 * sum(float(p[i] * (torch.log(p[i]) - q[ids[i]])) for i in range(len(ids)) if p[i] > 0)
                n += 1
    assert out.loss.item() == pytest.approx(total / n, rel=1e-4)


def _args(target_dir, run_dir, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--target", str(target_dir), "--corpus", "-", "--run-dir", str(run_dir), "--batch", "4"]
    flags += ["--prompt-min", "8", "--prompt-max", "16", "--gen-tokens", "24", "--anchors", "8", "--lr", "5e-3"]
    return p.parse_args([*flags, "--warmup", "2", "--log-every", "1000", "--val-batches", "0", *extra])


def test_smoke_training_of_a_causal_head(target_dir, tmp_path, streams):
    flags = ["--causal-head", "--draft-shift", "--loss", "kl", "--kd-topk", "16", "--block-size", "6"]
    trainer = DrafterTrainer(_args(target_dir, tmp_path, *flags, "--steps", "10", "--pool", "1"), streams=streams)
    trainer.run()
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines() if '"loss"' in x]
    losses = [r["loss"] for r in log]
    assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3]), losses
    export = load_drafter(tmp_path / "export")
    assert export.config.causal_head and export.config.draft_shift and export.config.block_size == 6
    again = _args(target_dir, tmp_path / "tune", "--init", str(tmp_path / "export"), "--draft-shift", "--steps", "1")
    with pytest.raises(ValueError, match="--causal-head differs from --init .*'s dflash_config.causal_head"):
        DrafterTrainer(again, streams=streams)


def test_kl_over_a_verifier_is_refused(target_dir, tmp_path, streams):
    args = _args(target_dir, tmp_path, "--loss", "kl", "--verifier", "127.0.0.1:1", "--steps", "1")
    with pytest.raises(ValueError, match="the Features RPC of --verifier carries no logits"):
        DrafterTrainer(args, streams=streams)
