"""Loading at scale: each rank of ``hf-tp train --model`` reads only its slices of a multi-file
safetensors checkpoint, so its host memory is bounded by its share of the model, not the model.
Runs scripts/measure_sharded_loading.py's worker (the script records the table in docs/checkpoints.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_sharded_loading.py"


def test_each_rank_holds_about_its_share_while_loading(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("measure_sharded_loading", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hidden, vocab = 768, 4000
    size, files = script.build_model(tmp_path / "model", 4, hidden, vocab, "16MB")  # 125 MiB fp32
    assert files >= 8
    largest = vocab * hidden * 4 / 2**20  # the embedding (and the untied lm_head): 11.7 MiB
    ranks = script.run_mesh(tmp_path / "model", "sharded", 1, 2)  # tp 1 x dp 2: FSDP2 halves
    for rank, got in enumerate(ranks):
        share = got["local_params_mib"]
        assert share == pytest.approx(size / 2, rel=0.01), (rank, got)
        # Its shards plus what is staged while one tensor is read (measured: share + 9 MiB), far
        # below the 125 MiB a whole-model load holds.
        assert got["anon_peak_mib"] < share + 2 * largest, (rank, got, size)


def test_a_moe_checkpoint_with_one_tensor_per_expert_loads_at_a_rank_s_share(tmp_path: Path) -> None:
    # Hub MoE checkpoints hold each expert's projections apart; transformers stacks them into fused
    # 3-D experts on load. Each rank reads just its box of every fused tensor, a file tensor's
    # slice at a time: never the whole model (which from_pretrained holds on every rank).
    spec = importlib.util.spec_from_file_location("measure_sharded_loading", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    size, files = script.build_model(tmp_path / "model", 4, 512, 4000, "16MB", moe=True)  # 124 MiB fp32
    assert files >= 6
    largest = 4000 * 512 * 4 / 2**20  # the embedding (and the untied lm_head): 7.8 MiB
    ranks = script.run_mesh(tmp_path / "model", "sharded", 1, 2)
    for rank, got in enumerate(ranks):
        share = got["local_params_mib"]
        assert share == pytest.approx(size / 2, rel=0.01), (rank, got)
        assert got["anon_peak_mib"] < share + 2 * largest, (rank, got, size)
