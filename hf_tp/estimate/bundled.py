"""The bundled model configs (``hf_tp/estimate/models/*.json``) by short name: plain json, no torch."""

from __future__ import annotations

import json
from importlib import resources


def bundled_models() -> dict[str, str]:
    """Short name -> Hub id of every bundled config, sorted by short name."""
    out = {}
    for entry in sorted(resources.files("hf_tp.estimate").joinpath("models").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text()).get("_name_or_path", "")
    return out
