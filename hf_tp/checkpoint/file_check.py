"""Before launch: do a model folder's safetensors hold every weight its config builds, in its shape,
and nothing else? Read from the files' headers (no tensor) against the model built on the meta
device, through transformers' own key mapping (renames, per-expert tensors its converters stack
into fused experts), so that tied weights, buffers and load-time conversions raise no false alarm.

Without this a folder lacking ``model.layers.1.*`` trains to the end with that layer random: the
only sign is transformers' load report scrolling past.
"""

from __future__ import annotations

import re
from pathlib import Path

SHOWN = 3  # names shown per kind in the one-line error


def check_weights_match(model: str, config) -> None:
    """``ValueError`` (one line, naming the tensors) when the local folder ``model``'s safetensors do
    not match the model its ``config`` builds."""
    problem = weight_mismatch(Path(model).expanduser(), config)
    if problem is not None:
        raise ValueError(
            f"model folder '{model}' does not match its config.json: its safetensors {problem}; the model would "
            "train with those weights random: copy or download the weight files again, or fix config.json"
        )


def weight_mismatch(model_dir: Path, config) -> str | None:
    """What the folder's safetensors lack, hold extra or hold in another shape against ``config``'s
    model, in words; None when they match (or the folder has no safetensors)."""
    import torch

    from hf_tp.checkpoint.load import file_index, file_keys
    from hf_tp.core.model_source import model_from_config
    from hf_tp.moe.expert_files import conversion_transforms, fused_sources

    index = file_index(model_dir)
    if not index:
        return None
    try:
        with torch.device("meta"):
            model = model_from_config(config, dtype=torch.float32)
    except Exception:  # noqa: BLE001 - a model it cannot build here (its own code): left to loading
        return None
    shapes = {k: shape for k, (_, shape) in index.items()}
    in_file = file_keys(model, set(index))
    transforms = conversion_transforms(model)
    fused = fused_sources(model, shapes) if transforms else {}
    converted, consumed = _converted(transforms, set(index))
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    missing, misshaped, used = [], [], set()
    for names in _parameter_names(model):
        if any(n in fused for n in names):
            used |= {k for n in names if n in fused for keys in fused[n].parts for k in keys}
            continue
        found = next((n for n in names if n in in_file), None)
        if found is not None:
            used.add(in_file[found])
            want = tuple(model.get_parameter(found).shape)
            if shapes[in_file[found]] != want:
                misshaped.append(f"{in_file[found]} {list(shapes[in_file[found]])} (the model's {list(want)})")
        elif not any(n in converted or _matches(ignore_missing, n) for n in names):
            missing.append(names[0])
    buffers = {name for name, _ in model.named_buffers()}
    ignore = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    mapped = {key: name for name, key in in_file.items()}
    unexpected = [
        k
        for k in sorted(index)
        if k not in used
        and k not in consumed
        and mapped.get(k) not in buffers
        and not _matches(ignore, mapped.get(k, k))
    ]
    return _describe(missing, misshaped, unexpected)


def _parameter_names(model) -> list[list[str]]:
    """Each parameter's names (a tied weight has several: one of them in the files is enough)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return list(by_id.values())


def _converted(transforms: list, keys: set[str]) -> tuple[set[str], set[str]]:
    """(model names transformers' converters build from the files, the file keys they read)."""
    from hf_tp.moe.expert_files import converted_keys

    found = [(key, target) for key, _, _, target, _ in converted_keys(transforms, keys)]
    return {target for _, target in found}, {key for key, _ in found}


def _patterns(model, attribute: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or [])]


def _matches(patterns: list[re.Pattern], name: str) -> bool:
    return any(p.search(name) for p in patterns)


def _describe(missing: list[str], misshaped: list[str], unexpected: list[str]) -> str | None:
    parts = []
    for what, names in (("lack", missing), ("hold in another shape", misshaped), ("hold unexpected", unexpected)):
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{what} {len(names)} weight{'s' if len(names) > 1 else ''}: {', '.join(names[:SHOWN])}{more}")
    return "; ".join(parts) or None
