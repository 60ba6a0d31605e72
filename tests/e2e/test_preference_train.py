"""`hf-tp train --objective dpo` end to end at tp2: the frozen reference built and sharded like the
policy, TRL's metrics in metrics.jsonl, the first step's loss exactly ln 2 (policy = reference),
the loss falling and held-out pairs evaluated; tests/unit/test_preference.py holds the parity with TRL and across layouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import hf_tp_train, metrics

pytestmark = pytest.mark.e2e
NAMES = ["ada", "bob", "cy", "dee"]
CITIES = ["paris", "rome", "oslo", "lima"]


def tiny_pairs_run(tmp_path: Path, **config) -> Path:
    """A tiny tied Llama with a chat tokenizer in ``tmp_path/model`` (``config``: its overrides) and
    pairs in TRL's conversational preference format in ``tmp_path/pairs.jsonl`` (returned)."""
    from tests.chat_data import chat_tokenizer
    from tests.helpers import tiny_config, tiny_model

    tok = chat_tokenizer()
    model_config = tiny_config("llama", tied=True, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **config)
    tiny_model(model_config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [
        {
            "prompt": [{"role": "user", "content": f"hi , i am {n} . where should i go ?"}],
            "chosen": [{"role": "assistant", "content": f"hello {n} , go to {c} ."}],
            "rejected": [{"role": "assistant", "content": f"i am {n} ."}],
        }
        for n in NAMES
        for c in CITIES[:2]
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_dpo_at_tp2_logs_trl_metrics_and_learns(tmp_path) -> None:
    data = tiny_pairs_run(tmp_path)
    out = tmp_path / "run"
    flags = ["--objective", "dpo", "--tp", "2", "--dp", "1", "--batch-size", "4", "--seq-len", "32"]
    proc = hf_tp_train(
        "--model", str(tmp_path / "model"), "--dataset", str(data), "--output-dir", str(out), *flags,
        "--max-steps", "4", "--lr", "1e-2", "--warmup-steps", "0", "--no-tensorboard", "--eval-split", "0.25",
        "--eval-every", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "global batch 4 preference pairs" in proc.stdout + proc.stderr
    records = [r for r in metrics(out) if r.get("split") != "eval"]
    evals = [r for r in metrics(out) if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_pairs"] == 2 for r in evals)
    assert evals[-1]["eval_rewards/margins"] > 0 and "eval_logps/rejected" in evals[-1]
    names = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"}
    assert all(names | {"logps/rejected"} <= set(r) for r in records)
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and records[0]["rewards/margins"] == 0
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["rewards/margins"] > 0
