"""``hf_tp.prepare`` makes every check of parallelize and leaves the model exactly as it was (no
process group needed: sizes alone); ``hf_tp.apply_prepared`` then changes it, once, over a mesh
of the sizes prepare checked."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import hf_tp
from hf_tp import ParallelDims
from hf_tp.core.record import facts_of, record_of
from tests.family_grid import grid_config, grid_model
from tests.helpers import clone, run_threaded, tiny_config, tiny_model
from tests.wrapper_grid import wrapper_config, wrapper_model

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks")


def snapshot(model: torch.nn.Module) -> dict:
    """Everything parallelize could change: each parameter object and flag, each state tensor, each
    module's class, attributes, hooks and recorded facts (packed experts), the record."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (id(p), p.requires_grad) for n, p in model.named_parameters()}
    modules = {
        path: (type(m), sorted(vars(m)), {h: list(getattr(m, h).values()) for h in HOOKS}, copy.deepcopy(facts_of(m)))
        for path, m in model.named_modules()
    }
    return {"state": state, "params": params, "modules": modules, "record": record_of(model)}


def assert_same(before: dict, after: dict) -> None:
    assert after["params"] == before["params"] and after["modules"] == before["modules"]
    assert after["record"] is None and before["record"] is None
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), k


def _lora():
    peft = pytest.importorskip("peft")
    model = tiny_model(tiny_config("llama", num_hidden_layers=1))
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], lora_dropout=0.1)
    return peft.get_peft_model(model, config)


CASES = {  # name: (model, sizes, the plan's origin)
    "llama": (lambda: tiny_model(tiny_config("llama", num_hidden_layers=1)), ParallelDims(tp=2), "hand-written"),
    "lora": (_lora, ParallelDims(tp=2), "hand-written"),
    "llava": (
        lambda: wrapper_model(wrapper_config("llava")),
        ParallelDims(tp=2, dp=2, cp=1),
        "multimodal wrapper: its language model at model.language_model",
    ),
    "qwen2_5_vl": (  # a 3-D mrope wrapper: apply hooks its packed positions
        lambda: wrapper_model(wrapper_config("qwen2_5_vl")),
        ParallelDims(tp=2),
        "multimodal wrapper: its language model at model.language_model",
    ),
    "qwen3_moe": (  # apply marks its packed experts; ep checked against the experts and dp
        lambda: grid_model(grid_config("qwen3_moe", num_experts=4)),
        ParallelDims(tp=2, dp=2, ep=2),
        "derived from the model (generic)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_prepare_leaves_the_model_untouched(case: str) -> None:
    build, dims, origin = CASES[case]
    model = build()
    before = snapshot(model)
    prepared = hf_tp.prepare(model, dims, activation_checkpointing=True)
    assert_same(before, snapshot(model))
    assert prepared.given is model and prepared.mesh is None and prepared.dims == dims and prepared.origin == origin
    assert prepared.options.activation_checkpointing and prepared.opts.sequence_parallel
    assert prepared.peft == (case == "lora") and (prepared.model is model) == (case != "lora")
    if case == "lora":  # the LoRA-aware adapter; no block of a llama runs whole
        assert prepared.lora_whole == () and prepared.adapter.layer_plan(prepared.opts) != hf_tp.get_adapter(
            model.config
        ).layer_plan(prepared.opts)


def test_prepare_refuses_as_parallelize_does_without_a_process_group() -> None:
    model = tiny_model(tiny_config("llama", num_hidden_layers=1))  # 4 heads, 2 KV heads
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"^tp must divide num_attention_heads \(4\) of this llama model, got tp=3"):
        hf_tp.prepare(model, ParallelDims(tp=3))
    with pytest.raises(ValueError, match=r"^ep=2 needs a mixture-of-experts model; llama has no experts$"):
        hf_tp.prepare(model, ParallelDims(tp=2, dp=2, ep=2))
    with pytest.raises(ValueError, match=r"^ep=2 and ParallelDims\(ep=1\) disagree"):
        hf_tp.prepare(model, ParallelDims(tp=2), ep=2)
    with pytest.raises(ValueError, match=r"^compile with activation checkpointing fails under tensor parallelism"):
        hf_tp.prepare(model, ParallelDims(tp=2), compile=True, activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"^train_vision_tower needs a multimodal checkpoint"):
        hf_tp.prepare(model, ParallelDims(tp=1), train_vision_tower=True)
    assert_same(before, snapshot(model))


def test_apply_prepared_once_over_the_sizes_prepare_checked() -> None:
    """At tp2: prepare on the mesh then apply is parallelize (the same logits); the record says the
    plan's origin as plan_for does; a second apply and a mesh of other sizes are refused."""
    ref = tiny_model(tiny_config("llama", num_hidden_layers=1))
    models = [clone(ref) for _ in range(2)]
    others = [clone(ref) for _ in range(2)]
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=ids).logits
    seen: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
        prepared = hf_tp.prepare(models[rank], mesh, loss_parallel=False)
        assert isinstance(prepared.mesh, DeviceMesh) and prepared.dims == ParallelDims(tp=2)
        model = hf_tp.apply_prepared(prepared)
        assert model is models[rank]
        with pytest.raises(ValueError, match=r"already parallelized"):
            hf_tp.apply_prepared(prepared)
        with pytest.raises(ValueError, match=r"^apply_prepared got a mesh of tp=1, dp=2, .* but prepare checked tp=2"):
            hf_tp.apply_prepared(
                hf_tp.prepare(others[rank], ParallelDims(tp=2)), hf_tp.build_mesh(tp=1, dp=2, device_type="cpu")
            )
        seen[rank] = (model(input_ids=ids).logits, record_of(model).adapter)

    run_threaded(2, rank_fn)
    plan = hf_tp.plan_for(ref.config, 2, seq_len=8)
    for logits, origin in seen.values():
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert origin == plan.adapter == "hand-written"
