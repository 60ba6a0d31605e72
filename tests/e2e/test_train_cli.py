"""`hf-tp train` end to end: real launches through accelerate, compared with plain HF training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiny_config, tiny_model
from tests.reference_loop import reference_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
STEPS = 6
COMMON = ["--seq-len", "15", "--max-steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "2", "--no-tensorboard"]


def hf_tp_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "train", *args]
    return run_killing_group(cmd, env, timeout)


def run_killing_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout kills the launcher's whole process group (ranks included)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen2 (tied, vocab of the default tokenizer) saved with a tokenizer, and a corpus.

    4 heads, 2 KV heads: at tp=2 k_proj/v_proj are sharded by KV head, at tp=4 each KV head is
    replicated on 2 ranks; the runs below (and test_checkpoint's resumes) cross between the two."""
    from transformers import AutoTokenizer

    from hf_tp.demo.assets import ensure_default_assets

    root = tmp_path_factory.mktemp("train")
    assets = ensure_default_assets(root / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    model_dir = root / "qwen2"
    config = tiny_config("qwen2", tied=True, kv_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tiny_model(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir, assets.data_file


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny tied Llama with a ChatML tokenizer, and a jsonl of multi-turn conversations (system,
    user, assistant and tool turns) in a `messages` column."""
    from tests.chat_data import chat_tokenizer, conversations

    root = tmp_path_factory.mktemp("chat")
    tok = chat_tokenizer()
    config = tiny_config(
        "llama", tied=True, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    tiny_model(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    return root / "model", data


def test_mesh_shapes_and_plain_hf_give_one_loss_curve(chat_setup, tmp_path) -> None:
    """Chat data (assistant-only labels, documents packed with their own masks), three mesh shapes
    (one chosen by --layout auto) and plain single-process HF: one loss curve, one grad-norm curve, one held-out eval loss. (A
    single-rank launch: the reference run of tests/e2e/test_checkpoint.py.)"""
    model_dir, data = chat_setup
    runs = {
        "tp2_dp2_b2": ["--tp", "2", "--dp", "2", "--batch-size", "2"],
        "auto_tp4_dp1_b4": ["--layout", "auto", "--world", "4", "--batch-size", "4"],  # 4 heads: tp 4 chosen
        "tp1_dp2_b1_accum2": ["--tp", "1", "--dp", "2", "--batch-size", "1", "--grad-accum", "2"],
    }
    # A held-out 25% of the conversations, its first 3 global batches evaluated after steps 3 and 6:
    # the same eval loss on every mesh (the token mean over those rows).
    held_out = ["--eval-split", "0.25", "--eval-every", "3", "--eval-batches", "3", "--seq-len", "31"]
    curves, evals = {}, {}
    for name, flags in runs.items():
        out = tmp_path / name
        proc = hf_tp_train(
            "--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out), *COMMON, *held_out, *flags
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        if name.startswith("auto"):  # --layout auto picks, prints and runs (no --gpu: the largest valid tp)
            assert "--layout auto on 4 ranks (no --gpu: nothing predicted): tp 4 x dp 1" in proc.stdout
            assert "runner-up: tp 2 x dp 2" in proc.stdout and "launching 4 ranks = tp 4 x dp 1" in proc.stdout
        evals[name] = {r["step"]: r["eval_loss"] for r in metrics(out) if r.get("split") == "eval"}
        rows = [r for r in metrics(out) if r.get("split") != "eval"]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert {"loss", "grad_norm", "lr", "tokens", "tokens_per_sec"} <= rows[0].keys()
        assert all(r["target_tokens"] < r["tokens"] for r in rows)  # assistant-only: prompts are no targets
        assert (out / "config.yaml").exists()
        curves[name] = rows
    want_loss, want_norm, want_eval = reference_run(
        str(model_dir),
        str(data),
        seq_len=31,
        global_batch=4,
        steps=STEPS,
        lr=3e-3,
        warmup_steps=2,
        eval_split=0.25,
        eval_steps=(3, STEPS),
        eval_rows=12,
    )
    assert want_loss[-1] < want_loss[0]
    for name, got_eval in evals.items():
        assert got_eval.keys() == want_eval.keys(), name
        for step, w in want_eval.items():
            assert abs(got_eval[step] - w) <= 1e-5 * abs(w), f"{name} eval after step {step}: {got_eval[step]} vs {w}"
    for name, rows in curves.items():
        got = [r["loss"] for r in rows]
        for step, (g, w) in enumerate(zip(got, want_loss, strict=True)):
            assert abs(g - w) <= 1e-5 * abs(w), f"{name} step {step + 1}: loss {g} vs plain HF {w}"
        for step, (g, w) in enumerate(zip([r["grad_norm"] for r in rows], want_norm, strict=True)):
            assert abs(g - w) <= 1e-4 * abs(w), f"{name} step {step + 1}: grad norm {g} vs plain HF {w}"


def cli_in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``hf-tp ARGS`` run by the CLI's own ``main`` in this process, for what fails before any rank
    starts (a launch would cost a new interpreter's imports and prove nothing more)."""
    from hf_tp.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["hf-tp", *args], code, out, err)


def test_bad_tp_fails_before_launch(setup, tmp_path, capsys) -> None:
    model_dir, data = setup
    out = tmp_path / "out"
    proc = cli_in_process(
        capsys, "train", "--model", str(model_dir), "--dataset", str(data), "--tp", "3", "--output-dir", str(out)
    )
    assert proc.returncode == 2
    assert "tp must divide num_attention_heads (4) of this qwen2 model, got tp=3" in proc.stderr
    assert not out.exists()


def test_nan_loss_stops_naming_the_step(setup, tmp_path) -> None:
    model_dir, data = setup
    out = tmp_path / "nan"
    proc = hf_tp_train(
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--output-dir",
        str(out),
        "--tp",
        "1",
        "--dp",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "15",
        "--max-steps",
        "6",
        "--lr",
        "1e30",
        "--warmup-steps",
        "0",
        "--max-grad-norm",
        "0",
        "--no-tensorboard",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert __import__("re").search(
        r"error \[rank 0\]: loss is (nan|inf) .* at step [2-6]: stopping before", proc.stderr
    )


def test_in_place_under_torchrun_every_rank_reports_an_empty_dataset(setup, tmp_path) -> None:
    """Run under torchrun (WORLD_SIZE set): no relaunch, and a data error on rank 0 reaches every
    rank instead of leaving them waiting in a collective."""
    model_dir, _ = setup
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "hf_tp.train",
        "--model",
        str(model_dir),
        "--dataset",
        str(empty),
        "--tp",
        "2",
        "--dp",
        "1",
        "--seq-len",
        "15",
        "--output-dir",
        str(tmp_path / "out"),
        "--no-tensorboard",
    ]
    proc = run_killing_group(cmd, env, 120)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"hf-tp train: error [rank {rank}]:" in proc.stderr, proc.stderr[-3000:]
    assert "is empty" in proc.stderr


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "columns.jsonl",
            '{"content": "a b c"}\n',
            r"hf-tp train: error: text column 'text' not in dataset '.*columns\.jsonl'; its columns are: content; "
            r"pass --text-column \(documents\) or --messages-column \(conversations\), or use prompt/completion \(or prompt/chosen/rejected\) columns",
        ),
        ("empty.txt", "", r"hf-tp train: error: dataset '.*empty\.txt' is empty"),
    ],
)
def test_dataset_errors_are_one_line_before_any_rank_starts(setup, tmp_path, capsys, name, content, message) -> None:
    model_dir, _ = setup
    data = tmp_path / name
    data.write_text(content)
    out = tmp_path / "out"
    proc = cli_in_process(
        capsys, "train", "--model", str(model_dir), "--dataset", str(data), "--tp", "2", "--dp", "1", "--seq-len", "15",
        "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert __import__("re").fullmatch(message, proc.stderr.strip()), proc.stderr
    assert "launching" not in proc.stdout and not out.exists()  # no rank started


def test_an_error_inside_the_ranks_is_printed_once_last_with_exit_2(setup, tmp_path) -> None:
    """Too few tokens for one block shows only once the ranks tokenize the corpus (its 60 bytes
    pass the check before launch, which bounds a batch of one row by bytes; the tokenizer makes
    under 64 tokens of them): the launching process prints the first rank's error once, as its
    last line, without torch elastic's report."""
    model_dir, _ = setup
    data = tmp_path / "short.txt"
    data.write_text("word " * 12)
    out = tmp_path / "out"
    proc = hf_tp_train(
        "--model", str(model_dir), "--dataset", str(data), "--tp", "2", "--dp", "1", "--seq-len", "64",
        "--batch-size", "1", "--output-dir", str(out), "--no-tensorboard",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == (
        f"hf-tp train: launching 2 ranks = tp 2 x dp 1 (1 node) on CPU, gloo, fp32; global batch 1 sequence "
        f"(1 per rank x dp 1) = 64 tokens per step, 1000 steps -> {out}"
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert __import__("re").fullmatch(
        r"hf-tp train: error \[rank \d\]: dataset '.*short\.txt' has only \d+ tokens, fewer than one block of "
        r"seq_len=64; lower --seq-len or add data",
        last,
    ), proc.stderr
    assert proc.stderr.count("fewer than one block") == 1
    for noise in ("Traceback", "ChildFailedError", "closing signal", "exitcode"):
        assert noise not in proc.stderr, proc.stderr


def test_the_readme_sequence_train_then_export_works(tmp_path, monkeypatch, capsys) -> None:
    """Issue 51 case 9: after the embedded default (no --model/--dataset: one rank here, to stay
    small), README's next command ``hf-tp export outputs/run exported/`` finds a checkpoint."""
    from hf_tp.cli.main import main

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "train", "--tp", "1", "--dp", "1", "--max-steps", "2"]
    proc = subprocess.run(
        cmd + ["--no-tensorboard"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "outputs" / "run" / "checkpoints" / "step-2" / "COMPLETE").is_file()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["export", "outputs/run", "exported/"]) == 0, capsys.readouterr().err
    assert (tmp_path / "exported" / "model.safetensors").is_file()
