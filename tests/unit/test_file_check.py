"""Issue 51 case 5: a model folder's safetensors against the model its config builds, from the
headers alone and through transformers' key mapping: no false alarm for tied weights, buffers,
per-expert files stacked into fused experts, renamed keys or multimodal wrappers; the missing,
mis-shaped and unexpected tensors named (the CLI's line: tests/unit/test_bad_inputs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from hf_tp.checkpoint.file_check import weight_mismatch
from tests.family_grid import grid_config
from tests.helpers import tiny_config
from tests.wrapper_grid import wrapper_config, wrapper_model


def saved(folder: Path, model) -> Path:
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama-tied", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "gpt_neox"])
def test_what_save_pretrained_writes_matches(tmp_path: Path, family: str) -> None:
    config = tiny_config("llama", tied=True) if family == "llama-tied" else grid_config(family)
    folder = saved(tmp_path / family, AutoModelForCausalLM.from_config(config))
    assert weight_mismatch(folder, AutoConfig.from_pretrained(folder)) is None


def test_a_wrappers_files_match(tmp_path: Path) -> None:
    folder = saved(tmp_path / "llava", wrapper_model(wrapper_config("llava")))
    assert weight_mismatch(folder, AutoConfig.from_pretrained(folder)) is None


def test_per_expert_files_missing_a_layer_name_its_fused_experts(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = saved(tmp_path / "moe", AutoModelForCausalLM.from_config(grid_config("qwen3_moe")))
    tensors = load_file(folder / "model.safetensors")
    assert any(".experts.0.gate_proj." in k for k in tensors)  # one tensor per expert in the files
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, folder / "model.safetensors")
    problem = weight_mismatch(folder, AutoConfig.from_pretrained(folder))
    assert problem is not None and problem.startswith("lack 11 weights: model.layers.1."), problem
