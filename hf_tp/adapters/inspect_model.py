"""Reading a HF causal LM for the generic plan: its modules, parameters and forward sources.

Hand-written, because nothing in torch or transformers answers these questions: transformers'
``base_model_tp_plan`` names only the projections, and its TP integration needs no SP (it never
asks where the residual stream's norms are or how a layer calls its blocks). Every rule here
either places a parameter or refuses with the module's name (:func:`hf_tp.adapters.generic.refuse`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from hf_tp.adapters.generic import Block, Derivation, Region, has_submodule, is_linear, refuse
from hf_tp.adapters.inspect_moe import moe_blocks, region_roles, returns_tuple, router_classes

# transformers' gathered styles and the plain one each amounts to, the gathered region aside
GATHERED = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


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
    facts = [_layer_facts(mt, config, layer, layer_styles, routers) for layer in kinds.values()]
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


def _layer_facts(mt: str, config, layer: nn.Module, layer_styles: dict[str, str], routers: tuple) -> dict:
    """What the plan needs from one decoder layer (see :class:`Derivation` for the fields)."""
    # Multi-head latent attention (DeepSeek's low-rank q/kv projections) runs whole on every rank:
    # its shared latent and rotary key feed every head, which a head split cannot express locally.
    mla = {p.split(".", 1)[0] for p, s in layer_styles.items() if s == "mla_kv_a_proj"}
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in mla}
    moe = moe_blocks(layer, layer_styles)
    regions = {b: _region(mt, config, layer, b, layer_styles, routers) for b in moe}
    layer_styles = {p: s for p, s in layer_styles.items() if p.split(".", 1)[0] not in moe}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = _head_dim(layer, config)
    colwise, rowwise, head_norms, width_norms, head_params, gathered = [], [], [], [], {}, []
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
            if not _is_norm(module, head_dim):
                raise refuse(mt, f"{path} is a norm over more than one head ({_shapes(module)}, head_dim {head_dim})")
            head_norms.append(path)
        elif style == "local_params":  # the module's own per-head parameters (attention sinks)
            own = dict(module.named_parameters(recurse=False))
            if not own or any(p.dim() < 1 or p.shape[0] != heads for p in own.values()):
                raise refuse(mt, f"{path}'s own parameters ({_shapes(module)}) are not one entry per attention head")
            head_params[path] = tuple(own)
        elif style == "width_norm":
            widths = {layer.get_submodule(p).out_features for p in colwise}
            if not any(_is_norm(module, w) for w in widths):
                raise refuse(mt, f"{path} is a width_norm but not a norm over a column-parallel output")
            width_norms.append(path)
        else:
            raise refuse(mt, f"its tp plan gives {path} the style '{style}', which the generic plan does not translate")
    kv = [
        p
        for p in colwise
        if p not in gathered and kv_heads != heads and layer.get_submodule(p).out_features == kv_heads * head_dim
    ]
    # Projections whose shards follow the KV heads: separate k/v, or q/k/v packed in one inside an
    # attention module (by size alone an MLP's width could pass for it). With none, the attention
    # runs whole (gathered or replicated) and tp needs no relation to the KV heads.
    packed = (heads + 2 * kv_heads) * head_dim
    kv_bound = kv + [
        p
        for p in colwise
        if p not in gathered
        and kv_heads != heads
        and layer.get_submodule(p).out_features == packed
        and "att" in type(layer.get_submodule(p.split(".", 1)[0])).__name__.lower()
    ]
    blocks = _blocks(mt, layer, colwise, rowwise, gathered, config.hidden_size, skip=set(moe))
    # Blocks that run whole on every rank: replicated ones, and those whose projections are all
    # gathered (the region between them is whole too). Every rank computes their parameters' full
    # gradient, so all of them are replicated (a per-head or width rule there would sum over tp).
    whole = {b for b in blocks if all(p in gathered for p in colwise + rowwise if p.startswith(b + "."))}
    inside = lambda path: path.split(".", 1)[0] in whole  # noqa: E731
    head_norms = [p for p in head_norms if not inside(p)]
    width_norms = [p for p in width_norms if not inside(p)]
    head_params = {p: n for p, n in head_params.items() if not inside(p)}
    planned = set(colwise + rowwise + head_norms + width_norms) | set(head_params)
    sharded = {b: blk for b, blk in blocks.items() if b not in whole}
    head_norms += _head_dim_norms(layer, sharded, planned, head_dim)
    activations = _activations(layer, sharded, planned | set(head_norms))
    region = {b: names for b in sorted(whole) if (names := _own_params(layer, b, planned))}
    planned |= set(head_norms) | set(activations)
    planned |= {f"{b}.{n}".rpartition(".")[0] for b, names in region.items() for n in names}
    return dict(
        colwise=colwise,
        kv=kv,
        kv_bound=kv_bound,
        rowwise=rowwise,
        gathered=gathered,
        head_norms=head_norms,
        width_norms=width_norms,
        head_params=head_params,
        region_params=region,
        activations=activations,
        layer_norms=_layer_norms(mt, layer, planned | set(moe), blocks, config.hidden_size),
        blocks=blocks,
        regions=regions,
    )


def _region(mt: str, config, layer: nn.Module, block: str, layer_styles: dict[str, str], routers: tuple) -> Region:
    roles, router_paths, widths = region_roles(mt, config, layer, block, layer_styles, routers)
    first = _first_param(type(layer.get_submodule(block)).forward)
    styles = {_call_style(call, first) for call in _self_calls(type(layer).forward).get(block, [])}
    if len(styles) != 1 or None in styles:
        raise refuse(mt, f"cannot read how {type(layer).__name__}.forward passes hidden states to {block}")
    experts = next(p for p, s in layer_styles.items() if s == "moe_tp_experts" and p.startswith(block + "."))
    return Region(
        roles=roles,
        positional=styles.pop(),
        routers=router_paths,
        experts=experts[len(block) + 1 :],
        widths=tuple(widths),
        aux_exact=all(returns_tuple(layer.get_submodule(f"{block}.{r}" if r else block)) for r in router_paths),
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


def _head_dim(layer: nn.Module, config) -> int:
    """The attention's own ``head_dim`` (it may differ per layer: Gemma 4 reads it from per-layer
    configs and refuses the global one), else the config's, else hidden / heads."""
    for module in layer.modules():
        value = module.__dict__.get("head_dim")
        if isinstance(value, int):
            return value
    try:
        value = getattr(config, "head_dim", None)
    except Exception:  # noqa: BLE001 - transformers raises its own error for per-layer attributes
        value = None
    return value or config.hidden_size // config.num_attention_heads


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


def _blocks(
    mt: str, layer: nn.Module, colwise: list[str], rowwise: list[str], gathered: list[str], hidden: int, skip: set
) -> dict:
    """Layer-level children that take the hidden states: those with column- and row-parallel
    projections, and *replicated* ones (no row-parallel projection: a linear-attention block
    transformers leaves whole, or runs gathered), which run on every rank on the all-gathered
    sequence and hand their output back as sequence shards. And how the layer calls each."""
    for path in colwise + rowwise:
        if "." not in path:
            raise refuse(mt, f"the projection {path} is called by the decoder layer itself, not by a block")
    names = {p.split(".", 1)[0] for p in colwise + rowwise}
    for name, child in layer.named_children():  # blocks the plan leaves whole
        if name in skip:
            continue
        if name not in names and any(True for _ in child.parameters()) and not _is_norm(child, hidden):
            names.add(name)
    calls = _self_calls(type(layer).forward)
    blocks = {}
    for name in sorted(names):
        inside = [p for p in colwise + rowwise if p.startswith(name + ".")]
        replicated = not any(p in rowwise for p in inside)
        if replicated and any(p not in gathered for p in inside):
            raise refuse(mt, f"the block {name} has column-parallel projections but no row-parallel one")
        if not replicated and not any(p in colwise for p in inside):
            raise refuse(mt, f"the block {name} has row-parallel projections but no column-parallel one")
        block = layer.get_submodule(name)
        first = _first_param(type(block).forward)
        styles = {_call_style(call, first) for call in calls.get(name, [])}
        if len(styles) != 1 or None in styles:
            raise refuse(mt, f"cannot read how {type(layer).__name__}.forward passes hidden states to {name}")
        blocks[name] = Block(
            positional=styles.pop(), edits_in_place=_edits_in_place(type(block).forward), replicated=replicated
        )
    return blocks


def _head_dim_norms(layer: nn.Module, blocks: dict, planned: set[str], head_dim: int) -> list[str]:
    """Norms over ``head_dim`` inside a block that transformers' plan leaves out (Phi's optional
    ``q_layernorm``/``k_layernorm``): per-head norms, as the plan's q_norm/k_norm elsewhere."""
    return [
        path
        for path, module in layer.named_modules()
        if path not in planned and path.split(".", 1)[0] in blocks and "." in path and _is_norm(module, head_dim)
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
        if not _is_norm(layer.get_submodule(owner), hidden):
            raise refuse(mt, f"the decoder layer's {owner} ({_shapes(layer.get_submodule(owner))}) is not a norm")
        norms.add(owner)
    return sorted(norms)


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
        if not owner or not _is_norm(module, hidden):
            raise refuse(mt, f"the parameter {name} outside the decoder layers has no place in a TP plan")
        norms.add(owner)
    return embedding, sorted(norms), lm_head


def _is_norm(module: nn.Module, size: int) -> bool:
    """A leaf whose parameters are all vectors of ``size`` (a norm's weight and bias)."""
    params = list(module.parameters(recurse=False))
    has_children = any(True for _ in module.children() if any(True for _ in _.parameters()))
    return bool(params) and not has_children and all(p.dim() == 1 and p.numel() == size for p in params)


def _shapes(module: nn.Module) -> str:
    return ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters()) or "no parameters"


def _source_tree(fn) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_calls(fn) -> dict[str, list[ast.Call]]:
    """``self.<name>(...)`` calls in ``fn``'s source, by name."""
    calls: dict[str, list[ast.Call]] = {}
    tree = _source_tree(fn)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "self":
                calls.setdefault(node.func.attr, []).append(node)
    return calls


def _edits_in_place(fn) -> bool:
    """The source calls an in-place tensor method (``x.clamp_(...)``, ``x.mul_(...)``...)."""
    tree = _source_tree(fn)
    return tree is not None and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in INPLACE for n in ast.walk(tree)
    )


INPLACE = {"clamp_", "clip_", "mul_", "div_", "add_", "sub_", "masked_fill_", "copy_", "zero_", "fill_"}


def _first_param(fn) -> str | None:
    params = [p for p in inspect.signature(inspect.unwrap(fn)).parameters.values() if p.name != "self"]
    return params[0].name if params else None


def _call_style(call: ast.Call, first: str | None) -> int | None:
    """Positional arguments of the call (hidden states first), 0 for ``first=`` by keyword, None
    when unreadable (``*args``, ``**kwargs`` only, or no hidden-states argument)."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    if call.args:
        return len(call.args)
    if first == "hidden_states" and any(k.arg == first for k in call.keywords):
        return 0
    return None


def plain_logits(model: nn.Module, lm_head: str) -> bool:
    """True when the causal-LM forward computes ``logits = self.<lm_head>(h)`` once, with ``h`` the
    decoder's last hidden state (sliced at most), and never changes the logits afterwards (no
    scaling or soft-capping): only then may the loss be fused with the lm_head."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None or "." in lm_head:
        return False
    tree = _source_tree(type(model).forward)
    if tree is None:
        return False
    writes = [n for n in ast.walk(tree) if _writes_name(n, "logits")]
    if len(writes) != 1 or not isinstance(writes[0], ast.Assign):
        return False
    value = writes[0].value
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) == f"self.{lm_head}" and len(value.args) == 1):
        return False
    arg = value.args[0]
    source = arg.value if isinstance(arg, ast.Subscript) else arg
    if not isinstance(source, ast.Name):
        return False
    return all(_is_hidden_state(n.value, source.id) for n in ast.walk(tree) if _writes_name(n, source.id))


def _writes_name(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return (
        isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
    )


def _is_hidden_state(value: ast.AST | None, name: str) -> bool:
    """``outputs.last_hidden_state``, ``outputs[0]``, ``name[...]`` or a slicing helper of those."""
    if isinstance(value, ast.Attribute):
        return value.attr == "last_hidden_state"
    if isinstance(value, ast.Subscript):
        return isinstance(value.value, ast.Name)
    if isinstance(value, ast.Call) and "slice" in ast.unparse(value.func):
        return bool(value.args) and _is_hidden_state(value.args[0], name) or ast.unparse(value.args[0]) == name
    return False
