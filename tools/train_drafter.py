"""`ddtree train drafter`: DFlash training of a drafter for any target the loader supports.

    python -m ddtree.tools.train_drafter --target DIR --corpus DIR --run-dir runs/drafter --minutes 30
    python -m ddtree.tools.train_drafter ... --resume          # continue from runs/drafter/checkpoint.pt
    python -m ddtree.tools.train_drafter ... --verifier HOST:PORT  # data from a running verifier (Features)

The target stays frozen. Each micro-batch is S sequences with the target's taps and greedy choices
at every position (services/training/drafter_data.py: by default the target's own greedy
continuations of corpus prompts); m random anchors per sequence become m draft blocks
[anchor, MASK x (B-1)] that run in ONE batched drafter forward under a block-sparse mask
(services/training/drafter_forward.py), and the loss is the depth-weighted cross-entropy against the
target's choices, or with --loss kl the forward KL to the target's own distributions (its top --kd-topk
logits; services/training/drafter_loss.py). --causal-head trains a causal parallel head (JetSpec).
AdamW, linear warmup + cosine decay, gradient
accumulation, bf16 autocast on CUDA (fp32 master weights), gradient clipping. The run itself is
services/training/drafter_trainer.py; this module holds the flags and imports nothing heavy.

Run directory: checkpoint.pt (model + optimizer + step; written atomically every --save-every steps,
at the time limit and on Ctrl-C or SIGTERM), train_log.jsonl (one line per step, plus validation lines),
args.json, init/ (the random initial drafter, same format), data/ (the cached data pool when --pool > 0)
and export/ (the drafter checkpoint: config.json in the DFlash format + model.safetensors), which
`load_drafter` and `ddtree drafter --model` load. --minutes without --steps sizes the cosine schedule
from the measured cost of the first steps (the plan is stored, so a resumed run keeps it).
"""

from __future__ import annotations

import argparse
import sys

from ddtree.config import DTYPE_NAMES

KINDS = ("code", "prose", "chat")


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--target", required=True, help="target checkpoint dir (HF layout; its tokenizer.json tokenizes the corpus)")
    a("--corpus", required=True, help="dir with train_{code,prose,chat}.txt (+ heldout_*.txt for validation)")
    a("--run-dir", default="runs/drafter", help="checkpoints, logs, data cache")
    a("--export", default="", help="drafter checkpoint dir written at the end (default RUN_DIR/export)")
    a("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt")
    a("--init", default="", help="start from this drafter checkpoint dir (fine-tune; its architecture wins)")
    a(
        "--verifier",
        default="",
        help="HOST:PORT of a running verifier serving --target: its Features RPC computes the data, so the "
        "target is not loaded here (of --target only config.json, tokenizer.json, embedding and LM head are read)",
    )
    a("--service-token-file", default="", help="with --verifier: a file holding the verifier's service token")
    g = p.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--target-layer-ids", default="", help="comma list (default: spread over the target's layers)")
    g.add_argument("--heads", type=int, default=0, help="attention heads (0 = 4, or hidden/128 for hidden >= 1024)")
    g.add_argument("--kv-heads", type=int, default=0, help="KV heads (0 = heads/2, heads/4 from 8 heads)")
    g.add_argument("--intermediate", type=int, default=0, help="MLP width (0 = 2 x hidden)")
    g.add_argument("--mask-token-id", type=int, default=-1, help="-1 = the tokenizer's [MASK], else vocab-1")
    g.add_argument(
        "--causal-head",
        action="store_true",
        help="a causal parallel head (JetSpec): block slot i attends to the context and slots <= i",
    )
    g.add_argument("--draft-shift", action="store_true", help="slot d predicts depth d + 1 (slots 0..B-2), not depth d")
    g = p.add_argument_group("data")
    g.add_argument("--kinds", default=",".join(KINDS), help="corpus kinds, drawn uniformly")
    g.add_argument(
        "--source",
        default="generate",
        choices=("generate", "corpus"),
        help="generate: the target's greedy continuations of corpus prompts; corpus: teacher forcing",
    )
    g.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    g.add_argument("--prompt-min", type=int, default=16)
    g.add_argument("--prompt-max", type=int, default=512, help="prompt length is log-uniform in [min, max]")
    g.add_argument("--gen-tokens", type=int, default=256, help="generated tokens per prompt")
    g.add_argument("--seq-len", type=int, default=512, help="window length with --source corpus")
    g.add_argument("--anchors", type=int, default=64, help="draft blocks per sequence")
    g.add_argument("--window", type=int, default=2048, help="context window, as the drafter serves (0 = all)")
    g.add_argument("--pool", type=int, default=0, help="distinct data batches, reused (cached on disk); 0 = fresh")
    g.add_argument("--taps-dtype", default="bfloat16", choices=DTYPE_NAMES, help="stored feature dtype")
    g.add_argument("--val-batches", type=int, default=1, help="held-out batches for validation (0 = none)")
    g.add_argument(
        "--val-budget",
        type=int,
        default=16,
        help="tree budget of the validation's served-walk tau (walk_tau_bN: the anchors a served greedy run "
        "visits, not every position; 0 = the chain's only)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = fit the schedule to --minutes)")
    g.add_argument("--minutes", type=float, default=0.0, help="wall-clock limit of this invocation (0 = none)")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=50, help="warmup steps (at most a tenth of the run)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument(
        "--gamma",
        type=float,
        default=0.0,
        help="depth-decay of the loss weights (0 = DFlash's default with --loss ce, uniform with --loss kl)",
    )
    g.add_argument(
        "--loss",
        default="ce",
        choices=("ce", "kl"),
        help="ce: cross-entropy to the target's greedy choices (DFlash); kl: forward KL to its distributions "
        "(JetSpec; needs the target in this process)",
    )
    g.add_argument("--kd-topk", type=int, default=64, help="--loss kl: the target's top-K logits kept (0 = all)")
    g.add_argument("--kd-temperature", type=float, default=1.0, help="--loss kl: distillation temperature")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    g.add_argument(
        "--target-dtype", default="auto", choices=("auto", *DTYPE_NAMES), help="auto = bfloat16 on CUDA, float32 on CPU"
    )
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    g.add_argument("--save-every", type=int, default=100)
    g.add_argument("--log-every", type=int, default=10)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `drafter` under the `ddtree train` sub-command group."""
    p = subparsers.add_parser(
        "drafter", help="train a DFlash drafter for a target (DFlash recipe)", description=__doc__.split("\n\n")[0]
    )
    add_arguments(p)
    p.set_defaults(fn=cmd_train_drafter)
    return p


def cmd_train_drafter(args: argparse.Namespace) -> int:
    train(args)
    return 0


def settings(args: argparse.Namespace) -> argparse.Namespace:
    """Just this tool's flags (a namespace from `ddtree train drafter` also carries the CLI's own)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    return argparse.Namespace(**{a.dest: getattr(args, a.dest) for a in probe._actions if hasattr(args, a.dest)})


def train(args: argparse.Namespace) -> dict:
    import signal

    from ddtree.training.drafter_trainer import DrafterTrainer

    def stop(signum, frame):  # SIGTERM ends the run like Ctrl-C: checkpoint + export, then exit
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return DrafterTrainer(settings(args)).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.tools.train_drafter", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        train(args)
    except ValueError as err:
        print(f"train drafter: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
