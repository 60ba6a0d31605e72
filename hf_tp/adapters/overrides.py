"""What family files know better than transformers' tp plan: corrected plan entries and fixed
counts that tp must divide. Family files register them; the generic derivation reads them."""

from __future__ import annotations

from transformers import PretrainedConfig

# model_type -> corrections to transformers' tp plan (same keys), for what a family file knows
# better: e.g. OLMo 2 gathers q/k before its full-width norms, hf_tp keeps them sharded
# ("width_norm", an hf_tp style). Registered by the family files (adapters/olmo2.py).
PLAN_OVERRIDES: dict[str, dict[str, str]] = {}

# model_type -> (what, n): a count fixed in the family's code that tp must divide, beyond the
# config's sizes (CodeGen packs qkv_proj into 4 groups whatever its heads). Registered by family files.
TP_DIVISORS: dict[str, tuple[str, int]] = {}


def register_plan_overrides(model_types: tuple[str, ...], overrides: dict[str, str]) -> None:
    """Correct the tp plan the generic derivation starts from, for these ``model_type``s."""
    for model_type in model_types:
        PLAN_OVERRIDES[model_type] = dict(overrides)


def register_tp_divisor(model_types: tuple[str, ...], what: str, n: int) -> None:
    """Require tp to divide ``n`` (``what`` names it in the error) for these ``model_type``s."""
    for model_type in model_types:
        TP_DIVISORS[model_type] = (what, n)


def base_tp_plan(config: PretrainedConfig) -> dict[str, str]:
    """transformers' ``base_model_tp_plan`` for ``config`` with hf_tp's corrections applied."""
    return {**(getattr(config, "base_model_tp_plan", None) or {}), **PLAN_OVERRIDES.get(config.model_type, {})}
