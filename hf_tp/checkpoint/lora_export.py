"""Export of a LoRA run (``hf-tp train --lora-r``) as a peft adapter folder.

A LoRA checkpoint holds only the adapters (and their optimizer state); the frozen base stays in
the model folder it was read from. The export writes what ``PeftModel.from_pretrained(base, OUT)``
loads: ``adapter_config.json`` (peft's ``LoraConfig`` of the run) and ``adapter_model.safetensors``
with peft's key names (``base_model.model.<module>.lora_A.weight``, adapter name left out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hf_tp.checkpoint.safe_load import SafeReader, safe_load
from hf_tp.moe.expert_lora import is_param_wrapper, update_factors

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # the adapter name hf-tp train gives peft


def peft_key(model_key: str) -> str:
    """peft's saved name of a LoRA tensor of the HF model's state dict."""
    return PEFT_PREFIX + model_key.replace(f".{ADAPTER}.", ".")


def read_lora_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of the checkpoint, whole (DCP gathers the shards; no process group)."""
    reader = SafeReader(ckpt)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith("model.") and ".lora_" in key and hasattr(meta, "size")
    }
    if not state:
        raise ValueError(f"{ckpt} holds no LoRA tensors although its run trained with --lora-r")
    safe_load(state, ckpt, no_dist=True, reader=reader)
    return {key[len("model.") :]: t for key, t in state.items()}


def write_adapter(ckpt: Path, folder: Path, dtype: torch.dtype, run: dict[str, Any]) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of the run into ``folder``."""
    tensors = {peft_key(k): t.to(dtype).contiguous() for k, t in read_lora_tensors(ckpt).items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    lora_config(run).save_pretrained(str(folder))


def lora_config(run: dict[str, Any]):
    """peft's ``LoraConfig`` of the run."""
    from peft import LoraConfig

    targets = run.get("lora_target_modules") or "all-linear"
    return LoraConfig(
        r=run["lora_r"],
        lora_alpha=run.get("lora_alpha") or 2 * run["lora_r"],
        lora_dropout=run.get("lora_dropout") or 0.0,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        base_model_name_or_path=run.get("model"),
        task_type="CAUSAL_LM",
    )


def merged_reader(ckpt: Path, model: torch.nn.Module, run: dict[str, Any]):
    """For :func:`hf_tp.checkpoint.stream.write_shards`: the keys of one module -> their merged
    tensors, the base weight read from the run's model folder (one tensor at a time) plus
    ``alpha / r * lora_B @ lora_A`` where the run trained an adapter on it (peft's merge)."""
    from safetensors import safe_open

    from hf_tp.checkpoint.load import file_index, file_keys, sliced_sources
    from hf_tp.core.model_source import local_model_dir
    from hf_tp.moe.expert_files import read_whole

    base_dir = local_model_dir(run["model"])
    fused = sliced_sources(model, base_dir)
    if fused is None:
        raise ValueError(
            f"--merge reads the base weights from {base_dir}, whose safetensors do not hold the model's tensors "
            "up to renames and per-expert stacking; export the adapter and merge with peft's merge_and_unload"
        )
    files = {k: base_dir / f for k, (f, _) in file_index(base_dir).items()}
    in_file = file_keys(model, set(files))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    lora = read_lora_tensors(ckpt)
    scaling = (run.get("lora_alpha") or 2 * run["lora_r"]) / run["lora_r"]
    wrapped = {k: w for k, w in param_wrappers(model, run).items() if f"{w[0]}.lora_A.{ADAPTER}.weight" in lora}

    def read(group: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for key in group:
            if key in fused:  # experts stacked from one tensor per expert
                tensor = read_whole(base_dir, {k: f.name for k, f in files.items()}, fused[key], shapes[key]).float()
            else:
                with safe_open(str(files[in_file[key]]), framework="pt") as st:
                    tensor = st.get_tensor(in_file[key]).float()
            prefix = key.removesuffix(".weight")
            a, b = lora.get(f"{prefix}.lora_A.{ADAPTER}.weight"), lora.get(f"{prefix}.lora_B.{ADAPTER}.weight")
            if a is not None and b is not None:
                tensor = tensor + (b.float() @ a.float()) * scaling
            out[key] = tensor if key not in wrapped else tensor + wrapped_update(*wrapped[key], lora)
        return out

    return read


def param_wrappers(model: torch.nn.Module, run: dict[str, Any]) -> dict[str, tuple[str, torch.nn.Module]]:
    """HF key of each parameter the run's LoRA wraps in a peft ``ParamWrapper`` (``all-linear`` on a
    MoE model: routers, fused experts) -> (the wrapper's path, the wrapper), from the run's peft
    config applied to a meta copy of ``model`` (which parameter a nested wrapper holds is peft's choice)."""
    import copy

    from peft import get_peft_model

    if run.get("lora_target_modules") not in (None, "", "all-linear"):
        return {}  # (named modules: peft wraps no parameter)
    with torch.device("meta"):
        inner = get_peft_model(copy.deepcopy(model), lora_config(run)).base_model.model
    out = {}
    for path, module in inner.named_modules():
        if is_param_wrapper(module):
            owner = ".".join(p for p in path.split(".") if p != "base_layer")
            out[f"{owner}.{module.parameter_name}"] = (path, module)
    return out


def wrapped_update(path: str, wrapper: torch.nn.Module, lora: dict[str, torch.Tensor]) -> torch.Tensor:
    """The update peft's merge adds to the parameter ``wrapper`` (at ``path``) wraps, from the run's factors."""
    a, b = lora[f"{path}.lora_A.{ADAPTER}.weight"].float(), lora[f"{path}.lora_B.{ADAPTER}.weight"].float()
    lhs, rhs = update_factors(wrapper, a, b)
    return (lhs @ rhs) * wrapper.scaling[ADAPTER]
