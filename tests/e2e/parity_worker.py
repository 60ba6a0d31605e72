"""One rank of a torchrun parity run: ``python -m torch.distributed.run ... parity_worker.py JSON``,
JSON a list of cases of this world size, checked one after the other in one process group.

Every rank builds the same reference (same seeds), so no weights need to be sent around.
"""

import json
import sys

import torch.distributed as dist

from tests.e2e.rank_exit import end_rank
from tests.parity import ParityCase

dist.init_process_group("gloo")
lines = []
for spec in json.loads(sys.argv[1]):
    case = ParityCase(**spec)
    start, data, want = case.reference()
    case.check(start, data, want)
    lines.append(f"PARITY OK {json.dumps(spec)}")
lines = lines if dist.get_rank() == 0 else []
end_rank(*lines)  # the ranks leave together first: the line means that every rank passed
