"""`hf-tp train` on multi-turn chat data (system, user, assistant and tool turns) with assistant-only
labels, packed with document masking, and a held-out evaluation: tp2 x dp2 (one launch of 4 ranks)
and tp1 x dp1 (one process, no launcher) give the loss curve and eval losses of plain
single-process HF on the same data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chat_data import chat_tokenizer, conversations
from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.helpers import tiny_config, tiny_model
from tests.reference_loop import reference_run

pytestmark = pytest.mark.e2e
STEPS, SEQ_LEN = 5, 31  # 31: rows padded to a multiple of tp=2
RUN = ["--seq-len", str(SEQ_LEN), "--max-steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "1"]
EVAL = ["--eval-split", "0.25", "--eval-every", "2", "--report-to", "none"]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama with a ChatML tokenizer, and a jsonl of conversations in a `messages` column."""
    root = tmp_path_factory.mktemp("chat")
    tok = chat_tokenizer()
    config = tiny_config("llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    tiny_model(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    return root / "model", data


def test_chat_with_eval_gives_plain_hf_curves_at_tp2_dp2_and_tp1_dp1(chat_setup, tmp_path) -> None:
    model_dir, data = chat_setup
    want_loss, want_norm, want_eval = reference_run(
        str(model_dir),
        str(data),
        seq_len=SEQ_LEN,
        global_batch=2,
        steps=STEPS,
        lr=3e-3,
        warmup_steps=1,
        eval_split=0.25,
        eval_steps=(2, 4, 5),
    )
    assert want_loss[-1] < want_loss[0]
    for name, mesh in {
        "tp2_dp2": ["--tp", "2", "--dp", "2", "--batch-size", "1"],
        "tp1_dp1": ["--batch-size", "2"],
    }.items():
        out = tmp_path / name
        proc = hf_tp_train(
            "--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out), *RUN, *EVAL, *mesh
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = metrics(out)
        train = [r for r in rows if r.get("split") != "eval"]
        evals = {r["step"]: r for r in rows if r.get("split") == "eval"}
        assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and sorted(evals) == [2, 4, 5]
        assert all(r["target_tokens"] < r["tokens"] for r in train)  # assistant-only: prompts are no targets
        for step, (row, w, n) in enumerate(zip(train, want_loss, want_norm, strict=True), 1):
            assert abs(row["loss"] - w) <= 1e-5 * abs(w), f"{name} step {step}: loss {row['loss']} vs plain HF {w}"
            assert abs(row["grad_norm"] - n) <= 1e-4 * abs(n), (
                f"{name} step {step}: grad norm {row['grad_norm']} vs {n}"
            )
        for step, w in want_eval.items():
            got = evals[step]["eval_loss"]
            assert abs(got - w) <= 1e-5 * abs(w), f"{name} eval after step {step}: {got} vs plain HF {w}"


def test_streaming_resume_equals_the_uninterrupted_run(chat_setup, tmp_path) -> None:
    """--streaming: 6 steps (checkpoints after steps 3 and 6); then the step-3 checkpoint resumed with
    the global batch split another way (2 micro-steps of 2) reads exactly the batches the uninterrupted
    run read: the same losses. Both in one process each (the split over dp ranks is the batch plan's,
    tested in tests/unit/test_streaming.py and on every mesh by test_train_cli)."""
    import shutil

    model_dir, data = chat_setup
    flags = ["--model", str(model_dir), "--dataset", str(data), "--streaming", "--report-to", "none", *RUN]
    flags += ["--max-steps", "6", "--save-every", "3", "--keep-checkpoints", "0"]
    whole = tmp_path / "whole"
    proc = hf_tp_train(*flags, "--batch-size", "4", "--output-dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = [r["loss"] for r in metrics(whole)]
    assert len(want) == 6

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    proc = hf_tp_train(*flags, "--tp", "2", "--dp", "2", "--batch-size", "2", "--output-dir", str(resumed), "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "step-3" in proc.stdout
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for step, (row, w) in enumerate(zip(rows, want, strict=True), 1):
        assert abs(row["loss"] - w) <= 1e-5 * abs(w), f"step {step}: resumed loss {row['loss']} vs uninterrupted {w}"
