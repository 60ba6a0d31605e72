"""The ``_``-prefixed names hf_tp may use outside :mod:`hf_tp.compat`, each with its reason.

tests/unit/test_private_access.py reads every module of hf_tp but this package and fails on a
private access (``x._name``, ``getattr(x, "_name")``, ``x.__dict__``, an import of a ``_`` module
or name of torch / transformers / peft / accelerate / datasets) unless the name is hf_tp's own (defined
on an hf_tp class or ``self`` outside this package, and not inherited from one of theirs) or is
listed here. A name belongs here only where its owner documents it (or it is the one extension
point it offers); anything else goes behind a function of :mod:`hf_tp.compat` with a probe.
"""

from __future__ import annotations

ALLOWED: dict[str, str] = {
    "_apply": (
        "torch.distributed.tensor.parallel.ParallelStyle's one abstract method: a custom style implements "
        "_apply(module, device_mesh), which parallelize_module calls (torch's documented extension point)"
    ),
    "_attn_implementation": (
        "transformers documents config._attn_implementation as the attention kernel a model runs "
        "(read, and set to a registered AttentionInterface name, as its attention docs do)"
    ),
    "_can_record_outputs": (
        "transformers' documented class attribute naming the module classes whose outputs a model "
        "records (hidden states, attentions, router logits) for output_* flags"
    ),
    "_keys_to_ignore_on_save": (
        "a documented PreTrainedModel class attribute: the state-dict keys save_pretrained leaves out"
    ),
    "_name_or_path": (
        "PretrainedConfig keeps name_or_path (its documented argument and property) in this attribute, "
        "and config.json saves it under this key"
    ),
    "_base": "torch's Tensor Views documentation names view._base as the tensor a view was made from",
    "_exit": "os._exit is the documented way to end a process at once (no cleanup handlers)",
}
