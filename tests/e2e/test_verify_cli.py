"""``hf-tp verify`` launched as users run it: ranks started through accelerate's launcher, a MoE
model's config from a local folder, expert parallelism over FSDP2 on CPU (gloo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.family_grid import grid_config
from tests.verify_grid import model_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_moe_expert_parallel_passes(tmp_path) -> None:
    folder = model_dir(tmp_path / "moe", grid_config("qwen3_moe", vocab_size=300))
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "verify", "--model", folder, "--device", "cpu"]
    cmd += ["--tp", "1", "--dp", "2", "--ep", "2", "--max-steps", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"timed out:\n{proc.communicate()[1][-3000:]}") from None
    assert proc.returncode == 0, out + err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("hf-tp verify: tp 1 x dp 2 (ep 2) on 2 cpu ranks vs one rank"), out
    assert lines[-1] == "hf-tp verify: 8 of 8 checks passed", out
    for name in ("logits", "gradients", "buffers", "AdamW steps", "checkpoint resume (tp ", "export round trip"):
        assert any(line.startswith("ok") and name in line for line in lines), (name, out)
