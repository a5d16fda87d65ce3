"""Bounds for equivalence tests whose two sides are equal in exact arithmetic but round differently.

Two training runs that compute the same thing in a different order (parameter averaging after the update vs
gradient averaging before it; a step redone from saved state; a bucketed all-reduce) end with parameters that
differ only by floating-point rounding. How much depends on the kernels of the torch release (CI saw 2.8e-5 in
float32 where an earlier release gave < 1e-5). So such claims are checked in **float64** (``precision="64-true"``)
against a bound that follows from the computation, and float32 runs are kept for claims that are bit-exact.

The bound: every step can add a few unit roundoffs of the parameters' magnitude, and training dynamics amplify an
early difference (the gradient at a perturbed point differs by the Hessian times the perturbation, times the
learning rate). We allow ``AMPLIFICATION`` unit roundoffs per step:

    |a - b| <= AMPLIFICATION * steps * eps(dtype) * max(1, max|w|)

In float64 with 12-40 steps that is ~1e-11 to 1e-10: five orders above what the runs show (~1e-14), and six orders
below a real mistake (a wrong scale or a missed sync moves parameters by >= 1e-4 within a few steps).
"""

from __future__ import annotations

import torch

#: unit roundoffs allowed per step (float32 runs showed ~70 per step on the digits CNN; float64 ~the same count)
AMPLIFICATION = 1e3


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over same-named tensors (the key sets must match)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def rounding_bound(reference: dict[str, torch.Tensor], steps: int) -> float:
    """What rounding alone can make two ``steps``-step runs differ by, in ``reference``'s dtype."""
    dtypes = {t.dtype for t in reference.values()}
    assert len(dtypes) == 1, f"one dtype expected, got {dtypes}"
    eps = torch.finfo(dtypes.pop()).eps
    scale = max(1.0, max(float(t.abs().max()) for t in reference.values()))
    return AMPLIFICATION * max(1, steps) * eps * scale


def assert_equal_in_exact_arithmetic(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, what: str = ""
) -> None:
    """``a`` and ``b`` are float64 results of computations that are equal in exact arithmetic."""
    for t in (*a.values(), *b.values()):
        assert t.dtype == torch.float64, f"run the equivalence in float64 (precision='64-true'), got {t.dtype}"
    diff, bound = max_diff(a, b), rounding_bound(a, steps)
    assert diff <= bound, f"{what}: max |a - b| = {diff:.3e} exceeds the rounding bound {bound:.3e} ({steps} steps)"
