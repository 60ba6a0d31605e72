"""``hf-tp train --layout auto``: the choice without a GPU (largest valid tp), with one (the sweep's
ranking, here on hand-made estimates), the settings it writes and the prediction the loop logs.
(tests/e2e/test_train_cli.py launches a run laid out this way.)"""

from __future__ import annotations

import dataclasses
import types

import pytest

from hf_tp.cli import auto_layout
from hf_tp.cli.main import main
from hf_tp.estimate import sweep as sweep_module
from hf_tp.estimate.speed import Cluster
from hf_tp.estimate.sweep import Sweep
from hf_tp.gpus import get_gpu
from hf_tp.run.config import TrainConfig
from hf_tp.train.loop import _metrics_record
from tests.helpers import tiny_config
from tests.unit.test_estimate_moe import tiny_moe
from tests.unit.test_estimate_speed import make

AUTO = dict(layout="auto", seq_len=64, batch_size=2)


@pytest.mark.parametrize(
    ("config", "world", "extra", "best", "runner"),
    [
        (tiny_config("llama"), 4, {}, (4, 1), (2, 2)),  # 4 heads: tp 4 first
        (tiny_config("llama"), 6, {}, (2, 3), (1, 6)),  # tp must divide the ranks too
        (tiny_moe(), 4, dict(ep=2), (2, 2), (1, 4)),  # ep 2 must divide dp: tp 4 x dp 1 is out
    ],
)
def test_without_a_gpu_the_largest_valid_tp_is_chosen(config, world, extra, best, runner) -> None:
    cfg = TrainConfig(**AUTO, **extra)
    got, second = auto_layout.choose(cfg, config, world, print)
    assert ((got.tp, got.dp), (second.tp, second.dp)) == (best, runner)
    assert got.tokens_per_sec_per_gpu is None  # nothing predicted


def test_with_a_gpu_the_fastest_fitting_layout_is_chosen_and_logged(monkeypatch) -> None:
    # the sweep's ranking on hand-made estimates: tp 1 fastest (no tp collectives) but too big for 80 GiB
    lean = make(tp=2, dp=4, matmul_flops=10**15, flops_per_token=10**15 / (4096 * 2 / 2))
    tp_heavy = make(tp=4, dp=2, matmul_flops=10**15, flops_per_token=10**15 / (4096 * 2 / 4))
    too_big = make(tp=1, dp=8, peak_gib=90.0, matmul_flops=10**15, flops_per_token=10**15 / (4096 * 2))
    seen = {}

    def fake_sweep(config, world, spec, *, cluster, grow, progress, verified, pp_schedules, jobs):
        seen.update(world=world, spec=spec, grow=grow, verified=verified, pp_schedules=pp_schedules, jobs=jobs)
        result = Sweep(world_size=world, gpu_memory=cluster.gpu.memory_bytes, cluster=cluster)
        result.estimates += [lean, tp_heavy, too_big]
        return result

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    cfg = TrainConfig(**AUTO, gpu="h100-sxm", activation_checkpointing=True)
    best, runner = auto_layout.choose(cfg, tiny_config("llama"), 8, print)
    assert (best.tp, best.dp, runner.tp, runner.dp) == (2, 4, 4, 2)
    assert seen["world"] == 8 and seen["grow"] is False  # the batch stays --batch-size
    assert seen["verified"] == 2  # the chosen layout and the runner-up simulated at every layer
    assert (seen["spec"].seq_len, seen["spec"].batch_size, seen["spec"].activation_checkpointing) == (64, 2, True)
    assert "predicted peak 10.0 GiB per GPU" in best.describe()
    chosen = auto_layout.apply(cfg, best, 8)
    assert (chosen.tp, chosen.dp, chosen.layout, chosen.gpu) == (2, 4, "manual", None)
    assert chosen.predicted_speed == pytest.approx(best.tokens_per_sec_per_gpu * 8)
    chosen.validate()  # what the ranks and config.yaml get is a plain, valid layout
    record = _metrics_record(  # the loop logs the prediction next to the measurement
        types.SimpleNamespace(cfg=chosen, peak_flops=None, device=types.SimpleNamespace(type="cpu")),
        0,
        types.SimpleNamespace(tokens=100, num_targets=90),
        types.SimpleNamespace(loss=1.0, grad_norm=1.0, lr=1e-3, aux_loss=None, metrics={}),
        0.5,
    )
    assert record["predicted_tokens_per_sec"] == chosen.predicted_speed and record["tokens_per_sec"] == 200
    assert record["predicted_mfu"] == pytest.approx(best.mfu)
    monkeypatch.setattr(
        sweep_module, "sweep", lambda *a, **k: Sweep(8, 10 * 2**30, cluster=Cluster(get_gpu("h100-sxm")))
    )
    with pytest.raises(ValueError, match=r"^no layout of 8 x h100-sxm fits at --batch-size 2"):
        auto_layout.choose(cfg, tiny_config("llama"), 8, print)


def test_requests_that_cannot_be_honoured_fail_before_launch(capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cases = [
        (["--layout", "auto", "--tp", "2", "--world", "2"], "--layout auto chooses --tp and --dp: drop --tp"),
        (["--gpu", "h100-sxm"], "--gpu and --world choose a layout: add --layout auto"),
        (["--layout", "auto", "--gpu", "h9000", "--world", "2"], "unknown --gpu 'h9000'"),
        (["--layout", "auto", "--device", "cpu"], "--layout auto on CPU needs --world N"),
        (["--layout", "auto", "--world", "4", "--dp-replicate", "2"], "--layout auto chooses --pp and --dp-replicate"),
    ]
    for flags, message in cases:
        capsys.readouterr()
        assert main(["train", *flags, "--output-dir", "/nonexistent/never"]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-tp train: error: ") and message in err and "\n" not in err, err
    monkeypatch.setenv("WORLD_SIZE", "8")  # under torchrun the world is torchrun's
    assert auto_layout.world_of(TrainConfig(layout="auto", world=2)) == 8


def test_a_pipeline_and_hsdp_layout_can_be_chosen_with_all_its_flags(monkeypatch) -> None:
    flat = make(tp=2, dp=4, matmul_flops=10**15, flops_per_token=10**15 / (4096 * 2 / 2))
    piped = dataclasses.replace(
        make(tp=2, dp=4, matmul_flops=10**14, flops_per_token=10**15 / (4096 * 2 / 2)),
        batch_size=8, pp=2, pp_schedule="interleaved1f1b", pp_virtual_stages=2, microbatches=4, dp_replicate=2,
    )  # fmt: skip
    seen = {}

    def fake_sweep(config, world, spec, *, cluster, grow, progress, pp_schedules, verified, jobs):
        seen["schedules"] = pp_schedules
        result = Sweep(world_size=world, gpu_memory=cluster.gpu.memory_bytes, cluster=cluster)
        result.estimates += [flat, piped]
        return result

    monkeypatch.setattr(sweep_module, "sweep", fake_sweep)
    cfg = TrainConfig(**(AUTO | dict(batch_size=8)), gpu="h100-sxm")
    best, runner = auto_layout.choose(cfg, tiny_config("llama", num_hidden_layers=4), 16, print)
    assert seen["schedules"] == ("1f1b", "interleaved1f1b") and (runner.pp, runner.tp) == (1, 2)
    assert (
        "pp 2 (interleaved1f1b x 2 stages per rank, 4 micro-batches) x tp 2 x dp 4 (HSDP: 2 replicas)"
        in best.describe()
    )
    chosen = auto_layout.apply(cfg, best, 16)
    got = (chosen.pp, chosen.pp_schedule, chosen.pp_virtual_stages, chosen.microbatches, chosen.dp_replicate)
    assert got == (2, "interleaved1f1b", 2, 4, 2) and (chosen.tp, chosen.dp, chosen.layout) == (2, 4, "manual")
    chosen.validate()  # a plain, valid pipeline layout of 16 ranks
    assert chosen.world_size == 16
    # what --pp does not combine with yet takes pipelines out; cp and ep inside the stages and a run that
    # saves (several stages a rank save) keep both
    assert auto_layout._schedules(TrainConfig(**AUTO, compile=True)) == ()
    assert auto_layout._schedules(TrainConfig(**AUTO, cp=2)) == auto_layout._schedules(TrainConfig(**AUTO, ep=2))
    assert auto_layout._schedules(TrainConfig(**AUTO, save_every=10)) == (
        "1f1b",
        "interleaved1f1b",
    )
