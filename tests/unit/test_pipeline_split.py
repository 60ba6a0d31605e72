"""Cutting a HF model into pipeline stages: balanced contiguous cuts, names kept, and one-line
refusals for what a stage cut cannot keep exact (single process; the schedules' parity runs in
tests/e2e/test_pipeline_torchrun.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hf_tp
from hf_tp.adapters import get_adapter
from hf_tp.core.dims import check_pipeline
from hf_tp.core.record import record_of
from hf_tp.pipeline.pipeline_build import pipeline_parallelize
from hf_tp.pipeline.pipeline_split import LayerGap, balanced_cuts, check_splittable, cut_stage
from hf_tp.run.config import TrainConfig
from tests.helpers import tiny_config, tiny_model


def test_balanced_cuts_minimise_the_heaviest_stage() -> None:
    assert balanced_cuts([1.0] * 4, 2) == [range(0, 2), range(2, 4)]
    assert balanced_cuts([3.0, 1.0, 1.0, 1.0], 2) == [range(0, 1), range(1, 4)]
    assert balanced_cuts([1.0] * 5, 2) == [range(0, 2), range(2, 5)]  # the earlier stage lighter
    assert balanced_cuts([1.0] * 3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match=r"at least one decoder layer per stage: 2 layers < 4 stages"):
        balanced_cuts([1.0, 1.0], 4)


def test_a_stage_keeps_its_layers_names_and_attention_types() -> None:
    config = tiny_config("gemma3_text", num_hidden_layers=4, layer_types=["full_attention", "sliding_attention"] * 2)
    model = tiny_model(config)
    names = dict(model.named_parameters())
    stage = cut_stage(model, get_adapter(config), range(2, 4), copy_model=True)
    kept = dict(stage.named_parameters())
    assert set(kept) == {
        n for n in names if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head."))
    }
    assert all(torch.equal(kept[n], names[n]) for n in kept)
    # Gemma 3 picks each layer's mask by its position in enumerate(self.layers): the gaps keep them true
    assert [i for i, layer in enumerate(stage.model.layers) if not isinstance(layer, LayerGap)] == [2, 3]
    # Some families read decoder_layer.attention_type: a gap keeps the layer's plain attributes
    layer = torch.nn.Linear(2, 2)
    layer.attention_type, layer.layer_idx = "sliding_attention", 3
    gap = LayerGap(layer)
    assert (gap.attention_type, gap.layer_idx) == ("sliding_attention", 3) and not list(gap.parameters())


def test_a_tied_weight_is_held_by_the_first_and_last_stage_under_both_names() -> None:
    model = tiny_model(tiny_config("qwen2", tied=True, num_hidden_layers=3))
    adapter = get_adapter(model.config)
    check_splittable(model, adapter)  # accepted
    stages = [cut_stage(model, adapter, range(i, i + 1), copy_model=True) for i in range(3)]
    for stage in (stages[0], stages[2]):  # a whole model's names, one Parameter: checkpoints hold it as at pp 1
        assert stage.lm_head.weight is stage.model.embed_tokens.weight
        assert torch.equal(stage.lm_head.weight, model.lm_head.weight)
    assert not any("embed" in n or "lm_head" in n for n, _ in stages[1].named_parameters(remove_duplicate=False))


def test_what_a_stage_cut_cannot_keep_exact_is_refused() -> None:
    granite = tiny_model(tiny_config("llama", num_hidden_layers=2))  # a scaled embedding, as Granite's forward has
    forward = type(granite.model).forward

    def scaled(self, inputs_embeds=None, **kwargs):
        return forward(self, inputs_embeds=inputs_embeds * 2.0, **kwargs)

    type(granite.model).forward = scaled
    try:
        with pytest.raises(ValueError, match=r"changes the hidden states outside its decoder layers"):
            check_splittable(granite, get_adapter(granite.config))
    finally:
        type(granite.model).forward = forward
    plain = tiny_model(tiny_config("llama", num_hidden_layers=2))
    check_splittable(plain, get_adapter(plain.config))  # untouched: accepted


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(pp=2, microbatches=1), r"--pp-schedule 1f1b needs at least as many micro-batches .* 1 < --pp 2"),
        (dict(pp=2, batch_size=3), r"--batch-size \(3\) must be a multiple of --microbatches \(2\)"),
        (dict(pp=2, pp_schedule="interleaved1f1b"), r"set --pp-virtual-stages 2 or more"),
        (dict(pp=2, pp_virtual_stages=2), r"needs --pp-schedule interleaved1f1b"),
        (dict(pp=2, pp_schedule="zb"), r"--pp-schedule must be one of 1f1b, gpipe, interleaved1f1b, loopedbfs, zbv"),
        (dict(pp=2, pp_schedule="zbv"), r"zbv places exactly 2 stages per rank \(V-shaped\): set --pp-virtual"),
        (dict(pp=2, compile=True, batch_size=2), r"--pp does not combine with --compile yet"),
        (
            dict(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2, microbatches=2, batch_size=2),
            r"dualpipev needs at least as many micro-batches as stages: --microbatches 2 < 4",
        ),
        (dict(microbatches=4), r"are pipeline settings: add --pp N"),
        (
            dict(pp=2, objective="dpo", batch_size=2, eval_split=0.25),
            r"--pp with --objective dpo does not evaluate held-out pairs yet: drop --eval-split",
        ),
    ],
)
def test_bad_pipeline_settings_are_one_line(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings).resolve().validate()


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"4 stages but the model has 2 decoder layers: at most one stage per layer"):
        check_pipeline(2, "interleaved1f1b", 2, 2, layers=2)
    assert TrainConfig(pp=2, tp=1, dp=2).resolve().world_size == 4
    # a split backward (zbv, dualpipev) under FSDP2 with gradient accumulation: exact (the torchrun grid)
    TrainConfig(pp=2, dp=2, pp_schedule="zbv", pp_virtual_stages=2, batch_size=2, grad_accum=2).resolve().validate()
    # the objective gives the last stage its loss: preference objectives run over a pipeline
    for objective in ("dpo", "simpo"):
        TrainConfig(pp=2, objective=objective, batch_size=2).resolve().validate()
    # context and expert parallelism run inside each stage
    both = TrainConfig(pp=2, tp=1, dp=2, cp=2, ep=4, batch_size=2).resolve()
    both.validate()
    assert both.world_size == 8


def test_cp_and_ep_refusals_read_the_whole_model_on_every_rank() -> None:
    # A stage sees only its layers; the checks that read them run on the whole model first, so
    # every rank of every stage refuses alike (4 threaded ranks: refused before any send/recv).
    import copy
    import re

    from transformers import AutoModelForCausalLM

    import hf_tp
    from hf_tp.compat import family_refusal
    from hf_tp.pipeline.pipeline_build import pipeline_parallelize
    from tests.family_grid import grid_config
    from tests.helpers import run_threaded

    hybrid = AutoModelForCausalLM.from_config(grid_config("jamba", tie_word_embeddings=False))  # Mamba, then attention
    dense = tiny_model(tiny_config("llama", num_hidden_layers=4))
    # (below the release that serves jamba, every rank refuses it with the release's line instead)
    floor = family_refusal("jamba")
    mamba = (
        re.escape(floor) if floor else r"jamba mixes tokens outside attention \(JambaMambaDecoderLayer at layers\.0\)"
    )
    cases = [
        (hybrid, dict(cp=2), mamba),
        (dense, dict(dp=2), r"ep=2 needs a mixture-of-experts model; llama has no experts"),
    ]
    for model, layout, message in cases:
        models = [copy.deepcopy(model) for _ in range(4)]

        def rank_fn(rank: int, models=models, layout=layout, message=message) -> None:
            mesh = hf_tp.build_mesh(tp=1, pp=2, device_type="cpu", **layout)
            with pytest.raises(ValueError, match=message):
                pipeline_parallelize(models[rank], mesh, microbatches=2, ep=2 if "dp" in layout else 1)

        run_threaded(4, rank_fn)


def test_a_tied_weight_under_a_v_shaped_schedule_is_refused() -> None:
    """zbv / dualpipev run the first and last stage on one rank: a tied lm_head's two copies there
    are not kept in step yet (refused before any stage is built)."""
    import hf_tp
    from hf_tp.pipeline.pipeline_build import pipeline_parallelize
    from tests.helpers import run_threaded

    models = [tiny_model(tiny_config("qwen2", tied=True, num_hidden_layers=4)) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, dp=1, pp=2, device_type="cpu")
        with pytest.raises(ValueError, match=r"--pp-schedule zbv runs the first and the last stage on one rank"):
            pipeline_parallelize(models[rank], mesh, schedule="zbv", microbatches=2, virtual_stages=2)

    run_threaded(2, rank_fn)


def test_a_torch_without_the_fsdp2_internals_pp_drives_is_refused(monkeypatch) -> None:
    """--pp with dp > 1 drives FSDP2's private post-backward by hand (hf_tp.pipeline.pipeline_fsdp):
    a torch whose FSDP2 lacks those names is refused in one line, not an AttributeError mid-step."""
    from types import SimpleNamespace

    from torch import nn

    from hf_tp.pipeline import pipeline_fsdp

    monkeypatch.setattr(pipeline_fsdp, "FSDPModule", nn.Linear)  # any module stands for a root
    monkeypatch.setattr(pipeline_fsdp, "fully_shard", SimpleNamespace(state=lambda root: SimpleNamespace()))
    with pytest.raises(RuntimeError, match=r"drives FSDP2's internals as torch 2\.13 has them.*train with --pp 1"):
        pipeline_fsdp.fsdp_roots([nn.Linear(2, 2)])
    assert pipeline_fsdp.fsdp_roots([nn.ReLU()]) == []  # no dp: nothing to check


@pytest.mark.parametrize(("schedule", "virtual", "fused"), [("zbv", 2, False), ("interleaved1f1b", 2, True)])
def test_a_split_backward_under_fsdp2_reduces_the_tp_partial_gradients_in_fsdp2(schedule, virtual, fused) -> None:
    """pp2 x dp2 x tp2 (a fake world of 8): a V-shaped schedule keeps FSDP2's units gathered through
    the step, where the fused tp-Partial reduction (which adds to the sharded gradients) could put
    nothing, so its stages go without it; other schedules keep it. (Parity at 8 ranks: a script-size
    run, docs/training.md.)"""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = hf_tp.build_mesh(tp=2, dp=2, pp=2, device_type="cpu")
        model = tiny_model(tiny_config("llama", num_hidden_layers=4))
        pipe = pipeline_parallelize(model, mesh, schedule=schedule, microbatches=2, virtual_stages=virtual)
        assert [record_of(m).partial_grads is not None for m in pipe.models] == [fused] * 2
    finally:
        dist.destroy_process_group()
