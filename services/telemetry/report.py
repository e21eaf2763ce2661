"""Why is it slow? The arithmetic of `ddtree diagnose` and `ddtree bench`, as pure functions.

Throughput = accepted tokens per step (tau) / step time (docs/design.md §2): every function here keeps the
two factors apart. Inputs are step records (dicts with the StepStats fields and `request_id`, as the
verifier streams and logs them) or `ProfilePoint`s measured at controlled contexts; outputs are numbers
and `Flag`s that carry their evidence as a sentence. No I/O: tests/tools/test_diagnose.py drives every flag
with synthetic records.

Output position: a step's position in its own generation is its context minus the context of the
request's first record (the prompt length when step 0 is present).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence

Record = Mapping[str, object]


# ---- summaries ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepSummary:
    steps: int
    tokens: int  # sum of accept lengths: tokens committed by these steps
    tau: float  # tokens per step
    step_ms: float  # mean total step time
    draft_ms: float
    verify_ms: float
    transport_ms: float
    tok_s: float  # tokens / summed step time (the steps only: no time between steps)


def summarize(records: Iterable[Record]) -> StepSummary:
    rs = list(records)
    n = len(rs)
    if n == 0:
        return StepSummary(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    tokens = sum(int(r["accept_length"]) for r in rs)
    total = sum(float(r["total_ms"]) for r in rs)
    mean = lambda k: sum(float(r[k]) for r in rs) / n  # noqa: E731
    return StepSummary(
        n,
        tokens,
        tokens / n,
        total / n,
        mean("draft_ms"),
        mean("verify_ms"),
        mean("transport_ms"),
        1e3 * tokens / total if total > 0 else 0.0,
    )


def by_request(records: Iterable[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(str(r["request_id"]), []).append(r)
    return out


def output_positions(records: Sequence[Record]) -> list[int]:
    """Per record (one request's, any order): tokens generated before the step."""
    base = min(int(r["context_tokens"]) for r in records)
    return [int(r["context_tokens"]) - base for r in records]


def summarize_span(records: Sequence[Record], start: int, end: int) -> StepSummary:
    """One request's steps that begin at output positions [start, end)."""
    return summarize(r for r, pos in zip(records, output_positions(records)) if start <= pos < end)


# ---- profile and prediction --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProfilePoint:
    """DDTree (and AR) decode measured at one prompt length."""

    context: int
    tau: float  # DDTree tokens per step
    step_ms: float  # DDTree mean step time from the step records
    tok_s: float  # DDTree decode speed on the verifier's clock (time between steps included)
    ar_tok_s: float = 0.0  # AR decode speed at the same context (0 = not measured)

    @property
    def wall_step_ms(self) -> float:
        """Step time as decode speed sees it: tau / tok_s (step records + time between steps)."""
        return 1e3 * self.tau / self.tok_s if self.tok_s > 0 else self.step_ms

    @property
    def speedup(self) -> float:
        return self.tok_s / self.ar_tok_s if self.ar_tok_s > 0 else 0.0


def interpolate(points: Sequence[ProfilePoint], context: float, key: str) -> float:
    """`key` of the profile at `context`: linear between measured contexts. Past the last point step
    times continue the last segment's slope (attention grows with context) and tau stays flat; before
    the first point everything stays flat."""
    pts = sorted(points, key=lambda p: p.context)
    if not pts:
        raise ValueError("empty profile")
    val = lambda p: float(getattr(p, key))  # noqa: E731
    if context <= pts[0].context or len(pts) == 1:
        return val(pts[0])
    for a, b in zip(pts, pts[1:]):
        if context <= b.context:
            f = (context - a.context) / (b.context - a.context)
            return val(a) + f * (val(b) - val(a))
    a, b = pts[-2], pts[-1]
    if key == "tau":
        return val(b)
    slope = (val(b) - val(a)) / (b.context - a.context)
    return max(val(b) + slope * (context - b.context), val(b))


@dataclasses.dataclass(frozen=True)
class Prediction:
    context: int
    output: int
    steps: float  # steps the generation takes (fractional last step)
    tau: float  # output / steps
    step_ms: float  # mean step time over the generation
    tok_s: float
    extrapolated: bool  # the generation runs past the largest measured context


def predict(points: Sequence[ProfilePoint], context: int, output: int, step_key: str = "wall_step_ms") -> Prediction:
    """Walk a generation of `output` tokens from `context`, step by step: each step commits tau(ctx)
    tokens in step time(ctx), and the context grows by what it committed."""
    if output < 1:
        raise ValueError(f"output must be >= 1, got {output}")
    ctx, made, steps, ms = float(context), 0.0, 0.0, 0.0
    while made < output - 1e-9:
        tau = max(interpolate(points, ctx, "tau"), 1.0)  # a step commits at least its bonus token
        t = interpolate(points, ctx, step_key)
        f = min(1.0, (output - made) / tau)
        made += f * tau
        steps += f
        ms += f * t
        ctx += f * tau
    top = max(p.context for p in points)
    return Prediction(
        context,
        output,
        steps,
        output / steps,
        ms / steps,
        1e3 * output / ms if ms > 0 else 0.0,
        extrapolated=context + output > top + 1,
    )


@dataclasses.dataclass(frozen=True)
class Reconciliation:
    observed_tok_s: float
    predicted: Prediction
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.observed_tok_s / self.predicted.tok_s if self.predicted.tok_s > 0 else float("inf")

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= self.tolerance

    @property
    def implied_step_ms(self) -> float:
        """The step time that explains the observed speed at the predicted tau."""
        return 1e3 * self.predicted.tau / self.observed_tok_s if self.observed_tok_s > 0 else float("inf")

    @property
    def implied_tau(self) -> float:
        """The tau that explains the observed speed at the predicted step time."""
        return self.observed_tok_s * self.predicted.step_ms / 1e3

    def explain(self) -> str:
        p = self.predicted
        head = (
            f"observed {self.observed_tok_s:.1f} tok/s at context {p.context}, {p.output} tokens; predicted "
            f"{p.tok_s:.1f} tok/s = tau {p.tau:.2f} x 1/{p.step_ms:.1f} ms "
            f"({self.ratio - 1:+.0%}{', extrapolated past the profile' if p.extrapolated else ''})"
        )
        if self.within:
            return head + f": reconciled within ±{self.tolerance:.0%}"
        return head + (
            f": NOT within ±{self.tolerance:.0%}; the observed figure needs a step of "
            f"{self.implied_step_ms:.1f} ms at tau {p.tau:.2f}, or tau {self.implied_tau:.2f} at "
            f"{p.step_ms:.1f} ms (other load on the server, other text, or a different measure)"
        )


def reconcile(observed_tok_s: float, prediction: Prediction, tolerance: float = 0.15) -> Reconciliation:
    return Reconciliation(observed_tok_s, prediction, tolerance)


def observed_from_records(records: Sequence[Record]) -> tuple[int, int, float]:
    """(start context, tokens, tok/s over the summed step times) of one request's step records."""
    s = summarize(records)
    return min(int(r["context_tokens"]) for r in records), s.tokens, s.tok_s


def reconcile_requests(
    points: Sequence[ProfilePoint], requests: Mapping[str, Sequence[Record]], tolerance: float = 0.15
) -> tuple[list[tuple[str, Reconciliation]], Reconciliation | None]:
    """Each request's speed (its step records) against the profile's record step times; then all of them
    together (total tokens over total step time, against the summed predicted times)."""
    rows, tokens, seconds, predicted_s, steps = [], 0, 0.0, 0.0, 0.0
    for rid, recs in requests.items():
        if not recs:
            continue
        context, out, tok_s = observed_from_records(recs)
        pred = predict(points, context, out, step_key="step_ms")
        rows.append((rid, reconcile(tok_s, pred, tolerance)))
        tokens += out
        seconds += out / tok_s if tok_s > 0 else 0.0
        predicted_s += pred.steps * pred.step_ms / 1e3
        steps += pred.steps
    if not rows or seconds <= 0 or predicted_s <= 0:
        return rows, None
    ctx = round(statistics.mean(r.predicted.context for _, r in rows))
    total = Prediction(
        ctx,
        tokens,
        steps,
        tokens / steps,
        1e3 * predicted_s / steps,
        tokens / predicted_s,
        any(r.predicted.extrapolated for _, r in rows),
    )
    return rows, reconcile(tokens / seconds, total, tolerance)


# ---- flags -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    raised: bool
    evidence: str
    checked: bool = True  # False: the data to decide was missing (evidence says what to run)

    def line(self) -> str:
        mark = "FLAG" if self.raised else ("ok  " if self.checked else "n/a ")
        return f"[{mark}] {self.name}: {self.evidence}"


def flag_speculation_not_paying(points: Sequence[ProfilePoint], min_speedup: float = 1.1) -> Flag:
    name = "speculation not paying"
    pts = [p for p in sorted(points, key=lambda p: p.context) if p.ar_tok_s > 0 and p.tok_s > 0]
    if not pts:
        return Flag(name, False, "no context has both a DDTree and an AR measurement", checked=False)
    bad = [p for p in pts if p.speedup <= min_speedup]
    worst = min(pts, key=lambda p: p.speedup)
    detail = "; ".join(
        f"context {p.context}: {p.tok_s:.1f} vs AR {p.ar_tok_s:.1f} tok/s = {p.speedup:.2f}x "
        f"(tau {p.tau:.2f}, step {p.wall_step_ms:.1f} ms vs AR {1e3 / p.ar_tok_s:.1f} ms)"
        for p in (bad or [worst])
    )
    if bad:
        return Flag(
            name,
            True,
            f"DDTree <= {min_speedup:.2f}x AR at {len(bad)} of {len(pts)} contexts: {detail}. "
            f"Tau is too low to pay for the longer step: a better-trained drafter, or AR here",
        )
    return Flag(name, False, f"DDTree > {min_speedup:.2f}x AR at every measured context; lowest {detail}")


def flag_draft_window(
    window: int, tau_on: Mapping[int, float], tau_off: Mapping[int, float], min_drop: float = 0.10
) -> Flag:
    """tau_on / tau_off: DDTree tau by prompt context with the deployment's window and with none."""
    name = "draft window cutting acceptance"
    if window <= 0:
        return Flag(name, False, "the drafter's window is unlimited")
    beyond = sorted(c for c in tau_on if c > window and c in tau_off and tau_off[c] > 0)
    if not beyond:
        return Flag(
            name, False, f"no context past the window ({window}) was measured with the window on and off", checked=False
        )
    drops = {c: 1.0 - tau_on[c] / tau_off[c] for c in beyond}
    detail = ", ".join(
        f"context {c}: tau {tau_on[c]:.2f} with the window vs {tau_off[c]:.2f} without ({-drops[c]:+.0%})"
        for c in beyond
    )
    if any(d >= min_drop for d in drops.values()):
        return Flag(name, True, f"window {window}: {detail}; raise --window (or 0 = unlimited) on the drafter")
    return Flag(name, False, f"window {window}: {detail}; drops under {min_drop:.0%}")


def flag_step_drift(
    records: Iterable[Record], split_tokens: int, bin_tokens: int = 64, max_ratio: float = 1.15, min_bins: int = 1
) -> Flag:
    """Verify time at equal context, late in a generation (output position >= split) vs early: with page
    size 1 and scattered commits a fragmented KV would make the late steps slower."""
    name = "step time drifting with output length (KV fragmentation suspect)"
    early: dict[int, list[float]] = {}
    late: dict[int, list[float]] = {}
    for recs in by_request(records).values():
        sides: dict[int, dict[bool, list[float]]] = {}
        for r, pos in zip(recs, output_positions(recs)):
            sides.setdefault(int(r["context_tokens"]) // bin_tokens, {}).setdefault(pos >= split_tokens, []).append(
                float(r["verify_ms"])
            )
        for b, got in sides.items():
            if len(got) == 1:  # a request crossing the split inside a bin would compare contexts, not positions
                ((is_late, values),) = got.items()
                (late if is_late else early).setdefault(b, []).extend(values)
    bins = sorted(set(early) & set(late))
    if len(bins) < min_bins:
        return Flag(
            name,
            False,
            f"no context was reached both before and after {split_tokens} generated tokens "
            f"(run generations of different lengths through the same contexts)",
            checked=False,
        )
    ratios = [statistics.median(late[b]) / statistics.median(early[b]) for b in bins]
    ratio = statistics.median(ratios)
    e = statistics.median(v for b in bins for v in early[b])
    lt = statistics.median(v for b in bins for v in late[b])
    evidence = (
        f"contexts {bins[0] * bin_tokens}-{(bins[-1] + 1) * bin_tokens}: verify {lt:.2f} ms for steps "
        f">= {split_tokens} tokens into their generation vs {e:.2f} ms for steps < {split_tokens} "
        f"(median ratio over {len(bins)} context bins {ratio:.2f}"
    )
    if ratio >= max_ratio:
        return Flag(name, True, evidence + f" >= {max_ratio:.2f}): step time grows with output length at equal context")
    return Flag(name, False, evidence + f" < {max_ratio:.2f})")


def flag_acceptance_decay(
    records: Iterable[Record], head_tokens: int = 200, min_drop: float = 0.15, min_rest_steps: int = 8
) -> Flag:
    """Tau over each generation's first `head_tokens` tokens vs the rest, pooled over requests."""
    name = "acceptance falling across a generation"
    head = [0, 0]
    rest = [0, 0]
    for recs in by_request(records).values():
        for r, pos in zip(recs, output_positions(recs)):
            side = head if pos < head_tokens else rest
            side[0] += int(r["accept_length"])
            side[1] += 1
    if rest[1] < min_rest_steps or head[1] == 0:
        return Flag(
            name,
            False,
            f"{rest[1]} steps past the first {head_tokens} tokens (need {min_rest_steps}): run longer generations",
            checked=False,
        )
    t_head, t_rest = head[0] / head[1], rest[0] / rest[1]
    evidence = (
        f"tau {t_head:.2f} over the first {head_tokens} tokens ({head[1]} steps) vs {t_rest:.2f} over the "
        f"rest ({rest[1]} steps), {t_rest / t_head - 1:+.0%}"
    )
    if t_rest <= t_head * (1 - min_drop):
        return Flag(
            name,
            True,
            evidence + f": acceptance measured on the first {head_tokens} tokens overstates the whole answer",
        )
    return Flag(name, False, evidence)


def flag_transport(records: Iterable[Record], max_share: float = 0.20) -> Flag:
    """Draft RPC time outside the drafter's compute, as a share of the speculative steps' time."""
    name = "transport taking a large share of the step"
    spec = [r for r in records if int(r["tree_nodes"]) > 0 or float(r["draft_ms"]) > 0]
    total = sum(float(r["total_ms"]) for r in spec)
    if not spec or total <= 0:
        return Flag(name, False, "no speculative steps", checked=False)
    n = len(spec)
    transport = sum(float(r["transport_ms"]) for r in spec)
    share = transport / total
    kb = sum(int(r["feature_bytes"]) for r in spec) / n / 1024
    evidence = (
        f"transport {transport / n:.2f} ms of a {total / n:.2f} ms step ({share:.0%}), "
        f"{kb:.1f} KiB of features per step"
    )
    if share > max_share:
        return Flag(
            name,
            True,
            evidence + f" > {max_share:.0%}: move the drafter closer (same host / GPU) or shrink what each step sends",
        )
    return Flag(name, False, evidence + f" <= {max_share:.0%}")


# ---- measuring methods -------------------------------------------------------------------------------
def two_point_tok_s(n_short: int, seconds_short: float, n_long: int, seconds_long: float) -> float:
    """The two-point method: (n_long - n_short) / (t_long - t_short), end-to-end times of two generations
    of one prompt. Prefill cancels, but the rate covers only tokens n_short..n_long of the answer."""
    dt = seconds_long - seconds_short
    if n_long <= n_short or dt <= 0:
        raise ValueError(
            f"need n_long > n_short and t_long > t_short, got {n_short}/{seconds_short:.3f}s and "
            f"{n_long}/{seconds_long:.3f}s"
        )
    return (n_long - n_short) / dt
