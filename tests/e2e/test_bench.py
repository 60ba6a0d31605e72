"""The GPU benchmark script runs end to end on CPU (tiny model): both sides produce a row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_TP_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/bench_train.py",
            "--smoke",
            "--out",
            str(out),
            "--profile-dir",
            str(tmp_path / "prof"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["plain"]
    for side in ("hf_tp", "trainer"):
        assert rows[0][side]["tokens_per_sec"] > 0 and rows[0][side]["peak_mem_mib"] > 0
    assert "| tiny | 64 | 1 | plain |" in proc.stdout  # model, seq, batch, variant
    # Both sides profiled their last two steps (left out of the timing).
    for name in ("hf_tp-64-plain", "trainer-64-plain"):
        assert (tmp_path / "prof" / f"{name}.ops.txt").read_text().startswith("2 steps, ")


def test_fused_loss_bench_smoke() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "scripts/bench_fused_loss.py", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        ln.split("|")[1:-1] for ln in proc.stdout.splitlines() if ln.startswith("| fused") or ln.startswith("| unf")
    ]
    assert len(rows) == 8
    for row in rows:  # every variant computes the same gradients as HF's path (fp32 on CPU)
        assert float(row[3]) < 1e-6 and float(row[4]) < 1e-6, row


def test_partial_grads_bench_smoke() -> None:
    # tp-only (no FSDP2): unfused, AdamW all-reduces each of the 4L+1 = 9 Partial gradients 3 times.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["scripts/bench_partial_grads.py", "--tp", "2", "--dp", "1", "--layers", "2", "--hidden", "64"]
    cmd += ["--seq-len", "16", "--steps", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fuse_partial_grads=False" in proc.stdout and "all-reduces in backward + AdamW: 27" in proc.stdout
    assert "fused (one all-reduce)" in proc.stdout and "all-reduces in backward + AdamW: 1\n" in proc.stdout
