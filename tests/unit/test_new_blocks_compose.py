"""The new blocks (issue 41) compose with context parallelism (tp2 x cp2), peft LoRA (tp2) and
activation checkpointing (tp2): a hyper-connection family, a per-layer mixer family, per-layer
embeddings and a new MoE layout, each against plain HF (LoRA: plain peft) on threads of one
process. The whole grid: ``python -m tests.compose_grid``."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING

from hf_tp.compat import family_refusal
from tests.compose_grid import run_compose

# Where cp cannot split the block by sequence: the one line parallelize refuses it with.
REFUSED = {
    ("nemotron_h", "cp"): "NemotronHMamba2Mixer at layers.0.mixer), which needs the whole sequence",
    ("deepseek_v4", "cp"): "DeepseekV4HCACompressor at layers.0.self_attn.compressor), which needs the whole sequence",
}
NAMES = ("deepseek_v4", "nemotron_h", "gemma4_text", "minimax_m3_vl_text")


def _case(name: str, mode: str):
    model_type = name.split("+")[0]
    later = model_type not in CONFIG_MAPPING or bool(family_refusal(model_type))
    return pytest.param(name, mode, marks=pytest.mark.skipif(later, reason=f"this transformers serves no {name}"))


@pytest.mark.parametrize(("name", "mode"), [_case(n, m) for n in NAMES for m in ("cp", "lora", "ac")])
def test_new_block_composes(name: str, mode: str) -> None:
    outcome = run_compose(name, mode)
    if (name, mode) in REFUSED:
        assert outcome.startswith("refused: cp=2") and REFUSED[name, mode] in outcome, outcome
        assert outcome.endswith("use --cp 1 (tensor parallelism still splits it)"), outcome
    else:
        assert outcome == "parity", outcome
