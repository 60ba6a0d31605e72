"""`hf-tp estimate --lora-r`: a LoRA run's per-rank memory (frozen base in the compute dtype, no
gradients or optimizer state for it; fp32 adapters with AdamW state), equal to a real measurement
of the same step, and the CLI flags."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import hf_tp
from hf_tp.cli.main import main
from hf_tp.estimate import estimate
from hf_tp.estimate.simulate import measure
from tests.unit.test_estimate import tiny_dir, tiny_llama  # noqa: F401 (tiny_dir is a fixture)

pytest.importorskip("peft")


def test_lora_estimate_matches_a_real_measurement_and_holds_no_base_state() -> None:
    config = tiny_llama()
    full = estimate(config, tp=1, dp=1, seq_len=128, batch_size=2, dtype="fp32")
    est = estimate(config, tp=1, dp=1, seq_len=128, batch_size=2, dtype="fp32", lora_r=8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = measure(config, hf_tp.build_mesh(tp=1, dp=1, device_type="cpu"), 128, 2, "fp32", lora_r=8)
    finally:
        dist.destroy_process_group()
    # equal up to a few scalar tensors (docs/estimate.md: 4-16 bytes)
    assert est.peak.total == pytest.approx(real.peak.total, abs=64)
    assert est.state.total == pytest.approx(real.state.total, abs=64)
    # every projection of 2 layers: (in + out) x r fp32 weights
    proj = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 512), (256, 512), (512, 256)]
    assert est.trainable_params == 2 * sum(8 * (i + o) for i, o in proj)
    # AdamW's two fp32 moments and a 4-byte step count per tensor (2 layers x 7 x A, B), adapters only
    assert est.state.optimizer == 2 * 4 * est.trainable_params + 4 * 28
    assert est.state.parameters == full.state.parameters + 4 * est.trainable_params  # base unchanged (fp32 here)
    assert est.state.gradients == 4 * est.trainable_params  # (taken before zero_grad)


def test_bf16_lora_stores_the_frozen_base_in_bf16() -> None:
    config = tiny_llama()
    est = estimate(config, tp=2, dp=1, seq_len=128, batch_size=1, dtype="bf16", lora_r=4, lora_target_modules="q_proj")
    base = est.num_params - est.trainable_params
    assert est.trainable_params == 2 * 4 * (256 + 256)
    # per rank: the base in bf16 (2 bytes) split over tp but for the 5 norms (whole); fp32 adapters:
    # lora_A whole (it reads the gathered sequence), lora_B split like q_proj
    norms = 5 * 256
    adapters = 2 * 4 * (4 * 256 + 256 * 4 // 2)
    assert est.state.parameters == 2 * (base - norms) // 2 + 2 * norms + adapters


@pytest.mark.large_estimate
def test_cli_lora_flags(tiny_dir, capsys) -> None:  # noqa: F811
    args = ["estimate", "--model", str(tiny_dir), "--tp", "2", "--seq-len", "64", "--lora-r", "4"]
    assert main([*args, "--lora-target-modules", "q_proj,v_proj", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora_r"] == 4 and out["lora_target_modules"] == "q_proj,v_proj" and out["trainable_params"] > 0
    assert main(args) == 0
    assert "LoRA r=4 on all-linear" in capsys.readouterr().out
    assert main([*args[:-2], "--lora-r", "-1"]) == 2
    assert "--lora-r must be a non-negative integer" in capsys.readouterr().err
    assert main([*args, "--world-size", "2", "--json"]) == 0  # a sweep keeps --lora-r on every layout
    assert {(e["tp"], e["lora_r"]) for e in json.loads(capsys.readouterr().out)["estimates"]} == {(1, 4), (2, 4)}
