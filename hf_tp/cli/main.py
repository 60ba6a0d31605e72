"""``hf-tp``: one module per subcommand, dispatched by a table."""

from __future__ import annotations

import argparse
import sys

from hf_tp.cli import estimate, export, train

# name -> (module with add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "train": (train, "train a model (launches tp*dp ranks)"),
    "export": (export, "checkpoint -> HF safetensors folder (+ Hub push)"),
    "estimate": (estimate, "per-rank memory and communication of a run, simulated on CPU"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-tp", description="TP+SP x FSDP2 training of HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    return SUBCOMMANDS[args.command][0].run(args)


if __name__ == "__main__":
    sys.exit(main())
