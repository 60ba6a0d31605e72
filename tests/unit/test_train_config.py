"""TrainConfig precedence and every bad-input message of `hf-tp train` (no process is started)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hf_tp.cli.main import main
from hf_tp.cli.train import add_arguments, config_from_args
from hf_tp.run.config import TrainConfig
from tests.helpers import tiny_config, tiny_model


def parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_defaults_then_yaml_then_flags(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("tp: 2\ndp: 4\nseq-len: 256\nlr: 1.0e-4\nsequence_parallel: false\n")
    cfg = parse(["--config", str(y), "--dp", "1", "--lr", "5e-4"])
    assert (cfg.tp, cfg.dp, cfg.seq_len, cfg.lr, cfg.sequence_parallel) == (2, 1, 256, 5e-4, False)
    assert cfg.grad_accum == 1 and cfg.loss_parallel is True  # untouched defaults
    assert parse(["--no-loss-parallel"]).loss_parallel is False


def test_profiles_fill_only_unset_fields() -> None:
    embedded = TrainConfig(seq_len=32).resolve()
    assert (embedded.seq_len, embedded.tp, embedded.dp, embedded.device) == (32, 2, 2, "cpu")
    general = TrainConfig(model="Qwen/Qwen2-0.5B", tp=2).resolve()
    assert (general.seq_len, general.tp, general.dp, general.device) == (2048, 2, 1, "auto")
    assert TrainConfig(batch_size=2, dp=2, grad_accum=3).global_batch == 12


def test_shipped_configs_parse() -> None:
    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml")):
        cfg = parse(["--config", str(path)]).resolve()
        cfg.validate()


def test_unknown_yaml_key(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("tp: 2\nbatchsize: 4\n")
    with pytest.raises(ValueError, match="unknown settings in .*: batchsize; valid: model"):
        parse(["--config", str(y)])


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen14")
    tiny_model(tiny_config("qwen2", heads=14, kv_heads=2, hidden_size=112)).save_pretrained(d)
    from hf_tp.demo.assets import ensure_default_assets

    for f in ensure_default_assets(d / "assets").model_dir.glob("tokenizer*"):  # a whole model folder
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("data") / "corpus.txt"
    f.write_text("hello world\n" * 50)
    return f


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "0"], "--tp must be a positive integer, got 0"),
        (["--lr", "-1"], "--lr must be positive, got -1.0"),
        (["--node-rank", "2", "--nnodes", "2"], r"--node-rank must be in \[0, nnodes=2\), got 2"),
        (
            ["--model", "/no/such/model"],
            "model not found: no file or directory at '/no/such/model'",
        ),
        (
            ["--tp", "4"],
            r"tp must divide num_attention_heads \(14\) of this qwen2 model, got tp=4; valid tp values for it are: 1, 2",
        ),
        (["--seq-len", "4096"], r"--seq-len 4096 is over this model's max_position_embeddings \(128\)"),
        (["--dataset", "/no/such/file.txt"], "dataset not found: no file or directory at '/no/such/file.txt'"),
        (["--profile-steps", "1-2"], r"--profile-steps 1-2: need 2 <= first <= last"),
        (["--profile-steps", "x"], "--profile-steps must look like 10-12"),
        (["--profile-steps", "4-9", "--max-steps", "5"], "--profile-steps 4-9 goes past --max-steps 5"),
        (["--dp", "3", "--ep", "2"], r"--ep must divide --dp \(3\): expert parallelism borrows its ranks from dp"),
        (["--ep", "2", "--dp", "2"], "--ep 2 needs a mixture-of-experts model; this qwen2 model has no experts"),
        (["--eval-split", "1.5"], r"--eval-split must be a fraction in \[0, 1\) of the training documents, got 1.5"),
        (
            ["--eval-every", "5"],
            "--eval-every/--eval-batches need evaluation data: pass --eval-dataset or --eval-split",
        ),
        (["--eval-split", "0.1", "--eval-dataset", "x.jsonl"], "pass either --eval-dataset or --eval-split"),
        (["--eval-dataset", "/no/eval.jsonl"], "dataset not found: no file or directory at '/no/eval.jsonl'"),
        (["--report-to", "mlflow"], "--report-to takes tensorboard, wandb, none"),
        (["--text-column", "a", "--messages-column", "b"], "pass either --text-column or --messages-column"),
        (["--split", "test[:5%]"], r"local data files form one split, 'train'; got --split test\[:5%\]"),
        (["--collective-timeout", "0"], "--collective-timeout must be a positive number of seconds, got 0.0"),
    ],
)
def test_bad_input_is_one_clear_line(flags, message, qwen_dir, corpus, tmp_path, capsys) -> None:
    base = ["train", "--model", str(qwen_dir), "--dataset", str(corpus), "--seq-len", "32", "--tp", "2"]
    base += ["--output-dir", str(tmp_path / "out")]
    assert main(base + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tp train: error: ") and "\n" not in err
    assert __import__("re").search(message, err), err


def test_output_dir_with_a_run_is_not_overwritten(qwen_dir, corpus, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    argv = ["train", "--model", str(qwen_dir), "--dataset", str(corpus), "--output-dir", str(out), "--seq-len", "32"]
    assert main(argv) == 2
    assert (
        "already holds a run (metrics.jsonl); pass --resume to continue it, another --output-dir"
        in capsys.readouterr().err
    )
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resume_with_another_setup_is_a_clear_error(tmp_path: Path) -> None:
    from hf_tp.run.validate import check_resume_compatible, run_fingerprint

    model_config = tiny_config("qwen2")
    saved = run_fingerprint(TrainConfig(model="m", dataset="d", seq_len=64, tp=2, dp=2, batch_size=2), model_config)
    # Another mesh with the same global batch is fine (DCP reshards) ...
    check_resume_compatible(
        saved,
        run_fingerprint(TrainConfig(model="m", dataset="d", seq_len=64, tp=4, dp=1, batch_size=4), model_config),
        tmp_path,
    )
    # ... another model or sequence length is not.
    other = run_fingerprint(TrainConfig(model="m", dataset="d", seq_len=32, tp=2, dp=2, batch_size=2), model_config)
    with pytest.raises(
        ValueError, match=r"cannot resume from .*: it was saved with seq_len=64 but this run has seq_len=32"
    ):
        check_resume_compatible(saved, other, tmp_path)
    bigger = run_fingerprint(
        TrainConfig(model="m", dataset="d", seq_len=64, tp=2, dp=2, batch_size=2), tiny_config("qwen2", hidden_size=128)
    )
    with pytest.raises(ValueError, match="hidden_size=64 but this run has hidden_size=128"):
        check_resume_compatible(saved, bigger, tmp_path)
    streamed = run_fingerprint(
        TrainConfig(model="m", dataset="d", seq_len=64, tp=2, dp=2, batch_size=2, streaming=True), model_config
    )
    with pytest.raises(ValueError, match="saved with streaming=False but this run has streaming=True"):
        check_resume_compatible(saved, streamed, tmp_path)
    # A checkpoint from before a setting existed resumes (the setting is not compared).
    older = {k: v for k, v in saved.items() if k not in ("streaming", "document_masking")}
    check_resume_compatible(older, streamed, tmp_path)


def test_more_processes_than_visible_gpus(monkeypatch) -> None:
    import torch

    from hf_tp.run.validate import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tp\*dp = 2\*2 = 4 processes need 4 GPUs per node, but 2 are visible"):
        check_devices(TrainConfig(tp=2, dp=2), "cuda")
    check_devices(TrainConfig(tp=2, dp=2, nnodes=2), "cuda")  # 2 per node fits


def test_start_line_says_what_is_launched() -> None:
    from hf_tp.run.launch import start_line

    cfg = TrainConfig(model="m", tp=2, dp=2, batch_size=4, grad_accum=2, seq_len=64, max_steps=10).resolve()
    assert start_line(cfg, "cpu", launching=True) == (
        "hf-tp train: launching 4 ranks = tp 2 x dp 2 (1 node) on CPU, gloo, fp32; global batch 16 sequences "
        "(4 per rank x dp 2 x grad-accum 2) = 1,024 tokens per step, 10 steps -> outputs/run"
    )
    gpu = start_line(TrainConfig(model="m", tp=4, dp=4, nnodes=2).resolve(), "cuda", launching=True)
    assert "16 ranks = tp 4 x dp 4 (2 nodes, 8 ranks on this one) on one GPU per rank, nccl, bf16 compute" in gpu
    assert start_line(TrainConfig(model="m").resolve(), "cpu", launching=False).startswith(
        "hf-tp train: running in this process: 1 rank = tp 1 x dp 1"
    )


def test_warmup_starts_above_zero_and_reaches_the_peak() -> None:
    from hf_tp.run.optim import lr_factor

    f = [lr_factor(s, warmup=3, total=10, min_ratio=0.1) for s in range(11)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # the first step trains at lr / (warmup + 1)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False)) and f[10] == pytest.approx(0.1)
    assert lr_factor(0, warmup=0, total=10, min_ratio=0.1) == 1.0


def test_resume_keeps_this_runs_schedule_length() -> None:
    # Resumed with a larger --max-steps: the saved position, this run's decay (not the first run's end).
    import torch

    from hf_tp.run.config import TrainConfig
    from hf_tp.run.optim import build_scheduler, restore_schedule_position

    def schedule(steps: int) -> torch.optim.lr_scheduler.LRScheduler:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return build_scheduler(opt, TrainConfig(max_steps=steps, warmup_steps=1, min_lr_ratio=0.1))

    short, long = schedule(3), schedule(10)
    for _ in range(3):
        short.optimizer.step()
        short.step()
        long.optimizer.step()
        long.step()
    resumed = schedule(10)
    restore_schedule_position(resumed, short.state_dict())
    assert resumed.get_last_lr() == pytest.approx(long.get_last_lr())
    resumed.step()
    long.step()
    assert resumed.get_last_lr() == pytest.approx(long.get_last_lr()) and long.get_last_lr()[0] > 0.1


def test_unreachable_hub_fails_at_once_with_one_line(monkeypatch) -> None:
    """No network: one quick request decides, instead of from_pretrained's ~25 s of retries."""
    import time

    import hf_tp.core.model_source
    from hf_tp.run.validate import load_model_config

    monkeypatch.setattr(hf_tp.core.model_source, "hub_unreachable", lambda: "ConnectError: Name or service not known")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:
        load_model_config("some-org/some-model-that-is-not-cached")
    assert time.perf_counter() - t0 < 5
    assert str(info.value) == (
        "model not found: 'some-org/some-model-that-is-not-cached' is not a local directory and not in the Hub "
        "cache, and the Hub cannot be reached (ConnectError: Name or service not known)"
    )


def test_aux_loss_over_is_step_or_micro_batch() -> None:
    # A YAML file bypasses argparse's choices: the config's own check names the valid values.
    assert TrainConfig().aux_loss_over == "step"
    with pytest.raises(ValueError, match="--aux-loss-over must be one of step, micro-batch, got 'batch'"):
        TrainConfig(aux_loss_over="batch").validate()
