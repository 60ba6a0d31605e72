"""Every family at the shape people download: ``plan_for`` on each causal-LM family's *default*
config (transformers writes the published checkpoint's sizes there) on the meta device, tp=2.

The grids' tiny configs switch off what a default config switches on (DeepSeek-V4's two attention
kinds, HY-V4's shared indexers, Kolibri's indexed layers), so a family can hold parity tiny and fail
at its real shape. Each family plans or is refused with a ``ValueError`` naming why, never a
crash; the flagships must plan. CI runs the flagships and every fourth family (about 10 s);
``python scripts/default_shapes.py`` runs all of them and prints one line each."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING, AutoConfig

from hf_tp.adapters.census import tensor_parallel_causal_lm_types
from hf_tp.compat import family_refusal
from hf_tp.plan import plan_for

FAMILIES = sorted(tensor_parallel_causal_lm_types())
# must plan at their published shape (each was refused there, or is a reference family)
FLAGSHIPS = ("deepseek_v3", "deepseek_v4", "hy_v4", "kolibri1_1", "llama", "mixtral", "qwen2", "qwen3_moe")
SAMPLE = sorted({*FAMILIES[::4], *(mt for mt in FLAGSHIPS if mt in FAMILIES)})


def default_shape(model_type: str) -> str:
    """``"plan"``, or ``"refused: <reason>"`` (a ``ValueError``); any other exception propagates."""
    try:
        plan_for(AutoConfig.for_model(model_type), tp=2, seq_len=64)
    except ValueError as exc:
        return f"refused: {str(exc).splitlines()[0]}"
    return "plan"


@pytest.mark.parametrize("model_type", SAMPLE)
def test_the_default_config_plans_or_is_refused_with_a_reason(model_type: str) -> None:
    if family_refusal(model_type):  # the installed transformers is too old for it (named elsewhere)
        return
    outcome = default_shape(model_type)
    if outcome != "plan":
        assert model_type not in FLAGSHIPS, f"{model_type} is refused at its default shape: {outcome}"
        assert model_type in outcome or "tp must divide" in outcome, outcome


def test_the_flagships_are_families_of_this_release() -> None:
    missing = [mt for mt in FLAGSHIPS if mt in CONFIG_MAPPING and mt not in FAMILIES and not family_refusal(mt)]
    assert not missing, missing


@pytest.mark.parametrize("model_type", ["opt", "xglm", "biogpt", "gpt_neo", "stablelm", "persimmon"])
def test_plans_read_from_the_modules_plan_at_the_default_shape(model_type: str) -> None:
    # no tp plan in transformers: hf_tp reads the projections' split from the modules
    assert default_shape(model_type) == "plan"
