"""`hf-tp train`'s flags, generated from TrainConfig's fields: the public flags kept, each parsed as
before, and docs/training.md's flag table the one the parser generates."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from hf_tp.cli.train import build_parser, config_from_args
from hf_tp.cli.train_flags import add_field_flags, documented_flags, flags_markdown
from hf_tp.core.setting import flags_of, setting
from hf_tp.run.config import GROUPS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]

# The flags of `hf-tp train` by group, as the hand-written parser had them before the flags were
# generated (2026-11-26). A flag added on purpose goes here too; one that disappears is a break.
PUBLIC_FLAGS = {
    "model and data": (
        "--config", "--model", "--trust-remote-code", "--dataset", "--dataset-config", "--split", "--text-column",
        "--messages-column", "--prompt-column", "--chosen-column", "--rejected-column", "--tools-column",
        "--assistant-only-loss", "--no-assistant-only-loss", "--seq-len", "--pack", "--no-pack",
        "--streaming", "--skip-bad-rows", "--no-document-masking", "--train-vision-tower",
    ),
    "held-out evaluation": ("--eval-dataset", "--eval-dataset-split", "--eval-split", "--eval-every", "--eval-batches"),
    "objective (preference training: docs/post-training.md)": (
        "--objective", "--beta", "--label-smoothing", "--simpo-gamma", "--precompute-ref",
    ),
    "sizes and optimizer": (
        "--tp", "--dp", "--ep", "--cp", "--dp-replicate", "--layout", "--gpu", "--world", "--batch-size", "--grad-accum", "--max-steps", "--lr",
        "--warmup-steps", "--weight-decay", "--max-grad-norm", "--aux-loss-over", "--seed", "--lora-r",
        "--lora-alpha", "--lora-dropout", "--lora-target-modules",
    ),
    "pipeline parallelism (docs/training.md)": ("--pp", "--pp-schedule", "--microbatches", "--pp-virtual-stages"),
    "output and checkpoints": (
        "--output-dir", "--overwrite", "--log-every", "--save-every", "--keep-checkpoints", "--collective-timeout",
        "--resume", "--export-on-finish",
    ),
    "speed, precision and parallelism": (
        "--activation-checkpointing", "--compile", "--dtype", "--device", "--no-sequence-parallel",
        "--no-loss-parallel", "--profile-steps", "--report-to", "--no-tensorboard",
    ),
    "launch (several nodes)": ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--verbose"),
}  # fmt: skip


def flags_by_group(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    out = {}
    for group in parser._action_groups:
        options = tuple(
            o for a in group._group_actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings
        )
        if options:
            out[group.title] = options
    return out


def test_every_public_flag_is_kept_in_its_group() -> None:
    got = flags_by_group(build_parser())
    for title, options in PUBLIC_FLAGS.items():
        missing = sorted(set(options) - set(got.get(title, ())))
        assert not missing, f"hf-tp train lost {missing} from group {title!r}"
    added = {t: sorted(set(o) - set(PUBLIC_FLAGS.get(t, ()))) for t, o in got.items()}
    assert not any(added.values()), f"new flags: {added}; add them to PUBLIC_FLAGS"
    assert got == PUBLIC_FLAGS  # the order of --help too


def test_fields_are_the_groups_in_order_and_each_declares_its_flags() -> None:
    assert [f.name for f in fields(TrainConfig)] == [f.name for g in GROUPS for f in fields(g)]
    dests = {a.dest for a in build_parser()._actions}
    for f in fields(TrainConfig):
        spec = flags_of(f)
        assert f.name in dests or spec.names is None, f"{f.name}: no flag and not marked YAML-only"


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], {}),
        (["--tp", "2", "--lr", "1e-3", "--eval-split", "0.1"], dict(tp=2, lr=1e-3, eval_split=0.1)),
        (["--lora-alpha", "16", "--master-port", "29500"], dict(lora_alpha=16.0, master_port=29500)),
        (["--no-pack", "--no-document-masking"], dict(pack=False, document_masking=False)),
        (["--no-sequence-parallel", "--no-loss-parallel"], dict(sequence_parallel=False, loss_parallel=False)),
        (["--assistant-only-loss"], dict(assistant_only_loss=True)),
        (["--no-assistant-only-loss"], dict(assistant_only_loss=False)),
        (["--no-tensorboard"], dict(report_to="none")),
        (["--report-to", "wandb"], dict(report_to="wandb")),
        (["--resume", "--overwrite", "--compile", "--streaming"], dict(resume=True, overwrite=True, compile=True, streaming=True)),
        (["--dtype", "bf16", "--objective", "dpo", "--aux-loss-over", "micro-batch"], dict(dtype="bf16", objective="dpo", aux_loss_over="micro-batch")),
        (["--profile-steps", "10-12", "--split", "train[:5%]"], dict(profile_steps="10-12", split="train[:5%]")),
    ],
)  # fmt: skip
def test_flags_parse_as_before(argv: list[str], expected: dict) -> None:
    args = build_parser().parse_args(argv)
    typed = {k: v for k, v in vars(args).items() if v is not None and k in TrainConfig.field_names()}
    assert typed == expected  # an untyped flag stays None: it must not override the YAML file
    assert {k: type(v) for k, v in typed.items()} == {k: type(v) for k, v in expected.items()}
    assert dataclasses.asdict(config_from_args(args)) == dataclasses.asdict(
        dataclasses.replace(TrainConfig(), **expected)
    )


@pytest.mark.parametrize("argv", [["--dtype", "fp16"], ["--tp", "two"], ["--lr", "x"], ["--objective", "ppo"]])
def test_bad_values_are_refused_by_the_parser(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


def test_a_new_setting_is_one_field() -> None:
    """A field declared with ``setting`` is a flag: type from the annotation, default in the help."""

    @dataclass
    class Pipeline:
        pp: int = setting(1, "pipeline stages", metavar="N")
        interleave: bool = setting(True, no_help="one stage per rank")
        silent: bool = setting(False)

    p = argparse.ArgumentParser()
    f_pp, f_interleave, f_silent = fields(Pipeline)
    add_field_flags(p, f_pp, (int,))
    add_field_flags(p, f_interleave, (bool,))
    action = next(a for a in p._actions if a.dest == "pp")
    assert (action.option_strings, action.type, action.metavar, action.help) == (
        ["--pp"],
        int,
        "N",
        "pipeline stages (default 1)",
    )
    assert vars(p.parse_args(["--pp", "4", "--no-interleave"])) == {"pp": 4, "interleave": False}
    with pytest.raises(TypeError, match="silent has no help text"):
        add_field_flags(p, f_silent, (bool,))


def test_docs_list_every_flag_as_the_parser_prints_it() -> None:
    parser = build_parser()
    doc = documented_flags((ROOT / "docs" / "training.md").read_text())
    cells = [line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `")]
    rows = [name.split(" ")[0] for cell in cells for name in cell.split(", ")]  # "--a X, --b X": aliases
    flags = [o for options in flags_by_group(parser).values() for o in options]
    assert sorted(set(flags) - set(rows)) == [], "flags missing from docs/training.md"
    assert sorted(set(rows) - set(flags)) == [], "docs/training.md documents flags hf-tp train does not have"
    assert doc == flags_markdown(parser).strip("\n"), "docs/training.md is stale: python scripts/train_flags_doc.py"


def test_saved_config_reads_back(tmp_path: Path) -> None:
    """config.yaml (every setting by its key) is a valid --config file giving the same run."""
    cfg = TrainConfig(model="m", tp=2, lr=1e-3, pack=False, report_to="none", min_lr_ratio=0.2)
    cfg.save(tmp_path / "config.yaml")
    assert TrainConfig(**TrainConfig.from_yaml(tmp_path / "config.yaml")) == cfg
