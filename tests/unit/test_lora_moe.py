"""peft's all-linear LoRA on MoE models (routers and fused 3-D experts through peft's
``target_parameters``) under hf_tp against the same peft model in one process: expert tp
(packed gate/up halves), expert parallelism with FSDP2 over dp, the router's aux-loss gradient."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

import hf_tp  # noqa: E402
from tests.family_grid import grid_config, grid_model  # noqa: E402
from tests.helpers import run_threaded  # noqa: E402
from tests.lora_grid import lora, run_lora  # noqa: E402

# per layer: 4 attention projections, the router, gate_up_proj and down_proj, each (A, B); 2 layers
ALL = 2 * 7 * 2


def _moe_lora(model_type: str, **overrides) -> torch.nn.Module:
    """peft's all-linear LoRA on the family's grid model; skipped where the installed transformers
    and peft wrap no parameter (experts not fused, or a peft without target_parameters)."""
    model = lora(grid_model(grid_config(model_type, vocab_size=300, **overrides)))
    if not any(type(m).__name__ == "ParamWrapper" for m in model.modules()):
        pytest.skip(f"peft's all-linear wraps no fused experts of {model_type} with the installed releases")
    return model


def test_all_linear_moe_lora_holds_parity_at_tp2() -> None:
    # Qwen3-MoE with the router aux loss in HF's loss (the router's LoRA gradient through it counted
    # once over tp), Mixtral; expert factors sliced like their experts (gate/up halves each).
    assert run_lora(_moe_lora("qwen3_moe", output_router_logits=True), tp=2, b=4, steps=2)["lora"] == ALL
    assert run_lora(_moe_lora("mixtral"), tp=2, b=4, steps=2)["lora"] == ALL


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_all_linear_moe_lora_holds_parity_under_expert_parallelism(model_type: str) -> None:
    # tp1 x dp2 x ep2: each rank adds the update of its own experts; factors FSDP2-sharded over dp.
    assert run_lora(_moe_lora(model_type), tp=1, dp=2, ep=2, b=4, steps=2)["lora"] == ALL


def test_target_parameters_outside_moe_regions_are_refused_at_tp2() -> None:
    config = LoraConfig(r=4, target_modules=[], target_parameters=["self_attn.q_proj.weight"])
    model = get_peft_model(grid_model(grid_config("qwen3_moe", vocab_size=300)), config)
    copies = [copy.deepcopy(model) for _ in range(2)]
    errors: dict[int, str] = {}

    def rank_fn(rank: int) -> None:
        with pytest.raises(ValueError, match=r"LoRA on model.layers.0.self_attn.q_proj: peft's target_parameters") as e:
            hf_tp.parallelize(copies[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        errors[rank] = str(e.value)

    run_threaded(2, rank_fn)
    assert "only on the parameters of a MoE region" in errors[0]


def test_adapter_and_merged_export_of_moe_lora_match_peft(tmp_path) -> None:
    # What hf-tp export writes from a run's LoRA tensors (keyed as the HF model inside peft names
    # them): the adapter folder PeftModel loads, and the merged weights, against peft's merge.
    from peft import PeftModel
    from safetensors.torch import save_file

    from hf_tp.checkpoint.lora_export import lora_config, param_wrappers, peft_key, wrapped_update
    from hf_tp.core.model_source import model_from_config

    config = grid_config("qwen3_moe", vocab_size=300)
    base = grid_model(config)
    peft_model = _moe_lora("qwen3_moe")  # r=4, alpha=8, all-linear: the same weights as base (grid_model's seed)
    run = {"lora_r": 4, "lora_alpha": 8, "model": "base"}
    tensors = {k: v for k, v in peft_model.base_model.model.state_dict().items() if ".lora_" in k}
    save_file({peft_key(k): v.contiguous() for k, v in tensors.items()}, str(tmp_path / "adapter_model.safetensors"))
    lora_config(run).save_pretrained(str(tmp_path))
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    data = torch.arange(3, 15)[None]
    torch.testing.assert_close(loaded(data).logits, peft_model(data).logits, rtol=0, atol=0)

    with torch.device("meta"):  # as hf-tp export builds the model it writes
        meta = model_from_config(config, dtype=torch.float32)
    wrapped = param_wrappers(meta, run)
    assert len(wrapped) == 2 * 3  # per layer: the router, gate_up_proj, down_proj
    want = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for key, (path, wrapper) in wrapped.items():
        got = base.state_dict()[key] + wrapped_update(path, wrapper, tensors).to(base.dtype)
        torch.testing.assert_close(got, want[key], rtol=1e-6, atol=1e-7)
