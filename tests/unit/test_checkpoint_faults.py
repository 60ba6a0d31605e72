"""Checkpoints under faults: a full disk during a save, and published checkpoints that a
filesystem damaged afterwards (a truncated or missing shard, unreadable metadata)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_tp.checkpoint.checkpoint_dirs import complete_checkpoints
from hf_tp.checkpoint.hf_folder import resolve_checkpoint
from hf_tp.checkpoint.integrity import damage, newest_good_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.save_worker", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_full_disk_stops_the_save_and_leaves_earlier_checkpoints_whole(saved) -> None:
    out, result = saved
    error = result["error"]
    assert error is not None and error.startswith("checkpoint step-3 could not be written to ")
    assert "a file-size limit (ulimit -f: 65536 bytes per file) was hit; " in error
    assert "GiB free, about " in error and "GiB needed (the size of step-2)" in error
    assert "earlier checkpoints are intact" in error and "--resume" in error
    assert [p.name for p in complete_checkpoints(out)] == ["step-1", "step-2"]
    assert not any(p.name.startswith(".tmp") for p in (out / "checkpoints").iterdir())  # nothing half-written left
    assert damage(out / "checkpoints" / "step-2") is None and damage(out / "checkpoints" / "step-1") is None


def test_damaged_checkpoints_are_named_and_skipped(saved, tmp_path) -> None:
    src, _ = saved
    out = tmp_path / "run"
    subprocess.run(["cp", "-r", str(src), str(out)], check=True)
    step1, step2 = out / "checkpoints" / "step-1", out / "checkpoints" / "step-2"
    shard = next(step2.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a node crash lost the tail of the file
    said: list[str] = []
    assert newest_good_checkpoint(out, said.append) == step1
    assert f"{shard.name} has 1000 bytes where the save wrote" in said[0] and "trying the one before" in said[0]
    assert said[1] == "hf-tp: using step-1, the newest checkpoint that is whole"
    assert resolve_checkpoint(out) == step1  # hf-tp export of the run dir falls back the same way
    with pytest.raises(ValueError, match=r"checkpoint .*step-2 is damaged \(__0_0.distcp has 1000 bytes"):
        resolve_checkpoint(step2)

    (step1 / ".metadata").write_bytes(b"\0" * (step1 / ".metadata").stat().st_size)  # same size, lost data
    assert damage(step1) == "its DCP metadata (.metadata) does not load (UnpicklingError)"
    with pytest.raises(
        ValueError, match=r"no checkpoint in .* is whole \(step-2: __0_0.distcp has 1000 .*step-1: its DCP"
    ):
        newest_good_checkpoint(out, said.append)
    shard.unlink()
    assert damage(step2) == f"{shard.name} is missing"
