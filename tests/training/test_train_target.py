"""`ddtree train target` on a tiny corpus and model: the loss falls, resume is exact, the export loads."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.cli import build_parser
from ddtree.models.checkpoint.loader import load_target
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.tools.train_target import DEMO_TARGET_CONFIG, init_model, loss_fn, make_optimizer
from ddtree.training.tokenizer_training import write_tokenizer
from scripts.data.build_corpus import build

VOCAB = 512
TINY = {**DEMO_TARGET_CONFIG, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 256}  # fmt: skip
EMPTY = torch.empty(0, dtype=torch.int64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("train-target")
    build(d / "corpus", code_mb=0.1, prose_mb=0.05, chat_mb=0.05, heldout=0.1)
    write_tokenizer(d / "corpus", d / "tok", vocab_size=VOCAB)
    (d / "tiny.json").write_text(json.dumps(TINY))
    return d


def _train(setup, out, *extra):
    args = build_parser().parse_args([
        "train", "target", "--corpus", str(setup / "corpus"), "--out", str(out), "--tokenizer", str(setup / "tok"),
        "--config", str(setup / "tiny.json"), "--steps", "6", "--seq-len", "32", "--batch", "2", "--warmup", "2",
        "--threads", "1", "--log-every", "1", *extra])  # fmt: skip
    return args.fn(args)


def test_loss_goes_down_on_a_repeated_batch():
    torch.manual_seed(0)
    model = init_model(DeepseekV3Config.from_dict(TINY), seed=0).train()
    opt = make_optimizer(model, 3e-3, 0.0)
    batch = torch.randint(0, VOCAB, (2, 33))
    losses = []
    for _ in range(15):
        loss, _ = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_resume_is_exact_and_export_loads(setup, tmp_path):
    assert _train(setup, tmp_path / "full") == 0
    assert _train(setup, tmp_path / "split", "--stop-at", "3") == 0
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["step"] == 3
    assert _train(setup, tmp_path / "split", "--resume") == 0
    full = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)
    split = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    assert full["step"] == split["step"] == 6
    for name, t in full["model"].items():
        assert torch.equal(t, split["model"][name]), name
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))

    export = tmp_path / "full" / "export"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in export.iterdir()
    }
    loaded = load_target(export)
    ref = DeepseekV3ForCausalLM(loaded.config).eval()
    ref.load_state_dict(full["model"])
    ids = torch.randint(0, VOCAB, (20,))
    meta = AttentionMetadata((SeqAttention(0, 20, EMPTY, torch.arange(20)),))
    logits = [m(ids, torch.arange(20), meta, m.new_kv_cache(20)).logits for m in (loaded, ref)]
    assert torch.equal(logits[0], logits[1])
    rope = json.loads((export / "config.json").read_text())["rope_scaling"]
    assert rope["original_max_position_embeddings"] == 32 and rope["factor"] == 256 / 32
