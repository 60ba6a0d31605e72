"""Reading a block whose kind changes by decoder layer (per-layer mixers) for the generic plan.

Hybrid models build one layer-level child under one name that is a different module by layer
index: Nemotron-H's ``mixer`` (Mamba-2, attention, MLP or MoE), MiniMax's ``self_attn`` (lightning
linear attention or softmax attention). Each layer kind is read on its own
(:func:`hf_tp.adapters.inspect_layer.layer_facts`); where the kinds read such a child differently
(one runs whole, another is split by heads; one is called by keyword, another by position), the
child gets one plan entry per module class (:class:`hf_tp.styles.ByKind`), each the plan its kind
would get in a model of that kind alone. Kinds that read it alike (Kimi-Linear's two attentions,
both run whole) keep one entry, as before.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from hf_tp.adapters.facts import Mixer, refuse


def per_kind_blocks(mt: str, facts: list[dict], layers: list[nn.Module]) -> dict[str, dict[str, Mixer]]:
    """Blocks the layer kinds (``facts[i]`` read from ``layers[i]``) read differently: path ->
    module class name -> :class:`Mixer`. Such blocks get one shared entry in every ``facts[i]``
    (their own parameters move into the Mixer), so merging the kinds does not refuse them."""
    mixers: dict[str, dict[str, Mixer]] = {}
    for name in sorted({n for f in facts for n in f["blocks"]}):
        seen: dict[str, Mixer] = {}
        for f, layer in zip(facts, layers, strict=True):
            if name not in f["blocks"]:
                continue
            cls = type(layer.get_submodule(name)).__name__
            mixer = Mixer(f["blocks"][name], tuple(sorted(f["region_params"].get(name, ()))))
            have = seen.setdefault(cls, mixer)
            if have.block != mixer.block:
                raise refuse(mt, f"its layers read {name} ({cls}) in two ways")
            # one class built in two shapes and run alike (DeepSeek-V4's attention with and without
            # its indexer, both whole): the union of their parameters, each layer holding its own
            seen[cls] = replace(have, params=tuple(sorted({*have.params, *mixer.params})))
        if len({m.block for m in seen.values()}) < 2:
            continue
        mixers[name] = seen
        # one entry for the merge; a projection of any kind that edits its output in place gets its own copy
        shared = replace(
            next(iter(seen.values())).block, edits_in_place=any(m.block.edits_in_place for m in seen.values())
        )
        for f in facts:
            if name in f["blocks"]:
                f["blocks"][name] = shared
                f["region_params"].pop(name, None)
    return mixers
