"""peft LoRA under hf_tp: parity with single-process peft at tp=2 (hand-written families), under
FSDP2 (tp2 x dp2), and clear refusals for what hf_tp does not shard."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402

import hf_tp  # noqa: E402
from tests.family_grid import grid_config, grid_model, needs_later_release  # noqa: E402
from tests.helpers import FAMILIES, parity_dtype, run_threaded, tiny_config, tiny_model  # noqa: E402
from tests.lora_grid import attention_targets, lora, plan_targets, run_lora  # noqa: E402


def _tiny(family: str = "llama", **kw) -> torch.nn.Module:
    return tiny_model(tiny_config(family, **kw), dtype=parity_dtype(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_all_linear_holds_parity_at_tp2(family: str) -> None:
    # all-linear: q/k/v/o and gate/up/down (peft leaves lm_head out); one AdamW step.
    counts = run_lora(lora(_tiny(family)))
    assert counts["lora"] == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)


def test_lora_under_fsdp2_tp2_dp2_with_micro_batches() -> None:
    # Frozen base and trainable LoRA factors in one FSDP2 unit per layer; 2 steps, 2 micro-batches.
    counts = run_lora(lora(_tiny("qwen2", tied=True)), tp=2, dp=2, b=4, steps=2, micro=2)
    assert counts["lora"] == 28


@pytest.mark.parametrize("sp", [True, False])
def test_lora_on_replicated_kv_heads_holds_parity(sp: bool) -> None:
    # 1 KV head at tp=2: k_proj/v_proj whole on both ranks, each computing its KV head's rows; their
    # LoRA factors too (lora_B on the head's rows), with and without sequence parallelism.
    assert run_lora(lora(_tiny(kv_heads=1)), sp=sp)["lora"] == 28


def test_base_weights_get_no_gradient_and_no_optimizer_state() -> None:
    peft_model = lora(_tiny())
    copies = [copy.deepcopy(peft_model) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        m = hf_tp.parallelize(copies[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        data = {"input_ids": torch.arange(3, 15)[None], "labels": torch.arange(3, 15)[None]}
        with hf_tp.loss_parallel():
            m(**data, use_cache=False).loss.backward()
        opt.step()
        trainable = {n for n, p in m.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_" in n for n in trainable), sorted(trainable)[:3]
        assert all(p.grad is None for p in m.parameters() if not p.requires_grad)
        assert len(opt.state) == len(trainable)

    run_threaded(2, rank_fn)


def _refusal(model: torch.nn.Module, tp: int = 2) -> str:
    errors: dict[int, str] = {}

    def rank_fn(rank: int) -> None:
        try:
            hf_tp.parallelize(copies[rank], hf_tp.build_mesh(tp=tp, device_type="cpu"))
        except ValueError as exc:
            errors[rank] = str(exc)

    copies = [copy.deepcopy(model) for _ in range(tp)]
    run_threaded(tp, rank_fn)
    assert len(errors) == tp and len(set(errors.values())) == 1, errors  # the same error on every rank
    return errors[0]


@pytest.mark.parametrize(
    ("targets", "kw", "match"),
    [
        (["lm_head"], {}, r"LoRA on lm_head: .*outside the decoder layers' tp plan.*target_modules"),
        (["embed_tokens"], {}, r"LoRA on model.embed_tokens: a peft Embedding over .*nn.Linear projections only"),
        (["q_proj"], {"use_dora": True}, r"LoRA on model.layers.0.self_attn.q_proj: LoRA variants"),
    ],
)
def test_unsupported_lora_targets_are_refused_naming_the_module(targets, kw, match) -> None:
    model = _tiny()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets, **kw))
    with pytest.raises(ValueError, match=match):
        raise ValueError(_refusal(peft_model))


def test_other_peft_tuners_are_refused() -> None:
    from peft import IA3Config

    peft_model = get_peft_model(
        _tiny(), IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    with pytest.raises(ValueError, match=r"LoRA adapters only, got a IA3Model"):
        raise ValueError(_refusal(peft_model))


# Generic-plan families with distinct structures: packed qkv (CodeGen, GPT-NeoX), gathered
# projections (Phi-3, GLM), a parallel block (Cohere), q/k/v clamped in place (OLMo), biases
# (StarCoder2), linear attention (Qwen3.5), Mamba hybrids (Falcon-H1), gated heads (LFM3).
# `python -m tests.lora_grid` runs every supported dense family.
GRID_SAMPLE = (
    "codegen",
    "gpt_neox",
    "phi3",
    "glm",
    "cohere",
    "olmo",
    "starcoder2",
    "qwen3_5_text",
    "falcon_h1",
    "lfm3",
)


@pytest.mark.parametrize("model_type", [m for m in GRID_SAMPLE if m in CONFIG_MAPPING])
def test_lora_grid_sample_holds_parity_at_tp2(model_type: str) -> None:
    if needs_later_release(model_type):  # (CodeGen before transformers 5.24: refused naming the release)
        return
    model = grid_model(grid_config(model_type))
    assert run_lora(lora(model, plan_targets(model, 2)))["lora"] > 0


def test_moe_attention_lora_holds_parity_under_fsdp2() -> None:
    # Qwen3-MoE at tp2 x dp2 (FSDP2): LoRA on the attention projections next to frozen MoE regions
    # (peft's all-linear, experts and routers included: tests/unit/test_lora_moe.py).
    model = grid_model(grid_config("qwen3_moe", vocab_size=300))
    assert run_lora(lora(copy.deepcopy(model), plan_targets(model, 2)), tp=2, dp=2, b=4)["lora"] == 16


def test_lora_generic_plan_at_tp4_with_replicated_kv_heads() -> None:
    # Granite (generic plan): 8 heads, 2 KV heads at tp=4, all-linear LoRA.
    model = grid_model(grid_config("granite", heads=8, kv=2))
    assert run_lora(lora(model), tp=4)["lora"] == 28


def test_lora_with_expert_parallelism_holds_parity() -> None:
    # Frozen experts placed over ep (tokens by all-to-all), LoRA on the projections around them:
    # Qwen3-MoE attention at tp2 x dp2 x ep2 (experts also split over tp), DeepSeek-V3's MLA
    # attention at tp1 x dp2 x ep2. `python -m tests.lora_grid --moe` runs the whole MoE set.
    model = grid_model(grid_config("qwen3_moe", vocab_size=300))
    assert run_lora(lora(model, plan_targets(model, 2)), tp=2, dp=2, ep=2, b=4)["lora"] == 16
    model = grid_model(grid_config("deepseek_v3"))
    assert run_lora(lora(model, attention_targets(model)), tp=1, dp=2, ep=2, b=4)["lora"] == 20


def test_lora_in_whole_run_regions_holds_parity_at_tp2() -> None:
    # Regions computed whole on every tp rank (DeepSeek-V3's MLA attention, Falcon-H1's Mamba mixer):
    # their LoRA factors are whole too, gradients Partial over tp, dropout masks shared over tp.
    model = grid_model(grid_config("deepseek_v3", vocab_size=300))
    assert run_lora(lora(model, attention_targets(model)), tp=2)["lora"] == 20
    model = grid_model(grid_config("falcon_h1"))
    targets = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert run_lora(lora(model, targets), tp=2)["lora"] == 32  # (peft refuses LoRA on Mamba's out_proj)
