"""Sharded loading: a meta-device model, parallelized, then each rank reads only its slices of the
HF safetensors files, so host memory per process stays near model size / (tp*dp)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from accelerate import init_empty_weights
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import PretrainedConfig

from hf_tp.core.model_source import model_from_config, text_config_of
from hf_tp.moe.expert_files import FusedSource, conversion_transforms, fused_sources, load_fused
from hf_tp.moe.expert_styles import hf_shapes
from hf_tp.parallel.materialize import to_empty_keeping_parameters
from hf_tp.parallel.tp import embeddings_tied


def safetensors_keys(model_dir: Path) -> set[str] | None:
    """Tensor names in a folder's safetensors files (header reads only); None if it has none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return keys


def build_empty(config: PretrainedConfig) -> torch.nn.Module:
    """The model with parameters on the meta device and real buffers (rotary tables are computed,
    not loaded, so they must not be left uninitialised); a multimodal wrapper as its own class."""
    with init_empty_weights(include_buffers=False):
        model = model_from_config(config, dtype=torch.float32)
    if getattr(config, "tie_word_embeddings", False):
        # init_empty_weights re-creates each Parameter on meta, which unties them.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def file_keys(model: torch.nn.Module, keys: set[str]) -> dict[str, str]:
    """Model state-dict key -> the safetensors key that holds it.

    transformers 5 keeps some families' files under older names and renames them on load
    (GPT-NeoX saves its ``lm_head`` as ``embed_out``); DCP's HF reader reads by the file's names,
    so the same pure renames are applied here (transformers' own mapping, not a copy of it)."""
    try:
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion mappings: names are as saved
        return {k: k for k in keys}
    if text_config_of(model.config) is not None:
        return _wrapper_file_keys(model, keys)
    transforms = conversion_transforms(model)
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        name = key
        for rename in renames:
            name, _ = rename.rename_source_key(name)
        out.setdefault(name, key)
    return out


def _wrapper_file_keys(model: torch.nn.Module, keys: set[str]) -> dict[str, str]:
    """:func:`file_keys` of a multimodal wrapper: its files keep each sub-model under older names
    (``language_model.model.*``), which transformers renames per sub-model on load; the same
    renames here, asked of transformers (its whole-model mapping and its prefix rule)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    # Asked of a fresh meta copy: FSDP2 renames the classes (FSDPLlava...), and transformers looks
    # mappings up by class name first.
    with torch.device("meta"):
        fresh = model_from_config(model.config)
    renames = [t for t in get_model_conversion_mapping(fresh) if not isinstance(t, WeightConverter)]
    names = dict.fromkeys(fresh.state_dict(), True)
    out: dict[str, str] = {}
    for key in keys:
        out.setdefault(rename_source_key(key, renames, [], model.base_model_prefix, names)[0], key)
    return out


def materialize_and_load(
    model: torch.nn.Module, model_dir: Path, device: torch.device, fused: dict[str, FusedSource] | None = None
) -> None:
    """Allocate the (already parallelized) meta parameters on ``device`` and fill each rank's
    shards straight from the safetensors files: DCP's HF reader for the tensors the files hold
    by name, :mod:`hf_tp.moe.expert_files` for the ``fused`` experts (:func:`sliced_sources`)."""
    index = file_index(model_dir)
    if index is None:
        raise ValueError(f"no safetensors files in {model_dir}; sharded loading needs safetensors weights")
    fused = dict(fused or {})
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    tied = embeddings_tied(model)
    to_empty_keeping_parameters(model, device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    # A LoRA model: the factors are not in the files (initialised by the caller); a wrapped base
    # projection's weight is the file's under its own name (peft adds ``.base_layer``).
    state = {k.replace(".base_layer.", "."): v for k, v in get_model_state_dict(model).items() if ".lora_" not in k}
    fused = {k: v for k, v in fused.items() if k in state}  # a pipeline stage holds some layers' experts only
    in_file = file_keys(model, set(index))
    tied_alias = "lm_head.weight" if tied else None
    missing = sorted(k for k in state if k not in in_file and k != tied_alias and k not in fused)
    if missing:
        raise ValueError(f"the safetensors files in {model_dir} lack {len(missing)} weights, e.g. {missing[:3]}")
    packed = hf_shapes(model)  # fused tensors the files hold whole, stored by hf_tp as packed halves
    for k, v in state.items():
        if k in in_file and k not in fused and tuple(v.shape) != index[in_file[k]][1] == packed.get(k):
            fused[k] = FusedSource(((in_file[k],),), stacked=False)
    state = {in_file[k]: v for k, v in state.items() if k in in_file and k not in fused}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path=str(model_dir)))
    load_fused(model, fused, model_dir, {k: f for k, (f, _) in index.items()})


def file_index(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """Tensor name -> (file name, shape) over a folder's safetensors files (header reads only);
    None if it has none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                out[key] = (f.name, tuple(st.get_slice(key).get_shape()))
    return out


def sliced_sources(model: torch.nn.Module, model_dir: Path) -> dict[str, FusedSource] | None:
    """How each rank can read just its slices of the (meta) model's parameters: every parameter
    is a tensor of the folder's safetensors files up to transformers' renames, or a fused expert
    tensor stacked from one tensor per expert (returned: name -> its file tensors); None if some
    parameter is neither (then ``from_pretrained`` loads the whole model)."""
    index = file_index(model_dir) or {}
    shapes = {k: shape for k, (_, shape) in index.items()}
    in_file = file_keys(model, set(index))
    fused = fused_sources(model, shapes) if conversion_transforms(model) else {}
    tied = "lm_head.weight" if embeddings_tied(model) else None
    for name, param in model.named_parameters(remove_duplicate=False):
        name = name.replace(".base_layer.", ".")
        if name in fused or name == tied:
            continue
        if name not in in_file or tuple(param.shape) != shapes[in_file[name]]:
            return None
    return fused
