"""Reading the source of a model's ``forward``s: how a layer calls its blocks, what a forward returns.

Hand-written, because nothing in torch or transformers answers these questions: the plan needs to
know whether a decoder layer passes ``hidden_states`` to a block by keyword or position (so
``PrepareModuleInput`` gathers the right argument), whether a block edits tensors in place, and
whether the logits are exactly ``lm_head(hidden)`` (only then may the loss be fused). An
unreadable source answers "unknown", and the callers refuse rather than guess.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading

from torch import nn

INPLACE = {"clamp_", "clip_", "mul_", "div_", "add_", "sub_", "masked_fill_", "copy_", "zero_", "fill_"}


_PARSE = threading.Lock()  # CPython 3.11's ast.parse is not safe in two threads at once (ranks as threads)


def source_tree(fn) -> ast.AST | None:
    """The parsed source of ``fn`` (decorators unwrapped), or None when it has none to read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
        with _PARSE:
            return ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None


def self_calls(fn) -> dict[str, list[ast.Call]]:
    """``self.<name>(...)`` calls in ``fn``'s source, by name."""
    calls: dict[str, list[ast.Call]] = {}
    tree = source_tree(fn)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "self":
                calls.setdefault(node.func.attr, []).append(node)
    return calls


def edits_in_place(fn) -> bool:
    """The source calls an in-place tensor method (``x.clamp_(...)``, ``x.mul_(...)``...)."""
    tree = source_tree(fn)
    return tree is not None and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in INPLACE for n in ast.walk(tree)
    )


def first_param(fn) -> str | None:
    """The name of ``fn``'s first parameter after ``self``."""
    params = [p for p in inspect.signature(inspect.unwrap(fn)).parameters.values() if p.name != "self"]
    return params[0].name if params else None


def call_style(call: ast.Call, first: str | None) -> int | None:
    """Positional arguments of the call (hidden states first), 0 for ``first=`` by keyword, None
    when unreadable (``*args``, ``**kwargs`` only, or no hidden-states argument)."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    if call.args:
        return len(call.args)
    if first == "hidden_states" and any(k.arg == first for k in call.keywords):
        return 0
    return None


AS_CALLED = -1  # the calls differ (by layer kind): the hidden states as each call passes them


def hidden_states_passing(layer: nn.Module, child: str) -> int | None:
    """How ``layer``'s forward passes the hidden states to its child ``child`` (as
    :func:`call_style`); :data:`AS_CALLED` when several calls differ but each passes them first or
    by the keyword ``hidden_states`` (a child whose kind changes by layer: Nemotron-H's mixer is
    called by keyword as attention, by position as Mamba or an MLP); None when unreadable."""
    first = first_param(type(layer.get_submodule(child)).forward)
    calls = self_calls(type(layer).forward).get(child, [])
    styles = {call_style(call, first) for call in calls}
    if len(styles) == 1 and None not in styles:
        return styles.pop()
    readable = all(call_style(call, "hidden_states") is not None for call in calls)
    return AS_CALLED if len(calls) > 1 and readable else None


def returns_tuple(module: nn.Module) -> bool:
    """Every ``return`` of the module's forward is a tuple (a router handing out its logits apart
    from the routing it computed)."""
    tree = source_tree(type(module).forward)
    rets = [n for n in ast.walk(tree) if isinstance(n, ast.Return)] if tree is not None else []
    return bool(rets) and all(isinstance(r.value, ast.Tuple) for r in rets)


def chunks_in_two(fn) -> bool:
    """The source splits a tensor into two halves (``x.chunk(2, ...)``): a packed gate|up output."""
    tree = source_tree(fn)
    return tree is not None and any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "chunk"
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value == 2
        for n in ast.walk(tree)
    )


def returned_self_call(module: nn.Module) -> str | None:
    """``X`` when every ``return`` of the module's forward is ``self.X(...)`` (a block that
    ends in a child of its own, e.g. a norm of its output), else None."""
    tree = source_tree(type(module).forward)
    rets = [n for n in ast.walk(tree) if isinstance(n, ast.Return)] if tree is not None else []
    names = {
        r.value.func.attr
        if isinstance(r.value, ast.Call)
        and isinstance(r.value.func, ast.Attribute)
        and isinstance(r.value.func.value, ast.Name)
        and r.value.func.value.id == "self"
        else None
        for r in rets
    }
    return names.pop() if len(names) == 1 and None not in names else None


def plain_logits(model: nn.Module, lm_head: str) -> bool:
    """True when the causal-LM forward computes ``logits = self.<lm_head>(h)`` once, with ``h`` the
    decoder's last hidden state (sliced at most), and never changes the logits afterwards (no
    scaling or soft-capping): only then may the loss be fused with the lm_head."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None or "." in lm_head:
        return False
    tree = source_tree(type(model).forward)
    if tree is None:
        return False
    writes = [n for n in ast.walk(tree) if _writes_name(n, "logits")]
    if len(writes) != 1 or not isinstance(writes[0], ast.Assign):
        return False
    value = writes[0].value
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) == f"self.{lm_head}" and len(value.args) == 1):
        return False
    arg = value.args[0]
    source = arg.value if isinstance(arg, ast.Subscript) else arg
    if not isinstance(source, ast.Name):
        return False
    return all(_is_hidden_state(n.value, source.id) for n in ast.walk(tree) if _writes_name(n, source.id))


def _writes_name(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return (
        isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
    )


def _is_hidden_state(value: ast.AST | None, name: str) -> bool:
    """``outputs.last_hidden_state``, ``outputs[0]``, ``name[...]`` or a slicing helper of those."""
    if isinstance(value, ast.Attribute):
        return value.attr == "last_hidden_state"
    if isinstance(value, ast.Subscript):
        return isinstance(value.value, ast.Name)
    if isinstance(value, ast.Call) and "slice" in ast.unparse(value.func):
        return bool(value.args) and _is_hidden_state(value.args[0], name) or ast.unparse(value.args[0]) == name
    return False


def first_calls(fn) -> dict[str, tuple[int, int]]:
    """Where ``fn``'s source first calls each ``self.<name>(...)``, to order them as they run: the
    end of the call (line, column), as a call runs after its arguments (``self.down(self.up(x))``)."""
    return {name: min((c.end_lineno, c.end_col_offset) for c in calls) for name, calls in self_calls(fn).items()}


def self_attributes(cls: type) -> set[str]:
    """Every ``self.<name>`` the source of ``cls`` reads (its methods, helpers included); empty
    when it has no source to read."""
    tree = source_tree(cls)
    return {
        node.attr
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def names_containing(cls: type, word: str) -> bool:
    """The source of ``cls`` names something (a variable, attribute or function) containing ``word``."""
    tree = source_tree(cls)
    return tree is not None and any(
        word in (node.id if isinstance(node, ast.Name) else node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name | ast.Attribute)
    )


def reshapes(fn) -> bool:
    """The source reshapes a tensor (``x.reshape(...)``, ``x.view(...)``, ``x.flatten(...)``): a layer
    that flattens batch and sequence itself (OPT's ``hidden_states.reshape(-1, hidden)``)."""
    tree = source_tree(fn)
    return tree is not None and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("reshape", "view", "flatten")
        for n in ast.walk(tree)
    )


ENCODER_STATES = ("key_value_states", "encoder_hidden_states")


def cross_attention_children(fn) -> list[str]:
    """The ``self.<name>(...)`` calls in ``fn``'s source that hand it an encoder's states
    (``key_value_states=`` or ``encoder_hidden_states``): a decoder layer's cross-attention."""
    found = []
    for name, calls in self_calls(fn).items():
        for call in calls:
            args = [*call.args, *(k.value for k in call.keywords)]
            if any(k.arg in ENCODER_STATES for k in call.keywords) or any(
                isinstance(a, ast.Name) and a.id in ENCODER_STATES for a in args
            ):
                found.append(name)
                break
    return found


def views_heads_then_three(cls: type, counts: tuple[str, ...]) -> bool:
    """The source of ``cls`` views a tensor as ``(..., self.<count>, 3, ...)``, one of ``counts``
    (``num_heads``) right before a 3: q, k and v packed head by head (Persimmon's query_key_value),
    so a contiguous split by heads keeps each head's q, k and v together."""
    tree = source_tree(cls)
    for node in ast.walk(tree) if tree is not None else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("view", "reshape")
        ):
            for a, b in zip(node.args, node.args[1:], strict=False):
                own = isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
                if own and a.attr in counts and isinstance(b, ast.Constant) and b.value == 3:
                    return True
    return False
