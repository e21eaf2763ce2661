"""`ddtree train target`: train the demo target (our DeepseekV3ForCausalLM: MLA + MoE + YaRN) from scratch on
the CPU, on a corpus written by `python -m scripts.data.build_corpus`.

    ddtree train target --corpus DIR --out RUN_DIR [--config JSON] [--steps N] [--seq-len L] [--batch B]
                        [--lr LR] [--resume] [--minutes M]

RUN_DIR gets `tokenizer/` (trained on the corpus unless --tokenizer is given), `tokens/` (the tokenised
splits), `ckpt.pt` (model + optimizer + step + data RNG, written every --ckpt-minutes, on SIGTERM/Ctrl-C and
at the end), `metrics.jsonl` (one line per logged step) and `export/`, an HF-layout checkpoint
(config.json + model.safetensors + tokenizer files) that `ddtree.models.checkpoint.loader.load_target` reads.

Training: AdamW, linear warmup then cosine decay to lr/10 over --steps; batches of --batch windows of
--seq-len + 1 tokens drawn from the three kinds with probabilities --mix (code, prose, chat); the router's
`e_score_correction_bias` follows DeepSeek-V3's aux-loss-free rule after every step. --minutes stops early
(checkpoint + export) when the wall-clock budget runs out. `--resume` continues exactly where the
checkpoint left off: same batches, same parameters as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ddtree.models.checkpoint.random import DEFAULT_TARGET_CONFIG
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.training_forward import training_forward, update_expert_bias
from ddtree.models.dtypes import TORCH_DTYPES
from ddtree.training.corpus import KINDS, read_documents
from ddtree.training.progress import Progress
from ddtree.training.schedule import lr_at

# The demo target: Kimi-K2-shaped (MLA with q/kv LoRA, sigmoid router with 1 shared expert, dense first
# layer, YaRN with Kimi's betas). YaRN's original_max_position_embeddings is set to the training length.
DEMO_TARGET_CONFIG: dict[str, Any] = {
    **DEFAULT_TARGET_CONFIG,
    "vocab_size": 8192,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 5,
    "n_routed_experts": 4,
    "rope_scaling": {**DEFAULT_TARGET_CONFIG["rope_scaling"], "factor": 8.0, "original_max_position_embeddings": 1024},
    "eos_token_id": [1, 2],  # [EOS], <|im_end|>
}
DEFAULT_MIX = (0.45, 0.30, 0.25)  # code, prose, chat
CKPT = "ckpt.pt"
DEFAULT_STEPS = 900
MIN_LR_RATIO = 0.1  # the cosine decays to lr / 10
EOS_ID = 1


# ---- data ----------------------------------------------------------------------------------------------
def tokenize_corpus(corpus: pathlib.Path, tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    """tokens/{split}_{kind}.pt: int32 [N], documents joined by [EOS] (which also ends the last one)."""
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for split in ("train", "heldout"):
        for kind in KINDS:
            path = out / f"{split}_{kind}.pt"
            if path.exists():
                continue
            ids: list[int] = []
            for enc in tok.encode_batch(read_documents(corpus, split, kind), add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(EOS_ID)
            tmp = path.with_suffix(".tmp")
            torch.save(torch.tensor(ids, dtype=torch.int32), tmp)
            os.replace(tmp, path)


def load_tokens(tokens_dir: pathlib.Path, split: str) -> dict[str, torch.Tensor]:
    return {kind: torch.load(tokens_dir / f"{split}_{kind}.pt") for kind in KINDS}


def sample_batch(
    streams: dict[str, torch.Tensor], mix: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """int64 [batch, seq_len + 1]: per row a kind drawn from `mix`, then a uniform window of that stream."""
    kinds = torch.multinomial(mix, batch, replacement=True, generator=gen).tolist()
    rows = []
    for k in kinds:
        stream = streams[KINDS[k]]
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start : start + seq_len + 1])
    return torch.stack(rows).long()


# ---- model ---------------------------------------------------------------------------------------------
def make_config(base: dict[str, Any], seq_len: int) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    rs = cfg.get("rope_scaling")
    if rs and rs.get("type", rs.get("rope_type")) == "yarn":
        rs["original_max_position_embeddings"] = seq_len
        rs["factor"] = cfg["max_position_embeddings"] / seq_len
    return cfg


def init_model(config: DeepseekV3Config, seed: int) -> DeepseekV3ForCausalLM:
    """N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2·layers), norms 1, bias 0."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    std = config.initializer_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * config.num_hidden_layers))
            else:
                p.normal_(0.0, std)
    return model


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    c = model.config
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    active = total - experts + moe_layers * c.num_experts_per_tok * per_expert
    return {"total": total, "active_per_token": active, "embedding+lm_head": 2 * c.vocab_size * c.hidden_size}


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def loss_fn(model: DeepseekV3ForCausalLM, batch: torch.Tensor, bf16: bool = False):
    """Mean next-token cross-entropy; bf16 autocasts the matmuls (fp32 master weights, fp32 loss)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = training_forward(model, batch[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    return loss, out.expert_load


# ---- checkpoints and export ----------------------------------------------------------------------------
def save_checkpoint(run: pathlib.Path, model, opt, step: int, gen: torch.Generator, meta: dict) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "data_rng": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "meta": meta,
    }
    tmp = run / f".{CKPT}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, run / CKPT)


def export(
    run: pathlib.Path,
    model: DeepseekV3ForCausalLM,
    tokenizer_dir: pathlib.Path,
    info: dict,
    dtype: torch.dtype = torch.float32,
    out: pathlib.Path | None = None,
) -> pathlib.Path:
    """HF-layout checkpoint: config.json, model.safetensors (router stays fp32), tokenizer files."""
    from safetensors.torch import save_file

    out = out or run / "export"
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = model.config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    tensors = {
        n: t.detach().to(torch.float32 if n.endswith(fp32) else dtype).contiguous()
        for n, t in model.state_dict().items()
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", 0o644)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ---- training loop ---------------------------------------------------------------------------------------
def run_meta(args: argparse.Namespace, ckpt: dict | None, tokenizer_dir: pathlib.Path, corpus: pathlib.Path) -> dict:
    """The run's settings: the checkpoint's when resuming (with a new --steps re-planning the rest of the
    cosine schedule), else from the flags."""
    if ckpt is not None:
        meta = ckpt["meta"]
        if args.steps is not None and args.steps != meta["steps"]:
            print(f"--steps {args.steps} replaces the checkpoint's {meta['steps']}", file=sys.stderr, flush=True)
            meta["steps"] = args.steps
        return meta
    base = json.loads(pathlib.Path(args.config).read_text()) if args.config else DEMO_TARGET_CONFIG
    return {
        "config": make_config(base, args.seq_len),
        "steps": args.steps or DEFAULT_STEPS,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "mix": list(args.mix),
        "bf16": args.bf16,
        "bias_gamma": args.bias_gamma,
        "seed": args.seed,
        "tokenizer": str(tokenizer_dir),
        "corpus": str(corpus),
    }


def stop_reason(step: int, total: int, signum: int | None, stop_at: int | None) -> str:
    if step >= total:
        return "done"
    if signum:
        return f"signal {signum}"
    return "--stop-at" if step == stop_at else "time budget"


def train(args: argparse.Namespace) -> pathlib.Path:
    run = pathlib.Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    corpus = pathlib.Path(args.corpus)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer_dir = pathlib.Path(args.tokenizer) if args.tokenizer else run / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        from ddtree.training.tokenizer_training import write_tokenizer

        write_tokenizer(corpus, tokenizer_dir)
    tokenize_corpus(corpus, tokenizer_dir, run / "tokens")
    streams = load_tokens(run / "tokens", "train")

    ckpt = torch.load(run / CKPT, weights_only=False) if args.resume and (run / CKPT).exists() else None
    meta = run_meta(args, ckpt, tokenizer_dir, corpus)
    config = DeepseekV3Config.from_dict(meta["config"])
    model = init_model(config, meta["seed"]).train()
    opt = make_optimizer(model, meta["lr"], meta["weight_decay"])
    gen = torch.Generator().manual_seed(meta["seed"])
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step = ckpt["step"]
        print(f"resumed from {run / CKPT} at step {step}", file=sys.stderr, flush=True)
    total, B, L = meta["steps"], meta["batch"], meta["seq_len"]
    mix = torch.tensor(meta["mix"], dtype=torch.float64)
    params = count_parameters(model)
    print(f"params {params}; {total} steps of {B}x{L} tokens", file=sys.stderr, flush=True)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    progress = Progress(total, start=step, every=args.log_every)
    start = time.time()
    deadline = start + args.minutes * 60 if args.minutes else math.inf
    last_ckpt, start_step, ema = start, step, None
    metrics = open(run / "metrics.jsonl", "a")
    try:
        end = min(total, args.stop_at) if args.stop_at else total
        while step < end and stop["signal"] is None and time.time() < deadline:
            lr = lr_at(step, total, meta["warmup"], meta["lr"], MIN_LR_RATIO)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = sample_batch(streams, mix, B, L, gen)
            loss, loads = loss_fn(model, batch, meta.get("bf16", False))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            update_expert_bias(model, loads, meta["bias_gamma"])
            step += 1
            value = loss.item()
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            elapsed = time.time() - start
            tok_s = (step - start_step) * B * L / elapsed
            eta = (total - step) * elapsed / (step - start_step)
            progress.update(step, eta_s=min(eta, deadline - time.time()), loss=ema, lr=lr, tok_s=round(tok_s))
            if step % args.log_every == 0 or step == total:
                balance = {i: round(float(x.max()) / max(1.0, float(x.float().mean())), 2) for i, x in loads.items()}
                record = dict(step=step, loss=round(value, 4), loss_ema=round(ema, 4), lr=lr,
                              grad_norm=round(float(gnorm), 3), tok_s=round(tok_s), elapsed_s=round(elapsed),
                              max_over_mean_load=balance)  # fmt: skip
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if time.time() - last_ckpt >= args.ckpt_minutes * 60:
                save_checkpoint(run, model, opt, step, gen, meta)
                last_ckpt = time.time()
    finally:
        progress.close()
        metrics.close()
        for s, h in old.items():
            signal.signal(s, h)
    save_checkpoint(run, model, opt, step, gen, meta)
    why = stop_reason(step, total, stop["signal"], args.stop_at)
    print(f"stopped at step {step}/{total} ({why}); checkpoint {run / CKPT}", file=sys.stderr, flush=True)
    info = {
        "step": step,
        "steps": total,
        "params": params,
        "loss_ema": ema,
        "stopped": why,
        **{k: v for k, v in meta.items() if k != "config"},
    }
    if args.export:
        out = export(run, model.eval(), tokenizer_dir, info, TORCH_DTYPES[args.export_dtype])
        print(f"exported {out}", file=sys.stderr, flush=True)
    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `target` under `ddtree train`."""
    p = subparsers.add_parser(
        "target",
        help="train the demo target (DeepSeek-V3 architecture) on the CPU",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--corpus", required=True, help="corpus dir written by `python -m scripts.data.build_corpus`")
    p.add_argument("--out", required=True, help="run dir: tokenizer, tokens, ckpt.pt, metrics.jsonl, export/")
    p.add_argument("--config", default="", help="model config.json (HF spelling); default: the demo config")
    p.add_argument("--tokenizer", default="", help="tokenizer dir (default: train one on the corpus into OUT)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"total optimizer steps (default {DEFAULT_STEPS}); with --resume, re-plans the schedule",
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free router bias step")
    p.add_argument("--mix", type=float, nargs=3, default=DEFAULT_MIX, metavar=("CODE", "PROSE", "CHAT"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--minutes", type=float, default=0, help="wall-clock budget; 0 = none")
    p.add_argument("--ckpt-minutes", type=float, default=5)
    p.add_argument("--stop-at", type=int, default=0, help="stop (checkpoint + export) at this step; --resume continues")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 autocast for the matmuls (faster on CPUs with AVX512-BF16 or AMX)",
    )
    p.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-export", dest="export", action="store_false")
    p.set_defaults(fn=lambda a: (train(a), 0)[1])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.tools.train_target")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["target", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
