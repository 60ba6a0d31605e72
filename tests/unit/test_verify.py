"""``hf-tp verify`` on threaded ranks: it passes on a sample of supported layouts of a dense model
(the whole set, dense and MoE: ``python -m tests.verify_grid``; a MoE under expert parallelism,
launched: tests/e2e/test_verify_cli.py) and fails, naming the check, when a fault is injected
(HF_TP_VERIFY_FAULT); the config cut and the refusals before launch."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from hf_tp.cli.main import main
from hf_tp.compat import family_refusal
from hf_tp.verify.injected_faults import FAULT_ENV
from tests.family_grid import grid_config
from tests.helpers import tiny_config
from tests.verify_grid import model_dir, verify_threaded


@pytest.mark.parametrize("flags", [("--tp", "2", "--lora-r", "4"), ("--tp", "1", "--cp", "2")], ids=["tp2-lora", "cp2"])
def test_dense_layouts_pass(tmp_path, flags) -> None:
    text, code, _ = verify_threaded(model_dir(tmp_path / "config", tiny_config("llama")), tmp_path, *flags)
    assert code == 0, text
    assert "8 of 8 checks passed" in text and "checkpoint resume (tp " in text, text


@pytest.mark.skipif(
    "gemma4_text" not in CONFIG_MAPPING or bool(family_refusal("gemma4_text")),
    reason="needs Gemma 4 (transformers 5.24)",
)
def test_gemma4_text_passes_at_tp2(tmp_path) -> None:
    """Its per-layer-input norm has an element whose resumed step's gradient is round-off while the
    moment AdamW carries is not: judged with every step's gradients it passes, as it trains."""
    text, code, _ = verify_threaded(model_dir(tmp_path / "config", grid_config("gemma4_text")), tmp_path, "--tp", "2")
    assert code == 0 and "8 of 8 checks passed" in text, text


@pytest.mark.parametrize(
    "fault, failed",
    [("stale-rotary", {"logits", "loss", "gradients", "buffers", "AdamW steps"}), ("rowwise-as-colwise", {"logits"})],
)
def test_injected_fault_fails_naming_the_check(tmp_path, monkeypatch, fault, failed) -> None:
    monkeypatch.setenv(FAULT_ENV, fault)
    text, code, ok = verify_threaded(model_dir(tmp_path / "config", tiny_config("llama")), tmp_path, "--tp", "2")
    assert code == 1, text
    assert failed <= {name for name, passed in ok.items() if not passed}, text
    assert "FAIL  logits" in text and "checks passed; failed: logits" in text, text
    if fault == "stale-rotary":  # the buffer is named, and what merely copies still passes
        assert "rotary_emb.inv_freq" in text and ok["export round trip"], text


def test_cut_keeps_one_layer_of_each_kind() -> None:
    from hf_tp.adapters.shrink import cut_config, layer_kinds
    from hf_tp.core.model_source import ModelSource

    deepseek = cut_config(ModelSource.for_shapes("deepseek-v3").config, tp=2, seq_len=32)
    kinds = layer_kinds(deepseek)
    assert deepseek.num_hidden_layers == 4 and len(set(kinds)) == 2  # 3 dense layers, then the first MoE one
    assert deepseek.n_routed_experts == 16 and deepseek.num_attention_heads == 128 and deepseek.hidden_size == 512
    qwen = cut_config(ModelSource.for_shapes("qwen3-30b-a3b").config, tp=4, seq_len=32)
    assert (qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.num_experts) == (1, 4, 16)
    assert qwen.vocab_size % 4 == 151936 % 4 and qwen.vocab_size < 4096 and qwen.moe_intermediate_size % 4 == 0


def test_refused_before_launch(capsys, monkeypatch) -> None:
    assert main(["verify", "--model", "qwen3-0.6b", "--tp", "3", "--device", "cpu"]) == 2
    assert "hf-tp verify: error:" in capsys.readouterr().err
    monkeypatch.setenv(FAULT_ENV, "no-such-fault")
    assert main(["verify", "--model", "qwen3-0.6b", "--tp", "2", "--device", "cpu"]) == 2
    assert "no-such-fault" in capsys.readouterr().err


def test_small_gradients_both_runs_agree_on_are_resolved() -> None:
    """A tied LM head's rows of tokens the batch lacks get the softmax tail: gradients far under the
    tensor's RMS yet exact, which AdamW moves by about lr each. Where the candidate's gradient agrees
    to 1e-3 of itself they count (a wrong update there fails); where not they are unresolved, and
    more than the cap of them fails the tensor."""
    from hf_tp.verify.compare import adam_error

    torch.manual_seed(0)
    start = {"w": torch.randn(100, 8)}
    grad = torch.randn(100, 8)
    grad[10:] *= 1e-9  # 90 of 100 rows: the tail
    want = {"w": start["w"] - 1e-3 * grad.sign()}
    agreeing = grad * (1 + 1e-6 * torch.randn_like(grad))
    assert adam_error(want, want, start, {"w": grad}, {"w": agreeing}, 1e-2).rel == 0
    flipped = want["w"].clone()
    flipped[50] += 2e-3  # one tail row moved the other way
    assert adam_error({"w": flipped}, want, start, {"w": grad}, {"w": agreeing}, 1e-2).rel > 1e-3
    noisy = grad + 1e-3 * grad[:10].abs().mean()  # round-off well above the tail
    assert "are ~0" in adam_error(want, want, start, {"w": grad}, {"w": noisy}, 1e-2).where


def test_a_gradient_the_fp32_reference_itself_misses_is_held_to_its_own_round_off() -> None:
    """A gradient summed from nearly cancelling terms is as far from float64 in the fp32 reference
    as in the layout: that tensor is held to 3 x the reference's own error, named in the report;
    every other tensor still to 1e-5."""
    from hf_tp.verify.measured import gradients_check

    exact = {"mixer": torch.ones(8, dtype=torch.float64), "proj": torch.ones(8, dtype=torch.float64)}
    want = {"mixer": torch.ones(8) + 2e-5, "proj": torch.ones(8)}  # the reference 2e-5 off on the mixer
    ok = gradients_check({"mixer": torch.ones(8) - 2e-5, "proj": torch.ones(8)}, want, exact)
    assert ok.ok and "tol 6e-05 (3 x the fp32 reference's own error against float64 on 1: mixer)" in ok.text, ok
    assert not gradients_check({"mixer": torch.ones(8) - 1e-4, "proj": torch.ones(8)}, want, exact).ok
    bad = gradients_check({"mixer": want["mixer"], "proj": torch.ones(8) + 2e-5}, want, exact)
    assert not bad.ok and "(proj); tol 1e-05" in bad.text, bad


def test_a_later_step_is_judged_with_the_moment_it_carries() -> None:
    """A resumed step whose gradient is ~0 on an element (and the two runs disagree on it) is no
    round-off update while AdamW's first moment carries the earlier steps' resolved gradient: with
    every step's gradients that element is judged, and a wrong update there fails; a moment that is
    round-off throughout is still unresolved (gemma4_text's post_per_layer_input_norm at tp 2)."""
    from hf_tp.verify.compare import adam_error

    torch.manual_seed(0)
    start, g1, g2 = torch.randn(64), torch.randn(64), torch.randn(64)
    g2[5] = 1e-12
    got_g2 = g2.clone()
    got_g2[5] = -1e-12
    want = {"w": start - 1e-3}
    start = {"w": start}
    assert "w: 1 of 64 gradients are ~0" in adam_error(want, want, start, {"w": g2}, {"w": got_g2}).where
    steps, got_steps = [{"w": g1}, {"w": g2}], [{"w": g1}, {"w": got_g2}]
    assert adam_error(want, want, start, steps, got_steps, judged=1).rel == 0
    wrong = want["w"].clone()
    wrong[5] += 1e-3
    assert adam_error({"w": wrong}, want, start, steps, got_steps, judged=1).rel > 1e-3
    g1[5] = 1e-12
    got_g1 = g1.clone()
    got_g1[5] = 1e-11
    assert "are ~0" in adam_error(want, want, start, [{"w": g1}, {"w": g2}], [{"w": got_g1}, {"w": got_g2}]).where


def test_the_flags_shared_with_train_are_trains() -> None:
    """``hf-tp verify``'s layout, LoRA and launch flags are generated from TrainConfig's fields, as
    ``hf-tp train``'s are: the same names, help and choices; not given, TrainConfig's defaults."""
    from hf_tp.cli.formatting import subcommand_parser
    from hf_tp.cli.train import build_parser
    from hf_tp.cli.verify import TRAIN_FLAGS, add_arguments, config_from_args
    from hf_tp.run.config import TrainConfig

    verify = subcommand_parser("hf-tp verify", None, "")
    add_arguments(verify)

    def actions(parser) -> dict:
        return {(a.dest, tuple(a.option_strings)): (a.help, a.choices, a.const) for a in parser._actions}

    train, mine = actions(build_parser()), actions(verify)
    shared = {key: value for key, value in train.items() if key[0] in TRAIN_FLAGS}
    assert {dest for dest, _ in shared} == set(TRAIN_FLAGS)  # (sequence / loss parallel: their --no- flag)
    assert {key: mine.get(key) for key in shared} == shared
    cfg = config_from_args(verify.parse_args(["--model", "m", "--cp", "2", "--no-loss-parallel"]))
    default = TrainConfig()
    assert (cfg.tp, cfg.dp, cfg.cp, cfg.max_steps, cfg.lr, cfg.seq_len, cfg.loss_parallel) == (
        2,
        1,
        2,
        3,
        1e-3,
        32,
        False,
    )
    assert all(getattr(cfg, f) == getattr(default, f) for f in TRAIN_FLAGS if f not in ("cp", "loss_parallel"))
    assert config_from_args(verify.parse_args(["--model", "m", "--tp", "2", "--cp", "3"])).seq_len == 36  # 2*cp*tp
