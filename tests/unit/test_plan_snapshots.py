"""Golden snapshots of ``hf-tp plan`` at tp=2 for every supported family: the grid's tiny
configs (tests/family_grid.py, tests/helpers.py), the plan text under tests/plans/<model_type>.txt.

A transformers release (or an hf_tp change) that changes a derived plan shows up here as a
readable diff of the plan. Regenerate with ``python scripts/update_plan_snapshots.py`` (or run
this test with ``HF_TP_UPDATE_SNAPSHOTS=1``) and read the diff before committing it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from transformers import CONFIG_MAPPING, PretrainedConfig

import hf_tp
from hf_tp.compat import family_refusal, installed
from hf_tp.plan import format_plan, plan_for
from tests.family_grid import grid_config
from tests.helpers import FAMILY_SETTINGS, tiny_config

SNAPSHOTS = Path(__file__).resolve().parents[1] / "plans"
TP, SEQ_LEN = 2, 64
UPDATE = os.environ.get("HF_TP_UPDATE_SNAPSHOTS") == "1"
# The transformers release the snapshots were written with: plans are derived from its model code,
# so another release (CI's floor run) is compared by scripts/update_plan_snapshots.py, not here.
RELEASE = (SNAPSHOTS / "RELEASE").read_text().strip()
pytestmark = pytest.mark.skipif(
    not UPDATE and installed("transformers") != RELEASE,
    reason=f"the plan snapshots are of transformers {RELEASE}",
)


def families() -> list[str]:
    """Every supported family this transformers has (and is not too old for)."""
    return sorted(mt for mt in hf_tp.supported_model_types() if mt in CONFIG_MAPPING and not family_refusal(mt))


def family_config(model_type: str) -> PretrainedConfig:
    """The tiny config the grids test the family with (the hand-written families' own settings)."""
    return tiny_config(model_type) if model_type in FAMILY_SETTINGS else grid_config(model_type)


def snapshot_text(model_type: str) -> str:
    """hf_tp's plan, then the plans transformers declares for the family (tp and ep), so that a
    release that changes them shows as a diff here even where hf_tp's own plan holds."""
    config = family_config(model_type)
    text = format_plan(plan_for(config, tp=TP, seq_len=SEQ_LEN, name=model_type))
    return text + transformers_plans(config)


def transformers_plans(config: PretrainedConfig) -> str:
    """The language model's ``base_model_tp_plan`` and ``base_model_ep_plan``, one entry a line."""
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    lines = ["", f"transformers' plans ({text.model_type})"]
    for name in ("base_model_tp_plan", "base_model_ep_plan"):
        plan = getattr(text, name, None) or {}
        lines.append(f"  {name}:" + ("" if plan else " none"))
        width = max((len(k) for k in plan), default=0)
        lines += [f"    {key.ljust(width)}  {style}" for key, style in sorted(plan.items())]
    return "\n".join(lines) + "\n"


def write_snapshots(model_types: list[str] | None = None) -> list[str]:
    """Write the snapshots of ``model_types`` (default: every family); the paths changed."""
    changed = []
    (SNAPSHOTS / "RELEASE").write_text(f"{installed('transformers')}\n")
    for mt in model_types or families():
        path = SNAPSHOTS / f"{mt}.txt"
        text = snapshot_text(mt)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(str(path))
    return changed


def test_every_supported_family_matches_its_snapshot() -> None:
    if UPDATE:
        write_snapshots()
    stale, missing = [], []
    for mt in families():
        path = SNAPSHOTS / f"{mt}.txt"
        if not path.is_file():
            missing.append(mt)
            continue
        want, got = path.read_text(), snapshot_text(mt)
        if got != want:
            diff = difflib.unified_diff(want.splitlines(), got.splitlines(), f"{mt}.txt", "derived now", lineterm="")
            stale.append("\n".join(list(diff)[:40]))
    assert not missing, f"no snapshot for {missing}: run python scripts/update_plan_snapshots.py"
    assert not stale, "derived plans changed (python scripts/update_plan_snapshots.py):\n" + "\n\n".join(stale)


def test_no_snapshot_of_a_family_gone() -> None:
    # A snapshot whose family is no longer supported (or installed) would go unread.
    known = set(families())
    extra = sorted(p.stem for p in SNAPSHOTS.glob("*.txt") if p.stem not in known and p.stem in CONFIG_MAPPING)
    if extra and not UPDATE:
        pytest.fail(f"snapshots of families not supported now: {extra}; delete them or restore the support")
