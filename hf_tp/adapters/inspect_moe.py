"""Reading a decoder layer's mixture-of-experts blocks for the generic plan.

A layer-level child holding a module that transformers' plan marks ``moe_tp_experts`` is a MoE
block. hf_tp runs it as one region (:class:`hf_tp.moe.expert_styles.MoERegion`) and gives every
parameter under it a role:

- the experts' 3-D weights: sharded on the intermediate dim their plan style names
  (``packed_colwise``/``colwise``: dim -2, ``packed_rowwise``/``rowwise``: dim -1; packed ones as
  gate and up halves), an expert bias following its weight (sharded when the weight is split on
  its output dim, -1 for experts stored transposed, else added once);
- 3-D weights the plan styles as experts outside the experts module (Inkling's shared experts
  stored as ``[shared, intermediate, hidden]`` stacks): split as experts;
- Linear layers the plan shards (DeepSeek's ``shared_experts.gate_proj``) or whose name the
  plan shards in a dense MLP or in the experts of the same layer (Qwen2-MoE's
  ``shared_expert.gate_proj`` from ``mlp.gate_proj``; MiniMax-M3's packed
  ``shared_experts.gate_up_proj`` from ``experts.gate_up_proj``): column- or row-parallel (a
  packed one as its gate and up halves, each split), a row-parallel bias added once;
- routers and gates (the module whose logits HF records, a Linear onto one score per expert or
  one gate value): replicated;
- vectors (norms inside the block, score-correction biases): replicated; but a norm the block
  returns applied to its combined output (A.X-K1's ``post_mlp_layernorm``) is the region's
  ``output_norm``: the region ends at its input and it runs as a sequence-parallel norm.

Anything else (a Linear the plan does not split and that is not a gate) could add a whole,
unsplit result to a partial sum: refused with its name, never guessed.
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.facts import Region, refuse
from hf_tp.core.forward_source import chunks_in_two, hidden_states_passing, returned_self_call, returns_tuple
from hf_tp.core.module_queries import has_submodule, is_linear, num_experts
from hf_tp.moe.expert_styles import Role

EXPERT_DIMS = {
    "packed_colwise": (-2, True),
    "colwise": (-2, False),
    "packed_rowwise": (-1, True),
    "rowwise": (-1, False),
}
# A Linear's style -> (the dim of its weight a rank slices, packed gate|up halves)
LINEAR_DIMS = {"colwise": (0, False), "rowwise": (1, False), "packed_colwise": (0, True)}
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
    layer_styles = _packed_halves(module, block, experts, layer_styles)
    dense_leaf = {p.rsplit(".", 1)[-1]: s for p, s in layer_styles.items() if s in LINEAR_DIMS}
    dense_leaf = {**SHARED_EXPERT_STYLES, **dense_leaf}
    experts_count = num_experts(config)
    roles: dict[str, Role] = {}
    # a router is a part of the block holding none of its experts: a release that records the MoE
    # block's own output as router_logits (Llama 4 at 5.17: its first output is the hidden states)
    # names no router, whose first output the region would scale
    routers = [
        path
        for path, sub in module.named_modules()
        if isinstance(sub, router_classes) and path and not any(e.startswith(path + ".") for e in experts)
    ]
    widths = []
    norm = output_norm(module, config.hidden_size)
    for path, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        if not own or (norm and path == norm):  # the output norm: outside the region (MoERegion.output_norm)
            continue
        full = f"{block}.{path}" if path else block
        prefix = f"{path}." if path else ""
        if path in experts or _stacked_experts(full, own, layer_styles):
            for name, param in own.items():
                transposed = bool(getattr(sub, "is_transposed", False))
                roles[prefix + name] = _expert_role(mt, full, name, param, layer_styles, own, transposed)
                if roles[prefix + name].kind == "shard":
                    size = param.shape[roles[prefix + name].dim] // (2 if roles[prefix + name].packed else 1)
                    widths.append((f"{full}.{name}", size))
        elif is_linear(sub) and (style := layer_styles.get(full) or _shared_style(path, dense_leaf, experts)):
            dim, packed = LINEAR_DIMS[style]
            roles[prefix + "weight"] = Role("shard", dim, packed)
            if sub.bias is not None:
                roles[prefix + "bias"] = Role("shard", 0, packed) if dim == 0 else Role("additive")
            widths.append((full, (sub.out_features // (2 if packed else 1)) if dim == 0 else sub.in_features))
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


def output_norm(block: nn.Module, hidden: int) -> str:
    """The child norm ``block`` returns applied to its output (``return self.norm(h)``): only
    vectors of the hidden width and no children of its own; "" when there is none."""
    name = returned_self_call(block)
    child = getattr(block, name, None) if name else None
    if not isinstance(child, nn.Module) or next(child.children(), None) is not None:
        return ""
    params = list(child.parameters(recurse=False))
    return name if params and all(tuple(p.shape) == (hidden,) for p in params) else ""


def _packed_halves(module: nn.Module, block: str, experts: list[str], layer_styles: dict[str, str]) -> dict[str, str]:
    """``layer_styles`` with a packed gate|up experts weight that the plan calls plain ``colwise``
    (Inkling's ``gate_up_proj``) read as ``packed_colwise``: its output is twice the intermediate
    width of the experts' row-parallel weight and their forward chunks it in two halves, so a plain
    split would hand one rank the gates and the other the ups."""
    out = dict(layer_styles)
    for path in experts:
        sub = module.get_submodule(path)
        if getattr(sub, "is_transposed", False) or not chunks_in_two(type(sub).forward):
            continue
        own = {f"{block}.{path}.{n}": p for n, p in sub.named_parameters(recurse=False) if p.dim() == 3}
        inter = {p.shape[-1] for n, p in own.items() if layer_styles.get(n) == "rowwise"}
        for name, param in own.items():
            if layer_styles.get(name) == "colwise" and param.shape[-2] in {2 * i for i in inter}:
                out[name] = "packed_colwise"
    return out


def _stacked_experts(full: str, own: dict, layer_styles: dict[str, str]) -> bool:
    """A module outside the plan's experts whose weights are 3-D stacks the plan splits as experts
    (Inkling's shared experts ``[shared, intermediate, hidden]``, styled colwise / rowwise)."""
    return all(p.dim() == 3 and layer_styles.get(f"{full}.{n}") in EXPERT_DIMS for n, p in own.items())


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


def router_classes(model: nn.Module) -> tuple[type, ...]:
    """The module classes whose output HF records as ``router_logits``: the causal LM's, or where
    it declares none, those of the first module that does (its base model: Qwen4-Exp's, Gemma 4's
    router) whose first output it records, the logits :class:`hf_tp.moe.expert_styles.MoERegion` scales
    (Llama 4's base model records its routers' second output, and its causal LM has no aux loss)."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    first_output = not recorders.get("router_logits")
    if first_output:
        found = (getattr(m, "_can_record_outputs", None) or {} for m in model.modules())
        recorders = next((r for r in found if r.get("router_logits")), {})
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
        output_norm=output_norm(layer.get_submodule(block), config.hidden_size),
    )


def layer_experts_region(mt: str, layer: nn.Module, path: str, layer_styles: dict[str, str]) -> Region:
    """Experts the decoder layer calls itself (Gemma 4's MoE layers: its router and experts are the
    layer's own children, called on the flattened tokens): the experts module alone is the region,
    its input and routing gathered from the rank's tokens, its partial output reduce-scattered back
    to them; the router runs per token on the rank's tokens (a plan entry of its own)."""
    module = layer.get_submodule(path)
    if any(True for c in module.children() if any(True for _ in c.parameters())):
        raise refuse(mt, f"the experts {path} that its decoder layer calls itself hold submodules with parameters")
    own = dict(module.named_parameters(recurse=False))
    transposed = bool(getattr(module, "is_transposed", False))
    roles = {n: _expert_role(mt, path, n, p, layer_styles, own, transposed) for n, p in own.items()}
    widths = [
        (f"{path}.{n}", own[n].shape[r.dim] // (2 if r.packed else 1)) for n, r in roles.items() if r.kind == "shard"
    ]
    positional = hidden_states_passing(layer, path)
    if positional is None:
        raise refuse(mt, f"cannot read how {type(layer).__name__}.forward passes hidden states to {path}")
    return Region(roles=roles, positional=positional, routers=(), experts="", widths=tuple(widths), aux_exact=True)


# -- the experts read from the model's own modules ------------------------------------------------
# transformers' experts kernels (``integrations.moe``) call an experts module's first projection
# ``gate_up_proj`` (gate and up packed) or ``up_proj`` (no gate) and its second ``down_proj``; shared
# experts stored as stacks (Inkling's) name them ``gate_proj`` / ``up_proj`` / ``down_proj``.
FIRST_PROJECTIONS = ("gate_up_proj", "up_proj", "gate_proj")
SECOND_PROJECTIONS = ("down_proj",)


def derived_expert_styles(mt: str, config, layer: nn.Module, layer_styles: dict[str, str]) -> dict[str, str]:
    """``layer_styles`` with the layer's routed experts and 3-D expert stacks read from its modules:
    a module holding 3-D weights stacked one per expert (leading dim the config's expert count) is
    the experts (``moe_tp_experts``), its first projection split on its output dim (packed gate|up
    halves when transformers stores them concatenated), ``down_proj`` on its input dim; a sibling in
    the same block holding only 3-D ``*_proj`` stacks (shared experts) the same way.

    transformers' plans (tp before 5.25, ep after) are hints: where the tp plan styles a weight, it
    must split the same dim, else the layer is refused naming both."""
    count = num_experts(config)
    if not count:
        return layer_styles
    out = dict(layer_styles)
    found = [
        path
        for path, sub in layer.named_modules()
        if path and any(p.dim() == 3 and p.shape[0] == count for p in sub.parameters(recurse=False))
    ]
    for path in found:
        if "." in path:  # shared-expert stacks in the same block (Inkling's)
            block = path.split(".", 1)[0]
            for other, sub in layer.get_submodule(block).named_modules():
                full = f"{block}.{other}"
                own = dict(sub.named_parameters(recurse=False))
                if other and full not in found and own and all(p.dim() == 3 for p in own.values()):
                    out.update(_stack_styles(mt, full, sub, layer_styles, routed=False))
        out.update(_stack_styles(mt, path, layer.get_submodule(path), layer_styles, routed=True))
    return out


def _stack_styles(mt: str, path: str, module: nn.Module, hints: dict[str, str], routed: bool) -> dict[str, str]:
    """The styles of one module of 3-D expert weights, ``[experts, out, in]`` or transposed
    ``[experts, in, out]`` (:func:`_transposed`), checked against the tp plan's ``hints``."""
    if getattr(module, "has_post_expert_norm", False):
        raise refuse(mt, f"the experts {path} normalise each expert's output, which a split of its width cannot")
    own = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    out_dim, in_dim = (-1, -2) if _transposed(mt, path, module, own) else (-2, -1)
    styles: dict[str, str] = {}
    for name, param in own.items():
        if name in FIRST_PROJECTIONS:
            packed = name == "gate_up_proj" and _concatenated(module)
            dim = out_dim
        elif name in SECOND_PROJECTIONS:
            packed, dim = False, in_dim
        else:
            raise refuse(
                mt, f"the experts parameter {path}.{name} {tuple(param.shape)} is not a projection hf_tp can split"
            )
        style = ("packed_" if packed else "") + ("colwise" if dim == -2 else "rowwise")
        declared = hints.get(f"{path}.{name}")
        if declared in EXPERT_DIMS and EXPERT_DIMS[declared][0] != dim:
            raise refuse(
                mt,
                f"transformers' tp plan splits {path}.{name} {tuple(param.shape)} as '{declared}', its module "
                f"as '{style}'",
            )
        styles[f"{path}.{name}"] = style
    if routed:
        styles[path] = "moe_tp_experts"
    return styles


def _transposed(mt: str, path: str, module: nn.Module, own: dict) -> bool:
    """Whether the stacks are stored ``[experts, in, out]``: read from how the first projection's
    and ``down_proj``'s shapes chain (the first reads what ``down_proj`` writes, and writes one or,
    packed, two of what it reads); transformers' ``is_transposed`` decides only where both readings
    chain (square weights). Llama 4's experts are transposed without saying so."""
    flag = bool(getattr(module, "is_transposed", False))
    first = next((own[n] for n in FIRST_PROJECTIONS if n in own), None)
    down = next((own[n] for n in SECOND_PROJECTIONS if n in own), None)
    if first is None or down is None:
        return flag
    k = 2 if "gate_up_proj" in own and getattr(module, "has_gate", True) else 1
    plain = first.shape[-1] == down.shape[-2] and first.shape[-2] == k * down.shape[-1]
    transposed = first.shape[-2] == down.shape[-1] and first.shape[-1] == k * down.shape[-2]
    if not plain and not transposed:
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own.items())
        raise refuse(mt, f"the experts {path} have projections whose shapes do not chain ({shapes})")
    return transposed if plain != transposed else flag


def _concatenated(module: nn.Module) -> bool:
    """A packed gate_up_proj stores the gates then the ups (split as two halves), not interleaved
    pairs (GPT-OSS's, which a contiguous split keeps together): transformers' ``is_concatenated``
    where the release marks it, else the forward chunking the output in two."""
    flag = getattr(module, "is_concatenated", None)
    return bool(flag) if flag is not None else chunks_in_two(type(module).forward)
