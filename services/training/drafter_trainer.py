"""The DFlash drafter training run behind `ddtree train drafter` (tools/train_drafter.py has the flags).

One micro-batch: S sequences with the frozen target's taps and greedy choices at every position
(drafter_data.py), m random anchors per sequence, all m*S draft blocks in one batched drafter forward
under the block-sparse mask (drafter_forward.py; a causal head, `--causal-head`, under the causal one), the
depth-weighted cross-entropy against the target's choices, or with `--loss kl` the forward KL to the target's
own distributions (its top `--kd-topk` logits, kept by the in-process target; drafter_loss.py).
AdamW (no decay on norms), linear warmup + cosine decay (schedule.py),
gradient accumulation and clipping, bf16 autocast on CUDA with fp32 master weights.

Resume is exact: data batch i and the anchors of micro-batch i are functions of (seed, i) alone, and the
checkpoint holds the model, the optimizer, the step and the planned number of steps, so a run stopped
and resumed ends with the same weights, bit for bit, as an uninterrupted one (tested).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from ddtree.models.checkpoint.loader import load_target
from ddtree.models.dflash.checkpoint import load_drafter, write_random_drafter
from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.models.dtypes import TORCH_DTYPES
from ddtree.training.drafter_data import BatchPool, DataSpec, TargetBatch, TargetRunner, load_corpus, make_batch
from ddtree.training.drafter_forward import block_hidden, block_inputs, block_labels, block_teacher, sample_anchors
from ddtree.training.drafter_loss import block_kl_loss, block_loss, default_gamma, depth_weights
from ddtree.training.progress import Progress
from ddtree.training.schedule import lr_at, plan_steps
from ddtree.training.served_tau import served_tau
from ddtree.training.verifier_data import VerifierRunner, load_head

# Settings that may change between a run and its --resume; every other one must match the checkpoint.
RESUMABLE = {
    "target",
    "corpus",
    "run_dir",
    "export",
    "minutes",
    "save_every",
    "log_every",
    "threads",
    "resume",
    "device",
    "val_batches",
    "val_budget",
    "verifier",
    "service_token_file",
}
PROBE_STEPS = 3  # steps measured before a --minutes run fixes its schedule
# Flags newer than some checkpoints: a checkpoint without one was run at its default.
LATER_FLAGS = {"causal_head": False, "draft_shift": False, "loss": "ce", "kd_topk": 64, "kd_temperature": 1.0}


def _tap_ids(text: str) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text.strip() else None


def _mask_token(target_dir: Path, vocab: int, flag: int) -> int:
    if flag >= 0:
        return flag
    tok = target_dir / "tokenizer.json"
    if tok.is_file():
        mid = Tokenizer.from_file(str(tok)).token_to_id("[MASK]")
        if mid is not None and mid < vocab:
            return mid
    return vocab - 1


def _eos_id(target_dir: Path, target_config: dict) -> int:
    tok = target_dir / "tokenizer.json"
    if tok.is_file():
        eid = Tokenizer.from_file(str(tok)).token_to_id("[EOS]")
        if eid is not None:
            return eid
    eos = target_config.get("eos_token_id", 0)
    return int(eos[0] if isinstance(eos, list) else eos)


def export_drafter(model: DFlashDraftModel, path: Path, extra: dict | None = None) -> Path:
    """config.json (DFlash format, docs/design.md §6) + model.safetensors, written into a fresh dir."""
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"torch_dtype": str(model.dtype).removeprefix("torch.")}
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if extra is not None:
        (path / "training.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    return path


def _check_args(args: argparse.Namespace, needs_corpus: bool) -> None:
    """Raise ValueError naming the flag for settings a run cannot start with."""
    if args.steps <= 0 and args.minutes <= 0:
        raise ValueError("give --steps, --minutes, or both")
    if not (Path(args.target) / "config.json").is_file():
        raise ValueError(f"--target {args.target}: no config.json (expected an HF-layout checkpoint dir)")
    if needs_corpus and not Path(args.corpus).is_dir():
        raise ValueError(f"--corpus {args.corpus}: not a directory")
    if getattr(args, "verifier", "") and args.source == "corpus":
        raise ValueError("--source corpus needs the target in this process: --verifier gives generations only")
    if getattr(args, "loss", "ce") == "kl":
        if getattr(args, "verifier", ""):
            raise ValueError(
                "--loss kl needs the target's distributions: the Features RPC of --verifier carries no logits; "
                "train with the target in this process, or --loss ce"
            )
        if args.kd_topk < 0 or args.kd_temperature <= 0:
            raise ValueError(
                f"--kd-topk must be >= 0 and --kd-temperature > 0, got {args.kd_topk}, {args.kd_temperature}"
            )
    if getattr(args, "val_budget", 16) < 0:
        raise ValueError(f"--val-budget must be >= 0 (0 = the chain only), got {args.val_budget}")
    for name in ("batch", "anchors", "accum", "layers", "save_every", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


class DrafterTrainer:
    """One training run. `args` holds exactly the flags of ddtree.tools.train_drafter.add_arguments;
    `streams` / `val_streams` (kind -> TokenStream) replace the corpus in tests."""

    def __init__(self, args: argparse.Namespace, streams=None, val_streams=None, log=print):
        self.args, self.log = args, log
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        _check_args(args, needs_corpus=streams is None)
        self.run_dir = Path(args.run_dir)
        self.device = torch.device(
            "cuda"
            if args.device == "auto" and torch.cuda.is_available()
            else "cpu"
            if args.device == "auto"
            else args.device
        )
        cuda = self.device.type == "cuda"
        auto = torch.bfloat16 if cuda else torch.float32
        tdtype = auto if args.target_dtype == "auto" else TORCH_DTYPES[args.target_dtype]
        self.autocast = dict(device_type=self.device.type, dtype=torch.bfloat16, enabled=cuda)

        target_dir = Path(args.target)
        tcfg = json.loads((target_dir / "config.json").read_text())
        self.remote = getattr(args, "verifier", "")  # the target runs in that verifier (verifier_data.py)
        if self.remote:
            self.target = None
            self.embed_w, self.head_w = load_head(target_dir, tdtype, self.device)
        else:
            self.target = load_target(target_dir, dtype=tdtype, device=self.device)
            self.embed_w = self.target.model.embed_tokens.weight.detach()
            self.head_w = self.target.lm_head.weight.detach()

        ckpt_file = self.run_dir / "checkpoint.pt"
        self.state = None
        if ckpt_file.is_file():
            if not args.resume:
                raise ValueError(f"{ckpt_file} exists: pass --resume to continue it, or use another --run-dir")
            self.state = torch.load(ckpt_file, map_location="cpu", weights_only=False)
            self._check_resume(self.state["args"])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "args.json").write_text(json.dumps(vars(args), indent=2, sort_keys=True) + "\n")

        init_dir = self._initial_drafter(target_dir, tcfg)
        self.model = load_drafter(init_dir, dtype=torch.float32, device=self.device).train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        cfg = self.model.config
        self.block = cfg.block_size
        self.kl = getattr(args, "loss", "ce") == "kl"
        # KL (JetSpec): uniform over depths unless --gamma asks for DFlash's decay; CE: DFlash's decay
        gamma = args.gamma if self.kl else args.gamma or default_gamma(self.block)
        self.weights = depth_weights(self.block, gamma)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(0.9, 0.95),
        )
        self.step, self.total = 0, args.steps or 0
        if self.state is not None:
            self.model.load_state_dict(self.state["model"])
            self.opt.load_state_dict(self.state["optim"])
            self.step, self.total = self.state["step"], self.state["total_steps"]

        kinds = tuple(k for k in args.kinds.split(",") if k)
        eos = _eos_id(target_dir, tcfg)
        if streams is None:
            streams = load_corpus(args.corpus, target_dir, kinds, "train", eos, cache_dir=self.run_dir / "data")
        if val_streams is None and args.val_batches > 0:
            need = (args.prompt_max if args.source == "generate" else args.seq_len) + 1
            try:
                held = load_corpus(args.corpus, target_dir, kinds, "heldout", eos, cache_dir=self.run_dir / "data")
            except ValueError:
                held = {}
            # Kinds without enough held-out text are validated on other windows of the training text.
            val_streams = {k: held[k] if k in held and held[k].ids.numel() >= need else streams[k] for k in kinds}
        self.spec = DataSpec(
            args.source, args.batch, args.prompt_min, args.prompt_max, args.gen_tokens, args.seq_len, args.seed
        )
        self.spec.validate(self.block)
        self._check_data_cache(target_dir, kinds, cfg.target_layer_ids)
        taps_dtype = TORCH_DTYPES[args.taps_dtype]
        self.runner = self._runner(cfg.target_layer_ids, taps_dtype, tcfg)
        self.pool = BatchPool(
            self.run_dir / "data", args.pool, lambda i: make_batch(i, self.spec, streams, self.runner)
        )
        val_spec = dataclasses.replace(self.spec, seed=self.spec.seed + 1_000_000)
        self.val = BatchPool(
            self.run_dir / "data" / "val",
            max(args.val_batches, 0),
            lambda i: make_batch(i, val_spec, val_streams, self.runner),
        )
        self.data_s = self.train_s = 0.0
        self.fresh = 0

    def _runner(self, taps: tuple[int, ...], taps_dtype: torch.dtype, tcfg: dict):
        """The target in this process (TargetRunner), or the --verifier serving it (VerifierRunner)."""
        if not self.remote:
            return TargetRunner(self.target, taps, taps_dtype, teacher_topk=self.args.kd_topk if self.kl else None)
        token_file = getattr(self.args, "service_token_file", "")
        token = Path(token_file).read_text().strip() if token_file else ""
        runner = VerifierRunner(self.remote, taps, taps_dtype, token=token)
        runner.check(tcfg, self.args.prompt_max, self.args.gen_tokens)
        return runner

    def _initial_drafter(self, target_dir: Path, tcfg: dict) -> Path:
        """run_dir/init: the drafter training starts from (resumed runs load their checkpoint over it): a copy
        of --init (fine-tuning), or a random drafter for the target (same seed and flags: the same bytes)."""
        args, init_dir = self.args, self.run_dir / "init"
        if self.state is None:  # a fresh run: nothing of an earlier, unsaved one is reused
            shutil.rmtree(init_dir, ignore_errors=True)
            (self.run_dir / "train_log.jsonl").unlink(missing_ok=True)
        if self.state is None and getattr(args, "init", ""):
            src = Path(args.init)
            if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
                raise ValueError(f"--init {src}: needs config.json and model.safetensors (a drafter checkpoint)")
            init = json.loads((src / "config.json").read_text()).get("dflash_config") or {}
            for flag in ("causal_head", "draft_shift"):  # the head's attention is its own: never changed silently
                if bool(getattr(args, flag, False)) != bool(init.get(flag, False)):
                    raise ValueError(f"--{flag.replace('_', '-')} differs from --init {src}'s dflash_config.{flag}")
            init_dir.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copyfile(src / name, init_dir / name)
        if not (init_dir / "model.safetensors").is_file():
            hidden = int(tcfg["hidden_size"])
            heads = args.heads or (hidden // 128 if hidden >= 1024 else 4)
            kv = args.kv_heads or max(1, heads // 4 if heads >= 8 else heads // 2)
            write_random_drafter(
                init_dir,
                tcfg,
                seed=args.seed,
                block_size=args.block_size,
                num_layers=args.layers,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                intermediate_size=args.intermediate or None,
                mask_token_id=_mask_token(target_dir, int(tcfg["vocab_size"]), args.mask_token_id),
                target_layer_ids=_tap_ids(args.target_layer_ids),
                attention={
                    "causal_head": bool(getattr(args, "causal_head", False)),
                    "draft_shift": bool(getattr(args, "draft_shift", False)),
                },
            )
        return init_dir

    def _check_data_cache(self, target_dir: Path, kinds: tuple[str, ...], tap_ids: tuple[int, ...]) -> None:
        """Cached data batches are only valid for the same data settings and target weights."""
        weights = sorted(target_dir.glob("*.safetensors"))
        spec = {
            **dataclasses.asdict(self.spec),
            "kinds": list(kinds),
            "taps_dtype": self.args.taps_dtype,
            "target_layer_ids": list(tap_ids),
            "val_batches": self.args.val_batches,
            "teacher_topk": self.args.kd_topk if self.kl else None,
            "target_weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in weights],
        }
        data = self.run_dir / "data"
        file = data / "spec.json"
        if file.is_file() and json.loads(file.read_text()) != spec:
            for old in data.glob("batch_*.pt"):
                old.unlink()
            shutil.rmtree(data / "val", ignore_errors=True)
        data.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(spec, indent=2) + "\n")

    def _check_resume(self, saved: dict) -> None:
        now = vars(self.args)
        diff = {
            k: (saved.get(k, LATER_FLAGS.get(k)), now.get(k))
            for k in now
            if k not in RESUMABLE and saved.get(k, LATER_FLAGS.get(k)) != now.get(k)
        }
        if diff:
            raise ValueError(
                "--resume with different settings than the checkpoint (saved, now): "
                + ", ".join(f"{k}: {a!r} != {b!r}" for k, (a, b) in sorted(diff.items()))
            )

    # ------------------------------------------------------------------------------------------------
    def micro_batch(self, batch: TargetBatch, gen: torch.Generator):
        """The loss of one micro-batch (anchors drawn from `gen`)."""
        s, t = batch.shape
        anchors = sample_anchors(batch.anchor_lo, t - self.block + 1, self.args.anchors, s, gen)  # [S, m]
        ids = block_inputs(batch.ids, anchors, self.block, self.model.config.mask_token_id)  # [S, m, B]
        embeds = self.embed_w[ids.to(self.device)]
        if self.model.config.input_embedding_scale != 1.0:
            embeds = embeds * self.model.config.input_embedding_scale
        labels = block_labels(batch.greedy, anchors, self.block)  # [S, m, B-1]
        with torch.autocast(**self.autocast):
            hidden = block_hidden(
                self.model, batch.taps.to(self.device), embeds, anchors.to(self.device), self.args.window
            )
            if not self.kl:
                return block_loss(self.model, hidden, self.head_w, labels.to(self.device), self.weights)
            if batch.teacher is None:
                raise ValueError("--loss kl: a data batch without the target's distributions (an older data cache?)")
            teacher = block_teacher(batch.teacher, anchors, self.block)  # [S, m, B-1, K]
            teacher_ids = block_teacher(batch.teacher_ids, anchors, self.block)
            return block_kl_loss(
                self.model, hidden, self.head_w, teacher, teacher_ids, labels, self.weights, self.args.kd_temperature
            )

    def _gen(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.args.seed * 7919 + 1 + index)

    @torch.no_grad()
    def validate(self) -> dict | None:
        if self.args.val_batches <= 0:
            return None
        self.model.eval()
        batches = [self.val.get(i) for i in range(self.args.val_batches)]
        outs = [self.micro_batch(b, torch.Generator().manual_seed(10_007 + i)) for i, b in enumerate(batches)]
        budget = getattr(self.args, "val_budget", 16)
        walked = served_tau(
            self.model, batches, self.embed_w, self.head_w, self.args.window, [budget] if budget > 0 else []
        )
        self.model.train()
        n = sum(o.blocks for o in outs)
        return {
            "val_loss": sum(float(o.loss) * o.blocks for o in outs) / n,
            "val_acc1": sum(float(o.acc_per_depth[0]) * o.blocks for o in outs) / n,
            "val_chain_tau": sum(o.chain_tau * o.blocks for o in outs) / n,
            **{f"val_{k}": v for k, v in walked.items()},
        }

    def save(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "step": self.step,
            "total_steps": self.total,
            "args": vars(self.args),
            "drafter_config": self.model.config.to_dict(),
        }
        tmp = self.run_dir / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.run_dir / "checkpoint.pt")

    def _logline(self, record: dict) -> None:
        with open(self.run_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _train_step(self) -> dict:
        a = self.args
        lr = lr_at(
            self.step, self.total or 10**9, min(a.warmup, max(1, (self.total or 10**9) // 10)), a.lr, a.min_lr_ratio
        )
        for group in self.opt.param_groups:
            group["lr"] = lr
        metrics, t_step = [], time.perf_counter()
        for micro in range(a.accum):
            index = self.step * a.accum + micro
            t0 = time.perf_counter()
            fresh = a.pool <= 0 or index < a.pool
            batch = self.pool.get(index)
            t1 = time.perf_counter()
            out = self.micro_batch(batch, self._gen(index))
            (out.loss / a.accum).backward()
            self.train_s += time.perf_counter() - t1
            if fresh:
                self.data_s += t1 - t0
                self.fresh += 1
            metrics.append(out)
        params = self.model.parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, a.clip) if a.clip > 0 else torch.tensor(0.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        n = len(metrics)
        return {
            "step": self.step,
            "lr": lr,
            "loss": sum(float(m.loss.detach()) for m in metrics) / n,
            "acc1": sum(float(m.acc_per_depth[0]) for m in metrics) / n,
            "chain_tau": sum(m.chain_tau for m in metrics) / n,
            "acc": [round(sum(float(m.acc_per_depth[d]) for m in metrics) / n, 4) for d in range(self.block - 1)],
            "grad_norm": float(grad_norm),
            "step_s": round(time.perf_counter() - t_step, 3),
        }

    def run(self) -> dict:
        a = self.args
        t_start = time.perf_counter()
        deadline = t_start + a.minutes * 60 if a.minutes > 0 else float("inf")
        start_step = self.step
        self.log(
            f"drafter: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M params, "
            f"layers {self.model.config.num_hidden_layers}, block {self.block}, taps "
            f"{list(self.model.config.target_layer_ids)}, mask id {self.model.config.mask_token_id}; "
            f"device {self.device}; run dir {self.run_dir}; from step {self.step}"
        )
        if self.step == 0:
            v = self.validate()
            if v:
                self._logline({"step": 0, **v})
                self.log(f"step 0 validation: {v}")
        progress = Progress(self.total or 0, start=self.step, every=a.log_every)
        stopped = "done"
        try:
            while not self.total or self.step < self.total:
                if time.perf_counter() >= deadline:
                    stopped = "time limit"
                    break
                rec = self._train_step()
                self._logline(rec)
                if not self.total and self.step - start_step >= PROBE_STEPS:
                    per = (self.step - start_step) * a.accum
                    left = deadline - time.perf_counter()
                    self.total = plan_steps(
                        left,
                        self.step,
                        a.accum,
                        self.train_s / per,
                        self.data_s / max(self.fresh, 1),
                        a.pool,
                        self.step * a.accum,
                    )
                    progress = Progress(self.total, start=start_step, every=a.log_every)
                    self.log(
                        f"schedule: {self.total} steps fit in {a.minutes:g} min "
                        f"(train {self.train_s / per:.2f} s, data {self.data_s / max(self.fresh, 1):.2f} s "
                        f"per micro-batch)"
                    )
                progress.update(self.step, loss=rec["loss"], acc1=rec["acc1"], tau=rec["chain_tau"], lr=rec["lr"])
                if self.step % a.save_every == 0:
                    self.save()
                    v = self.validate()
                    if v:
                        self._logline({"step": self.step, **v})
                        self.log(f"\nstep {self.step} validation: {v}")
        except KeyboardInterrupt:
            stopped = "interrupted"
        progress.close()
        self.save()
        v = self.validate()
        if v:
            self._logline({"step": self.step, **v})
        summary = {
            "step": self.step,
            "total_steps": self.total,
            "stopped": stopped,
            "target": str(a.target),
            "minutes": (time.perf_counter() - t_start) / 60,
            **(v or {}),
        }
        export = Path(a.export) if a.export else self.run_dir / "export"
        export_drafter(self.model, export, summary)
        self.log(f"{stopped} at step {self.step}/{self.total}; validation {v}; exported {export}")
        return summary
