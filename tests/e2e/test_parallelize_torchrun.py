"""End to end with real processes (torchrun, gloo): the README demo and an early error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_demo_trains_three_steps_matching_plain_hf() -> None:
    proc = torchrun(2, "examples/parallelize_demo.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max relative loss difference" in proc.stdout


def test_heads_not_divisible_stop_every_rank_at_once(tmp_path: Path) -> None:
    model_dir = tmp_path / "qwen2-7-heads"
    tiny_model(tiny_config("qwen2", heads=7, kv_heads=1, hidden_size=112)).save_pretrained(model_dir)
    start = time.monotonic()
    proc = torchrun(2, "examples/parallelize_demo.py", "--model", str(model_dir), timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    message = "tp must divide num_attention_heads (7) of this qwen2 model, got tp=2; valid tp values for it are: 1"
    assert proc.stderr.count(f"ValueError: {message}") == 2, proc.stderr[-3000:]
    assert "RuntimeError: shape" not in proc.stderr
    assert elapsed < 60


@pytest.mark.parametrize(
    "cases",
    [
        [
            # Qwen3: the per-head q/k norm weights' Partial gradients under FSDP2 on a 2-D mesh, with
            # two backward passes per step (FSDP2 reduce-scatters and hf_tp's fused all-reduce adds twice).
            {"family": "qwen3", "tp": 2, "dp": 2, "b": 4, "pad": None, "s": 9, "micro": 2},
            # One KV head for tp=2: k_proj/v_proj whole on both tp ranks, sharded over dp by FSDP2.
            {"family": "qwen2", "tied": True, "tp": 2, "dp": 2, "b": 4, "pad": None, "s": 9, "kv": 1},
        ],
        # torch.compile per decoder layer (inductor, CPU): same numbers as eager HF.
        [{"family": "llama", "tp": 2, "dp": 1, "compile": True, "pad": None, "s": 12}],
    ],
    ids=["tp2_dp2", "tp2_compile"],
)
def test_parity_with_real_processes(cases: list[dict]) -> None:
    # 2-D meshes run in real processes only: torch's threaded process group mismatches
    # collectives issued on two sub-groups in a row (dp then tp), which real gloo does not.
    # The cases of one world size share one launch.
    world = cases[0]["tp"] * cases[0].get("dp", 1)
    proc = torchrun(world, "tests/e2e/parity_worker.py", json.dumps(cases))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("PARITY OK") == len(cases), proc.stdout[-3000:]
