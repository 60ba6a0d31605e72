"""The probes of hf_tp/compat/: none broke on the installed releases, a broken name makes exactly one
line naming its package, release and compat function, and every private name a compat function
reaches is one its probe checks."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from hf_tp.compat import installed
from hf_tp.compat.probes import MODULES, probes
from hf_tp.compat.reaches import REACHES, Reach

COMPAT = Path(__file__).resolve().parents[2] / "hf_tp" / "compat"


def test_no_probe_broke_on_the_installed_releases() -> None:
    assert probes() == []


def test_a_missing_name_yields_exactly_one_line(monkeypatch) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    monkeypatch.delattr(DeviceMesh, "_flatten")
    assert probes() == [
        f"torch {installed('torch')}: torch.distributed.device_mesh.DeviceMesh._flatten is gone "
        "(hf_tp.compat.torch_distributed.flatten_mesh)"
    ]


def test_a_broken_behaviour_and_a_name_two_functions_reach() -> None:
    reaches = [
        Reach("torch.nn:Module", "hf_tp.compat.example.one", check=lambda: "Module no longer does X"),
        Reach("torch.nn:Module._gone_for_good", "hf_tp.compat.example.two"),
        Reach("transformers:PreTrainedModel._gone_for_good", "hf_tp.compat.example.three"),
        Reach("torch.nn:Module._gone_for_good", "hf_tp.compat.example.three"),
        Reach("argparse:_no_such_class", "hf_tp.compat.example.four"),
    ]
    torch, transformers = f"torch {installed('torch')}", f"transformers {installed('transformers')}"
    lines = probes(reaches)
    assert lines[:3] == [
        f"{torch}: Module no longer does X (hf_tp.compat.example.one)",
        f"{torch}: torch.nn.Module._gone_for_good is gone (hf_tp.compat.example.two, hf_tp.compat.example.three)",
        f"{transformers}: transformers.PreTrainedModel._gone_for_good is gone (hf_tp.compat.example.three)",
    ]
    assert re.fullmatch(
        r"python 3\.\d+\.\d+: argparse\._no_such_class is gone \(hf_tp\.compat\.example\.four\)", lines[3]
    )
    assert len(lines) == 4


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _reached(node: ast.AST, own: set[str]) -> set[str]:
    """The private names of torch & co. that the code under ``node`` reaches (not its module's own)."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
            out |= {p for p in sub.module.split(".") if _private(p)} | {a.name for a in sub.names if _private(a.name)}
        elif isinstance(sub, ast.Attribute) and _private(sub.attr):
            out.add(sub.attr)
        elif isinstance(sub, ast.Call) and getattr(sub.func, "id", None) in ("getattr", "hasattr", "setattr"):
            arg = sub.args[1] if len(sub.args) > 1 else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
                out.add(arg.value)
    return out - own


def _parts(paths: list[str]) -> set[str]:
    return {p for path in paths for p in re.split(r"[:.()]+", path) if p}


def test_every_private_name_a_compat_function_reaches_is_probed() -> None:
    """A public compat function (or class) registers each private name it reaches; a private helper
    or module-level code may reach those its module registers."""
    missing = []
    for name in MODULES:
        module = f"hf_tp.compat.{name}"
        importlib.import_module(module)
        tree = ast.parse((COMPAT / f"{name}.py").read_text())
        own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        own |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        own |= {  # attributes the module's own classes set (self._x = ...)
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", None) == "self"
        }
        everything = _parts([r.path for r in REACHES if r.owner.startswith(module + ".")])
        for node in tree.body:
            public = isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
            paths = [r.path for r in REACHES if public and r.owner == f"{module}.{node.name}"]
            for reached in sorted(_reached(node, own) - (_parts(paths) if public else everything)):
                missing.append(f"{module}.{getattr(node, 'name', f'line {node.lineno}')}: {reached}")
    assert not missing, "private names reached without a probe (register them with @reaches):\n" + "\n".join(missing)
