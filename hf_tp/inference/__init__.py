"""Generation and evaluation for models prepared by :func:`hf_tp.parallelize`."""

from hf_tp.inference.evaluate import EvalResult, count_targets, evaluate
from hf_tp.inference.generate import eval_mode, generate, generation_mode, replicated_logits

__all__ = ["EvalResult", "count_targets", "eval_mode", "evaluate", "generate", "generation_mode", "replicated_logits"]
