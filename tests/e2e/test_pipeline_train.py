"""``hf-tp train --pp``: the CLI's loss and grad-norm curves equal plain single-process HF training on
the same global batches (packed documents with their own masks, clipping on, gradient accumulation,
activation checkpointing). A checkpoint resumed across pp: tests/e2e/test_pipeline_torchrun.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.helpers import tiny_config, tiny_model
from tests.reference_loop import reference_run

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
    want_losses, want_norms, want_eval = reference_run(
        str(model_dir), str(data), seq_len=15, global_batch=4, steps=3, lr=3e-3, warmup_steps=1,
        eval_split=0.25, eval_steps=(3,), eval_rows=4,
    )  # fmt: skip
    # pp2 1F1B: 2 micro-steps of 2 rows, each 2 pipeline micro-batches of 1 row; per-layer recompute;
    # a held-out quarter of the documents, its first global batch evaluated through the stages after step 3
    pp = ["--pp", "2", "--tp", "1", "--dp", "1", "--batch-size", "2", "--grad-accum", "2", "--activation-checkpointing"]
    held_out = ["--eval-split", "0.25", "--eval-every", "3", "--eval-batches", "1"]
    out = tmp_path / "run"
    proc = hf_tp_train(
        "--model", str(model_dir), "--dataset", str(data), *RUN, *pp, *held_out, "--output-dir", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pp 2 (1f1b)" in proc.stdout
    got = [r for r in metrics(out) if r.get("split") != "eval"]
    losses, norms = [r["loss"] for r in got], [r["grad_norm"] for r in got]
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(losses + norms, want_losses + want_norms, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (losses, want_losses, norms, want_norms)
    evals = {r["step"]: r["eval_loss"] for r in metrics(out) if r.get("split") == "eval"}
    assert evals.keys() == want_eval.keys() and abs(evals[3] - want_eval[3]) <= 1e-5 * want_eval[3], (evals, want_eval)
