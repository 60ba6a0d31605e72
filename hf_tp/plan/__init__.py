"""``hf-tp plan`` / ``hf_tp.plan_for``: the TP+SP plan hf_tp derives for a model, described.

Modules, each importing only those below it:
  build         plan_for: resolve the model, run parallelize's checks, describe layers and top
  top, layers   the top level; one decoder layer's rows and collectives, layers grouped by kind
  collectives   the collectives a plan's styles make, sized (hf_tp.estimate.counters's record)
  styles        a ParallelStyle in words, and where it places each parameter
  text, record  the printed report; the typed record (plain data, no torch)
"""

from hf_tp.plan.build import plan_for
from hf_tp.plan.model_plan import Collective, LayerKind, ModelPlan, ModuleRow, ParamShard
from hf_tp.plan.plan_text import format_plan

__all__ = ["Collective", "LayerKind", "ModelPlan", "ModuleRow", "ParamShard", "format_plan", "plan_for"]
