"""Private names of torch / transformers / peft (and of the standard library) appear only in
``hf_tp/compat/``: every other module of hf_tp reaches them through a compat function with a probe.

The rule, read off the source (no module is run but to ask which class a name is inherited from):
- an import of a module path with a ``_``-prefixed component, or of a ``_`` name, from torch,
  transformers, peft, accelerate or datasets is flagged;
- an attribute ``x._name`` (not a dunder), a ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr``
  of a literal ``"_name"``, and any ``x.__dict__`` are flagged, unless ``_name`` is hf_tp's own or
  on :data:`hf_tp.compat.allowed.ALLOWED`;
- hf_tp's own: a name hf_tp defines outside ``hf_tp/compat/`` in a class body or as ``self._name =``
  / ``cls._name =``, where the class does not inherit it from a class outside hf_tp (an override of
  torch's private hook is torch's name, not hf_tp's).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from hf_tp.compat.allowed import ALLOWED

PACKAGE = Path(__file__).resolve().parents[2] / "hf_tp"
COMPAT = PACKAGE / "compat"
THEIRS = ("torch", "transformers", "peft", "accelerate", "datasets")
NAMED_BY_STRING = ("getattr", "hasattr", "setattr", "delattr")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _inherited(module: str, cls: str, name: str) -> bool:
    """Whether the top-level class ``cls`` of ``module`` gets ``name`` from a class outside hf_tp."""
    found = getattr(importlib.import_module(module), cls, None)
    if not isinstance(found, type):
        return False
    return any(name in vars(k) for k in found.__mro__[1:] if not k.__module__.startswith("hf_tp"))


def _class_names(node: ast.ClassDef) -> set[str]:
    """Private names a class defines: in its body, or as ``self._x = ...`` / ``cls._x = ...`` in its methods."""
    out = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(item.name)
        elif isinstance(item, ast.Assign | ast.AnnAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name):
            if sub.value.id in ("self", "cls"):
                out.add(sub.attr)
    return {n for n in out if private(n)}


def owned_names(sources: dict[Path, str]) -> set[str]:
    """The private names hf_tp defines itself outside compat (see the module docstring)."""
    owned = set()
    for path, text in sources.items():
        tree = ast.parse(text)
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for name in _class_names(node):
                if node.bases and id(node) not in top:
                    continue  # a class made inside a function, with bases: not resolvable here
                if node.bases and _inherited(_module_name(path), node.name, name):
                    continue
                owned.add(name)
    return owned


def _import_findings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in THEIRS and any(map(private, a.name.split(".")))]
    if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in THEIRS:
        if any(map(private, node.module.split("."))):
            return [node.module]
        return [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
    return []


def findings(text: str, owned: set[str], allowed: set[str]) -> list[tuple[int, str]]:
    """(line, what) of every private access in the source ``text`` (the rule of the module docstring)."""
    out = []
    nodes = sorted(
        (n for n in ast.walk(ast.parse(text)) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)
    )
    for node in nodes:
        out += [(node.lineno, f"import of {name}") for name in _import_findings(node)]
        name = None
        if isinstance(node, ast.Attribute):
            if node.attr == "__dict__":
                out.append((node.lineno, f"{ast.unparse(node)} (instance dict)"))
                continue
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAMED_BY_STRING:
            arg = node.args[1] if len(node.args) > 1 else None
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        if name is not None and private(name) and name not in owned and name not in allowed:
            out.append((node.lineno, name))
    return out


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if COMPAT not in p.parents}


def test_private_names_appear_only_in_compat() -> None:
    sources = _sources()
    owned = owned_names(sources)
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path, text in sources.items()
        for line, what in findings(text, owned, set(ALLOWED))
    ]
    assert not found, (
        "private names outside hf_tp/compat/ (put each behind a compat function with a probe, or on "
        "hf_tp.compat.allowed.ALLOWED with the reason its owner documents it):\n" + "\n".join(found)
    )


def test_the_rule_flags_what_it_should() -> None:
    text = """
from torch._subclasses.fake_tensor import FakeTensorMode
import torch.distributed._tools.mem_tracker
from torch.distributed.distributed_c10d import _world, new_group
from torch.distributed import _functional_collectives
class Mine:
    def __init__(self):
        self._mine = 1
    def f(self, m, t):
        m._parameters["w"]
        m.__dict__["w"] = t
        getattr(m, "_hook_handles")
        return self._mine, m._mine, self.__init__, m._attn_implementation, torch.__future__
"""
    owned = owned_names({PACKAGE / "example.py": text})
    assert owned == {"_mine"}
    got = [what for _, what in findings(text, owned, {"_attn_implementation"})]
    assert got == [
        "import of torch._subclasses.fake_tensor",
        "import of torch.distributed._tools.mem_tracker",
        "import of torch.distributed.distributed_c10d._world",
        "import of torch.distributed._functional_collectives",
        "_parameters",
        "m.__dict__ (instance dict)",
        "_hook_handles",
    ]


def test_an_override_of_their_private_hook_is_not_hf_tps_own() -> None:
    # PerTokenOnShards defines _layout itself; a MemTracker hook overridden outside compat would not count
    assert _inherited("hf_tp.styles.linear", "PerTokenOnShards", "_apply")
    assert not _inherited("hf_tp.styles.linear", "PerTokenOnShards", "_layout")
    assert _inherited("hf_tp.cli.formatting", "HelpFormatter", "_get_help_string")


def test_every_allowed_name_has_a_reason_and_is_used() -> None:
    used = set()
    for text in _sources().values():
        used |= {n.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute)}
        used |= set(re.findall(r"\"(_\w+)\"", text))
    for name, reason in ALLOWED.items():
        assert private(name) and len(reason.split()) >= 8, name
        assert name in used, f"{name} is on ALLOWED but hf_tp no longer uses it"
