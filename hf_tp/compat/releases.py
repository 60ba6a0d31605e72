"""The releases hf_tp is tested with: floors, ceilings, per-family needs, and the one-line refusals.

The floors are what ``scripts/compat.sh`` proves in CI (the unit suite passes with exactly these
releases installed, see docs/compatibility.md), the ceilings what the README's test command
proves (the newest releases); pyproject.toml declares the same range (``>=floor,<next minor``),
and ``configs/constraints/floor.txt`` / ``newest.txt`` pin its two ends. Below a floor hf_tp
refuses to start; a release series newer than a ceiling's gets one warning per package. Where a
family needs a later transformers than the floor (its config gained a tensor-parallel plan later),
:data:`FAMILY_RELEASES` names that release so the refusal can say what to install. Reads package
metadata only: importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
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
# package -> the newest release CI proves (the README's test command; pyproject's upper bound is the
# next minor release): a newer release series is warned about once, not refused
CEILINGS: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.25.0",
    "accelerate": "1.16.0",
    "datasets": "5.2.0",
}
# the lora extra's ceiling (warned about where LoRA is used, as PEFT_FLOOR is the lora extra's floor)
PEFT_CEILING = "0.22.0"

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


class NewerRelease(UserWarning):
    """An installed package is newer than the newest release hf_tp is tested with (it may work)."""


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
    """Raise :class:`UnsupportedRelease` (one line per package) if any package is below its floor;
    else warn (once per process and package) about a release newer than the tested ceiling."""
    lines = below_floor()
    if lines:
        raise UnsupportedRelease("; ".join(lines))
    warn_newer_releases()


def series(release: str) -> tuple[int, int]:
    """The release series ``(major, minor)`` of ``release`` (``5.25.3+cpu`` -> ``(5, 25)``)."""
    major, minor = (_base(release).release + (0, 0))[:2]
    return major, minor


def _tested(package: str) -> str | None:
    """The newest release of ``package`` CI proves, or None for a package without a ceiling."""
    return PEFT_CEILING if package == "peft" else CEILINGS.get(package)


def newer_line(package: str) -> str | None:
    """The one-line warning for an installed ``package`` whose release series is newer than its
    ceiling's (5.25.3 is inside a 5.25.0 ceiling, 5.26.0 is not), else None."""
    found, ceiling = installed(package), _tested(package)
    if found is None or ceiling is None or series(found) <= series(ceiling):
        return None
    major, minor = series(ceiling)
    return (
        f"{package} {found} is newer than the newest release hf_tp is tested with ({major}.{minor}); it may "
        f"work: report what breaks, or pip install '{package}<{major}.{minor + 1}'"
    )


def newer_than_tested(packages: Iterable[str] = tuple(CEILINGS)) -> list[str]:
    """One line per installed package of ``packages`` newer than the newest release CI proves."""
    return [line for package in packages if (line := newer_line(package)) is not None]


_REPORTED: set[str] = set()  # packages whose newer release this process has reported already
# ... or a process that started this one (hf-tp train's ranks inherit what the CLI printed)
REPORTED_ENV = "HF_TP_RELEASES_REPORTED"


def unreported_newer(packages: Iterable[str] = tuple(CEILINGS)) -> list[str]:
    """:func:`newer_than_tested`'s lines for the packages not reported yet by this process or the one
    that started it (they count as reported from now on, here and in the processes this one starts:
    the CLI prints them, and neither ``parallelize`` nor a launched rank warns again)."""
    reported = _REPORTED | set(filter(None, os.environ.get(REPORTED_ENV, "").split(",")))
    lines = []
    for package in packages:
        line = newer_line(package)
        if line is not None and package not in reported:
            _REPORTED.add(package)
            lines.append(line)
    if lines:
        os.environ[REPORTED_ENV] = ",".join(sorted(reported | _REPORTED))
    return lines


def warn_newer_releases(packages: Iterable[str] = tuple(CEILINGS)) -> None:
    """``warnings.warn`` (:class:`NewerRelease`) each of :func:`unreported_newer`'s lines: one per
    package and process. ``packages=("peft",)`` where LoRA is used."""
    for line in unreported_newer(packages):
        warnings.warn(line, NewerRelease, stacklevel=2)


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
