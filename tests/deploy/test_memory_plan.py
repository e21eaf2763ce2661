"""The memory plan per GPU (models/checkpoint/memory_plan.py) and the deployment files that state its numbers.

- weights are counted in the dtype the loader keeps: the router's weight in its stored dtype, its bias fp32;
- `ddtree inspect --drafter` places the drafter's ranks beside the verifier's at the verifier's --tp by
  default: Kimi K2.6 INT4 on 8 x 96 GB, default flags, >= 2 GB headroom on every GPU, >= 128k tokens of context;
- each Kimi K2.6 env file (8 x 96 GB, 8 x 141 GB) names the `ddtree inspect --device-memory-gb --drafter`
  command whose plan it follows and what that plan says; the settings compose derives from the file give the
  same plan, it fits, and the numbers stated are the ones `inspect` prints now;
- compose.kimi-k26.yaml's sizes are inspect's;
- the verifier and the drafter refuse a plan that does not fit, with the plan in the message, before any
  weight is read (CUDA's memory query stubbed: no GPU here).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch
import yaml

from ddtree.cli import main
from ddtree.config import DrafterConfig, VerifierConfig, config_from_flags
from ddtree.models.checkpoint.memory_plan import MemoryPlanError, format_plan
from ddtree.models.checkpoint.weight_bytes import config_tensors, held_tensor_bytes, read_checkpoint_weights
from ddtree.tools.gpu_plan import deployment_configs, deployment_plan
from tests.support.paths import REPO

DOCKER = REPO / "docker"
KIMI = REPO / "docs" / "kimi_k26_config.json"
KIMI_DRAFTER = REPO / "docs" / "kimi_k26_dflash_config.json"
ENV_FILES = {"kimi-k26.env": 96, "kimi-k26-141gb.env": 141}


def _env(name: str) -> tuple[dict[str, str], list[str]]:
    lines = (DOCKER / name).read_text().splitlines()
    values = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return values, [line for line in lines if line.startswith("#")]


def _service_env(service: str, env: dict[str, str]) -> dict[str, str]:
    """The service's environment in compose.yaml with the env file's values (compose's ${VAR:-default})."""
    svc = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"][service]

    def sub(value: str) -> str:
        return re.sub(r"\$\{([A-Z0-9_]+)(:-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(3) or "", value)

    return {k: sub(str(v)) for k, v in svc["environment"].items()}


def test_router_weight_counts_in_its_stored_dtype_as_the_loader_keeps_it():
    w = read_checkpoint_weights(KIMI, tp=8, dtype_bytes=2)
    gate = next(s for s in config_tensors(w.config) if s.name.endswith("mlp.gate.weight"))
    assert w.stored[gate.name][0] == "bf16"  # stored bf16, held bf16 (loader: no fp32 copy of the router)
    assert held_tensor_bytes(gate, w.stored[gate.name], gate.numel, 4) == 2 * gate.numel
    bias = next(s for s in config_tensors(w.config) if s.name.endswith("e_score_correction_bias"))
    assert held_tensor_bytes(bias, w.stored[bias.name], bias.numel, 2) == 4 * bias.numel
    embed = next(s for s in config_tensors(w.config) if s.name == "model.embed_tokens.weight")
    assert held_tensor_bytes(embed, w.stored[embed.name], 10, 2) == 20


@pytest.mark.parametrize("name", sorted(ENV_FILES))
def test_kimi_env_file_follows_the_plan_it_states(name, capsys):
    env, comments = _env(name)
    command = next(c for c in comments if c.startswith("# plan: "))[len("# plan: ") :]
    says = next(c for c in comments if c.startswith("# plan says: "))
    argv = shlex.split(command)
    assert argv[:2] == ["ddtree", "inspect"]
    gb = float(argv[argv.index("--device-memory-gb") + 1])
    assert gb == ENV_FILES[name] and argv[argv.index("--tp") + 1] == env["DDTREE_TP"]
    # the services' configs as compose makes them from this file, drafter on GPU 0
    verifier = config_from_flags(VerifierConfig, None, environ=_service_env("verifier", env))
    drafter = config_from_flags(DrafterConfig, None, environ=_service_env("drafter", env))
    plan = deployment_plan(str(KIMI), gb, verifier, drafter, KIMI_DRAFTER)
    assert plan.fits and len(plan.gpus) == 8
    assert plan.kv_tokens <= plan.largest_kv_tokens and verifier.max_context <= plan.kv_tokens
    # the command stated gives the same plan
    stated_v, stated_d = deployment_configs(
        8, False, argv[argv.index("--verifier-args") + 1], argv[argv.index("--drafter-args") + 1]
    )
    assert format_plan(deployment_plan(str(KIMI), gb, stated_v, stated_d, KIMI_DRAFTER)) == format_plan(plan)
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    assert format_plan(plan) in out
    t = plan.tightest
    expected = (
        f"# plan says: tightest GPU {t.index}, headroom {t.headroom / 1e9:.2f} GB; KV pool {plan.kv_tokens:,} "
        f"tokens; largest that fits {plan.largest_kv_tokens:,} tokens"
    )
    assert says == expected


def test_kimi_plan_on_96_gb_with_the_old_settings_does_not_fit():
    """8 GiB of KV per rank and the drafter's defaults on GPU 0 (the file before this plan): GPU 0 is over."""
    verifier, drafter = deployment_configs(8, False, "--kv-memory-gb 8", "--tp 1")
    plan = deployment_plan(str(KIMI), 96, verifier, drafter, KIMI_DRAFTER)
    assert not plan.fits and plan.tightest.index == 0
    assert [g.index for g in plan.gpus if g.headroom < 0] == [0]
    owners = {i.owner for i in plan.gpus[0].items}
    assert owners == {"verifier rank 0", "drafter"}
    whats = {i.what for i in plan.gpus[0].items if i.owner == "drafter"}
    assert {"weights", "target embedding + LM head copy", "CUDA graph buffers + pool", "runtime reserve"} <= whats


def test_inspect_json_has_the_plan(capsys):
    argv = ["inspect", str(KIMI), "--tp", "8", "--device-memory-gb", "141", "--drafter", str(KIMI_DRAFTER)]
    argv += ["--drafter-args", "--tp 1", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["memory_plan"]
    assert plan["fits"] is True and plan["tightest_gpu"] == 0 and len(plan["gpus"]) == 8
    gpu0 = {(i["owner"], i["what"]): i["bytes"] for i in plan["gpus"][0]["items"]}
    w = read_checkpoint_weights(KIMI, tp=8, dtype_bytes=2)
    assert gpu0[("verifier rank 0", "weights")] == w.bytes_per_rank
    assert gpu0[("drafter", "target embedding + LM head copy")] == 2 * 163840 * 7168 * 2
    assert plan["largest_kv_tokens"] * 70272 <= plan["gpus"][0]["headroom"] + gpu0[("verifier rank 0", "KV pool")]


def test_compose_override_states_inspects_sizes():
    text = (DOCKER / "compose.kimi-k26.yaml").read_text()
    w = read_checkpoint_weights(KIMI, tp=8, dtype_bytes=2)
    verifier, drafter = deployment_configs(8, False, "", "--tp 1")
    gpu0 = deployment_plan(str(KIMI), 141, verifier, drafter, KIMI_DRAFTER).gpus[0]
    drafter_bytes = {i.what: i.bytes for i in gpu0.items if i.owner == "drafter"}
    stored = sum(v[1] for v in w.stored.values())
    for stated in (
        f"{stored / 1e9:.2f} GB on disk",
        f"{w.bytes_per_rank / 1e9:.2f} GB of weights per rank",
        f"{w.config.kv_cache_width * w.config.num_hidden_layers * 2:,} B of latent",
        f"is {drafter_bytes['weights'] / 1e9:.2f} GB in bf16",
        f"({drafter_bytes['target embedding + LM head copy'] / 1e9:.2f} GB)",
        f"{drafter_bytes['weights'] / 2 / 1e9:.2f} B parameters",
    ):
        assert stated in " ".join(text.replace("#", " ").split()), stated


@pytest.fixture
def small_gpu(monkeypatch):
    """torch.cuda as a 2 GB GPU with 1 GB free, for the start-up checks (no CUDA here)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1_000_000_000, 2_000_000_000))


def test_verifier_refuses_before_reading_any_weight(default_ckpt, small_gpu, monkeypatch):
    from ddtree.verifier import engine

    def no_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(engine, "load_target", no_read)
    env = {"DDTREE_DEVICE": "cuda", "DDTREE_DTYPE": "bfloat16", "DDTREE_KV_MEMORY_GB": "4"}
    cfg = config_from_flags(VerifierConfig, None, environ=env)
    with pytest.raises(MemoryPlanError) as err:
        engine.build_engine(cfg, str(default_ckpt.target))
    msg = str(err.value)
    assert msg.startswith("verifier: the memory plan does not fit on GPU 0")
    assert "DOES NOT FIT" in msg and "KV pool" in msg and "weights" in msg and "free at start" not in msg


def test_drafter_refuses_before_reading_any_weight(default_ckpt, small_gpu, monkeypatch):
    from ddtree.drafter.factory import make_engine
    from ddtree.models.checkpoint import loader
    from ddtree.models.dflash import checkpoint as dflash_checkpoint

    def no_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(dflash_checkpoint, "load_drafter", no_read)
    monkeypatch.setattr(loader, "load_tensors", no_read)
    # the demo drafter fits in 1 GB; a window of 262144 rows for 16 contexts does not
    env = {"DDTREE_DEVICE": "cuda", "DDTREE_WINDOW": "262144", "DDTREE_CUDA_GRAPHS": "off"}
    cfg = config_from_flags(DrafterConfig, None, environ=env)
    with pytest.raises(MemoryPlanError) as err:
        make_engine(cfg, str(default_ckpt.drafter), str(default_ckpt.target))
    msg = str(err.value)
    assert msg.startswith("drafter: the memory plan does not fit on GPU 0")
    assert "draft contexts (16 x window 262144)" in msg and "DOES NOT FIT" in msg


def _drafter_rank_params(d: dict, tp: int) -> int:
    """One rank's DFlash parameters, written from the config's sizes: heads, KV heads and MLP columns / tp,
    fc split by its input rows, norms whole."""
    h, hd, kvh, inter = d["hidden_size"], d["head_dim"], d["num_key_value_heads"], d["intermediate_size"]
    taps = len(d["dflash_config"]["target_layer_ids"])
    q, kv = d["num_attention_heads"] * hd // tp, kvh * hd // tp
    layer = h * q + 2 * h * kv + q * h + 2 * hd + 2 * h + 3 * h * inter // tp
    return h * taps * h // tp + h + d["num_hidden_layers"] * layer + h


def test_inspect_json_plans_the_drafter_on_every_rank_of_8_x_96_gb(tmp_path, capsys):
    """The issue's plan: Kimi K2.6 INT4 + its DFlash drafter on 8 x 96 GB with the services' default flags,
    drafter rank r beside verifier rank r: every GPU keeps >= 2 GB, the plan holds >= 128k tokens."""
    (tmp_path / "config.json").write_text(KIMI_DRAFTER.read_text())
    argv = ["inspect", str(KIMI), "--tp", "8", "--device-memory-gb", "96", "--drafter", str(tmp_path), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    plan = report["memory_plan"]
    assert plan["fits"] is True and len(plan["gpus"]) == 8
    assert all(g["headroom"] >= 2e9 for g in plan["gpus"])
    assert report["max_context_tokens"] == plan["largest_kv_tokens"] >= 131072
    d = json.loads(KIMI_DRAFTER.read_text())
    for g in plan["gpus"]:
        items = {(i["owner"], i["what"]): i["bytes"] for i in g["items"]}
        r = g["index"]
        assert {o for o, _ in items} == {f"verifier rank {r}", f"drafter rank {r}"}
        assert items[(f"drafter rank {r}", "weights")] == 2 * _drafter_rank_params(d, 8)
        head = 2 * d["vocab_size"] // 8 * d["hidden_size"] * 2
        assert items[(f"drafter rank {r}", "target embedding + LM head (1/8 vocab)")] == head
        assert items.get((f"verifier rank {r}", "drafter feature ring"), 0) == (64 << 20 if r == 0 else 0)
        assert (f"drafter rank {r}", "CUDA graph buffers + pool") not in items  # eager at TP > 1
        assert items[(f"drafter rank {r}", "NCCL reserve")] == items[(f"verifier rank {r}", "NCCL reserve")]
        # the largest pool that fits leaves no GPU over
        assert plan["largest_kv_tokens"] * 70272 <= g["headroom"] + items[(f"verifier rank {r}", "KV pool")]
