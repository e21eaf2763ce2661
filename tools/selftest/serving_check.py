"""Part (b) of `ddtree selftest gpu`: a reduced-depth Kimi-K2.6-shaped model served end to end on one device.

1. A random checkpoint at full width (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, routed experts of
   width 2048 stored INT4 group 32, the first layer dense), fewer layers and experts, written on this
   machine by kimi_checkpoint.py, with the default checkpoint's tokenizer (its vocabulary sets the
   model's).
2. The three services as processes (`services/launcher.py start_stack`): gateway, verifier on the device,
   and the replay oracle drafter (selftest/oracle/replay_drafter.py: the oracle's noisy trees over the AR
   output, so acceptance is known and the draft costs nothing).
3. Per context: a prompt of that many tokens (code text) through the gateway, AR (no_spec) then DDTree
   (greedy, budget 16), the step records streamed with the tokens giving the draft / verify / transport
   split, and DDTree's tokens compared with AR's.

Two passes, each its own stack: fp32 (the identity check, contexts up to 4k) and bf16 (the production
dtype: the timing table, every context; twice, --cuda-graphs off and on, when the verifier can capture
the checkpoint: not with INT4 routed experts, so not today).
A bf16 difference is reported as a divergence but does not fail the check: docs/design.md §3.7, in
reduced precision a near-tie can resolve differently when the batch shape changes (a tree row vs an AR
row); in fp32 any difference is a mismatch and fails it. Each difference is diagnosed (tie_at): the
target's top-2 log-probabilities at that token and whether DDTree took the second, so that a near-tie can
be told from a wrong verify path.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import time
import traceback


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    dtype: str
    contexts: tuple[int, ...]
    strict: bool  # a DDTree token that differs from AR fails the check (else: a reported divergence)
    flags: tuple[str, ...] = ()  # extra verifier flags


@dataclasses.dataclass(frozen=True)
class ServePlan:
    layers: int
    experts: int
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    moe_width: int
    dense_width: int
    group: int
    contexts: tuple[int, ...]
    new_tokens: int
    device: str
    prefill_chunk: int
    taps: tuple[int, ...]
    budget: int = 16
    warmup_context: int = 64
    strict_up_to: int = 4096  # the fp32 pass's longest context

    def passes(self) -> list[Pass]:
        strict = tuple(c for c in self.contexts if c <= self.strict_up_to) or self.contexts[:1]
        # the identity check first: a late deadline skips timing rows, not it
        return [Pass("fp32", "float32", strict, True), Pass("bf16", "bfloat16", self.contexts, False)]


# A DDTree run that follows AR with tau below this is not following the oracle's trees (each step accepts
# 4.8 tokens on average, 1 only when its chain breaks at depth 1): the check would not be testing DDTree.
MIN_TAU = 2.0


def make_plan(dry_run: bool, layers: int = 0, experts: int = 0, contexts: str = "", new_tokens: int = 0) -> ServePlan:
    if dry_run:
        plan = ServePlan(2, 4, 128, 4, 64, 64, 64, 128, 32, (16, 64), 12, "cpu", 32, (0, 1), warmup_context=8,
                         strict_up_to=64)  # fmt: skip
    else:
        plan = ServePlan(4, 64, 7168, 64, 1536, 512, 2048, 18432, 32, (128, 1024, 4096, 16384, 32768), 48,
                         "cuda", 2048, (1, 2, 3))  # fmt: skip
    changes = {}
    if layers:
        changes.update(layers=layers, taps=tuple(sorted({min(t, layers - 1) for t in plan.taps})))
    if experts:
        changes["experts"] = experts
    if contexts:
        changes["contexts"] = tuple(int(c) for c in contexts.split(","))
    if new_tokens:
        changes["new_tokens"] = new_tokens
    return dataclasses.replace(plan, **changes)


def make_checkpoint(plan: ServePlan, root: pathlib.Path) -> dict:
    from ddtree.default_checkpoint import default_checkpoint
    from ddtree.tokenization.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tokenizer_dir = default_checkpoint().target
    vocab = Tokenizer(tokenizer_dir).vocab_size
    args = ["--out", str(root), "--layers", str(plan.layers), "--dense-layers", "1", "--experts", str(plan.experts),
            "--hidden", str(plan.hidden), "--vocab", str(vocab), "--heads", str(plan.heads), "--q-lora",
            str(plan.q_lora), "--kv-lora", str(plan.kv_lora), "--moe-width", str(plan.moe_width), "--dense-width",
            str(plan.dense_width), "--group", str(plan.group), "--no-vision"]  # fmt: skip
    subprocess.run([sys.executable, "-m", "ddtree.tools.selftest.kimi_checkpoint", *args], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, root / name)
    nbytes = sum(p.stat().st_size for p in root.glob("*.safetensors"))
    return dict(path=str(root), vocab=vocab, bytes=nbytes, make_s=time.perf_counter() - t0)


def cuda_graphs_flag() -> bool:
    """Whether the verifier has a --cuda-graphs flag (issue 17 point 1)."""
    from ddtree.config import VerifierConfig

    return "cuda_graphs" in {f.name for f in dataclasses.fields(VerifierConfig)}


def passes(plan: ServePlan) -> tuple[list[Pass], str]:
    """The passes to run (the bf16 one twice, eager and with CUDA graphs, when the verifier can capture),
    and what the JSON says about CUDA graphs."""
    out = plan.passes()
    if not cuda_graphs_flag():
        return out, "not available: the verifier has no --cuda-graphs flag"
    if plan.device != "cuda":
        return out, "not measured: CUDA graphs need a CUDA device"
    fp32, bf16 = out
    # The identity check eager, so that a capture that fails costs the graphs' pass alone.
    fp32 = dataclasses.replace(fp32, flags=("--cuda-graphs", "off"))
    eager = dataclasses.replace(bf16, name="bf16-eager", flags=("--cuda-graphs", "off"))
    graphs = dataclasses.replace(bf16, name="bf16-graphs", flags=("--cuda-graphs", "on"))
    return [fp32, eager, graphs], "measured: bf16-eager vs bf16-graphs (fp32: eager)"


def start(plan: ServePlan, run: Pass, model: pathlib.Path, reference: pathlib.Path, log_dir: pathlib.Path):
    from ddtree.launcher import start_stack

    max_context = max(run.contexts) + plan.new_tokens + 64
    verifier = ["--device", plan.device, "--dtype", run.dtype, "--max-context", str(max_context), "--kv-tokens",
                str(max_context + 4096), "--max-batch", "1", "--prefill-chunk", str(plan.prefill_chunk), *run.flags]  # fmt: skip
    drafter = ["--reference", str(reference), "--taps", ",".join(map(str, plan.taps)), "--oracle-seed", "7"]
    return start_stack(str(model), str(model), log_dir, verifier_args=tuple(verifier), drafter_args=tuple(drafter),
                       gateway_args=("--http-port", "-1"), drafter_module="ddtree.tools.selftest.oracle.replay_drafter")  # fmt: skip


def first_mismatch(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def run_row(run_pass: Pass, kind: str, context: int, run, prompt_tokens: int) -> dict:
    s = run.summary
    return dict(mode=run_pass.name, dtype=run_pass.dtype, kind=kind, context=context, prompt_tokens=prompt_tokens,
                tokens=run.completion_tokens, steps=s.steps, tau=s.tau, draft_ms=s.draft_ms, verify_ms=s.verify_ms,
                transport_ms=s.transport_ms, step_ms=s.step_ms, wall_step_ms=run.wall_step_ms,
                decode_tok_s=run.decode_tok_s, ttft_ms=run.ttft_ms,
                first_transport_ms=float(run.steps[0]["transport_ms"]) if run.steps else 0.0)  # fmt: skip


def tie_at(verifier: str, prefix: list[int], other: int) -> dict:
    """Why DDTree left AR at a position: the target's two most likely next tokens after `prefix` (asked of
    the verifier alone, AR, one token) and whether DDTree's token (`other`) was the second. A gap of a few
    bf16 rounding units with DDTree on the second is a near-tie; a wide gap, or DDTree on neither, is a
    bug in the batched verify path. The gap is as a prefill of `prefix` sees it (not the decode's own row)."""
    import grpc

    from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(verifier) as channel:
        req = verifier_pb2.GenerateRequest(request_id="gpu-check-tie", input_ids=prefix, max_new_tokens=1,
                                           ignore_eos=True, top_logprobs=2,
                                           spec=common_pb2.SpecOptions(no_spec=True))  # fmt: skip
        lp = [t for msg in verifier_pb2_grpc.VerifierStub(channel).Generate(req, timeout=600) for t in msg.logprobs]
    top_ids, top_lp = list(lp[0].top_ids), list(lp[0].top_logprobs)
    return dict(top_ids=top_ids, top_logprobs=top_lp, gap=top_lp[0] - top_lp[1], ddtree_token=other,
                ddtree_took_second=other == top_ids[1])  # fmt: skip


def serve_contexts(plan: ServePlan, run_pass: Pass, stack, tok, reference: pathlib.Path, corrupt: bool,
                   deadline: float, log=print, rows: list | None = None, on_row=lambda: None) -> list[dict]:  # fmt: skip
    """The pass's rows (appended to `rows` when given, on_row() after each context); a context not started
    past `deadline` (perf_counter) is a "skipped" row."""
    from ddtree.protocol.ddtree.v1 import gateway_pb2
    from ddtree.tools.bench.prompts import make_prompts
    from ddtree.tools.bench.runner import GatewayEndpoint

    ep = GatewayEndpoint(stack.gateway, tok, timeout_s=1800.0)
    rows, refs = ([] if rows is None else rows), []
    try:
        for i, context in enumerate((plan.warmup_context, *run_pass.contexts)):  # the first builds the kernels
            if time.perf_counter() > deadline:
                rows.append(dict(mode=run_pass.name, kind="skipped", context=context, reason="past --deadline-s"))
                log(f"{run_pass.name:<11} {context:>7} skipped: past the deadline")
                on_row()
                continue
            ids = make_prompts(tok, "code", context, 2)[1]  # the second chunk: no prefix shared across contexts
            prompt = list(ep.stub.Tokenize(gateway_pb2.TokenizeRequest(text=tok.decode(ids)), timeout=60).token_ids)
            n = 8 if i == 0 else plan.new_tokens
            ar = ep.generate(ids, n, no_spec=True)
            refs.append(prompt + ar.token_ids)
            tmp = reference.with_suffix(".tmp")
            tmp.write_text(json.dumps({"sequences": refs}))
            tmp.replace(reference)  # the oracle re-reads it on the next unknown sequence
            dd = ep.generate(ids, n, budget=plan.budget)
            expected = list(ar.token_ids)
            if corrupt:  # the check's own test: a spoiled reference must be reported
                expected[-1] = (expected[-1] + 1) % tok.vocab_size
            bad = first_mismatch(expected, dd.token_ids)
            same = dict(identical=bad is None, first_mismatch=bad, strict=run_pass.strict)
            if bad is not None and bad < min(len(expected), len(dd.token_ids)):
                same["tie"] = tie_at(stack.get("verifier").address, prompt + expected[:bad], dd.token_ids[bad])
            if i == 0:
                rows.append(dict(mode=run_pass.name, dtype=run_pass.dtype, kind="warmup", context=context, **same))
                log(f"{run_pass.name:<11} warm-up ({context} tokens): {_same(rows[-1])}")
                on_row()
                continue
            rows += [run_row(run_pass, "ar", context, ar, len(prompt)), run_row(run_pass, "ddtree", context, dd,
                     len(prompt))]  # fmt: skip
            rows[-1].update(same, speedup_vs_ar=dd.decode_tok_s / ar.decode_tok_s if ar.decode_tok_s else None,
                            low_acceptance=bad is None and dd.summary.tau < MIN_TAU)  # fmt: skip
            rows[-2].update(same)
            on_row()
            log(format_pair(rows[-2], rows[-1]))
    finally:
        ep.close()
    return rows


def run_serving(plan: ServePlan, work: pathlib.Path, corrupt: bool = False, deadline: float = float("inf"),
                log=print, on_row=lambda out: None) -> dict:  # fmt: skip
    """{plan, passes, checkpoint, rows, stacks, errors, skipped, mismatches, ...}; past `deadline`
    (perf_counter) no new stack starts and no new context is served (their contexts: "skipped" rows);
    on_row(result) after every context (the JSON saved)."""
    from ddtree.tokenization.tokenizer import Tokenizer
    from ddtree.tools.selftest.oracle.trees import expected_accept_length

    model = work / "kimi-shaped"
    ckpt = make_checkpoint(plan, model)
    log(f"checkpoint: {ckpt['bytes'] / 1e9:.2f} GB in {ckpt['make_s']:.1f} s ({model})")
    tok = Tokenizer(model)
    runs, graphs_note = passes(plan)
    result = dict(plan=dataclasses.asdict(plan), passes=[dataclasses.asdict(r) for r in runs], checkpoint=ckpt,
                  cuda_graphs=graphs_note, rows=[], stacks=[], errors=[],
                  expected_tau=expected_accept_length(budget=plan.budget))  # fmt: skip
    log(HEADER)
    on_row(result)
    for run_pass in runs:
        if time.perf_counter() > deadline:  # a stack takes a minute to start: none past the deadline
            result["rows"] += [dict(mode=run_pass.name, kind="skipped", context=c, reason="past --deadline-s")
                               for c in run_pass.contexts]  # fmt: skip
            log(f"{run_pass.name}: not started, past the deadline")
            continue
        reference = work / f"reference-{run_pass.name}.json"
        reference.write_text(json.dumps({"sequences": []}))
        logs = work / f"logs-{run_pass.name}"
        t0 = time.perf_counter()
        try:  # a pass that fails is reported and the next one still runs
            stack = start(plan, run_pass, model, reference, logs)
            result["stacks"].append(dict(mode=run_pass.name, start_s=time.perf_counter() - t0, logs=str(logs)))
            try:
                serve_contexts(plan, run_pass, stack, tok, reference, corrupt, deadline, log, result["rows"],
                               lambda: on_row(result))  # fmt: skip
            finally:
                result["stacks"][-1]["exit_codes"] = stack.stop()
        except Exception:
            result["errors"].append(dict(part=f"serving {run_pass.name}", error=traceback.format_exc()[-3000:],
                                         logs=str(logs)))  # fmt: skip
            log(f"{run_pass.name}: FAILED\n{traceback.format_exc()}")
    result["skipped"] = sum(r["kind"] == "skipped" for r in result["rows"])
    result["low_acceptance"] = sum(bool(r.get("low_acceptance")) for r in result["rows"])
    differ = [r for r in result["rows"] if r["kind"] in ("ddtree", "warmup") and not r["identical"]]
    result["mismatches"] = sum(r["strict"] for r in differ)
    result["divergences"] = sum(not r["strict"] for r in differ)
    return result


HEADER = (f"{'mode':<11} {'context':>7} {'kind':<6} {'tok':>4} {'steps':>5} {'tau':>5} {'draft':>7} {'verify':>7} "
          f"{'transp':>7} {'step ms':>8} {'tok/s':>7} {'ttft ms':>8}  same as AR")  # fmt: skip


def _same(r: dict) -> str:
    if r["identical"]:
        return f"yes{'  LOW TAU (the oracle is not followed)' if r.get('low_acceptance') else ''}"
    tie = r.get("tie")
    why = "" if tie is None else (f" (AR's top-2 gap {tie['gap']:.3g} nats, DDTree took "
                                  f"{'#2' if tie['ddtree_took_second'] else 'neither'})")  # fmt: skip
    return f"{'MISMATCH' if r['strict'] else 'diverges'} at token {r['first_mismatch']}{why}"


def format_pair(ar: dict, dd: dict) -> str:
    lines = []
    for r in (ar, dd):
        lines.append(f"{r['mode']:<11} {r['context']:>7} {r['kind']:<6} {r['tokens']:>4} {r['steps']:>5} "
                     f"{r['tau']:>5.2f} {r['draft_ms']:>7.2f} {r['verify_ms']:>7.2f} {r['transport_ms']:>7.2f} "
                     f"{r['step_ms']:>8.2f} {r['decode_tok_s']:>7.1f} {r['ttft_ms']:>8.1f}  "
                     f"{'' if r is ar else _same(r)}")  # fmt: skip
    return "\n".join(lines)
