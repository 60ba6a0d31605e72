"""A run's directory: --overwrite moves the earlier run aside (never deletes it, never lets a
later --resume pick up its checkpoints), a resume sets stale metrics aside, the record appends."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from hf_tp.checkpoint.checkpoint_dirs import MARKER, complete_checkpoints
from hf_tp.run.config import TrainConfig
from hf_tp.run.run_dir import REPLACED, holds_run, replace_earlier_run, supersede_metrics, write_run_record
from hf_tp.train.setup import accept


def earlier_run(out: Path) -> dict[str, bytes]:
    """A finished run (metrics, config, a published checkpoint, TensorBoard logs, an export) beside
    a file of the user's; returns the run's files and their bytes."""
    files = {
        "metrics.jsonl": b'{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n',
        "config.yaml": b"tp: 2\n",
        "checkpoints/step-2/trainer_state.json": b'{"step": 2}',
        f"checkpoints/step-2/{MARKER}": b"step 2\n",
        "tensorboard/events.out": b"\x00\x01",
        "export/model.safetensors": b"weights",
    }
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    (out / "notes.txt").write_text("the user's own file\n")
    return files


def test_overwrite_moves_the_earlier_run_aside_whole(tmp_path: Path) -> None:
    out = tmp_path / "run"
    files = earlier_run(out)
    assert complete_checkpoints(out)  # what --resume and hf-tp export OUTPUT_DIR look through
    moved = replace_earlier_run(out)
    assert moved is not None and moved.parent == out / REPLACED
    for name, data in files.items():  # every byte kept, in the same layout
        assert (moved / name).read_bytes() == data, name
    assert (out / "notes.txt").read_text() == "the user's own file\n"  # not hf_tp's: left in place
    assert not holds_run(out)
    # A later --resume (or hf-tp export OUTPUT_DIR) finds no checkpoint of the replaced run.
    assert complete_checkpoints(out) == []
    # A second --overwrite gets a folder of its own next to the first.
    earlier_run(out)
    second = replace_earlier_run(out)
    assert second is not None and second != moved and (moved / "metrics.jsonl").exists()
    assert replace_earlier_run(tmp_path / "empty") is None


def test_a_resume_sets_stale_records_aside_and_appends_to_the_history(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    records = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3, 4)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "lo')
    assert supersede_metrics(out / "metrics.jsonl", 2) == 3  # steps 3, 4 and a torn last line
    kept = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert kept == [1, 2]
    aside = (out / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in aside[:2]] == [3, 4] and aside[2] == '{"step": 5, "lo'
    assert supersede_metrics(out / "metrics.jsonl", 2) == 0
    cfg = TrainConfig(output_dir=str(out)).resolve()
    write_run_record(out, cfg, 0, None)
    write_run_record(out, cfg, 2, out / "checkpoints" / "step-2")
    history = [json.loads(ln) for ln in (out / "history.jsonl").read_text().splitlines()]
    assert [(h["start_step"], h["resumed_from"]) for h in history] == [(0, None), (2, str(out / "checkpoints/step-2"))]
    assert history[1]["layout"] == {"tp": 2, "cp": 1, "dp": 2, "ep": 1, "dp_replicate": 1, "pp": 1, "nnodes": 1}


def test_acceptance_writes_the_record_and_says_where_the_earlier_run_went(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    earlier_run(out)
    cfg = TrainConfig(output_dir=str(out), overwrite=True).resolve()
    accept(SimpleNamespace(cfg=cfg, out=out, start_step=0, resumed_from=None))
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"hf-tp: --overwrite: the earlier run in {out} (metrics, config, 1 checkpoint) was moved to "
    )
    assert (out / "config.yaml").read_text().startswith("model: null") and not (out / "metrics.jsonl").exists()
    assert len((out / "history.jsonl").read_text().splitlines()) == 1
