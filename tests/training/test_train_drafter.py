"""The DFlash drafter trainer (tools/train_drafter.py, services/training/).

- the block attention mask equals its definition, checked element by element;
- train/serve consistency: the batched training forward gives, for every anchor, the same per-depth
  log-probs as DraftEngine.draft serving that context and anchor (several anchors per sequence,
  windowed and not, the serving context built from several commits);
- training steps reduce the loss on a fixed batch; a resumed run ends bitwise equal to an
  uninterrupted one; the export loads with load_drafter and in the drafter service's factory;
- end to end on a tiny random target: after a short training on the target's own greedy generations,
  tau measured through the scheduler + drafter gRPC service clearly beats the untrained drafter.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ddtree.drafter.engine as engine_module
from ddtree.config import DrafterConfig
from ddtree.drafter.engine import DraftEngine, SeqDraftInput
from ddtree.drafter.factory import make_engine
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG, write_random_target
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.tools.selftest.compare import assert_close
from ddtree.tools.train_drafter import add_arguments
from ddtree.training.drafter_data import BatchPool, DataSpec, TargetRunner, TokenStream, make_batch, sample_windows
from ddtree.training.drafter_forward import (
    block_attention_mask,
    block_hidden,
    block_inputs,
    block_labels,
    sample_anchors,
)
from ddtree.training.drafter_loss import block_loss, depth_weights
from ddtree.training.drafter_trainer import DrafterTrainer
from ddtree.training.served_tau import served_tau, walk
from scripts.eval.eval_drafter import measure_tau

VOCAB = 128
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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and much faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random target whose lm_head is sharpened x10: the same greedy choices (its greedy
    generations fall into short cycles, a very predictable continuation), but logits large enough
    for a drafter sharing that lm_head to become confident, as with a trained target."""
    path = write_random_target(tmp_path_factory.mktemp("tiny-target"), TINY, seed=3)
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * 10
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def streams():
    g = torch.Generator().manual_seed(0)
    return {"code": TokenStream("code", torch.randint(2, VOCAB - 1, (20_000,), generator=g), None)}


def _args(target_dir, run_dir, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(
        [
            "--target",
            str(target_dir),
            "--corpus",
            "-",
            "--run-dir",
            str(run_dir),
            "--batch",
            "8",
            "--prompt-min",
            "8",
            "--prompt-max",
            "32",
            "--gen-tokens",
            "64",
            "--anchors",
            "16",
            "--lr",
            "3e-3",
            "--warmup",
            "10",
            "--log-every",
            "1000",
            *extra,
        ]
    )


# ------------------------------------------------------------------------------------------------ mask


@pytest.mark.parametrize("window", [0, 5])
def test_block_mask_matches_definition(window):
    g = torch.Generator().manual_seed(1)
    s, t, b = 3, 29, 4
    anchors = sample_anchors(1, t - b + 1, 6, s, g)
    mask = block_attention_mask(anchors, t, b, window)
    m = anchors.shape[1]
    assert mask.shape == (s, m * b, t + m * b) and mask.dtype == torch.bool
    want = torch.zeros_like(mask)
    for i in range(s):
        for q in range(m * b):
            a = int(anchors[i, q // b])
            for k in range(t + m * b):
                if k < t:
                    want[i, q, k] = k < a and (window == 0 or k >= a - window)
                else:
                    want[i, q, k] = (k - t) // b == q // b
    assert torch.equal(mask, want)
    assert anchors.min() >= 1 and anchors.max() <= t - b + 1
    assert all(len(set(row.tolist())) == m for row in anchors), "anchors of a sequence are distinct"


def test_labels_are_the_targets_greedy_choices_along_the_block():
    greedy = torch.arange(100).view(2, 50) * 10
    anchors = torch.tensor([[3, 20], [7, 40]])
    labels = block_labels(greedy, anchors, 4)  # slot k <- greedy[a + k - 1]
    assert labels.tolist() == [[[30, 40, 50], [200, 210, 220]], [[570, 580, 590], [900, 910, 920]]]
    ids = block_inputs(torch.arange(100).view(2, 50), anchors, 4, mask_token_id=99)
    assert ids[1, 1].tolist() == [90, 99, 99, 99]


# ---------------------------------------------------------------------------------- train/serve parity


def _serving_logprobs(engine: DraftEngine, inputs: list[SeqDraftInput], monkeypatch) -> list[torch.Tensor]:
    """Run DraftEngine.draft and capture the [B-1, V] logits it builds its tree from."""
    seen = []
    real = engine_module.topk_logprobs

    def spy(logits, k):
        seen.append(torch.log_softmax(logits.double(), dim=-1))
        return real(logits, k)

    monkeypatch.setattr(engine_module, "topk_logprobs", spy)
    for one in inputs:
        engine.draft([one])
    monkeypatch.setattr(engine_module, "topk_logprobs", real)
    return seen


@pytest.mark.parametrize("window", [0, 9])
def test_training_forward_matches_serving(target, target_dir, tmp_path, monkeypatch, window):
    drafter_dir = write_random_drafter(tmp_path / "d", TINY, seed=5, block_size=6, num_layers=2)
    model = load_drafter(drafter_dir)
    cfg = model.config
    s, t = 2, 40
    ids = torch.randint(2, VOCAB - 1, (s, t), generator=torch.Generator().manual_seed(2))
    taps, _ = TargetRunner(target, cfg.target_layer_ids, torch.float32).prefill(ids)
    anchors = torch.tensor([[3, 17, 30], [1, 12, 35]])
    embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    with torch.no_grad():
        hidden = block_hidden(
            model, taps, embed_w[block_inputs(ids, anchors, cfg.block_size, cfg.mask_token_id)], anchors, window
        )
        train_lp = torch.log_softmax(
            model.compute_logits(hidden[:, :, 1:].reshape(-1, cfg.hidden_size), head_w).double(), -1
        ).view(s, 3, cfg.block_size - 1, -1)

    engine = DraftEngine(model, embed_w, head_w, window=window, default_budget=4)
    for i in range(s):
        # As the verifier drives it: one sequence, commits arriving step by step (trimmed to the
        # window, as services/verifier/step/commit.py trims them), anchor = the next token.
        inputs, end = [], 0
        for j, a in enumerate(anchors[i].tolist()):
            start = max(end, a - window) if window else end
            inputs.append(
                SeqDraftInput(
                    seq_id=f"s{i}",
                    commit_token_ids=tuple(ids[i, start:a].tolist()),
                    commit_start=start,
                    commit_features=taps[i, start:a],
                    root_token_id=int(ids[i, a]),
                    reset=j == 0,
                )
            )
            end = a
        served = _serving_logprobs(engine, inputs, monkeypatch)
        for j in range(3):
            assert_close(
                f"seq {i} anchor {int(anchors[i, j])} window {window}",
                train_lp[i, j],
                served[j],
                abs_tol=2e-5,
                rel_tol=1e-4,
            )


def test_generated_batches_match_a_plain_forward_over_the_result(target, streams):
    """The decode loop's taps and choices equal one causal forward over the finished sequences, and
    every generated token is the target's argmax (so labels there are its greedy rollout)."""
    runner = TargetRunner(target, (0, 2), torch.float32)
    prompts = sample_windows(streams, 3, 10, torch.Generator().manual_seed(5), prompts=True)
    batch = runner.generate(prompts, 12)
    assert batch.anchor_lo == 10 and batch.shape == (3, 22)
    taps, greedy = runner.prefill(batch.ids)
    assert_close("decode taps", batch.taps, taps, abs_tol=1e-5, rel_tol=1e-4)
    assert torch.equal(batch.greedy[:, 9:], greedy[:, 9:])
    assert torch.equal(batch.ids[:, 10:], batch.greedy[:, 9:-1])
    corpus = make_batch(0, DataSpec("corpus", 2, 0, 0, 0, 24, seed=1), streams, runner)
    assert corpus.anchor_lo == 1 and corpus.shape == (2, 24) and bool((corpus.greedy >= 0).all())


# ------------------------------------------------------------------------------------------- training


def test_training_steps_reduce_the_loss_on_a_fixed_batch(target, tmp_path, streams):
    model = load_drafter(write_random_drafter(tmp_path / "d", TINY, seed=6, block_size=8)).train()
    cfg = model.config
    prompts = sample_windows(streams, 4, 16, torch.Generator().manual_seed(3), prompts=True)
    batch = TargetRunner(target, cfg.target_layer_ids, torch.float32).generate(prompts, 48)
    assert torch.equal(batch.ids[:, 17:], batch.greedy[:, 16:-1]), "generated tokens are the target's argmax"
    anchors = sample_anchors(batch.anchor_lo, batch.ids.shape[1] - 7, 12, 4, torch.Generator().manual_seed(4))
    embeds = target.model.embed_tokens.weight.detach()[block_inputs(batch.ids, anchors, 8, cfg.mask_token_id)]
    labels = block_labels(batch.greedy, anchors, 8)
    weights = depth_weights(8, 4.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        out = block_loss(
            model, block_hidden(model, batch.taps, embeds, anchors), target.lm_head.weight.detach(), labels, weights
        )
        losses.append(float(out.loss.detach()))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    # A random target's lm_head is small (logits ~0.2), so the CE falls slowly from ln(V) even as the
    # argmax labels get learnt.
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.5, losses
    # Chunked (checkpointed) logits give the same loss and gradients as one pass.
    hidden = block_hidden(model, batch.taps, embeds, anchors)
    whole = block_loss(model, hidden, target.lm_head.weight.detach(), labels, weights)
    chunked = block_loss(model, hidden, target.lm_head.weight.detach(), labels, weights, chunk_rows=50)
    g1 = torch.autograd.grad(whole.loss, model.fc.weight, retain_graph=True)[0]
    g2 = torch.autograd.grad(chunked.loss, model.fc.weight)[0]
    assert_close("chunked loss", chunked.loss.detach(), whole.loss.detach())
    assert_close("chunked grad", g2, g1)


def test_resume_reproduces_an_uninterrupted_run(target_dir, tmp_path, streams):
    common = ("--steps", "6", "--pool", "3", "--val-batches", "0", "--save-every", "100")
    straight = DrafterTrainer(_args(target_dir, tmp_path / "a", *common), streams=streams)
    straight.run()

    first = DrafterTrainer(_args(target_dir, tmp_path / "b", *common), streams=streams)
    for _ in range(4):
        first._logline(first._train_step())
    first.save()
    with pytest.raises(ValueError, match="--resume"):
        DrafterTrainer(_args(target_dir, tmp_path / "b", *common), streams=streams)
    with pytest.raises(ValueError, match="lr"):
        DrafterTrainer(_args(target_dir, tmp_path / "b", *common, "--resume", "--lr", "1e-3"), streams=streams)
    resumed = DrafterTrainer(_args(target_dir, tmp_path / "b", *common, "--resume"), streams=streams)
    assert resumed.step == 4
    resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert la == lb


def test_pool_batches_are_deterministic_and_cached(tmp_path):
    built = []
    pool = BatchPool(tmp_path, 2, lambda i: built.append(i) or _fake_batch(i))
    assert torch.equal(pool.get(0).ids, pool.get(2).ids) and built == [0]
    assert torch.equal(pool.get(1).taps, _fake_batch(1).taps) and built == [0, 1]


def _fake_batch(i):
    from ddtree.training.drafter_data import TargetBatch

    g = torch.Generator().manual_seed(i)
    return TargetBatch(
        torch.randint(0, 9, (2, 12), generator=g),
        torch.randn(2, 12, 4, generator=g),
        torch.randint(0, 9, (2, 12), generator=g),
        3,
    )


# ---------------------------------------------------------------------------------- export + tau


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory, streams):
    run = tmp_path_factory.mktemp("run")
    trainer = DrafterTrainer(
        _args(
            target_dir, run, "--steps", "160", "--pool", "16", "--save-every", "80", "--anchors", "48", "--lr", "8e-3"
        ),
        streams=streams,
        val_streams=streams,
    )
    summary = trainer.run()
    return run, trainer, summary


def test_export_loads_in_load_drafter_and_the_drafter_service(trained, target_dir):
    run, trainer, summary = trained
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == trainer.model.config.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == list(trainer.model.config.target_layer_ids)
    assert config["block_size"] == 8 and config["num_target_layers"] == TINY["num_hidden_layers"]
    assert config["hidden_size"] == TINY["hidden_size"] and config["num_hidden_layers"] == 2
    loaded = load_drafter(export)
    state = trainer.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    engine = make_engine(DrafterConfig(), str(export), str(target_dir))
    assert engine.info()["block_size"] == 8
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 161))
    assert [r["step"] for r in log if "val_loss" in r] == [0, 80, 160, 160]
    assert summary["val_chain_tau"] > 2.0, summary


def test_trained_drafter_beats_the_untrained_one_through_the_services(trained, target_dir, streams):
    run, _, _ = trained
    prompts = sample_windows(streams, 4, 24, torch.Generator().manual_seed(99), prompts=True).tolist()
    before = measure_tau(target_dir, run / "init", prompts, budget=16, tokens=64, max_batch=4)
    after = measure_tau(target_dir, run / "export", prompts, budget=16, tokens=64, max_batch=4)
    print(f"tau untrained {before['tau']:.3f}, trained {after['tau']:.3f}")
    assert before["generated_tokens"] == after["generated_tokens"] == 4 * 64
    assert before["tau"] < 1.2 and after["tau"] > before["tau"] + 0.8, (before["tau"], after["tau"])


def test_init_starts_from_a_trained_drafter(trained, target_dir, tmp_path, streams):
    """--init: a fine-tuning run starts from the given checkpoint's weights (and architecture), not at random."""
    run, trainer, _ = trained
    tuned = DrafterTrainer(
        _args(
            target_dir,
            tmp_path / "ft",
            "--steps",
            "2",
            "--pool",
            "2",
            "--val-batches",
            "0",
            "--init",
            str(run / "export"),
        ),
        streams=streams,
    )
    source = load_drafter(run / "export").state_dict()
    assert all(torch.equal(v, source[k]) for k, v in tuned.model.state_dict().items())
    with pytest.raises(ValueError, match="drafter checkpoint"):
        DrafterTrainer(
            _args(target_dir, tmp_path / "bad", "--steps", "2", "--init", str(tmp_path / "missing")), streams=streams
        )


# ------------------------------------------------------------------------------- the served walk


def test_walk_steps_from_each_stop_to_the_next_anchor():
    accepted = [2, 0, 0, 1, 0, 3, 0]  # by hand: 0 (+3) -> 3 (+2) -> 5 (+4) -> 9, past the end
    calls = []
    steps = walk(lambda j: calls.append(j) or accepted[j], len(accepted))
    assert steps == [3, 2, 4] and calls == [0, 3, 5]


def _served_run(engine: DraftEngine, batch, row: int, budget: int, chain: bool, block: int) -> list[int]:
    """A greedy generation of the batch's sequence `row` as the verifier drives the drafter service: commits
    arriving step by step, the tree of each step walked by the verifier's accept rule along the target's
    greedy choices (the sequence is the target's own greedy text, so choice at a node of depth d = greedy[a + d])."""
    from ddtree.verifier.sampling.accept import accept

    t = batch.ids.shape[1]
    steps, a, end = [], batch.anchor_lo, 0
    while a <= t - block:
        seq = SeqDraftInput(
            seq_id=f"r{row}-{budget}-{chain}",
            commit_token_ids=tuple(batch.ids[row, end:a].tolist()),
            commit_start=end,
            commit_features=batch.taps[row, end:a],
            root_token_id=int(batch.ids[row, a]),
            budget=budget,
            reset=end == 0,
            chain=chain,
        )
        tree = engine.draft([seq])[0]
        choice = [int(batch.greedy[row, a + d]) for d in (0, *tree.depths)]
        accepted = len(accept(tree, int(batch.ids[row, a]), choice).accepted_tokens) - 1
        steps.append(accepted + 1)
        end, a = a, a + accepted + 1
    return steps


def test_validation_walk_is_what_the_drafter_service_accepts(trained, target, streams):
    """served_tau's walk over generated sequences, from the training forward, takes the same steps as a greedy
    run through DraftEngine and the verifier's accept rule: chains and trees of 4 and 12 nodes."""
    _, trainer, summary = trained
    model = trainer.model.eval()
    block = model.config.block_size
    runner = TargetRunner(target, model.config.target_layer_ids, torch.float32)
    batch = runner.generate(sample_windows(streams, 2, 12, torch.Generator().manual_seed(7), prompts=True), 48)
    embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    got = served_tau(model, [batch], embed_w, head_w, window=0, budgets=[4, 12])
    engine = DraftEngine(model, embed_w, head_w, window=0)
    for key, budget, chain in (
        ("walk_chain_tau", block - 1, True),
        ("walk_tau_b4", 4, False),
        ("walk_tau_b12", 12, False),
    ):
        steps = [s for row in range(2) for s in _served_run(engine, batch, row, budget, chain, block)]
        assert got[key] == pytest.approx(sum(steps) / len(steps), abs=1e-12), key
    assert got["walk_tau_b12"] > 1.5, got  # a trained drafter: the walk is not trivially one token a step
    assert {"val_walk_chain_tau", "val_walk_tau_b16"} <= summary.keys()
