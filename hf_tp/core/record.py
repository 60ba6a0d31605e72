"""One typed record of what ``hf_tp.parallelize`` did to a model.

:class:`ParallelRecord` sits on the HF model ``parallelize`` changed (the one attribute ``hf_tp``;
:func:`record_of` finds it through a peft model or ``torch.compile``'s wrapper too): its meshes,
the plans and their styles, the expert shards, the context-parallel state, LoRA, the dropout
streams, the fused partial-gradient reduction, the weights kept whole, a pipeline stage's cut
(:class:`StageRecord`), the methods replaced on modules and the class swaps styles make
(:func:`reclass`). Generate, checkpoints, the loop, verify and the estimate read it; "already
parallelized" is a check on it.

Facts a hook needs about one module (a MoE region's roles, packed expert shapes, peft's
parameter wrappers, this rank's experts, the cp state an attention call reads) are
:class:`ModuleFacts`, kept off the module in a weak registry keyed by the module object (it
survives FSDP2's class swap and ``torch.compile``, and dies with the module);
:meth:`ParallelRecord.modules` lists them by path. Imports only torch: every layer may read it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.compat.torch_internals import COMPILED_CHILD, child_slots, own_attribute, set_own_attribute
from hf_tp.compat.transformers_private import LOSS_FUNCTION_SLOT

ATTRIBUTE = "hf_tp"  # the one attribute parallelize sets on the model


@dataclass
class ExpertShard:
    """One experts module under expert parallelism: this rank's experts and what its last
    forward moved (written by the dispatch; benchmarks, tests and the estimate read it)."""

    start: int  # this rank's first expert
    local: int  # how many experts this rank holds
    mesh: DeviceMesh  # ("dp_out", "ep", "tp")
    tokens_per_expert: torch.Tensor | None = None  # the last forward's load of this rank's experts
    a2a_rows: tuple[int, int] = (0, 0)  # rows that crossed the network, out and in
    routing: Any = None  # how the dispatch sizes its all-to-alls (a hf_tp.moe.routing.Routing)


@dataclass(frozen=True)
class StageRecord:
    """A pipeline stage: the model cut to some of its decoder layers
    (:func:`hf_tp.pipeline.pipeline_split.cut_stage`), the modules other stages run left as gaps."""

    layers: range  # the decoder layers this stage runs
    of: int  # the model's decoder layers
    gaps: tuple[str, ...] = ()  # paths (from the model) of the parameter-less gaps other stages run

    @property
    def first(self) -> bool:
        """The stage takes token ids (it holds the embedding)."""
        return self.layers.start == 0

    @property
    def last(self) -> bool:
        """The stage returns the logits (it holds the final norm and ``lm_head``)."""
        return self.layers.stop == self.of


@dataclass
class ModuleFacts:
    """What parallelize recorded about one module, for code that holds only the module."""

    experts: ExpertShard | None = None
    region_roles: dict[str, tuple[Any, int]] = field(default_factory=dict)  # leaf -> (MoE Role, tp)
    hf_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # leaf -> HF's shape (packed halves)
    packed: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # leaf -> (dim, HF shape)
    lora: dict[str, nn.Module] = field(default_factory=dict)  # leaf -> peft's ParamWrapper adding to it
    cp: Any = None  # the model's ContextState (attention modules, the decoder)
    stage: StageRecord | None = None  # a pipeline stage's cut (the model; set before parallelize)
    reclassed: str = ""  # the class a style swapped for its own subclass (:func:`reclass`)

    def empty(self) -> bool:
        return self == ModuleFacts()


_FACTS: weakref.WeakKeyDictionary[nn.Module, ModuleFacts] = weakref.WeakKeyDictionary()


def facts(module: nn.Module) -> ModuleFacts:
    """``module``'s facts, created empty on first use (while parallelize records them)."""
    found = _FACTS.get(module)
    if found is None:
        found = _FACTS[module] = ModuleFacts()
    return found


def facts_of(module: nn.Module) -> ModuleFacts | None:
    """``module``'s facts, or None when parallelize recorded none (no entry is created)."""
    return _FACTS.get(module)


@dataclass
class LoraRecord:
    """peft's LoRA as parallelize found it."""

    whole_run: tuple[str, ...] = ()  # LoRA layers in blocks run whole on every tp rank (their dropout: the tp group's)
    dropouts: int = 0  # peft dropouts replaced by tp-aware ones


@dataclass
class ParallelRecord:
    """What ``hf_tp.parallelize`` did to one model (``hf_tp.describe(model)`` prints it)."""

    model_type: str
    adapter: str  # hand-written | derived | ...
    options: Any  # the PlanOptions the plans were made with
    meshes: dict[str, DeviceMesh]  # "tp", and those present of "dp", "cp", "ep", "dp_replicate"
    layers_path: str
    layer_plan: dict[str, Any] = field(default_factory=dict)  # path in a decoder layer -> ParallelStyle
    top_plan: dict[str, Any] = field(default_factory=dict)  # path from the model -> ParallelStyle
    fsdp: bool = False
    compiled: bool = False
    activation_checkpointing: bool = False
    experts: dict[str, ExpertShard] = field(default_factory=dict)  # path -> this rank's experts (ep > 1)
    cp: Any = None  # ContextState (hf_tp.context.token_share) when a cp dim > 1
    lora: LoraRecord | None = None  # a peft LoRA model
    dropout: Any = None  # the model's own dropout streams (hf_tp.dropout.model_dropout.ModelDropout)
    partial_grads: Any = None  # the fused Partial-gradient reduction (hf_tp.parallel.partial_grads)
    whole: tuple[str, ...] = ()  # parameters kept whole on every dp rank, outside FSDP2 (odd dtypes)
    passengers: tuple[
        str, ...
    ] = ()  # a multimodal wrapper's modules outside its language model: whole on every tp rank
    overrides: tuple[str, ...] = ()  # "path.method": methods parallelize replaced on one module (generate, ...)
    classes: tuple[str, ...] = ()  # "path: Old -> New": modules a style gave a subclass of its own (:func:`reclass`)
    stage: StageRecord | None = None  # a pipeline stage (hf_tp.pipeline_parallelize), else None
    complete: bool = False  # parallelize returned (until then it is being filled in)

    def size(self, dim: str) -> int:
        """The size of mesh dim ``dim`` (1 when the mesh has none)."""
        mesh = self.meshes.get(dim)
        return 1 if mesh is None else mesh.size()

    def modules(self, model: nn.Module) -> dict[str, ModuleFacts]:
        """Path (from ``model``) -> the facts recorded for that module."""
        return {path: f for path, m in model.named_modules() if (f := _FACTS.get(m)) is not None and not f.empty()}


def overridden_methods(model: nn.Module) -> tuple[str, ...]:
    """``path.name`` of every method a module's own attribute replaces (``model.generate``, an
    experts module's dispatching ``forward``, a DeepStack merge, ``to_empty``, ``loss_function``)."""
    out = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if name == LOSS_FUNCTION_SLOT:  # (transformers' property stores what is set here)
                name = "loss_function"
            elif isinstance(value, nn.Module) or not callable(value) or not callable(getattr(type(module), name, None)):
                continue
            out.append(f"{path}.{name}" if path else name)
    return tuple(out)


def reclass(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """Give ``module`` the class ``cls`` (a subclass of its own keeping its parameters and
    state-dict keys, with its own forward), recorded in its facts so the record lists it."""
    found = facts(module)
    found.reclassed = found.reclassed or type(module).__name__
    module.__class__ = cls
    return module


def replaced_classes(model: nn.Module) -> tuple[str, ...]:
    """``path: Old -> New`` of every module of ``model`` that :func:`reclass` changed."""
    return tuple(
        f"{path}: {f.reclassed} -> {type(m).__name__}"
        for path, m in model.named_modules()
        if (f := _FACTS.get(m)) is not None and f.reclassed
    )


def attach(model: nn.Module, record: ParallelRecord) -> None:
    """Put ``record`` on ``model`` (the one attribute parallelize sets)."""
    set_own_attribute(model, ATTRIBUTE, record)


def record_of(model: nn.Module) -> ParallelRecord | None:
    """The record of a parallelized model (or of a peft / ``torch.compile`` wrapper around one), else None."""
    for _ in range(4):  # OptimizedModule -> PeftModel -> LoraModel -> the HF model
        found = own_attribute(model, ATTRIBUTE)
        if isinstance(found, ParallelRecord):
            return found
        inner = child_slots(model) if isinstance(model, nn.Module) else {}
        nxt = inner.get(COMPILED_CHILD) or inner.get("base_model") or inner.get("model")
        if not isinstance(nxt, nn.Module) or not _wrapper(model):
            return None
        model = nxt
    return None


def _wrapper(module: nn.Module) -> bool:
    """torch.compile's or peft's wrapper (whose own attributes forward to the model inside)."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" or cls.__module__.startswith("peft.")
