"""Two `ddtree diagnose` runs on the demo deployment, as issue 7 asks for them; prints and saves the reports.

    python -m scripts.bench.diagnose_demo reconcile [--out runs/diagnose_reconcile.json]
    python -m scripts.bench.diagnose_demo window --window 4 [--out runs/diagnose_window.json]

reconcile: the default stack with the verifier writing step records to a file; a real run (a 1000-token
stretch of standard-library code that the profile does not use, sent as text through the gateway by
`ddtree generate --json`, 400 tokens, ignore_eos) whose client-side decode speed is the observed figure;
then `ddtree diagnose --kind code --observed-tps X --context C --output N --step-log FILE --last 1`.

window: the stack with `drafter --window W`, and `ddtree diagnose --start-window-off` (a second drafter
with the same weights and no window) on code at contexts 16 and 1024.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from ddtree.launcher import start_stack
from ddtree.tokenization.tokenizer import Tokenizer
from ddtree.tools.bench.prompts import make_prompts

DEMO = pathlib.Path("checkpoints/demo")


def _diagnose(verifier: str, *flags: str) -> int:
    return subprocess.call(
        [sys.executable, "-m", "ddtree.cli", "diagnose", "--verifier", verifier, "--kind", "code", *flags]
    )


def reconcile(out: str) -> int:
    log = pathlib.Path(tempfile.mkdtemp(prefix="diagnose-demo-"))
    steps = log / "steps.jsonl"
    tok = Tokenizer(DEMO / "target")
    text = tok.decode(make_prompts(tok, "code", 1000, 12)[11])  # past the texts the profile uses
    with start_stack(
        str(DEMO / "target"), str(DEMO / "drafter"), log, verifier_args=("--step-log", str(steps))
    ) as stack:
        run = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ddtree.cli",
                    "generate",
                    "--gateway",
                    stack.gateway,
                    "--prompt",
                    text,
                    "--max-tokens",
                    "400",
                    "--ignore-eos",
                    "--json",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        observed = run["timing"]["decode_tokens_per_s"]
        context, tokens = run["usage"]["prompt_tokens"], run["usage"]["completion_tokens"]
        print(
            f"real run: context {context}, {tokens} tokens, observed {observed:.1f} tok/s (client clock), "
            f"avg accept {run['spec']['avg_accept_length']:.2f}",
            flush=True,
        )
        return _diagnose(
            stack.verifier,
            "--observed-tps",
            f"{observed:.2f}",
            "--context",
            str(context),
            "--output",
            str(tokens),
            "--step-log",
            str(steps),
            "--last",
            "1",
            "--contexts",
            "16,512,1024,2048",
            "--out",
            out,
        )


def window(width: int, out: str) -> int:
    log = pathlib.Path(tempfile.mkdtemp(prefix="diagnose-demo-"))
    with start_stack(str(DEMO / "target"), str(DEMO / "drafter"), log, drafter_args=("--window", str(width))) as stack:
        return _diagnose(stack.verifier, "--start-window-off", "--contexts", "16,1024", "--out", out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("reconcile")
    r.add_argument("--out", default="runs/diagnose_reconcile.json")
    w = sub.add_parser("window")
    w.add_argument("--window", type=int, default=4)
    w.add_argument("--out", default="runs/diagnose_window.json")
    args = p.parse_args(argv)
    return reconcile(args.out) if args.what == "reconcile" else window(args.window, args.out)


if __name__ == "__main__":
    sys.exit(main())
