"""The lossless part of `ddtree selftest gpu` (issue 50's measurement): greedy DDTree against AR in bf16 on a
Kimi-K2.6-shaped checkpoint served on the device, many prompts in flight together, with the verifier's row
invariance on and then off.

1. A random full-width checkpoint (serving_check.make_checkpoint: hidden 7168, 64 heads, MLA latent 512,
   INT4 routed experts), 2 layers (one dense, one MoE) and 16 experts by default: the kernels and widths the
   real model runs, few enough bytes to write in seconds.
2. PROMPTS prompts of random token ids, their lengths spread over LENGTHS so that prompts and their
   continuations cross the MLA attention's split edges (every 256 keys) at different rows.
3. Per setting of `--row-invariant` (on, then off: each its own verifier, beside the replay oracle drafter,
   selftest/oracle/replay_drafter.py): every prompt AR (no_spec) at once, then every prompt DDTree at once
   (budget 16, the oracle's noisy trees over that AR output), NEW_TOKENS tokens each. A prompt diverges when
   its DDTree tokens differ from its AR tokens; its row names the first such token and AR's top-2 gap there
   (the AR run's own log-probabilities), so a near-tie can be told from a wrong verify path. Near-ties: AR
   tokens whose top-2 log-probabilities are within NEAR_TIE (one bf16 unit of a logit in [2, 4)).

A divergence with row invariance on is a mismatch and fails the check (README, "What is identical to what");
with it off it is reported, not failed: that is the measurement of what the guarantee buys. The dry run (a
CPU, shrunk model) runs the same plumbing in fp32 on the CPU's torch path, where DDTree equals AR either way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import random
import time
import traceback

from ddtree.tools.selftest.serving_check import first_mismatch, make_checkpoint, make_plan

NEAR_TIE = 1 / 64  # top-2 log-probability gap: one bf16 unit of a logit in [2, 4)
MIN_TAU = 2.0  # below this, DDTree is not following the oracle's trees (as in serving_check)


@dataclasses.dataclass(frozen=True)
class LosslessPlan:
    prompts: int
    new_tokens: int
    lengths: tuple[int, int]  # prompt lengths drawn uniformly in [lo, hi]
    dtype: str
    budget: int = 16
    seed: int = 5
    settings: tuple[str, ...] = ("on", "off")  # --row-invariant, in this order


def make_lossless_plan(dry_run: bool, prompts: int = 0, new_tokens: int = 0) -> LosslessPlan:
    plan = LosslessPlan(3, 12, (8, 40), "float32") if dry_run else LosslessPlan(16, 256, (64, 1100), "bfloat16")
    changes = {k: v for k, v in (("prompts", prompts), ("new_tokens", new_tokens)) if v}
    return dataclasses.replace(plan, **changes)


def make_prompts(plan: LosslessPlan, vocab_size: int) -> list[list[int]]:
    """Distinct prompts of random ids in [2, vocab) (0 and 1 left out: BOS / EOS in most vocabularies)."""
    rng = random.Random(plan.seed)
    return [[rng.randrange(2, vocab_size) for _ in range(rng.randint(*plan.lengths))] for _ in range(plan.prompts)]


def start_services(serve_plan, plan: LosslessPlan, model: pathlib.Path, reference: pathlib.Path, setting: str,
                   prompts: list[list[int]], log_dir: pathlib.Path):  # fmt: skip
    """The replay oracle drafter, then a verifier at `--row-invariant setting` sized for every prompt at once."""
    from ddtree.launcher import start_service

    drafter = start_service("drafter", ["drafter", "--model", str(model), "--target", str(model), "--port", "0",
                                        "--reference", str(reference), "--taps", ",".join(map(str, serve_plan.taps)),
                                        "--oracle-seed", "7"], log_dir,
                            module="ddtree.tools.selftest.oracle.replay_drafter")  # fmt: skip
    longest = max(map(len, prompts)) + plan.new_tokens + 64
    kv = sum(len(p) + plan.new_tokens + 64 for p in prompts) + 4096
    args = ["verifier", "--model", str(model), "--drafter", drafter.address, "--port", "0", "--device",
            serve_plan.device, "--dtype", plan.dtype, "--row-invariant", setting, "--max-batch", str(len(prompts)),
            "--max-context", str(longest), "--kv-tokens", str(kv), "--prefill-chunk", str(serve_plan.prefill_chunk)]  # fmt: skip
    try:
        verifier = start_service("verifier", args, log_dir, timeout=600)
    except Exception:
        drafter.stop()
        raise
    return drafter, verifier


def generate_all(address: str, prompts: list[list[int]], plan: LosslessPlan, no_spec: bool) -> list[dict]:
    """Every prompt in flight at once: per prompt {tokens, gaps (AR's top-2 log-probability gap per token),
    accepts (tokens per step)}, in prompt order."""
    import grpc

    from ddtree.protocol.ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    def one(prompt: list[int]) -> dict:
        req = verifier_pb2.GenerateRequest(input_ids=prompt, max_new_tokens=plan.new_tokens, ignore_eos=True,
                                           top_logprobs=2, spec=common_pb2.SpecOptions(no_spec=no_spec,
                                                                                       budget=plan.budget))  # fmt: skip
        out = dict(tokens=[], gaps=[], top_ids=[], accepts=[])
        with grpc.insecure_channel(address) as channel:
            for msg in verifier_pb2_grpc.VerifierStub(channel).Generate(req, timeout=1800):
                out["tokens"] += msg.token_ids
                for lp in msg.logprobs:
                    out["gaps"].append(lp.top_logprobs[0] - lp.top_logprobs[1])
                    out["top_ids"].append(list(lp.top_ids))
                out["accepts"] += [s.accept_length for s in msg.steps]
        return out

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def compare(ar: list[dict], dd: list[dict]) -> list[dict]:
    """One entry per prompt whose DDTree tokens differ from its AR tokens: where, AR's top-2 there, DDTree's."""
    out = []
    for i, (a, d) in enumerate(zip(ar, dd, strict=True)):
        at = first_mismatch(a["tokens"], d["tokens"])
        if at is None:
            continue
        entry = dict(prompt=i, at=at)
        if at < min(len(a["tokens"]), len(d["tokens"])):
            entry.update(ar_top_ids=a["top_ids"][at], ar_gap=a["gaps"][at], ddtree_token=d["tokens"][at],
                         ddtree_took_second=d["tokens"][at] == a["top_ids"][at][1])  # fmt: skip
        out.append(entry)
    return out


def measure_setting(serve_plan, plan: LosslessPlan, model: pathlib.Path, prompts: list[list[int]], setting: str,
                    work: pathlib.Path, log) -> dict:  # fmt: skip
    reference = work / f"reference-{setting}.json"
    reference.write_text(json.dumps({"sequences": []}))
    t0 = time.perf_counter()
    drafter, verifier = start_services(serve_plan, plan, model, reference, setting, prompts, work / f"logs-{setting}")
    row = dict(row_invariant=setting, dtype=plan.dtype, prompts=len(prompts), new_tokens=plan.new_tokens,
               prompt_tokens=[len(p) for p in prompts], start_s=time.perf_counter() - t0)  # fmt: skip
    try:
        t1 = time.perf_counter()
        ar = generate_all(verifier.address, prompts, plan, no_spec=True)
        row["ar_s"] = time.perf_counter() - t1
        reference.write_text(json.dumps({"sequences": [p + a["tokens"] for p, a in zip(prompts, ar)]}))
        t1 = time.perf_counter()
        dd = generate_all(verifier.address, prompts, plan, no_spec=False)
        row["ddtree_s"] = time.perf_counter() - t1
    finally:
        row["exit_codes"] = dict(verifier=verifier.stop(timeout=120), drafter=drafter.stop())
    accepts = [x for d in dd for x in d["accepts"]]
    diverged = compare(ar, dd)
    row.update(tokens=sum(len(a["tokens"]) for a in ar), near_ties=sum(g <= NEAR_TIE for a in ar for g in a["gaps"]),
               exact_ties=sum(g == 0 for a in ar for g in a["gaps"]), tau=sum(accepts) / max(1, len(accepts)),
               diverged=len(diverged), divergences=diverged)  # fmt: skip
    row["low_acceptance"] = row["tau"] < MIN_TAU
    return row


def run_lossless_check(dry_run: bool, work: pathlib.Path, deadline: float = float("inf"), log=print,
                       on_row=lambda out: None, layers: int = 0, experts: int = 0, prompts: int = 0,
                       new_tokens: int = 0) -> dict:  # fmt: skip
    """{plan, model, checkpoint, rows (one per --row-invariant setting, or a "skipped" one past `deadline`),
    errors, and tally's mismatches, divergences_off, low_acceptance}; on_row(result) after each setting."""
    serve_plan = make_plan(dry_run, layers or (0 if dry_run else 2), experts or (0 if dry_run else 16))
    plan = make_lossless_plan(dry_run, prompts, new_tokens)
    model = work / "kimi-shaped"
    ckpt = make_checkpoint(serve_plan, model)
    log(f"checkpoint: {serve_plan.layers} layers, hidden {serve_plan.hidden}, {serve_plan.experts} INT4 experts, "
        f"{ckpt['bytes'] / 1e9:.2f} GB in {ckpt['make_s']:.1f} s; {plan.prompts} prompts x {plan.new_tokens} "
        f"tokens in {plan.dtype}, all in flight")  # fmt: skip
    result = dict(plan=dataclasses.asdict(plan), model=dict(layers=serve_plan.layers, hidden=serve_plan.hidden,
                  experts=serve_plan.experts), checkpoint=ckpt, rows=[], errors=[])  # fmt: skip
    on_row(result)
    prompt_ids = make_prompts(plan, ckpt["vocab"])
    for setting in plan.settings:
        if time.perf_counter() > deadline:
            result["rows"].append(dict(row_invariant=setting, skipped="past the deadline"))
            log(f"row invariance {setting}: skipped, past the deadline")
            continue
        try:
            row = measure_setting(serve_plan, plan, model, prompt_ids, setting, work, log)
            result["rows"].append(row)
            log(format_row(row))
        except Exception:
            result["errors"].append(dict(part=f"lossless {setting}", error=traceback.format_exc()[-3000:]))
            log(f"row invariance {setting}: FAILED\n{traceback.format_exc()}")
        on_row(result)
    result.update(tally(result["rows"]))
    return result


def tally(rows: list[dict]) -> dict:
    """The check's verdict from its rows: prompts diverged with row invariance on (mismatches: they fail it),
    with it off (reported; None when not measured), and measured settings whose DDTree run matched AR at
    under MIN_TAU tokens a step (low_acceptance: the oracle's trees were not followed, nothing was tested)."""
    measured = {r["row_invariant"]: r for r in rows if "diverged" in r}
    return dict(mismatches=measured["on"]["diverged"] if "on" in measured else 0,
                divergences_off=measured["off"]["diverged"] if "off" in measured else None,
                low_acceptance=sum(r["low_acceptance"] and r["diverged"] == 0 for r in measured.values()))  # fmt: skip


def format_row(row: dict) -> str:
    first = ", ".join(f"prompt {d['prompt']} at {d['at']}" + (f" (AR top-2 gap {d['ar_gap']:.3g})" if "ar_gap" in d
                      else "") for d in row["divergences"][:4])  # fmt: skip
    return (f"row invariance {row['row_invariant']:<3}: {row['prompts']} prompts x {row['new_tokens']} tokens, "
            f"near-ties {row['near_ties']}, DDTree tau {row['tau']:.2f}, AR {row['ar_s']:.1f} s, DDTree "
            f"{row['ddtree_s']:.1f} s; diverged {row['diverged']}{': ' + first if first else ''}")  # fmt: skip
