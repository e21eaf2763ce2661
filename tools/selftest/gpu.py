"""`ddtree selftest gpu`: the kernels against their references, then a reduced-depth Kimi-K2.6-shaped
model served end to end on one GPU, in one table and one JSON.

    ddtree selftest gpu --out runs/selftest_gpu.json       # one CUDA GPU
    ddtree selftest gpu --dry-run --out /tmp/selftest.json  # the same on a CPU: shapes shrunk, kernels
                                                            # under TRITON_INTERPRET=1
    options: --skip-kernels | --skip-serving | --skip-step | --skip-deploy | --skip-drafter | --skip-lossless,
             --layers N, --experts N, --contexts 128,1024, --new-tokens N,
             --work-dir DIR (checkpoint and service logs; default a temp dir, removed unless --keep)

The parts run in the order of parts.py, by value: (c), (e), lossless, (a), row invariance (when installed),
(d), (b).
The JSON is saved (atomically: record.py) after every row of every part, and no part starts a new shape,
context or stack past --deadline-s (part (c) also past --step-deadline-s, part (b) past --serving-budget-s
and the lossless part past --lossless-budget-s from their starts), so a run killed at any point keeps every
row it finished; "parts" says which ran to the end ("done"), which were cut ("running"), skipped or failed.

lossless_check.py: greedy DDTree against AR in bf16 on a 2-layer full-width Kimi-shaped checkpoint (16 INT4
    experts), 16 prompts x 256 tokens all in flight, with the verifier's --row-invariant on, then off: the
    prompts that diverge (a mismatch with it on), where, and AR's top-2 gap there.

(a) selftest/kernels/kernel_check.py: MLA decode / verify / extend, the latent write, the FP8 / INT4 dense GEMMs, the fused
    MoE (bf16 / INT4 / FP8, selftest/kernels/moe_bench.py) and the drafter's graph step (draft_graph.py), each against its
    torch reference, with kernel and torch times and the achieved bandwidth.
(b) serving_check.py: a random full-width Kimi-K2.6-shaped checkpoint (4 layers, 64 INT4 experts by
    default; kimi_checkpoint.py) made on this machine, served by gateway + verifier + the replay oracle
    drafter (selftest/oracle/replay_drafter.py) on one GPU; AR and DDTree at contexts 128 / 1k / 4k / 16k / 32k, step
    time split into draft / verify / transport, DDTree's tokens equal to AR's. CUDA graphs are measured
    when the verifier can capture the checkpoint, and the JSON says why not when it cannot.

(c) step_check.py: the verify step of Kimi K2.6's rank 0 at TP 8 (`ddtree bench step --emulate-tp 8`, full
    depth, random INT4 weights made on the GPU): AR and trees of 9 / 17 rows at contexts 128 / 1k / 8k / 32k,
    eager and CUDA graphs, launches, host syncs and all-reduces per step (numbers, not a check).

(d) deploy_check.py: a verifier's warm start (start to SERVING), its first request against a warm one, and the
    largest KV the memory plan admits against what the device reports free.

(e) drafter_check.py: the drafter's transport per Draft call at Kimi width (the co-located channel with the
    ring on the GPU over CUDA IPC, and in shared memory, against gRPC; commits of 1 / 8 / 2048 tokens, and
    of 1 after 10 ms idle) and its tree build on the device against the host's heap (equal).

It exits 1 on any mismatch (a kernel off its reference, DDTree off AR in fp32), on an error, and when a
DDTree run that matches AR accepts under 2 tokens per step (the oracle's trees not followed); 2 when it
cannot run at all.
DDTree is compared with AR in two passes: bf16 (the timing table; a difference there is reported as a
divergence, since a near-tie may resolve differently when the batch shape changes, docs/design.md §3.7;
its row says AR's top-2 gap there and whether DDTree took the second)
and fp32 (contexts up to 4k; any difference is a mismatch).
The JSON says where it was measured, so that it can be committed under docs/measurements/: {date (UTC),
device, commit (of the checkout, when git can tell) and dirty, command, torch, triton, dry_run, wall_s, kernels:
{rows, mismatches, skipped}, parts: {name: state}, serving: {plan, passes, checkpoint, cuda_graphs, expected_tau, stacks, rows,
mismatches, divergences}, step: {plan, source, config, model, rows, skipped}, mismatches, ok}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

from ddtree.tools.selftest.parts import PARTS
from ddtree.tools.selftest.record import Deadline, Record, save_json

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # tools/selftest/ -> the repository


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gpu",
        help="kernels against their references, then a Kimi-shaped model served end to end (one GPU)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/selftest_gpu.json"), help="the JSON")
    p.add_argument("--dry-run", action="store_true", help="shrunk shapes on a CPU, kernels interpreted")
    p.add_argument("--skip-kernels", action="store_true", help="no part (a)")
    p.add_argument("--skip-serving", action="store_true", help="no part (b)")
    p.add_argument("--skip-step", action="store_true", help="no part (c)")
    p.add_argument("--skip-deploy", action="store_true", help="no part (d)")
    p.add_argument("--skip-drafter", action="store_true", help="no part (e)")
    p.add_argument("--skip-invariance", action="store_true", help="no row-invariance part (when installed)")
    p.add_argument("--skip-lossless", action="store_true", help="no lossless part (DDTree against AR, many prompts)")
    p.add_argument(
        "--lossless-budget-s",
        type=float,
        default=200.0,
        help="the lossless part starts no verifier past this many seconds from its start",
    )
    p.add_argument("--step-deadline-s", type=float, default=300.0,
                   help="part (c): measure no new step shape after this many seconds from its start")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the served model (default 4; dry 2)")
    p.add_argument("--experts", type=int, default=0, help="routed experts per MoE layer (default 64; dry 4)")
    p.add_argument("--contexts", default="", help="comma-separated prompt lengths (default 128,1024,4096,16384,32768)")
    p.add_argument("--new-tokens", type=int, default=0, help="tokens generated per request (default 48; dry 12)")
    p.add_argument("--work-dir", default="", help="checkpoint + logs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir")
    p.add_argument("--deadline-s", type=float, default=450.0,
                   help="start no new part, shape or context after this many seconds from the start")  # fmt: skip
    p.add_argument("--serving-budget-s", type=float, default=240.0,
                   help="part (b): start no new stack or context after this many seconds from its start")  # fmt: skip
    p.add_argument("--commit", default="", type=_commit_hash,
                   help="the commit of a copied tree that git cannot tell (the device runner passes it)")  # fmt: skip
    p.add_argument("--corrupt-reference", action="store_true", help=argparse.SUPPRESS)  # tests: must fail
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton / the kernels are imported (children inherit it)
    try:
        import torch
    except ModuleNotFoundError:
        print("ddtree selftest gpu: needs torch, which this install does not have", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("ddtree selftest gpu: no CUDA device is visible; on a CPU only --dry-run runs", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    t0 = time.perf_counter()
    result = dict(provenance(name, sys.argv, args.commit), dry_run=args.dry_run, torch=torch.__version__,
                  triton=_triton_version(), corrupt_reference=args.corrupt_reference, errors=[])  # fmt: skip
    print(f"selftest gpu on {name}{' (dry run)' if args.dry_run else ''}", flush=True)
    log = lambda line: print(line, flush=True)  # noqa: E731
    record = Record(args.out, result)
    record.save()  # provenance on disk before anything can fail
    deadline = Deadline(t0 + args.deadline_s)
    for part in PARTS:
        if getattr(args, f"skip_{part.name}", False) or not part.available():
            continue
        if deadline.passed():  # no part starts past the deadline
            record.skip(part.name)
            log(f"\n{part.title}: skipped, past --deadline-s")
            continue
        print(f"\n{part.title}", flush=True)
        on_row = record.part(part.name)
        t1 = time.perf_counter()
        try:
            out = part.run(args, device, part.deadline(args, deadline), log, on_row)
            result["errors"] += out.get("errors", [])
            record.finish(part.name, out, time.perf_counter() - t1)
        except Exception:
            result["errors"].append(dict(part=part.name, error=traceback.format_exc()[-3000:]))
            traceback.print_exc()
            record.finish(part.name, None, time.perf_counter() - t1, "error")
        release_device_memory()
    result["mismatches"] = sum(result.get(part.name, {}).get("mismatches", 0) for part in PARTS if part.compared)
    low = sum(result.get(name, {}).get("low_acceptance", 0) for name in ("serving", "lossless"))
    result["ok"] = result["mismatches"] == 0 and not result["errors"] and not low
    result["wall_s"] = time.perf_counter() - t0
    record.save()
    print(summary(result), flush=True)
    print(f"saved {args.out} ({result['wall_s']:.0f} s)", flush=True)
    return 0 if result["ok"] else 1


def release_device_memory() -> None:
    """Give what a part left in this process's CUDA cache back to the device: the parts after it start
    services that plan against the memory free (deploy_check), and the next part's model needs it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def provenance(device: str, argv: list[str], given_commit: str = "") -> dict:
    """Where and when: the UTC date, the device, the command, and the checkout's commit (`unknown` outside a
    git checkout; `dirty` when its tracked files differ from that commit). given_commit: a copied tree's
    commit, said by whoever copied it; used when git cannot tell, and recorded as given."""
    commit, dirty = (f"{given_commit} (given)" if given_commit else "unknown"), None
    try:
        git = ["git", "-C", str(CHECKOUT)]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30,
                                check=True).stdout.strip()  # fmt: skip
        dirty = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=30, check=True).stdout.strip())  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pass
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return dict(date=date, device=device, commit=commit, dirty=dirty, command=" ".join(["ddtree", *argv[1:]]))


def _commit_hash(text: str) -> str:
    if text and not re.fullmatch(r"[0-9a-f]{7,40}", text):
        raise argparse.ArgumentTypeError(f"not a commit hash (7 to 40 lowercase hex digits): {text[:60]!r}")
    return text


def save(path: pathlib.Path, result: dict) -> None:
    save_json(path, result)


def summary(result: dict) -> str:
    lines = ["", "summary"]
    if "kernels" in result:
        k = result["kernels"]
        lines.append(f"  kernels: {len(k['rows'])} checked, {k['mismatches']} mismatches")
    if "serving" in result:
        s = result["serving"]
        dd = [r for r in s["rows"] if r["kind"] == "ddtree"]
        lines.append(f"  serving: {len(dd)} DDTree runs; differ from AR: {s['mismatches']} in fp32 (mismatches), "
                     f"{s['divergences']} in bf16 (divergences); expected tau {s['expected_tau']:.2f}; CUDA graphs: "
                     f"{s['cuda_graphs']}")  # fmt: skip
        if s["low_acceptance"]:
            lines.append(f"  serving: {s['low_acceptance']} DDTree runs with tau < 2: the oracle's trees not followed")
        if s["skipped"]:
            lines.append(f"  serving: {s['skipped']} contexts skipped, past --deadline-s")
    if "lossless" in result:
        lo = result["lossless"]
        lines.append(f"  lossless: prompts diverged from AR with row invariance on {lo['mismatches']} (mismatches), "
                     f"off {lo['divergences_off']}")  # fmt: skip
    if "step" in result:
        st = result["step"]
        lines.append(f"  step: {len(st['rows'])} shapes measured, {st['skipped']} skipped past --step-deadline-s")
    for e in result["errors"]:
        lines.append(f"  ERROR in {e['part']}: {e['error'].strip().splitlines()[-1]}")
    lines.append(f"  {'OK' if result['ok'] else 'FAILED'} in {result['wall_s']:.0f} s")
    return "\n".join(lines)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__
