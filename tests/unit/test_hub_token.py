"""The Hub token never reaches a file hf_tp writes: config.yaml, history.jsonl, metrics (and
what goes to TensorBoard / W&B), a checkpoint's trainer state and model files, or an export's model
card, marker and config. No setting holds a token; these pieces run here with ``HF_TOKEN`` set and
every file they write is searched for it."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from hf_tp.checkpoint.checkpoint_dirs import load_trainer_state
from hf_tp.checkpoint.dcp import _write_rank0_files
from hf_tp.checkpoint.hf_folder import export_checkpoint
from hf_tp.run.config import TrainConfig
from hf_tp.run.run_dir import write_run_record
from hf_tp.train.metrics import MetricsLogger
from tests.unit.test_export_stream import fake_checkpoint

TOKEN = "hf_" + "kQ7vXr2LmN9pTz4bWc8dYe1fGh5jUs3aVo"  # the shape of a Hub access token


@pytest.fixture
def token_set(monkeypatch: pytest.MonkeyPatch) -> str:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(name, TOKEN)
    from huggingface_hub import get_token

    assert get_token() == TOKEN  # what a push, a download or a gated model would use
    return TOKEN


def files_holding(folder: Path, secret: str) -> list[str]:
    return [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]


def test_the_hub_token_is_written_nowhere(token_set: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    cfg = TrainConfig(model="Qwen/Qwen2-0.5B", dataset="corpus.jsonl", output_dir=str(out)).resolve()
    assert not any("token" in name for name in TrainConfig.field_names())  # no setting to hold one
    out.mkdir()
    cfg.save(out / "config.yaml")  # the settings file the launcher hands the ranks
    write_run_record(out, cfg, 0, None)

    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64,
    )  # fmt: skip

    wandb_inits: list[dict] = []
    fake = types.ModuleType("wandb")
    run = types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    fake.init = lambda **kw: wandb_inits.append(kw) or run
    with monkeypatch.context() as patch:  # what W&B would be sent
        patch.setitem(sys.modules, "wandb", fake)
        logger = MetricsLogger(out, 1, enabled=True, report_to=("tensorboard", "wandb"), run_config=cfg.to_dict())
        logger.log({"step": 1, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "tokens_per_sec": 100.0})
        logger.close()
    assert wandb_inits and token_set not in repr(wandb_inits)
    ckpt, model = fake_checkpoint(out / "checkpoints", config)
    state = {"fingerprint": {"seed": 0}, "config": cfg.to_dict(), "base_model": cfg.model}
    _write_rank0_files(ckpt, 1, state, [model.config], model)  # what hf-tp train saves beside the shards
    assert load_trainer_state(ckpt)["config"]["model"] == "Qwen/Qwen2-0.5B"
    export = export_checkpoint(ckpt, tmp_path / "export", dtype="fp32")  # the model card names the Hub id
    assert "base_model: Qwen/Qwen2-0.5B" in (export / "README.md").read_text()
    assert torch.load(ckpt / "rng.pt", weights_only=True)  # plain data
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"config.yaml", "history.jsonl", "metrics.jsonl", "trainer_state.json", "README.md"} <= {
        p.name for p in written
    }
    assert files_holding(tmp_path, token_set) == []
