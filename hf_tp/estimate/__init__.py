"""Planning a run before it starts: per-rank memory and communication estimates, (tp, dp) sweeps.

Names are imported on first use, so ``hf-tp estimate --help`` (which lists the bundled models
through :mod:`hf_tp.core.model_source`) loads neither torch nor transformers.
"""

from __future__ import annotations

from hf_tp.lazy import lazy_names

# public name -> module that defines it
_PUBLIC: dict[str, str | tuple[str, str]] = {
    "Cluster": "hf_tp.estimate.speed",
    "CommStat": "hf_tp.estimate.counters",
    "Estimate": "hf_tp.estimate.estimate_run",
    "EstimateSpec": "hf_tp.estimate.spec",
    "MemoryBreakdown": "hf_tp.estimate.memory",
    "MoEStats": "hf_tp.estimate.memory",
    "Speed": "hf_tp.estimate.speed",
    "Sweep": "hf_tp.estimate.sweep",
    "bundled_models": "hf_tp.core.model_source",
    "estimate": "hf_tp.estimate.estimate_run",
    "estimate_fast": "hf_tp.estimate.depth",
    "estimate_spec": "hf_tp.estimate.estimate_run",
    "get_gpu": "hf_tp.gpus",
    "parse_memory": "hf_tp.estimate.spec",
    "predict": "hf_tp.estimate.speed",
    "resolve_model_config": "hf_tp.estimate.spec",
    "sweep": "hf_tp.estimate.sweep",
}


__getattr__ = lazy_names(__name__, _PUBLIC)

__all__ = sorted(_PUBLIC)
