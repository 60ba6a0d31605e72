"""Training objectives behind one interface (:class:`hf_tp.objectives.base.Objective`): next-token
cross entropy (:mod:`hf_tp.run.loss`), and the preference objectives on pair data, DPO against a
reference model (:mod:`.reference`) and the reference-free SimPO (:mod:`.preference`)."""

from __future__ import annotations

from hf_tp.objectives.base import MicroLoss, Objective

__all__ = ["MicroLoss", "Objective"]
