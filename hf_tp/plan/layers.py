"""One decoder layer's plan as rows and collectives, and the layers grouped by equal plans.

Every plan entry is resolved against the layer's own modules (a hybrid model's layer lacks some
entries; a ``DenseOrMoE`` entry is dense or MoE per layer), so two layers whose rows and
collectives are equal are one kind: ``layers 0-31 (32)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch import nn

from hf_tp.compat.torch_internals import own_attribute
from hf_tp.core.forward_source import self_calls
from hf_tp.core.module_queries import has_submodule
from hf_tp.plan.collectives import Sizes, block_collectives, in_order
from hf_tp.plan.model_plan import Collective, LayerKind, ModuleRow, ParamShard
from hf_tp.plan.styles import Part, Placed, parts, placements

GATHERED_STYLES = ("colwise_gather_output", "rowwise_split_input")


@dataclass(frozen=True)
class Context:
    """What describing a layer needs beyond the layer: sizes, the tp plan transformers gives the
    layer (paths relative to it), the KV heads and the experts' paths."""

    sizes: Sizes
    tp_plan: dict[str, str]
    kv_heads: int
    heads: int
    experts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Described:
    """One layer, described: the parts of a :class:`LayerKind` and its partial-gradient elements."""

    rows: tuple[ModuleRow, ...]
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    total: int
    split: int
    per_rank: int
    partial: int
    moe: bool


def describe_layer(layer: nn.Module, plan: dict, ctx: Context) -> Described:
    """The rows (call order), collectives and weight shares of ``layer`` under ``plan``."""
    resolved: dict[str, list[Part]] = {}
    for path, style in plan.items():
        if has_submodule(layer, path) and (found := parts(style, layer.get_submodule(path))):
            resolved[path] = found
    placed: dict[str, Placed] = {}
    for path, ps in resolved.items():
        for part in ps:
            for name, where in placements(part, layer.get_submodule(path)).items():
                placed[f"{path}.{name}" if path else name] = where
    modules = _in_call_order(layer)
    rows = [row for path, _ in modules if (row := _row(layer, path, resolved, placed, ctx)) is not None]
    params = [p for row in rows for p in row.params]
    blocks = []
    for block in dict.fromkeys(path.split(".", 1)[0] for path, _ in modules if path):
        inside = [(p, m, resolved[p]) for p, m in modules if p.startswith(block + ".") and p in resolved]
        kv = _kv_widths(layer.get_submodule(block), resolved, block, ctx)
        blocks.append(
            block_collectives(layer.get_submodule(block), block, resolved.get(block, []), inside, ctx.sizes, kv)
        )
    forward, backward = in_order(blocks)
    return Described(
        rows=tuple(rows),
        forward=tuple(forward),
        backward=tuple(backward),
        total=sum(math.prod(p.shape) for p in params),
        split=sum(math.prod(p.shape) for p in params if p.split),
        per_rank=sum(math.prod(p.local) for p in params),
        partial=sum(math.prod(p.shape) for p in params if p.partial_grad),
        moe=any(part.kind == "moe" for ps in resolved.values() for part in ps),
    )


@functools.cache
def _first_calls(cls: type) -> dict[str, int]:
    """Line of the first ``self.<name>(...)`` call in ``cls.forward``, by name (read once per class)."""
    return {name: min(c.lineno for c in found) for name, found in self_calls(cls.forward).items()}


def _in_call_order(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layer's modules in the order the forwards call them (the layer's children by the
    layer's forward, their children by theirs), the rest in registration order after them."""
    modules = list(layer.named_modules())
    index = {path: i for i, (path, _) in enumerate(modules)}

    def key(item: tuple[str, nn.Module]) -> tuple:
        names = item[0].split(".") if item[0] else []
        out, parent = [], layer
        for name in names[:2]:
            out.append((_first_calls(type(parent)).get(name, 10**6), index[".".join(names[: len(out) + 1])]))
            parent = parent.get_submodule(name)
        out += [(-1, -1)] * (2 - len(out))  # a module sorts right after its parent
        return (*out, index[item[0]])

    return sorted(modules, key=key)


def _row(
    layer: nn.Module, path: str, resolved: dict[str, list[Part]], placed: dict[str, Placed], ctx: Context
) -> ModuleRow | None:
    """The row of one module: its own style's words, or the words its parameters were placed with."""
    module = layer.get_submodule(path)
    own = resolved.get(path, [])
    params, words = [], [p.words for p in own if p.words]
    expert = ctx.sizes.ep > 1 and any(path == e or path.startswith(e + ".") for e in ctx.experts)
    for name, param in module.named_parameters(recurse=False):
        where = placed.get(f"{path}.{name}" if path else name)
        if where is not None and where.words and where.words not in words:
            words.append(where.words)
        params.append(shard_of(name, tuple(param.shape), where, ctx, expert, param.requires_grad))
    if not own and not params:
        return None
    if expert and params:
        n = params[0].shape[0]
        words.append(f"whole experts over ep ({n // ctx.sizes.ep} of {n} per rank)")
    if any(not p.placed for p in params):
        words.append("not placed by the plan (parallelize refuses it)")
    style = "; ".join(words) or "replicated"
    return ModuleRow(path or "(layer)", style, tuple(params), _why_whole(layer, path, resolved, ctx))


def shard_of(
    name: str, shape: tuple[int, ...], where: Placed | None, ctx: Context, expert: bool, trained: bool = True
) -> ParamShard:
    """Full and per-rank shape (rank 0: the first ranks keep one more row of an uneven split);
    a frozen parameter has no gradient to sum."""
    if where is None:
        return ParamShard(name, shape, shape, split=False, placed=False)
    local = list(shape)
    if expert:
        local[0] = -(-shape[0] // ctx.sizes.ep)
    if where.dim is not None:
        d, tp = where.dim, ctx.sizes.tp
        local[d] = 2 * -(-shape[d] // 2 // tp) if where.packed else -(-shape[d] // tp)
    split = where.dim is not None
    partial = where.partial and trained
    return ParamShard(name, shape, tuple(local), split=split, partial_grad=partial, packed=where.packed)


def _why_whole(layer: nn.Module, path: str, resolved: dict[str, list[Part]], ctx: Context) -> str:
    """Why this module runs whole on every rank, when its style makes it so."""
    kinds = {p.kind for p in resolved.get(path, [])}
    module = layer.get_submodule(path)
    block = path.split(".", 1)[0]
    if "whole_block" in kinds:
        mine = {k: v for k, v in ctx.tp_plan.items() if k.startswith(path + ".") and has_submodule(layer, k)}
        name = type(module).__name__
        if "mla_kv_a_proj" in mine.values() or has_submodule(module, "kv_a_proj_with_mqa"):
            return f"multi-head latent attention ({name}): its shared latent and rotary key feed every head"
        if mine and all(v in GATHERED_STYLES for v in mine.values()):
            return f"transformers' tp plan gathers every projection of {name} (colwise_gather_output): none splits it"
        if not mine:
            return f"transformers' tp plan has no entry for {name}: nothing splits it"
        return f"transformers' tp plan has no row-parallel projection in {name}: nothing splits it"
    if "kv_replicated" in kinds:
        r = ctx.sizes.tp // ctx.kv_heads
        return f"tp {ctx.sizes.tp} > {ctx.kv_heads} KV heads: each KV head whole on {r} ranks"
    whole_block = any(p.kind == "whole_block" for p in resolved.get(block, []))
    if "colwise_gathered" in kinds and not whole_block and ctx.tp_plan.get(path) == "colwise_gather_output":
        return (
            f"transformers gathers its output (colwise_gather_output): {block} runs whole from here to its "
            "row-parallel projection"
        )
    return ""


def _kv_widths(block: nn.Module, resolved: dict[str, list[Part]], path: str, ctx: Context) -> tuple[int, int] | None:
    """The K and V widths one rank gathers over cp in ``block``'s attention (None: no attention)."""
    attention = next((m for m in block.modules() if "Attention" in type(m).__name__), None)
    if attention is None or ctx.sizes.cp == 1:
        return None
    groups = own_attribute(attention, "num_key_value_groups") or max(ctx.heads // ctx.kv_heads, 1)
    kv = ctx.heads // groups
    head = own_attribute(attention, "head_dim") or ctx.sizes.hidden // ctx.heads
    k_dim = own_attribute(attention, "qk_head_dim") or head
    v_dim = own_attribute(attention, "v_head_dim") or head
    kinds = {p.kind for p in resolved.get(path, [])}
    inside = {p.kind for q, ps in resolved.items() if q.startswith(path + ".") for p in ps}
    if "kv_replicated" in inside:
        kv = 1
    elif "gather_in" in kinds and inside & {"colwise", "colwise_own"}:
        kv = -(-kv // ctx.sizes.tp)
    return kv * k_dim, kv * v_dim


def group_layers(described: list[Described], labels: list[tuple[str, ...]]) -> list[LayerKind]:
    """Layers with equal rows and collectives as one :class:`LayerKind` each, in first-seen order;
    ``labels`` (per layer: its layer type, dense or MoE) name what the kind's layers are."""
    kinds: dict[tuple, list[int]] = {}
    for i, d in enumerate(described):
        kinds.setdefault((d.rows, d.forward, d.backward), []).append(i)
    out = []
    for indices in kinds.values():
        d = described[indices[0]]
        words = []
        for part in zip(*(labels[i] for i in indices), strict=True):
            seen = [x for x in dict.fromkeys(part) if x]
            words.append(seen[0] if len(seen) == 1 else ", ".join(f"{x} x{part.count(x)}" for x in seen))
        label = "; ".join(w for w in words if w)
        out.append(LayerKind(tuple(indices), label, d.rows, d.forward, d.backward, d.total, d.split, d.per_rank))
    return out
