"""`hf-tp train` on a mixture of experts: Qwen3-MoE trains with its experts placed on ranks with
--ep 2 (tp 1 x dp 2), is killed, resumes at tp 2 x dp 1 (no ep), gives plain HF's loss curve and
exports a folder plain transformers loads. (Generic families through the same loop, one launch for
several: tests/e2e/test_families_fit.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from hf_tp.checkpoint.checkpoint_dirs import latest_checkpoint
from tests.e2e.test_train_cli import COMMON, STEPS, hf_tp_train, metrics
from tests.family_grid import grid_config
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e


def _family_model(model_type: str, tmp_path, **overrides):
    """A tiny random model of the family, saved with the embedded default's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tp.demo.assets import ensure_default_assets

    assets = ensure_default_assets(tmp_path / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    config = grid_config(
        model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **overrides
    )
    torch.manual_seed(0)
    model_dir = tmp_path / model_type
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir, assets


def test_moe_expert_parallel_resumes_with_another_ep_and_exports(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    # The router's aux loss on (weight 0.5): plain HF's loss on the whole global batch includes it.
    model_dir, assets = _family_model("qwen3_moe", tmp_path, output_router_logits=True)
    out = tmp_path / "run"
    flags = ["--model", str(model_dir), "--dataset", str(assets.data_file), "--output-dir", str(out), *COMMON]
    # Two ranks (expert TP inside EP on four: tests/e2e/test_families_fit.py).
    mesh = ["--tp", "1", "--dp", "2", "--batch-size", "2"]
    # Killed (rank 1) at the start of step 4, after the step-3 checkpoint: a kill-a-rank resume.
    os.environ["HF_TP_CRASH"] = "train:4:1"
    try:
        first = hf_tp_train(*flags, *mesh, "--ep", "2", "--save-every", "3")
    finally:
        del os.environ["HF_TP_CRASH"]
    assert first.returncode != 0 and latest_checkpoint(out).name == "step-3"
    # Resumed on another tp: the checkpoint holds the packed expert layout tp 2 stores (hf_tp/checkpoint/packed.py).
    second = hf_tp_train(*flags, "--tp", "2", "--dp", "1", "--batch-size", "4", "--resume", "--export-on-finish")
    assert second.returncode == 0, second.stderr[-4000:]
    records = metrics(out)
    got = [r["loss"] for r in records]
    want, _ = reference_losses(
        str(model_dir), str(assets.data_file), seq_len=15, global_batch=4, steps=STEPS, lr=3e-3, warmup_steps=2
    )
    assert len(got) == STEPS and all(r["aux_loss"] > 0 for r in records)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step + 1}: loss {g} vs plain HF {w}"
    # The export loads with plain transformers, experts back in HF's [experts, 2 x intermediate, hidden].
    exported = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new, old = (m.model.layers[0].mlp.experts.gate_up_proj for m in (exported, start))
    assert new.shape == old.shape and (new - old).abs().max() > 0
