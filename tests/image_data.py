"""Image + text test data built offline: a tiny LLaVA processor (CLIP image processor at 28x28, the
chat tokenizer of tests/chat_data.py with an ``<image>`` token, a template that renders content
parts), PNG images written to a folder, TRL-style rows, and a tiny saved LLaVA folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.chat_data import chat_tokenizer

IMAGE_TOKEN = "<image>"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llava_processor():
    """LlavaProcessor: 28x28 images, 4 image tokens each (2x2 patches of 14, CLS dropped)."""
    import transformers
    from transformers import LlavaProcessor

    pil = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    tokenizer = chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", IMAGE_TOKEN]})
    images = pil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )


def write_images(folder: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` small RGB PNGs of different sizes in ``folder``; their file names."""
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        pixels = (rng.random((20 + 7 * i, 30 + 5 * i, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        names.append(f"img{i}.png")
    return names


CITIES = ["paris", "rome", "oslo", "lima"]


def image_rows(names: list[str], counts: tuple[int, ...] = (1, 2, 0, 1, 1, 2, 1, 0)) -> list[dict]:
    """TRL rows: a user turn with ``count`` image parts and a question, an assistant answer."""
    rows, k = [], 0
    for i, count in enumerate(counts):
        parts = [{"type": "image"} for _ in range(count)]
        parts.append({"type": "text", "text": " where should i go ?"})
        answer = [{"type": "text", "text": f"go to {CITIES[i % len(CITIES)]} ."}]
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": [names[(k + j) % len(names)] for j in range(count)]})
        k += count
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_tiny_llava(folder: Path, processor) -> Path:
    """A tiny random LLaVA (the wrapper grid's sizes, float32) saved with its processor."""
    from tests.image_grid import image_config
    from tests.wrapper_grid import wrapper_model

    config = image_config("llava")
    config.image_token_index = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config.text_config.pad_token_id = processor.tokenizer.pad_token_id
    model = wrapper_model(config).to(torch.float32)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
