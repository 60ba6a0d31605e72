"""``hf-tp verify`` over the supported layouts of a dense and a MoE model, on threaded ranks.

``python -m tests.verify_grid`` runs them all (about two minutes on 2 cores) and prints each
report; tests/unit/test_verify.py runs a sample with the same helper, and
tests/e2e/test_verify_cli.py one layout launched as users launch it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

import hf_tp.run.model as train_model
from hf_tp.cli.formatting import subcommand_parser
from hf_tp.cli.verify import add_arguments, config_from_args
from hf_tp.core.model_source import ModelSource
from hf_tp.verify.report import render
from hf_tp.verify.run import verify_rank
from tests.family_grid import grid_config
from tests.helpers import run_threaded, tiny_config

DENSE = (
    ("--tp", "2"),
    ("--tp", "2", "--dp", "2"),
    ("--tp", "1", "--cp", "2"),
    ("--tp", "2", "--cp", "2"),
    ("--tp", "2", "--lora-r", "4"),
)
MOE = ("--tp", "2"), ("--tp", "2", "--dp", "2"), ("--tp", "1", "--dp", "2", "--ep", "2")
_BUILDING = threading.Lock()


@contextlib.contextmanager
def serial_meta_builds() -> Iterator[None]:
    """accelerate's ``init_empty_weights`` patches ``nn.Module.register_parameter`` for the whole
    process while one rank builds its meta model: rank threads must not run anything else then
    (separate processes, as launched, never share it). ``from_pretrained`` (the whole-model load of
    files that need a weight conversion) patches it too: two rank threads in it at once could
    leave the patch installed for the rest of the process (every later tied model untied)."""
    real, real_load = train_model.build_empty, ModelSource.load

    def build_empty(config):
        dist.barrier()
        with _BUILDING:
            model = real(config)
        dist.barrier()
        return model

    def load(source: ModelSource, **kwargs):
        with _BUILDING:
            return real_load(source, **kwargs)

    with (
        mock.patch.object(train_model, "build_empty", build_empty),
        mock.patch.object(ModelSource, "load", load),
    ):
        yield


def model_dir(folder: Path, config) -> str:
    """A folder holding only ``config``'s config.json (what verify needs of a model)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return str(folder)


def verify_threaded(model: str, work: Path, *flags: str) -> tuple[str, int, dict[str, bool]]:
    """(the report, the exit code, check name -> passed) of ``hf-tp verify --model MODEL FLAGS``
    on threaded CPU ranks, two AdamW steps."""
    p = subcommand_parser("hf-tp verify", None, "")
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", model, "--device", "cpu", "--max-steps", "2", *flags]))
    out = {}

    def rank(r: int) -> None:
        out[r] = verify_rank(cfg, work, torch.device("cpu"))

    with serial_meta_builds():
        run_threaded(cfg.world_size, rank)
    about, checks = out[0]
    text, code = render(checks, about)
    return text, code, {c.name.split(" (")[0]: c.ok for c in checks}


def main() -> int:
    models = {"llama": (tiny_config("llama"), DENSE), "qwen3_moe": (grid_config("qwen3_moe", vocab_size=300), MOE)}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, layouts) in models.items():
            for i, flags in enumerate(layouts):
                work = Path(tmp) / f"{name}-{i}"
                text, code, _ = verify_threaded(model_dir(work / "config", config), work, *flags)
                print(f"== {name} {' '.join(flags)}\n{text}\n", flush=True)
                failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
