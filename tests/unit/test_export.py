"""hf-tp export's messages about what a path is, and how the model card names a run's sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tp.checkpoint.export import describe_source, resolve_checkpoint


def test_messages_say_what_the_path_is(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^.*/missing does not exist \(expected a run's OUTPUT_DIR"):
        resolve_checkpoint(tmp_path / "missing")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"the run in .*/run saved no checkpoint; train with --save-every N .*"):
        resolve_checkpoint(run)
    (run / "checkpoints" / ".tmp-step-2").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*checkpoints \(half-written ones are ignored\)"):
        resolve_checkpoint(run)
    with pytest.raises(ValueError, match=r"^not a checkpoint: "):
        resolve_checkpoint(tmp_path)


def test_model_card_names_sources_not_machine_paths(tmp_path: Path) -> None:
    from hf_tp.demo.assets import ASSETS_NAME

    assert describe_source("Qwen/Qwen2-0.5B", "model") == ("Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B")
    snapshot = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2-0.5B/snapshots/abc123"
    assert describe_source(snapshot, "model") == ("Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B")
    embedded = f"/home/u/.cache/hf_tp/{ASSETS_NAME}/model"
    assert describe_source(embedded, "model") == ("hf_tp's embedded tiny Llama (random init)", None)
    assert describe_source(f"/x/{ASSETS_NAME}/corpus.txt", "dataset")[0] == "hf_tp's embedded generated toy corpus"
    (tmp_path / "my-model").mkdir()
    assert describe_source(str(tmp_path / "my-model"), "model") == ("local model `my-model`", None)
