"""``hf-tp verify``: check a layout (tp, dp, cp, ep, LoRA) of a model on these machines against
a single-rank reference on the same ranks, one line per check, exit 0 when every check passes.

A random copy of the model's config, cut to one layer of each kind at small widths, is trained a
few AdamW steps by plain HF on one rank and by the layout built as ``hf-tp train`` builds it
(ranks launched as train launches them: gloo on CPU, NCCL on GPUs). Compared: logits, loss,
every gradient, the gradient norm, buffers (rotary tables), the weights after the steps, a
checkpoint resumed on another mesh of the same ranks, and the export loaded by plain HF.
Offline: the config comes from a local folder, the Hub cache or a bundled name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import typing
from pathlib import Path

from hf_tp.cli.formatting import add_dims_flags, add_model_flag, subcommand_parser

EPILOG = """examples:
  hf-tp verify --model llama-3.1-8b --tp 2                  # 2 ranks: GPUs if visible, else CPU
  hf-tp verify --model qwen3-30b-a3b --tp 1 --dp 2 --ep 2      # a MoE under expert parallelism
  hf-tp verify --model ./my-model --tp 2 --cp 2 --lora-r 8

Exit code: 0 every check passed, 1 a check failed, 2 the model or layout was refused. The weights
are random and the model small: it checks the layout's arithmetic, not a trained model's quality."""

# The flags verify shares with hf-tp train: generated from TrainConfig's fields (help, names, choices
# and defaults in one place: hf_tp/run/settings_run.py), each meaning what it means for a training run.
TRAIN_FLAGS = (
    "ep",
    "cp",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "seed",
    "device",
    "sequence_parallel",
    "loss_parallel",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
)
# tp and dp: ParallelDims' fields (hf_tp.core.dims) with verify's own defaults, --tp's explained.
DIMS = ("tp", "dp")
DIMS_DEFAULTS = {"tp": (2, "verify checks a split against one rank, and tp 1 splits nothing")}
# verify's own (their defaults or meaning differ from train's): the model as estimate resolves it,
# and the short run it compares
OWN = ("model", "max_steps", "lr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hf_tp.cli.train_flags import add_field_flags
    from hf_tp.core.setting import value_types
    from hf_tp.run.config import TrainConfig

    add_model_flag(p)
    p.add_argument("--seq-len", type=int, default=32, help="tokens per row (rounded up to what the layout needs)")
    p.add_argument("--max-steps", type=int, default=3, help="AdamW steps compared")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument(
        "--output-dir",
        help="folder for the model, checkpoint and export: new, empty or made by verify before (default: a "
        "temporary one, removed after)",
    )
    p.add_argument("--verbose", action="store_true", help="the launcher's own output and every rank's error")
    shared = p.add_argument_group("layout, LoRA and launch: as hf-tp train takes them")
    add_dims_flags(shared, DIMS, DIMS_DEFAULTS)
    hints = typing.get_type_hints(TrainConfig)
    by_name = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in TRAIN_FLAGS:
        add_field_flags(shared, by_name[name], value_types(hints[name]))


def config_from_args(args: argparse.Namespace):
    """The run as a TrainConfig (verify launches and builds as train does); rows padded as train pads them.
    A shared flag not given takes its TrainConfig default."""
    from hf_tp.run.config import TrainConfig

    fields = {k: getattr(args, k) for k in (*OWN, *DIMS, *TRAIN_FLAGS) if getattr(args, k) is not None}
    cfg = TrainConfig(**fields, output_dir=args.output_dir or "", dtype="fp32", report_to="none")
    multiple = cfg.row_multiple
    seq_len = -(-args.seq_len // multiple) * multiple if multiple > 0 else args.seq_len
    return dataclasses.replace(cfg, seq_len=seq_len)


def checked(cfg) -> str:
    """The checks before launch (the numbers, peft, devices, the model's config against the layout,
    the plan); returns the device type. Raises ``ValueError`` naming what is refused."""
    from hf_tp.adapters.shrink import cut_config
    from hf_tp.core.model_source import ModelSource
    from hf_tp.plan import plan_for
    from hf_tp.run.validate import check_devices, check_packages, device_type

    cfg.resolve().validate()
    if cfg.nnodes > 1 and not cfg.output_dir:
        raise ValueError(
            "on several nodes give --output-dir: a folder every node sees (the model and checkpoint go there)"
        )
    check_packages(cfg)
    kind = device_type(cfg)
    check_devices(cfg, kind)
    config = ModelSource.for_shapes(cfg.model).config
    if getattr(config, "text_config", None) is not None:
        raise ValueError(
            f"hf-tp verify checks causal LMs; {cfg.model} is a multimodal wrapper: verify its language model "
            "(a folder holding its text_config as config.json)"
        )
    plan_for(cut_config(config, cfg.tp, cfg.seq_len), tp=cfg.tp, ep=cfg.ep, cp=cfg.cp, seq_len=cfg.seq_len)
    return kind


def run(args: argparse.Namespace) -> int:
    from hf_tp.run.launch import launch
    from hf_tp.verify.folder import check_work_dir
    from hf_tp.verify.injected_faults import requested

    try:
        check_work_dir(args.output_dir)  # never a run or a model folder of the user's
        cfg = config_from_args(args)
        checked(cfg)
        requested()
    except ValueError as exc:
        print(f"hf-tp verify: error: {(str(exc).splitlines() or [''])[0]}", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ or cfg.world_size == 1:  # under torchrun, or one rank: run here
        return _in_place(cfg)
    with tempfile.TemporaryDirectory(prefix="hf_tp-verify-result-") as folder:
        from hf_tp.verify.rank import RESULT_ENV

        result = Path(folder) / "code"
        os.environ[RESULT_ENV] = str(result)
        try:
            code = launch(cfg, verbose=args.verbose, module="hf_tp.verify")
        finally:
            os.environ.pop(RESULT_ENV, None)
        return int(result.read_text()) if code == 0 and result.is_file() else code


def _in_place(cfg) -> int:
    from hf_tp.run.distributed import shutdown
    from hf_tp.verify.rank import rank_main

    code = rank_main(cfg)
    shutdown()
    return code


def _launched(cfg) -> int:
    """A launched rank: the verdict goes to the launching process through the result file, so a
    rank whose checks failed still ends as a success (the launcher would report it as a crash)."""
    from hf_tp.run.distributed import shutdown
    from hf_tp.verify.rank import rank_main

    rank_main(cfg)
    shutdown()
    return 0


def rank_entry(argv: list[str]) -> int:
    """``python -m hf_tp.verify --config FILE`` on a launched rank (the file: the launch's TrainConfig)."""
    from hf_tp.run.config import TrainConfig, merge
    from hf_tp.run.errors import run_reporting_crashes

    p = argparse.ArgumentParser(prog="python -m hf_tp.verify")
    p.add_argument("--config", required=True)
    path = p.parse_args(argv).config
    code = run_reporting_crashes(lambda: _launched(merge(TrainConfig(), TrainConfig.from_yaml(path))))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    p = subcommand_parser("hf-tp verify", __doc__, EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
