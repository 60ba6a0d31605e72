"""The checks' results: one line each, gathered from every rank, and the exit code."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from hf_tp.verify.compare import Error

# Tolerances of fp32 round-off (the reference and the layout sum in different orders): on values,
# relative to each tensor's largest magnitude; on AdamW weights, relative to how far they moved.
VALUES = 1e-5
ADAM = 1e-3
# A gradient tensor whose fp32 reference is itself further than VALUES from float64 (one summed from
# nearly cancelling terms) is held to this many times the reference's own error: the layout sums
# in another order, with round-off of the same size, and the two errors add.
ROUND_OFF_MARGIN = 3.0
# The share of a tensor whose first gradient may be too small to give AdamW's update a direction
# (left out of the AdamW check). The test grids' tiny models allow 1 in 1000; a real vocabulary
# seen by a few dozen tokens has more: 1903 of 1.7M (0.11%) of Llama-3.2-1B's cut tied embedding.
# 1% is still far below one tp shard of a tensor.
UNRESOLVED = 1e-2
EXACT = 1e-6  # what a checkpoint or export only copies
# A gradient norm sums a million squares in fp32: measured against float64, torch's own clip was
# 3e-5 off and hf_tp's 1.5e-5 (gradients equal to 6e-7); a wrong norm (a replicated weight counted
# once per rank, a shard left out) is off by far more.
NORM = 1e-4


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    text: str

    @classmethod
    def of(cls, name: str, error: Error, tol: float) -> Check:
        ok = not error.missing and math.isfinite(error.rel) and error.rel <= tol
        return cls(name, ok, f"{error.text()}; tol {tol:g}")

    @classmethod
    def crashed(cls, name: str, exc: BaseException) -> Check:
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: each rank's own error
        if failures:
            exc = next(iter(failures.values()))
            exc = exc[0] if isinstance(exc, tuple) else exc
        first = (str(exc).strip().splitlines() or [""])[0]
        return cls(name, False, f"raised {type(exc).__name__}: {first}")

    @classmethod
    def skipped(cls, name: str, why: str) -> Check:
        return cls(name, False, f"not run: {why}")

    def line(self, width: int) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name:<{width}}  {self.text}"


def gathered(checks: list[Check]) -> list[Check]:
    """Every rank's checks, merged: a check fails if it failed on any rank (that rank's line)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checks)
    merged = []
    for i, check in enumerate(checks):
        failed = [rank[i] for rank in everyone if rank is not None and i < len(rank) and not rank[i].ok]
        merged.append(failed[0] if failed else check)
    return merged


def render(checks: list[Check], header: str) -> tuple[str, int]:
    """The report and the exit code: 0 when every check passed, 1 otherwise."""
    width = max((len(c.name) for c in checks), default=0)
    failed = [c.name for c in checks if not c.ok]
    tail = f"hf-tp verify: {len(checks) - len(failed)} of {len(checks)} checks passed" + (
        f"; failed: {', '.join(failed)}" if failed else ""
    )
    return "\n".join([header, *(c.line(width) for c in checks), tail]), 1 if failed else 0
