"""MetricsLogger: train and eval records in metrics.jsonl, TensorBoard and Weights & Biases (offline)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from hf_tp.train.metrics import MetricsLogger

TRAIN = {"step": 1, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "tokens_per_sec": 100.0}
EVAL = {"step": 1, "split": "eval", "eval_loss": 2.0, "eval_perplexity": 7.39, "eval_tokens": 30}


class FakeRun:
    """What hf_tp calls on the object ``wandb.init`` returns."""

    def __init__(self, **kwargs) -> None:
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, values))

    def finish(self) -> None:
        self.finished = True


def test_records_go_to_every_reporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, 1, enabled=True, report_to=("tensorboard", "wandb"), run_config={"lr": 1e-3})
    logger.log(TRAIN)
    logger.log_eval(EVAL)
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [TRAIN, EVAL]
    assert any((tmp_path / "tensorboard").iterdir())
    (run,) = runs
    assert run.init["config"] == {"lr": 1e-3} and run.init["dir"] == str(tmp_path) and run.finished
    assert run.logged[0] == (1, {f"train/{k}": v for k, v in TRAIN.items() if k != "step"})
    assert run.logged[1] == (1, {"eval/loss": 2.0, "eval/perplexity": 7.39, "eval/tokens": 30})


def test_report_to_none_writes_only_metrics_jsonl(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, 1, enabled=True, report_to=())
    logger.log(TRAIN)
    logger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
