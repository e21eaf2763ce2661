"""The parts of `ddtree selftest gpu`, in the order they run: by value, so that a run cut short by its time
limit has measured what matters most.

    step       (c) the Kimi K2.6 TP-8 rank's verify step, 8k context first: what the issues are judged by
    drafter    (e) the drafter's transport and device tree
    lossless        greedy DDTree against AR in bf16, 16 prompts x 256 tokens in flight, row invariance on
                    and off (lossless_check.py): issue 50's measurement
    kernels    (a) every kernel against its torch reference
    invariance      each tree row's result against its AR twin's (`ddtree selftest invariance`,
                    invariance_check.py), when that module has the entry point below (INVARIANCE_ENTRY)
    deploy     (d) warm start, first request, the memory plan against the device
    serving    (b) a Kimi-shaped checkpoint served end to end: last, and bounded by --serving-budget-s

Each part gets the run's Deadline (record.py), sooner for step (--step-deadline-s) and serving
(--serving-budget-s): past it, it starts no new shape, context or stack. It calls on_row(out) after each
row, which saves the JSON (record.Record), so a kill at any point loses the row in flight alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import shutil
import tempfile
from collections.abc import Callable

from ddtree.tools.selftest.record import Deadline

# The row-invariance measurement, added as a part when its module has this function:
# run_invariance_check(dry_run: bool, device, log, deadline: float (perf_counter), on_row) -> dict with
# "rows", "mismatches" (rows whose result differs from the row computed alone) and "errors", calling
# on_row(partial) after each row, as the other parts do.
INVARIANCE_MODULE, INVARIANCE_ENTRY = "ddtree.tools.selftest.invariance_check", "run_invariance_check"


@dataclasses.dataclass(frozen=True)
class Part:
    name: str  # the JSON key, and --skip-<name>
    title: str
    run: Callable  # (args, device, deadline: Deadline, log, on_row) -> dict with "errors"
    compared: bool = False  # its "mismatches" fail the check
    budget: str = ""  # the args attribute of its own time budget (s), "" for none
    module: str = ""  # a module that must be importable for the part to run ("" = always)
    entry: str = ""  # and a function it must define

    def deadline(self, args, run_deadline: Deadline) -> Deadline:
        return run_deadline.sooner(getattr(args, self.budget)) if self.budget else run_deadline

    def available(self) -> bool:
        return not self.module or _defines(self.module, self.entry)


def _defines(module: str, entry: str) -> bool:
    try:
        if importlib.util.find_spec(module) is None:
            return False
        return not entry or hasattr(importlib.import_module(module), entry)
    except ImportError:
        return False


def _step(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest import step_check

    with tempfile.TemporaryDirectory(prefix="selftest-step-") as work:
        return step_check.run_step_check(args.dry_run, pathlib.Path(work), deadline.at, log, on_row)


def _drafter(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest import drafter_check

    return drafter_check.run_drafter_check(args.dry_run, device, log, deadline.at, on_row)


def _lossless(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest import lossless_check

    with tempfile.TemporaryDirectory(prefix="selftest-lossless-") as work:
        return lossless_check.run_lossless_check(args.dry_run, pathlib.Path(work), deadline.at, log, on_row)


def _kernels(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest.kernels import kernel_check as gk

    log(gk.HEADER)
    return gk.run_kernels(args.dry_run, device, args.corrupt_reference, log, deadline.at, on_row)


def _invariance(args, device, deadline: Deadline, log, on_row) -> dict:
    module = importlib.import_module(INVARIANCE_MODULE)
    return getattr(module, INVARIANCE_ENTRY)(args.dry_run, device, log, deadline.at, on_row)


def _deploy(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest import deploy_check

    with tempfile.TemporaryDirectory(prefix="selftest-deploy-") as work:
        return deploy_check.run_deploy_check(args.dry_run, pathlib.Path(work), log)


def _serving(args, device, deadline: Deadline, log, on_row) -> dict:
    from ddtree.tools.selftest import serving_check as gs

    plan = gs.make_plan(args.dry_run, args.layers, args.experts, args.contexts, args.new_tokens)
    log(f"{plan.layers} layers, hidden {plan.hidden}, {plan.experts} INT4 experts, contexts {list(plan.contexts)}, "
        f"{plan.new_tokens} new tokens, {deadline.left_s():.0f} s")  # fmt: skip
    work = pathlib.Path(args.work_dir) if args.work_dir else pathlib.Path(tempfile.mkdtemp(prefix="selftest-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        out = gs.run_serving(plan, work, args.corrupt_reference, deadline.at, log, on_row)
    except Exception:
        args.keep = True  # the failed run's checkpoint and logs stay for a look
        raise
    if not args.work_dir and not args.keep and not out["errors"]:
        shutil.rmtree(work, ignore_errors=True)
    return out


PARTS = (
    Part("step", "(c) the verify step of a Kimi K2.6 rank (TP 8, emulated), as `ddtree bench step` measures it",
         _step, budget="step_deadline_s"),
    Part("drafter", "(e) the drafter: transport per Draft call at Kimi width, the tree built on the device", _drafter,
         compared=True),
    Part("lossless", "lossless: greedy DDTree against AR, every prompt in flight, row invariance on and off",
         _lossless, compared=True, budget="lossless_budget_s"),
    Part("kernels", "(a) kernels against their torch references", _kernels, compared=True),
    Part("invariance", "row invariance: each row's result alone and in a batch", _invariance, compared=True,
         module=INVARIANCE_MODULE, entry=INVARIANCE_ENTRY),
    Part("deploy", "(d) deployment: warm start, first vs warm request, the memory plan against the device", _deploy),
    Part("serving", "(b) served end to end", _serving, compared=True, budget="serving_budget_s"),
)  # fmt: skip
