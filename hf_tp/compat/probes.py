"""Run every compat function's probe on the installed releases: one line per private name that broke.

    python -c "from hf_tp.compat.probes import probes; print(*probes(), sep='\\n')"

A line names the package and its installed release, the name, and the compat functions that
reach it: ``torch 2.15.0: torch.distributed.device_mesh.DeviceMesh._flatten is gone
(hf_tp.compat.torch_distributed.flatten_mesh)``. Supporting a new release is making this list
empty by changing those functions only.
"""

from __future__ import annotations

import importlib
import platform

from hf_tp.compat.reaches import REACHES, Reach, defines, missing
from hf_tp.compat.releases import installed

# the compat modules that reach private names (each registers its names when imported)
MODULES = (
    "argparse_private",
    "mem_tracker",
    "peft_private",
    "torch_distributed",
    "torch_fake",
    "torch_fsdp",
    "torch_internals",
    "torch_styles",
    "transformers_private",
)


def release_of(package: str) -> str:
    """``package`` and its installed release as a line names them (the standard library's: Python's)."""
    if package in ("torch", "transformers", "peft", "accelerate", "datasets"):
        return f"{package} {installed(package) or '(not installed)'}"
    return f"python {platform.python_version()}"


def _broken(reach: Reach) -> str | None:
    """What broke of ``reach`` (a name gone, or its check's finding), or None."""
    gone = missing(reach.path.rpartition(".")[0] if reach.sets else reach.path)
    if gone is not None:
        return gone
    if reach.check is None and not reach.sets:
        return None
    try:
        return defines(reach.path) if reach.sets else reach.check()
    except Exception as exc:  # noqa: BLE001 - a probe that fails is a broken name too
        return f"{reach.dotted} no longer behaves as hf_tp expects ({type(exc).__name__}: {exc})"


def probes(reaches: list[Reach] | None = None) -> list[str]:
    """One line per broken private name of ``reaches`` (default: every compat module's, imported
    here), naming its package's installed release and the compat functions reaching it."""
    if reaches is None:
        for name in MODULES:
            importlib.import_module(f"hf_tp.compat.{name}")
        reaches = REACHES
    found: dict[tuple[str, str], list[str]] = {}  # (package, what broke) -> owners
    for reach in reaches:
        what = _broken(reach)
        if what is not None:
            owners = found.setdefault((reach.package, what), [])
            if reach.owner not in owners:
                owners.append(reach.owner)
    return [f"{release_of(package)}: {what} ({', '.join(owners)})" for (package, what), owners in found.items()]
