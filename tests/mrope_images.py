"""Images for the image grid's 3-D mrope families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4V(-MoE)):
random RGB pictures of different sizes through each family's own image processor, built offline
with the grid's vision sizes (14-pixel patches, two frames per temporal patch, 2x2 merge), so that
``pixel_values`` and ``image_grid_thw`` are laid out as the processor lays them out and each image
becomes a different (t, h, w) grid of tokens (the 3-D positions differ in height and width).
"""

from __future__ import annotations

import numpy as np
import torch

# model_type -> its image processor (transformers' PIL one: the torchvision one needs torchvision)
IMAGE_PROCESSORS = {
    "qwen2_vl": "Qwen2VLImageProcessorPil",
    "qwen2_5_vl": "Qwen2VLImageProcessorPil",
    "qwen3_vl": "Qwen2VLImageProcessorPil",
    "qwen3_vl_moe": "Qwen2VLImageProcessorPil",
    "glm4v": "Glm4vImageProcessorPil",
    "glm4v_moe": "Glm4vImageProcessorPil",
}
# (height, width) of the i-th image of a batch: 6, 2, 4 and 4 tokens under these processors (rows
# of 2, 0, 1 and 1 images: each tp2 x dp2 half holds 8 image tokens)
SIZES = ((56, 84), (28, 56), (56, 56), (56, 56))
MERGE = 2


def image_processor(model_type: str):
    """The family's image processor at the grid's sizes."""
    import transformers

    name = IMAGE_PROCESSORS[model_type]
    frames = 2 if name.startswith("Glm4v") else 1  # GLM-4V's counts both frames of a temporal patch in its budget
    size = {"shortest_edge": frames * 28 * 28, "longest_edge": frames * 56 * 84}
    cls = getattr(transformers, name)
    return cls(patch_size=14, temporal_patch_size=2, merge_size=MERGE, size=size)


def processed_images(model_type: str, count: int, g: torch.Generator) -> list[tuple[torch.Tensor, list[int]]]:
    """``count`` random pictures (sizes from :data:`SIZES` in turn) through the family's image
    processor: each one's patches (float64) and (t, h, w) grid."""
    from PIL import Image

    processor = image_processor(model_type)
    out = []
    for i in range(count):
        h, w = SIZES[i % len(SIZES)]
        pixels = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        done = processor(images=[Image.fromarray(np.ascontiguousarray(pixels))], return_tensors="pt")
        out.append((done["pixel_values"].to(torch.float64), done["image_grid_thw"][0].tolist()))
    return out


def tokens(grid: list[int]) -> int:
    """Image tokens of a (t, h, w) patch grid: its patches merged 2x2."""
    return grid[0] * grid[1] * grid[2] // MERGE**2
