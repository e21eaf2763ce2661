"""A drafter's tau on held-out prompts without the services: the training's metric beside the served walk.

    python -m scripts.eval.walk_tau --target DIR --drafter DIR[,DIR...] --corpus DIR --kind code,prose,chat \\
        --prompts 8 --tokens 128 --budgets 16,64 [--out FILE.json]

The target continues each held-out prompt greedily (eval_drafter.load_prompts, the prompts eval_drafter serves);
each drafter's block at every anchor of the continuation comes from the training forward. Per kind it prints

    position_chain_tau   the training's validation metric (val_chain_tau): a chain's accept length averaged
                         over every anchor alike
    walk_chain_tau       the same chains over the anchors a served greedy run visits (training/served_tau.py)
    walk_tau_bN          best-first trees of N nodes over those anchors: what eval_drafter measures through
                         the services at budget N, up to the verifier's cost cut and how a run ends
    acc_by_depth, walk_acc_by_depth, walk_acc_given_prefix
                         the chain's argmax right at each depth: over every anchor, over the walk's anchors,
                         and there given that every shallower depth was right

so a drafter's served tau can be read in seconds, and the gap between training and serving explained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def measure(target_dir: str, drafter_dirs: list[str], corpus: str, kinds: list[str], prompts: int, tokens: int,
            prompt_len: int, budgets: list[int], window: int) -> dict:  # fmt: skip
    from ddtree.models.checkpoint.loader import load_target
    from ddtree.models.dflash.checkpoint import load_drafter
    from ddtree.training.drafter_data import TargetRunner
    from ddtree.training.served_tau import block_logprobs, pooled_tau, walk_steps
    from scripts.eval.eval_drafter import load_prompts

    target = load_target(target_dir, dtype=torch.float32)
    embed_w, head_w = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    drafters = {d: load_drafter(d, dtype=torch.float32).eval() for d in drafter_dirs}
    out: dict = {"target": target_dir, "prompts": prompts, "tokens": tokens, "drafters": {}}
    runs: dict[tuple, list] = {}  # (taps, kind) -> the target's continuations, shared by drafters with those taps
    for name, model in drafters.items():
        taps = tuple(model.config.target_layer_ids)
        per_kind = {}
        for kind in kinds:
            if (taps, kind) not in runs:
                runner = TargetRunner(target, taps, torch.float32)
                runs[taps, kind] = [
                    runner.generate(torch.tensor([p]), tokens)
                    for p in load_prompts(corpus, target_dir, kind, prompts, prompt_len)
                ]
            batches = runs[taps, kind]
            chains, correct, visited = [], [], []
            pooled: dict[str, list[int]] = {}
            for batch in batches:
                lp, top, labels = block_logprobs(model, batch, 0, embed_w, head_w, window, max(budgets))
                walked_steps = walk_steps(lp, top, labels, budgets)
                for key, steps in walked_steps.items():
                    pooled.setdefault(key, []).extend(steps)
                right = top[:, :, 0] == labels  # [A, B-1] the chain's argmax at each depth
                chains += (right.long().cumprod(dim=1).sum(dim=1) + 1).tolist()
                correct.append(right)
                steps = torch.tensor(walked_steps["walk_chain_tau"])
                visited.append(right[steps.cumsum(0) - steps])  # the chain walk's anchors
            every, walked = torch.cat(correct).float(), torch.cat(visited).float()
            per_kind[kind] = {
                "position_chain_tau": sum(chains) / len(chains),
                **pooled_tau(pooled),
                "acc_by_depth": [round(float(x), 3) for x in every.mean(0)],
                "walk_acc_by_depth": [round(float(x), 3) for x in walked.mean(0)],
                # depth d right, given depths 1..d-1 right, at the walk's anchors
                "walk_acc_given_prefix": [
                    round(float(walked[walked[:, :d].prod(1) == 1, d].mean()), 3) for d in range(walked.shape[1])
                ],
            }
            print(
                name,
                kind,
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in per_kind[kind].items()}),
                flush=True,
            )
        out["drafters"][name] = per_kind
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.eval.walk_tau", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="comma list of drafter checkpoint dirs")
    p.add_argument("--corpus", required=True, help="dir with heldout_{kind}.txt")
    p.add_argument("--kind", default="code,prose,chat", help="comma list of code | prose | chat")
    p.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--budgets", default="16,64", help="tree budgets (comma list)")
    p.add_argument("--window", type=int, default=2048, help="drafter context window (0 = all)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--out", default="", help="JSON file")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        budgets = [int(b) for b in a.budgets.split(",") if b]
        if any(b < 1 for b in budgets):
            raise ValueError
    except ValueError:
        print(f"--budgets must be positive integers, got {a.budgets!r}", file=sys.stderr)
        return 2
    out = measure(a.target, [d for d in a.drafter.split(",") if d], a.corpus, [k for k in a.kind.split(",") if k],
                  a.prompts, a.tokens, a.prompt_len, budgets, a.window)  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
