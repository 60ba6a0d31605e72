"""Loss parallelism on vocab-sharded logits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

_lock = threading.Lock()
_depth = 0
_active: contextlib.AbstractContextManager | None = None


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross entropy directly on vocab-sharded DTensor logits (no logits all-gather).

    Put both the forward (``model(..., labels=...)`` or ``F.cross_entropy``) and
    ``loss.backward()`` inside it::

        with hf_tp.loss_parallel():
            loss = model(input_ids, labels=labels, use_cache=False).loss
            loss.backward()

    It wraps ``torch.distributed.tensor.parallel.loss_parallel``. That one installs handlers in a
    process-global table and removes them on exit, so nested or concurrent uses (threads, e.g.
    the in-process test process group) would remove them under each other; this one is
    reference-counted: the first entry installs, the last exit removes.
    """
    global _depth, _active
    with _lock:
        if _depth == 0:
            _active = _torch_loss_parallel()
            _active.__enter__()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _active is not None:
                _active.__exit__(None, None, None)
                _active = None


def local_loss_function(loss_function: Callable) -> Callable:
    """``loss_function`` returning a plain tensor where it returns a replicated DTensor: a MoE
    model's HF forward adds its plain aux loss to the LM loss, and DTensor cannot take a plain
    tensor's gradient in that sum's backward. Each rank's local loss is the whole loss."""

    def local(*args, **kwargs):
        loss = loss_function(*args, **kwargs)
        # (cloned: HF adds the aux loss in place, which autograd forbids on the view to_local returns)
        return loss.to_local(grad_placements=[Replicate()]).clone() if isinstance(loss, DTensor) else loss

    return local
