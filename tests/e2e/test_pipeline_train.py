"""``hf-tp train --pp``: the CLI's loss and grad-norm curves equal plain single-process HF training on
the same global batches (packed documents with their own masks, clipping on, gradient accumulation,
activation checkpointing). A checkpoint resumed across pp: tests/e2e/test_pipeline_torchrun.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.helpers import tiny_config, tiny_model
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e
RUN = ["--seq-len", "15", "--max-steps", "3", "--lr", "3e-3", "--warmup-steps", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama of 4 layers whose lm_head is tied to the embedding (a copy on the first and the
    last stage, their gradients summed, counted once in the clipped norm) with the default
    tokenizer, and the default corpus."""
    from transformers import AutoTokenizer

    from hf_tp.demo.assets import ensure_default_assets

    root = tmp_path_factory.mktemp("pp")
    assets = ensure_default_assets(root / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    config = tiny_config("llama", tied=True, num_hidden_layers=4, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tiny_model(config).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    return root / "llama", assets.data_file


def test_pp2_trains_on_plain_hf_curve(tied_llama, tmp_path) -> None:
    model_dir, data = tied_llama
    want_losses, want_norms = reference_losses(
        str(model_dir), str(data), seq_len=15, global_batch=4, steps=3, lr=3e-3, warmup_steps=1
    )
    # pp2 1F1B: 2 micro-steps of 2 rows, each 2 pipeline micro-batches of 1 row; per-layer recompute
    pp = ["--pp", "2", "--tp", "1", "--dp", "1", "--batch-size", "2", "--grad-accum", "2", "--activation-checkpointing"]
    out = tmp_path / "run"
    proc = hf_tp_train("--model", str(model_dir), "--dataset", str(data), *RUN, *pp, "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pp 2 (1f1b)" in proc.stdout
    got = metrics(out)
    losses, norms = [r["loss"] for r in got], [r["grad_norm"] for r in got]
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(losses + norms, want_losses + want_norms, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (losses, want_losses, norms, want_norms)
