"""The objects every tool stands on: where a model comes from (``ModelSource``), the parallel
layout (``ParallelDims``) and what ``parallelize`` will do (``Prepared``). Nothing here imports a
tool (train, plan, estimate, verify, cli)."""
