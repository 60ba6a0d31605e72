"""A rank's model: built on the meta device, parallelized, then filled with its own shards.

:func:`mixed_precision` and :func:`compute_dtype` are the loop's dtype policy, shared with the
estimate (:mod:`hf_tp.estimate.simulate`) so it sizes the step the loop runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers.utils import logging as hf_logging

from hf_tp.adapters import get_adapter
from hf_tp.checkpoint.load import build_empty, materialize_and_load, safetensors_keys, sliced_sources
from hf_tp.core.model_source import ModelSource, local_model_dir
from hf_tp.lora.peft_models import freeze_in_dtype, lora_init_state
from hf_tp.multimodal.passengers import describe as describe_passengers
from hf_tp.parallel import parallelize
from hf_tp.run.config import TrainConfig
from hf_tp.run.distributed import rank0_first
from hf_tp.run.validate import validate_model_config


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPUs unless ``--dtype fp32``; fp32 on CPU unless ``--dtype bf16``."""
    return torch.bfloat16 if cfg.compute_dtype_name(device.type) == "bf16" else torch.float32


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy | None:
    """FSDP2's bf16 compute with fp32 master weights and gradient reductions; None for fp32."""
    if dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def build_parallel_model(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """Build the model on the meta device, parallelize it, then let each rank read only its shards
    of the safetensors files (fp32 master weights). Folders without safetensors fall back to a
    full ``from_pretrained`` on every rank."""
    model, model_dir, fused = unparallelized_model(cfg, device)
    config = model.config
    lora = with_lora(model, cfg)
    if cfg.lora_r:  # the frozen base in the compute dtype: no fp32 master copy of weights never updated
        freeze_in_dtype(lora, compute_dtype(cfg, device))
    parallelize(
        lora,
        mesh,
        **parallelize_settings(cfg, device),
        train_vision_tower=cfg.train_vision_tower,
        compile=cfg.compile,
        ep=cfg.ep,
    )
    if fused is not None:
        materialize_and_load(model, model_dir, device, fused)
    if get_adapter(config).language_model and dist.get_rank() == 0:  # a multimodal wrapper: say what trains
        print(describe_passengers(model, get_adapter(config)), file=sys.stderr, flush=True)
    if cfg.lora_r:
        init_lora(model, lora_init_state(model, cfg.seed))
    return model


def parallelize_settings(cfg: TrainConfig, device: torch.device) -> dict:
    """The :func:`hf_tp.parallelize` settings a run's flags give (shared with pipeline stages)."""
    return dict(
        sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel,
        mp_policy=mixed_precision(compute_dtype(cfg, device)),
        activation_checkpointing=cfg.activation_checkpointing,
    )


def unparallelized_model(cfg: TrainConfig, device: torch.device) -> tuple[torch.nn.Module, Path, object]:
    """(model, its folder, fused sources): the model on the meta device with what
    :func:`materialize_and_load` reads its shards from, or (fused None) loaded whole on every rank when its files need a weight
    conversion that is not read by slices. In train mode."""
    if dist.get_rank() != 0:
        hf_logging.disable_progress_bar()  # one progress bar, not one per rank
    model_dir = rank0_first(lambda: local_model_dir(cfg.model))
    source = ModelSource.at(model_dir, cfg.trust_remote_code, say=None)  # the launcher warned once
    config = source.config
    validate_model_config(config, cfg.tp, cfg.seq_len, ep=cfg.ep)
    model = build_empty(config) if safetensors_keys(model_dir) is not None else None
    # Files whose tensors are the model's up to renames, or fused experts stacked from one tensor
    # per expert, are read slice by slice; any other conversion goes through from_pretrained.
    fused = sliced_sources(model, model_dir) if model is not None else None
    if model is not None and fused is None and dist.get_rank() == 0:
        print(
            f"hf-tp: {model_dir}'s safetensors need a weight conversion that is not read by slices (only renames "
            "and per-expert stacking are); every rank loads the whole model with from_pretrained",
            file=sys.stderr,
            flush=True,
        )
    if fused is None:
        model = source.load(dtype=torch.float32).to(device)
    model.train()
    return model, model_dir, fused


def with_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """``model`` wrapped in peft LoRA adapters (in place: ``model`` then holds ``lora.Linear``
    layers over its frozen projections) when ``cfg.lora_r`` > 0; else ``model``."""
    if not cfg.lora_r:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ValueError("--lora-r needs peft: pip install 'hf_tp[lora]'") from exc
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r
    passengers = get_adapter(model.config).passengers  # a multimodal wrapper: LoRA on its language model only
    outside = "|".join(re.escape(p) for p in passengers)
    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_targets(),
        exclude_modules=rf"(?:{outside})(?:\..*)?" if passengers else None,
    )
    return get_peft_model(model, config)


def init_lora(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every rank's LoRA factors from the same full initial ``state`` (:func:`lora_init_state` of
    the whole model), each rank keeping its shards of the factors ``model`` holds (a pipeline
    stage holds some layers' only)."""
    names = {name for name, _ in model.named_parameters()}
    state = {k: v for k, v in state.items() if k in names}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
