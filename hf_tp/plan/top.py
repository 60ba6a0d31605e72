"""The top level of a plan: embedding, final norms, lm_head, and a wrapper's passengers."""

from __future__ import annotations

import math

from torch import nn

from hf_tp.adapters.adapter import Adapter
from hf_tp.plan.layers import Context, shard_of
from hf_tp.plan.model_plan import ModuleRow, ParamShard
from hf_tp.plan.styles import PER_TOKEN, parts, placements

PASSENGER = "whole on every tp rank (FSDP2 shards it over dp); a vision tower frozen unless --train-vision-tower, a projector trained"


def describe_top(
    model: nn.Module, adapter: Adapter, plan: dict, ctx: Context
) -> tuple[tuple[ModuleRow, ...], dict[str, tuple[str, int]], int]:
    """(rows, top-level path -> (the kind of its style, its hidden width), elements of its partial gradients)."""
    rows: list[ModuleRow] = []
    kinds: dict[str, tuple[str, int]] = {}
    partial = 0
    tied = _tied(model)
    for path, style in plan.items():
        module = model.get_submodule(path)
        ps = parts(style, module)
        placed = {n: w for p in ps for n, w in placements(p, module).items()}
        whole = any(p.kind in PER_TOKEN for p in ps)  # its submodules (Qwen4-Exp's mixers') are placed with it
        shards = tuple(
            shard_of(n, tuple(p.shape), placed.get(n), ctx, False, p.requires_grad)
            for n, p in module.named_parameters(recurse=whole)
        )
        words = "; ".join(p.words for p in ps if p.words)
        if tied and module is model.get_output_embeddings():
            words += "; weight tied to the input embedding (one parameter)"
        rows.append(ModuleRow(path, words, shards))
        width = module.embedding_dim if isinstance(module, nn.Embedding) else getattr(module, "in_features", 0)
        for p in ps:
            kinds[path] = (p.kind, width)
        partial += sum(math.prod(s.shape) for s in shards if s.partial_grad)
    rows += _passengers(model, adapter)
    placed_paths = set(plan) | {r.path for r in rows}
    whole = tuple(f"{path}." for path, (kind, _) in kinds.items() if kind in PER_TOKEN)  # placed with their module
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner == adapter.layers_path or owner.startswith(adapter.layers_path + "."):
            continue
        if owner in placed_paths or name.startswith(whole) or adapter.is_passenger(name):  # (a tied lm_head: once)
            continue
        rows.append(ModuleRow(owner, "not placed by the plan (parallelize refuses it)", (_unplaced(leaf, p),)))
    return tuple(rows), kinds, partial


def _tied(model: nn.Module) -> bool:
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if get_out is not None else None
    return out is not None and model.get_input_embeddings().weight is out.weight


def _passengers(model: nn.Module, adapter: Adapter) -> list[ModuleRow]:
    """One row per passenger (its parameter count, not each tensor)."""
    rows = []
    for path in adapter.passengers:
        try:
            module = model.get_submodule(path)
            count = sum(p.numel() for p in module.parameters())
        except AttributeError:  # a parameter held directly by a module outside the language model
            count = model.get_parameter(path).numel()
        shard = ParamShard("", (count,), (count,), split=False)  # (its size, not each tensor)
        rows.append(ModuleRow(path, "passenger, outside the language model", (shard,), PASSENGER))
    return rows


def _unplaced(name: str, p: nn.Parameter) -> ParamShard:
    return ParamShard(name, tuple(p.shape), tuple(p.shape), split=False, placed=False)
