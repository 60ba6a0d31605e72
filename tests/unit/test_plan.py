"""``hf-tp plan`` / ``hf_tp.plan_for``: the derived plan, described without applying it, and its
collectives checked against what a parallelized model really issues (a fake process group:
counts and sizes only) and against ``hf-tp estimate``'s simulation for cp and ep."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import hf_tp
from hf_tp.cli.main import main
from hf_tp.compat import family_refusal
from hf_tp.estimate.counters import CommCounter
from hf_tp.plan import ModelPlan, plan_for
from hf_tp.plan.collectives import summary
from hf_tp.plan.plan_text import layer_ranges
from hf_tp.run.validate import validate_model_config
from tests.family_grid import grid_config, is_moe
from tests.helpers import FAMILY_SETTINGS, batch, tiny_config

S = 12  # a multiple of tp: no padding


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


def whole_model(plan: ModelPlan) -> dict[str, list]:
    """One forward and one backward of the whole model, per (dim, collective): [count, bytes]."""
    dims = {"tp": plan.tp, "cp": plan.cp, "ep": plan.ep}
    fwd, bwd = list(plan.top_forward), list(plan.top_backward)
    for kind in plan.kinds:
        fwd += list(kind.forward) * len(kind.layers)
        bwd += list(kind.backward) * len(kind.layers)
    return {
        d: {(s.dim, s.collective): [s.count, s.bytes] for s in summary(c, dims)}
        for d, c in (("fwd", fwd), ("bwd", bwd))
    }


def test_llama_3_1_8b_at_tp8() -> None:
    code, out, err = run_cli("--model", "llama-3.1-8b", "--tp", "8", "--seq-len", "4096")
    assert code == 0, err
    assert "meta-llama/Llama-3.1-8B (llama): tp 8, 1 x 4096 tokens, bfloat16" in out
    assert "layers 0-31 (32)\n" in out and "decoder layers at model.layers: 32, 1 kind" in out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "self_attn.q_proj colwise weight 4096x4096 -> 512x4096" in lines
    assert "self_attn.k_proj colwise weight 1024x4096 -> 128x4096" in lines
    assert "mlp.down_proj rowwise, reduce-scatter to sequence shards weight 4096x14336 -> 4096x1792" in lines
    assert "input_layernorm sequence-parallel norm weight 4096 (whole)" in lines
    assert (
        "model.embed_tokens vocab-parallel embedding, reduce-scatter to sequence shards weight 128256x4096 -> 16032x4096"
        in lines
    )
    # tp-facts: a dense layer's forward is 2 all-gathers + 2 reduce-scatters of b x s x h (bf16: 32 MiB)
    assert "forward, per layer: 2 all-gather, 2 reduce-scatter (128.0 MiB; one rank sends 112.0 MiB)" in lines


def test_one_dense_layer_is_the_megatron_sp_minimum() -> None:
    plan = plan_for(tiny_config("llama"), tp=2, seq_len=S)
    (kind,) = plan.kinds
    assert kind.layers == (0, 1)
    h = 64
    for side in (kind.forward, kind.backward):
        assert sorted(c.op for c in side) == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
        assert {(c.dim, c.elements, c.itemsize) for c in side} == {("tp", S * h, 4)}
    assert [c.op for c in kind.forward] == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    assert kind.split_share > 0.99 and kind.per_rank == kind.split // 2 + (kind.total - kind.split)


# A family for every kind of part the plans use: Llama's layout, gathered packed projections
# (phi3), full-width norms (olmo2), blocks that run whole and gathered ones inside them
# (qwen3_5_text, lfm2), latent attention and a dense first layer (deepseek_v3), MoE regions with
# sinks and biases (gpt_oss), learned activation scalars (apertus), scaled embeddings (gemma2),
# a MoE block returning its tokens flattened (llama4_text), a norm on a MoE block's output (axk1),
# a normed embedding and shared experts stored as 3-D stacks (inkling_text).
FAMILIES = [
    "llama",
    "phi3",
    "olmo2",
    "qwen3_5_text",
    "lfm2",
    "deepseek_v3",
    "gpt_oss",
    "apertus",
    "gemma2",
    "llama4_text",
    "axk1",
    "inkling_text",
]
# per-layer mixers (a plan per mixer kind) and hyper-connections (the mixers and the layer's stream
# arithmetic add no collective), on the release that serves them
FAMILIES += [
    pytest.param(mt, marks=pytest.mark.skipif(bool(family_refusal(mt)), reason=str(family_refusal(mt))))
    for mt in ("nemotron_h", "minimax", "hy_v4", "deepseek_v4")
]
# an indexer (no gradient flows back through a choice of keys) and experts a layer hands its routing
FAMILIES += [
    pytest.param(mt, marks=pytest.mark.skipif(bool(family_refusal(base)), reason=str(family_refusal(base))))
    for mt, base in (("qwen4_exp_text", "qwen4_exp_text"), ("gemma4_text+moe", "gemma4_text"))
]
# plans read from the modules (no tp plan in transformers): OPT's layer runs its MLP itself on flattened
# tokens (fc1 gathers, fc2 all-reduces); GPT-Neo's attention sits one module down (attn.attention);
# XGLM's sinusoidal positions run whole, sliced to sequence shards
FAMILIES += ["opt", "gpt_neo", "xglm"]
VARIANTS = {"gemma4_text+moe": dict(enable_moe_block=True, top_k_experts=2)}


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_collectives_are_what_a_parallelized_model_issues(model_type: str, fake_world) -> None:
    model_type, variant = model_type.split("+")[0], VARIANTS.get(model_type, {})
    if model_type not in CONFIG_MAPPING or family_refusal(model_type):
        pytest.skip(f"this transformers has no {model_type} (or hf_tp refuses it at this release)")
    config = tiny_config(model_type) if model_type in FAMILY_SETTINGS else grid_config(model_type, **variant)
    want = whole_model(plan_for(config, tp=2, seq_len=S))
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if is_moe(config) else {}
    model = AutoModelForCausalLM.from_config(config, **extra)
    mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
    hf_tp.parallelize(model, mesh)
    groups = {mesh["tp"].get_group().group_name: ("tp", 2)}
    fwd, bwd = CommCounter(groups), CommCounter(groups)
    with hf_tp.loss_parallel():
        with fwd:
            loss = model(**batch(config.vocab_size, b=1, s=S, pad=None), use_cache=False).loss
        with bwd:
            loss.backward()
    got = {d: {(s.dim, s.collective): [s.count, s.bytes] for s in c.stats()} for d, c in (("fwd", fwd), ("bwd", bwd))}
    assert got == want


def test_cp_and_ep_collectives_are_what_the_estimate_simulates() -> None:
    from hf_tp.compat import moe_estimate_refusal
    from hf_tp.estimate.estimate_run import estimate

    cases = [(tiny_config("llama"), dict(cp=2))]
    if moe_estimate_refusal("fp32") is None:  # an fp32 MoE estimate needs a later transformers than the floor
        cases.append((grid_config("qwen3_moe"), dict(ep=2)))
        # their layers cast modules to fp32 in __init__ (built under fake tensors): Inkling's short
        # convolutions, DeepSeek-V4's attention and hyper-connection mixers
        for mt in ("inkling_text", "deepseek_v4"):
            if mt in CONFIG_MAPPING and not family_refusal(mt):
                cases.append((grid_config(mt), {}))
    for config, layout in cases:
        plan = whole_model(plan_for(config, tp=2, seq_len=64, **layout))
        simulated = estimate(config, 2, 2 if "ep" in layout else 1, 64, 1, dtype="fp32", **layout)
        for s in simulated.comms:
            if s.dim in layout or (s.dim, s.collective) == ("tp", "reduce_scatter"):
                planned = [
                    sum(x) for x in zip(*(plan[d].get((s.dim, s.collective), [0, 0]) for d in plan), strict=True)
                ]
                assert planned == [s.count, s.bytes], (config.model_type, s)


def test_kv_heads_replicated_when_tp_is_over_them() -> None:
    plan = plan_for(tiny_config("llama", heads=8, kv_heads=2), tp=4, seq_len=S)
    rows = {r.path: r for r in plan.kinds[0].rows}
    k = rows["self_attn.k_proj"]
    assert k.style == "replicated KV heads (x2 copies)" and "each KV head whole on 2 ranks" in k.whole
    assert all(p.local == p.shape and p.partial_grad for p in k.params)
    assert len(plan.kinds[0].forward) == 4  # still the SP minimum
    assert any("KV heads" in n for n in plan.notes)


def test_moe_layers_dense_layers_and_expert_parallel() -> None:
    plan = plan_for(grid_config("deepseek_v3"), tp=2, ep=2, seq_len=S)
    dense, moe = plan.kinds
    assert (dense.layers, dense.label, moe.layers, moe.label) == ((0,), "dense", (1,), "MoE")
    rows = {r.path: r for r in moe.rows}
    assert "multi-head latent attention" in rows["self_attn"].whole
    experts = rows["mlp.experts"]
    assert "whole experts over ep (2 of 4 per rank)" in experts.style
    gate_up = next(p for p in experts.params if p.name == "gate_up_proj")
    assert gate_up.packed and gate_up.local == (2, gate_up.shape[1] // 2, gate_up.shape[2])
    ops = [(c.dim, c.op) for c in moe.forward]
    assert ops.count(("ep", "all_to_all")) == 4 and ("ep", "all_to_all") not in [(c.dim, c.op) for c in dense.forward]


def test_refusals_are_one_line_and_train_s_messages(tmp_path: Path) -> None:
    config = tiny_config("llama")
    for argv, cause in (
        (["--tp", "3"], lambda: validate_model_config(config, 3, 64)),
        (["--ep", "2"], lambda: validate_model_config(config, 2, 64, ep=2)),
        (["--seq-len", "4096"], lambda: validate_model_config(config, 2, 4096)),
    ):
        (tmp_path / "config.json").write_text(config.to_json_string())
        code, out, err = run_cli("--model", str(tmp_path), *argv)
        with pytest.raises(ValueError) as want:
            cause()
        assert (code, out, err) == (2, "", f"hf-tp plan: error: {want.value}\n")
    code, _, err = run_cli("--model", "no-such-model")
    assert code == 2 and err.startswith("hf-tp plan: error: unknown model 'no-such-model'") and err.count("\n") == 1
    code, _, err = run_cli("--model", "llama-3.1-8b", "--tp", "0")
    assert (code, err) == (2, "hf-tp plan: error: --tp must be a positive integer, got 0\n")


def test_a_local_folder_a_config_and_a_model_give_one_plan(tmp_path: Path) -> None:
    config = grid_config("qwen2")
    (tmp_path / "config.json").write_text(config.to_json_string())
    by_config = plan_for(config, tp=2, seq_len=S, name="x")
    assert plan_for(str(tmp_path), tp=2, seq_len=S, name="x") == by_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert plan_for(model, tp=2, seq_len=S, name="x") == by_config
    assert hf_tp.plan_for is plan_for


def test_a_hub_id_in_the_cache_needs_no_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "models--someone--tiny-qwen2"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(grid_config("qwen2").to_json_string())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_tp.core.model_source.hub_unreachable", lambda: pytest.fail("asked the Hub"))
    plan = plan_for("someone/tiny-qwen2", tp=2, seq_len=S)
    assert (plan.model, plan.model_type, len(plan.kinds[0].layers)) == ("someone/tiny-qwen2", "qwen2", 2)


def test_json_is_the_record() -> None:
    code, out, _ = run_cli("--model", "qwen3-0.6b", "--tp", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["tp"] == 2 and data["kinds"][0]["layers"] == list(range(28))
    row = next(r for r in data["kinds"][0]["rows"] if r["path"] == "self_attn.q_norm")
    assert row["style"] == "per-head norm on the rank's heads" and row["params"][0]["partial_grad"]


def test_uneven_shards_show_rank_0() -> None:
    plan = plan_for(grid_config("qwen2"), tp=2, seq_len=S)  # vocab 301 over 2 ranks: 151 and 150
    embed = next(r for r in plan.top if r.path == "model.embed_tokens")
    assert embed.params[0].shape == (301, 64) and embed.params[0].local == (151, 64)
    assert math.prod(embed.params[0].local) > math.prod(embed.params[0].shape) / 2


def test_layer_ranges() -> None:
    assert layer_ranges((0, 1, 2, 3)) == "0-3"
    assert layer_ranges((1, 3)) == "1, 3"
    assert layer_ranges((0, 2, 4, 6, 8)) == "0, 2, ..., 8"
    assert layer_ranges((0, 1, 2, 5, 6, 9)) == "0-2, 5-6, 9"


def test_the_default_seq_len_fits_the_model(tmp_path: Path) -> None:
    """Issue 51 case 15: a model with 256 positions was refused over a --seq-len 2048 the user never gave."""
    config = tiny_config("llama")
    config.max_position_embeddings = 256
    (tmp_path / "config.json").write_text(config.to_json_string())
    code, out, err = run_cli("--model", str(tmp_path), "--tp", "2", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["seq_len"] == 256
    assert run_cli("--model", str(tmp_path), "--tp", "2", "--seq-len", "4096")[0] == 2  # given: still checked
