"""``hf_tp.parallelize``: TP+SP (and FSDP2 on a dp dim) for a HF causal LM, in place."""

from __future__ import annotations

import types

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from hf_tp.adapters import Adapter
from hf_tp.context.context_install import install_context_parallel
from hf_tp.core.dims import ParallelDims
from hf_tp.core.dims import check_compile as check_compile  # (where tests import it from)
from hf_tp.core.mesh import MeshSlices
from hf_tp.core.record import (
    LoraRecord,
    ParallelRecord,
    attach,
    facts_of,
    overridden_methods,
    record_of,
    replaced_classes,
)
from hf_tp.lora.peft_models import check_dropout_recompute, install_dropouts, keep_frozen
from hf_tp.moe.expert_parallel import apply_expert_parallel, build_ep_mesh
from hf_tp.multimodal.deepstack import shard_deepstack
from hf_tp.multimodal.packed_positions import pass_packed_positions
from hf_tp.multimodal.passengers import freeze_passengers
from hf_tp.parallel.fsdp import apply_fsdp, odd_dtype_params
from hf_tp.parallel.generate import generate as parallel_generate
from hf_tp.parallel.loss_parallel import local_loss_function
from hf_tp.parallel.materialize import keep_parameters_on_to_empty
from hf_tp.parallel.partial_grads import install as install_partial_grad_reduction
from hf_tp.parallel.prepare import Prepared, check_not_parallelized, prepare
from hf_tp.parallel.tp import apply_tensor_parallel, mark_packed_experts


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | ParallelDims,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    compile: bool = False,
    fuse_partial_grads: bool = True,
    ep: int = 1,
    train_vision_tower: bool = False,
) -> nn.Module:
    """Tensor-parallelize a HF ``*ForCausalLM`` (or a multimodal wrapper) over ``mesh`` in place; return it.

    ``mesh`` (:func:`hf_tp.build_mesh`) is 1-D (tp), ``("dp", "tp")``, ``("dp", "cp", "tp")`` or ``("dp_replicate",
    "dp_shard", "tp")`` (HSDP: FSDP2 over dp_shard, replicated over dp_replicate); a dp or cp dim > 1 adds FSDP2 over
    dp x cp (at dp=1 too when ``mp_policy`` asks for it). Takes a model from ``from_pretrained``, one built on meta (its ``to_empty(device=...)`` then keeps
    each parameter object and the gradient hooks parallelize attached: :mod:`hf_tp.parallel.materialize`),
    or a peft LoRA model (:mod:`hf_tp.lora.peft_models`). ``loss_parallel``: vocab-sharded logits, so compute the loss
    and backward inside :func:`hf_tp.loss_parallel`. Every check runs before any collective and depends only on
    the config and the mesh shape: a bad input raises the same ``ValueError`` on every rank (tp must divide the heads and the MLP width; fewer KV heads than tp replicate each,
    :mod:`hf_tp.styles.kv_heads`). A tp dim of size 1 applies no tensor parallelism. ``activation_checkpointing``: HF's
    per-layer recompute; ``compile``: ``torch.compile`` on each decoder layer after TP, before FSDP2 (not both under
    tp: :func:`check_compile`); ``fuse_partial_grads``: one all-reduce per backward for the ``Partial`` gradients of weights
    replicated over tp (:mod:`hf_tp.parallel.partial_grads`). ``ep`` > 1 (MoE): whole experts on ranks borrowed from
    dp (dp x cp), tokens moved by all-to-all (:mod:`hf_tp.moe.expert_parallel`); ep must divide them and the
    experts. A ``cp`` dim > 1 splits each row's tokens (:mod:`hf_tp.context.token_share`): every rank of a cp x tp group
    passes the same full rows (a multiple of 2 x cp x tp long); the logits are this rank's tokens (``TokenShare.indices``
    says which), a ``labels=`` loss the whole rows' on every rank. A wrapper's vision tower trains if ``train_vision_tower``.
    ``mesh`` may be a :class:`hf_tp.ParallelDims` (pp 1): its mesh is built here, its ``ep`` taken.
    The same as ``apply_prepared(prepare(model, mesh, ...))`` (:mod:`hf_tp.parallel.prepare`)."""
    prepared = prepare(
        model,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        fuse_partial_grads=fuse_partial_grads,
        ep=ep,
        train_vision_tower=train_vision_tower,
    )
    return apply_prepared(prepared)


def apply_prepared(prepared: Prepared, mesh: DeviceMesh | None = None) -> nn.Module:
    """Change ``prepared.given`` as :func:`hf_tp.prepare` decided, over ``mesh`` (default: the mesh
    prepare was given, else one built from ``prepared.dims``); return it. A mesh of other sizes than
    prepare checked is refused, as is a model already parallelized (a :class:`Prepared` applies once)."""
    mesh, slices = _mesh_for(prepared, mesh)
    check_not_parallelized(prepared.model)
    ep_mesh = build_ep_mesh(mesh, prepared.dims.ep) if prepared.dims.ep > 1 else None
    _ready(prepared, mesh, slices, ep_mesh)
    _parallelize(prepared, slices, ep_mesh)
    return prepared.given


def _mesh_for(prepared: Prepared, mesh: DeviceMesh | None) -> tuple[DeviceMesh, MeshSlices]:
    """The mesh to apply over and its named slices, its sizes those prepare checked."""
    if mesh is None:
        mesh = prepared.mesh if prepared.mesh is not None else prepared.dims.build_mesh()
    slices = MeshSlices.of(mesh)
    got, want = slices.dims, prepared.dims.replace(ep=1)
    if got != want:
        raise ValueError(
            f"apply_prepared got a mesh of {_sizes(got)}, but prepare checked {_sizes(want)}: "
            "pass the mesh (or ParallelDims) prepare was given"
        )
    return mesh, slices


def _sizes(dims: ParallelDims) -> str:
    return ", ".join(f"{d}={getattr(dims, d)}" for d in ("tp", "dp", "cp", "dp_replicate"))


def _ready(prepared: Prepared, mesh: DeviceMesh, slices: MeshSlices, ep_mesh: DeviceMesh | None) -> None:
    """What parallelize changes before its styles: a peft LoRA model gets tp-aware dropout
    (:mod:`hf_tp.lora.peft_models`); a multimodal wrapper's passengers are frozen
    (:mod:`hf_tp.multimodal.passengers`) and its 3-D mrope language model takes packed position
    ids in its 4-row form (:mod:`hf_tp.multimodal.packed_positions`); packed expert weights are
    marked; the record is attached."""
    model, adapter, opts = prepared.model, prepared.adapter, prepared.opts
    lora = None
    if prepared.lora_whole is not None:
        dropouts = install_dropouts(model, list(prepared.lora_whole), prepared.dims.tp)
        lora = LoraRecord(prepared.lora_whole, dropouts)
    freeze_passengers(model, adapter, train_vision_tower=prepared.options.train_vision_tower)  # by default
    if adapter.language_model:  # a wrapper's packed text rows: document positions as its masks read them
        pass_packed_positions(model.get_submodule(adapter.language_model))
    if adapter.moe:  # expert weights tp > 1 stores as packed halves: checkpoints hold that layout on every mesh
        mark_packed_experts(model, adapter, opts)
    _record(prepared, mesh, slices, ep_mesh, lora=lora)


def _parallelize(prepared: Prepared, slices: MeshSlices, ep_mesh: DeviceMesh | None) -> None:
    """TP, partial-gradient fusion, compile, cp, ep and FSDP2, in that order; the record completed."""
    model, adapter, opts, o = prepared.model, prepared.adapter, prepared.opts, prepared.options
    dp_mesh, tp_mesh = slices.dp, slices.tp
    record = record_of(model)  # attached by _ready
    if o.activation_checkpointing:
        enable_activation_checkpointing(model)
    fsdp = dp_mesh is not None and (dp_mesh.size() > 1 or o.mp_policy is not None)
    tp = tp_mesh.size() > 1  # at tp=1 the model stays plain torch (a 1-rank DTensor pays per-op dispatch)
    if tp:
        with keep_frozen(model):  # some styles re-register parameters as trainable
            apply_tensor_parallel(model, adapter, tp_mesh, opts)
    whole = odd_dtype_params(model, adapter) if fsdp else set()  # kept whole on every dp rank
    if tp and adapter.moe:
        model.loss_function = local_loss_function(model.loss_function)
    if tp and o.fuse_partial_grads:
        units = list(model.get_submodule(adapter.layers_path)) if fsdp else []  # apply_fsdp's units
        record.partial_grads = install_partial_grad_reduction(model, units, tp_mesh, dp_mesh, fsdp=fsdp, outside=whole)
    if o.compile:
        for layer in model.get_submodule(adapter.layers_path):
            layer.compile()
    if slices.cp is not None:
        _install_context_parallel(model, adapter, slices.cp, tp_mesh.size())
    expert_params = apply_expert_parallel(model, adapter.layers_path, adapter.experts, ep_mesh) if ep_mesh else []
    if fsdp:
        apply_fsdp(
            model,
            adapter,
            dp_mesh,
            shard_mesh=slices.fsdp,
            mp_policy=o.mp_policy,
            reshard_after_forward=o.reshard_after_forward,
            ignored_params=(set(expert_params) | whole) or None,
            averaged=whole,
            fused=o.fuse_partial_grads and tp,
        )
    flags = (fsdp, o.compile, o.activation_checkpointing, _names(model, whole))
    _mark_parallelized(model, prepared.given, *flags)


def _install_context_parallel(model: nn.Module, adapter: Adapter, cp: DeviceMesh, tp: int) -> None:
    """cp's attention, input split and checks (:mod:`hf_tp.context`), and a wrapper's DeepStack
    features added to this rank's tokens (:mod:`hf_tp.multimodal.deepstack`)."""
    install_context_parallel(model, adapter.layers_path, cp, tp)
    shard_deepstack(model.get_decoder())


def _record(
    prepared: Prepared, mesh: DeviceMesh, slices: MeshSlices, ep_mesh: DeviceMesh | None, **fields
) -> ParallelRecord:
    """The record of this call (:mod:`hf_tp.core.record`): meshes, plans, options; filled in as
    parallelize goes."""
    model, adapter, opts = prepared.model, prepared.adapter, prepared.opts
    names, meshes = mesh.mesh_dim_names or (), {"tp": slices.tp}
    if slices.dp is not None:  # every dp rank (both HSDP dims), without cp
        meshes["dp"] = mesh["dp"] if "dp" in names else slices.dp
    meshes |= {d: mesh[d] for d in ("cp", "dp_replicate") if d in names}
    if ep_mesh is not None:
        meshes["ep"] = ep_mesh["ep"]
    record = ParallelRecord(
        model_type=model.config.model_type,
        adapter=prepared.origin,
        options=opts,
        meshes=meshes,
        layers_path=adapter.layers_path,
        layer_plan=dict(adapter.layer_plan(opts)),
        top_plan=dict(adapter.top_plan(opts)),
        passengers=tuple(adapter.passengers),
        stage=getattr(facts_of(model), "stage", None),  # a pipeline stage's cut (hf_tp.pipeline.pipeline_split)
        **fields,
    )
    attach(model, record)  # parallelize's steps fill it in; complete once it returns
    return record


def _mark_parallelized(model: nn.Module, outer: nn.Module, *flags) -> None:
    record = record_of(model)
    record.fsdp, record.compiled, record.activation_checkpointing, record.whole = flags
    record.complete = True  # a parallelize that stopped before changing the model may run again
    # HF's own generate cannot decode vocab-sharded logits: model.generate(...) now runs hf_tp's.
    model.generate = types.MethodType(_generate, model)
    if any(p.device.type == "meta" for p in model.parameters()):  # to_empty must keep the hooks
        keep_parameters_on_to_empty(*{id(m): m for m in (outer, model)}.values())
    record.overrides = overridden_methods(model)
    record.classes = replaced_classes(model)


def _generate(model: nn.Module, inputs=None, **kwargs):
    """``model.generate`` of a parallelized model: :func:`hf_tp.generate` with HF's signature."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError(
            "model.generate on a model parallelized by hf_tp needs input_ids (token ids); "
            "hf_tp.generate(model, input_ids, ...) documents what it takes"
        )
    return parallel_generate(model, input_ids, **kwargs)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """HF's per-decoder-layer checkpointing (non-reentrant: works with DTensor activations)."""
    check_dropout_recompute(model)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in recent transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _names(model: nn.Module, params: set[nn.Parameter]) -> tuple[str, ...]:
    ids = {id(p) for p in params}
    return tuple(n for n, p in model.named_parameters() if id(p) in ids)
