"""The data format names and :class:`DataFormat`, which every format module and the row checks share."""

from __future__ import annotations

from dataclasses import dataclass

TEXT, CHAT, COMPLETION, IMAGES, PREFERENCE = "text", "chat", "completion", "images", "preference"
DEFAULT_TEXT_COLUMN, DEFAULT_MESSAGES_COLUMN = "text", "messages"


@dataclass(frozen=True)
class DataFormat:
    """How to read a dataset: ``kind`` (text, chat or completion), the column of a text or chat
    dataset, and whether only the assistant turns / the completion are targets (preference
    data: only the completions, always)."""

    kind: str
    column: str | None = None
    assistant_only: bool = True
    seq_len: int | None = None  # preference pairs: each side cut to it, a prompt that fills it a bad row

    def describe(self) -> str:
        if self.kind == COMPLETION:
            return "prompt/completion (columns prompt, completion)"
        if self.kind == PREFERENCE:
            return "preference pairs (columns prompt, chosen, rejected)"
        if self.kind == IMAGES:
            return f"image + text conversations (columns '{self.column}', images)"
        return f"{self.kind} (column '{self.column}')"
