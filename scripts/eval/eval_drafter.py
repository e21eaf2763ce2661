"""Average accepted length tau of a drafter on held-out prompts, measured through the real pieces.

    python -m scripts.eval.eval_drafter --target DIR --drafter DIR --corpus DIR --kind code,prose \\
        --budget 16 --tokens 256 --prompts 8 [--out FILE.json]

In one process: the drafter service (`make_engine` + `serve_engine` on a loopback port), the verifier's
`Scheduler` with a `DrafterClient` to it, and greedy requests of --tokens new tokens with EOS ignored.
tau = accepted drafts + 1 per verify step (the step's accept length), pooled over every step of every
generation (`tau`); `tau_per_prompt` is the mean of the per-prompt means.

Prompts come from `heldout_{kind}.txt` (documents joined by [EOS]): for code and prose the first
--prompt-len tokens of evenly spaced documents, for chat a conversation up to its first
`<|im_assistant|>assistant<|im_middle|>`, so the target writes an assistant answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def load_prompts(
    corpus_dir: str | Path, tokenizer_dir: str | Path, kind: str, count: int, prompt_len: int
) -> list[list[int]]:
    """`count` prompts of at most `prompt_len` tokens from the held-out documents of `kind`."""
    from tokenizers import Tokenizer

    from ddtree.training.drafter_data import DOC_SEPARATOR

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    path = Path(corpus_dir) / f"heldout_{kind}.txt"
    docs = [d for d in path.read_text(encoding="utf-8").split(DOC_SEPARATOR) if d.strip()]
    if kind == "chat":
        header = "<|im_assistant|>assistant<|im_middle|>"
        docs = [d[: d.index(header) + len(header)] for d in docs if header in d]
    encoded = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    if kind == "chat":
        eligible = [ids[-prompt_len:] for ids in encoded]
    else:
        eligible = [ids[:prompt_len] for ids in encoded if len(ids) > prompt_len]
    if len(eligible) < count:
        raise ValueError(f"{path}: only {len(eligible)} documents fit a {prompt_len}-token prompt, asked for {count}")
    step = len(eligible) / count
    return [eligible[int(i * step)] for i in range(count)]


def measure_tau(
    target_dir: str | Path,
    drafter_dir: str | Path,
    prompts: list[list[int]],
    budget: int = 16,
    tokens: int = 256,
    max_batch: int = 8,
    window: int = 2048,
    drafter_dtype: str = "float32",
) -> dict:
    """Greedy generations through scheduler + drafter service; returns tau and per-prompt details."""
    from ddtree.config import DrafterConfig, VerifierConfig
    from ddtree.contract.sampling_params import SamplingConfig
    from ddtree.drafter.factory import make_engine
    from ddtree.drafter.server import serve_engine
    from ddtree.models.checkpoint.loader import load_target
    from ddtree.verifier.drafting.drafter_client import DrafterClient
    from ddtree.verifier.engine import build_engine
    from ddtree.verifier.sequence import GenerateParams, Sequence

    model = load_target(target_dir, dtype=torch.float32)
    dcfg = DrafterConfig(
        port=0,
        grace_s=0.0,
        window=window,
        default_budget=max(budget, 1),
        max_budget=max(budget, 1024),
        dtype=drafter_dtype,
    )
    engine = make_engine(dcfg, str(drafter_dir), str(target_dir))
    drafter = serve_engine(engine, dcfg)
    client = DrafterClient(f"127.0.0.1:{drafter.port}", timeout_s=120)
    longest = max(len(p) for p in prompts)
    kv_tokens = max_batch * (longest + tokens + budget + 2)
    vcfg = VerifierConfig(
        max_batch=max_batch,
        max_queue=len(prompts),
        kv_tokens=kv_tokens,
        prefill_chunk=512,
        default_budget=budget,
        max_context=longest + tokens + 1,
        tree_cut="fixed",  # tau of the drafter's whole trees: not of cuts that depend on this machine's timing
    )
    sched = build_engine(vcfg, model=model, drafter=client).scheduler
    sched.start()
    t0 = time.perf_counter()
    try:
        seqs = []
        for i, ids in enumerate(prompts):
            seq = Sequence(
                GenerateParams(
                    f"eval-{i}", tuple(ids), SamplingConfig(temperature=0.0), tokens, frozenset(), True, budget
                )
            )
            sched.submit(seq)
            seqs.append(seq)
        for seq in seqs:
            while not seq.events.get(timeout=600).finish_reason:
                pass
            if seq.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"{seq.request_id} finished with {seq.finish_reason!r}")
        deadline = time.perf_counter() + 5
        while engine.active_sequences and time.perf_counter() < deadline:  # finished requests' Release RPCs
            time.sleep(0.01)
    finally:
        sched.stop()
        drafter.stop(0)
        client.close()
    wall = time.perf_counter() - t0
    lengths = [a for s in seqs for a in s.accept_lengths]
    per_prompt = [sum(s.accept_lengths) / max(len(s.accept_lengths), 1) for s in seqs]
    return {
        "tau": sum(lengths) / max(len(lengths), 1),
        "tau_per_prompt": sum(per_prompt) / len(per_prompt),
        "steps": len(lengths),
        "generated_tokens": sum(len(s.generated) for s in seqs),
        "prompts": len(seqs),
        "prompt_tokens": [len(p) for p in prompts],
        "budget": budget,
        "tokens": tokens,
        "wall_s": wall,
        "per_prompt_tau": [round(t, 4) for t in per_prompt],
        "accept_histogram": {str(k): lengths.count(k) for k in sorted(set(lengths))},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.eval.eval_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--corpus", required=True, help="dir with heldout_{kind}.txt")
    p.add_argument("--kind", default="code", help="comma list of code | prose | chat")
    p.add_argument("--budget", type=int, default=16, help="tree node budget")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt (EOS ignored)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--window", type=int, default=2048, help="drafter context window")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument(
        "--drafter-dtype", default="float32", help="float32 | bfloat16 | float16: the drafter's compute dtype"
    )
    p.add_argument("--out", default="", help="JSON file (default runs/eval/<drafter dir name>_b<budget>.json)")
    args = p.parse_args(argv)
    from ddtree.telemetry.logging import configure_logging

    configure_logging("warning", "console")  # no per-step records
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = {"target": args.target, "drafter": args.drafter, "kinds": {}}
    for kind in [k for k in args.kind.split(",") if k]:
        prompts = load_prompts(args.corpus, args.target, kind, args.prompts, args.prompt_len)
        r = measure_tau(
            args.target,
            args.drafter,
            prompts,
            args.budget,
            args.tokens,
            args.max_batch,
            args.window,
            args.drafter_dtype,
        )
        result["kinds"][kind] = r
        print(
            f"{kind:6s} tau {r['tau']:.3f} (per prompt {r['tau_per_prompt']:.3f}) over {r['steps']} steps, "
            f"{r['generated_tokens']} tokens, budget {args.budget}, {r['wall_s']:.1f} s",
            flush=True,
        )
    out = Path(args.out or f"runs/eval/{Path(args.drafter).resolve().name}_b{args.budget}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
