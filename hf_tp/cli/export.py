"""``hf-tp export``: a DCP checkpoint -> a plain HF model folder (and optionally the Hub)."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  hf-tp export outputs/run exported/        # the newest complete checkpoint of a run
  hf-tp export outputs/run/checkpoints/step-100 exported/ --dtype bf16 --push-to-hub me/my-model --private

A run has checkpoints when it was trained with --save-every N or --export-on-finish."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="OUTPUT_DIR of a run (its newest checkpoint) or OUTPUT_DIR/checkpoints/step-N")
    p.add_argument("out_dir", help="where to write the HF folder (safetensors, config, tokenizer, model card)")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the exported weights (default: the base model's dtype, fp32 where it was not recorded)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file (also about the export's peak host memory); bigger models get several and an index",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write full weights with the adapters merged in (default: adapter)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in out_dir (a folder holding .hf_tp_export.json); other folders are never deleted",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="a run trained with --trust-remote-code: run the model's own Python code saved in the checkpoint "
        "(default: off, such a checkpoint is refused)",
    )
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload the folder to this Hub repo")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")


def run(args: argparse.Namespace) -> int:
    from hf_tp.checkpoint.hf_folder import export_checkpoint
    from hf_tp.checkpoint.hub import push_to_hub

    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            dtype=args.dtype,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            merge=args.merge,
            trust_remote_code=args.trust_remote_code,
        )
    except ValueError as exc:
        print(f"hf-tp export: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a permission: the half-built folder is gone, out_dir as it was
        print(f"hf-tp export: error: {write_failed(exc, args.out_dir)}", file=sys.stderr)
        return 1
    print(f"hf-tp export: wrote {out}")
    if args.push_to_hub:
        try:
            url = push_to_hub(out, args.push_to_hub, private=args.private)
        except (RuntimeError, ValueError) as exc:
            print(f"hf-tp export: error: {exc}", file=sys.stderr)
            return 1
        print(f"hf-tp export: pushed to {url}")
    return 0


def write_failed(exc: OSError, out_dir: str) -> str:
    """One line for an ``OSError`` during an export: what the system said, and that ``out_dir`` is unchanged."""
    where = f": {exc.filename}" if exc.filename else ""
    return (
        f"export to {out_dir} failed ({exc.strerror or exc}{where}); the half-built folder was removed and "
        f"{out_dir} is as it was: free some space or fix the permission, or pass another dir"
    )
