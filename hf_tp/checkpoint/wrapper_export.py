"""Export of a multimodal wrapper's run: trained tensors from the checkpoint, frozen ones from the
model folder the run read.

A checkpoint holds only trainable tensors (:func:`hf_tp.checkpoint.dcp._train_state`); a wrapper
trained on text leaves its vision tower and projector frozen, so the export reads them from the
run's model folder as they were (byte for byte where the export keeps their dtype) and writes the
whole wrapper under its own class and tensor names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hf_tp.checkpoint.safe_load import SafeReader
from hf_tp.checkpoint.stream import GroupReader, _read_group


def frozen_from_source_reader(ckpt: Path, model: torch.nn.Module, run: dict[str, Any]) -> GroupReader:
    """For :func:`hf_tp.checkpoint.stream.write_shards`: one module's tensors, from the checkpoint
    where it holds them, else from the run's model folder (``model`` on the meta device)."""
    from hf_tp.checkpoint.load import file_index, file_keys
    from hf_tp.core.model_source import local_model_dir

    if not run.get("model"):
        raise ValueError(f"{ckpt} does not record the model folder its run read; its frozen weights are there")
    base_dir = local_model_dir(run["model"])
    files = {k: base_dir / f for k, (f, _) in (file_index(base_dir) or {}).items()}
    in_file = file_keys(model, set(files))
    reader = SafeReader(ckpt)
    metadata = reader.read_metadata()
    hf = model.state_dict()

    def read(group: list[str]) -> dict[str, torch.Tensor]:
        saved = [k for k in group if f"model.{k}" in metadata.state_dict_metadata]
        out = _read_group(reader, metadata, hf, saved) if saved else {}
        for key in (k for k in group if k not in out):
            if key not in in_file:
                raise ValueError(f"neither {ckpt} nor the model folder {base_dir} holds {key}")
            with safe_open(str(files[in_file[key]]), framework="pt") as st:
                out[key] = st.get_tensor(in_file[key])
        return out

    return read
