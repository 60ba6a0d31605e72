"""Cutting an unmodified HF causal LM into pipeline stages by decoder layers, keeping its forward.

A stage is the whole ``*ForCausalLM`` object with the modules other stages own replaced by
parameter-less gaps: the decoder layers it does not run become :class:`LayerGap` (the hidden
states pass through; the layer's plain attributes such as ``attention_type`` stay, so the model's
loop over ``enumerate(self.layers)`` still indexes ``config.layer_types`` by the true layer
number), the embedding is a gap on every stage but the first (those are fed the hidden states as
``inputs_embeds``), the final norm and ``lm_head`` on every stage but the last. Every parameter
keeps its name (``model.layers.7.mlp.up_proj.weight`` on whichever stage runs layer 7), so
checkpoints are the same files at any pp, and the model's own forward still builds the rotary
tables, masks and position ids on every stage.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_tp.adapters.adapter import Adapter
from hf_tp.compat.torch_internals import buffer_slots, child_slots, parameter_slots
from hf_tp.core.record import StageRecord, facts
from hf_tp.parallel.tp import embeddings_tied


class StageGap(nn.Module):
    """A module another pipeline stage runs: no parameters, passes its first input through (the
    stage's record lists its path; tensor parallelism leaves it out of the plan, hf_tp.parallel.tp)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class HeadGap(StageGap):
    """``lm_head`` on a stage before the last: keeps the hidden states it is given (the stage's
    output, read back by :class:`hf_tp.pipeline.schedules.StageModule`) and passes them on."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.seen = hidden_states
        return hidden_states


class LayerGap(StageGap):
    """A decoder layer another stage runs, with the original's plain attributes (``layer_idx``,
    ``attention_type``, ``is_sliding`` ...) that the model's forward may read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool, type(None))):
                setattr(self, name, value)


def layer_costs(model: nn.Module, layers_path: str) -> list[float]:
    """Each decoder layer's cost for balancing the stages: its parameter count (a first proxy of
    its compute and memory; the estimate's per-layer time would plug in here)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in model.get_submodule(layers_path)]


def balanced_cuts(costs: list[float], stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, each non-empty, minimising the largest stage's cost
    (ties: the earlier stages lighter, since under 1F1B they hold the most in-flight activations)."""
    n = len(costs)
    if stages > n:
        raise ValueError(
            f"pipeline parallelism needs at least one decoder layer per stage: {n} layers < {stages} stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best: dict[tuple[int, int], tuple[float, int]] = {}  # (stages left, start) -> (max cost, end of first)

    def solve(k: int, start: int) -> float:
        if (k, start) in best:
            return best[(k, start)][0]
        if k == 1:
            best[(k, start)] = (prefix[n] - prefix[start], n)
            return best[(k, start)][0]
        choice = (float("inf"), start + 1)
        for end in range(start + 1, n - k + 2):
            worst = max(prefix[end] - prefix[start], solve(k - 1, end))
            if worst < choice[0] - 1e-9 * max(1.0, worst):  # strictly better: keep the shortest first stage
                choice = (worst, end)
        best[(k, start)] = choice
        return choice[0]

    solve(stages, 0)
    cuts, start = [], 0
    for k in range(stages, 0, -1):
        end = best[(k, start)][1]
        cuts.append(range(start, end))
        start = end
    return cuts


def check_splittable(model: nn.Module, adapter: Adapter) -> None:
    """Refuse what a stage cut cannot keep exact, before anything is built (every rank alike)."""
    name = model.config.model_type
    if adapter.language_model or adapter.passengers:
        raise ValueError(f"--pp: multimodal wrappers ({name}) are not cut into stages yet: train with --pp 1")
    _check_stream_passthrough(model, adapter)


def _check_stream_passthrough(model: nn.Module, adapter: Adapter) -> None:
    """A stage feeds the hidden states it receives as ``inputs_embeds`` and hands on what reaches
    ``lm_head``; that is exact only if the model's forward changes nothing outside its layers and
    final norm (Granite multiplies the embeddings, some models add embedding dropout or norms).
    Checked on a copy of the model with every layer, the embedding and the norm as gaps (on the CPU,
    its few other tensors zeroed: the model may be on the meta device): ``lm_head`` must be given
    the very tensor passed in (or all of it, viewed)."""
    probe = _gapped_copy(model, adapter)
    x = torch.zeros(1, 2, model.config.get_text_config().hidden_size, dtype=next(model.parameters()).dtype)
    try:
        with torch.no_grad():
            probe(inputs_embeds=x, use_cache=False, **_no_routers(model))
    except Exception as exc:  # noqa: BLE001 - any failure means the stage cut is not safe
        raise ValueError(
            f"--pp: {model.config.model_type}'s forward does not run on hidden states fed as inputs_embeds "
            f"({type(exc).__name__}: {exc}); train it with --pp 1"
        ) from exc
    seen = getattr(probe.lm_head, "seen", None)
    if seen is None or not (seen is x or (seen._base is x and seen.shape == x.shape)):
        raise ValueError(
            f"--pp: {model.config.model_type}'s forward changes the hidden states outside its decoder layers "
            "(an embedding scale, dropout or norm), which every stage would apply again; train it with --pp 1"
        )


def _no_routers(model: nn.Module) -> dict:
    """``output_router_logits=False`` for a MoE that records them (the probe has no router, and HF's
    aux loss fails on none)."""
    return {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}


def _gapped_copy(model: nn.Module, adapter: Adapter) -> nn.Module:
    """A CPU copy of ``model`` whose layers, embedding, final norm and lm_head are gaps (none of
    their weights copied), its other tensors zeros."""
    decoder, layers_name = _decoder_and_layers(model, adapter)
    norm_name = _final_norm_name(decoder, layers_name)
    gaps = {
        (decoder, layers_name): nn.ModuleList([LayerGap(layer) for layer in getattr(decoder, layers_name)]),
        (decoder, _embedding_name(decoder)): StageGap(),
        (model, "lm_head"): HeadGap(),
    }
    if norm_name:
        gaps[(decoder, norm_name)] = StageGap()
    saved = {key: getattr(*key) for key in gaps}
    try:
        for (owner, name), gap in gaps.items():
            setattr(owner, name, gap)
        probe = copy.deepcopy(model)
    finally:
        for (owner, name), module in saved.items():
            setattr(owner, name, module)
    probe.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*probe.parameters(), *probe.buffers()]:
            t.zero_()
    return probe


def cut_stage(model: nn.Module, adapter: Adapter, layers: range, copy_model: bool) -> nn.Module:
    """The stage of ``model`` that runs decoder ``layers`` (a deep copy when ``copy_model``, else
    ``model`` itself, cut in place): the others' modules become gaps, every name kept. The cut is a
    :class:`~hf_tp.core.record.StageRecord` in the model's facts, which parallelize puts in its record.

    A model whose ``lm_head`` is tied to the embedding keeps the tie on the first and last stages,
    as a whole model holds it (both names, one Parameter): the first stage's ``lm_head`` gap holds
    the embedding's weight, the last stage keeps the embedding (never called: it is fed hidden
    states) tied to its ``lm_head``. So each stage's checkpoint names are a whole model's, and the
    two copies train as one once their gradients are summed
    (:meth:`hf_tp.pipeline.schedules.Pipeline.sync_tied_grads`)."""
    if copy_model:
        model = copy.deepcopy(model)
    tied = embeddings_tied(model)
    decoder, layers_name = _decoder_and_layers(model, adapter)
    stack = decoder.get_submodule(layers_name)
    gaps = []
    for i in range(len(stack)):
        if i not in layers:
            stack[i] = LayerGap(stack[i])
            gaps.append(f"{adapter.layers_path}.{i}")
    prefix = adapter.layers_path.rpartition(".")[0]
    prefix += "." if prefix else ""
    first, last = layers.start == 0, layers.stop == len(stack)
    weight = decoder.get_input_embeddings().weight
    if not first and not (tied and last):
        embed = _embedding_name(decoder)
        setattr(decoder, embed, StageGap())
        gaps.append(prefix + embed)
    if not last:
        norm = _final_norm_name(decoder, layers_name)
        if norm:
            setattr(decoder, norm, StageGap())
            gaps.append(prefix + norm)
        model.lm_head = HeadGap()
        gaps.append("lm_head")
        if tied and first:
            model.lm_head.weight = weight
    facts(model).stage = StageRecord(layers, len(stack), tuple(gaps))
    return model


def _decoder_and_layers(model: nn.Module, adapter: Adapter) -> tuple[nn.Module, str]:
    path, _, name = adapter.layers_path.rpartition(".")
    decoder = model.get_submodule(path) if path else model
    return decoder, name


def _embedding_name(decoder: nn.Module) -> str:
    embedding = decoder.get_input_embeddings()
    for name, module in decoder.named_children():
        if module is embedding:
            return name
    raise ValueError(f"--pp: {type(decoder).__name__}'s input embedding is not a direct child; train with --pp 1")


def _final_norm_name(decoder: nn.Module, layers_name: str) -> str | None:
    """The final norm: the child named ``norm`` (or ``final_layernorm``/``ln_f``) of the decoder."""
    for name in ("norm", "final_layernorm", "ln_f", "final_norm"):
        if isinstance(getattr(decoder, name, None), nn.Module):
            return name
    return None


def merged_stages(models: list[nn.Module]) -> nn.Module:
    """One module over the stages a rank holds (``--pp-virtual-stages``: several) whose parameters
    and buffers are theirs under their original names, each where it runs: what a checkpoint
    saves and loads (torch's state-dict functions take one module and one optimizer over it).
    Modules the stages share are kept, a module real on one stage is taken from it over the
    others' gaps (the first stage's ``lm_head`` gap holding a tied weight over a bare one), and
    containers real on several (the model, its decoder, the layer list) are merged child by child.
    The merged module carries the model's ``config`` and ``generation_config``, which
    :func:`hf_tp.save_checkpoint` saves beside the weights."""
    if len(models) == 1:
        return models[0]
    merged = _merged(models)
    for name in ("config", "generation_config"):
        if getattr(models[0], name, None) is not None:
            setattr(merged, name, getattr(models[0], name))
    return merged


def _merged(modules: list[nn.Module]) -> nn.Module:
    distinct = list({id(m): m for m in modules}.values())
    real = [m for m in distinct if not isinstance(m, StageGap)]
    if not real:  # gaps only: one holding a tied weight if there is one
        return next((m for m in distinct if any(True for _ in m.parameters())), distinct[0])
    if len(real) == 1 or not child_slots(real[0]):
        return real[0]
    merged = nn.ModuleList() if isinstance(real[0], nn.ModuleList) else nn.Module()
    for name, param in parameter_slots(real[0]).items():
        if param is not None:
            merged.register_parameter(name, param)
    buffers, not_saved = buffer_slots(real[0])
    for name, buf in buffers.items():
        if buf is not None:
            merged.register_buffer(name, buf, persistent=name not in not_saved)
    for name in dict.fromkeys(n for m in real for n, child in child_slots(m).items() if child is not None):
        merged.add_module(name, _merged([child_slots(m)[name] for m in real if child_slots(m).get(name) is not None]))
    return merged
