"""`ddtree selftest invariance`: is every verified row's result independent of the rows around it, here?

    ddtree selftest invariance --model DIR [--tp N] [--kernels auto|torch|triton] [--dtype auto|bf16|fp16|fp32]
        [--batches 1,3,8] [--rows 9,17] [--contexts N,...] [--static] [--prefill on|off] [--row-invariant on|off]
        [--seed S] [--json]

For sampled contexts (lengths that cross the attention's prefix-split boundaries), trees of --rows rows at
each batch size of --batches (the other sequences of the batch are trees over other contexts): every row's
fp32 logits against its AR twin, the same token decoded alone at batch 1 after its ancestors, each decoded
alone (invariance.py), bit for bit. And at each batch size, prompts of those lengths prefilled in random
chunks beside each other, every row against the same prompt prefilled whole and alone, its last rows against
their AR twins (a prompt's KV must not depend on the chunks it was prefilled in, nor on the prefix cache).
Prints the rows compared, the rows that differ and the largest difference; exits 1 when any row differs, 2 on
bad input. --prefill off leaves the prompts' chunks out (the trees only).

--static runs each batched tree step through the verifier's static step (verifier/step/static_step.py:
the bucket its default ladder picks, batches 1, 2, 4, ..., rows max(--rows), keys doubling from 512, a
CUDA graph on CUDA; kernels/mla/static_plan.py's plan with the Triton kernels), padding rows and
sequences included; the AR twins stay eager. At --tp N every rank builds that ladder over its KV replica
(verifier/tp_worker.py, as a TP verifier does) and replays rank 0's tree steps in lockstep; the static
step taps layer 0 and only the tree steps ask for that tap, so the prefills and the AR twins run eager on
every rank (a step whose taps differ from the static step's is eager: StaticStep.plan).

--row-invariant off plans the Triton attention as `ddtree verifier --row-invariant off` does (splits from the
step's work over the SMs): the check's negative control, and what an operator who turned it off gives up.

--kernels triton on a CPU runs the device path under the Triton interpreter (TRITON_INTERPRET=1 is set here
when triton is not imported yet); auto is triton on CUDA, torch on the CPU. --tp N runs N ranks on this
host (gloo on the CPU, NCCL on CUDA), each its shard, rank 0 comparing the gathered logits.

`run_invariance_check` is the GPU check's part (tools/selftest/parts.py): a small Kimi-shaped checkpoint
(INT4 experts, bf16 elsewhere), the Triton kernels, in bf16, the tree steps eager and then static.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time

SPLIT_EDGES = (256, 512)  # the MLA plan's default min_split and twice it: contexts straddle these
STATIC_TAPS = (0,)  # at TP N, what only the tree steps ask of the static step (the rest runs eager)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "invariance", help="every tree row's logits against its AR twin (batch 1), bitwise", description=__doc__
    )
    p.add_argument("--model", required=True, type=pathlib.Path, help="checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks on this host")
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="auto: bf16 on CUDA, fp32 on the CPU")  # fmt: skip
    p.add_argument("--batches", default="1,3,8", help="batch sizes (comma-separated)")
    p.add_argument("--rows", default="9,17", help="tree rows (comma-separated)")
    p.add_argument("--contexts", default="", help="context lengths to sample from (default: around 256 and 512)")
    p.add_argument("--static", action="store_true",
                   help="verify the trees through the static (CUDA-graph) step; the AR twins stay eager")  # fmt: skip
    p.add_argument("--prefill", choices=("on", "off"), default="on",
                   help="also prompts prefilled in random chunks against one whole prefill (eager steps)")  # fmt: skip
    p.add_argument("--row-invariant", choices=("on", "off"), default="on",
                   help="the Triton attention's plan, as the verifier's flag of that name")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(fn=run)
    return p


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--{name} must be comma-separated positive integers, got {text!r}")
    return out


def default_contexts(edges=SPLIT_EDGES) -> list[int]:
    """Lengths just under, at and past each split edge (a context and its tree's rows straddle it)."""
    return sorted({e + d for e in edges for d in (-9, -1, 0, 3)})


def run(args: argparse.Namespace) -> int:
    try:
        batches, rows = _ints(args.batches, "batches"), _ints(args.rows, "rows")
        contexts = _ints(args.contexts, "contexts") if args.contexts else default_contexts()
    except ValueError as err:
        print(f"ddtree selftest invariance: {err}", file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"ddtree selftest invariance: no config.json in {args.model}", file=sys.stderr)
        return 2
    if args.tp < 1:
        print("ddtree selftest invariance: --tp must be >= 1", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    kernels = args.kernels if args.kernels != "auto" else ("triton" if cuda else "torch")
    if kernels == "triton" and not cuda:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("ddtree selftest invariance: triton was imported before TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    spec = CheckSpec(str(args.model), kernels, dtype, batches, rows, contexts, args.seed, args.static,
                     args.row_invariant == "on", args.prefill == "on")  # fmt: skip
    started = time.perf_counter()
    result = _run_ranks(spec, args.tp) if args.tp > 1 else compare_all(_load(spec, "cuda" if cuda else "cpu"), spec)
    out = {**result, "model": str(args.model), "tp": args.tp, "kernels": kernels, "dtype": str(dtype),
           "device": "cuda" if cuda else "cpu", "batches": batches, "tree_rows": rows, "static": args.static,
           "prefill": spec.prefill,
           "row_invariant": args.row_invariant,
           "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"rows compared {out['rows']} ({out['prefill_rows']} of them prompt rows prefilled in chunks), rows "
              f"differing {out['differing']}, largest difference "
              f"{out['max_abs_diff']:.3g}, argmax flips {out['argmax_flips']} ({kernels} kernels, {dtype}, "
              f"TP {args.tp}, {out['device']}, {'static' if args.static else 'eager'} step, row invariance "
              f"{args.row_invariant})")  # fmt: skip
    return 1 if out["differing"] else 0


class CheckSpec:
    def __init__(self, model, kernels, dtype, batches, rows, contexts, seed, static=False, row_invariant=True,
                 prefill=True):  # fmt: skip
        self.model, self.kernels, self.dtype = model, kernels, dtype
        self.batches, self.rows, self.contexts, self.seed = batches, rows, contexts, seed
        self.static = static  # the tree steps through the static step (static_verify)
        self.row_invariant = row_invariant  # the attention's plan (make_attention_backend)
        self.prefill = prefill and not static  # prompts in random chunks (eager, as the verifier prefills)


def _load(spec: CheckSpec, device: str, tp=None):
    from ddtree.models.checkpoint.loader import load_target
    from ddtree.models.layers.attention import make_attention_backend
    from ddtree.models.layers.layer_kernels import make_layer_kernels

    backend = make_attention_backend("triton" if spec.kernels == "triton" else "torch", spec.row_invariant)
    if tp is None:
        model = load_target(spec.model, dtype=spec.dtype, device=device, attention_backend=backend).eval()
    else:
        from ddtree.models.parallel.tp_model import load_tp_model

        model = load_tp_model(spec.model, tp, dtype=spec.dtype, attention_backend=backend).eval()
    model.layer_kernels = make_layer_kernels(spec.kernels)
    return model


def compare_all(model, spec: CheckSpec, step=None, cache_of=None, verify=None) -> dict:
    """Every (batch, rows) case over contexts drawn from spec.contexts, and (eager only) at every batch size
    those prompts' rows prefilled in random chunks beside each other against one whole prefill and against
    their last rows decoded alone: the merged Comparison as a dict.
    `verify` runs the tree steps (default: the forward `step`, or at TP 1 with spec.static static_verify)."""
    from ddtree.tools.selftest.invariance import Comparison, compare_prefill_rows, compare_tree_rows, random_tree

    if spec.static and verify is None:
        verify, cache_of = static_verify(model, spec)
    rng = random.Random(spec.seed)
    vocab = model.config.vocab_size
    total = Comparison(0, 0, 0.0, 0)
    cases, prefill_rows = [], 0
    for batch in spec.batches:
        for n in spec.rows:
            contexts = [[rng.randrange(vocab) for _ in range(rng.choice(spec.contexts))] for _ in range(batch)]
            trees = [random_tree(n, vocab, rng) for _ in range(batch)]
            got = compare_tree_rows(model, contexts, trees, step, cache_of, verify)
            cases.append({"batch": batch, "rows": n, "static": spec.static, "compared": got.rows,
                          "differing": got.differing, "max_abs_diff": got.max_abs_diff})  # fmt: skip
            total = total.merged(got)
    if spec.prefill:  # prompts prefilled in random chunks beside each other
        for batch in spec.batches:
            contexts = [[rng.randrange(vocab) for _ in range(rng.choice(spec.contexts))] for _ in range(batch)]
            got = compare_prefill_rows(model, contexts, rng, step, cache_of)
            prefill_rows += got.rows
            cases.append({"batch": batch, "prefill_chunks": True, "compared": got.rows, "differing": got.differing,
                          "max_abs_diff": got.max_abs_diff})  # fmt: skip
            total = total.merged(got)
    return {"rows": total.rows, "prefill_rows": prefill_rows, "differing": total.differing,
            "max_abs_diff": total.max_abs_diff,
            "argmax_flips": total.argmax_flips, "cases": cases}  # fmt: skip


def static_verify(model, spec: CheckSpec):
    """(verify, cache_of) for compare_tree_rows: the batched tree step through the verifier's static step in
    the bucket its default ladder picks for it (default_buckets over spec's batches, rows and contexts),
    captured as a CUDA graph on CUDA, over a cache with one slot more (the pad slot, seen by no real row)."""
    import torch

    from ddtree.verifier.step.static_step import StaticStep

    ladder = static_ladder(spec)
    cuda = torch.cuda.is_available()

    def verify(model, ids, pos, meta, cache):
        pad = cache.shape[1] - 1  # cache [L, S, W]
        bucket = StaticStep(model, cache, pad, ladder, (), graphs=False).bucket_for(meta)
        if bucket is None:
            raise ValueError(f"no bucket of {ladder} fits the step")
        static = StaticStep(model, cache, pad, (bucket,), (), graphs=cuda)
        static.capture()
        hidden, _ = static.run(ids, pos, meta, ())
        return model.compute_logits(hidden)

    return verify, lambda num_slots: model.new_kv_cache(num_slots + 1)


def static_ladder(spec: CheckSpec) -> tuple:
    """The static step's buckets for spec's trees: the verifier's default ladder up to its largest step."""
    from ddtree.verifier.step.static_step import default_buckets

    rows = max(spec.rows)
    return default_buckets(max(spec.batches), rows, max(spec.contexts) + rows)


def _run_ranks(spec: CheckSpec, world: int) -> dict:
    import torch
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory(prefix="ddtree-invariance-") as work:
        out = pathlib.Path(work) / "result.pt"
        tmp.spawn(_rank_main, args=(world, spec, str(out)), nprocs=world, join=True)
        return torch.load(out)


def _rank_main(rank: int, world: int, spec: CheckSpec, out: str) -> None:
    """One rank: rank 0 runs the comparison through TensorParallelModel (every forward broadcast to the others,
    which serve them in worker_loop until rank 0 closes), and saves the result. spec.static: every rank
    builds the static step over each new KV replica (STATIC after CACHE) and the tree steps replay it."""
    import torch

    from ddtree.models.parallel.process_group import destroy_tp, init_tp, rank_device
    from ddtree.models.parallel.tp_model import TensorParallelModel
    from ddtree.verifier.step.static_step import StaticPlan, make_static_step
    from ddtree.verifier.tp_worker import worker_loop

    if spec.kernels == "triton" and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    device = rank_device("cuda" if torch.cuda.is_available() else "cpu", rank)
    tp = init_tp(
        world, rank, device, timeout_s=600, init_method=f"file://{out}.store", ordered_reduce=spec.row_invariant
    )
    model = _load(spec, str(device), tp).to(device)
    plan = StaticPlan(static_ladder(spec), graphs=torch.cuda.is_available()) if spec.static else None
    if rank > 0:
        worker_loop(model, tp, static_plan=plan)
    else:
        runner = TensorParallelModel(model, tp, ping_interval_s=30)

        def cache_of(num_slots: int):
            kv = model.new_kv_cache(num_slots + (plan is not None))  # static: one more, the pad slot
            runner.replicate_kv(kv)
            if plan is not None:
                runner.start_static(num_slots, STATIC_TAPS, lambda: make_static_step(plan, model, kv, num_slots, STATIC_TAPS))  # fmt: skip
            return kv

        def step(_model, ids, pos, meta, kv):
            return runner.forward(ids, pos, meta, kv, gather_logits=True).logits

        def verify_static(_model, ids, pos, meta, kv):
            if runner.static.bucket_for(meta) is None:
                raise ValueError(f"no bucket of {plan.buckets} fits the step")
            replays = runner.static.replays
            logits = runner.forward(ids, pos, meta, kv, tap_layer_ids=STATIC_TAPS, gather_logits=True).logits
            if runner.static.replays != replays + 1:
                raise RuntimeError("the tree step ran eager, not through the static step")
            return logits

        result = compare_all(model, spec, step, cache_of, verify_static if plan is not None else None)
        runner.close()
        torch.save(result, out)
    destroy_tp()
    os._exit(0)  # skip the interpreter's teardown of gloo's threads (tests/support/tp_ranks.py)


def run_invariance_check(dry_run: bool, device, log, deadline: float, on_row) -> dict:
    """The GPU check's part: a small Kimi-shaped checkpoint (INT4 experts), Triton kernels, bf16, every row
    of trees of 9 and 17 rows at batch 1, 3 and 8 against its AR twin, the trees verified by the eager step
    and then by the static step (dry run, interpreted on a CPU: 2 layers, two trees of 5 rows, contexts
    across a 32-key split edge)."""
    import torch

    from ddtree.tools.selftest import kimi_checkpoint

    with tempfile.TemporaryDirectory(prefix="selftest-invariance-") as work:
        args = kimi_checkpoint.parse_args(["--out", work, "--layers", "3", "--experts", "16", "--hidden", "1024",
                                           "--vocab", "8192", "--heads", "16", "--q-lora", "256", "--kv-lora", "512",
                                           "--moe-width", "256", "--dense-width", "1024", "--no-vision"])  # fmt: skip
        if dry_run:
            args = kimi_checkpoint.parse_args(["--out", work, "--layers", "2", "--experts", "4", "--hidden", "64",
                                               "--vocab", "256", "--heads", "4", "--q-lora", "32", "--kv-lora", "32",
                                               "--moe-width", "32", "--dense-width", "64", "--no-vision"])  # fmt: skip
        kimi_checkpoint.write_checkpoint(args)
        batches, rows, contexts = ([2], [5], [29, 40]) if dry_run else ([1, 3, 8], [9, 17], default_contexts())
        spec = CheckSpec(work, "triton", torch.bfloat16, batches, rows, contexts, 0)
        model = _load(spec, str(device))
        if dry_run:
            from ddtree.kernels.mla.backend import TritonMLAAttention
            from ddtree.kernels.mla.plan import MLAKernelConfig

            model.attn_backend = TritonMLAAttention(MLAKernelConfig(block_n=16, min_split=32, max_splits=4))
        out = compare_all(model, spec)
        static = compare_all(model, CheckSpec(work, "triton", torch.bfloat16, batches, rows, contexts, 0, static=True))
    log(f"rows {out['rows']} ({out['prefill_rows']} prompt rows) + {static['rows']} static, differing "
        f"{out['differing']} + {static['differing']} static, largest difference "
        f"{max(out['max_abs_diff'], static['max_abs_diff']):.3g}")  # fmt: skip
    both = (out, static)
    row = {"rows": sum(o["rows"] for o in both), "prefill_rows": out["prefill_rows"],
           "mismatches": sum(o["differing"] for o in both),
           "max_abs_diff": max(o["max_abs_diff"] for o in both), "argmax_flips": sum(o["argmax_flips"] for o in both),
           "cases": out["cases"] + static["cases"], "errors": []}  # fmt: skip
    on_row(row)
    return row
