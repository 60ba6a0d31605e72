"""Everything hf_tp needs to know about the releases it runs on, in one package.

- :mod:`~hf_tp.compat.releases`: the tested range (floors, ceilings, per-family needs) and its
  one-line refusals and warnings; re-exported here (``from hf_tp.compat import FLOORS``).
- The only modules of hf_tp that reach a private (``_``-prefixed) name of torch, transformers,
  peft or the standard library, each behind a small documented function:
  :mod:`~hf_tp.compat.torch_distributed` (meshes, process groups, collectives, DCP),
  :mod:`~hf_tp.compat.torch_fsdp` (FSDP2's state), :mod:`~hf_tp.compat.torch_fake` (fake tensors
  and the estimate's patches), :mod:`~hf_tp.compat.torch_internals` (``nn.Module`` slots, autograd,
  ops), :mod:`~hf_tp.compat.torch_styles` (tensor-parallel style hooks),
  :mod:`~hf_tp.compat.mem_tracker` (``MemTracker``), :mod:`~hf_tp.compat.transformers_private`,
  :mod:`~hf_tp.compat.peft_private` and :mod:`~hf_tp.compat.argparse_private`.
- Every private name those functions reach is registered with :func:`~hf_tp.compat.reaches.reaches`;
  :func:`hf_tp.compat.probes.probes` checks them all on the installed releases and names each one
  that broke, with the release (tests/unit/test_compat_probes.py runs it).
- :data:`~hf_tp.compat.allowed.ALLOWED`: the private names hf_tp may use elsewhere, each with its
  reason (tests/unit/test_private_access.py fails on any other private access outside this package).

Importing this package imports neither torch nor transformers (``hf-tp --help`` imports it).
"""

from hf_tp.compat.releases import (
    CEILINGS,
    EXPERTS,
    FAMILY_RELEASES,
    FLOORS,
    PEFT_CEILING,
    PEFT_FLOOR,
    PLAN,
    NewerRelease,
    UnsupportedRelease,
    below_floor,
    check_releases,
    fake_experts_fallback,
    family_refusal,
    installed,
    moe_estimate_refusal,
    newer_line,
    newer_than_tested,
    series,
    unreported_newer,
    warn_newer_releases,
)

__all__ = [
    "CEILINGS",
    "EXPERTS",
    "FAMILY_RELEASES",
    "FLOORS",
    "PEFT_CEILING",
    "PEFT_FLOOR",
    "PLAN",
    "NewerRelease",
    "UnsupportedRelease",
    "below_floor",
    "check_releases",
    "fake_experts_fallback",
    "family_refusal",
    "installed",
    "moe_estimate_refusal",
    "newer_line",
    "newer_than_tested",
    "series",
    "unreported_newer",
    "warn_newer_releases",
]
