"""Ranks started from a notebook: accelerate's notebook_launcher on CPU/gloo (run twice in one process), and
examples/notebooks/hf_tp_quickstart.ipynb executed top to bottom with nbclient."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import run_killing_group

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "notebooks" / "hf_tp_quickstart.ipynb"
WORKER = Path(__file__).with_name("notebook_launcher_worker.py")
pytestmark = pytest.mark.e2e
# Set by launchers; a test process started under one must not pass them on.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def assets_root(tmp_path_factory) -> Path:
    """The embedded default built once for this module (also the notebook's ``HF_TP_CACHE``)."""
    from hf_tp.demo.assets import ensure_default_assets

    root = tmp_path_factory.mktemp("hf_tp_cache")
    ensure_default_assets(root)
    return root


def test_launcher_twice_in_one_process(assets_root: Path, tmp_path: Path) -> None:
    """notebook_launcher starts 2 real CPU processes; two runs (with a failing launch between
    them) give the same losses and text, and leave the parent process clean."""
    cmd = [sys.executable, str(WORKER), "--out", str(tmp_path), "--assets", str(assets_root)]
    proc = run_killing_group(cmd, clean_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    parent = json.loads((tmp_path / "parent.json").read_text())
    ranks = {
        (run, rank): json.loads((tmp_path / f"run{run}-rank{rank}.json").read_text())
        for run in (0, 1)
        for rank in (0, 1)
    }

    assert parent["failure"] == "ChildFailedError"  # the failing launch raised in the parent instead of hanging
    pids = {r["pid"] for r in ranks.values()}
    assert len(pids) == 4 and parent["pid"] not in pids  # 2 fresh processes per run
    for (run, rank), r in ranks.items():
        assert r["world_size"] == 2 and r["rank"] == rank
        assert r["pg_left"] is True, (run, rank)  # the function joined the group and left it
    for state in parent["runs"]:  # the notebook's own process after each launch
        assert not state["pg_initialized"] and state["children"] == 0 and state["changed_env"] == [], state

    want = ranks[(0, 0)]
    assert want["losses"][-1] < want["losses"][0]
    for key, r in ranks.items():
        assert r["losses"] == want["losses"], f"run/rank {key}: {r['losses']} vs {want['losses']}"
        assert r["after"] == want["after"], key
        # Before training the parallel greedy output equals plain HF's on the same weights.
        assert r["before"] == parent["runs"][key[0]]["plain_greedy"], key
    assert want["after"] != want["before"]  # training changed the model


def test_notebook_is_stored_executed_with_public_api_only() -> None:
    """The stored notebook is the executed example (scripts/execute_notebook.py): every code cell
    ran, in order, and its outputs name no path of the machine that ran it."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    text = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
    assert "greedy text of the reloaded export == parallel model's: True" in text
    assert not re.search(r"/(tmp|work|root|home|Users)/", text), re.findall(
        r"\S*/(?:tmp|work|root|home|Users)/\S*", text
    )
    source = "\n".join("".join(c["source"]) for c in code)
    assert not re.search(r"(from|import) hf_tp\.", source)  # public names only, as the README shows
    assert "hf_tp.shutdown()" in source and "destroy_process_group" not in source
    # The real-model cell must stay off by default (CI has no GPU and no Hub access).
    assert "USE_QWEN = False" in source


def test_quickstart_notebook_runs_top_to_bottom(assets_root: Path, tmp_path: Path, monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    # A kernel spec for this interpreter, so no other python3 kernel on the machine is picked up.
    spec = tmp_path / "jupyter" / "kernels" / "hf-tp-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "hf_tp test", "language": "python"}))
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    env = clean_env(HF_TP_CACHE=str(assets_root), JUPYTER_PATH=str(tmp_path / "jupyter"))
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")  # hf_tp.fit's tokenized corpus
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment

    work = tmp_path / "work"  # the notebook writes only under its working directory
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="hf-tp-test", resources={"metadata": {"path": str(work)}}
    )
    client.execute()  # raises CellExecutionError naming the cell if any cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "greedy text of the reloaded export == parallel model's: True" in text, text[-3000:]
    out = work / "hf_tp_quickstart_out"
    assert (out / "export" / "model.safetensors").is_file()
    assert (out / "fit" / "export" / "model.safetensors").is_file()
    assert len((out / "fit" / "metrics.jsonl").read_text().splitlines()) > 0
