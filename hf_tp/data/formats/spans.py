"""Labels from character spans of a rendered text: tokenize once, keep the tokens inside the spans.

Chat and prompt/completion examples are rendered to one string first, and the parts the model must
learn (assistant turns, the completion) are known as character spans of that string. Tokenizing the
whole string with offsets and labelling the tokens that overlap a span is exact whatever the
template puts around the turns; re-tokenizing the pieces separately is not (merges across a
boundary differ). The result is checked against the rendered text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_tp.labels import IGNORE_INDEX


def span_labels(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], *, where: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``text``: labels are the token ids of tokens that overlap one of
    ``spans`` (half-open character ranges) and ``IGNORE_INDEX`` elsewhere.

    Checks that every non-whitespace character of a span lies in a labelled token (a tokenizer
    whose offsets skip text, or a span outside the text, would otherwise train on the wrong
    tokens); ``where`` names the example in the error.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "chat and prompt/completion data need a fast tokenizer (character offsets); this tokenizer is "
            f"{type(tokenizer).__name__}; load the model's tokenizer.json (use_fast=True)"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [IGNORE_INDEX] * len(ids)
    covered = bytearray(len(text) + 1)
    for i, (start, end) in enumerate(offsets):
        if end > start and any(start < b and end > a for a, b in spans):
            labels[i] = ids[i]
            covered[start:end] = b"\x01" * (end - start)
    for a, b in spans:
        if not 0 <= a <= b <= len(text):
            raise ValueError(f"{where}: label span {a}-{b} is outside the rendered text of {len(text)} characters")
        missed = [c for c in range(a, b) if not covered[c] and not text[c].isspace()]
        if missed:
            raise ValueError(
                f"{where}: the tokenizer's offsets do not cover character {missed[0]} ({text[missed[0]]!r}) of a "
                "labelled span of the rendered text; use a tokenizer with complete offset mappings"
            )
    return ids, labels
