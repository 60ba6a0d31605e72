"""Reading one decoder layer for the generic plan: which projections, norms, blocks and experts
it has, and how the layer calls them (the fields of :class:`hf_tp.adapters.facts.Derivation`).

Every rule here either places a parameter or refuses with the module's name
(:func:`hf_tp.adapters.facts.refuse`); a parameter left over is an error, never a guess.
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.facts import Block, refuse
from hf_tp.adapters.inspect_moe import derived_expert_styles, layer_experts_region, moe_blocks, moe_region
from hf_tp.compat.torch_internals import own_attribute
from hf_tp.core.forward_source import edits_in_place, hidden_states_passing, reshapes, self_attributes
from hf_tp.core.module_queries import expert_holders, has_submodule, is_linear, is_norm, shapes, stream_mixers

# transformers' gathered styles and the plain one each amounts to, the gathered region aside
GATHERED = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}
LOCAL_COUNTS = "local_head_counts"  # hf_tp's style: an attention module's own head counts become the rank's


def layer_facts(
    mt: str, config, layer: nn.Module, layer_styles: dict[str, str], routers: tuple, streams: bool = False
) -> dict:
    """What the plan needs from one decoder layer (see :class:`Derivation` for the fields);
    ``routers``: the classes whose logits HF records (:func:`router_classes`); ``streams``: the
    residual has hyper-connection streams (the model mixes them at the top)."""
    mixers = _mixers(mt, layer, config.hidden_size, streams)
    layer_styles = derived_expert_styles(mt, config, layer, layer_styles)  # the plan's experts are hints
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in mixers}
    # Multi-head latent attention (DeepSeek's low-rank q/kv projections) runs whole on every rank:
    # its shared latent and rotary key feed every head, which a head split cannot express locally.
    mla = {p.split(".", 1)[0] for p, s in layer_styles.items() if s == "mla_kv_a_proj"}
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in mla}
    moe = moe_blocks(layer, layer_styles)
    # experts the layer calls itself (Gemma 4): a region of their own; the router and the layer's
    # norms then run per token on the rank's tokens (the layer flattens them for router and experts)
    own = [p for p, s in layer_styles.items() if s == "moe_tp_experts" and "." not in p and has_submodule(layer, p)]
    own_regions = {p: layer_experts_region(mt, layer, p, layer_styles) for p in own}
    layer_routers = [n for n, c in layer.named_children() if own and routers and isinstance(c, routers)]
    if own and not layer_routers:
        raise refuse(
            mt, f"its routed experts ({own[0]}) are called by the decoder layer itself, with no router it records"
        )
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in own}
    if not moe and not own and (holders := expert_holders(layer, config)):
        raise refuse(
            mt,
            f"its routed experts in {holders[0]} are not weights stacked one per expert (3-D, the config's expert "
            "count first), the layout hf_tp reads and splits",
        )
    regions = {b: moe_region(mt, config, layer, b, layer_styles, routers) for b in moe} | own_regions
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in moe}
    head_dim = head_dim_of(layer, config)
    facts = _plan_entries(mt, config, layer, layer_styles, head_dim)
    facts.update(_kv_projections(config, layer, facts["colwise"], facts["gathered"], head_dim))
    skip = set(moe) | set(own) | set(layer_routers) | set(mixers)
    blocks = _blocks(mt, layer, facts, config.hidden_size, skip=skip)
    facts.update(_unplanned(layer, blocks, facts, head_dim))
    planned = facts.pop("planned")
    # Linears the layer calls itself on the residual stream (Gemma 4's per-layer input gate): per token
    linears = [
        n for n, child in layer.named_children() if is_linear(child) and n not in blocks and n not in skip | planned
    ]
    norms = _layer_norms(mt, layer, planned | skip | set(linears), blocks, config.hidden_size)
    # the layer runs an MLP itself and reshapes (OPT flattens its tokens around fc1 / fc2): its norms,
    # as those of a layer calling its own experts, run per token (SequenceParallel would re-split them)
    inline = any("." not in p for p in facts["rowwise"]) and reshapes(type(layer).forward)
    per_token = bool(own) or inline
    facts.update(
        flattening=[type(layer).__name__] if inline else [],
        layer_linears=linears + layer_routers + (norms if per_token else []),
        layer_mixers=mixers,
        layer_norms=[] if per_token else norms,
        blocks=blocks,
        regions=regions,
    )
    return facts


def _mixers(mt: str, layer: nn.Module, hidden: int, streams: bool) -> list[str]:
    """The layer's hyper-connection mixers (:func:`stream_mixers`), when the residual has streams,
    each called with the residual first."""
    if not streams:
        return []
    found = stream_mixers(layer, hidden)
    for name in found:
        if not hidden_states_passing(layer, name):
            raise refuse(mt, f"cannot read that {type(layer).__name__}.forward passes the residual first to {name}")
    return sorted(found)


def _plan_entries(mt: str, config, layer: nn.Module, layer_styles: dict[str, str], head_dim: int) -> dict:
    """The plan's own entries, checked against the modules they name: projections, per-head and
    full-width norms, per-head parameters (attention sinks)."""
    colwise, rowwise, head_norms, width_norms, head_params, gathered, counts = [], [], [], [], {}, [], {}
    for path, style in sorted(layer_styles.items(), key=lambda item: item[1] == "width_norm"):  # norms last
        try:
            module = layer.get_submodule(path)
        except AttributeError:
            continue  # the plan names a module this layer does not build (e.g. q_norm when off)
        if style in ("colwise", "rowwise", *GATHERED):
            if not is_linear(module):
                raise refuse(mt, f"{path} is {style} in its tp plan but a {type(module).__name__}, not an nn.Linear")
            (colwise if GATHERED.get(style, style) == "colwise" else rowwise).append(path)
            if style in GATHERED:
                gathered.append(path)
        elif style == "replicated_with_grad_allreduce":
            if not is_norm(module, head_dim):
                raise refuse(mt, f"{path} is a norm over more than one head ({shapes(module)}, head_dim {head_dim})")
            head_norms.append(path)
        elif style == "local_params":  # the module's own per-head parameters (attention sinks)
            own = dict(module.named_parameters(recurse=False))
            if not own and any(True for _ in module.children()):
                continue  # a layer kind without them (MiMo-V2-Flash's full-attention layers have no sinks)
            if not own or any(p.dim() < 1 or p.shape[0] != config.num_attention_heads for p in own.values()):
                raise refuse(mt, f"{path}'s own parameters ({shapes(module)}) are not one entry per attention head")
            head_params[path] = tuple(own)
        elif style == LOCAL_COUNTS:
            counts[path] = head_count_attributes(module, config, head_dim)
        elif style == "width_norm":
            widths = {layer.get_submodule(p).out_features for p in colwise}
            if not any(is_norm(module, w) for w in widths):
                raise refuse(mt, f"{path} is a width_norm but not a norm over a column-parallel output")
            width_norms.append(path)
        else:
            raise refuse(mt, f"its tp plan gives {path} the style '{style}', which the generic plan does not translate")
    return dict(
        colwise=colwise,
        rowwise=rowwise,
        gathered=gathered,
        head_norms=head_norms,
        width_norms=width_norms,
        head_params=head_params,
        head_counts=counts,
    )


def _kv_projections(config, layer: nn.Module, colwise: list[str], gathered: list[str], head_dim: int) -> dict:
    """``kv``: the K/V projections (replicated when tp > KV heads); ``kv_bound``: every sharded
    projection whose shards follow the KV heads: separate k/v, or q/k/v packed in one inside an
    attention module (by size alone an MLP's width could pass for it). With none, the attention runs
    whole (gathered or replicated) and tp needs no relation to the KV heads."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sharded = [p for p in colwise if p not in gathered and kv_heads != heads]
    width = {p: layer.get_submodule(p).out_features for p in sharded}
    # values may have their own head size (MiMo-V2-Flash's v_head_dim)
    dims = {head_dim} | {v for m in layer.modules() if isinstance(v := own_attribute(m, "v_head_dim"), int)}
    kv = [p for p in sharded if width[p] in {kv_heads * d for d in dims}]
    packed = [
        p
        for p in sharded
        if width[p] == (heads + 2 * kv_heads) * head_dim
        and "att" in type(layer.get_submodule(p.split(".", 1)[0])).__name__.lower()
    ]
    return dict(kv=kv, kv_bound=kv + packed)


def _unplanned(layer: nn.Module, blocks: dict, facts: dict, head_dim: int) -> dict:
    """What the plan leaves out inside the blocks: norms over ``head_dim``, activations with learned
    scalars, and the parameters of blocks that run whole; plus every placed module (``planned``).

    Blocks that run whole on every rank (replicated ones, and those whose projections are all
    gathered: the region between them is whole too) compute their parameters' full gradient on
    every rank, so all of them are replicated (a per-head or width rule there would sum over tp)."""
    projections = facts["colwise"] + facts["rowwise"]
    whole = {b for b in blocks if all(p in facts["gathered"] for p in projections if p.startswith(b + "."))}
    inside = lambda path: path.split(".", 1)[0] in whole  # noqa: E731
    head_norms = [p for p in facts["head_norms"] if not inside(p)]
    width_norms = [p for p in facts["width_norms"] if not inside(p)]
    head_params = {p: n for p, n in facts["head_params"].items() if not inside(p)}
    planned = set(projections + head_norms + width_norms) | set(head_params)
    sharded = {b: blk for b, blk in blocks.items() if b not in whole}
    head_norms += _head_dim_norms(layer, sharded, planned, head_dim)
    activations = _activations(layer, sharded, planned | set(head_norms))
    region = {b: names for b in sorted(whole) if (names := _own_params(layer, b, planned))}
    planned |= set(head_norms) | set(activations)
    planned |= {f"{b}.{n}".rpartition(".")[0] for b, names in region.items() for n in names}
    return dict(
        head_norms=head_norms,
        width_norms=width_norms,
        head_params=head_params,
        activations=activations,
        region_params=region,
        planned=planned,
    )


def _own_params(layer: nn.Module, block: str, planned: set[str]) -> tuple[str, ...]:
    """Parameters under ``block`` outside the plan, as dotted names relative to the block (the
    block's code may read a submodule's weight itself: ``self.conv1d.weight``)."""
    out = []
    for path, module in layer.get_submodule(block).named_modules(prefix=block):
        if path not in planned:
            rel = path[len(block) + 1 :]
            out += [f"{rel}.{n}" if rel else n for n, _ in module.named_parameters(recurse=False)]
    return tuple(out)


def head_count_attributes(module: nn.Module, config, head_dim: int) -> tuple[str, ...]:
    """The integer attributes of an attention ``module`` that its class's code reads and that count
    heads (``num_heads``, ``num_key_value_heads``, ``all_head_size``) or the width of all heads
    (``embed_dim``): what must become the rank's own under a head split. Not sizes per head
    (``head_dim``, ``rotary_ndims``), which may equal a count by chance."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    found = []
    for name in sorted(self_attributes(type(module))):
        value = own_attribute(module, name)
        if type(value) is not int:
            continue
        if ("head" in name and "dim" not in name and value in {heads, kv, heads * head_dim, kv * head_dim}) or (
            name in ("embed_dim", "hidden_size") and value == heads * head_dim
        ):
            found.append(name)
    return tuple(found)


def head_dim_of(layer: nn.Module, config) -> int:
    """The attention's own ``head_dim`` (it may differ per layer: Gemma 4 reads it from per-layer
    configs and refuses the global one), else the config's, else hidden / heads."""
    for module in layer.modules():
        value = own_attribute(module, "head_dim")
        if isinstance(value, int):
            return value
    try:
        value = getattr(config, "head_dim", None)
    except Exception:  # noqa: BLE001 - transformers raises its own error for per-layer attributes
        value = None
    return value or config.hidden_size // config.num_attention_heads


def _blocks(mt: str, layer: nn.Module, facts: dict, hidden: int, skip: set) -> dict[str, Block]:
    """Layer-level children that take the hidden states: those with column- and row-parallel
    projections, and *replicated* ones (no row-parallel projection: a linear-attention block
    transformers leaves whole, or runs gathered), which run on every rank on the all-gathered
    sequence and hand their output back as sequence shards. And how the layer calls each."""
    colwise, rowwise, gathered = facts["colwise"], facts["rowwise"], facts["gathered"]
    own = [p for p in colwise + rowwise if "." not in p]  # an MLP the layer runs itself (OPT's fc1, fc2)
    if own and (any(p in gathered for p in own) or not any(p in colwise for p in own) or not set(own) & set(rowwise)):
        raise refuse(mt, f"the decoder layer calls the projections {', '.join(own)} itself, not as a column/row pair")
    skip = skip | set(own)
    names = {p.split(".", 1)[0] for p in colwise + rowwise if "." in p}
    for name, child in layer.named_children():  # blocks the plan leaves whole
        if name not in skip and name not in names and any(True for _ in child.parameters()):
            if not is_norm(child, hidden) and not is_linear(child):  # a Linear the layer calls: layer_linears
                names.add(name)
    blocks = {}
    for name in sorted(names):
        inside = [p for p in colwise + rowwise if p.startswith(name + ".")]
        replicated = not any(p in rowwise for p in inside)
        if replicated and any(p not in gathered for p in inside):
            raise refuse(mt, f"the block {name} has column-parallel projections but no row-parallel one")
        if not replicated and not any(p in colwise for p in inside):
            raise refuse(mt, f"the block {name} has row-parallel projections but no column-parallel one")
        positional = hidden_states_passing(layer, name)
        if positional is None:
            raise refuse(mt, f"cannot read how {type(layer).__name__}.forward passes hidden states to {name}")
        forward = type(layer.get_submodule(name)).forward
        blocks[name] = Block(positional=positional, edits_in_place=edits_in_place(forward), replicated=replicated)
    return blocks


def _head_dim_norms(layer: nn.Module, blocks: dict, planned: set[str], head_dim: int) -> list[str]:
    """Norms over ``head_dim`` inside a block that transformers' plan leaves out (Phi's optional
    ``q_layernorm``/``k_layernorm``): per-head norms, as the plan's q_norm/k_norm elsewhere."""
    return [
        path
        for path, module in layer.named_modules()
        if path not in planned and path.split(".", 1)[0] in blocks and "." in path and is_norm(module, head_dim)
    ]


def _activations(layer: nn.Module, blocks: dict, planned: set[str]) -> list[str]:
    """Activation modules with learned scalars inside a block (Apertus' xIELU ``act_fn``): they
    act elementwise on the column-parallel output, so the scalars are replicated and their
    gradients summed over tp like a per-head norm's."""
    found = []
    for path, module in layer.named_modules():
        params = list(module.parameters(recurse=False))
        if path in planned or not params or path.split(".", 1)[0] not in blocks:
            continue
        if "act" in path.rpartition(".")[2] and all(p.numel() == 1 for p in params):
            found.append(path)
    return found


def _layer_norms(mt: str, layer: nn.Module, planned: set[str], blocks: dict, hidden: int) -> list[str]:
    """Layer-level modules with parameters outside the planned projections: norms over hidden_size
    (sequence parallel) or a refusal naming the module."""
    norms = set()
    for name, _ in layer.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in planned or owner.split(".", 1)[0] in planned:  # planned holds the MoE blocks whole
            continue
        if owner.split(".", 1)[0] in blocks or not owner:
            raise refuse(mt, f"the parameter {name} of its decoder layer has no place in a TP plan")
        if not is_norm(layer.get_submodule(owner), hidden):
            raise refuse(mt, f"the decoder layer's {owner} ({shapes(layer.get_submodule(owner))}) is not a norm")
        norms.add(owner)
    return sorted(norms)
