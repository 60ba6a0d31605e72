"""`--lora-*` settings: parsed into TrainConfig, checked before any rank starts."""

from __future__ import annotations

import pytest

from hf_tp.run.config import TrainConfig


def test_lora_targets_parse() -> None:
    assert TrainConfig(lora_r=8).lora_targets() == "all-linear"
    assert TrainConfig(lora_r=8, lora_target_modules="q_proj, v_proj").lora_targets() == ["q_proj", "v_proj"]
    TrainConfig(lora_r=16, lora_alpha=32, lora_dropout=0.05).validate()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(lora_r=-1), r"--lora-r must be a non-negative integer"),
        (dict(lora_r=4, lora_alpha=0), r"--lora-alpha must be positive"),
        (dict(lora_r=4, lora_dropout=1.0), r"--lora-dropout must be in \[0, 1\)"),
        (dict(lora_r=4, lora_target_modules=" , "), r"--lora-target-modules is empty"),
        (dict(lora_dropout=0.1), r"--lora-alpha/--lora-dropout need --lora-r"),
    ],
)
def test_bad_lora_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw).validate()
