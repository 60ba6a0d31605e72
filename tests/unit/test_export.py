"""hf-tp export's messages about what a path is, and how the model card names a run's sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tp.checkpoint.hf_folder import describe_source, resolve_checkpoint


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


def test_no_whole_checkpoint_advice_fits_the_command(tmp_path: Path) -> None:
    """Export's advice names what export takes (hf-tp export has no --resume); training's stays."""
    from hf_tp.checkpoint.checkpoint_dirs import MARKER
    from hf_tp.checkpoint.integrity import newest_good_checkpoint

    ckpt = tmp_path / "run" / "checkpoints" / "step-1"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text("step 1\n")  # published, but its trainer_state.json is lost
    with pytest.raises(
        ValueError, match=r"is whole \(step-1: trainer_state.json is missing or not valid JSON\); "
    ) as e:
        resolve_checkpoint(tmp_path / "run")
    assert str(e.value).endswith(
        "; restore one from a copy, then export it by its path (OUTPUT_DIR/checkpoints/step-N)"
    )
    with pytest.raises(ValueError) as e:
        newest_good_checkpoint(tmp_path / "run", lambda line: None)
    assert str(e.value).endswith("; restore one, or start again without --resume in a new --output-dir")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".metadata").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"incomplete checkpoint \(no COMPLETE marker: its save did not finish\); export"
    ):
        resolve_checkpoint(tmp_path / "half")
