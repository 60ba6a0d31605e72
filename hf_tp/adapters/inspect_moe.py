"""Reading a decoder layer's mixture-of-experts blocks for the generic plan.

A layer-level child holding a module that transformers' plan marks ``moe_tp_experts`` is a MoE
block. hf_tp runs it as one region (:class:`hf_tp.styles.experts.MoERegion`) and gives every
parameter under it a role:

- the experts' 3-D weights: sharded on the intermediate dim their plan style names
  (``packed_colwise``/``colwise``: dim -2, ``packed_rowwise``/``rowwise``: dim -1; packed ones as
  gate and up halves), an expert bias following its weight (sharded when the weight is split on
  its output dim, -1 for experts stored transposed, else added once);
- Linear layers the plan shards (DeepSeek's ``shared_experts.gate_proj``) or whose name the
  plan shards in a dense MLP of the same layer (Qwen2-MoE's ``shared_expert.gate_proj`` from
  ``mlp.gate_proj``): column- or row-parallel, a row-parallel bias added once;
- routers and gates (the module whose logits HF records, a Linear onto one score per expert or
  one gate value): replicated;
- vectors (norms inside the block, score-correction biases): replicated.

Anything else (a Linear the plan does not split and that is not a gate) could add a whole,
unsplit result to a partial sum: refused with its name, never guessed.
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.facts import Region, refuse
from hf_tp.adapters.modules import has_submodule, is_linear, num_experts
from hf_tp.adapters.source import hidden_states_passing, returns_tuple
from hf_tp.styles.experts import Role

EXPERT_DIMS = {
    "packed_colwise": (-2, True),
    "colwise": (-2, False),
    "packed_rowwise": (-1, True),
    "rowwise": (-1, False),
}
LINEAR_DIMS = {"colwise": 0, "rowwise": 1}
# A shared expert's projections by HF's names, for plans that list none (Llama's MLP names)
SHARED_EXPERT_STYLES = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def moe_blocks(layer: nn.Module, layer_styles: dict[str, str]) -> list[str]:
    """Layer-level children of ``layer`` that hold an experts module of the plan."""
    out = []
    for path, style in layer_styles.items():
        if style == "moe_tp_experts" and "." in path and has_submodule(layer, path):
            out.append(path.split(".", 1)[0])
    return sorted(set(out))


def region_roles(
    mt: str, config, layer: nn.Module, block: str, layer_styles: dict[str, str], router_classes: tuple[type, ...]
) -> tuple[dict[str, Role], tuple[str, ...], list[tuple[str, int]]]:
    """(parameter -> role, router paths, (path, width) pairs tp must divide) for one MoE block;
    names relative to the block."""
    module = layer.get_submodule(block)
    experts = [
        p[len(block) + 1 :] for p, s in layer_styles.items() if s == "moe_tp_experts" and p.startswith(block + ".")
    ]
    dense_leaf = {p.rsplit(".", 1)[-1]: s for p, s in layer_styles.items() if s in LINEAR_DIMS}
    dense_leaf = {**SHARED_EXPERT_STYLES, **dense_leaf}
    experts_count = num_experts(config)
    roles: dict[str, Role] = {}
    routers = [path for path, sub in module.named_modules() if isinstance(sub, router_classes)]
    widths = []
    for path, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        if not own:
            continue
        full = f"{block}.{path}" if path else block
        prefix = f"{path}." if path else ""
        if path in experts:
            for name, param in own.items():
                transposed = bool(getattr(sub, "is_transposed", False))
                roles[prefix + name] = _expert_role(mt, full, name, param, layer_styles, own, transposed)
                if roles[prefix + name].kind == "shard":
                    size = param.shape[roles[prefix + name].dim] // (2 if roles[prefix + name].packed else 1)
                    widths.append((f"{full}.{name}", size))
        elif is_linear(sub) and (style := layer_styles.get(full) or _shared_style(path, dense_leaf, experts)):
            dim = LINEAR_DIMS[style]
            roles[prefix + "weight"] = Role("shard", dim)
            if sub.bias is not None:
                roles[prefix + "bias"] = Role("shard", 0) if dim == 0 else Role("additive")
            widths.append((full, sub.out_features if dim == 0 else sub.in_features))
        elif isinstance(sub, router_classes) or _is_gate(sub, own, experts_count, config.hidden_size):
            roles.update({prefix + n: Role("replicate") for n in own})
        elif any(path.startswith(r + ".") for r in routers):  # a router's own parts (Ernie's moe_statics)
            roles.update({prefix + n: Role("replicate") for n in own})
        elif all(p.dim() == 1 for p in own.values()):
            roles.update({prefix + n: Role("replicate") for n in own})
        else:
            raise refuse(
                mt,
                f"the MoE block {block} has {full} ({', '.join(f'{n} {tuple(p.shape)}' for n, p in own.items())}), "
                "which the tp plan does not split and is not a router or gate",
            )
    return roles, tuple(routers), widths


def _is_gate(module: nn.Module, own: dict, num_experts: int | None, hidden: int) -> bool:
    """A Linear onto one score per expert or one gate value, or a module holding just such a
    weight ``[experts, hidden]`` (routers not recorded by HF: DeepSeek-V4's hash router)."""
    if is_linear(module):
        return module.out_features in (num_experts, 1)
    weights = [p for p in own.values() if p.dim() == 2]
    return len(weights) == 1 and tuple(weights[0].shape) == (num_experts, hidden)


def _expert_role(
    mt: str, experts: str, name: str, param, layer_styles: dict[str, str], own: dict, transposed: bool
) -> Role:
    """The role of one experts parameter; ``transposed``: weights stored ``[experts, in, out]``
    (transformers' ``is_transposed``), so the output dim is -1, not -2."""
    style = layer_styles.get(f"{experts}.{name}")
    if style is None:
        weight = name[: -len("_bias")] if name.endswith("_bias") else None
        wstyle = layer_styles.get(f"{experts}.{weight}") if weight in own else None
        if wstyle not in EXPERT_DIMS:
            raise refuse(mt, f"the experts parameter {experts}.{name} {tuple(param.shape)} has no split in its tp plan")
        dim, packed = EXPERT_DIMS[wstyle]
        # a bias [experts, out]: split with an output (column) split, added once with an input split
        return Role("shard", 1, packed) if dim == (-1 if transposed else -2) else Role("additive")
    if style not in EXPERT_DIMS or param.dim() != 3:
        raise refuse(mt, f"the experts parameter {experts}.{name} {tuple(param.shape)} has the style '{style}'")
    dim, packed = EXPERT_DIMS[style]
    return Role("shard", param.dim() + dim, packed)


def _shared_style(path: str, dense_leaf: dict[str, str], experts: list[str]) -> str | None:
    """A shared expert's projection: a Linear below a child of the block (not the experts) whose
    leaf name the plan splits in a dense MLP (``gate_proj``, ``up_proj``, ``down_proj``)."""
    if "." not in path or any(path.startswith(e + ".") for e in experts):
        return None
    return dense_leaf.get(path.rsplit(".", 1)[-1])


def router_classes(model: nn.Module, first_output: bool = False) -> tuple[type, ...]:
    """The module classes whose output HF records as ``router_logits`` (``first_output``: only
    those whose first output it records, the logits :class:`hf_tp.styles.MoERegion` scales)."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits")
    out = []
    for item in rec if isinstance(rec, list | tuple) else [rec]:
        cls = getattr(item, "target_class", item)
        if isinstance(cls, type) and not (first_output and getattr(item, "index", 0) != 0):
            out.append(cls)
    return tuple(out)


def moe_region(
    mt: str, config, layer: nn.Module, block: str, layer_styles: dict[str, str], routers: tuple[type, ...]
) -> Region:
    """The :class:`Region` of one MoE block of ``layer``: its parameters' roles, routers and how the
    layer passes it the hidden states."""
    roles, router_paths, widths = region_roles(mt, config, layer, block, layer_styles, routers)
    positional = hidden_states_passing(layer, block)
    if positional is None:
        raise refuse(mt, f"cannot read how {type(layer).__name__}.forward passes hidden states to {block}")
    experts = next(p for p, s in layer_styles.items() if s == "moe_tp_experts" and p.startswith(block + "."))
    return Region(
        roles=roles,
        positional=positional,
        routers=router_paths,
        experts=experts[len(block) + 1 :],
        widths=tuple(widths),
        aux_exact=all(returns_tuple(layer.get_submodule(f"{block}.{r}" if r else block)) for r in router_paths),
    )
