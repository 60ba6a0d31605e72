"""`hf-tp train` on families served by the generic plan: tp=2 x dp=2 gives plain HF's loss curve.

GPT-NeoX (its own module paths, attention called positionally, packed per-head query_key_value,
parallel residual) and OLMo 2 (post-norms only, q/k norms over the whole projection width) are the
two farthest from Llama's layout; Qwen3-MoE runs its experts split over tp (expert tensor parallelism)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_train_cli import COMMON, STEPS, hf_tp_train, metrics
from tests.family_grid import grid_config
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("model_type", ["gpt_neox", "olmo2", "qwen3_moe"])
def test_generic_family_trains_like_plain_hf(model_type: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tp.demo.assets import ensure_default_assets

    assets = ensure_default_assets(tmp_path / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    config = grid_config(model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir = tmp_path / model_type
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    out = tmp_path / "run"
    flags = ["--tp", "2", "--dp", "2", "--batch-size", "2", "--output-dir", str(out), *COMMON]
    if config.model_type == "qwen3_moe":  # packed expert halves go back to HF's layout on export
        flags.append("--export-on-finish")
    proc = hf_tp_train("--model", str(model_dir), "--dataset", str(assets.data_file), *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = [r["loss"] for r in metrics(out)]
    want, _ = reference_losses(
        str(model_dir), str(assets.data_file), seq_len=15, global_batch=4, steps=STEPS, lr=3e-3, warmup_steps=2
    )
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"{model_type} step {step + 1}: loss {g} vs plain HF {w}"
    if model_type == "qwen3_moe":
        # The export loads with plain transformers, with the trained weights in HF's layout.
        exported = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32)
        start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        moved = exported.model.layers[0].mlp.experts.gate_up_proj - start.model.layers[0].mlp.experts.gate_up_proj
        assert moved.shape == start.model.layers[0].mlp.experts.gate_up_proj.shape and moved.abs().max() > 0
