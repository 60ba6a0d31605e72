"""The fast estimate (:mod:`hf_tp.estimate.depth`: the model cut to 4 and 5 periods of its layer
kinds, extended to its depth) against the simulation of every layer, on tiny dense, MoE and
mixed-kind configs: the state after the step, every collective, the work, the MoE figures and the
parameter counts equal; the peak equal too, to the byte."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
from transformers import CONFIG_MAPPING

from hf_tp.compat import family_refusal
from hf_tp.estimate import EstimateSpec, depth, estimate_spec
from hf_tp.estimate import sweep as sweep_module
from hf_tp.estimate.depth import Layering, cut_config, estimate_fast, layering
from hf_tp.estimate.speed import Cluster
from hf_tp.estimate.sweep import Sweep, verify_best
from hf_tp.gpus import get_gpu
from tests.unit.test_estimate_speed_layouts import make

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def _family(model_type: str, **fields):
    if model_type not in CONFIG_MAPPING or family_refusal(model_type):
        pytest.skip(f"{model_type} is not supported by this transformers release")
    return CONFIG_MAPPING[model_type](max_position_embeddings=256, **SIZES, **fields)


def same(config, spec: EstimateSpec) -> None:
    """The fast estimate equals the full one in everything it reports but the time taken."""
    fast, full = estimate_fast(config, spec), estimate_spec(config, spec)
    assert fast.extended_from and not full.extended_from
    assert fast.peak.total == full.peak.total  # to the byte (the segments extend exactly)
    assert fast.state == full.state
    key = lambda c: (c.dim, c.collective)  # noqa: E731
    assert sorted(fast.comms, key=key) == sorted(full.comms, key=key)
    assert fast.work == full.work and fast.moe == full.moe
    assert (fast.num_params, fast.trainable_params) == (full.num_params, full.trainable_params)
    assert fast.model_flops_per_token == pytest.approx(full.model_flops_per_token, rel=1e-12)


def test_dense_with_activation_checkpointing_matches_full() -> None:
    # with recompute the peak's moment moves with the depth (the start of backward against a layer
    # next to the first): the segments of both short runs still place it exactly
    config = _family("llama", num_hidden_layers=6)
    assert layering(config) == Layering(0, 1, 6)
    same(config, EstimateSpec(2, 2, 64, 1, activation_checkpointing=True))


def test_moe_with_ep_matches_full() -> None:
    config = _family("qwen3_moe", num_hidden_layers=6, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    same(config, EstimateSpec(1, 2, 64, 1, ep=2))


def test_mixed_layer_kinds_match_full() -> None:
    config = _family("gemma2", num_hidden_layers=12, head_dim=16, sliding_window=16)
    assert layering(config) == Layering(0, 2, 6)
    assert cut_config(config, 8).layer_types == config.layer_types[:8]
    same(config, EstimateSpec(1, 2, 64, 1))


def test_layerings() -> None:
    # DeepSeek-V3's first dense layer is a prefix simulated on its own; too shallow or not
    # repeating: simulated in full
    dense_first = _family(
        "deepseek_v3", num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2
    )
    assert layering(dense_first) == Layering(1, 1, 7)
    assert layering(_family("llama", num_hidden_layers=5)) is None
    assert layering(_family("gemma2", num_hidden_layers=11, head_dim=16)) is None  # 11 layers of a period of 2


def test_the_best_layout_is_simulated_at_every_layer_and_the_next_checked_where_it_does_not_fit(monkeypatch) -> None:
    # tp 1 is the fastest by its fast estimate, but its full simulation does not fit 80 GiB: tp 2 is
    # then simulated in full and recommended; tp 4 (slower) is never simulated again
    fast = [dataclasses.replace(make(tp=t, dp=8 // t, matmul_flops=10**15), extended_from=(4, 5)) for t in (1, 2, 4)]
    full = {1: make(tp=1, dp=8, fixed_gib=90.0, matmul_flops=10**15), 2: make(tp=2, dp=4, matmul_flops=10**15)}
    calls = []

    def simulate(config, spec, model_name=None, stage=None):
        assert not stage.simulate.fast  # every layer
        calls.append(spec.tp)
        return full[spec.tp]

    monkeypatch.setattr(sweep_module, "estimate_layout", simulate)
    result = Sweep(world_size=8, gpu_memory=80 * 2**30, cluster=Cluster(get_gpu("h100-sxm")), estimates=list(fast))
    lines: list[str] = []
    verify_best(result, None, "m", lines.append)
    assert calls == [1, 2] and result.recommended is full[2]
    assert result.estimates == [full[1], full[2], fast[2]]  # replaced in place, the rest kept
    assert lines[0] == "simulating tp=1 x dp=8, batch 1, at every layer (the best)"


def test_a_checked_extension_predicts_a_deeper_run_or_falls_back_to_every_layer(monkeypatch) -> None:
    config, spec, sims = _family("llama", num_hidden_layers=8), EstimateSpec(2, 1, 64, 1), depth.Simulations()
    same = depth.same_figures
    checked = estimate_fast(config, spec, sims=sims, check=True)
    assert checked.extended_from == (4, 5, 6)  # cut to 4 and 5 layers, checked exact at 6
    monkeypatch.setattr(depth, "same_figures", lambda a, b: False)  # an extension that misses the deeper run
    full = estimate_fast(config, spec, sims=sims, check=True)  # (the short runs kept by ``sims``)
    assert full.extended_from == () and full.seconds > 0  # every layer simulated
    assert same(checked, full)  # (and the extension was right: to the byte at 8 layers)


def test_a_sweep_in_worker_processes_equals_one_in_this_process() -> None:
    # the simulations forked to two workers (queued ahead, as a sweep on many cores runs them) give
    # the sweep run here, estimate for estimate
    config = _family("llama", num_hidden_layers=8)
    runs = [
        sweep_module.sweep(config, 2, seq_len=64, batch_size=1, gpu_memory=4 * 2**30, jobs=jobs, verify="check")
        for jobs in (1, 2)
    ]
    here, workers = ([dataclasses.replace(e, seconds=0.0) for e in r.estimates] for r in runs)
    assert here == workers and len(here) == 2
    assert runs[1].recommended.extended_from == (4, 5, 6)


def test_a_worker_that_dies_is_one_clear_error() -> None:
    config, spec = _family("llama", num_hidden_layers=2), EstimateSpec(1, 1, 64, 1)
    with depth.Simulations(2) as sims:
        sims.submit(config, spec, None)
        for pid in sims._pool._processes:  # killed mid-simulation (out of memory, a signal)
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(depth.WorkerDied, match="rerun with fewer --jobs"):
            sims.get(config, spec, None)


def test_without_fork_a_sweep_runs_in_its_own_process_or_says_why(monkeypatch) -> None:
    monkeypatch.setattr(depth.threading, "active_count", lambda: 1)
    assert depth._context(2).get_start_method() == "fork"  # (no imports: the workers are this process)
    monkeypatch.setattr(depth.threading, "active_count", lambda: 3)  # another Python thread (pytest-xdist's, Jupyter's)
    assert depth._context(2).get_start_method() == "forkserver" and depth.default_jobs() == 1
    monkeypatch.setattr(depth.multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # (Windows)
    assert depth.default_jobs() == 1
    with depth.Simulations(2) as sims, pytest.raises(ValueError, match="cannot fork .*use --jobs 1"):
        sims.submit(_family("llama", num_hidden_layers=2), EstimateSpec(1, 1, 64, 1), None)
