"""The one GPU table (hf_tp.gpus): the GPUs training's MFU had before the tables were merged
(H800, A800, L40S) are found by the exact names CUDA reports, with their vendor peaks."""

from __future__ import annotations

import pytest
import torch

from hf_tp.gpus import GPUS, get_gpu, gpu_of_device
from hf_tp.train import metrics


@pytest.mark.parametrize(
    "device_name, gpu, peak",
    [
        ("NVIDIA H800", "h800", 989.4e12),
        ("NVIDIA A800-SXM4-80GB", "a800-80gb", 312e12),
        ("NVIDIA L40S", "l40s", 362.05e12),
    ],
)
def test_training_finds_the_gpu_by_its_cuda_name(monkeypatch, device_name: str, gpu: str, peak: float) -> None:
    assert gpu_of_device(device_name) is GPUS[gpu] and GPUS[gpu].bf16_flops == peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert metrics.peak_flops(torch.device("cuda"), torch.bfloat16) == peak
    assert metrics.peak_flops(torch.device("cuda"), torch.float32) is None  # (MFU is reported for bf16 only)


def test_h800_and_a800_are_their_sisters_with_a_slower_nvlink() -> None:
    h800, a800 = get_gpu("h800"), get_gpu("a800-80gb")
    for cut, full in ((h800, GPUS["h100-sxm"]), (a800, GPUS["a100-80gb"])):
        assert (cut.bf16_flops, cut.fp32_flops, cut.hbm_bandwidth, cut.memory_bytes, cut.matmul_efficiency) == (
            full.bf16_flops,
            full.fp32_flops,
            full.hbm_bandwidth,
            full.memory_bytes,
            full.matmul_efficiency,
        )
        assert cut.link == "NVLink" and cut.link_bandwidth == 200e9 < full.link_bandwidth  # 400 GB/s both ways
    assert gpu_of_device("NVIDIA A800 80GB PCIe") is None and gpu_of_device("NVIDIA H800 PCIe") is None


def test_a_gpu_without_published_efficiencies_is_refused_by_the_speed_model() -> None:
    l40s = GPUS["l40s"]
    assert (l40s.link, l40s.link_bandwidth, l40s.memory_bytes, l40s.fp32_flops) == ("PCIe Gen4", 32e9, 48e9, 91.6e12)
    with pytest.raises(ValueError, match=r"^--gpu l40s: no published maximum achievable matmul .*leave --gpu out"):
        get_gpu("L40S")
