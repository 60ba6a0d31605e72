"""``generate`` on a model prepared by :func:`hf_tp.parallelize`, token for token equal to plain HF.

With ``loss_parallel=True`` the lm_head returns logits as a ``DTensor`` sharded on the vocab, which
HF's decoding loop cannot use: its ``torch.argmax(scores, dim=-1)`` fails inside DTensor (torch
2.13 all-gathers the per-shard maxima with the negative dim unnormalised: ``RuntimeError: shape
'[1, 2, 2, 1]' is invalid``), and logits processors that ``gather``/``scatter`` (repetition
penalty) fail on mixed Tensor/DTensor. Everything else works as is: KV caches hold each rank's
heads, and the sequence-parallel DTensor residual handles prompts of any length, left padding and
one-token decode steps (uneven sequence shards). So decoding needs only replicated logits, which a
forward hook on the lm_head gives for the duration of the call. Sampling also needs the tp ranks
to draw the same tokens (their inputs must stay identical), so they share one RNG state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.generation.utils import GenerateOutput

from hf_tp.compat.torch_distributed import flatten_mesh, root_mesh
from hf_tp.compat.torch_fsdp import fsdp_lazy_init
from hf_tp.core.model_source import text_config_of
from hf_tp.core.record import record_of

__all__ = ["eval_mode", "generate", "generation_mode", "replicated_logits"]


def model_meshes(model: nn.Module) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(dp_mesh, tp_mesh)`` of a parallelized model: its record's (:mod:`hf_tp.core.record`), else read from
    its embedding (None: not sharded).

    The embedding weight lives on the tp mesh, or on the 2-D (dp, tp) mesh while FSDP2 holds it
    sharded; between forwards FSDP2 may leave it unsharded (tp mesh only, e.g. the root unit), so
    the dp dim is read from the mesh that mesh was sliced from: the one given to ``parallelize``.
    """
    record = record_of(model)
    if record is not None:
        return record.meshes.get("dp"), record.meshes["tp"]
    weight = model.get_input_embeddings().weight
    if not isinstance(weight, DTensor):
        return None, None
    root = root_mesh(weight.device_mesh)
    if root.ndim == 2 and set(root.mesh_dim_names or ()) == {"dp", "tp"}:
        return root["dp"], root["tp"]
    if root.ndim == 3 and root.mesh_dim_names == ("dp", "cp", "tp"):
        return root["dp"], root["tp"]  # the cp ranks of a dp rank share its rows
    if root.ndim == 3 and root.mesh_dim_names == ("dp_replicate", "dp_shard", "tp"):
        return flatten_mesh(root["dp_replicate", "dp_shard"], "dp"), root["tp"]  # HSDP: dp is both dims
    return None, root  # parallelize accepts only these: 3-D (dp, cp, tp), HSDP, 2-D (dp, tp) or 1-D tp


def comm_device(mesh: DeviceMesh) -> torch.device:
    """The device that collectives on ``mesh`` take tensors on (the current GPU for nccl)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode, then give each back its own ``training`` flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _replicate(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.full_tensor() if isinstance(output, DTensor) else output


@contextlib.contextmanager
def replicated_logits(model: nn.Module) -> Iterator[None]:
    """Make the lm_head return plain full-vocab logits (all-gathered over tp) inside the block.

    Used for decoding, where HF's argmax, logits processors and sampling need every vocab entry;
    a no-op for a model parallelized with ``loss_parallel=False`` (its logits are already whole).
    """
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(_replicate) if head is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


@contextlib.contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode plus replicated logits, so that ``model.generate(...)`` works inside the block.

    The model's training flags come back and the hook goes away on exit. Prefer
    :func:`generate`, which also checks the inputs and shares the sampling RNG over tp.
    """
    with eval_mode(model), replicated_logits(model):
        yield


def fingerprint(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A small int64 summary of shapes and values; equal inputs give equal fingerprints."""
    acc = torch.zeros(1, dtype=torch.int64)
    for t in tensors:
        values = [-1]
        if t is not None:
            flat = t.detach().reshape(-1)
            flat = (flat.double() * 2**20).round().long() if flat.is_floating_point() else flat.long()  # pixels
            weights = torch.arange(flat.numel(), device=flat.device) % 65_521 + 1
            values = [t.ndim, *t.shape, *torch.stack([flat.sum(), (flat * weights).sum()]).tolist()]
        for v in values:
            acc = acc * 1_000_003 + v  # int64 wraps around: still order- and value-sensitive
    return acc


def check_same_on_tp(tp_mesh: DeviceMesh, tensors: Sequence[torch.Tensor | None], what: str) -> None:
    """Raise the same ``ValueError`` on every tp rank unless all of them got equal ``tensors``.

    TP needs identical inputs on the ranks of a tp group; different ones give wrong results
    silently (the vocab-sharded embedding sums partial rows of different tokens).
    """
    mine = fingerprint(tensors).to(comm_device(tp_mesh))
    gathered = [torch.empty_like(mine) for _ in range(tp_mesh.size())]
    dist.all_gather(gathered, mine, group=tp_mesh.get_group())
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise ValueError(
            f"the {tp_mesh.size()} tp ranks got different {what}; every rank of a tp group must pass the same"
        )


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


@contextlib.contextmanager
def shared_rng(tp_mesh: DeviceMesh) -> Iterator[None]:
    """Sample with the first tp rank's RNG state on every tp rank, so all draw the same tokens.

    The first tp rank's state advances as in plain HF (seed it as you would seed plain HF); the
    other ranks get their own states back on exit.
    """
    device = comm_device(tp_mesh)
    own = _rng_states(device)
    shared = []
    for state in own:
        buf = state.to(device, copy=True)  # .to() would alias a CPU state: keep ours intact
        dist.broadcast(buf, group=tp_mesh.get_group(), group_src=0)
        shared.append(buf.cpu())
    _set_rng_states(device, shared)
    try:
        yield
    finally:
        if tp_mesh.get_local_rank() != 0:
            _set_rng_states(device, own)


def passengers_in_step(model: nn.Module, dp_mesh: DeviceMesh, kwargs: dict) -> None:
    """Under FSDP2 (dp > 1) a wrapper's vision tower and projector are gathered over dp when they
    run: every dp rank must pass images, or none (one ``ValueError`` on every rank otherwise). The
    root unit is set up first: transformers may encode the images through the wrapper's
    ``get_image_features`` before its first forward, which FSDP2 would take for the root."""
    mine = torch.tensor([int(any(k.startswith("pixel_values") and v is not None for k, v in kwargs.items()))])
    mine = mine.to(comm_device(dp_mesh))
    gathered = [torch.empty_like(mine) for _ in range(dp_mesh.size())]
    dist.all_gather(gathered, mine, group=dp_mesh.get_group())
    if len({int(g) for g in gathered}) > 1:
        raise ValueError(
            "some dp ranks passed images to generate and others did not; FSDP2 gathers the vision tower "
            "and projector on every dp rank together: give every dp rank images, or generate text-only "
            "prompts in a call of their own"
        )
    fsdp_lazy_init(model)  # (a no-op once set up)


def _samples(model: nn.Module, kwargs: dict) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    return bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs,
) -> torch.LongTensor | GenerateOutput:
    """``model.generate(input_ids, attention_mask=..., **generate_kwargs)`` for a parallelized model.

    Call it on every rank. The ranks of a tp group must pass the same ``input_ids``,
    ``attention_mask`` and kwargs (checked for the tensors: one small all-gather); dp ranks may
    pass different rows (with FSDP2, HF's ``synced_gpus`` keeps them stepping together). Greedy
    output equals plain single-process HF token for token. With ``do_sample=True`` the tp ranks
    sample with the first tp rank's RNG state (CPU, and CUDA on GPU meshes).

    The model runs in eval mode with an lm_head hook that all-gathers the vocab-sharded logits
    (only the last position: HF asks for ``logits_to_keep=1``); both are undone on return, so a
    training loop can continue right after. Returns what ``model.generate`` returns; a returned
    cache holds each rank's own heads, and hidden states (if asked for) are DTensors.
    """
    if getattr(record_of(model), "stage", None) is not None:
        raise ValueError(
            "generate on a pipeline stage: one stage holds only some layers; export the checkpoint "
            "(hf-tp export) and generate with the whole model, or parallelize it without pp"
        )
    if getattr(record_of(model), "cp", None) is not None:
        raise ValueError(
            "hf_tp.generate does not decode with context parallelism (each rank holds part of every row); "
            "generate from a model parallelized on a mesh without cp, e.g. after hf-tp export"
        )
    dp_mesh, tp_mesh = model_meshes(model)
    if attention_mask is not None:
        generate_kwargs["attention_mask"] = attention_mask
    wrapper = text_config_of(getattr(model, "config", None)) is not None
    if wrapper and isinstance(model, FSDPModule) and dp_mesh is not None and dp_mesh.size() > 1:
        passengers_in_step(model, dp_mesh, generate_kwargs)
    rng: contextlib.AbstractContextManager = contextlib.nullcontext()
    if tp_mesh is not None and tp_mesh.size() > 1:
        images = [v for v in generate_kwargs.values() if isinstance(v, torch.Tensor)]  # pixel_values, ...
        check_same_on_tp(tp_mesh, [input_ids, attention_mask, *images], "input_ids/attention_mask/images")
        if _samples(model, generate_kwargs):
            rng = shared_rng(tp_mesh)
    # type(model).generate: the class's method, even if an instance attribute shadows it.
    with generation_mode(model), rng:
        return type(model).generate(model, input_ids, **generate_kwargs)
