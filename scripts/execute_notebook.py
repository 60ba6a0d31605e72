"""Run examples/notebooks/hf_tp_quickstart.ipynb top to bottom with this interpreter and store it
with its outputs (the README calls it the executed example).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/execute_notebook.py

It runs in a temporary working directory (the notebook writes ``hf_tp_quickstart_out/`` there) on
the default cache (``~/.cache/hf_tp``), and prints paths relative to those, so the stored outputs
name no path of this machine. Cell timestamps are dropped and the kernel spec is the generic one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "hf_tp_quickstart.ipynb"
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hf_tp-notebook-") as tmp:
        spec = Path(tmp) / "jupyter" / "kernels" / "hf-tp"
        spec.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "hf_tp", "language": "python"}))
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
        os.environ.update(
            JUPYTER_PATH=str(Path(tmp) / "jupyter"),
            JUPYTER_RUNTIME_DIR=str(Path(tmp) / "runtime"),
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        work = Path(tmp) / "work"
        work.mkdir()
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="hf-tp", resources={"metadata": {"path": str(work)}}
        )
        client.execute()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, NOTEBOOK)
    print(f"executed and saved {NOTEBOOK}")


if __name__ == "__main__":
    main()
