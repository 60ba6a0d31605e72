"""The one record of what ``parallelize`` did (:mod:`hf_tp.core.record`) and ``hf_tp.describe``."""

from __future__ import annotations

import io

import pytest
import torch

import hf_tp
from hf_tp.core.record import ParallelRecord, record_of
from hf_tp.pipeline.pipeline_build import pipeline_parallelize
from tests.family_grid import grid_config, grid_model
from tests.helpers import clone, run_threaded, tiny_config, tiny_model
from tests.wrapper_grid import wrapper_config, wrapper_model


def hf_tp_attributes(model) -> list[str]:
    """Every ``hf_tp_*`` attribute left on a module of ``model`` (parallelize sets none)."""
    return [f"{path or '<model>'}.{k}" for path, m in model.named_modules() for k in vars(m) if k.startswith("hf_tp_")]


def test_record_of_a_tp2_dp2_model_and_describe() -> None:
    ref = tiny_model(tiny_config("llama", num_hidden_layers=2))
    models = [clone(ref) for _ in range(4)]
    seen: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        model = models[rank]
        assert record_of(model) is None
        hf_tp.parallelize(model, hf_tp.build_mesh(tp=2, dp=2, device_type="cpu"))
        record = record_of(model)
        assert isinstance(record, ParallelRecord) and model.hf_tp is record
        out = io.StringIO()
        text = hf_tp.describe(model, file=out)
        seen[rank] = (record, text, out.getvalue(), hf_tp_attributes(model))

    run_threaded(4, rank_fn)
    record, text, printed, left = seen[0]
    assert {d: m.size() for d, m in record.meshes.items()} == {"tp": 2, "dp": 2}
    assert record.complete and record.model_type == "llama" and record.fsdp and record.layers_path == "model.layers"
    assert record.options.sequence_parallel and record.options.loss_parallel
    assert set(record.layer_plan) >= {"self_attn.q_proj", "mlp.down_proj"}
    assert record.partial_grads is not None and record.cp is None and not record.experts and record.lora is None
    assert left == []
    assert printed == text + "\n"
    lines = text.splitlines()
    assert lines[0] == "hf_tp: llama (hand-written)"
    assert lines[1] == "meshes: tp=2, dp=2 (FSDP2 over dp)"
    assert "decoder layers (model.layers): 1 kind(s)" in lines and "  layers 0-1:" in lines
    assert "    self_attn.q_proj: colwise" in lines
    assert "    mlp.down_proj: rowwise, reduce-scatter to sequence shards" in lines
    assert "partial gradients: one fused all-reduce per backward" in lines
    assert lines[-1] == "methods replaced: generate", lines
    assert len({s[1] for s in seen.values()}) == 1  # every rank describes the same layout


def test_describe_refuses_a_plain_model() -> None:
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is not parallelized by hf_tp .*call hf_tp.parallelize"):
        hf_tp.describe(tiny_model(tiny_config("llama", num_hidden_layers=1)))


def test_record_of_experts_cp_lora_and_a_wrapper() -> None:
    """One world of 4: a MoE at tp2 x ep2 (dp2) on every rank, then on ranks 0-1 a cp2 model, a peft
    LoRA model and a multimodal wrapper at tp2: what each records and how describe says it."""
    peft = pytest.importorskip("peft")
    moe_ref = grid_model(grid_config("qwen3_moe", num_experts=4, vocab_size=300))
    moes = [clone(moe_ref) for _ in range(4)]
    ref = tiny_model(tiny_config("llama", num_hidden_layers=1))
    cps = [clone(ref) for _ in range(2)]
    loras = [
        peft.get_peft_model(clone(ref), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], lora_dropout=0.1))
        for _ in range(2)
    ]
    wrapper = wrapper_model(wrapper_config("llava"))
    wrappers = [clone(wrapper) for _ in range(2)]
    ids = torch.randint(3, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    seen: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        moe = hf_tp.parallelize(moes[rank], hf_tp.build_mesh(tp=2, dp=2, device_type="cpu"), ep=2)
        moe(input_ids=ids, use_cache=False)
        record = record_of(moe)
        assert record.modules(moe)["model.layers.0.mlp.experts"].experts is record.experts["model.layers.0.mlp.experts"]
        seen[rank] = (record, hf_tp.describe(moe, file=io.StringIO()), hf_tp_attributes(moe))

    def pair_fn(rank: int) -> None:
        cp = hf_tp.parallelize(cps[rank], hf_tp.build_mesh(tp=1, cp=2, device_type="cpu"))
        lora = hf_tp.parallelize(loras[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        llava = hf_tp.parallelize(wrappers[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        texts = [hf_tp.describe(m, file=io.StringIO()) for m in (cp, lora, llava)]
        left = hf_tp_attributes(cp) + hf_tp_attributes(lora) + hf_tp_attributes(llava)
        seen[10 + rank] = (record_of(cp), record_of(lora), texts, left)

    run_threaded(4, rank_fn)
    run_threaded(2, pair_fn)
    for rank in range(4):
        record, text, left = seen[rank]
        assert left == [] and set(record.meshes) == {"tp", "dp", "ep"} and record.size("ep") == 2
        assert len(record.experts) == 2  # both layers' experts modules
        shard = record.experts["model.layers.0.mlp.experts"]
        assert (shard.start, shard.local) == (2 * (rank // 2 % 2), 2) and shard.tokens_per_expert is not None
        assert f"experts: 2 modules over ep=2, this rank holds experts {shard.start}-{shard.start + 1} of each" in text
        assert "methods replaced: loss_function, generate, model.layers.*.mlp.experts.forward" in text
    cp, lora, (cp_text, lora_text, llava_text), left = seen[10]
    assert left == [] and cp.cp is not None and cp.size("cp") == 2 and lora.cp is None
    assert "meshes: tp=1, dp=1, cp=2 (FSDP2 over dp x cp)" in cp_text.splitlines()
    assert "context parallel: cp=2, the model's kernel 'sdpa' per rank" in cp_text.splitlines()
    assert lora.lora is not None and lora.lora.dropouts == 2 and lora.lora.whole_run == ()
    assert "LoRA: peft model, 2 dropouts tp-aware, 0 layers in blocks run whole" in lora_text.splitlines()
    lines = llava_text.splitlines()
    assert lines[0] == "hf_tp: llava (multimodal wrapper: its language model at model.language_model)"
    assert "decoder layers (model.language_model.layers): 1 kind(s)" in lines
    assert (
        "run whole on every tp rank (a wrapper's passengers): model.vision_tower, model.multi_modal_projector" in lines
    )


def test_record_of_pipeline_stages_and_replaced_classes() -> None:
    """pp2 x tp2 of a 4-layer llama with one KV head: each rank's stage is in its record (which
    layers, first/last, the gaps TP left out of the plan), generate refuses a stage, and the KV
    projections' class swap is listed with the methods replaced."""
    ref = tiny_model(tiny_config("llama", num_hidden_layers=4, kv_heads=1))
    models = [clone(ref) for _ in range(4)]
    seen: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        pipe = pipeline_parallelize(models[rank], hf_tp.build_mesh(tp=2, pp=2, device_type="cpu"), microbatches=2)
        (stage,) = pipe.stages
        record = record_of(stage.model)
        with pytest.raises(ValueError, match=r"generate on a pipeline stage: one stage holds only some layers"):
            stage.model.generate(torch.ones(1, 4, dtype=torch.long))
        text = hf_tp.describe(stage.model, file=io.StringIO())
        seen[rank] = (record, (stage.first, stage.last), text, hf_tp_attributes(stage.model))

    run_threaded(4, rank_fn)
    for rank in range(4):
        record, (first, last), text, left = seen[rank]
        stage, lines = record.stage, text.splitlines()
        assert left == [] and stage is not None and (first, last) == (stage.first, stage.last), left
        if rank < 2:  # the pp dim is outermost: ranks 0-1 hold the first stage
            assert (stage.layers, stage.of, first, last) == (range(0, 2), 4, True, False)
            assert stage.gaps == ("model.layers.2", "model.layers.3", "model.norm", "lm_head")
            assert set(record.top_plan) >= {"model.norm", "lm_head"}  # the adapter's plan, as for any model
            want = "pipeline stage: decoder layers 0-1 of 4 (first: yes, last: no); gaps for the other stages' "
            assert want + "model.norm, lm_head" in lines, lines
        else:
            assert (stage.layers, first, last) == (range(2, 4), False, True)
            assert stage.gaps == ("model.layers.0", "model.layers.1", "model.embed_tokens")
            want = "pipeline stage: decoder layers 2-3 of 4 (first: no, last: yes); gaps for the other stages' "
            assert want + "model.embed_tokens" in lines, lines
        layers = [str(i) for i in stage.layers]
        assert record.classes == tuple(
            f"model.layers.{i}.self_attn.{p}: Linear -> KVHeadLinear" for i in layers for p in ("k_proj", "v_proj")
        )
        assert (
            "classes replaced: model.layers.*.self_attn.k_proj: Linear -> KVHeadLinear, "
            "model.layers.*.self_attn.v_proj: Linear -> KVHeadLinear" in lines
        ), lines


def test_a_function_runs_as_the_forward_for_one_call() -> None:
    """The fused loss's way of running the decoder: the module's hooks run around the function, and
    the module is left as it was (an instance forward it had is put back)."""
    from hf_tp.parallel.as_forward import call_as_forward

    module, seen = torch.nn.Linear(2, 2), []
    module.register_forward_pre_hook(lambda mod, args: seen.append(args[0].sum().item()))
    assert call_as_forward(module, lambda x, scale: x * scale, torch.ones(3), scale=2.0).tolist() == [2.0] * 3
    assert seen == [3.0] and "forward" not in vars(module)

    def own(x: torch.Tensor) -> torch.Tensor:
        return x

    module.forward = own
    with pytest.raises(RuntimeError, match="inside"):
        call_as_forward(module, lambda x: (_ for _ in ()).throw(RuntimeError("inside")), torch.ones(1))
    assert module.forward is own and seen == [3.0, 1.0]
