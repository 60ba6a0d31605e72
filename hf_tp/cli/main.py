"""``hf-tp``: one module per subcommand, dispatched by a table."""

from __future__ import annotations

import argparse
import sys

from hf_tp.cli import estimate, export, plan, train, verify
from hf_tp.cli.formatting import HelpFormatter
from hf_tp.compat import below_floor, unreported_newer

# name -> (module with add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "train": (train, "train a model (launches tp*dp ranks)"),
    "export": (export, "checkpoint -> HF safetensors folder (+ Hub push)"),
    "estimate": (estimate, "per-rank memory and communication of a run, simulated on CPU"),
    "plan": (plan, "the TP+SP plan hf_tp derives for a model: styles, shards, collectives"),
    "verify": (verify, "check a layout on these machines against one rank: logits, gradients, steps, checkpoints"),
}


EPILOG = """examples:
  hf-tp train                        # the embedded tiny Llama on CPU: 4 ranks, about a minute
  hf-tp estimate --model qwen2-0.5b --tp 2 --dp 8 --seq-len 2048 --batch-size 1
  hf-tp export outputs/run exported/
  hf-tp plan --model llama-3.1-8b --tp 8     # what each module becomes, and the collectives per layer
  hf-tp verify --model llama-3.1-8b --tp 2   # the layout checked on these ranks against one rank

hf-tp SUBCOMMAND --help lists every flag with its default."""


def build_parser() -> argparse.ArgumentParser:
    """The whole ``hf-tp`` parser (building it imports neither torch nor transformers)."""
    parser = argparse.ArgumentParser(
        prog="hf-tp",
        description="TP+SP x FSDP2 training of HF causal LMs",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(
            sub.add_parser(
                name,
                help=help_text,
                description=getattr(module, "DESCRIPTION", module.__doc__).replace("``", ""),
                epilog=module.EPILOG,
                formatter_class=HelpFormatter,
            )
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C at any time (the first seconds import torch and transformers) ends with one line."""
    try:
        args = build_parser().parse_args(argv)
        if lines := below_floor():  # a release older than CI's compat run proves: one line each, nothing built
            print("\n".join(f"hf-tp: {line}" for line in lines), file=sys.stderr)
            return 2
        for line in unreported_newer():  # newer than CI proves: one warning each, and the run goes on
            print(f"hf-tp: warning: {line}", file=sys.stderr)
        return SUBCOMMANDS[args.command][0].run(args)
    except KeyboardInterrupt:
        print("hf-tp: stopped by Ctrl-C (SIGINT)", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
