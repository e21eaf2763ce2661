"""What a verifier step costs and what its drafts are worth: the two estimates behind `--tree-cut cost`.

A speculative step costs its Draft call (draft, transport: it does not depend on how many nodes are
verified, the drafter builds the whole tree) plus the verify, roughly

    verify = a + b·rows + c·row_context          (ms)

where rows is the forward's rows (every sequence's root and tree nodes), row_context is the sum over the
step's items of rows × context tokens in thousands (each row of a long sequence reads that many more
keys in attention). One more node in the tree of a sequence with context L costs b + c·L/1000. On a
GPU b and c stay near zero while the step is memory-bound; on a CPU a node's cost grows with its context,
so the tree worth verifying shrinks as the context grows.

`StepCostModel` fits (a, b, c) online by least squares over exponentially forgotten observations (the
verify time of every speculative decode step; steps with prefill chunks are not used, their rows cost
differently, nor AR-only steps, which would push the speculative ones out of the window), and keeps the
recent Draft call time beside it. The rows must vary for the slope to be seen: step_drafter.py cuts some
trees at random sizes.

`AcceptCalibration` turns the drafter's node probabilities exp(score) into expected accepted tokens,
corrected per level of confidence to the acceptance actually seen on this verifier.

Neither changes any token: they only decide how many of the drafter's nodes each step verifies
(budget.cost_cut, applied by cut.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import torch

# Observations before the fit is used (until then trees are cut at random sizes, to see the slope).
MIN_OBSERVATIONS = 16


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The cost features of one step: rows = Σ rows, row_context = Σ rows × context / 1000 over its items."""

    rows: int
    row_context: float

    @staticmethod
    def of(items: list[tuple[int, int]]) -> StepShape:
        """items: (rows, context tokens before them) per work item of the step."""
        return StepShape(sum(n for n, _ in items), sum(n * c for n, c in items) / 1000.0)

    def features(self) -> list[float]:
        return [1.0, float(self.rows), self.row_context]


class StepCostModel:
    """Least-squares fit of verify ms on StepShape.features(), each observation's weight decaying by `forget`
    per later observation (a window of about 1 / (1 - forget) steps). A small ridge term pulls the
    coefficients other than the intercept toward 0, so that directions the steps have not yet varied in
    (say every step had the same rows) stay at 0 rather than at whatever noise says."""

    def __init__(self, forget: float = 0.99, ridge: float = 1e-3):
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.forget = forget
        self.ridge = ridge
        self.observations = 0
        self._xx = torch.zeros(3, 3, dtype=torch.float64)  # Σ w x xᵀ
        self._xy = torch.zeros(3, dtype=torch.float64)  # Σ w x y
        self._theta = torch.zeros(3, dtype=torch.float64)  # (a, b, c)
        self._draft = 0.0  # Σ w · Draft call ms
        self._weight = 0.0  # Σ w

    @property
    def ready(self) -> bool:
        return self.observations >= MIN_OBSERVATIONS

    def observe(self, shape: StepShape, verify_ms: float, draft_ms: float) -> None:
        """One speculative step: its shape, its verify time and its Draft call's time (both ms)."""
        x = torch.tensor(shape.features(), dtype=torch.float64)
        self._xx.mul_(self.forget).add_(torch.outer(x, x))
        self._xy.mul_(self.forget).add_(x * verify_ms)
        self._draft = self._draft * self.forget + draft_ms
        self._weight = self._weight * self.forget + 1.0
        self.observations += 1
        # The ridge scales with how much data the fit holds (Σ w); the intercept is not pulled.
        penalty = torch.diag(torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)) * (self.ridge * self._weight)
        try:
            self._theta = torch.linalg.solve(self._xx + penalty + 1e-9 * torch.eye(3, dtype=torch.float64), self._xy)
        except RuntimeError:  # singular (cannot happen with the ridge, but a cut must never fail a step)
            pass

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c): intercept ms, ms per row, ms per row per 1000 context tokens, of the verify."""
        a, b, c = (float(v) for v in self._theta)
        return a, b, c

    @property
    def draft_ms(self) -> float:
        """The recent Draft calls' mean time (ms)."""
        return self._draft / self._weight if self._weight > 0 else 0.0

    def predict(self, shape: StepShape) -> float:
        """A speculative step's ms: the Draft call plus the verify of this shape."""
        a, b, c = self.coefficients
        return self.draft_ms + max(a + b * shape.rows + c * shape.row_context, 1e-3)

    def node_ms(self, context: int) -> float:
        """The cost of one more tree node of a sequence with `context` tokens: the fit's slope in rows at
        that context, b + c·context/1000, never negative. b and c are not clamped apart: when every step
        had about the same context the two are collinear and only their sum at that context is known."""
        _, b, c = self.coefficients
        return max(b + c * context / 1000.0, 0.0)


# Bins of the drafter's path log-prob for the calibration, upper edges: [0, -0.1), [-0.1, -0.25), ...
SCORE_EDGES = (-0.1, -0.25, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.5)


class AcceptCalibration:
    """What a node is worth: the probability that it is on the accepted path, from the drafter's path
    probability exp(score) corrected by the acceptance actually seen at that level of confidence:
    alpha_b = accepted / Σ exp(score) of the verified nodes whose score falls in bin b (SCORE_EDGES) over
    exponentially forgotten steps, shrunk toward the all-bin ratio by PSEUDO_COUNT predicted nodes. The
    drafter's probabilities are its own model's, and a cut picks nodes by them: a level where it is
    over-confident would keep nodes for more than they give, one where it is under-confident would drop
    nodes that pay; one factor for all levels corrects neither."""

    PSEUDO_COUNT = 2.0

    def __init__(self, forget: float = 0.99, low: float = 0.02, high: float = 4.0):
        self.forget = forget
        self.low, self.high = low, high
        self._accepted = [0.0] * (len(SCORE_EDGES) + 1)  # per bin, Σ w · accepted
        self._predicted = [0.0] * (len(SCORE_EDGES) + 1)  # Σ w · exp(score)

    @staticmethod
    def bin(score: float) -> int:
        return bisect.bisect_left([-e for e in SCORE_EDGES], -score)

    def observe(self, scores: tuple[float, ...], accepted: set[int]) -> None:
        """One verified tree: its node scores and the node indices (1-based) on the accepted path."""
        for b in range(len(self._accepted)):
            self._accepted[b] *= self.forget
            self._predicted[b] *= self.forget
        for k, score in enumerate(scores):
            b = self.bin(score)
            self._predicted[b] += math.exp(score)
            self._accepted[b] += 1.0 if k + 1 in accepted else 0.0

    def alpha(self, score: float) -> float:
        """The correction at this score; 1 before any tree was seen."""
        total_p = sum(self._predicted)
        overall = sum(self._accepted) / total_p if total_p > 0 else 1.0
        b = self.bin(score)
        a = (self._accepted[b] + self.PSEUDO_COUNT * overall) / (self._predicted[b] + self.PSEUDO_COUNT)
        return min(max(a, self.low), self.high)

    def gains(self, scores: tuple[float, ...]) -> list[float]:
        """Each node's expected accepted tokens, non-increasing in node order (a node is accepted only
        with its ancestors, which come first), at most 1."""
        out, prev = [], 1.0
        for score in scores:
            prev = min(prev, self.alpha(score) * math.exp(score))
            out.append(prev)
        return out
