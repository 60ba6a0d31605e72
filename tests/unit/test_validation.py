"""Bad inputs to the registry and to parallelize fail early with a clear ValueError."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

import hf_tp
from hf_tp.adapters import Adapter, get_adapter, register_adapter, unregister_adapter
from hf_tp.adapters.families import llama_layer_plan, llama_top_plan
from tests.helpers import run_threaded, tiny_config, tiny_model


def test_builtin_adapters_are_registered() -> None:
    assert {"llama", "qwen2", "mistral"} <= set(hf_tp.supported_model_types())


def test_unknown_model_type_names_supported_and_how_to_register() -> None:
    # a name hf_tp does not know: the supported ones and how to register another
    with pytest.raises(ValueError, match=r"adapter for model_type 'no_such_model' .*supported: .*llama"):
        get_adapter("no_such_model")
    # a config whose plan cannot be read from the model (issue 55): what is missing, and how to register
    with pytest.raises(ValueError, match=r"model_type 'gpt2': attn.c_attn is a Conv1D .*register_adapter"):
        get_adapter(GPT2Config())


def test_register_twice_is_an_error_and_custom_adapter_works() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_adapter(Adapter(model_type="qwen2", layer_plan=llama_layer_plan, top_plan=llama_top_plan))
    custom = Adapter(model_type="my_llama", layer_plan=llama_layer_plan, top_plan=llama_top_plan)
    register_adapter(custom)
    try:
        assert get_adapter("my_llama") is custom
    finally:
        unregister_adapter("my_llama")


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "tp", "message"),
    [
        (
            14,
            2,
            4864,
            4,
            r"tp must divide num_attention_heads \(14\) of this qwen2 model, got tp=4; valid tp values for it are: 1, 2$",
        ),
        (
            12,
            4,
            96,
            6,
            r"tp must divide num_key_value_heads \(4\) \(or be a multiple of it\) .* got tp=6; "
            r"valid tp values for it are: 1, 2, 4, 12$",
        ),
        (8, 8, 100, 8, r"tp must divide intermediate_size \(100\) .* got tp=8; valid tp values for it are: 1, 2, 4$"),
        (8, 8, 128, 0, r"tp must be a positive integer, got tp=0"),
    ],
)
def test_divisibility_errors_name_the_numbers(heads, kv, inter, tp, message) -> None:
    config = tiny_config("qwen2", heads=heads, kv_heads=kv, intermediate_size=inter, hidden_size=heads * 8)
    with pytest.raises(ValueError, match=message):
        get_adapter(config).validate(config, tp)


def test_fewer_kv_heads_than_ranks_is_valid() -> None:
    config = tiny_config("qwen2", heads=16, kv_heads=2, intermediate_size=128, hidden_size=128)
    adapter = get_adapter(config)
    assert adapter.valid_tp_sizes(config) == [1, 2, 4, 8, 16]
    adapter.validate(config, 8)
    assert [adapter.kv_replicas(config, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]


def test_build_mesh_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="needs an initialised process group"):
        hf_tp.build_mesh(tp=2)


def test_mesh_and_model_errors_on_every_rank() -> None:
    config = tiny_config("qwen2", heads=14, kv_heads=2, hidden_size=112)
    bad_heads = [tiny_model(config) for _ in range(4)]
    base_models = [tiny_model(tiny_config("llama")).model for _ in range(2)]
    twice = [tiny_model(tiny_config("llama")) for _ in range(2)]
    seen: dict[int, list[str]] = {r: [] for r in range(4)}

    def expect(rank: int, fn, pattern: str) -> None:
        with pytest.raises(ValueError, match=pattern) as info:
            fn()
        seen[rank].append(str(info.value))

    def rank_fn(rank: int) -> None:
        expect(rank, lambda: hf_tp.build_mesh(tp=2, dp=3), r"world size \(4\) must equal tp\*dp \(2\*3=6\)")
        mesh = hf_tp.build_mesh(tp=4, device_type="cpu")
        expect(rank, lambda: hf_tp.parallelize(bad_heads[rank], mesh), r"num_attention_heads \(14\)")
        named = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        expect(rank, lambda: hf_tp.parallelize(bad_heads[rank], named), r"dims named \('dp', 'tp'\)")

    run_threaded(4, rank_fn)
    assert all(len(v) == 3 for v in seen.values()) and len({tuple(v) for v in seen.values()}) == 1

    def rank_fn2(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
        expect(rank, lambda: hf_tp.parallelize(base_models[rank], mesh), r"expects a \*ForCausalLM model")
        hf_tp.parallelize(twice[rank], mesh)
        expect(rank, lambda: hf_tp.parallelize(twice[rank], mesh), "already parallelized")

    run_threaded(2, rank_fn2)


_QLORA = (
    r"qwen2 model is quantized with bitsandbytes \(4-bit, QLoRA\): .* do not compose with DTensor sharding today; "
    r"train LoRA on the bf16 base under tp .*or QLoRA with peft \+ bitsandbytes on one GPU"
)


@pytest.mark.parametrize(
    ("model_type", "quantization", "message"),
    [
        ("gpt_oss", {"quant_method": "mxfp4"}, r"quant_method 'mxfp4'.*Mxfp4Config\(dequantize=True\)"),
        ("qwen2", {"quant_method": "fp8", "weight_block_size": [128, 128]}, r"FineGrainedFP8Config\(dequantize=True\)"),
        ("qwen2", {"quant_method": "bitsandbytes", "load_in_4bit": True}, _QLORA),
        ("qwen2", {"quant_method": "bitsandbytes", "load_in_8bit": True}, _QLORA.replace("4", "8")),
    ],
)
def test_quantized_checkpoints_are_refused_with_the_fix(model_type: str, quantization: dict, message: str) -> None:
    # A quantized checkpoint's files hold codes and scales, not weights: refused before loading
    # (hf-tp train's launcher and every rank) and in parallelize, never trained as raw codes.
    from transformers import AutoConfig

    from hf_tp.run.validate import validate_model_config

    config = AutoConfig.for_model(model_type, quantization_config=quantization)
    with pytest.raises(ValueError, match=message):
        validate_model_config(config, tp=1, seq_len=16)

    def rank_fn(rank: int) -> None:
        model = tiny_model(tiny_config("qwen2"))
        model.config.quantization_config = quantization
        with pytest.raises(ValueError, match=message):  # a peft LoRA model over it too (QLoRA)
            hf_tp.parallelize(lora(model) if rank else model, hf_tp.build_mesh(tp=2, device_type="cpu"))

    if quantization["quant_method"] == "bitsandbytes":  # (parallelize's check is the same for all)
        from tests.lora_grid import lora

        run_threaded(2, rank_fn)


def test_old_style_load_in_4bit_flag_is_refused_before_loading() -> None:
    from transformers import AutoConfig

    from hf_tp.run.validate import validate_model_config

    with pytest.raises(ValueError, match=_QLORA):
        validate_model_config(AutoConfig.for_model("qwen2", load_in_4bit=True), tp=1, seq_len=16)
