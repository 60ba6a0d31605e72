"""``hf-tp train --pp 2 --objective dpo``: the stages run torch's schedule and the objective gives the
last stage its loss; the reference is a frozen copy pipelined like the policy. The loss, grad-norm
and reward-margin curves equal plain single-process HF DPO (tests/reference_loop.py) on the same
global batches of pairs, with gradient accumulation and a tied lm_head (a copy on either stage)."""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_preference_train import tiny_pairs_run
from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.reference_loop import reference_dpo_run

pytestmark = pytest.mark.e2e


def test_pp2_dpo_trains_on_plain_hf_dpo_curve(tmp_path) -> None:
    data = tiny_pairs_run(tmp_path, num_hidden_layers=4)
    model = str(tmp_path / "model")
    want_losses, want_norms, want_margins = reference_dpo_run(
        model, str(data), seq_len=32, global_batch=4, steps=3, lr=1e-2, warmup_steps=0
    )
    # pp2 1F1B: 2 micro-steps of 2 pairs, each 2 pipeline micro-batches of one pair (its two rows)
    pp = ["--pp", "2", "--tp", "1", "--dp", "1", "--batch-size", "2", "--grad-accum", "2"]
    out = tmp_path / "run"
    proc = hf_tp_train(
        "--model", model, "--dataset", str(data), "--output-dir", str(out), "--objective", "dpo", *pp,
        "--seq-len", "32", "--max-steps", "3", "--lr", "1e-2", "--warmup-steps", "0", "--no-tensorboard",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "pp 2 (1f1b)" in proc.stdout and "a frozen copy of the model" in proc.stderr
    got = metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy starts as its reference
    losses, norms, margins = ([r[k] for r in got] for k in ("loss", "grad_norm", "rewards/margins"))
    for g, w in zip(losses + norms, want_losses + want_norms, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (losses, want_losses, norms, want_norms)
    for g, w in zip(margins, want_margins, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w) + 1e-7, (margins, want_margins)
    assert losses[-1] < losses[0] and margins[-1] > 0
