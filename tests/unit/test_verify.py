"""``hf-tp verify`` on threaded ranks: it passes on supported layouts of a dense model (a MoE
model under expert parallelism: tests/e2e/test_verify_cli.py, launched), and fails, naming the
check, when a fault is injected (HF_TP_VERIFY_FAULT); the config cut and the refusals before launch."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_tp.train.model as train_model
from hf_tp.cli.formatting import subcommand_parser
from hf_tp.cli.main import main
from hf_tp.cli.verify import add_arguments as verify_arguments
from hf_tp.cli.verify import config_from_args
from hf_tp.verify.faults import FAULT_ENV
from hf_tp.verify.report import render
from hf_tp.verify.run import verify_rank
from tests.helpers import run_threaded, tiny_config

_BUILDING = threading.Lock()


@pytest.fixture
def serial_meta_builds(monkeypatch):
    """accelerate's ``init_empty_weights`` patches ``nn.Module.register_parameter`` for the whole
    process while one rank builds its meta model: rank threads must not run anything else then
    (separate processes, as launched, never share it)."""
    real = train_model.build_empty

    def build_empty(config):
        dist.barrier()
        with _BUILDING:
            model = real(config)
        dist.barrier()
        return model

    monkeypatch.setattr(train_model, "build_empty", build_empty)


def _model_dir(tmp_path: Path, config) -> str:
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return str(folder)


def _verify(model: str, tmp_path: Path, *flags: str) -> tuple[str, int, dict[str, bool]]:
    p = subcommand_parser("hf-tp verify", None, "")
    verify_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", model, "--device", "cpu", "--max-steps", "2", *flags]))
    out = {}

    def rank(r: int) -> None:
        out[r] = verify_rank(cfg, tmp_path, torch.device("cpu"))

    run_threaded(cfg.world_size, rank)
    about, checks = out[0]
    text, code = render(checks, about)
    return text, code, {c.name.split(" (")[0]: c.ok for c in checks}


@pytest.mark.parametrize(
    "flags",
    [("--tp", "2", "--lora-r", "4"), ("--tp", "1", "--cp", "2"), ("--tp", "2", "--dp", "2")],
    ids=["tp2-lora", "cp2", "tp2xdp2"],
)
def test_dense_layouts_pass(tmp_path, serial_meta_builds, flags) -> None:
    model = _model_dir(tmp_path, tiny_config("llama"))
    text, code, _ = _verify(model, tmp_path, *flags)
    assert code == 0, text
    assert "8 of 8 checks passed" in text and "checkpoint resume (tp " in text, text


@pytest.mark.parametrize(
    "fault, failed",
    [("stale-rotary", {"logits", "loss", "gradients", "buffers", "AdamW steps"}), ("rowwise-as-colwise", {"logits"})],
)
def test_injected_fault_fails_naming_the_check(tmp_path, serial_meta_builds, monkeypatch, fault, failed) -> None:
    monkeypatch.setenv(FAULT_ENV, fault)
    text, code, ok = _verify(_model_dir(tmp_path, tiny_config("llama")), tmp_path, "--tp", "2")
    assert code == 1, text
    assert failed <= {name for name, passed in ok.items() if not passed}, text
    assert "FAIL  logits" in text and "checks passed; failed: logits" in text, text
    if fault == "stale-rotary":  # the buffer is named, and what merely copies still passes
        assert "rotary_emb.inv_freq" in text and ok["export round trip"], text


def test_cut_keeps_one_layer_of_each_kind() -> None:
    from hf_tp.plan.build import resolve_config
    from hf_tp.verify.shrink import cut_config, layer_kinds

    deepseek = cut_config(resolve_config("deepseek-v3")[0], tp=2, seq_len=32)
    kinds = layer_kinds(deepseek)
    assert deepseek.num_hidden_layers == 4 and len(set(kinds)) == 2  # 3 dense layers, then the first MoE one
    assert deepseek.n_routed_experts == 16 and deepseek.num_attention_heads == 128 and deepseek.hidden_size == 512
    qwen = cut_config(resolve_config("qwen3-30b-a3b")[0], tp=4, seq_len=32)
    assert (qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.num_experts) == (1, 4, 16)
    assert qwen.vocab_size % 4 == 151936 % 4 and qwen.vocab_size < 4096 and qwen.moe_intermediate_size % 4 == 0


def test_refused_before_launch(capsys, monkeypatch) -> None:
    assert main(["verify", "--model", "qwen3-0.6b", "--tp", "3", "--device", "cpu"]) == 2
    assert "hf-tp verify: error:" in capsys.readouterr().err
    monkeypatch.setenv(FAULT_ENV, "no-such-fault")
    assert main(["verify", "--model", "qwen3-0.6b", "--tp", "2", "--device", "cpu"]) == 2
    assert "no-such-fault" in capsys.readouterr().err
