"""Image + text data (TRL's convention): a ``messages`` column of conversations whose turns hold
content parts (``{"type": "image"}``, ``{"type": "text", "text": ...}``) and an ``images`` column
(per row, the images in the order their parts appear: local paths, PIL images, bytes, or
``datasets.Image``'s ``{"bytes", "path"}``), rendered by the checkpoint's own processor (its chat
template, its image processor).

Each row is encoded once (:func:`encode_image_row`: ``input_ids`` as the processor expands the
image placeholders, ``labels`` on the assistant turns only); the images themselves are processed
again per batch by :class:`ImageBatchCollator` (one processor call for the batch's rows, as the
processor lays out its image inputs), checked to give the same token ids. No packing: a row is one
conversation, padded on the right to a multiple of tp.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_tp.labels import IGNORE_INDEX

MESSAGES, IMAGES = "messages", "images"
# Inputs laid out per token (padded like input_ids); every other processor output is the images'.
PER_TOKEN = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0, "mm_token_type_ids": 0}


def is_image_data(columns: Sequence[str]) -> bool:
    """A dataset of image + text conversations: ``messages`` and ``images`` columns."""
    return MESSAGES in columns and IMAGES in columns


def image_parts(messages: Any) -> int:
    """How many ``{"type": "image"}`` parts the conversation holds."""
    return sum(
        1
        for m in messages
        if not isinstance(m.get("content"), str)
        for part in m.get("content") or ()
        if isinstance(part, Mapping) and part.get("type") == "image"
    )


def image_row_problem(
    row: Mapping[str, Any], base_dir: Path | None = None, *, files: bool = True, placeholder: str | None = None
) -> str | None:
    """What is wrong with a raw row that the inputs alone decide (before launch), or None: the
    conversation's shape, the processor's image ``placeholder`` written as text, its image parts
    against its images, a missing image file (``files``)."""
    messages, images = row.get(MESSAGES), row.get(IMAGES)
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        return "column 'messages' must hold a non-empty list of {'role', 'content'} messages"
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            return f"message {j} is not a {{'role', 'content'}} mapping (got {repr(m)[:60]})"
        content = m.get("content")
        if not isinstance(content, str) and not (isinstance(content, Sequence) and content):
            return f"message {j} ({m['role']}) has content {repr(content)[:40]}; give a string or a list of parts"
    written = placeholder and next((j for j, m in enumerate(messages) if placeholder in _text_of(m["content"])), None)
    if written is not None:
        return (
            f"message {written} ({messages[written]['role']}) writes the image placeholder {placeholder!r} as text; "
            "mark each image with a {'type': 'image'} content part, its file in column 'images'"
        )
    images = [] if images is None else images
    if not isinstance(images, Sequence) or isinstance(images, str | bytes):
        return f"column 'images' must hold a list of images (paths, PIL images or bytes), got {type(images).__name__}"
    if image_parts(messages) != len(images):
        return f"the messages hold {image_parts(messages)} image parts but column 'images' holds {len(images)} images"
    for k, ref in enumerate(images):
        path = _path_of(ref)
        if files and path is not None and not _resolve(path, base_dir).is_file():
            return f"image {k} ({path}) is not a file"
    return None


def _text_of(content: Any) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))


def load_row_images(images: Sequence[Any] | None, base_dir: Path | None = None) -> list:
    """A row's images (:func:`load_image`); one that PIL cannot open raises a ``ValueError``
    naming it (``image k (its path)``)."""
    out = []
    for k, ref in enumerate(images or ()):
        try:
            out.append(load_image(ref, base_dir))
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for a damaged file
            name = f" ({_path_of(ref)})" if _path_of(ref) is not None else ""
            raise ValueError(f"image {k}{name} cannot be opened ({type(exc).__name__}: {exc})") from None
    return out


def load_image(ref: Any, base_dir: Path | None = None):
    """A PIL image (RGB) from a path, bytes, ``{"bytes", "path"}`` or a PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, Mapping) and ref.get("bytes") is not None:
        ref = ref["bytes"]
    if isinstance(ref, bytes | bytearray):
        return Image.open(io.BytesIO(ref)).convert("RGB")
    path = _path_of(ref)
    if path is None:
        raise ValueError(f"an image must be a path, bytes or a PIL image, got {type(ref).__name__}")
    with Image.open(_resolve(path, base_dir)) as img:
        return img.convert("RGB")


def _path_of(ref: Any) -> str | None:
    if isinstance(ref, str):
        return ref
    if isinstance(ref, Mapping) and ref.get("bytes") is None and isinstance(ref.get("path"), str):
        return ref["path"]
    return None


def _resolve(path: str, base_dir: Path | None) -> Path:
    """A relative path is read from the dataset file's folder when it is there, else from the working directory."""
    p = Path(path)
    if not p.is_absolute() and base_dir is not None and (base_dir / p).exists():
        return base_dir / p
    return p


def clean_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts without the None fields Arrow adds (a text part's ``image`` key, an image part's ``text``)."""

    def part(p: Any) -> Any:
        return {k: v for k, v in p.items() if v is not None} if isinstance(p, Mapping) else p

    out = []
    for m in messages:
        content = m["content"]
        out.append({"role": m["role"], "content": content if isinstance(content, str) else [part(p) for p in content]})
    return out


def image_token_id(processor: Any) -> int | None:
    """The id of the image placeholder token the processor expands to (never a target), if it names
    one: the tokenizer's where it names one (Gemma 3's processor names its begin-image token, which
    stays text, and expands it to the tokenizer's soft image tokens), else the processor's."""
    found = getattr(getattr(processor, "tokenizer", None), "image_token_id", None)
    found = found if found is not None else getattr(processor, "image_token_id", None)
    token = getattr(processor, "image_token", None)
    if found is None and isinstance(token, str):
        found = processor.tokenizer.convert_tokens_to_ids(token)
    return found


def _tokens(processor: Any, text: str, images: list) -> list[int]:
    out = processor(text=[text], images=images or None, return_tensors="pt")
    return out["input_ids"][0].tolist()


def encode_image_row(
    processor: Any, messages: list[dict], images: list, *, assistant_only: bool, where: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation with its (loaded) images: the processor's
    tokens; labels on the assistant turns (each located by rendering the conversation up to it
    with the generation prompt, and through it, checked to be prefixes) or on every non-image token."""
    render = processor.apply_chat_template
    ids = _tokens(processor, render(messages, tokenize=False), images)
    placeholder = image_token_id(processor)
    if not assistant_only:
        return ids, [IGNORE_INDEX if t == placeholder else t for t in ids]
    labels = [IGNORE_INDEX] * len(ids)
    found = False
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        seen = image_parts(messages[:i])
        before = _tokens(processor, render(messages[:i], tokenize=False, add_generation_prompt=True), images[:seen])
        through = _tokens(processor, render(messages[: i + 1], tokenize=False), images[:seen])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(
                f"{where}: the chat template renders the turns before assistant message {i} differently once later "
                "turns follow, so its tokens cannot be located; pass --no-assistant-only-loss"
            )
        labels[len(before) : len(through)] = ids[len(before) : len(through)]
        found = found or len(through) > len(before)
    if not found:
        raise ValueError(f"{where}: the conversation has no assistant turn to learn from")
    return ids, labels


@dataclass
class ImageBatchCollator:
    """Rows (``messages``, ``images``, ``input_ids``, ``labels``) -> one batch of model inputs:
    the processor's outputs for the rows together, right-padded to a multiple of ``multiple_of``
    (tp), labels -100 on padding and image tokens."""

    processor: Any
    multiple_of: int = 1
    base_dir: Path | None = None

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [self.processor.apply_chat_template(clean_messages(r[MESSAGES]), tokenize=False) for r in rows]
        images = [[load_image(ref, self.base_dir) for ref in r[IMAGES] or ()] for r in rows]
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        side, tokenizer.padding_side = tokenizer.padding_side, "right"
        try:
            has = any(images)
            out = dict(self.processor(text=texts, images=images if has else None, padding=True, return_tensors="pt"))
        finally:
            tokenizer.padding_side = side
        width = -(-out["input_ids"].shape[1] // self.multiple_of) * self.multiple_of
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            if out["input_ids"][i, :n].tolist() != list(r["input_ids"]):
                raise ValueError(f"row {i} of the batch: the processor gives other token ids than when it was encoded")
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, r in enumerate(rows):
            labels[i, : len(r["labels"])] = torch.tensor(r["labels"], dtype=torch.long)
        for key, fill in PER_TOKEN.items():
            if key in out:
                t = out[key]
                pad = torch.full((t.shape[0], width - t.shape[1]), fill if key != "input_ids" else _pad_id(tokenizer))
                out[key] = torch.cat([t, pad.to(t.dtype)], dim=1)
        out["labels"] = labels
        return out


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)
