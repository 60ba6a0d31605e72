"""``hf-tp estimate`` on multimodal wrappers: built as ``hf-tp train`` builds them, the vision tower's
and projector's weights counted, the frozen tower without optimizer state (a text-only step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tp.cli.main import main
from hf_tp.estimate import estimate
from hf_tp.estimate.spec import image_load
from tests.image_grid import image_config
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
    image_config("gemma3").save_pretrained(tmp_path)  # 4 image tokens per 28x28 image
    args = ["estimate", "--model", str(tmp_path), "--tp", "2", "--dp", "2", "--seq-len", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "frozen, projector" in out and "give --images-per-row (and --image-size) to count them" in out
    assert main([*args, "--images-per-row", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "gemma3" and data["tower_params"] > 0 and data["projector_params"] > 0
    images = data["images"]
    assert (images["images_per_row"], images["image_size"], images["tower_tokens"], images["merged_tokens"]) == (
        3,
        28,
        4,
        4,
    )
    assert images["tower_working_set"] > 0 and images["projector_saved"] > 0 and images["merged_sequence"] > 0
    assert data["trainable_params"] == data["num_params"] - data["tower_params"]
    assert main([*args, "--lora-r", "4", "--json"]) == 0  # LoRA on the language model only
    lora = json.loads(capsys.readouterr().out)
    assert 0 < lora["trainable_params"] < data["trainable_params"] - data["projector_params"]


def qwen2_5_vl_7b_like():
    """Qwen2.5-VL-7B-Instruct's published sizes (its config.json), built offline."""
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28)
    text.update(num_key_value_heads=4, vocab_size=152064)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision)


def test_images_of_a_qwen2_5_vl_7b_like_checkpoint() -> None:
    config = qwen2_5_vl_7b_like()
    load = image_load(config, images_per_row=2, image_size=448, seq_len=4096, batch_size=1, tp=4, dtype="bf16")
    # 448 pixels: 32 x 32 patches of 14 in the tower, merged 2 x 2 into 256 tokens (Qwen's processor's count)
    assert (load.tower_tokens, load.merged_tokens) == (1024, 256)
    # per image, bf16: the tower's working set 1024 tokens x (5 x 1280 + 3420) values = 19.2 MiB; the
    # projector keeps its input (1024 x 1280) and two activations (256 x 3584 each, LLaVA-style) = 6 MiB
    assert load.tower_working_set == 2 * 1024 * 9820 * 2 and load.projector_saved == 2 * 6 * 2**20
    # the merged sequence's copy (4096 x 3584 bf16 = 28 MiB), and it and its gradient whole instead of a quarter
    assert load.merged_sequence == 28 * 2**20 + 2 * 21 * 2**20
    assert load.peak_extra == load.projector_saved + load.merged_sequence  # the tower's is transient
    lora = image_load(config, 2, 448, 4096, 1, 4, "bf16", projector_trains=False)  # frozen: nothing kept
    assert lora.projector_saved == 0 and lora.merged_sequence == load.merged_sequence
    with pytest.raises(ValueError, match=r"any size: give --image-size"):
        image_load(config, 2, 0, 4096, 1, 4, "bf16")
    with pytest.raises(ValueError, match=r"take 4096 tokens of the merged sequence, more than --seq-len 2048"):
        image_load(config, 16, 448, 2048, 1, 4, "bf16")


def test_images_on_a_fixed_size_tower_and_on_a_text_model() -> None:
    config = image_config("llava")  # a 28x28 CLIP tower
    with pytest.raises(ValueError, match=r"takes 28x28 images .*--image-size 448 does not apply"):
        image_load(config, 1, 448, 64, 1, 2, "bf16")
    assert image_load(config, 1, 0, 64, 1, 2, "bf16").tower_tokens == 4
    with pytest.raises(ValueError, match=r"needs a multimodal checkpoint with a vision tower; llama has none"):
        image_load(config.text_config, 1, 0, 64, 1, 2, "bf16")
