"""README.md's example commands, as a new user would type them (issue 51 case 11).

Every ``hf-tp`` line of README.md's ```bash blocks (the install line and the test command aside)
runs in one fresh interpreter (imports paid once) in a scratch folder, offline (``HF_HUB_OFFLINE=1``
and an empty Hub cache): a command that needs the Hub stops at its first refusal, one line naming
the model or dataset it could not reach, never a traceback or a hang (a time limit per command).
The offline ones run for real up to where they would start work: ``hf-tp train`` to the launch
(its checks all passed), ``hf-tp estimate`` to the simulation (the model resolved, the layout
checked); the launch and the simulation themselves are stubbed, so the whole file takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_BLOCKS = ("pip install", "pytest")  # the install line, the test command
PLACEHOLDER = " ... "  # `hf-tp train ... --export-on-finish`: a flag shown with the rest elided
PER_COMMAND_S = 120

# Runs each argv through hf_tp's own main with the launch and the simulation replaced; prints one
# JSON result per command: its exit code, stderr, and how far it got.
DRIVER = r"""
import contextlib, io, json, signal, sys, traceback

import hf_tp.cli.train as cli_train
import hf_tp.estimate.sweep as sweep
from hf_tp.cli.main import main

class Reached(BaseException):
    pass

class TimedOut(BaseException):
    pass

def reached(what):
    def stub(*args, **kwargs):
        raise Reached(what)
    return stub

cli_train._started = reached("launch")
sweep.sweep = sweep.estimate_candidate = reached("simulation")

def alarm(signum, frame):
    raise TimedOut()

signal.signal(signal.SIGALRM, alarm)
for argv in json.loads(sys.stdin.read()):
    err, out, result = io.StringIO(), io.StringIO(), {"argv": argv, "reached": None}
    signal.alarm(int(sys.argv[1]))
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            result["code"] = main(argv)
    except Reached as exc:
        result["code"], result["reached"] = 0, str(exc)
    except TimedOut:
        result["code"] = "timeout"
    except SystemExit as exc:
        result["code"] = exc.code
    except BaseException:
        result["code"], result["traceback"] = "raised", traceback.format_exc()
    finally:
        signal.alarm(0)
    result["stderr"], result["stdout"] = err.getvalue(), out.getvalue()[-2000:]
    print(json.dumps(result), flush=True)
"""


def readme_commands() -> list[str]:
    """The ``hf-tp`` lines of README.md's bash blocks, comments dropped, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = []
    for block in blocks:
        if any(word in block for word in SKIPPED_BLOCKS):
            continue
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                assert line.startswith("hf-tp "), f"README shows a command this test does not know: {line!r}"
                lines.append(line)
    return lines


def argvs(line: str) -> list[list[str]]:
    """The argv(s) a README line stands for: ``[--flag x]`` optional parts left out, then all given;
    none for a line with elided flags."""
    if PLACEHOLDER in line:
        return []
    bare = re.sub(r"\s*\[[^\]]*\]", "", line)
    full = line.replace("[", "").replace("]", "")
    return [shlex.split(text)[1:] for text in dict.fromkeys([bare, full])]


def hub_names(argv: list[str]) -> list[str]:
    """The Hub ids the command must reach (``--model`` / ``--dataset`` values of owner/name form;
    ``hf-tp estimate`` reads a bundled model's config offline)."""
    from hf_tp.core.model_source import bundled_models

    pairs = zip(argv, argv[1:], strict=False)
    names = [v for flag, v in pairs if flag in ("--model", "--dataset") and re.fullmatch(r"[\w.-]+/[\w.-]+", v)]
    return [n for n in names if argv[0] != "estimate" or n not in bundled_models().values()]


def write_inputs(cwd: Path) -> None:
    """The local files the README's commands name: corpus.jsonl, chats.jsonl, configs/."""
    words = " ".join(f"word{i % 97}" for i in range(4000))
    (cwd / "corpus.jsonl").write_text("".join(json.dumps({"text": f"{i} {words}"}) + "\n" for i in range(64)))
    chat = [{"role": "user", "content": "hello?"}, {"role": "assistant", "content": "hello."}]
    (cwd / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(100)))
    shutil.copytree(ROOT / "configs", cwd / "configs")


def run_all(commands: list[list[str]], cwd: Path) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(cwd / "hf_home"))
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(PER_COMMAND_S)],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=PER_COMMAND_S * len(commands) + 60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    cwd = tmp_path_factory.mktemp("readme")
    write_inputs(cwd)
    commands = [argv for line in readme_commands() for argv in argvs(line)] + [["--help"]]
    return {shlex.join(r["argv"]): r for r in run_all(commands, cwd)}


def test_readme_lists_the_commands_this_test_runs() -> None:
    lines = readme_commands()
    assert any(line.startswith("hf-tp train") for line in lines) and any("estimate" in line for line in lines)
    assert any(hub_names(shlex.split(line)) for line in lines), "no Hub command left to check"


def test_every_readme_command_answers_offline(results: dict[str, dict]) -> None:
    """Each command ends in its expected place: ``--help`` and the offline ones reach their work
    (the launch, the simulation), a Hub one stops with one line naming what it could not reach,
    a missing run with one line naming it; never a traceback or a hang."""
    assert results, "no command ran"
    for text, r in results.items():
        err = [ln for ln in r["stderr"].splitlines() if ln.strip() and not ln.startswith("hf-tp: warning:")]
        assert r["code"] not in ("timeout", "raised"), f"{text}: {r['code']}\n{r.get('traceback', r['stderr'])}"
        assert "Traceback" not in r["stderr"], f"{text}:\n{r['stderr']}"
        argv, names = r["argv"], hub_names(r["argv"])
        if argv == ["--help"]:
            assert r["code"] == 0 and "train" in r["stdout"], text
        elif names:
            assert r["code"] == 2 and len(err) == 1, f"{text}: not one line:\n{r['stderr']}"
            assert err[0].startswith(f"hf-tp {argv[0]}: error: "), f"{text}: {err[0]}"
            assert any(f"'{name}'" in err[0] for name in names), f"{text}: names none of {names}: {err[0]}"
        elif argv[0] == "export":  # the run it names was not trained here
            assert r["code"] == 2 and len(err) == 1 and "outputs/run does not exist" in err[0], f"{text}: {err}"
        else:  # offline: the embedded default, bundled model configs
            expected = "simulation" if argv[0] == "estimate" else "launch"
            assert r["reached"] == expected, f"{text}: stopped before the {expected} ({r['code']}):\n{r['stderr']}"
