"""The pieces training, the estimate and parallelize share: the layout rules (one message per rule,
in flag or argument words), the GPU table matched by exact CUDA names, and the one MFU definition."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tp.adapters.census import unrouted_expert_params
from hf_tp.core.dims import check_cp_rows, check_layout, check_world, row_multiple
from hf_tp.gpus import GPUS, gpu_of_device, model_flops_per_token
from hf_tp.run.config import TrainConfig
from hf_tp.train import metrics
from tests.unit.test_estimate_moe import tiny_moe


@pytest.mark.parametrize(
    ("sizes", "flags", "message"),
    [
        (dict(dp=3, ep=2), True, r"--ep must divide --dp \(3\): expert parallelism borrows its ranks from dp, got 2"),
        (dict(dp=2, cp=2, ep=8), False, r"ep must divide dp x cp \(4\): .* from dp x cp, got ep=8"),
        (dict(dp=4, dp_replicate=3), True, r"--dp-replicate must divide --dp \(4\): .* got 3"),
        (dict(dp=4, ep=2, dp_replicate=2), False, r"dp_replicate does not combine with ep yet: drop one of them"),
        (dict(tp=0), False, r"tp must be a positive integer, got tp=0"),
        (dict(cp=True), True, r"--cp must be a positive integer, got True"),
    ],
)
def test_one_rule_one_message_in_the_callers_words(sizes: dict, flags: bool, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_layout(**sizes, flags=flags)


def test_train_estimate_and_mesh_share_the_rules() -> None:
    # TrainConfig.validate words them as flags; an undecided dp (None) skips the rules that need it
    with pytest.raises(ValueError, match=r"^--ep must divide --dp x --cp \(4\)"):
        TrainConfig(tp=1, dp=2, cp=2, ep=8).validate()
    check_layout(tp=None, dp=None, ep=8, flags=True)
    with pytest.raises(ValueError, match=r"world size \(8\) must equal tp\*cp\*dp \(2\*2\*4=16\)"):
        check_world(8, 2, 4, 2)
    assert (row_multiple(2, 1), row_multiple(2, 2), TrainConfig(tp=2, cp=3).row_multiple) == (2, 8, 12)
    with pytest.raises(ValueError, match=r"seq_len \(20\) must be a multiple of 2\*cp\*tp \(8\)"):
        check_cp_rows(20, 2, 2)


def test_gpus_are_matched_by_their_exact_cuda_names(monkeypatch) -> None:
    # an H100 PCIe is not an SXM: 756 TFLOP/s, not 989 (a substring match on "H100" gave it 989)
    assert gpu_of_device("NVIDIA H100 PCIe") is GPUS["h100-pcie"] and GPUS["h100-pcie"].bf16_flops == 756e12
    assert gpu_of_device("NVIDIA H100 80GB HBM3") is GPUS["h100-sxm"]
    assert gpu_of_device("NVIDIA H100 NVL") is None and gpu_of_device("NVIDIA A100 80GB PCIe") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert metrics.peak_flops(torch.device("cuda"), torch.bfloat16) == 756e12
    assert metrics.peak_flops(torch.device("cuda"), torch.float32) is None
    assert metrics.peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert "device_names" not in GPUS["h200"].to_dict()  # (the estimate's --json gpu record is unchanged)


def test_mfu_counts_the_experts_a_token_is_routed_to() -> None:
    config = tiny_moe()  # 8 experts, top-2
    model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    assert unrouted_expert_params(model, config) == experts * 6 // 8
    n = sum(p.numel() for p in model.parameters())
    dense = model_flops_per_token(config, n, 32)
    routed = model_flops_per_token(config, n, 32, unrouted_expert_params(model, config))
    assert dense - routed == 6 * experts * 6 // 8
    embed = config.vocab_size * config.hidden_size
    assert dense == 6 * (n - embed) + 12 * config.num_hidden_layers * config.hidden_size * 32
