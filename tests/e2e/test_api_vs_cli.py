"""``hf-tp train`` (CLI) and ``hf_tp.fit(hf_tp.TrainConfig(...))`` (Python API, ranks started by
torchrun) on the same settings write the same metrics and config. The file is also the torchrun
worker (run as a script: ``torchrun ... test_api_vs_cli.py SETTINGS_JSON``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_train_cli import ROOT, hf_tp_train, metrics, run_killing_group

pytestmark = pytest.mark.e2e
# Everything but the model, dataset and output dir; each key's flag is --key-with-dashes.
SETTINGS = {
    "tp": 2,
    "dp": 1,
    "seq_len": 32,
    "batch_size": 2,
    "max_steps": 4,
    "lr": 3e-3,
    "warmup_steps": 1,
    "report_to": "none",
}
COMPARED = ("step", "loss", "grad_norm", "lr", "tokens")  # not timings or peak memory


def cli_flags(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def test_cli_and_python_api_give_the_same_run(tmp_path: Path) -> None:
    from hf_tp.demo.assets import ensure_default_assets

    assets = ensure_default_assets(tmp_path / "assets")
    common = {"model": str(assets.model_dir), "dataset": str(assets.data_file), **SETTINGS}

    cli_out = tmp_path / "cli"
    proc = hf_tp_train(*cli_flags(common), "--output-dir", str(cli_out))
    assert proc.returncode == 0, proc.stderr[-4000:]

    api_out = tmp_path / "api"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    settings = json.dumps(common | {"output_dir": str(api_out)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, settings]
    proc = run_killing_group(cmd, env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    cli_rows, api_rows = metrics(cli_out), metrics(api_out)
    assert [r["step"] for r in cli_rows] == list(range(1, SETTINGS["max_steps"] + 1))
    for cli_row, api_row in zip(cli_rows, api_rows, strict=True):
        assert {k: cli_row[k] for k in COMPARED} == {k: api_row[k] for k in COMPARED}
    # fit's return value carries the same curve as the metrics file.
    returned = json.loads((api_out / "fit_result.json").read_text())
    assert returned["losses"] == [r["loss"] for r in api_rows]
    assert returned["grad_norms"] == [r["grad_norm"] for r in api_rows]
    # And both runs resolved the settings the same way (config.yaml, output dir aside).
    cli_cfg, api_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (cli_out, api_out))
    assert {k: v for k, v in cli_cfg.items() if k != "output_dir"} == {
        k: v for k, v in api_cfg.items() if k != "output_dir"
    }


def _worker(settings: str) -> None:
    """One torchrun rank: the whole training through the public API."""
    import torch.distributed as dist

    import hf_tp
    from tests.e2e.rank_exit import end_rank

    result = hf_tp.fit(hf_tp.TrainConfig(**json.loads(settings)))
    if dist.get_rank() == 0:
        record = {"losses": result.losses, "grad_norms": result.grad_norms}
        (result.output_dir / "fit_result.json").write_text(json.dumps(record))
    end_rank()


if __name__ == "__main__":
    _worker(sys.argv[1])
