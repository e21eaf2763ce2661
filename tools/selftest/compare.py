"""The one shared tensor comparator (after FlashMLA kernelkit `check_is_allclose`).

assert_close(name, actual, expected) checks, in order:
1. shapes are equal;
2. NaN at the same positions, and ±inf at the same positions with the same sign;
3. every finite element passes if |a - e| <= abs_tol OR |a - e| <= rel_tol · |e|;
4. cosine difference 1 - 2·Σae / Σ(a² + e²) <= cos_tol (also catches a global scale error).
On failure it reports the worst element (largest |a - e| / (abs_tol + rel_tol·|e|)): its index, both
values, and the fraction of elements that passed.

Default tolerances come from the lower-precision dtype of the two tensors:

  dtype     abs_tol (× max(1, max|expected|))   rel_tol        cos_tol
  float64   1e-10                                1e-9           1e-12
  float32   1e-5                                 1e-4           1e-6
  float16   1e-3                                 2.01 / 1024    1e-5
  bfloat16  8e-3                                 2.01 / 128     1e-5

rel 2.01/2^mantissa allows about two ulps; abs scales with the magnitude of `expected` so that values that
cancel near zero (whose error is set by the magnitude of their inputs) do not fail spuriously.
"""

from __future__ import annotations

import torch

_DEFAULTS = {  # dtype: (abs base, rel, cos)
    torch.float64: (1e-10, 1e-9, 1e-12),
    torch.float32: (1e-5, 1e-4, 1e-6),
    torch.float16: (1e-3, 2.01 / 1024, 1e-5),
    torch.bfloat16: (8e-3, 2.01 / 128, 1e-5),
}
_PRECISION = [torch.float64, torch.float32, torch.float16, torch.bfloat16]  # most to least precise


def default_tolerances(*dtypes: torch.dtype) -> tuple[float, float, float]:
    """(abs base, rel, cos) for the least precise floating dtype among `dtypes` (ints count as float32)."""
    ranked = [d if d in _DEFAULTS else torch.float32 for d in dtypes]
    return _DEFAULTS[max(ranked, key=_PRECISION.index)]


def assert_close(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    abs_tol: float | None = None,
    rel_tol: float | None = None,
    cos_tol: float | None = None,
) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    abs_base, rel_default, cos_default = default_tolerances(actual.dtype, expected.dtype)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)

    a_nan, e_nan = a.isnan(), e.isnan()
    if not torch.equal(a_nan, e_nan):
        idx = _unravel(int((a_nan ^ e_nan).flatten().nonzero()[0]), a.shape)
        raise AssertionError(f"{name}: NaN mismatch at {idx}: actual {a[idx].item()} expected {e[idx].item()}")
    a_inf, e_inf = a.isinf(), e.isinf()
    if not torch.equal(a_inf, e_inf) or not torch.equal(a[a_inf], e[e_inf]):
        bad = (a_inf ^ e_inf) | (a_inf & e_inf & (a != e))
        idx = _unravel(int(bad.flatten().nonzero()[0]), a.shape)
        raise AssertionError(f"{name}: inf mismatch at {idx}: actual {a[idx].item()} expected {e[idx].item()}")

    finite = ~(a_nan | a_inf)
    af, ef = a[finite], e[finite]
    if af.numel() == 0:
        return
    if abs_tol is None:
        abs_tol = abs_base * max(1.0, ef.abs().max().item())
    rel_tol = rel_default if rel_tol is None else rel_tol
    cos_tol = cos_default if cos_tol is None else cos_tol

    err = (af - ef).abs()
    passed = (err <= abs_tol) | (err <= rel_tol * ef.abs())
    if not bool(passed.all()):
        ratio = err / (abs_tol + rel_tol * ef.abs())
        worst = int(ratio.argmax())
        idx = _unravel(int(finite.flatten().nonzero()[worst]), a.shape)
        raise AssertionError(
            f"{name}: {passed.double().mean().item():.4%} of {passed.numel()} elements within tolerance "
            f"(abs {abs_tol:.3g} or rel {rel_tol:.3g}); worst at {idx}: actual {af[worst].item():.9g} "
            f"expected {ef[worst].item():.9g} (abs err {err[worst].item():.3g}, rel err "
            f"{(err[worst] / ef[worst].abs().clamp_min(1e-300)).item():.3g}); max abs err {err.max().item():.3g}"
        )
    denom = (af * af + ef * ef).sum().item()
    cos_diff = 0.0 if denom == 0 else 1.0 - 2.0 * (af * ef).sum().item() / denom
    if cos_diff > cos_tol:
        raise AssertionError(f"{name}: cosine difference {cos_diff:.3g} > {cos_tol:.3g}")


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for dim in reversed(shape):
        idx.append(flat % dim)
        flat //= dim
    return tuple(reversed(idx))
