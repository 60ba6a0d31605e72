"""Fused expert weights read box by box from checkpoints that hold one tensor per expert.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters (``gate_up_proj``
[experts, 2 x intermediate, hidden], ``down_proj`` [experts, hidden, intermediate]), while most
Hub checkpoints hold one 2-D tensor per expert and projection, which ``from_pretrained`` stacks
and concatenates on load (transformers' ``WeightConverter`` with ``MergeModulelist`` and
``Concatenate``). DCP's HF reader reads tensors by their names in the files only, so such a
checkpoint used to be loaded whole by every rank.

Here a fused parameter is described by the file tensors it is made of, found with transformers'
own conversion mapping (:func:`fused_sources`), and each rank reads only the box of the fused
tensor it holds (its experts under ep, its tp slice, its FSDP2 shard), a file tensor's slice at a
time (:func:`load_fused`). A rank's host memory stays at its share of the experts. Written by hand
because neither DCP nor transformers reads a slice of a tensor that the files store in pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from hf_tp.compat.torch_distributed import local_shape_and_offset


@dataclass(frozen=True)
class FusedSource:
    """A parameter in HF's layout as file tensors: ``parts[p][e]`` is the file tensor of expert
    ``e`` in part ``p``; experts are stacked along dim 0 and the parts concatenated along ``dim``
    (transformers' ``MergeModulelist(dim=0)`` then ``Concatenate(dim)``). A fused tensor stored
    as such in the files is one part of one key, not ``stacked``."""

    parts: tuple[tuple[str, ...], ...]
    dim: int = 1
    stacked: bool = True
    sizes: tuple[int, ...] = ()  # each part's length along ``dim``


def conversion_transforms(model: torch.nn.Module) -> list:
    """transformers' weight transforms for ``model``'s class (then its model_type): [] when none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion mappings: names are as saved
        return []
    # Looked up as transformers does (class name, then model_type), by the HF class: FSDP2 makes the
    # model an instance of a subclass of its own, which transformers would take for custom code.
    hf_class = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    transforms = get_checkpoint_conversion_mapping(hf_class.__name__)
    if transforms is None:
        transforms = get_checkpoint_conversion_mapping(model.config.model_type) or []
    return transforms


def _merge_ops(converter) -> int | None:
    """The concatenation dim of a ``[MergeModulelist(0)]`` or ``[MergeModulelist(0), Concatenate(d)]``
    converter (1 for the first: unused); None for any other chain (read whole by from_pretrained)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
    if ops == [("MergeModulelist", 0)]:
        return 1
    if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" and (ops[1][1] or 0) >= 1:
        return ops[1][1]
    return None


def converted_keys(transforms: list, keys) -> Iterator[tuple[str, str, Any, str, str]]:
    """(file key, its name after transformers' renames, the converter that reads it, the model
    name it builds, the converter's source pattern) for each file key a converter reads: at most
    one converter per key, as in transformers."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    for key in keys:
        name = key
        for rename in renames:
            name, _ = rename.rename_source_key(name)
        for converter in converters:
            target, pattern = converter.rename_source_key(name)
            if pattern is not None:
                yield key, name, converter, target, pattern
                break


def fused_sources(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, FusedSource]:
    """Parameter name -> the file tensors it is stacked from, for the model's parameters that
    transformers builds from one tensor per expert. ``shapes``: every file tensor's shape.
    A parameter is left out when its pieces are not the whole tensor (a missing expert, another
    shape): it is then not loaded by boxes."""
    found: dict[str, dict[tuple[int, int], str]] = {}
    dims: dict[str, int] = {}
    for key, name, converter, target, pattern in converted_keys(conversion_transforms(model), shapes):
        dim, expert = _merge_ops(converter), _expert_index(name, target)
        if dim is not None and expert is not None:
            found.setdefault(target, {})[(converter.source_patterns.index(pattern), expert)] = key
            dims[target] = dim
    params = dict(model.named_parameters())
    out = {}
    for target, pieces in found.items():
        source = _complete(pieces, dims[target])
        if target in params and source is not None and _hf_shape(source, shapes) == _hf_shape_of(model, target):
            sizes = tuple(shapes[keys[0]][source.dim - 1] for keys in source.parts)
            out[target] = dataclasses.replace(source, sizes=sizes)
    return out


def _expert_index(source: str, target: str) -> int | None:
    """The expert number in a per-expert key: the first dotted part where it leaves the fused name."""
    a, b = source.split("."), target.split(".")
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return int(a[common]) if common < len(a) and a[common].isdigit() else None


def _complete(pieces: dict[tuple[int, int], str], dim: int) -> FusedSource | None:
    parts = sorted({p for p, _ in pieces})
    experts = sorted({e for _, e in pieces})
    if parts != list(range(len(parts))) or experts != list(range(len(experts))):
        return None
    if any((p, e) not in pieces for p in parts for e in experts):
        return None
    return FusedSource(tuple(tuple(pieces[(p, e)] for e in experts) for p in parts), dim)


def _hf_shape(source: FusedSource, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The fused tensor's shape in HF's layout, None if the pieces do not fit together."""
    if not source.stacked:
        return tuple(shapes[source.parts[0][0]])
    first = [shapes[keys[0]] for keys in source.parts]
    if any(shapes[k] != first[p] for p, keys in enumerate(source.parts) for k in keys):
        return None
    d = source.dim - 1
    if any(len(s) != len(first[0]) or s[:d] + s[d + 1 :] != first[0][:d] + first[0][d + 1 :] for s in first):
        return None
    shape = list(first[0])
    shape[d] = sum(s[d] for s in first)
    return (len(source.parts[0]), *shape)


def _hf_shape_of(model: torch.nn.Module, name: str) -> tuple[int, ...]:
    from hf_tp.moe.expert_styles import hf_shapes

    return hf_shapes(model).get(name, tuple(model.get_parameter(name).shape))


class _Files:
    """Open safetensors files by tensor name (``weight_map``: tensor -> file), kept open for a load."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str]) -> None:
        self.dir, self.map, self.open = model_dir, weight_map, {}

    def tensor(self, key: str):
        """The file tensor as a lazily read safetensors slice (``[box]`` reads just that box)."""
        name = self.map[key]
        if name not in self.open:
            self.open[name] = safe_open(str(self.dir / name), framework="pt")
        return self.open[name].get_slice(key)


def _read_hf_box(files: _Files, source: FusedSource, box: tuple[slice, ...], out: torch.Tensor) -> None:
    """Fill ``out`` with ``box`` of the fused tensor in HF's layout, read piece by piece."""
    if not source.stacked:
        out.copy_(files.tensor(source.parts[0][0])[box])
        return
    d = source.dim  # the concatenation dim of the fused tensor (the file tensors' d - 1)
    start = 0
    for keys, size in zip(source.parts, source.sizes, strict=True):
        lo, hi = max(box[d].start, start), min(box[d].stop, start + size)
        if lo < hi:
            inner = list(box[1:])
            inner[d - 1] = slice(lo - start, hi - start)
            at = [slice(None)] * out.dim()
            at[d] = slice(lo - box[d].start, hi - box[d].start)
            for i, e in enumerate(range(box[0].start, box[0].stop)):
                at[0] = i
                out[tuple(at)].copy_(files.tensor(keys[e])[tuple(inner)])
        start += size


def read_whole(
    model_dir: Path, weight_map: dict[str, str], source: FusedSource, shape: tuple[int, ...]
) -> torch.Tensor:
    """The whole fused tensor in HF's layout, fp32 (a merged LoRA export's base experts)."""
    out = torch.empty(shape, dtype=torch.float32)
    _read_hf_box(_Files(model_dir, weight_map), source, tuple(slice(0, n) for n in shape), out)
    return out


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The box of the global tensor this rank holds of ``param`` (the whole tensor if not a DTensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = local_shape_and_offset(param)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(f"the local shard is {tuple(param.to_local().shape)}, its placements give {tuple(shape)}")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def load_fused(
    model: torch.nn.Module, sources: dict[str, FusedSource], model_dir: Path, weight_map: dict[str, str]
) -> None:
    """Fill each parameter named in ``sources`` (already materialized) with this rank's box of
    it, cast to the parameter's dtype as ``from_pretrained`` casts."""
    from hf_tp.moe.expert_styles import hf_shapes

    files, packed = _Files(model_dir, weight_map), hf_shapes(model)
    with torch.no_grad():
        for name, source in sources.items():
            param = model.get_parameter(name)
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.numel():
                _read_stored_box(files, source, tuple(param.shape), packed.get(name, tuple(param.shape)),
                                 local_box(param), local)  # fmt: skip
    files.open.clear()


def _read_stored_box(
    files: _Files,
    source: FusedSource,
    stored: tuple[int, ...],
    hf: tuple[int, ...],
    box: tuple[slice, ...],
    out: torch.Tensor,
) -> None:
    """A box of hf_tp's stored layout: HF's, or HF's with one dim split in (2, n / 2) (packed
    gate/up halves, :func:`hf_tp.moe.expert_styles.stored_shape`): the same numbers in the same order."""
    if stored == hf:
        _read_hf_box(files, source, box, out)
        return
    d = next(i for i in range(len(hf)) if stored[i] != hf[i])
    half = stored[d + 1]
    if stored[d] * half != hf[d] or math.prod(stored) != math.prod(hf):
        raise ValueError(f"cannot read a {stored} parameter from a {hf} tensor")
    for i, a in enumerate(range(box[d].start, box[d].stop)):
        rows = slice(a * half + box[d + 1].start, a * half + box[d + 1].stop)
        target = out.select(d, i)
        _read_hf_box(files, source, (*box[:d], rows, *box[d + 2 :]), target)
