"""``hf-tp estimate`` on multimodal wrappers: built as ``hf-tp train`` builds them, the vision tower's
and projector's weights counted, the frozen tower without optimizer state (a text-only step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tp.cli.main import main
from hf_tp.estimate import estimate
from tests.wrapper_grid import wrapper_config


def test_llava_estimate_counts_the_tower_frozen_and_the_projector_trained() -> None:
    config = wrapper_config("llava")
    one = estimate(config, tp=1, dp=1, seq_len=64, batch_size=1, dtype="bf16")
    assert one.tower_params > 0 and one.projector_params > 0
    assert one.trainable_params == one.num_params - one.tower_params
    # fp32 master weights of everything, AdamW's two fp32 moments of the trainable parameters only
    # (plus its step counters): the frozen tower's state would add 8 bytes per tower parameter
    assert one.state.parameters == 4 * one.num_params
    assert 0 <= one.state.optimizer - 8 * one.trainable_params < 1024 < 8 * one.tower_params
    split = estimate(config, tp=2, dp=2, seq_len=64, batch_size=1, dtype="bf16")
    assert (split.tower_params, split.projector_params) == (one.tower_params, one.projector_params)
    assert split.state.total < one.state.total and split.sent_bytes("tp") > 0 and split.sent_bytes("dp") > 0


def test_cli_estimates_a_gemma3_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrapper_config("gemma3").save_pretrained(tmp_path)
    args = ["estimate", "--model", str(tmp_path), "--tp", "2", "--dp", "2", "--seq-len", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "frozen, projector" in out and "image activations and the merged image + text sequence" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "gemma3" and data["tower_params"] > 0 and data["projector_params"] > 0
    assert data["trainable_params"] == data["num_params"] - data["tower_params"]
    assert main([*args, "--lora-r", "4", "--json"]) == 0  # LoRA on the language model only
    lora = json.loads(capsys.readouterr().out)
    assert 0 < lora["trainable_params"] < data["trainable_params"] - data["projector_params"]
