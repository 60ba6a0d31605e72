"""Reading a HF causal LM for the generic plan: its decoder layers, the modules around them, and
the plan transformers gives them (:class:`hf_tp.adapters.facts.Derivation`).

Hand-written, because nothing in torch or transformers answers these questions: transformers'
``base_model_tp_plan`` names only the projections, and its TP integration needs no SP (it never
asks where the residual stream's norms are or how a layer calls its blocks). One layer is read by
:mod:`hf_tp.adapters.inspect_layer`; this module reads every kind of layer, merges them into one
plan and reads the top level (embedding, final norms, lm_head).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from hf_tp.adapters.facts import Derivation, Region, refuse
from hf_tp.adapters.inspect_layer import head_dim_of, layer_facts
from hf_tp.adapters.inspect_moe import router_classes
from hf_tp.adapters.mixers import per_kind_blocks
from hf_tp.core.forward_source import first_param, plain_logits, returned_self_call
from hf_tp.core.module_queries import has_submodule, is_linear, is_norm, stream_mixers


def inspect_model(model: nn.Module, tp_plan: dict[str, str]) -> Derivation:
    """The :class:`Derivation` of ``model`` (a ``*ForCausalLM``, possibly on the meta device)."""
    config = model.config
    mt = config.model_type
    prefix = base_model_path(model)
    # hyper-connections: the streams' final mix sits beside the layers, each layer mixes them too
    top_mixers = [f"{prefix}.{name}" for name in stream_mixers(model.get_submodule(prefix), config.hidden_size)]
    layers_path, layer_styles = _layer_styles(model, tp_plan, top_mixers)
    layers = model.get_submodule(layers_path)
    # parameter names and module classes -> first layer of that kind (DeepSeek-V4's hash-routed and
    # learned-router MoE layers have the same parameters; only the latter's router logits are recorded)
    kinds: dict[tuple, nn.Module] = {}
    for layer in layers:
        names = tuple(n for n, _ in layer.named_parameters())
        kinds.setdefault((names, tuple(type(m).__name__ for m in layer.modules())), layer)
    routers = router_classes(model)  # the logits HF records for the aux loss
    facts = [layer_facts(mt, config, layer, layer_styles, routers, bool(top_mixers)) for layer in kinds.values()]
    mixers = per_kind_blocks(mt, facts, list(kinds.values()))  # blocks whose kind changes by layer
    merged = {key: _merge(mt, key, [f[key] for f in facts]) for key in facts[0]}
    _norms_run_as_blocks(mt, merged, list(kinds.values()))
    top = _top_level(model, layers_path, config.hidden_size, top_mixers)
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
        **{k: tuple(v) if isinstance(v, list) else v for k, v in top.items()},
        # the fused loss runs get_decoder(): it must be the base model (Llama 4's returns the whole model)
        plain_lm_head=plain_logits(model, top["lm_head"])
        and model.get_decoder() is model.get_submodule(base_model_path(model)),
        widths=tuple(widths),
        kv_vary=_kv_vary(layers, merged["kv"], config),
        hidden_size=config.hidden_size,
        mixers=mixers,
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
                have = out.setdefault(name, item)
                if key == "regions" and have != item:  # routers recorded in some layers only
                    item = _same_region_but_routers(have, item)
                    out[name] = item or have
                if out[name] != item:
                    raise refuse(mt, f"its layer kinds treat {name} differently ({key})")
        return out
    return sorted({item for value in values for item in value})


def _same_region_but_routers(a: Region, b: Region) -> Region | None:
    """One MoE region for two layer kinds that differ only in which routers HF records (DeepSeek-V4's
    hash-routed layers record none): the union, each layer scaling the aux-loss gradient of the
    routers it has (a router whose logits nothing records gets none)."""
    if replace(a, routers=(), aux_exact=True) != replace(b, routers=(), aux_exact=True):
        return None
    return replace(a, routers=tuple(sorted({*a.routers, *b.routers})), aux_exact=a.aux_exact and b.aux_exact)


def _norms_run_as_blocks(mt: str, merged: dict, layers: list[nn.Module]) -> None:
    """A layer-level module that is a plain norm in one layer kind and a block in another (AXK2's
    gated norm on its MoE layers) runs as the block in every layer: whole on the gathered sequence,
    its norm's parameters replicated with the block's own."""
    for path in [p for p in merged["layer_norms"] if p in merged["blocks"]]:
        if not merged["blocks"][path].replicated:
            raise refuse(mt, f"{path} is a norm in some decoder layers and a sharded block in others")
        names = set(merged["region_params"].get(path, ()))
        for layer in layers:
            if has_submodule(layer, path):
                names |= {n for n, _ in layer.get_submodule(path).named_parameters(recurse=False)}
        merged["region_params"][path] = tuple(sorted(names))
        merged["layer_norms"].remove(path)


def _layer_styles(model: nn.Module, tp_plan: dict[str, str], mixers: list[str]) -> tuple[str, dict[str, str]]:
    """The layers' ModuleList path and the plan relative to one layer. Entries inside the
    hyper-connection ``mixers`` (model-relative) are left out: they run whole on sequence shards."""
    mt = model.config.model_type
    # transformers >= 5.24 names the input embedding in some plans (vocab-sharded or replicated):
    # hf_tp's top plan shards it over the vocab anyway, handing sequence shards to the layers
    embed = model.get_input_embeddings()
    prefix = base_model_path(model)
    base = model.get_submodule(prefix)
    embed_path = next((n for n, m in base.named_modules() if m is embed), None)
    inside = tuple(m.removeprefix(prefix + ".") + "." for m in mixers)
    outside = sorted(k for k in tp_plan if ".*." not in k and k != embed_path and not k.startswith(inside))
    if outside:
        raise refuse(mt, f"its tp plan shards modules outside the decoder layers ({', '.join(outside)})")
    lists = {k.split(".*.", 1)[0] for k in tp_plan if ".*." in k}
    if not lists:
        raise refuse(mt, "its tp plan shards only the embedding (transformers leaves its decoder layers whole)")
    if len(lists) != 1:
        raise refuse(mt, f"its tp plan covers several layer lists ({', '.join(sorted(lists))})")
    layers_path = f"{prefix}.{lists.pop()}"
    try:
        layers = model.get_submodule(layers_path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise refuse(mt, f"no decoder layers at '{layers_path}'")
    return layers_path, {k.split(".*.", 1)[1]: v for k, v in tp_plan.items() if ".*." in k}


def base_model_path(model: nn.Module) -> str:
    """Where the base model (the module the tp plan's paths start from) sits: ``base_model_prefix``
    where the model has it, else the module holding the input embedding (Llama 4's text model
    declares ``language_model`` as its prefix but keeps its decoder at ``model``)."""
    prefix = model.base_model_prefix
    if has_submodule(model, prefix):
        return prefix
    embed = model.get_input_embeddings()
    path = next((n for n, m in model.named_modules() if m is embed), "")
    if "." not in path:
        raise refuse(model.config.model_type, f"its base model is neither at '{prefix}' nor holds the input embedding")
    return path.rpartition(".")[0]


def _top_level(model: nn.Module, layers_path: str, hidden: int, mixers: list[str]) -> dict:
    """Paths of the input embedding, the lm_head, and what else sits outside the layers: norms,
    further token embeddings and per-token Linears (Gemma 4's per-layer embeddings and their
    projection, which feed every layer a sequence-sharded input of its own), hyper-connection
    ``mixers`` (found by the caller)."""
    mt = model.config.model_type
    paths = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed) is not nn.Embedding and not isinstance(embed, nn.Embedding):
        raise refuse(mt, f"its input embedding is a {type(embed).__name__}, not an nn.Embedding")
    if head is None or not is_linear(head):
        raise refuse(mt, "it has no nn.Linear output embedding (lm_head)")
    embedding, lm_head = paths[id(embed)], paths[id(head)]
    owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    skip = tuple(f"{p}." for p in [layers_path, *mixers])
    owners = {o for o in owners if o not in (embedding, lm_head, *mixers) and not o.startswith(skip)}
    module = {o: model.get_submodule(o) if o else model for o in owners}
    embeddings = sorted(o for o in owners if o and isinstance(module[o], nn.Embedding))
    # an embedding whose forward takes no token ids (OPT's positions, read off the attention mask)
    positions = [o for o in embeddings if first_param(type(module[o]).forward) not in ("input", "input_ids")]
    embeddings = [o for o in embeddings if o not in positions]
    linears = sorted(o for o in owners if o and is_linear(module[o]))
    extra = {module[o].embedding_dim for o in embeddings} | {module[o].out_features for o in linears}
    norms = sorted(o for o in owners if o and any(is_norm(module[o], w) for w in {hidden} | _parts(extra)))
    for owner in sorted(owners - set(embeddings) - set(positions) - set(linears) - set(norms)):
        name = next(n for n, _ in module[owner].named_parameters(recurse=False))
        where = f"{owner}.{name}" if owner else name
        raise refuse(mt, f"the parameter {where} outside the decoder layers has no place in a TP plan")
    base = model.get_submodule(layers_path.rpartition(".")[0]) if "." in layers_path else model
    # a fixed position table (XGLM's sinusoids): no parameters, a buffer of hidden-size rows
    tables = [
        f"{paths[id(base)]}.{name}".lstrip(".")
        for name, child in base.named_children()
        if not any(True for _ in child.parameters())
        and any(b.dim() == 2 and b.shape[-1] == hidden for b in child.buffers())
    ]
    own_norm = returned_self_call(embed) or ""  # the embedding's forward ends in a norm of its own
    return dict(
        embedding=embedding,
        embedding_norm=own_norm if f"{embedding}.{own_norm}" in norms else "",
        lm_head=lm_head,
        top_norms=norms,
        top_embeddings=embeddings,
        top_positions=positions + tables,
        top_position_weights=positions,
        top_linears=linears,
        top_mixers=mixers,
    )


def _parts(widths: set[int]) -> set[int]:
    """The widths of the further embeddings and Linears and their exact parts (a norm over one
    layer's slice of Gemma 4's packed per-layer input)."""
    return {d for w in widths for d in range(2, w + 1) if w % d == 0}


def _kv_vary(layers: nn.ModuleList, kv: list[str], config) -> bool:
    """The K/V projections' widths in units of each layer's head_dim differ between layers: the KV
    head count changes by layer (MiMo-V2-Flash's sliding-window layers double it)."""
    counts = [
        {e.get_submodule(p).out_features // head_dim_of(e, config) for e in layers if has_submodule(e, p)} for p in kv
    ]
    return any(len(c) > 1 for c in counts)
