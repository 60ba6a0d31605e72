"""`hf-tp` itself: help a user can work from, and a start that imports no training stack."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_tp.cli.main import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "datasets")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_flag_has_help_with_its_default_and_examples(name: str) -> None:
    parser = subparsers()[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = " ".join(formatter._format_action(action).split())
        assert action.help, f"hf-tp {name} {action.dest}: no help text"
        if action.option_strings:
            assert "default" in text or "(required)" in text, f"hf-tp {name}: {text}"
    help_text = parser.format_help()
    assert help_text.count(f"hf-tp {name} ") >= 3  # usage + at least two examples in the epilog
    assert "examples:" in help_text


def test_train_help_states_the_real_defaults() -> None:
    text = " ".join(subparsers()["train"].format_help().split())
    assert "tokens per sequence (default 2048; 64 for the embedded default)" in text
    assert "(default 1; 2 for the embedded default)" in text  # --tp
    assert "(default outputs/run)" in text and "(default 0.1)" in text
    assert "default: the embedded tiny Llama" in text and "default: the embedded generated toy corpus" in text


def test_parser_and_argument_errors_import_no_training_stack() -> None:
    """Building the parser, printing help and rejecting bad arguments (a bad number, an export
    path that does not exist) load none of torch, transformers or datasets (each costs seconds)."""
    script = f"""
import contextlib, io, json, sys
import hf_tp
from hf_tp.cli.main import build_parser, main
build_parser().format_help()
codes = []
for argv in (
    ["train", "--help"], ["estimate", "--help"], ["train", "--tp", "x"], ["train", "--tp", "0"],
    ["export", "/no/such/run", "/no/such/out"],
):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as exc:
            codes.append(exc.code)
print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"codes": [0, 0, 2, 2, 2], "heavy": []}


def test_help_starts_in_about_a_second() -> None:
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "--help"]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=60)  # warm the file cache
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0 and "hf-tp SUBCOMMAND --help" in out.stdout
    assert elapsed < 3.0, f"hf-tp --help took {elapsed:.1f} s"


def test_public_names_resolve_lazily() -> None:
    import hf_tp
    import hf_tp.data
    import hf_tp.estimate

    for module in (hf_tp, hf_tp.data, hf_tp.estimate):
        for name in module.__all__:
            assert getattr(module, name) is not None, name
    assert hf_tp.fit.__name__ == "train" and hf_tp.export.__name__ == "export_checkpoint"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_tp.nope  # noqa: B018
