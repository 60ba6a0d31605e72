"""The family grid: every dense causal-LM family of the installed transformers, a tiny random model
of each built from its own config class, trained with hf_tp at tp=2 (and tp=4 for a subset) on
threads of one process and compared with plain single-process HF.

Used by tests/unit/test_family_grid.py and by scripts/family_grid.py (which writes
docs/architectures.md from the same runs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import hf_tp
from hf_tp.adapters.census import is_mixture
from hf_tp.adapters.shrink import shrink_config
from hf_tp.compat import UnsupportedRelease, family_refusal
from hf_tp.core.module_queries import num_experts
from hf_tp.verify.compare import stream_mixer_params
from hf_tp.verify.random_model import draw_index_tables
from tests.helpers import batch, clone, float64_everywhere, has_fp32_islands, run_threaded
from tests.parity import KEY_BIASES, assert_parity, train_steps

# Sizes of the grid's tiny models; heads/kv are per case. Dropout off: dropout draws differ
# between a sharded and an unsharded run, so no parity could hold with it.
GRID_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    head_dim=16,
    vocab_size=301,  # not divisible by 2 or 4: uneven vocab shards
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # see tests/helpers.tiny_config: resolves every gradient
    attention_dropout=0.0,
    hidden_dropout=0.0,
    residual_dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
)
# What a family needs beyond GRID_SIZES to build at these sizes.
FAMILY_EXTRAS: dict[str, dict] = {
    # One layer of each kind (transformers' generate needs an attention layer for the cache length).
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # Its default config has no rope parameters for its layer type.
    "cohere_compass_text": dict(
        layer_types=["full_attention"] * 2,
        # Its rotary splits head_dim / 2 frequencies by mrope_section, whose default fits head_dim 128;
        # the grid's 16 has 8 (transformers 5.17 cannot build the model with the default).
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}},
    ),
    # Families transformers gives no tp plan (hf_tp reads theirs from the model): dropout off under
    # their own field names; GPT-Neo keeps its global and local layers, its window inside the grid's rows.
    "opt": dict(dropout=0.0, ffn_dim=128),
    "xglm": dict(dropout=0.0, attention_dropout=0.0, ffn_dim=128),
    "biogpt": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
}


def _mrope(t: int, h: int, w: int, **extra) -> dict:
    """Rotary parameters whose mrope sections (temporal, height, width) fit the grid's head_dim."""
    return {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [t, h, w], **extra}


# Mixture-of-experts sizes (set where the config class has the field): 4 experts, 2 per token,
# an aux-loss weight large enough that a wrong router gradient from it shows; no router noise.
MOE_SIZES = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,  # Hunyuan's and Aria's name for it
    moe_num_experts=4,  # Ernie 4.5's and Aria's names
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    router_aux_loss_coef=0.5,
    router_jitter_noise=0.0,
    input_jitter_noise=0.0,
    n_group=1,
    topk_group=1,
    num_experts_per_token=2,  # Kimi-Linear's and Bailing-Hybrid's names
    num_expert_group=1,
)
# Latent-attention (DeepSeek-style) sizes: its head_dim must equal the rotary part.
MLA_SIZES = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48)
HYBRID = dict(layer_types=["linear_attention", "full_attention"])
LINEAR = dict(linear_num_heads=4, linear_head_dim=16)
FAMILY_EXTRAS.update(
    {
        "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
        "qwen3_next": HYBRID,
        "qwen3_5_moe_text": HYBRID,
        "bailing_hybrid": dict(**HYBRID, **LINEAR, mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1),
        # Mamba sizes scaled to the grid (its defaults, 128 heads and state 256, took ~10 s a run)
        "granitemoehybrid": dict(
            layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16
        ),
        # A short-convolution layer and an attention layer (their defaults start with two convolutions)
        "lfm2": dict(layer_types=["conv", "full_attention"]),
        "lfm3": dict(layer_types=["conv", "full_attention"]),
        "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16),
        "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_d_ssm=128),
        # One layer of each mixer kind (Mamba, MoE, attention, MLP: its default), Mamba and shared expert scaled
        "nemotron_h": dict(
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            chunk_size=16,
            moe_shared_expert_intermediate_size=48,
        ),
        "flint": dict(mlp_only_layers=[0]),  # a dense layer and a MoE layer
        # (5.25) a dense sliding-window layer and an indexed MoE one; its indexer's heads within a KV head's queries
        "kolibri1_1": dict(
            layer_types=["sliding_attention", "indexed_attention"],
            index_num_heads=2,
            index_topk=8,
            index_pool_size=32,
            index_compression=2,
            index_num_local_tokens=4,
            index_num_sink_tokens=1,
            mlp_only_layers=[0],  # its default makes layers 0 and 1 dense: no MoE layer in two
            mlp_only_intermediate_size=128,
        ),
        "beam": dict(mlp_layer_types=["dense", "sparse"]),  # its default for 2 layers has no MoE layer
        # A dense layer (its MLP is intermediate_size_mlp wide, 16384 by default), then a MoE layer
        "llama4_text": dict(interleave_moe_layer_step=2, intermediate_size_mlp=128),
        # Its latent attention's head_dim is the nope + rope parts (the rotary covers the rope part only)
        "mistral4": dict(head_dim=32),
        # A linear-attention layer and an attention one (its 2-layer default has no attention layer)
        # and its attention's QSA indexer, which has no defaults (2 blocks of 2 tokens per query)
        "qwen4_exp_text": dict(
            layer_types=["linear_attention", "full_attention"],  # (5.24 reads full_attention as indexed)
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=4,
            indexer_compress_ratio=2,
        ),
        # Per-layer embeddings at grid sizes (262144 x 8 x 256 by default) and narrower global heads
        # Its default config sets no shared-expert count (the published one does), which the block multiplies by
        "dots1": dict(n_shared_experts=1),
        # A dense short-convolution layer, then a MoE attention layer (its defaults: no layer_types, 2 dense layers)
        "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
        # A dense layer, then a MoE layer (every layer is MoE by default); its own names for the MLP widths
        "minimax_m3_vl_text": dict(
            mlp_layer_types=["dense", "sparse"], dense_intermediate_size=128, shared_intermediate_size=48
        ),
        # Its sliding-window attention's own head counts and relative-position extent, at grid sizes
        "inkling_text": dict(
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, rel_extent=32
        ),
        "gemma4_text": dict(
            vocab_size_per_layer_input=301, hidden_size_per_layer_input=16, global_head_dim=32, sliding_window=8
        ),
        # Text towers with 3-D mrope: the (t, h, w) sections of the grid's 8 rotary frequencies
        **{
            mt: dict(rope_parameters=_mrope(3, 3, 2))
            for mt in ("qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text", "qwen3_vl_text", "qwen3_vl_moe_text")
        },
        "glm4v_moe_text": dict(rope_parameters=_mrope(2, 1, 1, partial_rotary_factor=0.5)),
    }
)
# The prefill and two cached decode steps: the second is the first whose position is not the
# prompt's length (a cache offset taken from the prompt alone passes one step, not two).
GREEDY_TOKENS = 3


# Families whose tiny model is their default config shrunk whole (hf_tp.adapters.shrink.shrink_config): every
# layer kind, attention form and width ratio of the published shape kept (tests/unit/test_shrink.py).
SHRUNK = ("deepseek_v4", "hy_v4", "kimi_linear")
# What the grid sets on a shrunk default: its uneven vocabulary and token ids, short positions.
SHRUNK_GRID = dict(vocab_size=301, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
GRID_SEQ = 13  # the grid's rows (tests.helpers.batch)


def grid_config(model_type: str, heads: int | None = None, kv: int | None = None, **overrides) -> PretrainedConfig:
    """The grid's tiny config of ``model_type`` (``heads`` / ``kv``: attention and KV head counts,
    4 and 2 unless a shrunk default's own)."""
    if model_type in SHRUNK:
        default = AutoConfig.for_model(model_type)
        counts = {k: v for k, v in (("num_attention_heads", heads), ("num_key_value_heads", kv)) if v}
        aux = (
            {"router_aux_loss_coef": MOE_SIZES["router_aux_loss_coef"]}
            if "router_aux_loss_coef" in default.to_dict()
            else {}
        )
        return shrink_config(default, tp=2, seq_len=GRID_SEQ, **{**SHRUNK_GRID, **aux, **counts, **overrides})
    heads, kv = heads or 4, kv or 2
    sizes = {**GRID_SIZES, "num_attention_heads": heads, "num_key_value_heads": kv}
    fields = AutoConfig.for_model(model_type).to_dict()
    if is_moe(AutoConfig.for_model(model_type)):
        sizes.update({k: v for k, v in MOE_SIZES.items() if k in fields})
        if "first_k_dense_replace" in fields:
            sizes["first_k_dense_replace"] = 1  # a dense layer, then a MoE layer
    if (fields.get("rotary_dim") or 0) > GRID_SIZES["head_dim"]:  # GPT-J, CodeGen: 64 rotary dims by default
        sizes["rotary_dim"] = GRID_SIZES["head_dim"] // 2
    if "kv_lora_rank" in fields:
        sizes.update({k: v for k, v in MLA_SIZES.items() if k in fields}, num_key_value_heads=heads)
    return AutoConfig.for_model(model_type, **{**sizes, **FAMILY_EXTRAS.get(model_type, {}), **overrides})


def grid_model(config: PretrainedConfig) -> torch.nn.Module:
    """float64 (fp32's round-off would sit above the element-wise tolerance for some families'
    gradients; in float64 the same tolerances are far stricter), random 1-D parameters."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    # torch's grouped_mm (transformers' default experts kernel) has no float64 path on CPU. Asked
    # of the config's expert count, not the plan: before 5.21 some MoE families' plans name no experts.
    extra = {"experts_implementation": "eager"} if is_moe(config) or num_experts(config) else {}
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64, **extra)
    except ValueError:  # transformers has no sdpa path for it (Gemma 2, VaultGemma, Granite SWA, ...)
        # ... and raised with torch's default dtype still set to float64: restore it, or every later
        # test in this process would build float64 tensors.
        torch.set_default_dtype(default)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64, **extra)
    assert torch.get_default_dtype() == default
    with torch.no_grad():
        draw_index_tables(model, config)  # DeepSeek-V4's hash routing table, zeros until a checkpoint loads it
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("_bias"):  # experts' biases [experts, features] (GPT-OSS), zero at init
                p.normal_(0.0, 0.1)
            elif name.endswith("gate.weight") and not p.any():
                # a router left at zeros (Ernie 4.5's: transformers draws it in _init_weights from 5.23 on):
                # every expert ties, half of its gradient is round-off
                p.normal_(0.0, config.initializer_range)
    return model


# Parameters no gradient reaches in plain HF by construction (kept out of neither side's check: the
# gradient check compares the two runs' sets of names): a top-k indexer's (DeepSeek-V4's, HY-V4's) only
# score tokens to pick which ones attention reads, and the pick (an index) carries no gradient.
NO_GRADIENT = (".indexer.",)


def assert_every_gradient(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Every trainable parameter of the reference ``model`` has a gradient in ``grads``, but those
    ``NO_GRADIENT`` names as having none by construction."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in grads]
    missing = sorted(n for n in missing if not any(s in n for s in NO_GRADIENT))
    assert not missing, f"no gradient in plain HF (the check would not see them): {missing}"


def exact_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, computing wholly in float64 where it computes parts in fp32 by construction
    (:func:`tests.helpers.float64_everywhere`)."""
    return float64_everywhere(model) if has_fp32_islands(model) else model


def is_moe(config: PretrainedConfig) -> bool:
    return is_mixture(config)


def needs_later_release(model_type: str) -> bool:
    """True if the installed transformers is older than ``model_type`` needs
    (``hf_tp.compat.FAMILY_RELEASES``), after checking that hf_tp refuses it with the one line
    naming that release, before any model is built."""
    refusal = family_refusal(model_type)
    if refusal is None:
        return False
    try:
        hf_tp.get_adapter(grid_config(model_type))
    except UnsupportedRelease as exc:
        assert str(exc) == refusal, exc
        return True
    raise AssertionError(f"{model_type} was not refused: {refusal}")


@dataclass
class GridResult:
    model_type: str
    status: str  # "parity" or "refused"
    reason: str = ""
    grad_error: float = 0.0  # the largest gradient error (:func:`gradient_error`) and its parameter
    grad_where: str = ""


def gradient_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest max |g - w| over the parameters, each relative to its own largest gradient, but a
    gradient zero in exact arithmetic (a key bias's: ``KEY_BIASES``), held against the model's
    largest gradient; and the parameter it is in."""
    largest = max(w.abs().max().item() for w in want.values())
    errors = {
        name: (got[name].double() - w.double()).abs().max().item()
        / (largest if name.endswith(KEY_BIASES) else max(w.abs().max().item(), 1e-300))
        for name, w in want.items()
    }
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def _prompt(vocab: int) -> dict[str, torch.Tensor]:
    """Two left-padded prompts (the second has 2 pad tokens)."""
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


# Families whose code builds a tensor in torch's default dtype and mixes it with the model's (XGLM's
# eager attention floor, torch.full((), torch.finfo(weights.dtype).min), overflows float32): the
# grid's float64 model runs with float64 as the default dtype (plain HF fails otherwise).
DEFAULT_DTYPE_OF_MODEL = ("xglm",)


def run_family(
    model_type: str,
    tp: int = 2,
    heads: int | None = None,
    kv: int | None = None,
    steps: int = 1,
    aux: bool | None = None,
    **overrides,
) -> GridResult:
    """Parity of ``model_type`` at ``tp`` against plain HF (logits, loss and every gradient, the
    weights after ``steps`` AdamW steps, and ``model.generate`` greedy tokens), or the
    ``ValueError`` with which hf_tp refuses it. Any other exception propagates (a defect).
    ``aux``: the router's aux loss in the trained loss (default: on for a MoE family). A model that
    computes parts in fp32 by construction runs them in float64 (:func:`tests.helpers.float64_everywhere`).

    The refusal is asked of ``hf_tp.get_adapter`` and ``Adapter.validate``, the checks
    ``hf_tp.parallelize`` runs first, before any reference model is built (some refused families
    build GBs of encoders at their default sizes)."""
    if model_type in DEFAULT_DTYPE_OF_MODEL and torch.get_default_dtype() != torch.float64:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return run_family(model_type, tp, heads, kv, steps, aux, **overrides)
        finally:
            torch.set_default_dtype(previous)
    config = grid_config(model_type, heads, kv, **overrides)
    default_dtype = torch.get_default_dtype()  # checked at the end: a leak would change later tests
    try:
        hf_tp.get_adapter(config).validate(config, tp)
    except ValueError as exc:
        return GridResult(model_type, "refused", str(exc))
    ref = exact_model(grid_model(config))
    mixers = stream_mixer_params(ref)
    data = batch(config.vocab_size, b=2, s=GRID_SEQ, pad="right")
    prompt = _prompt(config.vocab_size)
    greedy = ref.generate(**prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    candidates = [clone(ref) for _ in range(tp)]
    aux = is_moe(config) if aux is None else aux
    # Train with the router's aux loss in the loss or without (HF's generate cannot run with it on).
    for model in [ref, *candidates]:
        model.config.output_router_logits = aux
    want = train_steps(copy.deepcopy(ref), data, steps=steps)
    assert_every_gradient(ref, want.grads)

    traces = {}

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        hf_tp.parallelize(model, hf_tp.build_mesh(tp=tp, device_type="cpu"))
        model.config.output_router_logits = False
        got = model.generate(**prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
        assert torch.equal(got, greedy), f"model.generate: {got} vs plain HF {greedy}"
        model.config.output_router_logits = aux
        model.train()
        traces[rank] = train_steps(model, data, steps=steps, ctx=hf_tp.loss_parallel)
        assert_parity(traces[rank], want, uncapped=mixers)

    run_threaded(tp, rank_fn)
    assert torch.get_default_dtype() == default_dtype, f"{model_type} left torch's default dtype changed"
    return GridResult(model_type, "parity", "", *gradient_error(traces[0].grads, want.grads))


def run_family_ep(
    model_type: str, ep: int = 2, tp: int = 1, steps: int = 1, dp: int = 0, exact: bool = True, **overrides
) -> None:
    """Expert parallelism on ``ep`` dp ranks (times ``tp``) against plain HF on the global batch:
    logits, loss, every gradient (experts and routers), AdamW weights. Each dp rank trains on its
    own rows with HF's ``labels=`` loss, so the router's aux loss is off here (its global-batch
    form is tested in tests/unit/test_aux_loss.py and through the training loop). ``dp`` (default
    ``ep``) > ``ep``: FSDP2 over the rest (``ep=1``: a dense model under tp x dp). ``exact=False``: a
    model's fp32 parameters stay fp32 (what FSDP2 must place beside the float64 ones) and compute so."""
    dp = dp or ep
    config = grid_config(model_type, vocab_size=300, **overrides)  # 300: even vocab shards
    ref = exact_model(grid_model(config)) if exact else grid_model(config)
    mixers = stream_mixer_params(ref)
    data = batch(config.vocab_size, b=2 * dp, s=12, pad=None)  # equal token counts per dp rank
    want = train_steps(copy.deepcopy(ref), data, steps=steps)
    assert_every_gradient(ref, want.grads)
    candidates = [copy.deepcopy(ref) for _ in range(tp * dp)]

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        hf_tp.parallelize(model, mesh, ep=ep)
        rows = slice(2 * mesh.get_local_rank("dp"), 2 * mesh.get_local_rank("dp") + 2)
        local = {k: v[rows] for k, v in data.items()}
        got = train_steps(model, local, steps=steps, ctx=hf_tp.loss_parallel, dp_group=mesh["dp"].get_group())
        assert_parity(got, want, rows, uncapped=mixers)

    run_threaded(tp * dp, rank_fn)
