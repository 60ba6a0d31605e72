"""Running a function as a model's own ``forward`` for one call, the model left as it was.

The fused loss (:func:`hf_tp.parallel.linear_ce.causal_lm_loss`), the per-sequence log-probs
(:mod:`hf_tp.parallel.logps`) and the loop's router-count pass (:mod:`hf_tp.run.loss`) run the
decoder and score its hidden states without the vocabulary logits, yet the hooks on the root
module (FSDP2's: gather its parameters, move the inputs to the device; context parallelism's)
must run as in a normal call. ``nn.Module.__call__`` runs them around ``self.forward``, so the
function is that for the duration of one call: an instance attribute, removed after (a forward
the model already had on the instance is put back). Nothing stays on the model, so the record
(:mod:`hf_tp.core.record`) lists none of these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def call_as_forward(model: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` with ``forward`` as its forward: the module's hooks run around it.
    The tensors go through the call (FSDP2's root hook moves its inputs and expects at least one)."""
    own = vars(model).get("forward")  # (a user's or another caller's instance forward, else None)
    model.forward = forward
    try:
        return model(*args, **kwargs)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
