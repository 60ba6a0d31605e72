"""Pipeline parallelism with cp, ep and a tied lm_head in the estimate: a layout's arithmetic on a
stand-in stage simulation (the collectives a stage counts, scaled over the schedule; the stage's cp
tokens in its sends and logits; a MoE's experts 1/ep on a rank in the held gradients; the tied
weight's gradient sum over the first and last stage), the refusals shared with training, the sweep's
stage splits and pipelines with ep, and one real simulated pp x cp x ep stage."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from hf_tp.estimate.counters import CommStat, Work
from hf_tp.estimate.estimate_run import Estimate, GiB
from hf_tp.estimate.layouts import estimate_layout, stage_plan
from hf_tp.estimate.memory import MemoryBreakdown
from hf_tp.estimate.spec import EstimateSpec
from hf_tp.estimate.speed import Cluster
from hf_tp.estimate.sweep import pipeline_layouts, sweep
from hf_tp.gpus import get_gpu

HIDDEN, VOCAB = 64, 1001


def moe(**fields) -> Qwen3MoeConfig:
    sizes = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01,
    )  # fmt: skip
    return Qwen3MoeConfig(**{**sizes, **fields})


def llama(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
    )  # fmt: skip


# One micro-batch's collectives of the stand-in stage: (dim, collective, count)
STAGE_COMMS = [
    ("cp", "all_gather", 4),
    ("dp", "all_gather", 3),
    ("dp", "reduce_scatter", 3),
    ("dp_out", "all_gather", 2),
    ("dp_out", "reduce_scatter", 2),
    ("ep", "all_to_all", 8),
    ("tp", "all_gather", 4),
]


class StandIn:
    """A stage simulation of known figures that records what it was asked to simulate."""

    def __init__(self, trainable: int = 10**7) -> None:
        self.calls: list[tuple[object, EstimateSpec]] = []
        self.trainable = trainable

    def __call__(self, config, spec: EstimateSpec, name) -> Estimate:
        self.calls.append((config, spec))
        peak = MemoryBreakdown(parameters=GiB, gradients=GiB // 8, activations=GiB // 2, temporary=GiB // 4)
        comms = [CommStat(d, c, 2, n, n * 1000, n * 500) for d, c, n in STAGE_COMMS]
        return Estimate(
            "m", config.model_type, 10**7, spec.tp, spec.dp, spec.ep, spec.seq_len, spec.batch_size, "fp32", False,
            peak, peak, comms, cp=spec.cp, trainable_params=self.trainable,
            work=Work(matmul_flops=10**12 * config.num_hidden_layers * spec.batch_size),
        )  # fmt: skip


def by_kind(est: Estimate) -> dict[tuple[str, str], CommStat]:
    return {(c.dim, c.collective): c for c in est.comms}


def test_pp_with_ep_and_cp_scales_the_stages_collectives_and_splits_its_experts_gradients() -> None:
    config, sim = moe(), StandIn(trainable=10**9)  # the held gradients (4 GB) make the peak
    # bf16 (a mixture of experts estimates in fp32 only from transformers 5.23: the release floor runs these)
    spec = EstimateSpec(tp=1, dp=2, seq_len=64, batch_size=8, dtype="bf16", ep=4, cp=2, pp=2, microbatches=4)
    est = estimate_layout(config, spec, None, sim)
    (stage_cfg, simulated), m = sim.calls[0], 4
    assert (simulated.pp, simulated.ep, simulated.cp, simulated.batch_size, stage_cfg.num_hidden_layers) == (
        1,
        4,
        2,
        2,
        2,
    )
    comms = by_kind(est)
    once = {("dp", "reduce_scatter"), ("dp_out", "reduce_scatter")}  # FSDP2 (experts' too) reduces after the step
    for dim, collective, n in STAGE_COMMS:
        times = 1 if (dim, collective) in once else m + 1  # per micro-batch and the schedule's shape pass
        assert comms[(dim, collective)].count == n * times, (dim, collective)
    # a micro-batch's 2 rows of hidden states, this rank's cp half of the tokens, out and their gradients back
    assert comms[("pp", "send_recv")].bytes == 2 * m * (2 * 64 // 2 * HIDDEN * 2)
    # the gradient norm's squares and the aux loss's routing counts summed over the stages
    assert (comms[("pp", "all_reduce")].count, comms[("pp", "all_reduce")].bytes) == (2, 8 + (8 + 1) * 4)
    assert (est.ep, est.cp, est.routing_pass, est.world_size) == (4, 2, True, 8)
    # the stage's unsharded fp32 gradients, held from its first backward: its experts 1/ep on a rank
    plan = stage_plan(config, 2)
    experts = 8 * 3 * HIDDEN * 32
    assert plan.expert_costs == (experts,) * 4
    layers = plan.rank_layers(2, plan.busiest_rank(2))
    grads = (10**9 - 2 * experts + 2 * experts // 4) * 4
    assert len(layers) == 2 and est.peak.gradients == grads


def test_a_stage_of_dense_layers_is_simulated_without_ep_as_training_runs_it() -> None:
    # the first three layers dense and heavy: the busiest rank holds the first two, no experts
    config, sim = moe(mlp_only_layers=[0, 1, 2], intermediate_size=2048), StandIn()
    est = estimate_layout(config, EstimateSpec(1, 2, 64, 4, "bf16", ep=2, pp=2, microbatches=2), None, sim)
    plan = stage_plan(config, 2)
    assert plan.busiest_rank(2) == 0 and plan.expert_costs[:2] == (0, 0)
    assert sim.calls[0][1].ep == 1 and est.ep == 2


def test_the_last_stage_loss_takes_its_cp_tokens_logits() -> None:
    sim = StandIn()
    spec = EstimateSpec(
        tp=1, dp=1, seq_len=64, batch_size=2, dtype="fp32", cp=2, pp=2, microbatches=2, pp_schedule="gpipe"
    )
    est = estimate_layout(llama(False), spec, None, sim)
    act, logits = GiB // 2, 64 // 2 * VOCAB  # a row of 64 tokens, 32 of them on this cp rank
    rest = GiB + GiB // 4
    # GPipe: both micro-batches in flight on rank 0, or the last rank's with their logits (2 held + 1 backward)
    before = GiB // 8 + act + max(act, act + logits * (2 * 8 + 8))
    during = max(GiB // 8, 10**7 * 4) + act  # the held gradients with one micro-batch still in flight
    assert before > during and est.peak.total == rest + before


def test_a_tied_lm_head_is_held_by_both_ends_and_its_gradient_summed_between_them() -> None:
    plan = stage_plan(llama(True), 4)
    assert plan.tied and plan.embedding_shape == (VOCAB, HIDDEN) and not stage_plan(llama(False), 4).tied
    spec = EstimateSpec(tp=2, dp=2, seq_len=64, batch_size=4, dtype="bf16", cp=2, pp=4, microbatches=4)
    est = estimate_layout(llama(True), spec, None, StandIn())
    pp = by_kind(est)[("pp", "all_reduce")]
    shard = 126 * HIDDEN * 4  # its fp32 shard: of 1001 vocab rows 501 on a tp rank, 126 of those on a dp x cp rank
    assert (pp.count, pp.group_size, pp.bytes) == (2, 4, 8 + shard)
    assert pp.sent_bytes == int(8 * 2 * 3 / 4) + shard  # the norm over 4 stages, the weight between 2 ranks
    lora = estimate_layout(llama(True), spec.replace(lora_r=4), None, StandIn())
    assert by_kind(lora)[("pp", "all_reduce")].count == 1  # frozen: nothing to sum
    with pytest.raises(ValueError, match=r"--pp-schedule zbv runs the first and the last stage on one rank"):
        estimate_layout(llama(True), spec.replace(pp=2, pp_schedule="zbv", pp_virtual_stages=2), None, StandIn())


def test_the_sweep_tries_pipelines_with_cp_and_ep_on_the_stage_splits_they_take() -> None:
    skipped: list[str] = []
    spec = EstimateSpec(1, 1, 64, 4, "bf16", ep=4, cp=2)
    seen = []

    def splits_of(ranks: int) -> list[tuple[int, int]]:
        seen.append(ranks)
        return [(1, ranks), (ranks // 2, 2), (ranks, 1)]

    layouts = pipeline_layouts(moe(), 32, spec, 8, False, splits_of, skipped, ("1f1b",))
    assert seen == [8, 4]  # pp 2 and 4 of 32 ranks, a stage's tp x dp without its cp
    assert {(lay.pp, lay.tp, lay.dp) for lay in layouts} == {(2, 1, 8), (2, 4, 2), (4, 1, 4), (4, 2, 2)}
    assert any("ep must divide dp x cp (2)" in s for s in skipped)  # pp 2 x tp 8 x dp 1 x cp 2: ep 4 cannot split


def test_a_real_stage_of_pp_cp_and_ep_is_simulated() -> None:
    spec = EstimateSpec(tp=1, dp=1, seq_len=32, batch_size=2, dtype="bf16", ep=2, cp=2, pp=2, microbatches=2)
    est = estimate_layout(moe(), spec)
    comms = by_kind(est)
    assert {("cp", "all_gather"), ("ep", "all_to_all"), ("pp", "send_recv"), ("pp", "all_reduce")} <= set(comms)
    assert comms[("pp", "send_recv")].bytes == 2 * 2 * (32 // 2 * HIDDEN * 2)
    assert est.peak.total > est.state.total and est.stage_layers == 2


def test_a_sweep_with_ep_across_nodes_tries_pipelines_without_hsdp() -> None:
    gpu = dataclasses.replace(get_gpu("h100-sxm"), gpus_per_node=2)  # 8 ranks are 4 nodes
    result = sweep(moe(), 8, seq_len=64, batch_size=4, ep=2, cluster=Cluster(gpu), simulate=StandIn(), grow=False)
    layouts = {(e.pp, e.tp, e.dp, e.ep, e.dp_replicate) for e in result.estimates}
    assert {(2, 1, 4, 2, 1), (4, 1, 2, 2, 1)} <= layouts  # pp with ep inside each stage's dp ranks
    # HSDP does not combine with ep: no HSDP layout simulated, nor pruned
    assert all(e.dp_replicate == 1 for e in result.estimates) and not any("HSDP" in s for s in result.skipped)


def test_a_v_shaped_rank_holds_the_first_and_last_stages_layers_and_its_own_experts() -> None:
    config = moe(num_hidden_layers=8, mlp_only_layers=[0, 1])  # stage 0 dense, stages 1-3 MoE
    plan = stage_plan(config, 4)
    assert plan.rank_layers(2, 0, "dualpipev") == [0, 1, 6, 7] and plan.rank_layers(2, 0) == [0, 1, 4, 5]
    spec = EstimateSpec(1, 2, 64, 8, "bf16", ep=2, pp=2, microbatches=4, pp_schedule="dualpipev", pp_virtual_stages=2)
    sim = StandIn(trainable=10**9)
    est = estimate_layout(config, spec, None, sim)
    layers = plan.rank_layers(2, plan.busiest_rank(2, "dualpipev"), "dualpipev")
    assert sim.calls[0][0].num_hidden_layers == len(layers) == 4
    others = sum(plan.expert_costs[i] for i in layers) // 2  # the other ep rank's experts
    # the stage's gathered bf16 weights kept through the step, and its fp32 gradients: its own experts only
    assert est.peak.other == (10**7 - others) * 2 and est.peak.gradients == (10**9 - others) * 4
