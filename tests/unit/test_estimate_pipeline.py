"""Pipeline parallelism and HSDP in the estimate: the stage cut and its config, the in-flight counts
against torch's schedules, a pp layout's arithmetic on one real simulated stage, HSDP derived from
its shard group's simulation against HSDP simulated directly, the speed model's bubble and p2p,
and a sweep across nodes on a stand-in simulation (no simulation for the sweep)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from torch.distributed.pipelining.schedules import _get_warmup_ops
from transformers import DeepseekV3Config

from hf_tp.cli.estimate import main
from hf_tp.cli.estimate_report import format_ranking
from hf_tp.estimate.counters import CommStat, Work
from hf_tp.estimate.estimate_run import Estimate, GiB, estimate
from hf_tp.estimate.layouts import (
    SimulationCache,
    bubble_fraction,
    estimate_layout,
    in_flight,
    stage_config,
    stage_plan,
)
from hf_tp.estimate.memory import MemoryBreakdown
from hf_tp.estimate.spec import EstimateSpec
from hf_tp.estimate.speed import BASE_LATENCY, STEP_LATENCY, Cluster, comm_seconds, predict
from hf_tp.estimate.sweep import Sweep, SweepCandidate, hsdp_pruned, sweep
from hf_tp.gpus import get_gpu
from tests.helpers import tiny_config
from tests.unit.test_estimate import tiny_dir, tiny_llama  # noqa: F401 (tiny_dir is a fixture)

H100 = get_gpu("h100-sxm")
NIC = 400e9 / 8 * 0.80


def four_layers():
    config = tiny_llama()
    config.num_hidden_layers = 4
    return config


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 3), (8, 16, 2), (4, 12, 2)])
def test_interleaved_in_flight_follows_torchs_warmup(pp, m, v) -> None:
    per_round = m // max(1, m // pp)
    warmup = _get_warmup_ops(0, v, per_round, pp, m)  # rank 0's forwards before its first backward
    assert in_flight("interleaved1f1b", pp, m, v) == min(warmup + 1, v * m) / v
    assert in_flight("1f1b", pp, m, 1) == min(pp, m) and in_flight("gpipe", pp, m, 1) == m
    assert bubble_fraction(pp, m, v) == (pp - 1) / (v * m + pp - 1)


def test_stages_cut_as_training_cuts_them_with_their_layers_configs() -> None:
    layer_types = ["sliding_attention", "full_attention"] * 2
    config = tiny_config(
        "qwen3", num_hidden_layers=4, layer_types=layer_types, sliding_window=16, use_sliding_window=True
    )
    plan = stage_plan(config, 4)
    assert [list(c) for c in plan.cuts] == [[0], [1], [2], [3]] and plan.rank_layers(2, 1) == [1, 3]
    cut = stage_config(config, plan, [1, 2])
    assert (cut.num_hidden_layers, cut.layer_types) == (2, ["full_attention", "sliding_attention"])
    deepseek = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    plan = stage_plan(deepseek, 2)
    assert [stage_config(deepseek, plan, list(c)).first_k_dense_replace for c in plan.cuts] == [2, 0]
    assert len(stage_plan(tiny_config("llama", tied=True), 2).cuts) == 2  # a tied lm_head: both ends keep it


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(pp=2, microbatches=1), r"--pp-schedule 1f1b needs at least as many micro-batches as stages"),
        (dict(pp=2, microbatches=3, batch_size=4), r"batch_size \(4\) must be a multiple of microbatches \(3\)"),
        (dict(pp=8, microbatches=8, batch_size=8), r"8 stages but the model has 4 decoder layers"),
        (dict(pp=2, microbatches=2, batch_size=2, cp=4, seq_len=36), r"seq_len \(36\) must be a multiple of 2\*cp\*tp"),
        (dict(microbatches=2), r"microbatches, pp_schedule and pp_virtual_stages are pipeline settings"),
    ],
)
def test_bad_pipeline_specs_fail_early(changes, message) -> None:
    spec = EstimateSpec(tp=1, dp=1, seq_len=64, batch_size=2, dtype="fp32").replace(**changes)
    with pytest.raises(ValueError, match=message):
        estimate_layout(four_layers(), spec)


def test_a_pipeline_layout_is_its_busiest_stage_times_the_schedule() -> None:
    config, cache = four_layers(), SimulationCache()
    spec = EstimateSpec(tp=1, dp=2, seq_len=64, batch_size=4, dtype="fp32", pp=2, microbatches=4)
    one, gpipe = (estimate_layout(config, spec.replace(pp_schedule=s), None, cache) for s in ("1f1b", "gpipe"))
    assert len(cache.runs) == 1 and cache.hits == 1  # one simulated stage serves both schedules
    stage = next(iter(cache.runs.values()))  # 2 layers, 1 row, the stage's 2 dp ranks
    assert (stage.batch_size, stage.dp, stage.world_size) == (1, 2, 2) and one.world_size == 4
    act, logits = stage.peak.activations, 64 * 8000  # the last stage's loss on whole logits
    rest = stage.peak.total - act - stage.peak.gradients
    grads = stage.trainable_params * 4  # the stage's unsharded fp32 gradients, held from its first backward
    assert grads > stage.peak.gradients and one.in_flight == 2  # min(pp, M) on rank 0
    # before the first backward (2 micro-batches, or the last rank's with its logits), or after it
    # with the gradients and still 2 micro-batches in flight (GPipe: 3)
    assert one.peak.total == rest + max(act + max(act, logits * 16), 2 * act + grads)
    assert gpipe.peak.total == rest + max(4 * act + logits * (4 * 8 + 8), 3 * act + grads)
    assert one.peak.parameters == stage.peak.parameters and one.state == stage.state
    sent = {(c.dim, c.collective): c for c in one.comms}
    times = {("dp", "reduce_scatter"): 1}  # FSDP2 reduces once
    for c in stage.comms:  # every other collective of a micro-batch, once per micro-batch and the shape pass
        n = times.get((c.dim, c.collective), 5)
        assert (sent[(c.dim, c.collective)].count, sent[(c.dim, c.collective)].bytes) == (n * c.count, n * c.bytes)
    p2p = sent[("pp", "send_recv")]  # 4 micro-batches' 64 x 256 fp32 hidden states out, their gradients back
    assert (p2p.count, p2p.bytes) == (8, 8 * 64 * 256 * 4)
    assert one.num_params == estimate(config, 1, 1, 64, 1, "fp32").num_params  # the whole model's
    assert one.work.matmul_flops == 4 * stage.work.matmul_flops
    hsdp = estimate_layout(
        config, spec.replace(dp_replicate=2, dp=4), None, lambda c, s, n: cache(c, s.replace(dp=2, dp_replicate=1), n)
    )
    replicas = next(c for c in hsdp.comms if c.dim == "dp_replicate")
    scatter = next(c for c in stage.comms if c.collective == "reduce_scatter")
    assert (replicas.count, replicas.bytes) == (scatter.count, scatter.bytes // 2)  # once per step too


def test_hsdp_from_its_shard_groups_simulation_equals_hsdp_simulated() -> None:
    spec = EstimateSpec(tp=1, dp=4, seq_len=64, batch_size=1, dtype="fp32", dp_replicate=2)
    derived, direct = estimate_layout(tiny_llama(), spec), estimate(tiny_llama(), **dataclasses.asdict(spec))
    assert (derived.peak, derived.state, derived.work) == (direct.peak, direct.state, direct.work)
    assert sorted(derived.comms, key=lambda c: (c.dim, c.collective)) == direct.comms
    replicas_only = estimate_layout(tiny_llama(), spec.replace(dp=2, dp_replicate=2))  # simulated as HSDP
    assert [c.group_size for c in replicas_only.comms if c.dim == "dp_replicate"] == [2]


def staged(pp=4, m=8, v=1, tp=8, dp=8) -> Estimate:
    mem = MemoryBreakdown(activations=GiB)
    comms = [CommStat("pp", "send_recv", pp, 2 * v * m, 2 * v * m * 2**25, 2 * v * m * 2**25)]
    return Estimate(
        "m", "llama", 10**9, tp, dp, 1, 4096, m, "bf16", True, mem, mem, comms, work=Work(matmul_flops=10**15),
        pp=pp, microbatches=m, pp_virtual_stages=v, pp_schedule="1f1b" if v == 1 else "interleaved1f1b",
    )  # fmt: skip


def test_the_bubble_and_the_stage_sends_are_on_the_critical_path() -> None:
    compute = 10**15 / (989.4e12 * 0.803)
    p2p = 16 * (BASE_LATENCY + STEP_LATENCY["net"]) + 16 * 2**25 / NIC  # stages of 64 ranks cross nodes
    speed = predict(staged(), Cluster(H100))
    assert speed.seconds["pp exposed"] == pytest.approx(p2p)
    assert speed.seconds["pp bubble"] == pytest.approx((compute + p2p) * 3 / 8)  # (pp - 1) / (V x M) of busy
    assert speed.tokens_per_second_per_gpu == pytest.approx(8 * 4096 / (8 * 4) / speed.step_seconds)
    assert speed.bubble_share == pytest.approx(3 / 11)  # (pp - 1) / (M + pp - 1)
    assert predict(staged(v=2), Cluster(H100)).bubble_share < speed.bubble_share
    near = predict(staged(pp=2, tp=2, dp=2), Cluster(H100))  # 2 stages of 4 ranks: one node, NVLink
    assert near.seconds["pp exposed"] < speed.seconds["pp exposed"] / 5


def test_a_sweep_across_nodes_tries_hsdp_and_pipelines_sharing_simulations() -> None:
    gpu = dataclasses.replace(H100, gpus_per_node=2)  # 4 ranks are 2 nodes
    seen: list[tuple[int, int, int, int]] = []

    def stand_in(config, spec, name) -> Estimate:  # cost grows with the layers a rank runs
        seen.append((config.num_hidden_layers, spec.tp, spec.dp, spec.batch_size))
        mem = MemoryBreakdown(parameters=GiB // spec.dp, activations=config.num_hidden_layers * spec.batch_size * GiB)
        work = Work(matmul_flops=10**12 * config.num_hidden_layers * spec.batch_size // spec.tp)
        comm = CommStat("dp", "all_gather", spec.dp, 9, 2**30, 2**30) if spec.dp > 1 else None
        return Estimate(
            "m", "llama", 10**8, spec.tp, spec.dp, 1, spec.seq_len, spec.batch_size, "bf16",
            spec.activation_checkpointing, mem, mem, [comm] if comm else [], work=work,
        )  # fmt: skip

    result = sweep(four_layers(), 4, seq_len=64, batch_size=4, cluster=Cluster(gpu), simulate=stand_in, grow=False)
    layouts = {(e.pp, e.pp_schedule, e.tp, e.dp, e.dp_replicate) for e in result.estimates}
    assert {(1, "1f1b", 1, 4, 2), (2, "1f1b", 1, 2, 1), (2, "interleaved1f1b", 2, 1, 1)} <= layouts
    assert len(seen) < len(result.estimates)  # 1F1B and interleaved share their stage's simulation
    assert {e.microbatches for e in result.estimates if e.pp == 2} == {4}  # --batch-size 4 split for pp 2
    header = format_ranking(result).splitlines()[1].split()
    assert header[:7] == ["#", "pp", "sched", "M", "repl", "tp", "dp"] and "bubble" in header


def test_hsdp_is_not_simulated_where_its_fsdp2_counterpart_rules_it_out() -> None:
    gpu = dataclasses.replace(H100, gpus_per_node=2)

    def plain(peak_gib: float, ac: bool) -> Estimate:
        mem = MemoryBreakdown(parameters=int(peak_gib * GiB))
        return Estimate("m", "llama", 10**9, 1, 4, 1, 4096, 1, "bf16", ac, mem, mem, [], work=Work(matmul_flops=10**14))

    hsdp = SweepCandidate(1, 4, dp_replicate=2)
    result = Sweep(world_size=4, gpu_memory=80 * GiB, cluster=Cluster(gpu))
    assert hsdp_pruned(result, hsdp) is None  # nothing to compare with yet
    result.estimates += [plain(90.0, False), plain(85.0, True)]
    assert "does not fit even with checkpointing" in hsdp_pruned(result, hsdp)
    result.estimates[1] = plain(20.0, True)  # fits, and no FSDP2 time to save: HSDP cannot be faster
    assert "below the best that fits" in hsdp_pruned(result, hsdp)


def test_fsdp2_and_the_replicas_all_reduce_hide_behind_one_compute_window() -> None:
    compute = 10**15 / (989.4e12 * 0.803)  # 1.26 s
    nbytes = int(0.8 * compute * NIC)  # each dim's traffic alone fits in the compute, both together do not
    comms = [
        CommStat("dp", "all_gather", 8, 100, 8 * nbytes // 7, nbytes),
        CommStat("dp_replicate", "all_reduce", 8, 100, 4 * nbytes // 7, nbytes),
    ]
    est = dataclasses.replace(staged(pp=1, m=1), comms=comms, dp_replicate=8, dp=64)
    speed = predict(est, Cluster(H100))
    total = sum(speed.comm[d] for d in ("dp", "dp_replicate"))
    edges = speed.comm["dp"] / 100 + speed.comm["dp_replicate"] / 100
    exposed = speed.seconds["dp exposed"] + speed.seconds["dp_replicate exposed"]
    assert exposed == pytest.approx(edges + (total - edges - compute))
    fsdp2 = [CommStat("dp", "all_gather", 8, 40, 2**30, 2**30), CommStat("dp", "reduce_scatter", 8, 4, 2**30, 2**30)]
    flat, piped = (dataclasses.replace(staged(pp=pp, m=m), comms=fsdp2) for pp, m in ((1, 1), (4, 8)))
    scatter = comm_seconds(flat, Cluster(H100))["dp"]["reduce_scatter"]
    flat_s, piped_s = (predict(e, Cluster(H100)).seconds["dp exposed"] for e in (flat, piped))
    assert piped_s == pytest.approx(flat_s + scatter * 3 / 4)  # a stage reduces after its step: all exposed


def test_cli_estimates_one_pipeline_layout_and_leaves_pp_to_the_sweep(tiny_dir, capsys) -> None:  # noqa: F811
    args = ["--model", str(tiny_dir), "--seq-len", "64", "--dtype", "fp32", "--pp", "2", "--microbatches", "2"]
    assert main([*args, "--batch-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["pp"], out["microbatches"], out["stage_layers"], out["in_flight"], out["world_size"]) == (2, 2, 1, 2, 2)
    assert main([*args, "--world-size", "4"]) == 2
    assert "the --gpu-memory/--world-size sweep chooses them itself" in capsys.readouterr().err
