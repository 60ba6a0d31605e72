"""One rank of a torchrun pipeline parity grid: ``python -m torch.distributed.run ... pipeline_worker.py
JSON``, JSON a list of :class:`tests.pipeline_case.PipelineCase` settings of this world size, checked one
after the other in one process group (every rank builds the same reference from the same seeds)."""

import json
import sys

import torch.distributed as dist

from tests.e2e.rank_exit import end_rank
from tests.pipeline_case import PipelineCase

dist.init_process_group("gloo")
lines = []
for spec in json.loads(sys.argv[1]):
    loss, weights, held_out = PipelineCase(**spec).check()
    lines.append(
        f"PIPELINE OK {json.dumps(spec)} max rel loss diff {loss:.2e}, weights {weights:.2e} of their update, "
        f"held-out loss {held_out:.2e}"
    )
lines = lines if dist.get_rank() == 0 else []
end_rank(*lines)
