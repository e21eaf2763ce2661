"""A/B of verifier settings on one machine, interleaved prompt by prompt, so that drift in the machine's
speed falls on every arm alike.

    python -m scripts.bench.bench_ab [--corpus runs/corpus] --kind code --context 4096 --prompts 11 \
        --arm "fixed=--tree-cut fixed" --arm "cost=--tree-cut cost" [--out runs/bench_ab.json]

Each arm is a private drafter + verifier (the demo pair unless --model / --drafter; `--arm-drafter
NAME=DIR` gives an arm its own drafter, `--arm-drafter-flags NAME=FLAGS` its drafter flags, `--arm-env
NAME=VAR=VALUE ...` environment variables of both processes) started with that arm's verifier flags. For every prompt, each
arm in turn generates it AR (no_spec) then DDTree, greedy, fixed length (ignore_eos); outputs must equal
AR's (the script fails otherwise). Per arm it prints the aggregate decode speed (all tokens / all decode
time, the verifier's clock) of DDTree and AR, their ratio, tau and the median step; JSON keeps every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import tempfile

from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.tools.bench.prompts import make_prompts
from ddtree.tools.bench.runner import VerifierEndpoint, private_verifier


def _arm(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"an arm is NAME=FLAGS, got {text!r}")
    return name, tuple(flags.split())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=pathlib.Path, help="dir with heldout_{kind}.txt (default: the standard library)")
    p.add_argument("--model", default="checkpoints/demo/target")
    p.add_argument("--drafter", default="checkpoints/demo/drafter")
    p.add_argument("--kind", default="code")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--arm", type=_arm, action="append", required=True, help="NAME=verifier flags (repeat)")
    p.add_argument(
        "--arm-drafter",
        type=_arm,
        action="append",
        default=[],
        help="NAME=DIR: that arm's drafter checkpoint instead of --drafter (old drafter vs new)",
    )
    p.add_argument(
        "--arm-drafter-flags",
        type=_arm,
        action="append",
        default=[],
        help="NAME=FLAGS: that arm's drafter flags (e.g. --threads 2)",
    )
    p.add_argument(
        "--arm-env",
        type=_arm,
        action="append",
        default=[],
        help="NAME=VAR=VALUE ...: environment variables of that arm's drafter and verifier (e.g. GOMP_SPINCOUNT=300000)",
    )
    p.add_argument(
        "--arm-python",
        type=_arm,
        action="append",
        default=[],
        help="NAME=PYTHON: the interpreter of that arm's processes, e.g. another checkout's venv (old commit vs new)",
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench_ab.json"))
    args = p.parse_args(argv)
    tok = Tokenizer(args.model)
    prompts = make_prompts(tok, args.kind, args.context, args.prompts, args.corpus)
    runs: dict[str, list[dict]] = {name: [] for name, _ in args.arm}
    drafters = {name: " ".join(d) for name, d in args.arm_drafter}
    drafter_flags = dict(args.arm_drafter_flags)
    pythons = {name: " ".join(py) for name, py in args.arm_python}
    envs = {}
    for name, assignments in args.arm_env:
        pairs = [a.partition("=") for a in assignments]
        if not pairs or any(not var or not sep for var, sep, _ in pairs):
            p.error(f"--arm-env {name}= takes VAR=VALUE pairs, got {' '.join(assignments)!r}")
        envs[name] = {var: value for var, _, value in pairs}
    unknown = (set(drafters) | set(drafter_flags) | set(envs) | set(pythons)) - set(runs)
    if unknown:
        p.error(f"--arm-drafter / --arm-drafter-flags / --arm-env / --arm-python name no arm: {sorted(unknown)}")
    with contextlib.ExitStack() as stack:
        endpoints = {}
        for name, flags in args.arm:
            log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"ddtree-ab-{name}-"))
            address = stack.enter_context(
                private_verifier(
                    args.model,
                    drafters.get(name, args.drafter),
                    args.context + args.tokens + 64,
                    log_dir,
                    verifier_args=flags,
                    drafter_args=drafter_flags.get(name, ()),
                    name=name,
                    env=envs.get(name),
                    python=pythons.get(name),
                )
            )
            endpoints[name] = stack.enter_context(contextlib.closing(VerifierEndpoint(address)))
            endpoints[name].generate(prompts[0][:64], 8)  # warm-up
            print(
                f"arm {name}: drafter {drafters.get(name, args.drafter)} {' '.join(drafter_flags.get(name, ()))}, "
                f"verifier {' '.join(flags) or '(defaults)'}; "
                f"env {' '.join(f'{k}={v}' for k, v in envs.get(name, {}).items()) or '(defaults)'}; "
                f"python {pythons.get(name, 'this one')}; "
                f"logs in {log_dir}",
                flush=True,
            )
        same_across_arms = 0  # prompts whose output every arm gives alike (expected when only the code differs)
        for i, ids in enumerate(prompts):
            outputs = set()
            for name, ep in endpoints.items():
                ar = ep.generate(ids, args.tokens, no_spec=True)
                dd = ep.generate(ids, args.tokens)
                if ar.token_ids != dd.token_ids:
                    raise AssertionError(f"arm {name}, prompt {i}: DDTree output differs from AR")
                outputs.add(tuple(dd.token_ids))
                runs[name].append(
                    {
                        "ar_tok_s": ar.decode_tok_s,
                        "ddtree_tok_s": dd.decode_tok_s,
                        "tau": dd.summary.tau,
                        "step_ms": dd.summary.step_ms,
                        "steps": dd.summary.steps,
                    }
                )
            same_across_arms += len(outputs) == 1
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    rows = []
    for name, r in runs.items():
        n = args.tokens * len(r)
        dd = n / sum(args.tokens / x["ddtree_tok_s"] for x in r)  # all tokens / all decode time
        ar = n / sum(args.tokens / x["ar_tok_s"] for x in r)
        tau = sum(x["tau"] * x["steps"] for x in r) / sum(x["steps"] for x in r)
        step = statistics.median(x["step_ms"] for x in r)
        rows.append({"arm": name, "ddtree_tok_s": dd, "ar_tok_s": ar, "speedup": dd / ar, "tau": tau, "step_ms": step})
        print(
            f"{name:>10} {args.kind}@{args.context}: DDTree {dd:6.1f} tok/s  AR {ar:6.1f} tok/s  "
            f"{dd / ar:.2f}x  tau {tau:.2f}  step {step:.1f} ms"
        )
    print(f"outputs equal across arms on {same_across_arms} of {len(prompts)} prompts")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "runs": runs,
        "same_across_arms": same_across_arms,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
