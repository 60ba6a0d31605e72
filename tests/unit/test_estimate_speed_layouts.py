"""The speed model under context parallelism and LoRA, and the sweep's batch dimension: hand-computed
collective times, the traced step's cp collectives and LoRA FLOPs, the CLI's text and --json, and
the batch search on hand-made estimates (no simulation) plus one small real cp sweep."""

from __future__ import annotations

import json

import pytest

from hf_tp.cli.estimate import main
from hf_tp.cli.estimate_report import format_ranking
from hf_tp.estimate.counters import CommStat, Work
from hf_tp.estimate.estimate_run import Estimate, GiB, estimate
from hf_tp.estimate.memory import MemoryBreakdown
from hf_tp.estimate.speed import BASE_LATENCY, STEP_LATENCY, Cluster, predict
from hf_tp.estimate.sweep import Sweep, fits, grow_batch, speed_sweep, sweep
from hf_tp.gpus import get_gpu
from tests.unit.test_estimate import tiny_dir, tiny_llama  # noqa: F401 (tiny_dir is a fixture)
from tests.unit.test_estimate_moe import tiny_moe

H100 = get_gpu("h100-sxm")
NVLINK = 450e9 * 0.80  # bytes/s one direction, at the published NCCL efficiency
NIC = 400e9 / 8 * 0.80  # one 400 Gb/s NIC per GPU
PEAK = 989.4e12


def make(tp=1, dp=1, cp=1, batch=1, comms=(), fixed_gib=10.0, row_gib=0.0, ac=False, lora_r=0, **work) -> Estimate:
    """A hand-made estimate: ``fixed_gib`` of state plus ``row_gib`` of activations per sequence."""
    peak = MemoryBreakdown(parameters=int(fixed_gib * GiB), activations=int(row_gib * batch * GiB))
    return Estimate(
        "m", "llama", 10**9, tp, dp, 1, 4096, batch, "bf16", ac, peak, peak, list(comms), work=Work(**work), cp=cp,
        lora_r=lora_r, lora_target_modules="all-linear" if lora_r else "",
    )  # fmt: skip


def test_cp_all_gather_across_nodes_runs_at_the_nic_and_is_exposed() -> None:
    # tp 8 fills a node: each cp pair is one rank per node, so its ring crosses one NIC per GPU
    size = 4 * 2**26  # 4 K/V gathers of 64 MiB each; each of the 2 ranks sends half
    ag = CommStat("cp", "all_gather", 2, 4, size, size // 2)
    speed = predict(make(tp=8, cp=2, dp=1, comms=[ag], matmul_flops=10**16), Cluster(H100))
    expected = 4 * (BASE_LATENCY + STEP_LATENCY["net"]) + (size // 2) / NIC
    assert speed.comm["cp"] == pytest.approx(expected)
    assert speed.seconds["cp exposed"] == pytest.approx(expected)  # on the critical path, however busy


def test_cp_group_inside_a_node_rings_over_nvlink() -> None:
    size = 2**30
    ag = CommStat("cp", "all_gather", 4, 1, size, size * 3 // 4)  # tp 2 x cp 4 = 8 ranks: one node
    speed = predict(make(tp=2, cp=4, comms=[ag]), Cluster(H100))
    assert speed.comm["cp"] == pytest.approx(BASE_LATENCY + 3 * STEP_LATENCY["NVLink"] + size * 3 / 4 / NVLINK)


def test_cp_tokens_per_gpu_and_attention_counted_in_full() -> None:
    flops = 4 * 10**14
    plain = predict(make(tp=2, attention_flops=flops), Cluster(H100))
    cp = predict(make(tp=2, cp=2, attention_flops=flops), Cluster(H100))
    assert plain.seconds["attention"] == pytest.approx(flops / 2 / (PEAK * 0.35))  # causal flash: half
    assert cp.seconds["attention"] == pytest.approx(flops / (PEAK * 0.35))  # masked kernel: every score
    assert cp.tokens_per_second_per_gpu == pytest.approx(4096 / (2 * 2) / cp.step_seconds)
    assert any(line.startswith("cp=2: a GPU keeps 1/2") for line in cp.assumptions)


def test_traced_cp_step_counts_kv_gathers_as_cp_even_when_dp_is_one() -> None:
    # tp 1 x cp 2 x dp 1: the cp group is also FSDP2's dp x cp group (one process group)
    c = tiny_llama()
    est = estimate(c, tp=1, dp=1, cp=2, seq_len=128, batch_size=2)
    stats = {(s.dim, s.collective): s for s in est.comms}
    kv = 2 * c.num_key_value_heads * 128 * (c.hidden_size // c.num_attention_heads) * 2  # (B, kv, S, d) bf16
    layers = c.num_hidden_layers
    assert (stats["cp", "all_gather"].count, stats["cp", "all_gather"].bytes) == (2 * layers, 2 * layers * kv)
    assert (stats["cp", "reduce_scatter"].count, stats["cp", "reduce_scatter"].bytes) == (2 * layers, 2 * layers * kv)
    plain = estimate(c, tp=1, dp=2, seq_len=128, batch_size=2)  # FSDP2 over 2 ranks, no cp
    assert [(s.collective, s.count, s.bytes) for s in est.comms if s.dim == "dp" and s.collective != "all_reduce"] == [
        (s.collective, s.count, s.bytes) for s in plain.comms if s.dim == "dp" and s.collective != "all_reduce"
    ]
    assert est.work.matmul_flops == pytest.approx(plain.work.matmul_flops / 2, rel=0.01)  # half the tokens


def test_lora_step_skips_base_weight_gradients_and_their_reduce_scatter() -> None:
    c = tiny_llama()
    full = estimate(c, tp=1, dp=2, seq_len=128, batch_size=2)
    lora = estimate(c, tp=1, dp=2, seq_len=128, batch_size=2, lora_r=8)
    # forward 2 + input gradients 2 of the full step's 6 FLOPs per weight and token, plus the adapters
    assert lora.work.matmul_flops / full.work.matmul_flops == pytest.approx(4 / 6, abs=0.02)
    scatter = {
        e.lora_r: [s for s in e.comms if (s.dim, s.collective) == ("dp", "reduce_scatter")][0] for e in (full, lora)
    }
    assert scatter[8].bytes == pytest.approx(4 * lora.trainable_params, rel=0.05)  # fp32 adapter gradients only
    assert scatter[0].bytes == pytest.approx(4 * full.num_params, rel=0.05)
    speed = predict(lora, Cluster(H100))
    # MFU counts 6N + 12LHS per token (training's definition), not the ~4N the LoRA step does
    assert speed.mfu == pytest.approx(lora.model_flops_per_token * 2 * 128 / (speed.step_seconds * PEAK))
    assert lora.model_flops_per_token == pytest.approx(full.model_flops_per_token, rel=0.05)
    assert any(line.startswith("LoRA r=8 on all-linear") for line in speed.assumptions)


@pytest.mark.large_estimate
def test_cli_prints_and_json_carries_the_cp_figures(tiny_dir, capsys) -> None:  # noqa: F811
    args = ["--model", str(tiny_dir), "--tp", "2", "--cp", "2", "--seq-len", "64", "--gpu", "h100-sxm"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cp"] == 2 and out["world_size"] == 4
    assert out["speed"]["comm"]["cp"] > 0 and out["speed"]["seconds"]["cp exposed"] == out["speed"]["comm"]["cp"]
    assert out["speed"]["tokens_per_second_per_gpu"] == pytest.approx(64 / 4 / out["speed"]["step_seconds"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cp collectives exposed" in text and "attention (masked, every score)" in text and "[7] cp=2" in text


def fake_run(fixed_gib: float, row_gib: float, reported_row_gib: float, calls: list, **work_per_row):
    """A stand-in for the estimate: peak = fixed + row x batch, of which ``reported_row_gib`` per
    row shows as activations (the first guess's input); work per row plus 10^12 bytes of fixed
    memory-bound work (the optimizer step), which a larger batch amortises."""

    def run(tp: int, dp: int, activation_checkpointing: bool, batch_size: int = 1) -> Estimate:
        calls.append(batch_size)
        peak = (fixed_gib + row_gib * batch_size) * GiB
        acts = reported_row_gib * batch_size * GiB
        mem = MemoryBreakdown(parameters=int(peak - acts), activations=int(acts))
        work = Work(**{k: v * batch_size for k, v in work_per_row.items()})
        work.memory_bytes += 10**12
        return Estimate(
            "m", "llama", 10**9, tp, dp, 1, 4096, batch_size, "bf16", activation_checkpointing, mem, mem, [], work=work
        )

    return run


@pytest.mark.parametrize(("reported", "simulated"), [(10.0, [4]), (2.0, [8, 4]), (30.0, [2, 4])])
def test_batch_grows_to_the_largest_double_that_fits_in_two_simulations(reported, simulated) -> None:
    # 80 GiB: fits while (20 + 10 b) x 1.1 + 1 <= 80, i.e. b <= 5.18: batch 4 of 2, 4, 8
    calls: list[int] = []
    run = fake_run(20.0, 10.0, reported, calls, matmul_flops=10**14)
    result = Sweep(world_size=8, gpu_memory=80 * GiB, cluster=Cluster(H100))
    base = run(1, 8, False)
    result.estimates.append(base)
    calls.clear()
    grow_batch(result, base, run, None)
    assert calls == simulated  # the first guess from the activations, then a line through two peaks
    best = result.ranking()[0][0]
    assert best.batch_size == 4 and fits(best, 80 * GiB)


@pytest.mark.large_estimate
def test_speed_sweep_grows_the_fastest_first_and_prunes_by_compute_bound() -> None:
    calls: list[int] = []
    run = fake_run(20.0, 10.0, 10.0, calls, matmul_flops=10**13)
    result = Sweep(world_size=8, gpu_memory=80 * GiB, cluster=Cluster(H100))
    speed_sweep(result, [(1, 8), (2, 4)], run, False, None)
    # the same work per rank (fake_run ignores tp), so tp 1 does twice the tokens/s of tp 2; both are
    # mostly the fixed memory-bound time, so tp 2's bound (its matmul time per token) stays above tp 1
    # at batch 4 and both grow
    assert sorted(calls) == [1, 1, 4, 4]
    r = result.recommended
    assert r is not None and r.batch_size == 4
    assert result.to_dict()["recommended"]["batch_size"] == 4
    pruned = Sweep(world_size=8, gpu_memory=80 * GiB, cluster=Cluster(H100))
    calls.clear()
    slow = fake_run(20.0, 10.0, 10.0, calls, matmul_flops=10**16)  # matmul-bound: tp 2's bound is below tp 1
    speed_sweep(pruned, [(1, 8), (2, 4)], slow, False, None)
    assert sorted(calls) == [1, 1, 4] and any("below the best that fits" in s for s in pruned.skipped)


@pytest.mark.large_estimate
def test_cp_sweep_ranks_layouts_and_batches() -> None:
    lines: list[str] = []
    result = sweep(tiny_llama(), 4, seq_len=64, batch_size=1, progress=lines.append, cluster=Cluster(H100), cp=2)
    assert lines[:2] == ["simulating tp=2 x cp=2 x dp=1 (split 1 of 2)", "simulating tp=1 x cp=2 x dp=2 (split 2 of 2)"]
    assert {e.cp for e in result.estimates} == {2} and max(e.batch_size for e in result.estimates) == 8
    speeds = [s.tokens_per_second_per_gpu for _, s in result.ranking()]
    assert speeds == sorted(speeds, reverse=True)
    assert result.recommended is result.ranking()[0][0] and result.recommended.batch_size == 8
    text = format_ranking(result)
    assert "CP exp" in text and f"--cp 2 --dp {result.recommended.dp} --batch-size 8" in text


def test_cp_with_ep_keeps_all_to_alls_under_ep_where_one_group_is_both() -> None:
    est = estimate(tiny_moe(), tp=1, dp=1, cp=2, ep=2, seq_len=64, batch_size=1)  # ep group = cp group
    dims = {(s.dim, s.collective) for s in est.comms}
    assert ("ep", "all_to_all") in dims and ("cp", "all_gather") in dims and ("cp", "all_to_all") not in dims
