"""Image + text data (TRL's messages + images columns) through a tiny LLaVA processor built
offline: rows encoded with assistant-only labels, batches of rows with different image counts,
and bad rows named by their line before launch (or where the processor rejects them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tp.data.datasets import check_text_dataset, load_text_dataset
from hf_tp.data.formats import IMAGES, detect_format
from hf_tp.data.formats.images import ImageBatchCollator
from hf_tp.data.image_data import check_image_rows, encode_image_dataset
from hf_tp.labels import IGNORE_INDEX
from tests.image_data import IMAGE_TOKEN, image_rows, llava_processor, write_images, write_jsonl


@pytest.fixture(scope="module")
def processor():
    return llava_processor()


def _encode(processor, path: Path, seq_len: int = 64, skip: bool = False):
    raw = load_text_dataset(str(path))
    rows, dropped = encode_image_dataset(
        raw, processor, seq_len=seq_len, assistant_only=True, label=f"'{path}'", base_dir=path.parent, skip=skip
    )
    return (rows, dropped) if skip else rows


def test_rows_encode_with_assistant_labels_and_collate_mixed_image_counts(processor, tmp_path) -> None:
    path = write_jsonl(tmp_path / "images.jsonl", image_rows(write_images(tmp_path, 3), counts=(1, 2, 0)))
    assert detect_format(["messages", "images"]).kind == IMAGES
    rows = _encode(processor, path)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tok = processor.tokenizer
    for row, count, city in zip(rows, (1, 2, 0), ("paris", "rome", "oslo"), strict=True):
        assert row["input_ids"].count(image_id) == 4 * count  # 2x2 patches per 28x28 image
        targets = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert tok.decode(targets) == f"go to {city} . <|im_end|>"  # the answer and its end token only
    batch = ImageBatchCollator(processor, multiple_of=4, base_dir=tmp_path)([rows[i] for i in range(3)])
    assert batch["input_ids"].shape[1] % 4 == 0
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28)  # the three images, in row order
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert batch["labels"][i, :n].tolist() == row["labels"]
        assert (batch["labels"][i, n:] == IGNORE_INDEX).all() and (batch["attention_mask"][i, n:] == 0).all()


def test_bad_rows_are_named_before_launch(processor, tmp_path) -> None:
    names = write_images(tmp_path, 2)
    rows = image_rows(names, counts=(1, 1, 1))
    rows[1]["images"] = ["missing.png"]
    path = write_jsonl(tmp_path / "images.jsonl", rows)
    with pytest.raises(ValueError, match=r"line 2 of .*images.jsonl: image 0 \(missing.png\) is not a file"):
        check_text_dataset(str(path), every_row=True)
    rows[1]["images"] = [names[0], names[1]]  # two images for one image part
    write_jsonl(path, rows)
    with pytest.raises(ValueError, match=r"line 2 of .*: the messages hold 1 image parts but column 'images' holds 2"):
        check_image_rows(load_text_dataset(str(path)), f"'{path}'", tmp_path)


def test_rows_the_processor_rejects_or_too_long_are_named(processor, tmp_path) -> None:
    names = write_images(tmp_path, 2)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = image_rows(names, counts=(1, 1))
    rows[1]["images"] = ["broken.png"]
    path = write_jsonl(tmp_path / "broken.jsonl", rows)
    with pytest.raises(ValueError, match=r"line 2 of .*broken.jsonl: image 0 \(broken.png\) cannot be opened \("):
        _encode(processor, path)
    path = write_jsonl(tmp_path / "long.jsonl", image_rows(names, counts=(2,)))
    with pytest.raises(ValueError, match=r"line 1 of .*: 2\d tokens with its image tokens, over --seq-len 12"):
        _encode(processor, path, seq_len=12)
    # --skip-bad-rows: the broken image, the missing file and the long row are dropped, each named
    rows = image_rows(names, counts=(1, 1, 1, 2, 1))
    rows[1]["images"], rows[2]["images"] = ["broken.png"], ["missing.png"]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    kept, dropped = _encode(processor, path, seq_len=20, skip=True)
    assert len(kept) == 2 and [line.split(":")[0] for line in dropped] == [f"line {i} of {path}" for i in (2, 3, 4)]


def test_a_later_bad_row_is_named_with_its_line_and_file_in_the_ranks(processor, tmp_path) -> None:
    # Before launch only the first rows are encoded (hf_tp.run.first_rows); the ranks encode every
    # row: a damaged image or the placeholder written as text past them is one line naming the row.
    names = write_images(tmp_path, 2)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot a png")
    rows = image_rows(names, counts=(1,) * 20)
    rows[18]["images"] = ["broken.png"]
    path = write_jsonl(tmp_path / "late.jsonl", rows)
    with pytest.raises(ValueError, match=r"^line 19 of .*late.jsonl: image 0 \(broken.png\) cannot be opened \(.*\)$"):
        _encode(processor, path)
    rows[18] = {
        "messages": [{"role": "user", "content": f"{IMAGE_TOKEN} where?"}, rows[17]["messages"][1]],
        "images": [],
    }
    path = write_jsonl(tmp_path / "late.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"^line 19 of .*: message 0 \(user\) writes the image placeholder '<image>' as"
    ):
        _encode(processor, path)


def test_collated_batches_train_a_parallel_llava_as_plain_hf(processor, tmp_path) -> None:
    # The batch path of hf-tp train: processor batches (rows of 1, 2, 0, 1 images) through
    # training_loss (the fused lm_head + loss where the model allows it) at tp=2 give plain HF's
    # loss and every trainable gradient (the vision tower frozen in both).
    import copy

    import torch

    import hf_tp
    from hf_tp.labels import count_targets
    from hf_tp.multimodal.passengers import in_tower
    from hf_tp.parallel.linear_ce import fusable
    from hf_tp.run.loss import training_loss
    from tests.helpers import full, full_grads, run_threaded
    from tests.image_grid import image_config
    from tests.wrapper_grid import wrapper_model

    path = write_jsonl(tmp_path / "images.jsonl", image_rows(write_images(tmp_path, 3), counts=(1, 2, 0, 1)))
    rows = _encode(processor, path)
    batch = ImageBatchCollator(processor, multiple_of=2, base_dir=tmp_path)([rows[i] for i in range(4)])
    config = image_config("llava")
    config.image_token_index = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ref = wrapper_model(config)
    adapter = hf_tp.get_adapter(config)
    candidates = [copy.deepcopy(ref) for _ in range(2)]
    for name, p in ref.named_parameters():
        p.requires_grad_(not in_tower(adapter, name))
    want = ref(**batch, use_cache=False).loss
    want.backward()
    want_grads = full_grads(ref)
    targets = count_targets(batch["labels"])

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(candidates[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        assert fusable(model)
        with hf_tp.loss_parallel():
            loss, _ = training_loss(model, dict(batch), targets, fused=True)
            loss.backward()
        assert abs(full(loss).item() - want.item()) <= 1e-6 * abs(want.item())
        got = full_grads(model)
        assert got.keys() == want_grads.keys(), sorted(got.keys() ^ want_grads.keys())
        for name, w in want_grads.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-6 * w.abs().max().item(), msg=name)

    run_threaded(2, rank_fn)


def test_dp_rank_without_images_gets_a_ghost_row_and_plain_hf_gradients(processor, tmp_path) -> None:
    # tp2 x dp2, dp rank 0's rows hold no image, dp rank 1's do: FSDP2 gathers the vision tower and
    # projector (and reduce-scatters the projector's gradient) on every dp rank or on none, so rank
    # 0 collates a ghost row (a blank image, no targets). Loss and every trainable gradient equal
    # plain HF on the four real rows; without the ghost the ranks' collectives do not pair up.
    import copy

    import torch

    import hf_tp
    from hf_tp.data.image_steps import ImageStepBatchSource
    from hf_tp.data.sampler import split_global_batch
    from hf_tp.multimodal.passengers import in_tower
    from hf_tp.run.loss import training_loss
    from tests.helpers import full, full_grads, run_threaded
    from tests.image_grid import image_config
    from tests.wrapper_grid import wrapper_model

    class InOrder:  # the global batch in file order: dp rank 0 takes rows 0-1, dp rank 1 rows 2-3
        def step_indices(self, step: int) -> list[int]:
            return [0, 1, 2, 3]

        def local_indices(self, step: int, **sizes) -> list[list[int]]:
            return split_global_batch(self.step_indices(step), **sizes)

    path = write_jsonl(tmp_path / "images.jsonl", image_rows(write_images(tmp_path, 3), counts=(0, 0, 1, 2)))
    rows = _encode(processor, path)
    collate = ImageBatchCollator(processor, multiple_of=2, base_dir=tmp_path)
    config = image_config("llava")
    config.image_token_index = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ref = wrapper_model(config)
    adapter = hf_tp.get_adapter(config)
    candidates = [copy.deepcopy(ref) for _ in range(4)]
    for name, p in ref.named_parameters():
        p.requires_grad_(not in_tower(adapter, name))
    want = ref(**collate([rows[i] for i in range(4)]), use_cache=False).loss
    want.backward()
    want_grads = full_grads(ref)
    sources = [ImageStepBatchSource(rows, InOrder(), collate, d, 2, 2, 1, torch.device("cpu")) for d in range(2)]
    steps = [source(0) for source in sources]
    assert [len(s.micro_batches[0]["input_ids"]) for s in steps] == [3, 2]  # the ghost row on dp rank 0

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, dp=2, device_type="cpu")
        model = hf_tp.parallelize(candidates[rank], mesh)
        step = steps[mesh.get_local_rank("dp")]
        with hf_tp.loss_parallel():
            loss, _ = training_loss(model, dict(step.micro_batches[0]), step.num_targets, fused=True)
            (loss * 2).backward()  # FSDP2 averages over dp; the loss is already over the global count
        total = full(loss).detach().clone()
        torch.distributed.all_reduce(total, group=mesh["dp"].get_group())
        assert abs(total.item() - want.item()) <= 1e-6 * abs(want.item())
        got = full_grads(model)
        assert got.keys() == want_grads.keys(), sorted(got.keys() ^ want_grads.keys())
        for name, w in want_grads.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-6 * w.abs().max().item(), msg=name)

    run_threaded(4, rank_fn)


def test_gemma3_labels_skip_the_soft_image_tokens_not_its_begin_token(tmp_path) -> None:
    # Gemma3Processor names its begin-image token as image_token and expands it to the tokenizer's
    # soft tokens: with every token a target, the soft tokens are never targets, the begin token is.
    from tests.processor_images import gemma3_processor

    processor = gemma3_processor()
    path = write_jsonl(tmp_path / "images.jsonl", image_rows(write_images(tmp_path, 1), counts=(1,)))
    rows = encode_image_dataset(
        load_text_dataset(str(path)), processor, seq_len=64, assistant_only=False, label="x", base_dir=tmp_path
    )[0]
    tok = processor.tokenizer
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    assert ids.count(tok.image_token_id) == 4 and tok.boi_token_id in ids
    assert [t for t in labels if t != IGNORE_INDEX] == [t for t in ids if t != tok.image_token_id]


def test_processor_rows_train_a_parallel_smolvlm_as_plain_hf(tmp_path) -> None:
    # Idefics3's processor (SmolVLM's own needs torchvision) saved with a tiny SmolVLM and reloaded:
    # its rows through hf_tp's data path (a ghost row at tp2 x dp2) give plain HF's loss and
    # every trainable gradient at tp2 and tp2 x dp2 (Gemma 3's: scripts/image_grid.py --processors).
    from tests.processor_images import PROCESSORS, processor_parity

    try:
        PROCESSORS["smolvlm"][0]()
    except ImportError as exc:  # transformers 5.17's Idefics3ImageProcessorPil requires torchvision
        pytest.skip(f"this transformers builds Idefics3's processor only with torchvision: {str(exc).strip()[:80]}")
    diffs = processor_parity("smolvlm", tmp_path)
    assert max(diffs.values()) <= 1e-6, diffs


def test_streamed_image_rows_are_refused_in_the_ranks_too(tmp_path) -> None:
    # hf-tp train refuses them before launch (tests/unit/test_bad_inputs.py); ranks started by torchrun
    # themselves read the stream's columns and say the same line (it was KeyError: 'prompt')
    from hf_tp.run.config import TrainConfig
    from hf_tp.train.data import build_data

    path = write_jsonl(tmp_path / "images.jsonl", image_rows(write_images(tmp_path, 1), counts=(1, 1)))
    cfg = TrainConfig(model=str(tmp_path), dataset=str(path), streaming=True, output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"^dataset '.*images.jsonl' holds image \+ text rows .*: drop --streaming$"):
        build_data(cfg.resolve(), tokenizer=None)
