"""``hf-tp``: one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from hf_tp.cli import estimate, export, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-tp", description="TP+SP x FSDP2 training of HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_arguments(sub.add_parser("train", help="train a model (launches tp*dp ranks)"))
    export.add_arguments(sub.add_parser("export", help="checkpoint -> HF safetensors folder (+ Hub push)"))
    estimate.add_arguments(
        sub.add_parser("estimate", help="per-rank memory and communication of a run, simulated on CPU")
    )
    args = parser.parse_args(argv)
    if args.command == "train":
        return train.run(args)
    if args.command == "export":
        return export.run(args)
    if args.command == "estimate":
        return estimate.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
