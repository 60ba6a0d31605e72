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
from transformers import AutoModelForCausalLM, PretrainedConfig

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


def local_model_dir(model: str) -> Path:
    """A local folder holding the model's files (downloading config + safetensors from the Hub if needed)."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))


def build_empty(config: PretrainedConfig) -> torch.nn.Module:
    """The model with parameters on the meta device and real buffers (rotary tables are computed,
    not loaded, so they must not be left uninitialised)."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion mappings: names are as saved
        return {k: k for k in keys}
    # Looked up as transformers does (class name, then model_type), by the HF class: FSDP2 makes the
    # model an instance of a subclass of its own, which transformers would take for custom code.
    hf_class = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    transforms = get_checkpoint_conversion_mapping(hf_class.__name__)
    if transforms is None:
        transforms = get_checkpoint_conversion_mapping(model.config.model_type) or []
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        name = key
        for rename in renames:
            name, _ = rename.rename_source_key(name)
        out.setdefault(name, key)
    return out


def materialize_and_load(model: torch.nn.Module, model_dir: Path, device: torch.device) -> None:
    """Allocate the (already parallelized) meta parameters on ``device`` and fill each rank's
    shards straight from the safetensors files with DCP's HF reader."""
    keys = safetensors_keys(model_dir)
    if keys is None:
        raise ValueError(f"no safetensors files in {model_dir}; sharded loading needs safetensors weights")
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    tied = embeddings_tied(model)
    model.to_empty(device=device)
    if tied and not embeddings_tied(model):
        # A plain (tp=1, no FSDP) meta Parameter is replaced, not filled, by to_empty: re-tie.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    # A LoRA model: the factors are not in the files (initialised by the caller); a wrapped base
    # projection's weight is the file's under its own name (peft adds ``.base_layer``).
    state = {k.replace(".base_layer.", "."): v for k, v in get_model_state_dict(model).items() if ".lora_" not in k}
    in_file = file_keys(model, keys)
    tied_alias = "lm_head.weight" if tied else None
    missing = sorted(k for k in state if k not in in_file and k != tied_alias)
    if missing:
        raise ValueError(f"the safetensors files in {model_dir} lack {len(missing)} weights, e.g. {missing[:3]}")
    state = {in_file[k]: v for k, v in state.items() if k in in_file}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path=str(model_dir)))


def files_match_model(model: torch.nn.Module, model_dir: Path) -> bool:
    """Every parameter of the (meta) model is a tensor of the folder's safetensors files, up to
    transformers' renames: then each rank can read its shards directly. Fused 3-D expert weights
    are never read this way: hf_tp stores packed gate/up halves in another shape than the files
    (:mod:`hf_tp.styles.experts`), and MoE checkpoints often hold one tensor per expert."""
    if any(p.dim() == 3 for p in model.parameters()):
        return False
    in_file = file_keys(model, safetensors_keys(model_dir) or set())
    tied = "lm_head.weight" if embeddings_tied(model) else None
    return all(name in in_file or name == tied for name, _ in model.named_parameters(remove_duplicate=False))
