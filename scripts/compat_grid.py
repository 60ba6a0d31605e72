"""One column of docs/compatibility.md: every family of the installed transformers at tp=2.

For each causal-LM family with a tensor-parallel plan (and those hf_tp writes one for), the family
grid's parity run (tests/family_grid.py: logits, loss, every gradient, AdamW weights, greedy
tokens against plain HF) gives "parity" or the refusal; for those at parity, the share of the
tiny model's decoder-layer parameters that tp=2 shards (the rest runs whole on every rank). Prints one line per
family (``model_type<TAB>status<TAB>sharded %<TAB>reason``) and the releases it ran on.

    OMP_NUM_THREADS=1 python scripts/compat_grid.py [LATEST.tsv] > /tmp/grid-$(python -c 'import transformers as t; print(t.__version__)').tsv

With the TSV of a later release, the families of that column this release also has are run too,
plan or not (so a family this release cannot serve shows as refused, not as absent).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sharded_share(model_type: str) -> float:
    """Fraction of the tiny grid model's decoder-layer parameter elements that tp=2 shards
    (:func:`hf_tp.parallel.tp.sharded_share`; the embedding and lm_head are left out: at the grid's
    sizes they would dominate the count)."""
    import hf_tp
    from hf_tp.parallel.tp import sharded_share as share_of
    from tests.family_grid import grid_config, grid_model
    from tests.helpers import clone, run_threaded

    ref = grid_model(grid_config(model_type))
    models = [clone(ref) for _ in range(2)]
    layers = hf_tp.get_adapter(ref.config).layers_path
    share = {}

    def rank_fn(rank: int) -> None:
        hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        share[rank] = share_of(models[rank], layers)

    run_threaded(2, rank_fn)
    return share[0]


def main() -> int:
    import torch
    import transformers

    from hf_tp.adapters.census import tensor_parallel_causal_lm_types
    from hf_tp.adapters.support import MOE
    from tests.family_grid import run_family

    families = set(tensor_parallel_causal_lm_types()) | {mt for mt in MOE if mt in transformers.CONFIG_MAPPING}
    for column in sys.argv[1:]:  # another release's TSV: its families this release has too (with or without a plan)
        listed = [line.split("\t")[0] for line in Path(column).read_text().splitlines() if not line.startswith("#")]
        families |= {mt for mt in listed if mt in transformers.CONFIG_MAPPING}
    families = sorted(families)
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}")
    for mt in families:
        t0 = time.perf_counter()
        try:
            result = run_family(mt)
            status, reason = result.status, result.reason
        except Exception as exc:  # noqa: BLE001 - a defect: recorded as a crash, the grid goes on
            status, reason = "crash", f"{type(exc).__name__}: {exc}"
        try:
            share = f"{100 * sharded_share(mt):.0f}" if status == "parity" else ""
        except Exception as exc:  # noqa: BLE001 - the share is a note; the grid goes on
            share = f"? ({type(exc).__name__})"
        reason = reason.split("; register")[0].split(". Add an adapter")[0].replace("\n", " ")[:200]
        print(f"{mt}\t{status}\t{share}\t{reason}", flush=True)
        print(f"{mt:22s} {status:8s} {time.perf_counter() - t0:5.1f}s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
