"""The standing bad-input table: every input `hf-tp train` / `hf-tp export` must refuse or warn
about, run through the CLI's own ``main`` in this process.

Each row gives the command, the exit code and the one line it must print (its last stderr line,
matched whole). For every row the table also checks that no rank was started (the launcher is
replaced by one that fails the test) and that nothing in the shared world (the model folder, the
data, a run with checkpoints, an unrelated folder) changed by a single byte.

What needs running ranks lives with the launches: an error raised inside the ranks
(tests/e2e/test_train_cli.py), stop signals, hung and killed ranks (tests/e2e/test_faults.py),
damaged checkpoints on resume (tests/e2e/test_checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_tp.cli.main import main
from tests.image_data import image_rows, llava_processor, save_tiny_llava, write_images, write_jsonl


@dataclass(frozen=True)
class World:
    """The files every row may read and none may change."""

    root: Path
    model: Path  # a whole model folder: config, safetensors weights, tokenizer
    data: Path  # a text corpus
    run: Path  # a finished run: config.yaml, metrics.jsonl, checkpoints/step-2 (whole)
    other: Path  # an unrelated non-empty folder of the user's
    llava: Path  # a tiny multimodal model folder with its processor (tests/image_data.py)


@dataclass(frozen=True)
class Row:
    id: str
    argv: Callable[[World, Path], list[str]]  # (world, this row's scratch dir) -> hf-tp arguments
    line: str  # regex the last stderr line must match whole
    code: int = 2
    warning: bool = False  # the line is a warning and the command goes on to launch
    env: dict[str, str] = field(default_factory=dict)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (dirs too) with a hash of its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def build_run(run: Path, model: Path, data: Path) -> None:
    """A run dir as `hf-tp train --save-every 2 --max-steps 2` leaves it, written in this process:
    the model's weights as a DCP checkpoint with hf_tp's trainer state (its run fingerprint), size
    manifest and marker."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tp.checkpoint.checkpoint_dirs import MARKER
    from hf_tp.checkpoint.integrity import write_manifest
    from hf_tp.run.config import TrainConfig
    from hf_tp.run.validate import run_fingerprint

    cfg = TrainConfig(
        model=str(model), dataset=str(data), output_dir=str(run), max_steps=2, save_every=2, seq_len=32
    ).resolve()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ckpt = run / "checkpoints" / "step-2"
    dcp.save({"model": dict(hf.state_dict())}, checkpoint_id=str(ckpt), no_dist=True)
    hf.config.save_pretrained(ckpt / "model_files")
    AutoTokenizer.from_pretrained(model).save_pretrained(ckpt / "model_files")
    state = {"step": 2, "fingerprint": run_fingerprint(cfg, hf.config), "config": cfg.to_dict(), "scheduler": {}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt)
    (ckpt / MARKER).write_text("step 2\n")
    cfg.save(run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.9}\n')


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from hf_tp.demo.assets import ensure_default_assets

    root = tmp_path_factory.mktemp("world")
    assets = ensure_default_assets(root / "assets")
    w = World(root, assets.model_dir, assets.data_file, root / "run", root / "other", root / "llava")
    build_run(w.run, w.model, w.data)
    save_tiny_llava(w.llava, llava_processor())
    w.other.mkdir()
    (w.other / "notes.txt").write_text("the user's own file\n")
    return w


def train(*flags: str) -> Callable[[World, Path], list[str]]:
    """`hf-tp train` on the world's model and data, writing to the row's scratch dir unless the
    flags name another --output-dir; ``{model}``, ``{data}``, ``{run}``, ``{other}``, ``{tmp}`` in
    flags are filled in."""

    def argv(w: World, tmp: Path) -> list[str]:
        names = dict(model=w.model, data=w.data, run=w.run, other=w.other, tmp=tmp, llava=w.llava)
        filled = [f.format(**names) for f in flags]
        base = ["train", "--model", str(w.model), "--dataset", str(w.data), "--seq-len", "32"]
        if "--output-dir" not in filled:
            base += ["--output-dir", str(tmp / "out")]
        return base + filled

    return argv


def command(*words: str) -> Callable[[World, Path], list[str]]:
    def argv(w: World, tmp: Path) -> list[str]:
        names = dict(model=w.model, data=w.data, run=w.run, other=w.other, tmp=tmp)
        return [word.format(**names) for word in words]

    return argv


def with_file(name: str, content: bytes | str, then: Callable[[World, Path], list[str]]):
    """Write ``tmp/name`` first (a data file, a YAML config), then build the argv."""

    def argv(w: World, tmp: Path) -> list[str]:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return then(w, tmp)

    return argv


def with_model(change: Callable[[Path], None], *flags: str) -> Callable[[World, Path], list[str]]:
    """A copy of the world's model folder, changed (weights removed, truncated, ...), trained on."""

    def argv(w: World, tmp: Path) -> list[str]:
        model = tmp / "model"
        shutil.copytree(w.model, model)
        change(model)
        return train("--model", str(model), *flags)(w, tmp)[:]

    return argv


def with_images(change: Callable[[list[dict]], list[dict]], *flags: str, model: str = "{llava}"):
    """`hf-tp train` on ``tmp/images.jsonl`` (image + text rows, two PNGs and a damaged one beside
    them), its rows changed by ``change``, with the world's LLaVA unless ``model`` names another."""

    def argv(w: World, tmp: Path) -> list[str]:
        names = write_images(tmp, 2)
        (tmp / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot a png")
        data = write_jsonl(tmp / "images.jsonl", change(image_rows(names, counts=(1, 1, 1, 1))))
        return train("--model", model, "--dataset", str(data), "--seq-len", "48", *flags)(w, tmp)

    return argv


def rewrite_weights(change: Callable[[dict], dict]) -> Callable[[Path], None]:
    """A model folder change: its model.safetensors rewritten with ``change(tensors)``."""

    def apply(model: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = model / "model.safetensors"
        save_file(change(load_file(path)), path, metadata={"format": "pt"})

    return apply


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


E = r"hf-tp train: error: "
X = r"hf-tp export: error: "
V = r"hf-tp verify: error: "
LIVE_LOCK = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "2026-01-01T00:00:00Z"})
OTHER_HOST_LOCK = json.dumps({"host": "node-7", "pid": 4242, "since": "2026-01-01T00:00:00Z"})
ROWS = [
    # --- sizes and numbers (these passed before; kept standing)
    Row("tp-against-heads", train("--tp", "3"), E + r"tp must divide num_attention_heads \(4\) .*"),
    Row(
        "world-not-divisible-by-nodes",
        train("--tp", "2", "--dp", "1", "--nnodes", "3"),
        E + r".*cannot be split evenly over --nnodes 3",
    ),
    # --- HSDP (--dp-replicate R: dp = R replicas x the FSDP shard group)
    Row(
        "dp-replicate-not-dividing-dp",
        train("--tp", "1", "--dp", "4", "--dp-replicate", "3"),
        E + r"--dp-replicate must divide --dp \(4\): dp = replicas x the FSDP shard group, got 3",
    ),
    Row("dp-replicate-zero", train("--dp-replicate", "0"), E + r"--dp-replicate must be a positive integer, got 0"),
    Row(
        "dp-replicate-with-cp",
        train("--tp", "1", "--dp", "2", "--cp", "2", "--dp-replicate", "2"),
        E + r"--dp-replicate does not combine with --cp yet: drop one of them",
    ),
    Row(
        "layout-auto-with-pp",
        train("--layout", "auto", "--world", "4", "--pp", "2"),
        E + r"--layout auto chooses --pp and --dp-replicate itself \(with --gpu, across nodes\): drop --pp "
        r"\(or drop --layout auto\)",
    ),
    Row(
        "compile-with-recompute-under-tp",
        train("--tp", "2", "--dp", "1", "--compile", "--activation-checkpointing"),
        E + r"compile with activation checkpointing fails under tensor parallelism in this torch .*: drop --compile "
        r"or --activation-checkpointing",
    ),
    Row("lr-negative", train("--lr", "-1"), E + r"--lr must be positive, got -1\.0"),
    Row("lr-nan", train("--lr", "nan"), E + r"--lr must be a finite number, got nan"),
    # finding 6: --lr inf was accepted and trained to NaN at step 2
    Row("lr-inf", train("--lr", "inf"), E + r"--lr must be a finite number, got inf"),
    Row("weight-decay-inf", train("--weight-decay", "inf"), E + r"--weight-decay must be a finite number, got inf"),
    # --- YAML config (finding 2: PyYAML reads 1e-3 as a string; every numeric field had the hole)
    Row(
        "yaml-1e-3-is-a-number",
        with_file(
            "c.yaml", "lr: 1e-3\nwarmup_steps: 1E1\nmax_steps: 3e4\n", train("--config", "{tmp}/c.yaml", "--tp", "3")
        ),
        E + r"tp must divide num_attention_heads \(4\) .*",  # got past the config: the numbers parsed
    ),
    Row(
        "yaml-word-for-int",
        with_file("c.yaml", "tp: two\n", train("--config", "{tmp}/c.yaml")),
        E + r"config file .*c\.yaml: tp must be an integer, got 'two'",
    ),
    Row(
        "yaml-fraction-for-int",
        with_file("c.yaml", "max_steps: 2.5\n", train("--config", "{tmp}/c.yaml")),
        E + r"config file .*: max_steps must be an integer, got 2\.5",
    ),
    Row(
        "yaml-bool-for-number",
        with_file("c.yaml", "lr: yes\n", train("--config", "{tmp}/c.yaml")),
        E + r"config file .*: lr must be a number, got True",
    ),
    Row(
        "yaml-unknown-key",
        with_file("c.yaml", "batchsize: 4\n", train("--config", "{tmp}/c.yaml")),
        E + r"unknown settings in .*: batchsize; valid: .*",
    ),
    Row(
        "yaml-not-yaml",
        with_file("c.yaml", "lr: [1\n", train("--config", "{tmp}/c.yaml")),
        E + r"config file .*c\.yaml is not valid YAML.*",
    ),
    Row("yaml-missing", train("--config", "{tmp}/nope.yaml"), E + r"config file not found: .*nope\.yaml"),
    # --- output directory (finding 4: tracebacks after "launching 4 ranks")
    Row(
        "output-dir-is-a-file",
        with_file("f", "x", train("--output-dir", "{tmp}/f")),
        E + r"--output-dir .*/f is a file, not a directory; pass a directory path",
    ),
    Row(
        "output-dir-under-a-file",
        with_file("f", "x", train("--output-dir", "{tmp}/f/run")),
        E
        + r"--output-dir .*/f/run cannot be created or written: .*/f is a file, not a directory; pass a directory you can write",
    ),
    Row(
        "output-dir-under-proc",
        train("--output-dir", "/proc/hf_tp_run"),
        E
        + r"--output-dir /proc/hf_tp_run cannot be created or written: /proc does not take new folders \(.*\); pass a directory you can write",
    ),
    Row(
        "output-dir-holds-a-run",
        train("--output-dir", "{run}"),
        E + r"output dir .*/run already holds a run \(metrics\.jsonl, config\.yaml, checkpoints\); pass --resume .*",
    ),
    Row(
        "resume-and-overwrite",
        train("--output-dir", "{run}", "--resume", "--overwrite"),
        E + r"pass --resume \(continue .*\) or --overwrite \(.*\), not both",
    ),
    # finding 5: a refused --resume rewrote the run's config.yaml (and was caught only after launch)
    Row(
        "resume-other-global-batch",
        train("--output-dir", "{run}", "--resume", "--batch-size", "3"),
        E
        + r"cannot resume from .*/run/checkpoints/step-2: it was saved with global_batch=1 but this run has global_batch=3; .*",
    ),
    Row(
        "resume-other-seq-len",
        train("--output-dir", "{run}", "--resume", "--seq-len", "16"),
        E + r"cannot resume from .*step-2: it was saved with seq_len=32 but this run has seq_len=16; .*",
    ),
    # --- data (empty, bad rows, wrong columns: kept standing)
    Row(
        "data-missing",
        train("--dataset", "{tmp}/nope.jsonl"),
        E + r"dataset not found: no file or directory at '.*nope\.jsonl'",
    ),
    Row("data-empty", with_file("d.txt", "", train("--dataset", "{tmp}/d.txt")), E + r"dataset '.*d\.txt' is empty"),
    Row(
        "data-wrong-column",
        with_file("d.jsonl", '{"content": "a b c"}\n', train("--dataset", "{tmp}/d.jsonl")),
        E + r"text column 'text' not in dataset .*; its columns are: content; .*",
    ),
    # --- the model folder (finding 3: tracebacks from inside the ranks, or a dependency guess)
    Row(
        "model-without-weights",
        with_model(lambda m: (m / "model.safetensors").unlink()),
        E + r"model folder '.*/model' has no weights \(no model\.safetensors, .*\); copy the weight files into it .*",
    ),
    Row(
        "model-truncated-weights",
        with_model(lambda m: truncate(m / "model.safetensors", 20000)),
        E
        + r"model folder '.*' has damaged weights: model\.safetensors is truncated \(20000 of \d+ bytes\); copy or download it again",
    ),
    Row(
        "model-only-config",
        with_model(lambda m: [p.unlink() for p in m.iterdir() if p.name != "config.json"]),
        E + r"model folder '.*' has no weights .*",
    ),
    Row(
        "model-without-tokenizer",
        with_model(
            lambda m: [
                p.unlink()
                for p in m.iterdir()
                if "token" in p.name or p.suffix in (".model", ".txt") or p.name == "vocab.json"
            ]
        ),
        E + r"model folder '.*' has no tokenizer files \(.*\); copy the tokenizer's files into it .*",
    ),
    Row(
        "model-missing-absolute-path",
        train("--model", "/nonexistent/hf_tp/model"),
        E + r"model not found: no file or directory at '/nonexistent/hf_tp/model'",
    ),
    Row(
        "model-missing-bare-name",
        train("--model", "no_such_model_dir_hf_tp"),
        E
        + r"model not found: there is no directory 'no_such_model_dir_hf_tp' in .*, and no (Hub )?model 'no_such_model_dir_hf_tp' .*",
    ),
    # finding 6: a Latin-1 file was told to run iconv -f utf-8 -t utf-8 -c (which deletes accents),
    # rows were counted from 0 while editors count lines from 1, a blank .txt passed until the ranks
    Row(
        "data-latin-1",
        with_file(
            "d.jsonl", '{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"), train("--dataset", "{tmp}/d.jsonl")
        ),
        E
        + r"dataset '.*d\.jsonl': line 2 of .*d\.jsonl is not UTF-8 \(byte 0xe9, 'é' in Latin-1\); it looks like Latin-1 / Windows-1252: convert it with iconv -f latin1 -t utf-8 .*",
    ),
    Row(
        "data-bad-json-line-3",
        with_file("d.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "cut\n', train("--dataset", "{tmp}/d.jsonl")),
        E + r"cannot read dataset '.*d\.jsonl' as json files \(line 3 of .*d\.jsonl is not valid JSON .*",
    ),
    Row(
        "data-wrong-type-line-2",
        with_file("d.jsonl", '{"text": "a"}\n{"text": 5}\n', train("--dataset", "{tmp}/d.jsonl")),
        E + r"line 2 of .*d\.jsonl: column 'text' holds int 5, not a string; fix it, or pass --skip-bad-rows .*",
    ),
    Row(
        "data-blank-txt",
        with_file("d.txt", "\n\n  \n", train("--dataset", "{tmp}/d.txt")),
        E + r"dataset '.*d\.txt' is empty",
    ),
    Row(
        "train-vision-tower-on-a-text-model",
        train("--train-vision-tower"),
        E
        + r"--train-vision-tower needs a multimodal checkpoint; this llama model has no vision tower \(leave the flag out\)",
    ),
    # --- optional packages the flags name (finding 6: --lora-r without peft failed inside the ranks)
    Row(
        "lora-without-peft",
        train("--lora-r", "4"),
        E + r"--lora-r needs the peft package: pip install 'hf_tp\[lora\]' \(or pip install peft\)",
        env={"no_peft": "1"},
    ),
    # --- warnings: the command goes on (finding 6: --cp 3 on two cores started 12 ranks silently)
    Row(
        "ranks-outnumber-cores",
        train("--tp", "1", "--dp", "1", "--cp", "3", "--dp", "4"),
        r"hf-tp train: warning: 12 ranks share \d+ CPU cores?; they take turns, .*",
        code=0,
        warning=True,
    ),
    Row(
        "export-on-finish-over-a-foreign-folder",
        with_file("out/export/mine.txt", "x", train("--export-on-finish")),
        E + r"--export-on-finish writes .*/out/export: export dir .* is not an hf_tp export .*",
    ),
    # --- export (finding 1: `hf-tp export RUN RUN --overwrite` deleted the run, exit 0)
    Row(
        "export-run-into-itself",
        command("export", "{run}", "{run}", "--overwrite"),
        X + r"export dir .*/run is the run being exported; nothing was written or deleted: .*",
    ),
    Row(
        "export-into-its-checkpoints",
        command("export", "{run}", "{run}/checkpoints", "--overwrite"),
        X + r"export dir .*/run/checkpoints is the run's checkpoints folder; nothing was written or deleted: .*",
    ),
    Row(
        "export-into-the-checkpoint",
        command("export", "{run}", "{run}/checkpoints/step-2/", "--overwrite"),
        X + r"export dir .*/step-2 is inside the run's checkpoints folder .*; nothing was written or deleted: .*",
    ),
    Row(
        "export-checkpoint-into-its-run",
        command("export", "{run}/checkpoints/step-2", "{run}", "--overwrite"),
        X + r"export dir .*/run is the run being exported; .*",
    ),
    Row(
        "export-into-a-parent",
        command("export", "{run}", "{run}/..", "--overwrite"),
        X + r"export dir .* contains the run being exported .*",
    ),
    Row(
        "export-over-a-users-folder",
        command("export", "{run}", "{other}", "--overwrite"),
        X + r"export dir .*/other is not empty and is not an hf_tp export .*; nothing was deleted: .*",
    ),
    Row(
        "export-to-a-file",
        with_file("f", "x", command("export", "{run}", "{tmp}/f")),
        X + r"export dir .*/f is a file, not a folder; nothing was written: pass a folder path",
    ),
    Row(
        "export-under-proc",
        command("export", "{run}", "/proc/hf_tp_export"),
        X
        + r"export dir /proc/hf_tp_export cannot be created or written: /proc does not take new folders \(.*\); pass a dir you can write",
    ),
    # --- round two (issue 51): nothing lost, nothing silently wrong
    # case 5: a folder without layer 1's tensors trained to the end with that layer random
    Row(
        "model-lacks-a-layer",
        with_model(rewrite_weights(lambda t: {k: v for k, v in t.items() if ".layers.1." not in k})),
        E + r"model folder '.*/model' does not match its config\.json: its safetensors lack 9 weights: "
        r"model\.layers\.1\.self_attn\.q_proj\.weight, .* and 6 more; the model would train with those weights "
        r"random: .*",
    ),
    # case 13: weights of another shape printed two load-report tables from inside the ranks
    Row(
        "model-weight-of-another-shape",
        with_model(
            rewrite_weights(lambda t: t | {"model.layers.0.mlp.up_proj.weight": t["model.norm.weight"].clone()})
        ),
        E + r"model folder '.*' does not match its config\.json: its safetensors hold in another shape 1 weight: "
        r"model\.layers\.0\.mlp\.up_proj\.weight \[64\] \(the model's \[256, 64\]\); .*",
    ),
    Row(
        "model-holds-unexpected-weights",
        with_model(
            rewrite_weights(lambda t: t | {"model.layers.7.mlp.up_proj.weight": t["model.norm.weight"].clone()})
        ),
        E + r"model folder '.*' does not match its config\.json: its safetensors hold unexpected 1 weight: "
        r"model\.layers\.7\.mlp\.up_proj\.weight; .*",
    ),
    # case 1: verify wrote its one-layer random model over a finished run's checkpoint
    Row(
        "verify-over-a-run",
        command("verify", "--model", "{model}", "--device", "cpu", "--output-dir", "{run}"),
        V
        + r"--output-dir .*/run holds files hf-tp verify did not write \(checkpoints, config\.yaml, metrics\.jsonl\); "
        r".*pass a new or empty folder, or leave --output-dir out for a temporary one",
    ),
    # case 2: verify replaced the model folder's weights and config with its random copy
    Row(
        "verify-over-the-model-folder",
        command("verify", "--model", "{model}", "--device", "cpu", "--output-dir", "{model}"),
        V + r"--output-dir .*/model holds files hf-tp verify did not write \(config\.json, .*\); .*",
    ),
    # case 13: verify --output-dir FILE said "hf-tp train: training failed"
    Row(
        "verify-output-dir-is-a-file",
        with_file("f", "x", command("verify", "--model", "{model}", "--device", "cpu", "--output-dir", "{tmp}/f")),
        V + r"--output-dir .*/f is a file, not a directory; pass a new or empty folder",
    ),
    Row(
        "verify-output-dir-empty",
        command("verify", "--model", "{model}", "--device", "cpu", "--output-dir", ""),
        V + r"--output-dir is empty \(''\); pass a folder path, or leave --output-dir out for a temporary folder",
    ),
    # case 7: --output-dir '' wrote the run into the current directory
    Row(
        "output-dir-empty",
        train("--output-dir", ""),
        E + r"--output-dir is empty \(''\); pass a folder path, e\.g\. --output-dir outputs/run .*",
    ),
    # case 3: two runs at once in one folder interleaved their metrics; the second is refused
    Row(
        "output-dir-in-use",
        with_file("out/.hf_tp.lock", LIVE_LOCK, train()),
        E + rf"--output-dir .*/out is in use by another run \(pid {os.getpid()} on this host, since .*\); wait for it "
        r"to end, or pass another --output-dir",
    ),
    Row(
        "output-dir-locked-by-another-host",
        with_file("out/.hf_tp.lock", OTHER_HOST_LOCK, train()),
        E + r"--output-dir .*/out is in use by pid 4242 on host node-7 \(since 2026-01-01T00:00:00Z\); if that run "
        r"has ended, delete .*/out/\.hf_tp\.lock, or pass another --output-dir",
    ),
    # case 6: --batch-size 100000 on a small dataset was OOM-killed after 146 s, no message
    Row(
        "global-batch-over-the-dataset",
        train("--batch-size", "100000"),
        E + r"the global batch \(100000 sequences: --batch-size 100000 x dp 1 x grad-accum 1\) is larger than dataset "
        r"'.*', which holds \d+ rows \(at most \d+ packed sequences of 32 tokens\); lower --batch-size, or add data",
    ),
    # case 14: --seq-len 1 said every label was masked; --eval-split 0.999 a raw datasets message
    Row(
        "seq-len-1",
        train("--seq-len", "1"),
        E + r"--seq-len must be at least 2: the loss predicts each token from the ones before it, and a 1-token "
        r"sequence has none to predict; got 1",
    ),
    Row(
        "eval-split-leaves-no-training-rows",
        with_file("d.txt", "one\ntwo\nthree\n", train("--dataset", "{tmp}/d.txt", "--eval-split", "0.999")),
        E + r"--eval-split 0\.999 holds out 3 of dataset '.*d\.txt''s 3 rows and leaves none for training; lower "
        r"--eval-split \(0\.05 is usual\), or pass --eval-dataset",
    ),
    # case 13: checked only once the ranks ran: more pipeline stages than decoder layers, a port out of range
    Row(
        "pp-over-the-layers",
        train("--pp", "3", "--microbatches", "3", "--batch-size", "3", "--tp", "1", "--dp", "1"),
        E + r"--pp 3: 3 stages but the model has 2 decoder layers: at most one stage per layer; use --pp 2 or less",
    ),
    Row(
        "zbv-over-the-layers",
        train(
            "--pp", "2", "--pp-schedule", "zbv", "--pp-virtual-stages", "2", "--microbatches", "2", "--batch-size", "2"
        ),
        E + r"--pp-schedule zbv places 2 stages per rank: --pp 2 x 2 = 4 stages but the model has 2 decoder layers: "
        r"at most one stage per layer; use --pp-schedule 1f1b or gpipe, or train with --pp 1",
    ),
    Row(
        "dualpipev-over-the-layers",
        train(
            "--pp",
            "2",
            "--pp-schedule",
            "dualpipev",
            "--pp-virtual-stages",
            "2",
            "--microbatches",
            "4",
            "--batch-size",
            "4",
        ),
        E + r"--pp-schedule dualpipev places 2 stages per rank: --pp 2 x 2 = 4 stages but .*",
    ),
    Row(
        "master-port-out-of-range",
        train("--tp", "2", "--dp", "1", "--master-port", "99999"),
        E + r"--master-port must be a port number, 1-65535, got 99999",
    ),
    # case 13: image rows checked only in the ranks (a KeyError, transformers' raw template error, ...)
    Row(
        "image-rows-streaming",
        with_images(lambda rows: rows, "--streaming"),
        E + r"dataset '.*images\.jsonl' holds image \+ text rows \(messages and images columns\), which --streaming "
        r"does not read yet: drop --streaming",
    ),
    Row(
        "image-rows-eval-split",
        with_images(lambda rows: rows, "--eval-split", "0.25"),
        E + r"hf_tp does not evaluate image \+ text data yet: drop --eval-split / --eval-dataset",
    ),
    Row(
        "image-rows-on-a-text-model",
        with_images(lambda rows: rows, model="{model}"),
        E
        + r"dataset '.*' holds image \+ text rows \(messages and images columns\), but this llama model has no vision "
        r"tower: pass a multimodal checkpoint \(e\.g\. a LLaVA or Qwen2-VL model\), or data without an images column",
    ),
    Row(
        "image-placeholder-without-images",
        with_images(
            lambda rows: (
                rows[:2]
                + [{"messages": [{"role": "user", "content": "<image> where?"}, rows[2]["messages"][1]], "images": []}]
            )
        ),
        E + r"line 3 of .*images\.jsonl: message 0 \(user\) writes the image placeholder '<image>' as text; mark each "
        r"image with a \{'type': 'image'\} content part, its file in column 'images'",
    ),
    Row(
        "image-damaged-png-in-the-first-rows",
        with_images(lambda rows: rows[:1] + [dict(rows[1], images=["broken.png"])] + rows[2:]),
        E + r"line 2 of .*images\.jsonl: image 0 \(broken\.png\) cannot be opened \(.*\)",
    ),
    Row(
        "export-missing-run",
        command("export", "{tmp}/nope", "{tmp}/e"),
        X + r".*/nope does not exist \(expected a run's OUTPUT_DIR or OUTPUT_DIR/checkpoints/step-N\)",
    ),
]


@pytest.fixture
def no_launch(monkeypatch):
    """The launcher, replaced: a row that reaches it started ranks (a failure unless it is a
    warning row, which then returns 0 here)."""
    import hf_tp.run.launch as launch

    launched = []
    monkeypatch.setattr(launch, "launch", lambda cfg, **kw: launched.append(cfg) or 0)
    return launched


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, world: World, tmp_path: Path, capsys, monkeypatch, no_launch) -> None:
    if row.env.get("no_peft"):
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    before = snapshot(world.root)
    argv = row.argv(world, tmp_path)
    scratch = snapshot(tmp_path)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == row.code, err[-3000:]
    assert lines, "nothing printed"
    matched = [ln for ln in lines if re.fullmatch(row.line, ln)]
    assert matched, f"no line matches {row.line!r}:\n{err}"
    if row.warning:
        assert len(no_launch) == 1, "a warning must not stop the launch"
    else:
        assert len(lines) == 1, f"more than one line:\n{err}"
        assert not no_launch and "launching" not in out, "ranks were started for an input that decides alone"
    assert snapshot(world.root) == before, "the shared world changed"
    assert snapshot(tmp_path) == scratch, "the command created or changed files"


def test_an_unexpected_failure_is_one_line_naming_its_traceback(
    world: World, tmp_path: Path, capsys, monkeypatch
) -> None:
    """A failure no input predicted (here a KeyError from the loop of a one-rank run): exit 1 and
    one line that names the file holding the traceback, not a Python traceback."""
    import hf_tp.train.loop as loop

    def crash(cfg):
        raise KeyError("model.layers.0.mlp.up_proj.weight")

    monkeypatch.setattr(loop, "train", crash)
    capsys.readouterr()
    code = main(train("--tp", "1", "--dp", "1")(world, tmp_path))
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err, err
    m = re.fullmatch(
        r"hf-tp train: training failed \[rank 0\]: KeyError: 'model\.layers\.0\.mlp\.up_proj\.weight' "
        r"\(traceback in (\S+); --verbose prints it\)",
        err,
    )
    assert m, err
    kept = Path(m.group(1))
    try:
        assert kept.read_text().startswith("Traceback") and "in crash" in kept.read_text()
    finally:
        kept.unlink()
