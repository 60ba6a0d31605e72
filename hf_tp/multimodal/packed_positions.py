"""Packed text rows on a 3-D mrope language model: the document positions handed over in the form
its masks read.

hf_tp packs text documents into rows and marks them with ``position_ids`` that restart at each
document (no attention mask): transformers' mask builders turn those into per-document masks. A
3-D mrope language model (Qwen2-VL, Qwen2.5-VL, GLM-4V, ...) reads 4-row ``position_ids`` as
(text, temporal, height, width), builds its masks from the text row, and expands 2-D ones to the
three rotary rows only, leaving its masks without them: packed documents would attend to each
other. transformers documents the 4-row form for packing, with the text positions first; for text
the temporal, height and width positions equal the text ones (what the model's own expansion
gives its rotary), so hf_tp hands 2-D ``position_ids`` over as those four equal rows.
"""

from __future__ import annotations

import ast

from torch import nn

from hf_tp.core.forward_source import source_tree

FOUR_ROWS = "position_ids.shape[0] == 4"  # how these forwards recognise the (text, t, h, w) form


def reads_text_positions_first(language_model: nn.Module) -> bool:
    """The language model's forward takes 4-row ``position_ids``, the text positions first."""
    tree = source_tree(type(language_model).forward)
    return tree is not None and any(isinstance(n, ast.Compare) and ast.unparse(n) == FOUR_ROWS for n in ast.walk(tree))


def pass_packed_positions(language_model: nn.Module) -> None:
    """Hand a 3-D mrope language model 2-D ``position_ids`` as four equal rows (text first)."""
    if not reads_text_positions_first(language_model):
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        positions = kwargs.get("position_ids")
        if positions is None or positions.dim() != 2:
            return None
        return args, {**kwargs, "position_ids": positions[None].expand(4, *positions.shape)}

    language_model.register_forward_pre_hook(hook, with_kwargs=True)
