"""``hf-tp estimate`` for mixture-of-experts models: expert weights per rank, the ep all-to-alls
(under the balanced-routing assumption), the MoE section, and the errors for a bad ``--ep``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, Qwen3MoeConfig

import hf_tp
from hf_tp.cli.main import main
from hf_tp.compat import UnsupportedRelease, moe_estimate_refusal
from hf_tp.estimate import estimate
from hf_tp.estimate.simulate import measure
from hf_tp.estimate.sweep import candidate_splits

SEQ, BATCH = 32, 2
MESHES = [(1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 2)]  # (tp, dp, ep)


def tiny_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def estimates() -> dict[tuple[int, int, int], object]:
    config = tiny_moe()
    return {(tp, dp, ep): estimate(config, tp, dp, SEQ, BATCH, "bf16", ep=ep) for tp, dp, ep in MESHES}


def comms(est) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {(c.dim, c.collective): (c.count, c.bytes, c.sent_bytes) for c in est.comms}


def expert_bytes(c: Qwen3MoeConfig) -> int:
    """fp32 bytes of every MoE layer's experts: gate_up [E, 2I, H] and down [E, H, I]."""
    per_expert = 2 * c.moe_intermediate_size * c.hidden_size + c.hidden_size * c.moe_intermediate_size
    return c.num_hidden_layers * c.num_experts * per_expert * 4


@pytest.mark.large_estimate
@pytest.mark.parametrize(("tp", "dp", "ep"), MESHES)
def test_expert_weights_per_rank(estimates, tp: int, dp: int, ep: int) -> None:
    c, moe = tiny_moe(), estimates[(tp, dp, ep)].moe
    assert (moe.layers, moe.experts, moe.top_k) == (2, 8, 2)
    assert moe.experts_per_rank == c.num_experts // ep
    # ep=1: FSDP2 shards the experts over dp like every weight; ep>1: a rank's experts / ep (split
    # over tp) are sharded by FSDP2 over dp_out = dp / ep: 1/dp of the experts per rank either way.
    assert moe.expert_param_bytes == expert_bytes(c) // (tp * dp)
    assert moe.other_param_bytes > 0
    assert estimates[(tp, dp, ep)].ep == ep


@pytest.mark.parametrize(("tp", "dp", "ep"), MESHES)
def test_all_to_all_bytes_follow_the_config(estimates, tp: int, dp: int, ep: int) -> None:
    c, est = tiny_moe(), estimates[(tp, dp, ep)]
    rows = SEQ * BATCH * c.num_experts_per_tok  # (token, choice) rows per rank per layer (tp gathers the sequence)
    assert est.moe.routed_rows == rows
    got = comms(est)
    if ep == 1:
        assert not any(coll == "all_to_all" for _, coll in got) and est.sent_bytes("ep") == 0
        assert (est.moe.a2a_rows_out, est.moe.balanced_routing) == (0, False)
        return
    # Per MoE layer: forward = the counts (ep int64), the expert ids (rows int64), the hidden rows
    # out and back (bf16); backward = the rows' gradients both ways (bf16).
    per_layer = 8 * ep + 8 * rows + 4 * rows * c.hidden_size * 2
    total = c.num_hidden_layers * per_layer
    assert got[("ep", "all_to_all")] == (6 * c.num_hidden_layers, total, int(total * (ep - 1) / ep))
    assert est.moe.a2a_rows_out == est.moe.a2a_rows_in == rows * (ep - 1) // ep  # balanced routing
    assert est.moe.balanced_routing and est.moe.activation_bytes > 0 and est.moe.forward_peak_bytes > 0
    if dp // ep > 1:  # experts sharded over dp_out: gathered (bf16) in forward and backward, fp32 gradients
        local = expert_bytes(c) // (tp * ep)  # reduce-scattered; one unit per MoE layer
        assert got[("dp_out", "all_gather")][:2] == (2 * c.num_hidden_layers, local)
        assert got[("dp_out", "reduce_scatter")][:2] == (c.num_hidden_layers, local)
        assert ("dp_out", "all_reduce") not in got
    else:
        assert "dp_out" not in {d for d, _ in got}


def test_an_estimate_leaves_no_process_group_behind(estimates) -> None:
    # (balanced routing is installed on the simulated model's experts: no switch to leave on)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="ep must divide"):
        estimate(tiny_moe(), 1, 4, SEQ, BATCH, ep=3)
    assert not dist.is_initialized()


def test_fp32_moe_estimate_matches_a_real_measurement() -> None:
    config = tiny_moe()  # fp32 grouped_mm has no fake kernel: the estimate runs transformers' fallback op
    if refusal := moe_estimate_refusal("fp32"):  # (before transformers 5.23 that op cannot run on fake tensors)
        with pytest.raises(UnsupportedRelease, match=re.escape(refusal)):
            estimate(config, 1, 1, SEQ, BATCH, "fp32")
        return
    est = estimate(config, 1, 1, SEQ, BATCH, "fp32")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = measure(config, hf_tp.build_mesh(tp=1, dp=1, device_type="cpu"), SEQ, BATCH, "fp32")
    finally:
        dist.destroy_process_group()
    assert est.peak.total == pytest.approx(real.peak.total, abs=64)  # a few scalars apart
    assert est.moe.routed_rows == SEQ * BATCH * 2


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        (tiny_moe(), dict(dp=4, ep=8), r"^ep must divide dp \(4\): expert parallelism borrows its ranks from dp"),
        (tiny_moe(), dict(dp=6, ep=3), r"^ep must divide the number of experts \(8\) of this model, got ep=3$"),
        (tiny_moe(), dict(dp=2, ep=0), r"^ep must be a positive integer, got ep=0$"),
        (
            LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4),
            dict(dp=2, ep=2),
            r"^ep=2 needs a mixture-of-experts model; this llama model has no experts \(leave ep at 1\)$",
        ),
    ],
)
def test_bad_ep_fails_early_with_one_line(config, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        estimate(config, tp=1, seq_len=SEQ, batch_size=1, **kwargs)
    assert "\n" not in str(info.value) and not dist.is_initialized()


@pytest.mark.large_estimate
def test_sweep_keeps_ep_and_skips_splits_it_cannot_use() -> None:
    splits = candidate_splits(tiny_moe(), 4, ep=2)
    assert splits and all(dp % 2 == 0 for _, dp in splits) and (4, 1) not in splits
    with pytest.raises(ValueError, match=r"no \(tp, dp\) split of 6 ranks has a dp divisible by ep=4"):
        candidate_splits(tiny_moe(), 6, ep=4)


@pytest.mark.large_estimate
def test_cli_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_moe().save_pretrained(tmp_path)
    args = ["estimate", "--model", str(tmp_path), "--tp", "2", "--dp", "2", "--ep", "2", "--seq-len", "32"]
    args += ["--batch-size", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tp=2 x dp=2 (4 ranks), ep=2" in out
    for row in ("ep all_to_all", "mixture of experts: 2 MoE layers", "expert weights MiB", "balanced routing"):
        assert row in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ep"] == 2 and data["moe"]["experts_per_rank"] == 4 and data["moe"]["balanced_routing"]
    assert any(c["dim"] == "ep" and c["collective"] == "all_to_all" for c in data["comms"])
    for bad, message in ((["--dp", "4", "--ep", "8"], "ep must divide dp (4)"), (["--ep", "3"], "experts (8)")):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-tp estimate: error: ") and message in err and "\n" not in err
    assert not dist.is_initialized()


@pytest.mark.large_estimate
def test_gpt_oss_quantized_checkpoint_is_sized_as_its_dequantized_copy() -> None:
    # GPT-OSS ships its experts in MXFP4: hf-tp estimate sizes the full-precision model hf_tp
    # would train (training it refuses with the dequantizing command). Experts carry biases.
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    config = AutoConfig.for_model("gpt_oss", **sizes, quantization_config={"quant_method": "mxfp4"})
    est = estimate(config, 2, 2, SEQ, BATCH, "bf16", ep=2)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **sizes))
    assert est.num_params == sum(p.numel() for p in plain.parameters())
    assert est.moe.experts_per_rank == 2 and config.quantization_config == {"quant_method": "mxfp4"}


@pytest.mark.parametrize(
    ("name", "billions"), [("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1), ("deepseek-v3", 671.0)]
)
def test_bundled_moe_configs_build_the_published_parameter_count(name: str, billions: float) -> None:
    # DeepSeek-V3's 671B leave out its multi-token-prediction layer (685B on the Hub), as transformers does.
    import torch
    from transformers import AutoModelForCausalLM

    from hf_tp.estimate import resolve_model_config

    config, label = resolve_model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == billions and "/" in label


def test_mfu_numerator_is_the_traced_routed_work(estimates) -> None:
    # training's 6N + 12LHS with the unrouted experts left out is what the traced step did (top-2 of 8)
    est = estimates[(1, 4, 1)]
    assert est.model_flops_per_token * BATCH * SEQ == pytest.approx(est.work.model_flops, rel=0.03)


def test_bincount_of_categories_runs_on_fake_tensors_as_its_bins() -> None:
    # transformers before 5.2x counts each expert's routed rows with bincount(minlength=experts)
    # in its load-balancing loss (on rows without a padding mask, as under cp): minlength bins
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_tp.estimate.simulate import DataDependentBounds

    with FakeTensorMode(), DataDependentBounds():
        ids = torch.zeros(12, dtype=torch.long)
        counts, weighted = torch.bincount(ids, minlength=8), torch.bincount(ids, torch.ones(12), minlength=8)
    assert (counts.shape, counts.dtype, weighted.shape, weighted.dtype) == ((8,), torch.long, (8,), torch.float32)
