"""Image + text parity through a checkpoint's real processor, built offline and saved with a tiny
wrapper: TRL rows rendered by ``AutoProcessor.from_pretrained(folder)`` (chat template, placeholder
expansion, image processor), encoded and batched by hf_tp's data path, trained at tp2 and tp2 x dp2
(a ghost row on the dp rank without images) against plain transformers on the same batch: loss and
every trainable gradient (the vision tower frozen in both)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoProcessor, PreTrainedTokenizerFast

import hf_tp
from hf_tp.data.datasets import load_text_dataset
from hf_tp.data.formats.images import ImageBatchCollator
from hf_tp.data.image_data import encode_image_dataset
from hf_tp.data.image_steps import ImageStepBatchSource
from hf_tp.data.sampler import split_global_batch
from hf_tp.multimodal.passengers import in_tower
from hf_tp.run.loss import training_loss
from tests.chat_data import chat_tokenizer
from tests.helpers import full, full_grads, run_threaded
from tests.image_data import TEMPLATE, image_rows, write_images, write_jsonl
from tests.image_grid import image_config
from tests.wrapper_grid import wrapper_model

COUNTS = (0, 0, 1, 2)  # dp rank 0's rows hold no image: it collates a ghost row at tp2 x dp2
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def gemma3_processor():
    """Gemma3Processor: the PIL image processor at the tiny tower's 28x28, 4 soft tokens per image
    between its begin/end tokens; the chat tokenizer with Gemma 3's named image tokens."""
    import transformers
    from transformers import Gemma3Processor

    base = chat_tokenizer()
    base.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *GEMMA3_TOKENS.values()]})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        model_max_length=512,
        extra_special_tokens=GEMMA3_TOKENS,
    )
    pil = getattr(transformers, "Gemma3ImageProcessorPil", None) or transformers.Gemma3ImageProcessor
    return Gemma3Processor(
        image_processor=pil(size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        chat_template=TEMPLATE.replace("<image>", GEMMA3_TOKENS["boi_token"]),
        image_seq_length=4,
    )


def gemma3_ids(config, processor) -> None:
    tok = processor.tokenizer
    config.image_token_index = tok.image_token_id
    config.boi_token_index, config.eoi_token_index = tok.boi_token_id, tok.eoi_token_id


def idefics3_processor():
    """Idefics3Processor: the PIL image processor at the tiny tower's 28x28, unsplit, one image
    token per image (2x2 patches of 14, pixel-shuffled by 2) between its fake tokens."""
    import transformers
    from transformers import Idefics3Processor

    tokenizer = chat_tokenizer()
    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<global-img>", *tiles]})
    pil = getattr(transformers, "Idefics3ImageProcessorPil", None) or transformers.Idefics3ImageProcessor
    edge = {"longest_edge": 28}
    return Idefics3Processor(
        image_processor=pil(do_image_splitting=False, size=edge, max_image_size=edge),
        tokenizer=tokenizer,
        image_seq_len=1,
        chat_template=TEMPLATE,
    )


def idefics3_ids(config, processor) -> None:
    config.image_token_id = processor.image_token_id


# model_type -> (its processor built offline, setting the config's image token ids from the
# processor). SmolVLM's own SmolVLMProcessor takes a video processor, which transformers builds
# only with torchvision: its wrapper gets Idefics3's, which lays images out as SmolVLM's does.
PROCESSORS: dict[str, tuple[Callable, Callable]] = {
    "gemma3": (gemma3_processor, gemma3_ids),
    "idefics3": (idefics3_processor, idefics3_ids),
    "smolvlm": (idefics3_processor, idefics3_ids),
}


class _InOrder:
    """The global batch in file order: dp rank 0 takes rows 0-1, dp rank 1 rows 2-3."""

    def step_indices(self, step: int) -> list[int]:
        return [0, 1, 2, 3]

    def local_indices(self, step: int, **sizes) -> list[list[int]]:
        return split_global_batch(self.step_indices(step), **sizes)


def processor_parity(model_type: str, folder: Path) -> dict[tuple[int, str], float]:
    """Save the tiny wrapper with its processor in ``folder``, reload the processor, and train the
    rows at tp2 and tp2 x dp2: (dp, "loss" | "grads") -> max relative difference to plain HF."""
    build, set_ids = PROCESSORS[model_type]
    config = image_config(model_type)
    set_ids(config, build())
    ref = wrapper_model(config)
    ref.save_pretrained(folder)
    build().save_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    path = write_jsonl(folder / "images.jsonl", image_rows(write_images(folder, 3), counts=COUNTS))
    rows, _ = encode_image_dataset(
        load_text_dataset(str(path)), processor, seq_len=128, assistant_only=True, label="rows", base_dir=folder
    )
    collate = ImageBatchCollator(processor, multiple_of=2, base_dir=folder)
    adapter = hf_tp.get_adapter(config)
    candidates = [copy.deepcopy(ref) for _ in range(6)]
    for name, p in ref.named_parameters():
        p.requires_grad_(not in_tower(adapter, name))
    batch = collate([rows[i] for i in range(4)])
    image_token = getattr(config, "image_token_index", None) or config.image_token_id
    assert (batch["input_ids"] == image_token).any(), "the processor expanded no image placeholder"
    want = ref(**batch, use_cache=False).loss
    want.backward()
    want_grads = full_grads(ref)
    diffs: dict[tuple[int, str], float] = {}
    for dp, models in ((1, candidates[:2]), (2, candidates[2:])):
        sources = [
            ImageStepBatchSource(rows, _InOrder(), collate, d, dp, 4 // dp, 1, torch.device("cpu")) for d in range(dp)
        ]
        steps = [source(0) for source in sources]
        if dp == 2:
            assert [len(s.micro_batches[0]["input_ids"]) for s in steps] == [3, 2], "no ghost row on dp rank 0"

        def rank_fn(rank: int, dp=dp, models=models, steps=steps) -> None:
            mesh = hf_tp.build_mesh(tp=2, dp=dp, device_type="cpu")
            model = hf_tp.parallelize(models[rank], mesh)
            step = steps[mesh.get_local_rank("dp") if dp > 1 else 0]
            with hf_tp.loss_parallel():
                loss, _ = training_loss(model, dict(step.micro_batches[0]), step.num_targets, fused=True)
                (loss * dp).backward()  # FSDP2 averages over dp; the loss is already over the global count
            total = full(loss).detach().clone()
            if dp > 1:
                torch.distributed.all_reduce(total, group=mesh["dp"].get_group())
            got = full_grads(model)
            assert got.keys() == want_grads.keys(), sorted(got.keys() ^ want_grads.keys())
            worst = max(
                ((got[n] - w).abs().max() / max(w.abs().max().item(), 1e-30)).item() for n, w in want_grads.items()
            )
            if rank == 0:
                diffs[dp, "loss"] = abs(total.item() - want.item()) / abs(want.item())
                diffs[dp, "grads"] = worst

        run_threaded(2 * dp, rank_fn)
    return diffs
