"""Per-step batches of image + text rows that keep the dp ranks' passenger collectives in step.

FSDP2 shards a wrapper's vision tower and projector over dp as units of their own: a unit is
all-gathered when it runs, and its gradients are reduce-scattered in backward. The ranks of dp
must therefore all run them, or none: a micro-batch without an image on one dp rank, while
another dp rank's has one, would pair collectives of different units (an error, a hang, or wrong
sums). Such a micro-batch gets one *ghost row*: a user turn holding one blank image, rendered by
the checkpoint's processor, every label ignored. Its logits carry no loss, so the gradient that
flows back through it is exactly zero everywhere (the language model's, the projector's, the
tower's): the step equals plain transformers on the real rows, with the same collectives on
every dp rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_tp.data.formats.images import IMAGES, MESSAGES, encode_image_row
from hf_tp.data.sampler import split_global_batch
from hf_tp.data.steps import StepBatchSource
from hf_tp.labels import IGNORE_INDEX

GHOST_SIDE = 64  # pixels; the image processor resizes it as it resizes any image


def ghost_row(processor: Any) -> dict[str, Any]:
    """One user turn holding one blank image, as the checkpoint's processor renders it; no targets."""
    from PIL import Image

    image = Image.new("RGB", (GHOST_SIDE, GHOST_SIDE), (127, 127, 127))
    messages = [{"role": "user", "content": [{"type": "image"}]}]
    ids, _ = encode_image_row(processor, messages, [image], assistant_only=False, where="the ghost row")
    return {MESSAGES: messages, IMAGES: [image], "input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)}


@dataclass
class ImageStepBatchSource(StepBatchSource):
    """:class:`StepBatchSource` for image + text rows: a micro-batch of this rank without an image
    gets a ghost row when another dp rank's micro-batch of the same micro-step has one."""

    _has_images: list[bool] | None = field(default=None, repr=False)
    _ghost: dict[str, Any] | None = field(default=None, repr=False)

    def micro_rows(self, step: int, micro_step: int, indices: list[int]) -> list:
        rows = super().micro_rows(step, micro_step, indices)
        if self.dp == 1 or any(r[IMAGES] for r in rows):
            return rows
        if self._has_images is None:
            self._has_images = [bool(images) for images in self.data[IMAGES]]
        ordered = self.order.step_indices(step)
        sizes = dict(dp=self.dp, micro_batch=self.micro_batch, grad_accum=self.grad_accum)
        others = (split_global_batch(ordered, dp_rank=d, **sizes)[micro_step] for d in range(self.dp))
        if not any(self._has_images[i] for part in others for i in part):
            return rows
        if self._ghost is None:
            self._ghost = ghost_row(self.collate.processor)
        return [*rows, self._ghost]
