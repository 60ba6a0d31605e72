"""A run saved before the package moved into floors (hf_tp at 7b8672b) resumes with today's code:
its ``config.yaml`` loads, its checkpoint's fingerprint matches, and steps 3 and 4 give the losses
that release logged when it trained the same 4 steps without a stop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import hf_tp_train, metrics

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run_7b8672b"
SAVED_ASSETS, SAVED_RUN = "/root/.cache/hf_tp/default-tiny-llama-v1", "/tmp/oldrun"
pytestmark = pytest.mark.e2e


def test_a_run_saved_by_an_earlier_layout_resumes_on_its_curve(tmp_path: Path) -> None:
    from hf_tp.demo.assets import ensure_default_assets

    assets = ensure_default_assets(tmp_path / "assets").model_dir.parent  # the same files, built here
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    ckpt = run / "checkpoints" / "step-2"
    for path in (run / "config.yaml", run / "history.jsonl", ckpt / "trainer_state.json"):
        path.write_text(path.read_text().replace(SAVED_ASSETS, str(assets)).replace(SAVED_RUN, str(run)))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # the size record of the moved file
    manifest["sizes"]["trainer_state.json"] = (ckpt / "trainer_state.json").stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = hf_tp_train("--config", str(run / "config.yaml"), "--resume", "--max-steps", "4", "--no-tensorboard")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr + proc.stdout
    want = json.loads((FIXTURE / "uninterrupted_4_steps.json").read_text())["losses"]
    got = {str(m["step"]): m["loss"] for m in metrics(run) if "loss" in m}
    for step in ("3", "4"):
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])
