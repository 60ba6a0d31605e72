"""``hf-tp estimate``: simulated per-rank memory and comms, checked against arithmetic and real runs."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from transformers import LlamaConfig

import hf_tp
from hf_tp.cli.main import main
from hf_tp.estimate import bundled_models, estimate, resolve_model_config
from hf_tp.estimate.memory import GiB, MiB
from hf_tp.estimate.simulate import measure
from hf_tp.estimate.spec import parse_memory
from hf_tp.estimate.sweep import RESERVED_BYTES, recommend, sweep

# Published shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied).
SHAPES = {
    "qwen2-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128256, False),
    "llama-3.1-405b": (16384, 53248, 126, 128, 8, 128256, False),
    "mistral-7b": (4096, 14336, 32, 32, 8, 32000, False),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 151936, False),
    "gemma-2-2b": (2304, 9216, 26, 8, 4, 256000, True),
    "gemma-2-9b": (3584, 14336, 42, 16, 8, 256000, True),
}


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    tiny_llama().save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def qwen_tp2_dp8():
    config, name = resolve_model_config("qwen2-0.5b")
    return config, estimate(config, tp=2, dp=8, seq_len=2048, batch_size=1, dtype="fp32", model_name=name)


def analytic_params(c) -> int:
    """Parameter count of a Qwen2/Qwen3/Llama/Mistral/Gemma 2 config from its shapes (q/k/v biases
    for Qwen2, per-head q/k norms for Qwen3, four norms per layer for Gemma 2, explicit head_dim)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attn = 2 * c.hidden_size * q + 2 * c.hidden_size * kv
    if c.model_type == "qwen2":
        attn += q + 2 * kv
    if c.model_type == "qwen3":
        attn += 2 * head_dim
    norms = 4 if c.model_type == "gemma2" else 2  # Gemma 2: pre/post feed-forward norms too
    layer = attn + 3 * c.hidden_size * c.intermediate_size + norms * c.hidden_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embed + c.num_hidden_layers * layer + c.hidden_size


def test_bundled_configs_have_the_published_shapes() -> None:
    moe = {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"}  # their parameter counts: test_estimate_moe.py
    assert set(bundled_models()) == set(SHAPES) | moe
    for name, shape in SHAPES.items():
        c, _ = resolve_model_config(name.upper())  # short names are case-insensitive
        got = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
        got += (c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings)
        assert got == shape, name
    c, label = resolve_model_config("meta-llama/Llama-3.1-8B")  # a bundled Hub id needs no network
    assert (c.hidden_size, label) == (4096, "meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bundled_configs_build_the_published_parameter_count(name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config, _ = resolve_model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == analytic_params(config)


@pytest.mark.large_estimate
def test_qwen_tp2_dp8_parameters_and_optimizer_match_arithmetic(qwen_tp2_dp8) -> None:
    config, est = qwen_tp2_dp8
    assert est.num_params == analytic_params(config) == 494_032_768
    sharded_fp32 = est.num_params / 16 * 4  # fp32 master weights over tp*dp ranks
    assert est.state.parameters == pytest.approx(sharded_fp32, rel=0.03)
    assert est.state.optimizer == pytest.approx(2 * est.state.parameters, rel=0.01)  # AdamW exp_avg + exp_avg_sq
    assert est.peak.optimizer == est.state.optimizer
    assert est.peak.total > est.state.parameters + est.state.optimizer
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.large_estimate
def test_qwen_tp2_dp8_collectives(qwen_tp2_dp8) -> None:
    _, est = qwen_tp2_dp8
    counts = {(c.dim, c.collective): c.count for c in est.comms}
    # Megatron SP: 2 all-gathers + 2 reduce-scatters per layer forward, the same backward, +1 each for lm_head.
    assert counts[("tp", "reduce_scatter")] == 4 * 24 + 2
    # The fused lm_head + loss adds one small all-gather per chunk of tokens: 2048 tokens in chunks
    # of 2**29 / (4 * 75,968 vocab rows per rank) = 1766.
    assert counts[("tp", "all_gather")] == 4 * 24 + 2 + 2
    # The SP norm weights' Partial gradients (2 per layer + the final norm) are summed in one
    # all-reduce over all 16 ranks (not one per weight over tp), and the gradient norm is another.
    assert ("tp", "all_reduce") not in counts
    assert counts[("world", "all_reduce")] == 2
    # FSDP2: each layer gathered in forward and again in backward, the root once; one reduce-scatter per unit.
    assert counts[("dp", "all_gather")] == 2 * 24 + 1
    assert counts[("dp", "reduce_scatter")] == 24 + 1
    assert est.sent_bytes("tp") > 0 and est.sent_bytes("dp") > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=4, dp=4), r"tp must divide num_attention_heads \(14\) .* valid tp values for it are: 1, 2$"),
        (dict(seq_len=200_000), r"seq_len 200000 is over this model's max_position_embeddings \(131072\)"),
        (dict(batch_size=0), r"batch_size must be a positive integer, got batch_size=0"),
        (dict(dp=0), r"dp must be a positive integer"),
        (dict(dtype="fp16"), r"dtype must be one of bf16, fp32"),
    ],
)
def test_bad_inputs_fail_early_with_one_line(kwargs: dict, message: str) -> None:
    config, _ = resolve_model_config("qwen2-0.5b")
    args = dict(tp=2, dp=1, seq_len=128, batch_size=1, dtype="bf16") | kwargs
    with pytest.raises(ValueError, match=message):
        estimate(config, **args)
    assert not dist.is_initialized()


def test_unknown_models_name_the_bundled_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never reach for the Hub in tests
    with pytest.raises(ValueError, match=r"unknown model 'qwen9'.*qwen2-0\.5b"):
        resolve_model_config("qwen9")
    with pytest.raises(ValueError, match=r"cannot load a config for 'nobody/nothing'.*llama-3\.1-8b"):
        resolve_model_config("nobody/nothing")
    with pytest.raises(ValueError, match="no file or directory at './missing'"):
        resolve_model_config("./missing")


def test_estimate_matches_a_real_measurement() -> None:
    config = tiny_llama()
    est = estimate(config, tp=1, dp=1, seq_len=256, batch_size=2, dtype="fp32")
    est_again = estimate(config, tp=1, dp=1, seq_len=256, batch_size=2, dtype="fp32")  # runs twice in a process
    assert est_again.peak == est.peak
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = measure(config, hf_tp.build_mesh(tp=1, dp=1, device_type="cpu"), 256, 2, "fp32")
        with pytest.raises(ValueError, match="runs its own fake process group"):
            estimate(config, tp=1, dp=1, seq_len=256, batch_size=2)
    finally:
        dist.destroy_process_group()
    assert est.peak.total == pytest.approx(real.peak.total, rel=0.15)
    assert est.state.total == pytest.approx(real.state.total, rel=0.15)


@pytest.mark.large_estimate
def test_cli_prints_tables_and_json(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", str(tiny_dir), "--tp", "2", "--dp", "2", "--seq-len", "128", "--batch-size", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tp=2 x dp=2 (4 ranks)" in out
    for row in ("parameters", "optimizer state", "activations", "total", "tp all_gather", "dp reduce_scatter"):
        assert row in out
    assert not dist.is_initialized()
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["peak"]["total"] > 0
    assert main([*args[:3], "--tp", "3", "--seq-len", "8", "--batch-size", "1"]) == 2
    assert "tp must divide num_attention_heads (4)" in capsys.readouterr().err
    assert main([*args, "--jobs", "0"]) == 2
    assert capsys.readouterr().err.strip() == "hf-tp estimate: error: --jobs must be at least 1, got --jobs 0"


@pytest.mark.large_estimate
def test_gpu_memory_sweep_recommends_the_smallest_tp_that_fits(tiny_dir: Path, capsys) -> None:
    config = tiny_llama()
    result = sweep(config, world_size=4, seq_len=128, batch_size=2, dtype="fp32")
    by_tp = {e.tp: e for e in result.estimates}
    # tp=4 too: more ranks than its 2 KV heads, each then replicated on 2 ranks.
    assert sorted(by_tp) == [1, 2, 4] and by_tp[1].peak.total > by_tp[2].peak.total
    # A GPU that holds tp=2's peak (with the margins) but not tp=1's.
    gpu = int(by_tp[2].peak.total * 1.1 + RESERVED_BYTES) + 1
    assert recommend(result.estimates, gpu).tp == 2
    assert recommend(result.estimates, 80 * GiB).tp == 1
    assert recommend(result.estimates, RESERVED_BYTES) is None
    args = ["estimate", "--model", str(tiny_dir), "--world-size", "4", "--gpu-memory", "80GiB"]
    start = time.perf_counter()
    assert main([*args, "--seq-len", "128", "--batch-size", "2", "--dtype", "fp32"]) == 0
    wall = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "Recommended: --tp 1 --dp 4" in out and "rule: the smallest tp that fits" in out
    # issue 51 case 16: the sweep's wall time, not its simulations' seconds summed over workers
    took = float(re.search(r"Simulated in ([\d.]+) s on CPU", out).group(1))
    assert took <= wall + 0.1, (took, wall)
    assert not dist.is_initialized()


def test_parse_memory() -> None:
    assert parse_memory("80GiB") == 80 * GiB
    assert parse_memory("141GB") == 141 * 10**9
    assert parse_memory("80") == parse_memory("80G") == 80 * GiB
    assert parse_memory("512 MiB") == 512 * MiB
    with pytest.raises(ValueError, match="not a memory size; write it like 80GiB"):
        parse_memory("lots")


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi3"])
def test_cli_estimates_generic_families_from_config_json(model_type: str, tmp_path: Path, capsys) -> None:
    # Families served by the generic plan: a config.json is enough (no weights, no adapter file).
    from tests.family_grid import grid_config

    grid_config(model_type).save_pretrained(tmp_path)
    args = ["estimate", "--model", str(tmp_path / "config.json"), "--tp", "2", "--seq-len", "32", "--batch-size", "1"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peak"]["total"] > 0 and any(c["collective"] == "reduce_scatter" for c in data["comms"])


def test_an_estimate_prints_no_warning(tiny_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 51 case 16: torch's module tracker warned "The module hierarchy tracking maybe be messed
    up" on every estimate (silenced exactly, hf_tp.compat.mem_tracker.quiet_module_tracking), and
    the format of every later warning of the process changed with it."""
    formatwarning = warnings.formatwarning
    args = ["estimate", "--model", str(tiny_dir), "--tp", "1", "--dp", "1", "--seq-len", "32", "--batch-size", "1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(args) == 0
    assert not [str(w.message) for w in caught]
    assert "Warning" not in capfd.readouterr().err
    assert warnings.formatwarning is formatwarning
