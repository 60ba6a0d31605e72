"""Stream a DCP checkpoint's model tensors into HF safetensors shards, a module's tensors at a time.

Nothing is built but a meta-device model (names, shapes, ties, transformers' weight conversions).
The tensors of one module (a layer's projection, a MoE block's fused experts) are read from the
checkpoint together, reshaped from hf_tp's storage layout (packed gate/up halves) to HF's, put
back into the original checkpoint format by transformers' own ``revert_weight_conversion`` (fused
experts split per expert, renamed keys), cast, and appended to the current output shard, which is
written as soon as it is full. Peak host memory is about one shard plus one module's fp32 tensors,
whatever the model's size. Tied weights are written once (as ``save_pretrained`` does).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata

from hf_tp.checkpoint.safe_load import SafeReader, safe_load

GroupReader = Callable[[list[str]], dict[str, torch.Tensor]]
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def unique_state_keys(model: torch.nn.Module) -> list[str]:
    """State-dict keys of ``model`` with each tensor once (a tied ``lm_head`` is its embedding) and
    without the keys its class never saves."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    seen: set[int] = set()
    keys = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or key in ignore:
            continue
        seen.add(id(tensor))
        keys.append(key)
    return keys


def _revert(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under the names and in the layout of the model's original checkpoint format."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions saves its state dict as is
        return tensors
    return revert_weight_conversion(model, tensors)


def module_groups(model: torch.nn.Module, keys: list[str]) -> list[list[str]]:
    """``keys`` grouped by owning module (weight conversions combine a module's own tensors), in
    state-dict order. Raises if a conversion needs tensors of two modules at once."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rpartition(".")[0], []).append(key)
    out = list(groups.values())
    sd = model.state_dict()
    apart = set().union(*(_revert(model, {k: sd[k] for k in g}) for g in out)) if out else set()
    whole = set(_revert(model, {k: sd[k] for k in keys}))
    if apart != whole:
        raise ValueError(
            f"{type(model).__name__}'s weight conversion combines tensors of different modules "
            f"({sorted(apart ^ whole)[:3]}); export it with a transformers release that converts it per module"
        )
    return out


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split (name, bytes) in order into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards if shards[0] else []


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _read_group(reader: SafeReader, metadata: Metadata, hf: dict[str, torch.Tensor], group: list[str]) -> dict:
    """One module's tensors from the checkpoint, in HF's shape (fp32 or whatever was stored)."""
    stored = {}
    for key in group:
        meta = metadata.state_dict_metadata.get(f"model.{key}")
        if meta is None or not hasattr(meta, "size"):
            raise ValueError(f"the checkpoint holds no tensor for {key}; was it saved from this model's config?")
        if math.prod(meta.size) != hf[key].numel():
            raise ValueError(f"{key}: the checkpoint holds {tuple(meta.size)}, the config gives {tuple(hf[key].shape)}")
        stored[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        safe_load({"model": stored}, reader.path, no_dist=True, reader=reader)  # metadata read once
    return {k: t.view(hf[k].shape) for k, t in stored.items()}  # packed halves: the same numbers in order


def _converted(
    ckpt: Path, model: torch.nn.Module, groups: list[list[str]], dtype: torch.dtype, read: GroupReader | None
) -> Iterator[dict]:
    reader = SafeReader(ckpt)
    metadata = reader.read_metadata()
    hf = model.state_dict()
    for group in groups:
        tensors = _revert(model, read(group) if read else _read_group(reader, metadata, hf, group))
        yield {k: v.to(dtype).contiguous() for k, v in tensors.items()}


def write_shards(
    ckpt: Path,
    model: torch.nn.Module,
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_size: int | str,
    read: GroupReader | None = None,
) -> list[str]:
    """Write ``model``'s tensors from the DCP checkpoint ``ckpt`` (``model`` on the meta device)
    into ``out_dir`` as safetensors shards of at most ``max_shard_size`` (an index when several).
    ``read`` (keys of one module -> their tensors in HF's shape) replaces the checkpoint as the
    source (a LoRA run's merged weights: :mod:`hf_tp.checkpoint.lora_export`). Returns the file
    names written."""
    max_bytes = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    if max_bytes <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    groups = module_groups(model, unique_state_keys(model))
    sd = model.state_dict()
    item = torch.empty((), dtype=dtype).element_size()
    layout = [(name, t.numel() * item) for g in groups for name, t in _revert(model, {k: sd[k] for k in g}).items()]
    shards = plan_shards(layout, max_bytes)
    files = _shard_names(len(shards))
    where = {name: i for i, names in enumerate(shards) for name in names}
    current, pending = 0, {}
    for tensors in _converted(ckpt, model, groups, dtype, read):
        for name, tensor in tensors.items():
            if where[name] != current:
                save_file(pending, str(out_dir / files[current]), metadata={"format": "pt"})
                current, pending = where[name], {}
            pending[name] = tensor
        del tensors
    if pending:
        save_file(pending, str(out_dir / files[current]), metadata={"format": "pt"})
    if len(files) > 1:
        index = {
            "metadata": {
                "total_size": sum(size for _, size in layout),
                "total_parameters": sum(s for _, s in layout) // item,
            },
            "weight_map": {name: files[i] for name, i in where.items()},
        }
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
