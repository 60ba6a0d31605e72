"""Pipeline stages in the estimate: how ``hf-tp train --pp`` cuts a model, which rank is the busiest,
the config of that rank's layers, and how many micro-batches' activations a rank holds at once.

The cut is training's own (:func:`hf_tp.parallel.pipeline_split.balanced_cuts` over each decoder
layer's parameter count, read from a model built on the meta device: no memory), refused where
training refuses it (:func:`hf_tp.parallel.pipeline_split.check_splittable`: tied embeddings,
multimodal wrappers, forwards that change the hidden states outside the layers). A rank runs
stages ``rank + v * pp`` for v < ``pp_virtual_stages``; the simulated rank is the one whose layers
hold the most parameters (ties: the later rank, which runs the last stage's ``lm_head``).

In-flight micro-batches (the activations saved for backward a rank holds at its peak), from torch's
schedules (``torch.distributed.pipelining.schedules``): under 1F1B rank ``r`` runs ``pp - r``
forwards before its first backward, so it holds ``min(pp - r, M)`` micro-batches (rank 0 the
most); GPipe runs every forward first: all ``M``; Interleaved 1F1B warms up with ``(V - 1) x
micro-batches per round + 2 (pp - 1 - r)`` forwards of one stage each, so rank 0 holds that plus
one stage-sized chunks (at most ``V x M``), i.e. that / V of its whole layers' micro-batches;
LoopedBFS runs every forward of every local stage first: ``M``. The last rank, which computes the
loss: 1F1B and Interleaved 1F1B hold one micro-batch of the last stage at a time (the last rank
runs no warm-up forwards of it), GPipe and LoopedBFS all ``M`` (:func:`last_in_flight`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter, wrapper
from hf_tp.parallel.aux_loss import standard_aux_loss
from hf_tp.parallel.pipeline_split import balanced_cuts, check_splittable, layer_costs
from hf_tp.train.metrics import unrouted_expert_params
from hf_tp.verify.shrink import layer_kinds

# Per-layer fields whose values are layer numbers (the layers that keep a dense MLP)
_LAYER_INDEX_LISTS = ("mlp_only_layers",)
_DENSE_PREFIX = ("first_k_dense_replace",)  # the first k layers are dense


@dataclass(frozen=True)
class StagePlan:
    """The whole model's figures and its cut into ``len(cuts)`` stages."""

    cuts: tuple[range, ...]
    costs: tuple[float, ...]  # each decoder layer's parameter count
    kinds: tuple[str, ...]  # each decoder layer's kind (hf_tp.verify.shrink.layer_kinds)
    num_params: int
    unrouted_params: int  # routed experts' weights one token does not use (MFU's N leaves them out)
    aux_loss: bool  # a MoE whose aux loss needs a routing pass before a pipeline step

    def rank_layers(self, pp: int, rank: int) -> list[int]:
        """The decoder layers of every stage ``rank`` runs (stages ``rank + v * pp``)."""
        return [i for s in range(rank, len(self.cuts), pp) for i in self.cuts[s]]

    def busiest_rank(self, pp: int) -> int:
        """The rank whose layers hold the most parameters (ties: the later rank)."""
        load = [sum(self.costs[i] for i in self.rank_layers(pp, r)) for r in range(pp)]
        return max(range(pp), key=lambda r: (load[r], r))


_PLANS: dict[tuple[str, int], StagePlan] = {}


def config_key(config: PretrainedConfig) -> str:
    """A config's identity for caching (its fields as sorted JSON)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def stage_plan(config: PretrainedConfig, stages: int) -> StagePlan:
    """``config`` cut into ``stages`` stages as ``hf-tp train --pp`` cuts it (cached per config)."""
    key = (config_key(config), stages)
    if key not in _PLANS:
        if wrapper.text_config_of(config) is not None:
            raise ValueError(f"pp: multimodal wrappers ({config.model_type}) are not cut into stages yet: use pp 1")
        adapter = get_adapter(config)
        with torch.device("meta"):
            model = wrapper.model_from_config(config)
        check_splittable(model, adapter)
        costs = layer_costs(model, adapter.layers_path)
        _PLANS[key] = StagePlan(
            cuts=tuple(balanced_cuts(costs, stages)),
            costs=tuple(costs),
            kinds=tuple(layer_kinds(config)),
            num_params=sum(p.numel() for p in model.parameters()),
            unrouted_params=unrouted_expert_params(model, config),
            aux_loss=standard_aux_loss(model),
        )
    return _PLANS[key]


def stage_config(config: PretrainedConfig, plan: StagePlan, layers: list[int]) -> PretrainedConfig:
    """``config`` with only decoder ``layers`` (with the embedding, final norm and lm_head): its
    per-layer lists picked, layer-number fields renumbered; a ``ValueError`` if the cut model's
    layers are not built as the originals are."""
    data = config.to_dict()
    total = config.num_hidden_layers
    out: dict = {"num_hidden_layers": len(layers)}
    for key, value in data.items():
        if isinstance(value, list) and len(value) == total and key not in ("architectures", *_LAYER_INDEX_LISTS):
            out[key] = [value[i] for i in layers]
    for key in _LAYER_INDEX_LISTS:
        if isinstance(data.get(key), list):
            out[key] = [j for j, i in enumerate(layers) if i in set(data[key])]
    for key in _DENSE_PREFIX:
        if isinstance(data.get(key), int):
            out[key] = sum(1 for i in layers if i < data[key])
    cut = config.__class__.from_dict({**data, **out})
    if layer_kinds(cut) != [plan.kinds[i] for i in layers]:
        raise ValueError(
            f"pp: cannot size a stage of this {config.model_type} model (layers {layers[0]}-{layers[-1]}): its "
            "config does not rebuild those layers alike on their own; estimate it at pp 1"
        )
    return cut


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Micro-batches (of a rank's whole layers) whose activations the busiest rank holds at once
    (rank 0; see the module docstring)."""
    m = microbatches
    if schedule == "1f1b":
        return float(min(pp, m))
    if schedule == "interleaved1f1b":
        per_round = m // max(1, m // pp)
        warmup = min((virtual - 1) * per_round + 2 * (pp - 1), m * virtual)
        return min(warmup + 1, m * virtual) / virtual
    return float(m)  # gpipe, loopedbfs: every forward before any backward


def last_in_flight(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[float, int]:
    """(micro-batches of its whole layers, micro-batches of the last stage) the last rank holds at once."""
    m = microbatches
    if schedule in ("gpipe", "loopedbfs"):
        return float(m), m
    if schedule == "interleaved1f1b":
        per_round = m // max(1, m // pp)
        return min((virtual - 1) * per_round + 1, m * virtual) / virtual, 1
    return 1.0, 1


def bubble_fraction(pp: int, microbatches: int, virtual: int) -> float:
    """The share of a step a pipeline rank waits idle: ``(pp - 1) / (V x M + pp - 1)``."""
    return (pp - 1) / (virtual * microbatches + pp - 1)
