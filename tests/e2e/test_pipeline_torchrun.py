"""Pipeline parallelism (``--pp``) with torch's schedules in real processes (torch's threaded
process group has no point-to-point send/recv): the loss curve and every weight after a few AdamW
steps equal plain single-process HF's. The cases of one world size share one launch."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_parallelize_torchrun import torchrun

pytestmark = pytest.mark.e2e

# Sliding windows (window 5 < 13 tokens) on layers whose types alternate across the stage cut:
# each stage's layers must keep their own attention type and mask.
_GEMMA3_WINDOWS = {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}

GRIDS = {
    "pp2": [
        {"family": "llama", "schedule": "gpipe"},
        {"family": "qwen2", "schedule": "interleaved1f1b", "virtual": 2, "microbatches": 4},
        {"family": "qwen3_moe", "schedule": "1f1b"},
        {"family": "gemma3_text", "schedule": "1f1b", "dtype": "float64", "overrides": _GEMMA3_WINDOWS},
    ],
    "pp2_tp2_and_pp2_dp2": [
        {"family": "llama", "schedule": "1f1b", "tp": 2},
        {"family": "qwen2", "schedule": "gpipe", "dp": 2},
    ],
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_pipeline_parity(name: str) -> None:
    cases = GRIDS[name]
    world = cases[0].get("pp", 2) * cases[0].get("tp", 1) * cases[0].get("dp", 1)
    proc = torchrun(world, "tests/e2e/pipeline_worker.py", json.dumps(cases))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("PIPELINE OK") == len(cases), proc.stdout[-3000:]
