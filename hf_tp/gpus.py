"""The one GPU table (vendor peaks, memory, links, published efficiencies) and the one MFU definition,
shared by training's metrics and ``hf-tp estimate``'s speed model (no torch needed).

Every number is a vendor figure (dense, no sparsity) or a published measurement; the sources
are listed in docs/estimate.md ("Speed model: where every constant comes from"). Nothing here
was fitted to a training run. A GPU is found by its ``--gpu`` name or by the exact name CUDA
reports for it (an H100 PCIe is not an H100 SXM: 756 against 989 TFLOP/s).

MFU, everywhere hf_tp reports it: model FLOPs per token (:func:`model_flops_per_token`, PaLM's
6N + 12 L H S as torchtitan reports it) x tokens per second per GPU / the GPU's dense peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 10**9
TFLOPS = 10**12

# Published efficiencies shared by several GPUs (sources in docs/estimate.md).
FLASH2_HOPPER = 0.35  # FlashAttention-3 paper: FlashAttention-2 reaches ~35% of H100 peak
FLASH2_AMPERE = 0.50  # FlashAttention-2 paper: 50-73% of A100 peak; the low end (backward-bound fwd+bwd)
HBM_EFFICIENCY = 0.84  # coalesced loads at 2.8 of 3.35 TB/s on H100 SXM (Nsight Compute, published)
NVLINK_EFFICIENCY = 0.80  # nccl-tests busbw 230-250 GB/s of NVLink3's 300 GB/s per direction (8x A100)
PCIE_EFFICIENCY = 0.625  # nccl-tests busbw 35-45 GB/s of PCIe Gen5's 64 GB/s per direction (8x H100 PCIe)
NET_EFFICIENCY = 0.80  # assumed as NVLink's (no per-NIC busbw published with the NIC count)


@dataclass(frozen=True)
class GPU:
    """One GPU model and the node it usually comes in.

    ``link_bandwidth`` is one direction of one GPU's intra-node link (NVLink through NVSwitch,
    or PCIe where there is none). ``matmul_efficiency`` is the maximum achievable matmul FLOP/s
    over the bf16 peak (MAMF, published per GPU); ``attention_efficiency`` the same for sdpa's
    flash kernel.
    """

    name: str
    description: str
    bf16_flops: float
    fp32_flops: float | None  # non-tensor-core fp32 (hf_tp does not enable TF32); None: not published
    hbm_bandwidth: float
    memory_bytes: int
    link_bandwidth: float
    link: str
    link_efficiency: float
    gpus_per_node: int
    matmul_efficiency: float | None  # None: none published (the speed model refuses the GPU; MFU still works)
    attention_efficiency: float | None
    hbm_efficiency: float = HBM_EFFICIENCY
    device_names: tuple[str, ...] = ()  # torch.cuda.get_device_name's exact answers for this GPU

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` ("bf16" or "fp32"); a ValueError where none is published."""
        if dtype == "bf16":
            return self.bf16_flops
        if self.fp32_flops is None:
            raise ValueError(f"no published fp32 peak for --gpu {self.name}; use --dtype bf16")
        return self.fp32_flops

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "device_names"}


def _nvlink(bandwidth_gb: float) -> dict:
    return {"link_bandwidth": bandwidth_gb * GB, "link": "NVLink", "link_efficiency": NVLINK_EFFICIENCY}


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("h100-sxm", "NVIDIA H100 SXM5 80GB, HGX/DGX node of 8 with NVSwitch", 989.4 * TFLOPS, 66.9 * TFLOPS,
            3.35e12, 80 * 2**30, gpus_per_node=8, matmul_efficiency=0.803, attention_efficiency=FLASH2_HOPPER,
            device_names=("NVIDIA H100 80GB HBM3",), **_nvlink(450)),
        GPU("h100-pcie", "NVIDIA H100 PCIe 80GB, 8 per node over PCIe Gen5 (no NVSwitch)", 756 * TFLOPS,
            51.2 * TFLOPS, 2.0e12, 80 * 2**30, link_bandwidth=64 * GB, link="PCIe Gen5",
            link_efficiency=PCIE_EFFICIENCY, gpus_per_node=8, matmul_efficiency=499.5 / 756,
            attention_efficiency=FLASH2_HOPPER, device_names=("NVIDIA H100 PCIe",)),
        GPU("h200", "NVIDIA H200 SXM 141GB, HGX node of 8 with NVSwitch", 989.4 * TFLOPS, 66.9 * TFLOPS, 4.8e12,
            141 * GB, gpus_per_node=8, matmul_efficiency=0.803, attention_efficiency=FLASH2_HOPPER,
            device_names=("NVIDIA H200",), **_nvlink(450)),
        GPU("a100-80gb", "NVIDIA A100 SXM4 80GB, HGX/DGX node of 8 with NVSwitch", 312 * TFLOPS, 19.5 * TFLOPS,
            2.039e12, 80 * 2**30, gpus_per_node=8, matmul_efficiency=0.869, attention_efficiency=FLASH2_AMPERE,
            device_names=("NVIDIA A100-SXM4-80GB",), **_nvlink(300)),
        GPU("a100-40gb", "NVIDIA A100 SXM4 40GB, HGX/DGX node of 8 with NVSwitch", 312 * TFLOPS, 19.5 * TFLOPS,
            1.555e12, 40 * 2**30, gpus_per_node=8, matmul_efficiency=0.869, attention_efficiency=FLASH2_AMPERE,
            device_names=("NVIDIA A100-SXM4-40GB",), **_nvlink(300)),
        GPU("b200", "NVIDIA B200 180GB, HGX node of 8 with NVLink 5 switches", 2250 * TFLOPS, None, 8.0e12,
            180 * GB, gpus_per_node=8, matmul_efficiency=0.776, attention_efficiency=FLASH2_HOPPER,
            device_names=("NVIDIA B200",), **_nvlink(900)),
        # H800 / A800: the H100 SXM's / A100 SXM's die, SMs and clocks with NVLink cut to 400 GB/s both ways
        GPU("h800", "NVIDIA H800 SXM5 80GB, HGX node of 8 with NVSwitch (NVLink 400 GB/s)", 989.4 * TFLOPS,
            66.9 * TFLOPS, 3.35e12, 80 * 2**30, gpus_per_node=8, matmul_efficiency=0.803,
            attention_efficiency=FLASH2_HOPPER, device_names=("NVIDIA H800",), **_nvlink(200)),
        GPU("a800-80gb", "NVIDIA A800 SXM4 80GB, HGX node of 8 with NVSwitch (NVLink 400 GB/s)", 312 * TFLOPS,
            19.5 * TFLOPS, 2.039e12, 80 * 2**30, gpus_per_node=8, matmul_efficiency=0.869,
            attention_efficiency=FLASH2_AMPERE, device_names=("NVIDIA A800-SXM4-80GB",), **_nvlink(200)),
        GPU("l40s", "NVIDIA L40S 48GB (GDDR6), 8 per node over PCIe Gen4 (no NVLink)", 362.05 * TFLOPS,
            91.6 * TFLOPS, 0.864e12, 48 * GB, link_bandwidth=32 * GB, link="PCIe Gen4",
            link_efficiency=PCIE_EFFICIENCY, gpus_per_node=8, matmul_efficiency=None, attention_efficiency=None,
            device_names=("NVIDIA L40S",)),
    )
}  # fmt: skip

DEFAULT_INTER_NODE_GBPS = 400.0  # one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU (HGX H100 reference design)


def get_gpu(name: str) -> GPU:
    """The named GPU (case-insensitive) for the speed model, or a ValueError listing the names (or
    saying that the GPU's efficiencies are not published)."""
    gpu = GPUS.get(name.lower().strip())
    if gpu is None:
        raise ValueError(f"unknown --gpu '{name}'; known GPUs: {', '.join(GPUS)}")
    if gpu.matmul_efficiency is None or gpu.attention_efficiency is None:
        raise ValueError(
            f"--gpu {gpu.name}: no published maximum achievable matmul or attention FLOP/s for the {gpu.name}, which "
            f"the speed model needs; leave --gpu out or name another (training's MFU on it still uses its "
            f"{gpu.bf16_flops / TFLOPS:g} TFLOP/s dense bf16 peak)"
        )
    return gpu


def gpu_of_device(device_name: str) -> GPU | None:
    """The GPU whose CUDA name is exactly ``device_name`` (``torch.cuda.get_device_name``), or None."""
    return next((g for g in GPUS.values() if device_name.strip() in g.device_names), None)


def model_flops_per_token(model_config, num_params: int, seq_len: int, unrouted_params: int = 0) -> float:
    """Training FLOPs per token, the numerator of every MFU hf_tp reports: PaLM's 6N + 12 L H S, as
    torchtitan reports it (forward 2N, backward 4N; attention's scores and values 12 L H S, the full
    S x S matrix, not the causal half a flash kernel computes).

    N counts the parameters that take part in matrix products: all but the input embedding (a
    lookup). ``num_params`` counts a tied embedding/lm_head matrix once; it still does the output
    projection, so it is added back (otherwise a tied model's MFU would omit its lm_head, about
    a third of Qwen2-0.5B's work). A mixture-of-experts model's routed experts count as far as a
    token uses them: ``unrouted_params`` (the experts' weights x (1 - top_k / experts)) are left out.
    Every other parameter counts whatever trains (a LoRA run's frozen base, a multimodal wrapper's
    tower), as published MFU figures count them.
    """
    model_config = getattr(model_config, "text_config", None) or model_config  # a multimodal wrapper's language model
    embed = model_config.vocab_size * model_config.hidden_size
    n = num_params - embed - unrouted_params
    if getattr(model_config, "tie_word_embeddings", False):
        n += embed
    return 6 * n + 12 * model_config.num_hidden_layers * model_config.hidden_size * seq_len


def mfu(flops_per_token: float, tokens_per_second_per_gpu: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: :func:`model_flops_per_token` x tokens/s per GPU over the dense peak."""
    return flops_per_token * tokens_per_second_per_gpu / peak_flops
