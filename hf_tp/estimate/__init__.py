"""Planning a run before it starts: per-rank memory and communication estimates, (tp, dp) sweeps."""

from hf_tp.estimate.api import Estimate, MemoryBreakdown, estimate
from hf_tp.estimate.comm import CommStat
from hf_tp.estimate.configs import bundled_models, resolve_model_config
from hf_tp.estimate.sweep import Sweep, parse_memory, sweep

__all__ = [
    "CommStat",
    "Estimate",
    "MemoryBreakdown",
    "Sweep",
    "bundled_models",
    "estimate",
    "parse_memory",
    "resolve_model_config",
    "sweep",
]
