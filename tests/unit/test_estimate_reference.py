"""`hf-tp estimate --objective dpo`: the frozen reference copy's weights (the policy's parameter
shards again, no gradients or optimizer state) and its no-grad forward counted; adapters-off,
precomputed and SimPO add no memory; a pair is two rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_tp.cli.main import main
from hf_tp.estimate.estimate_run import estimate, reference_cost
from tests.unit.test_estimate import tiny_dir, tiny_llama  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def tiny_tp2():
    config = tiny_llama()
    return config, estimate(config, tp=2, dp=1, seq_len=64, batch_size=4, dtype="fp32")


def test_the_frozen_copy_adds_its_shards_and_its_forward(tiny_tp2) -> None:
    config, est = tiny_tp2
    cost = reference_cost(est, config, "dpo")
    assert cost.kind == "frozen copy" and cost.compute == pytest.approx(1 / 3)
    # its fp32 shards: half of every weight matrix at tp=2, the 5 RMSNorm weights (256 each) whole
    norms = (2 * 2 + 1) * 256
    assert cost.weights == est.state.parameters == 4 * (est.num_params - norms) // 2 + 4 * norms
    assert cost.state == est.state.total + cost.weights
    assert cost.forward > 0 and cost.peak >= est.peak.total + cost.weights
    for objective, precompute, kind in (("dpo", True, "precomputed"), ("simpo", False, "none")):
        other = reference_cost(est, config, objective, precompute)
        assert (other.kind, other.weights, other.peak, other.state) == (kind, 0, est.peak.total, est.state.total)


def test_cli_counts_pairs_as_two_rows_and_the_reference(tiny_dir: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    argv = [
        "estimate",
        "--model",
        str(tiny_dir),
        "--tp",
        "2",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--dtype",
        "fp32",
    ]
    assert main([*argv, "--objective", "dpo", "--lora-r", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] == 4 and out["reference"]["kind"] == "adapters off" and out["reference"]["weights"] == 0
    assert main([*argv, "--objective", "dpo", "--world-size", "2"]) == 2  # (refused before any simulation)
    err = capsys.readouterr().err.strip()
    assert "frozen reference copy is counted for one layout" in err and "\n" not in err
