"""The releases hf_tp is tested with: floors, per-family needs, and the one-line refusals.

The floors are what ``scripts/compat.sh`` proves in CI (the unit suite passes with exactly these
releases installed, see docs/compatibility.md); pyproject.toml declares the same numbers. Where a
family needs a later transformers than the floor (its config gained a tensor-parallel plan later),
:data:`FAMILY_RELEASES` names that release so the refusal can say what to install. Reads package
metadata only: importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

# package -> the lowest release CI's compat run passes the unit suite with (pyproject.toml agrees)
FLOORS: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.17.0",
    "accelerate": "1.10.0",
    "datasets": "4.8.0",
}
# the lora extra's floor (peft is optional: checked where LoRA is used, not at start-up)
PEFT_FLOOR = "0.21.0"

# model_type -> (the first transformers release that serves it, what that release added): the
# families a release inside the supported range cannot serve. Read off each release's configs
# (base_model_tp_plan) and held to parity by the family grid on the latest (docs/compatibility.md).
PLAN = "a tensor-parallel plan"
EXPERTS = "a tensor-parallel plan of its experts"
_NO_PLAN_BEFORE_5_21 = ("afmoe", "granitemoe", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "jamba")
FAMILY_RELEASES: dict[str, tuple[str, str]] = {
    **{mt: ("5.21.0", PLAN) for mt in (*_NO_PLAN_BEFORE_5_21, "nemotron", "phimoe")},
    # before 5.21 their plans shard attention and name no experts
    **{mt: ("5.21.0", EXPERTS) for mt in ("aria_text", "cohere2_moe", "exaone_moe", "qwen2_moe")},
    **{mt: ("5.23.0", "a tensor-parallel plan of its attention sinks") for mt in ("granite_swa", "granitemoe_swa")},
    **{mt: ("5.24.0", PLAN) for mt in ("codegen", "gptj")},
    # Held to parity at 5.24 and refused at the floor (5.17: mimo's sinks take another shape, and
    # Mistral4ForCausalLM is not found from its config); the releases between were not run.
    "mimo_v2_flash": ("5.24.0", "a tensor-parallel plan of its attention sinks"),
    "mistral4": ("5.24.0", "a tensor-parallel plan built from its config (Mistral4ForCausalLM)"),
    # Hyper-connection families, held to parity at 5.24 (the releases between were not run). At 5.17
    # DeepSeek-V4's config has no plan, Qwen4-Exp's layer types differ, and HY-V4's first mixer
    # weights missed the grid's AdamW check (2e-3 of the update) where 5.24 holds it.
    **{mt: ("5.24.0", PLAN) for mt in ("deepseek_v4", "hy_v4", "qwen4_exp_text")},
    # Qwen3-VL-MoE's language model: 5.17's plan names no experts (held to parity at 5.24)
    "qwen3_vl_moe_text": ("5.24.0", EXPERTS),
    # per-layer mixers: held to parity at 5.24, earlier releases not run
    **{mt: ("5.24.0", "a tensor-parallel plan of its per-layer mixers") for mt in ("minimax", "nemotron_h")},
    # Held to parity at 5.24; at 5.17 LFM2-MoE's plan names no experts and Inkling records no router logits
    "lfm2_moe": ("5.24.0", EXPERTS),
    "inkling_text": ("5.24.0", "a tensor-parallel plan of its router (transformers records its router logits)"),
}


class UnsupportedRelease(ValueError):
    """An installed package (or a family under it) needs a later release; the message says which."""


def installed(package: str) -> str | None:
    """The installed release of ``package`` (its distribution metadata), or None if absent."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _base(release: str) -> Version:
    """A release without its local tag (``2.13.0+cpu`` -> ``2.13.0``), for comparing with floors."""
    return Version(Version(release).base_version)


def _needs(who: str, package: str, floor: str, found: str, why: str = "") -> str:
    """``who needs package >= floor[ for why]; found X: pip install -U 'package>=floor'``."""
    why = f" for {why}" if why else ""
    return f"{who} needs {package} >= {floor}{why}; found {found}: pip install -U '{package}>={floor}'"


def below_floor() -> list[str]:
    """One line per installed package older than its floor (empty when every floor is met)."""
    lines = []
    for package, floor in FLOORS.items():
        found = installed(package)
        if found is not None and _base(found) < Version(floor):
            lines.append(_needs("hf_tp", package, floor, found))
    return lines


def check_releases() -> None:
    """Raise :class:`UnsupportedRelease` (one line per package) if any package is below its floor."""
    lines = below_floor()
    if lines:
        raise UnsupportedRelease("; ".join(lines))


def family_refusal(model_type: str) -> str | None:
    """The one-line refusal for a family the installed transformers cannot serve yet, or None."""
    if model_type not in FAMILY_RELEASES:
        return None
    release, what = FAMILY_RELEASES[model_type]
    found = installed("transformers")
    if found is None or _base(found) >= Version(release):
        return None
    return _needs(model_type, "transformers", release, found, what)


def fake_experts_fallback() -> bool:
    """Whether transformers' grouped_mm fallback (the experts kernel an estimate runs for dtypes
    other than bf16, see :mod:`hf_tp.estimate.simulate`) runs backward on fake tensors: from 5.23
    its backward is an op with a fake kernel; before, it reads the group offsets' values."""
    import torch
    import transformers.integrations.moe  # noqa: F401  (registers transformers' ops)

    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")


def moe_estimate_refusal(dtype: str) -> str | None:
    """The one-line refusal for estimating a mixture of experts in ``dtype`` where the installed
    transformers cannot trace its experts on fake tensors (bf16 always can), or None."""
    if dtype == "bf16" or fake_experts_fallback():
        return None
    found = installed("transformers") or "none"
    return (
        _needs(f"an {dtype} estimate of a mixture of experts", "transformers", "5.23.0", found) + " (or --dtype bf16)"
    )
