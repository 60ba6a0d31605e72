"""Model configs for estimates: bundled short names, local dirs/files, or Hub ids.

The bundled configs (``hf_tp/estimate/models/*.json``) hold the published shapes of a few common
models, so ``hf-tp estimate --model llama-3.1-8b`` works offline and without Hub access. Listing
them (:func:`bundled_models`, for ``--help``) reads json only: transformers is imported on first
use of a config.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["bundled_config", "bundled_models", "config_from_dict", "resolve_model_config"]


def bundled_models() -> dict[str, str]:
    """Short name -> Hub id of every bundled config, sorted by short name."""
    out = {}
    for entry in sorted(resources.files("hf_tp.estimate").joinpath("models").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text()).get("_name_or_path", "")
    return out


def config_from_dict(data: dict) -> PretrainedConfig:
    """A transformers config object from the contents of a ``config.json``."""
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config.json has model_type {model_type!r}, which transformers does not know")
    return CONFIG_MAPPING[model_type].from_dict(dict(data))


def bundled_config(short_name: str) -> PretrainedConfig:
    """The bundled config of ``short_name`` (case-insensitive); a ``ValueError`` naming them if unknown."""
    name = short_name.lower()
    models = bundled_models()
    if name not in models:
        raise ValueError(f"unknown model short name '{short_name}'; bundled ones are: {', '.join(models)}")
    entry = resources.files("hf_tp.estimate").joinpath("models", f"{name}.json")
    return config_from_dict(json.loads(entry.read_text()))


def resolve_model_config(model: str) -> tuple[PretrainedConfig, str]:
    """``(config, label)`` for ``--model``: a local dir or config.json, a bundled short name (or
    its Hub id, served offline from the bundle), else a Hub id through ``AutoConfig``."""
    path = Path(model).expanduser()
    if path.is_file():
        return config_from_dict(json.loads(path.read_text())), str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"local directory '{model}' has no config.json; pass a model dir or a config.json file")
        return config_from_dict(json.loads((path / "config.json").read_text())), str(path)
    if model.startswith((".", "/", "~")) or model.endswith(".json"):
        raise ValueError(f"model not found: no file or directory at '{model}'")
    models = bundled_models()
    by_hub_id = {hub_id.lower(): short for short, hub_id in models.items() if hub_id}
    short = model.lower() if model.lower() in models else by_hub_id.get(model.lower())
    if short is not None:
        return bundled_config(short), models[short] or short
    if "/" not in model:
        raise ValueError(
            f"unknown model '{model}': not a bundled short name ({', '.join(models)}), a local path, or a Hub id"
        )
    from hf_tp.train.validate import load_model_config  # one quick request when the Hub is unreachable

    try:
        return load_model_config(model), model
    except ValueError as exc:
        raise ValueError(
            f"cannot load a config for '{model}' ({exc}); offline, use a local dir/config.json or a bundled "
            f"short name: {', '.join(models)}"
        ) from None
