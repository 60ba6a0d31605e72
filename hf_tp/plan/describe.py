"""``hf_tp.describe(model)``: what ``parallelize`` did to a model, in words, from its record
(:mod:`hf_tp.core.record`): meshes, options, each decoder-layer kind's styles, the top level,
experts, context parallelism, LoRA, dropout, the fused partial gradients."""

from __future__ import annotations

import re

from torch import nn

from hf_tp.compat.torch_internals import own_attribute
from hf_tp.core.module_queries import has_submodule
from hf_tp.core.record import ATTRIBUTE, ParallelRecord, record_of
from hf_tp.plan.styles import parts
from hf_tp.styles import resolve


def describe(model: nn.Module, *, file=None) -> str:
    """Print (to ``file``, stdout by default) and return the record of a parallelized ``model``."""
    text = format_record(model)
    print(text, file=file)
    return text


def format_record(model: nn.Module) -> str:
    """The record of a parallelized ``model`` in words (a peft or compiled wrapper is looked through)."""
    record = record_of(model)
    if record is None:
        raise ValueError(
            f"{type(model).__name__} is not parallelized by hf_tp (it has no record): call hf_tp.parallelize first"
        )
    inner = _holder(model)
    out = [f"hf_tp: {record.model_type} ({record.adapter})", "meshes: " + _meshes(record)]
    opts = record.options
    out.append(
        f"options: sequence_parallel={opts.sequence_parallel}, loss_parallel={opts.loss_parallel}, "
        f"kv_replicas={opts.kv_replicas}, activation_checkpointing={record.activation_checkpointing}, "
        f"compile={record.compiled}"
    )
    if record.size("tp") > 1:
        out += _layer_kinds(inner, record)
        out.append("top level:")
        out += [f"  {path}: {_words(style, inner, path)}" for path, style in record.top_plan.items() if style]
    out += _extras(record)
    return "\n".join(out)


def _holder(model: nn.Module) -> nn.Module:
    """The module the record sits on (a peft or compile wrapper looked through)."""
    for module in model.modules():
        if isinstance(own_attribute(module, ATTRIBUTE), ParallelRecord):
            return module
    return model


def _meshes(record: ParallelRecord) -> str:
    sizes = ", ".join(f"{dim}={mesh.size()}" for dim, mesh in record.meshes.items())
    return sizes + (" (FSDP2 over dp" + (" x cp" if "cp" in record.meshes else "") + ")" if record.fsdp else "")


def _words(style, root: nn.Module, path: str) -> str:
    if not has_submodule(root, path) and path:
        return "(no such module here)"
    module = root.get_submodule(path) if path else root
    chosen = resolve(style, module)
    if chosen is None:
        return "runs whole (no style)"
    try:
        return "; ".join(part.words for part in parts(chosen, module))
    except Exception:  # noqa: BLE001 - a user's own style: its class name
        return type(chosen).__name__


def _layer_kinds(model: nn.Module, record: ParallelRecord) -> list[str]:
    """Decoder layers grouped by the styles their modules got (per-layer choices resolved)."""
    kinds: dict[tuple, list[int]] = {}
    for index, layer in enumerate(model.get_submodule(record.layers_path)):
        rows = tuple((p, _words(s, layer, p)) for p, s in record.layer_plan.items() if s and has_submodule(layer, p))
        kinds.setdefault(rows, []).append(index)
    out = [f"decoder layers ({record.layers_path}): {len(kinds)} kind(s)"]
    for rows, layers in kinds.items():
        out.append(f"  layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}:")
        out += [f"    {path}: {words}" for path, words in rows]
    return out


def _ranges(values: list[int]) -> str:
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _extras(record: ParallelRecord) -> list[str]:
    out = []
    if record.experts:
        first = next(iter(record.experts.values()))
        out.append(
            f"experts: {len(record.experts)} modules over ep={first.mesh['ep'].size()}, "
            f"this rank holds experts {first.start}-{first.start + first.local - 1} of each"
        )
    if record.cp is not None:
        out.append(f"context parallel: cp={record.cp.mesh.size()}, the model's kernel '{record.cp.base}' per rank")
    if record.lora is not None:
        out.append(
            f"LoRA: peft model, {record.lora.dropouts} dropouts tp-aware, "
            f"{len(record.lora.whole_run)} layers in blocks run whole"
        )
    if record.dropout is not None:
        out.append("dropout: the model's own, drawn from tp-aware streams")
    if record.partial_grads is not None:
        out.append("partial gradients: one fused all-reduce per backward")
    if record.passengers:
        out.append(f"run whole on every tp rank (a wrapper's passengers): {', '.join(record.passengers)}")
    if record.whole:
        out.append(f"kept whole outside FSDP2 (odd dtype): {', '.join(record.whole)}")
    if record.stage is not None:
        stage, layers = record.stage, record.layers_path + "."
        others = [gap for gap in stage.gaps if not gap.startswith(layers)]  # (the layers: all but its own)
        line = f"pipeline stage: decoder layers {_ranges(list(stage.layers))} of {stage.of}"
        line += f" (first: {'yes' if stage.first else 'no'}, last: {'yes' if stage.last else 'no'})"
        out.append(line + (f"; gaps for the other stages' {', '.join(others)}" if others else ""))
    if record.overrides:  # a method per decoder layer once, its layer index as *
        out.append(f"methods replaced: {', '.join(_per_layer(record.overrides))}")
    if record.classes:
        out.append(f"classes replaced: {', '.join(_per_layer(record.classes))}")
    return out


def _per_layer(names: tuple[str, ...]) -> list[str]:
    """``names`` with each layer index written ``*``, each distinct one once."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))
