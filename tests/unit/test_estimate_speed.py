"""The speed model's arithmetic on hand-computed cases, and that the sweep's ranking follows it.
Pure arithmetic on hand-made estimates (no simulation, no processes) plus one small real op count."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_tp.cli.estimate import main
from hf_tp.cli.estimate_report import format_ranking
from hf_tp.estimate.counters import CommStat, Work, WorkCounter
from hf_tp.estimate.estimate_run import Estimate, GiB, estimate
from hf_tp.estimate.memory import MemoryBreakdown
from hf_tp.estimate.speed import BASE_LATENCY, STEP_LATENCY, Cluster, predict
from hf_tp.estimate.sweep import Sweep, sweep
from hf_tp.gpus import GPUS, get_gpu

H100 = get_gpu("h100-sxm")
NVLINK = 450e9 * 0.80  # bytes/s one direction, at the published NCCL efficiency
NIC = 400e9 / 8 * 0.80  # one 400 Gb/s NIC per GPU


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip


def make(tp=1, dp=1, comms=(), peak_gib=10.0, ac=False, flops_per_token=0.0, **work) -> Estimate:
    mem = MemoryBreakdown(activations=int(peak_gib * GiB))
    return Estimate(
        "m", "llama", 10**9, tp, dp, 1, 4096, 2, "bf16", ac, mem, mem, list(comms), work=Work(**work),
        model_flops_per_token=flops_per_token,
    )  # fmt: skip


def test_pure_matmul_runs_at_the_published_matmul_efficiency() -> None:
    flops = 10**15
    speed = predict(make(matmul_flops=flops, flops_per_token=flops / (4096 * 2)), Cluster(H100))
    step = flops / (989.4e12 * 0.803)
    assert speed.step_seconds == pytest.approx(step)
    assert speed.tokens_per_second_per_gpu == pytest.approx(4096 * 2 / step)
    assert speed.mfu == pytest.approx(0.803)  # every FLOP counted by 6N + 12LHS
    assert speed.exposed_comm_share == pytest.approx(0.0)


def test_attention_is_counted_causal_and_recompute_is_not_model_flops() -> None:
    work = dict(attention_flops=4 * 10**14, matmul_flops=10**15, recompute_flops=2 * 10**14)
    speed = predict(make(flops_per_token=1.2e15 / (4096 * 2), **work), Cluster(H100))
    assert speed.seconds["attention"] == pytest.approx(2e14 / (989.4e12 * 0.35))
    assert speed.mfu == pytest.approx(1.2e15 / (speed.step_seconds * 989.4e12))  # MFU: model FLOPs per token only


def test_memory_bound_kernels_run_at_hbm_bandwidth() -> None:
    speed = predict(make(memory_bytes=10**12), Cluster(get_gpu("h200")))
    assert speed.step_seconds == pytest.approx(1e12 / (4.8e12 * 0.84))


def test_pure_tp_all_gather_inside_a_node_is_exposed_ring_time() -> None:
    size = 2**30  # gathered bytes; each of 8 ranks sends 7/8 of it
    ag = CommStat("tp", "all_gather", 8, 1, size, size * 7 // 8)
    speed = predict(make(tp=8, dp=1, comms=[ag]), Cluster(H100))
    expected = BASE_LATENCY + 7 * STEP_LATENCY["NVLink"] + (size * 7 // 8) / NVLINK
    assert speed.seconds["tp exposed"] == pytest.approx(expected)
    assert speed.step_seconds == pytest.approx(expected)
    assert speed.tokens_per_second_per_gpu == pytest.approx(4096 * 2 / 8 / expected)


def test_dp_ring_across_nodes_runs_at_the_nic_bandwidth() -> None:
    # tp=8 fills a node: the dp pair is one rank per node, so its ring crosses one NIC per GPU.
    rs = CommStat("dp", "reduce_scatter", 2, 1, 2**30, 2**29)
    speed = predict(make(tp=8, dp=2, comms=[rs]), Cluster(H100))
    expected = BASE_LATENCY + STEP_LATENCY["net"] + 2**29 / NIC
    assert speed.comm["dp"] == pytest.approx(expected)
    faster = predict(make(tp=8, dp=2, comms=[rs]), Cluster(H100, inter_node_gbps=800))
    assert faster.comm["dp"] == pytest.approx(BASE_LATENCY + STEP_LATENCY["net"] + 2**29 / (2 * NIC))


def test_fsdp_collectives_hide_behind_compute_except_the_first_and_last() -> None:
    ag = CommStat("dp", "all_gather", 8, 10, 10 * 2**27, 10 * 2**27 * 7 // 8)
    rs = CommStat("dp", "reduce_scatter", 8, 5, 5 * 2**27, 5 * 2**27 * 7 // 8)
    busy = predict(make(dp=8, comms=[ag, rs], matmul_flops=10**16), Cluster(H100))
    comm = predict(make(dp=8, comms=[ag, rs]), Cluster(H100))  # the same collectives, no compute
    per_ag = BASE_LATENCY + 7 * STEP_LATENCY["NVLink"] + 2**27 * 7 / 8 / NVLINK
    assert busy.seconds["dp exposed"] == pytest.approx(2 * per_ag, rel=1e-6)  # first all-gather + last reduce-scatter
    assert comm.seconds["dp exposed"] == pytest.approx(comm.comm["dp"])  # nothing to hide behind


def test_ranking_follows_predicted_tokens_per_second_among_layouts_that_fit() -> None:
    cluster = Cluster(H100)
    tp_heavy = make(
        tp=8, dp=1, comms=[CommStat("tp", "all_gather", 8, 100, 2**34, 2**34 * 7 // 8)], matmul_flops=10**14
    )
    lean = make(tp=2, dp=4, matmul_flops=4 * 10**14)
    too_big = make(tp=1, dp=8, matmul_flops=10**14, peak_gib=200)
    result = Sweep(world_size=8, gpu_memory=80 * GiB, estimates=[tp_heavy, lean, too_big], cluster=cluster)
    ranked = result.ranking()
    assert [e for e, _ in ranked] == sorted(
        [tp_heavy, lean], key=lambda e: -predict(e, cluster).tokens_per_second_per_gpu
    )
    assert too_big not in [e for e, _ in ranked]
    assert result.to_dict()["estimates"][2]["speed"] is None


def test_work_counter_counts_a_matmul_and_an_elementwise_kernel() -> None:
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    with WorkCounter() as counter:
        a @ b
        a + a
    assert counter.work.matmul_flops == 2 * 8 * 16 * 4
    assert counter.work.memory_bytes == 3 * a.numel() * 4  # two reads and one write
    assert counter.work.memory_kernels == 1


def test_work_counter_skips_ops_run_under_another_fake_mode() -> None:
    # DTensor's shape propagation re-runs each new op on global shapes in a fake mode of its own
    with FakeTensorMode():
        a, b = torch.ones(8, 16), torch.ones(16, 4)
        with WorkCounter() as counter:
            a @ b
            with FakeTensorMode():
                torch.ones(8, 16) @ torch.ones(16, 4)
                torch.ones(8, 16) + 1
    assert counter.work.matmul_flops == 2 * 8 * 16 * 4
    assert counter.work.memory_bytes == 0 and counter.work.memory_kernels == 0


def test_traced_tp_step_counts_this_rank_s_matmuls_exactly() -> None:
    # Issue 43: the 405B step counted ~14 TFLOP per 1,024 tokens of DTensor shape propagation
    c = tiny_llama()
    tp, rows, seq = 2, 2, 128
    est = estimate(c, tp=tp, dp=2, seq_len=seq, batch_size=rows, dtype="bf16")
    head_dim = c.hidden_size // c.num_attention_heads
    attn = 2 * c.hidden_size * head_dim * (c.num_attention_heads + c.num_key_value_heads)  # q, o; k, v
    linear = c.num_hidden_layers * (attn + 3 * c.hidden_size * c.intermediate_size) + c.hidden_size * c.vocab_size
    # 2 x forward + 4 x backward, a 1/tp share; transformers before 5.2x also finds RoPE's angles by a
    # matmul of the inverse frequencies by the positions (head_dim/2 x 1 @ 1 x seq, no grad: one row
    # of positions, which the rows share)
    rope = 2 * (head_dim // 2) * seq
    rope_by_matmul = "inv_freq_expanded @" in inspect.getsource(LlamaRotaryEmbedding.forward)
    assert est.work.matmul_flops == 6 * rows * seq * linear // tp + (rope if rope_by_matmul else 0)
    scores = 2 * 2 * rows * (c.num_attention_heads // tp) * seq * seq * head_dim  # QK^T and PV, full S x S
    assert est.work.attention_flops == c.num_hidden_layers * scores * 7 // 2  # forward + 2.5 x in backward


def test_gpu_table_and_bad_gpu_fail_early(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"h100-sxm", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "b200"} <= set(GPUS)
    assert main(["--model", "qwen2-0.5b", "--seq-len", "128", "--gpu", "x100"]) == 2
    assert "unknown --gpu 'x100'; known GPUs: h100-sxm" in capsys.readouterr().err
    assert main(["--model", "qwen2-0.5b", "--seq-len", "128", "--gpu", "b200", "--dtype", "fp32"]) == 2
    assert "no published fp32 peak for --gpu b200" in capsys.readouterr().err
    assert main(["--model", "qwen2-0.5b", "--seq-len", "128", "--gpu", "h100-sxm", "--inter-node-gbps", "0"]) == 2


def test_traced_step_counts_6n_flops_and_recompute_is_excluded_from_model_flops() -> None:
    config = tiny_llama()
    plain = estimate(config, tp=1, dp=1, seq_len=128, batch_size=2, dtype="bf16")
    ac = estimate(config, tp=1, dp=1, seq_len=128, batch_size=2, dtype="bf16", activation_checkpointing=True)
    tokens, dense = 2 * 128, plain.num_params - config.vocab_size * config.hidden_size  # the embedding does no matmul
    assert plain.work.matmul_flops == pytest.approx(6 * dense * tokens, rel=0.01)
    assert plain.work.recompute_flops == 0 and ac.work.recompute_flops > 0
    assert ac.work.model_flops == plain.work.model_flops
    assert ac.work.matmul_flops + ac.work.attention_flops > plain.work.model_flops
    # MFU's numerator (training's 6N + 12LHS) is the traced step's model FLOPs: the two MFUs compare
    assert plain.model_flops_per_token * tokens == pytest.approx(plain.work.model_flops, rel=0.02)
    assert ac.model_flops_per_token == plain.model_flops_per_token


@pytest.mark.large_estimate
def test_sweep_ranks_the_layouts_that_fit_by_predicted_speed() -> None:
    config = tiny_llama()
    lines: list[str] = []
    result = sweep(config, 2, seq_len=64, batch_size=1, progress=lines.append, cluster=Cluster(H100))
    assert lines[:2] == ["simulating tp=2 x dp=1 (split 1 of 2)", "simulating tp=1 x dp=2 (split 2 of 2)"]
    speeds = [s.tokens_per_second_per_gpu for _, s in result.ranking()]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 4  # each split at batch 1 and grown to 8
    assert result.recommended is result.ranking()[0][0]
    assert result.to_dict()["recommended"]["tp"] == result.recommended.tp
    text = format_ranking(result)
    assert "ranked by predicted tokens/s per GPU on 2 x h100-sxm" in text
    assert f"Fastest that fits: --tp {result.recommended.tp}" in text and "[1] NVIDIA H100 SXM5" in text
