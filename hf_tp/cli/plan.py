"""``hf-tp plan``: the TP+SP plan hf_tp derives for a model, per decoder-layer kind and the top level.

Each module's style and shard shapes, the share of weights tp splits, why a part runs whole, and
the collectives per layer with their sizes. Offline: the model is built on the meta device from
its config (a bundled name, a local folder or config.json, or a Hub id in the cache), no weights.
"""

from __future__ import annotations

import argparse
import json
import sys

from hf_tp.cli.formatting import add_dims_flags, add_model_flag, subcommand_parser

EPILOG = """examples:
  hf-tp plan --model llama-3.1-8b --tp 8
  hf-tp plan --model qwen3-30b-a3b --tp 4 --ep 8 --seq-len 4096
  hf-tp plan --model ./my-model --tp 2 --cp 2 --seq-len 32768
  hf-tp plan --model Qwen/Qwen2-0.5B --tp 2 --json

Sizes are per forward and backward of one row of --seq-len tokens at the model's dtype, padded as
hf-tp train pads rows; all-to-all sizes assume even routing over the experts."""


DEFAULT_SEQ_LEN = 2048
# plan's own default for --tp, and why (the flags are ParallelDims' fields: hf_tp.core.dims)
DIMS_DEFAULTS = {"tp": (2, "a plan shows how tp splits the model, and tp 1 splits nothing")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    add_dims_flags(p, ("tp", "ep", "cp"), DIMS_DEFAULTS)
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per row, for the collectives' sizes (default: {DEFAULT_SEQ_LEN}, or the model's "
        "max_position_embeddings where that is less)",
    )
    p.add_argument("--json", action="store_true", help="print the plan record as JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    from hf_tp.plan import format_plan, plan_for

    try:
        model, seq_len, name = args.model, args.seq_len, None
        if seq_len is None:  # a length the model takes: a flag the user never gave must not refuse it
            from hf_tp.core.model_source import ModelSource

            source = ModelSource.for_shapes(args.model)
            model, name = source.config, source.name
            text = getattr(model, "text_config", None) or model
            seq_len = min(DEFAULT_SEQ_LEN, getattr(text, "max_position_embeddings", None) or DEFAULT_SEQ_LEN)
        plan = plan_for(model, tp=args.tp, ep=args.ep, cp=args.cp, seq_len=seq_len, name=name)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"hf-tp plan: error: {first}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan), end="" if not args.json else "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = subcommand_parser("hf-tp plan", __doc__, EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
