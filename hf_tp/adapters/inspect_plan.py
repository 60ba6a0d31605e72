"""The projections' tp styles read off a model that transformers gives no ``base_model_tp_plan``.

For OPT, GPT-Neo, StableLM, Persimmon and the other decoders transformers cannot
tensor-parallelize, the plan the generic derivation starts from is read from the modules and their forwards, in
transformers' own style names: in each module that holds a decoder layer's ``nn.Linear``s, the
one called last whose output is ``hidden_size`` wide folds the block back into the residual
(``rowwise``); the others read the hidden states (``colwise``). Attention is the block whose
row-parallel input is heads x head_dim wide and whose column-parallel outputs are q (heads x
head_dim) and k/v (kv heads x head_dim) wide: its own head counts (``self.num_heads`` that its
code reshapes with) become the rank's (``local_head_counts``). An MLP's column outputs are its
row-parallel input (the intermediate size). A q/k/v projection the forward views as
``(self.num_heads, 3, head_dim)`` is packed head by head (Persimmon) and splits with the heads.
What a contiguous column split would get wrong is refused naming it: a fused q/k/v or gate|up
projection in an order the forward does not show, a transposed ``Conv1D``, ALiBi slopes built for
every head, norms held one per head, cross-attention over an encoder's states.
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.facts import refuse
from hf_tp.adapters.inspect_layer import LOCAL_COUNTS, head_count_attributes, head_dim_of
from hf_tp.adapters.inspect_model import base_model_path
from hf_tp.core.forward_source import cross_attention_children, first_calls, names_containing, views_heads_then_three
from hf_tp.core.module_queries import has_submodule, is_linear


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """A ``base_model_tp_plan`` for ``model`` (a ``*ForCausalLM``) read from its decoder layers."""
    config = model.config
    mt = config.model_type
    base = model.get_submodule(base_model_path(model))
    if getattr(config, "alibi", True) and names_containing(type(base), "alibi"):
        raise refuse(
            mt,
            "it adds ALiBi biases built for every attention head in the base model, which a head split would "
            "have to slice per rank",
        )
    layers = _layer_list(mt, base, config)
    plan: dict[str, str] = {}
    seen: set[type] = set()
    for layer in base.get_submodule(layers):
        if type(layer) not in seen:
            seen.add(type(layer))
            plan.update({f"{layers}.*.{p}": s for p, s in layer_tp_styles(mt, config, layer).items()})
    return plan


def _layer_list(mt: str, base: nn.Module, config) -> str:
    """The path (in the base model) of the one ``ModuleList`` of ``num_hidden_layers`` decoder layers."""
    n = getattr(config, "num_hidden_layers", None)
    found = [
        path
        for path, m in base.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == n and n and all(any(True for _ in c.parameters()) for c in m)
    ]
    found = [p for p in found if not any(p.startswith(f"{q}.") for q in found)]  # not lists inside the layers
    if len(found) != 1:
        raise refuse(mt, f"no single list of its {n} decoder layers in its base model (found {found or 'none'})")
    return found[0]


def layer_tp_styles(mt: str, config, layer: nn.Module) -> dict[str, str]:
    """One decoder layer's projections, paths relative to it (see the module docstring)."""
    if cross := [c for c in cross_attention_children(type(layer).forward) if has_submodule(layer, c)]:
        raise refuse(
            mt,
            f"its decoder layer calls {', '.join(cross)} with an encoder's states (cross-attention), which the "
            "plan does not place",
        )
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    fused = _fused_widths(heads, kv, head_dim_of(layer, config))
    for path, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and not is_linear(module):
            kind = type(module).__name__
            what = f"a {kind}, an nn.Linear with a forward of its own" if isinstance(module, nn.Linear) else f"a {kind}"
            what += " (GPT-2's Conv1D stores its weight transposed)" if kind == "Conv1D" else ""
            qkv = (
                "; it packs q, k and v, whose interleaving a module does not show" if set(weight.shape) & fused else ""
            )
            raise refuse(mt, f"{path} is {what}, not a plain nn.Linear the plan can split{qkv}")
    owners: dict[str, list[str]] = {}
    for path, module in layer.named_modules():
        if is_linear(module):
            owners.setdefault(path.rpartition(".")[0], []).append(path)
    styles: dict[str, str] = {}
    for owner, paths in owners.items():
        styles.update(_owner_styles(mt, config, layer, owner, paths))
    return styles


def _owner_styles(mt: str, config, layer: nn.Module, owner: str, paths: list[str]) -> dict[str, str]:
    """The styles of the Linears ``paths`` held by the module ``owner`` (an attention or an MLP)."""
    module = layer.get_submodule(owner) if owner else layer
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_dim_of(layer, config)
    order = first_calls(type(module).forward)
    names = {p: p.rpartition(".")[2] for p in paths}
    if any(n not in order for n in names.values()):
        missing = ", ".join(p for p, n in names.items() if n not in order)
        raise refuse(mt, f"{type(module).__name__}.forward does not call {missing} itself, so its order is unread")
    linear = {p: layer.get_submodule(p) for p in paths}
    outs = [p for p in paths if linear[p].out_features == hidden]
    if len(paths) < 2 or not outs:
        raise refuse(mt, f"{owner} holds {', '.join(paths)}: no pair of projections into and out of the hidden size")
    row = max(outs, key=lambda p: order[names[p]])
    columns = [p for p in paths if p != row]
    inner = linear[row].in_features
    packed = 3 * heads * head_dim  # q, k and v in one projection, packed head by head: split as the heads
    per_head = any(linear[p].out_features == packed for p in columns) and views_heads_then_three(
        type(module), head_count_attributes(module, config, head_dim)
    )
    attention = inner == heads * head_dim and (len(columns) >= 3 or per_head) and owner != ""
    allowed = {heads * head_dim, kv * head_dim} | ({packed} if per_head else set()) if attention else {inner}
    for p in columns:
        width = linear[p].out_features
        if linear[p].in_features != hidden or width not in allowed:
            what = (
                "a fused q/k/v projection (how q, k and v interleave in its columns, per head or per tensor, is not "
                "readable from the module; a contiguous split would mix them)"
                if width in _fused_widths(heads, kv, head_dim)
                else "a fused gate|up projection"
                if width == 2 * inner
                else f"neither a head projection nor an MLP's up projection ({linear[p].in_features} -> {width} "
                f"features, {row} takes {inner})"
            )
            raise refuse(mt, f"{p} is {what}")
    styles = {p: "colwise" for p in columns} | {row: "rowwise"}
    if attention:
        _check_per_head_modules(mt, module, owner, heads, kv)
        if head_count_attributes(module, config, head_dim):
            styles[owner] = LOCAL_COUNTS
    return styles


def _fused_widths(heads: int, kv: int, head_dim: int) -> set[int]:
    """The widths of q, k and v packed in one projection: with the KV heads, multi-query (one KV
    head) or as many KV heads as query heads."""
    return {(heads + 2 * kv) * head_dim, (heads + 2) * head_dim, 3 * heads * head_dim}


def _check_per_head_modules(mt: str, module: nn.Module, owner: str, heads: int, kv: int) -> None:
    """Refuse modules held one per head (StableLM's per-head LayerNorms): a rank's local head i is
    not the model's head i, so a head split would apply the wrong one."""
    for path, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) in (heads, kv) and any(True for _ in child.parameters()):
            raise refuse(
                mt,
                f"{owner}.{path} holds one module per attention head, which a head split would pair with the "
                "wrong heads",
            )
