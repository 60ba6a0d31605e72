"""Reading a HF causal LM for the generic plan: its decoder layers, the modules around them, and
the plan transformers gives them (:class:`hf_tp.adapters.facts.Derivation`).

Hand-written, because nothing in torch or transformers answers these questions: transformers'
``base_model_tp_plan`` names only the projections, and its TP integration needs no SP (it never
asks where the residual stream's norms are or how a layer calls its blocks). One layer is read by
:mod:`hf_tp.adapters.inspect_layer`; this module reads every kind of layer, merges them into one
plan and reads the top level (embedding, final norms, lm_head).
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.facts import Derivation, refuse
from hf_tp.adapters.inspect_layer import layer_facts
from hf_tp.adapters.inspect_moe import router_classes
from hf_tp.adapters.modules import has_submodule, is_linear, is_norm
from hf_tp.adapters.source import plain_logits


def inspect_model(model: nn.Module, tp_plan: dict[str, str]) -> Derivation:
    """The :class:`Derivation` of ``model`` (a ``*ForCausalLM``, possibly on the meta device)."""
    config = model.config
    mt = config.model_type
    layers_path, layer_styles = _layer_styles(model, tp_plan)
    layers = model.get_submodule(layers_path)
    kinds: dict[tuple[str, ...], nn.Module] = {}  # parameter names -> first layer of that kind
    for layer in layers:
        kinds.setdefault(tuple(n for n, _ in layer.named_parameters()), layer)
    routers = router_classes(model)
    facts = [layer_facts(mt, config, layer, layer_styles, routers) for layer in kinds.values()]
    merged = {key: _merge(mt, key, [f[key] for f in facts]) for key in facts[0]}
    embedding, top_norms, lm_head = _top_level(model, layers_path, config.hidden_size)
    widths = []  # layers may differ in size (Gemma 4's full-attention layers have wider heads)
    for i, each in enumerate(layers):
        present = [p for p in merged["colwise"] + merged["rowwise"] if has_submodule(each, p)]
        widths += [
            (f"{layers_path}.{i}.{p}", _split_width(each.get_submodule(p), p in merged["colwise"])) for p in present
        ]
    # K/V projections may be replicated (tp > KV heads); gathered ones may be split unevenly (their
    # output is all-gathered whole, as the vocab-sharded lm_head's: DTensor pads uneven shards)
    loose = merged["kv"] + merged["gathered"]
    widths = [(path, w) for path, w in widths if not any(path.endswith("." + k) for k in loose)]
    widths += [(f"{layers_path}.*.{p}", w) for region in merged["regions"].values() for p, w in region.widths]
    return Derivation(
        model_type=mt,
        layers_path=layers_path,
        **{k: tuple(v) if isinstance(v, list) else v for k, v in merged.items()},
        embedding=embedding,
        top_norms=tuple(top_norms),
        lm_head=lm_head,
        plain_lm_head=plain_logits(model, lm_head),
        widths=tuple(widths),
    )


def _split_width(linear: nn.Linear, column: bool) -> int:
    return linear.out_features if column else linear.in_features


def _merge(mt: str, key: str, values: list):
    """One plan for every layer kind (hybrid models mix attention with linear-attention layers):
    the union of their entries, which must agree where they name the same module."""
    if key == "region_params":  # a whole block's parameters: the union (each layer views those it has)
        names: dict = {}
        for value in values:
            for name, item in value.items():
                names[name] = tuple(sorted(set(names.get(name, ())) | set(item)))
        return names
    if isinstance(values[0], dict):
        out: dict = {}
        for value in values:
            for name, item in value.items():
                if out.setdefault(name, item) != item:
                    raise refuse(mt, f"its layer kinds treat {name} differently ({key})")
        return out
    return sorted({item for value in values for item in value})


def _layer_styles(model: nn.Module, tp_plan: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The layers' ModuleList path and the plan relative to one layer."""
    mt = model.config.model_type
    # transformers >= 5.24 names the input embedding in some plans (vocab-sharded or replicated):
    # hf_tp's top plan shards it over the vocab anyway, handing sequence shards to the layers
    embed = model.get_input_embeddings()
    base = model.get_submodule(model.base_model_prefix) if has_submodule(model, model.base_model_prefix) else model
    embed_path = next((n for n, m in base.named_modules() if m is embed), None)
    outside = sorted(k for k in tp_plan if ".*." not in k and k != embed_path)
    if outside:
        raise refuse(mt, f"its tp plan shards modules outside the decoder layers ({', '.join(outside)})")
    lists = {k.split(".*.", 1)[0] for k in tp_plan if ".*." in k}
    if not lists:
        raise refuse(mt, "its tp plan shards only the embedding (transformers leaves its decoder layers whole)")
    if len(lists) != 1:
        raise refuse(mt, f"its tp plan covers several layer lists ({', '.join(sorted(lists))})")
    layers_path = f"{model.base_model_prefix}.{lists.pop()}"
    try:
        layers = model.get_submodule(layers_path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise refuse(mt, f"no decoder layers at '{layers_path}'")
    return layers_path, {k.split(".*.", 1)[1]: v for k, v in tp_plan.items() if ".*." in k}


def _top_level(model: nn.Module, layers_path: str, hidden: int) -> tuple[str, list[str], str]:
    """Paths of the input embedding, the hidden-size norms outside the layers, and the lm_head."""
    mt = model.config.model_type
    paths = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed) is not nn.Embedding and not isinstance(embed, nn.Embedding):
        raise refuse(mt, f"its input embedding is a {type(embed).__name__}, not an nn.Embedding")
    if head is None or not is_linear(head):
        raise refuse(mt, "it has no nn.Linear output embedding (lm_head)")
    embedding, lm_head = paths[id(embed)], paths[id(head)]
    norms = set()
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in (embedding, lm_head) or owner.startswith(layers_path + "."):
            continue
        module = model.get_submodule(owner) if owner else model
        if not owner or not is_norm(module, hidden):
            raise refuse(mt, f"the parameter {name} outside the decoder layers has no place in a TP plan")
        norms.add(owner)
    return embedding, sorted(norms), lm_head
