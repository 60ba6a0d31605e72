"""``hf_tp.prepare``: everything :func:`hf_tp.parallelize` decides before it touches the model.

``parallelize(model, mesh, ...)`` is ``apply_prepared(prepare(model, mesh, ...))``: :func:`prepare`
makes every check (in one place, in one order, each a one-line ``ValueError`` raised before any
collective and depending only on the config and the sizes) and derives the adapter, the plan
options and the plan's origin, leaving the model exactly as it was; :func:`hf_tp.apply_prepared`
(:mod:`hf_tp.parallel.api`) then changes it. ``hf_tp.plan_for`` describes a :class:`Prepared` of a
meta-device model and its sizes alone: no mesh, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from hf_tp.adapters import Adapter, PlanOptions, get_adapter
from hf_tp.adapters.registry import registered_model_types
from hf_tp.compat import check_releases, warn_newer_releases
from hf_tp.context.context_install import check_context_parallel
from hf_tp.core.dims import ParallelDims, check_compile, check_dp_replicate, check_expert_ranks
from hf_tp.core.mesh import MeshSlices
from hf_tp.core.record import record_of
from hf_tp.lora.peft_models import check_lora, lora_adapter, unwrap_peft
from hf_tp.moe.expert_parallel import check_experts
from hf_tp.multimodal.passengers import check_wrapper
from hf_tp.parallel.tp import check_plan_paths


@dataclass(frozen=True)
class ParallelizeOptions:
    """:func:`hf_tp.parallelize`'s keywords (its docstring says what each does)."""

    sequence_parallel: bool = True
    loss_parallel: bool = True
    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    compile: bool = False
    fuse_partial_grads: bool = True
    ep: int = 1
    train_vision_tower: bool = False


@dataclass(frozen=True)
class Prepared:
    """What :func:`hf_tp.parallelize` decided, every check passed, before changing anything.

    ``given``: the model passed (what parallelize returns: a peft model, a wrapper or the HF model);
    ``model``: the HF model inside it (peft unwrapped), the one that is changed and gets the record;
    ``adapter``: its adapter (LoRA-aware for a peft model); ``opts``: the plan options; ``dims``: the
    sizes (pp 1, the ep in use); ``mesh``: the mesh prepare was given, or None (sizes only:
    :func:`hf_tp.apply_prepared` builds it); ``lora_whole``: a peft model's LoRA layers in blocks
    that run whole on every tp rank (their dropout takes the tp group's mask), None without peft;
    ``origin``: where the plan comes from (``hand-written``, ``derived from the model (generic)``,
    ``multimodal wrapper: its language model at <path>``), as plan_for and the record say it."""

    given: nn.Module
    model: nn.Module
    adapter: Adapter
    opts: PlanOptions
    dims: ParallelDims
    options: ParallelizeOptions
    origin: str
    lora_whole: tuple[str, ...] | None = None
    mesh: DeviceMesh | None = field(default=None, compare=False)

    @property
    def peft(self) -> bool:
        return self.lora_whole is not None


def prepare(model: nn.Module, layout: DeviceMesh | ParallelDims, **options: Any) -> Prepared:
    """Every check of :func:`hf_tp.parallelize` on ``model`` at ``layout`` (a mesh, read for its sizes,
    or a :class:`hf_tp.ParallelDims`: no process group needed), and what it derives from them; the
    model is left untouched. ``options``: parallelize's keywords (:class:`ParallelizeOptions`)."""
    opt = ParallelizeOptions(**options)
    check_releases()  # a release below the tested floors: one line naming it, before anything else
    ep = _pipeline_free(layout, opt.ep) if isinstance(layout, ParallelDims) else opt.ep
    hf_model, peft = unwrap_peft(model)
    if peft:
        warn_newer_releases(("peft",))  # (the lora extra's ceiling, checked where LoRA is used)
    config = getattr(hf_model, "config", None)
    if config is None:
        raise ValueError(f"hf_tp.parallelize expects a HF PreTrainedModel, got {type(hf_model).__name__}")
    adapter = get_adapter(config)
    dims = layout if isinstance(layout, ParallelDims) else MeshSlices.of(layout).dims  # (the mesh's checks)
    adapter.validate(config, dims.tp)
    kv = adapter.kv_replicas(config, dims.tp)
    opts = PlanOptions(sequence_parallel=opt.sequence_parallel, loss_parallel=opt.loss_parallel, kv_replicas=kv)
    _check_layout(hf_model, adapter, opts, dims, ep)
    lora_whole = None
    if peft:
        lora_whole = tuple(check_lora(hf_model, adapter, opts, dims.tp, ep))
    _check_vision(opt.train_vision_tower, adapter, config.model_type, peft)
    check_compile(opt.compile, opt.activation_checkpointing, dims.tp)  # (hf_tp.core.dims)
    return Prepared(
        given=model,
        model=hf_model,
        adapter=lora_adapter(adapter) if peft else adapter,
        opts=opts,
        dims=dims.replace(ep=ep),
        options=opt,
        origin=plan_origin(adapter),
        lora_whole=lora_whole,
        mesh=None if isinstance(layout, ParallelDims) else layout,
    )


def _check_layout(model: nn.Module, adapter: Adapter, opts: PlanOptions, dims: ParallelDims, ep: int) -> None:
    """The plan's paths exist, the wrapper, cp and ep fit the model and the sizes, and the model is
    not parallelized yet."""
    check_plan_paths(model, adapter, opts)
    if dims.dp_replicate > 1:
        check_dp_replicate(dims.dp, dims.dp_replicate, ep=ep)  # (hf_tp.core.dims)
    check_wrapper(model, adapter, cp=dims.cp > 1)
    if dims.cp > 1:
        check_context_parallel(model, adapter.layers_path, dims.cp)
    if ep > 1:
        if not adapter.moe:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; {model.config.model_type} has no experts")
        check_experts(model, adapter.layers_path, adapter.experts, ep)
        check_expert_ranks(dims.dp, dims.cp, ep)  # (the ranks ep borrows: dp x cp)
    check_not_parallelized(model)


def check_not_parallelized(model: nn.Module) -> None:
    """parallelize runs once per model: refuse one it (or another DTensor user) already changed."""
    if getattr(record_of(model), "complete", False) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "this model is already parallelized (hf_tp.describe(model) shows how); call hf_tp.parallelize once per model"
        )


def _check_vision(train_vision: bool, adapter: Adapter, model_type: str, peft: bool) -> None:
    if train_vision and not adapter.passengers:
        raise ValueError(
            f"train_vision_tower needs a multimodal checkpoint; this {model_type} model has no vision tower"
        )
    if train_vision and peft:
        raise ValueError("train_vision_tower trains the tower's own weights, which a peft LoRA model freezes: drop one")


def _pipeline_free(dims: ParallelDims, ep: int) -> int:
    """A :class:`ParallelDims` given to parallelize: one stage (pp 1), its ep given once; the ep."""
    if dims.pp > 1:
        raise ValueError(
            f"parallelize takes one pipeline stage's mesh, got ParallelDims(pp={dims.pp}): pipeline stages are "
            "built by hf-tp train --pp (hf_tp.fit); pass pp=1"
        )
    if ep not in (1, dims.ep):
        raise ValueError(f"ep={ep} and ParallelDims(ep={dims.ep}) disagree: give ep once, in the ParallelDims")
    return dims.ep


def plan_origin(adapter: Adapter) -> str:
    """Where the plan of ``config``'s model comes from, in the words of ``hf_tp.plan_for`` and the record."""
    if adapter.language_model:
        return f"multimodal wrapper: its language model at {adapter.language_model}"
    if adapter.model_type in registered_model_types():
        return "hand-written"
    if adapter.read_from_modules:  # transformers has no tp plan for it: the projections read off the modules
        return "derived from the model (generic; its projections read from its modules, transformers has no tp plan)"
    return "derived from the model (generic)"
