"""``hf-tp train --pp``: the CLI's loss and grad-norm curves equal plain single-process HF training on
the same global batches (packed documents with their own masks, clipping on), and a pp2 checkpoint
resumes at pp1 x tp2 on the uninterrupted curve (same parameter names at any pp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.helpers import tiny_config, tiny_model
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e
RUN = ["--seq-len", "15", "--max-steps", "4", "--lr", "3e-3", "--warmup-steps", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny untied Llama of 4 layers (the embedding and lm_head sit on different stages) with the
    default tokenizer, and the default corpus."""
    from transformers import AutoTokenizer

    from hf_tp.demo.assets import ensure_default_assets

    root = tmp_path_factory.mktemp("pp")
    assets = ensure_default_assets(root / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    config = tiny_config("llama", num_hidden_layers=4, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tiny_model(config).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    return root / "llama", assets.data_file


def test_pp2_trains_on_plain_hf_curve_and_resumes_at_pp1_tp2(untied, tmp_path) -> None:
    model_dir, data = untied
    want_losses, want_norms = reference_losses(
        str(model_dir), str(data), seq_len=15, global_batch=4, steps=4, lr=3e-3, warmup_steps=1
    )
    base = ["--model", str(model_dir), "--dataset", str(data), *RUN]
    out = tmp_path / "run"
    # pp2 (1F1B, 2 micro-steps of 2 rows, each 2 pipeline micro-batches of 1 row; per-layer recompute)
    # for 2 steps with a checkpoint, then pp1 x tp2 (4 rows at once) to the end
    pp = ["--pp", "2", "--tp", "1", "--dp", "1", "--batch-size", "2", "--grad-accum", "2", "--activation-checkpointing"]
    proc = hf_tp_train(*base, *pp, "--output-dir", str(out), "--max-steps", "2", "--save-every", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pp 2 (1f1b)" in proc.stdout
    proc = hf_tp_train(*base, "--output-dir", str(out), "--tp", "2", "--dp", "1", "--batch-size", "4", "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = metrics(out)
    losses = [r["loss"] for r in got]
    norms = [r["grad_norm"] for r in got]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(losses + norms, want_losses + want_norms, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (losses, want_losses, norms, want_norms)
