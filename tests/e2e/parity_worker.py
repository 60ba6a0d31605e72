"""One rank of a torchrun parity run: ``python -m torch.distributed.run ... parity_worker.py JSON``.

Every rank builds the same reference (same seeds), so no weights need to be sent around.
"""

import json
import sys

import torch.distributed as dist

from tests.e2e.rank_exit import end_rank
from tests.parity import ParityCase

dist.init_process_group("gloo")
case = ParityCase(**json.loads(sys.argv[1]))
start, data, want = case.reference()
case.check(start, data, want)
lines = [f"PARITY OK {sys.argv[1]}"] if dist.get_rank() == 0 else []
end_rank(*lines)  # the ranks leave together first: the line means that every rank passed
