"""Checks whose tolerance, tensor by tensor, is the larger of a fixed one and the fp32 reference's
own measured error against a float64 copy of it (:func:`hf_tp.verify.single_rank.exact_grads`).

A gradient summed from nearly cancelling terms (a hyper-connection mixer's base after a
scale-invariant norm, a gated linear attention's ``A_log``) is only as exact, relative to its own
size, as the terms' round-off allows; the fp32 reference has that round-off as much as the
layout does. Where it is larger than the fixed tolerance, that tensor is held to
``ROUND_OFF_MARGIN`` times it (the layout's round-off is of the same size and the two add); the
report names those tensors. Modules that compute in fp32 inside
the float64 copy keep their round-off there, so the measure comes out small, never large.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hf_tp.verify.compare import Error, tensor_error
from hf_tp.verify.report import ROUND_OFF_MARGIN, VALUES, Check


def measured_check(
    name: str, tol: float, names: list[str], error_of: Callable[[str], Error], own_of: Callable[[str], Error]
) -> Check:
    """The check ``name`` over tensors ``names``: each one's error (``error_of``) against the larger
    of ``tol`` and ``ROUND_OFF_MARGIN`` times the reference's own (``own_of``); the worst tensor,
    by error over its tolerance, is reported with its tolerance."""
    worst, worst_tol, measured = Error(), tol, []
    for tensor in names:
        own = own_of(tensor).rel
        own = own if math.isfinite(own) else 0.0  # an unmeasurable reference error raises nothing
        this = max(tol, float(f"{ROUND_OFF_MARGIN * own:.2g}"))  # two digits, as the report shows it
        if this > tol:
            measured.append(tensor)
        error = error_of(tensor)
        if error.missing or not math.isfinite(error.rel):
            return Check.of(name, error, this)
        if error.rel / this > worst.rel / worst_tol or not worst.where:
            worst, worst_tol = error, this
    check = Check.of(name, worst, worst_tol)
    if not measured:
        return check
    listed = ", ".join(measured[:3]) + (", ..." if len(measured) > 3 else "")
    own_text = f" ({ROUND_OFF_MARGIN:g} x the fp32 reference's own error against float64 on {len(measured)}: {listed})"
    return dataclasses.replace(check, text=check.text + own_text)


def gradients_check(got: dict, want: dict, exact: dict) -> Check:
    """The first gradients (``exact``: the float64 copy's)."""
    error = tensor_error(got, want)
    if error.missing:
        return Check.of("gradients", error, VALUES)
    return measured_check(
        "gradients",
        VALUES,
        list(want),
        lambda n: tensor_error({n: got[n]}, {n: want[n]}),
        lambda n: tensor_error({n: want[n]}, {n: exact[n]}) if n in exact else Error(),
    )
