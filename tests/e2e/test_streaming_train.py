"""`hf-tp train --streaming` end to end: a run resumed from a checkpoint reads exactly the batches the
uninterrupted run read (the data position is in the checkpoint)."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.test_train_cli import chat_setup, hf_tp_train, metrics  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e
RUN = ["--seq-len", "31", "--lr", "3e-3", "--warmup-steps", "1", "--report-to", "none"]


def test_streaming_resume_equals_the_uninterrupted_run(chat_setup, tmp_path) -> None:  # noqa: F811
    """--streaming: 6 steps in one process (checkpoints after steps 3 and 6); then the step-3 checkpoint
    resumed on two dp ranks, each reading the stream and keeping its half of every global batch, reads
    exactly the batches the uninterrupted run read: the same losses."""
    model_dir, data = chat_setup
    flags = ["--model", str(model_dir), "--dataset", str(data), "--streaming", *RUN]
    flags += ["--max-steps", "6", "--save-every", "3", "--keep-checkpoints", "0"]
    whole = tmp_path / "whole"
    proc = hf_tp_train(*flags, "--batch-size", "4", "--output-dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = [r["loss"] for r in metrics(whole)]
    assert len(want) == 6

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    proc = hf_tp_train(*flags, "--tp", "1", "--dp", "2", "--batch-size", "2", "--output-dir", str(resumed), "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "step-3" in proc.stdout
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for step, (row, w) in enumerate(zip(rows, want, strict=True), 1):
        assert abs(row["loss"] - w) <= 1e-5 * abs(w), f"step {step}: resumed loss {row['loss']} vs uninterrupted {w}"
