"""Image + text parity of multimodal wrappers: plain transformers against hf_tp (tp=2, tp2 x dp2)
on the same tiny wrapper (tests/wrapper_grid.py's configs, with image tokens inside the grid's
vocab), with pixel_values and each family's extra inputs built by hand, rows of different image
counts in one batch.

The reference trains every parameter; hf_tp freezes the vision tower (unless asked to train it),
so the comparison covers the trainable ones: logits, loss, every gradient, an AdamW step's loss.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import hf_tp
from hf_tp.context.token_share import TokenShare
from hf_tp.core.record import record_of
from hf_tp.multimodal.passengers import in_tower
from tests.family_grid import GREEDY_TOKENS
from tests.helpers import full, full_grads, run_threaded
from tests.mrope_images import IMAGE_PROCESSORS, processed_images, tokens
from tests.parity import KEY_BIASES
from tests.wrapper_grid import wrapper_config, wrapper_model

IMAGE = 290  # the image placeholder token of every family here (inside the grid's 301-token vocab)
SEQ = 16
# model_type -> (config fields: "" the wrapper's own, else a sub-config; tokens per image; pixel side)
FAMILIES: dict[str, tuple[dict[str, dict], int, int]] = {
    "llava": ({"": dict(image_token_index=IMAGE, image_seq_length=4)}, 4, 28),
    "gemma3": (
        {"": dict(image_token_index=IMAGE, mm_tokens_per_image=4, boi_token_index=291, eoi_token_index=292)},
        4,
        28,
    ),
    "mistral3": ({"": dict(image_token_index=IMAGE), "vision_config": dict(image_size=56)}, 4, 56),
    "smolvlm": ({"": dict(image_token_id=IMAGE, scale_factor=2)}, 1, 28),
    "idefics3": ({"": dict(image_token_id=IMAGE, scale_factor=2)}, 1, 28),
    "qwen3_5": ({"": dict(image_token_id=IMAGE, vision_start_token_id=291, vision_end_token_id=292)}, 1, 28),
}
# 3-D mrope families: images through their own image processor (tests/mrope_images.py), one
# token per 2x2 patches; Qwen3-VL's one vision layer tapped for DeepStack (its features join the
# first decoder layer's output)
QWEN_IDS = dict(image_token_id=IMAGE, vision_start_token_id=291, vision_end_token_id=292, video_token_id=293)
GLM_IDS = dict(image_token_id=IMAGE, image_start_token_id=291, image_end_token_id=292, video_token_id=293)
DEEPSTACK = {"vision_config": dict(deepstack_visual_indexes=[0])}
FAMILIES.update(
    {
        # Qwen2-VL's vision hidden_size is its merger's output: the language model's width
        "qwen2_vl": ({"": QWEN_IDS, "vision_config": dict(hidden_size=64)}, 0, 0),
        "qwen2_5_vl": ({"": QWEN_IDS}, 0, 0),
        **{mt: ({"": QWEN_IDS, **DEEPSTACK}, 0, 0) for mt in ("qwen3_vl", "qwen3_vl_moe")},
        **{mt: ({"": GLM_IDS}, 0, 0) for mt in ("glm4v", "glm4v_moe")},
    }
)
PATCHES = ("qwen3_5", *IMAGE_PROCESSORS)  # pixel_values: every image's flattened patches, + image_grid_thw
IMAGES_PER_ROW = (2, 0, 1, 1)  # dp halves hold as many image (hence label) tokens: their mean losses average to HF's
PADDING = (0, 3, 3, 0)


def image_config(model_type: str):
    """The grid's tiny config of ``model_type`` with its image token (and sizes) set for images."""
    config = wrapper_config(model_type)
    fields, _, _ = FAMILIES[model_type]
    for key, values in fields.items():
        target = config if key == "" else getattr(config, key)
        for name, value in values.items():
            setattr(target, name, value)
    return config


def image_rows(model_type: str, config, seed: int = 3) -> list[dict]:
    """One dict per row: token ids with each image's placeholder run, labels (-100 on image and
    padding tokens), attention mask, and that row's images (random pixels, never all zero)."""
    _, per_image, side = FAMILIES[model_type]
    g = torch.Generator().manual_seed(seed)
    done = processed_images(model_type, sum(IMAGES_PER_ROW), g) if model_type in IMAGE_PROCESSORS else []
    rows = []
    for n, pad in zip(IMAGES_PER_ROW, PADDING, strict=True):
        ids = torch.randint(3, 280, (SEQ,), generator=g)
        if done:
            images, grids = [p for p, _ in done[:n]], [grid for _, grid in done[:n]]
            done = done[n:]
        elif model_type == "qwen3_5":  # 2x2 patches of 3 x 2 frames x 14 x 14
            images = [torch.rand(4, 3 * 2 * 14 * 14, generator=g, dtype=torch.float64) + 0.1 for _ in range(n)]
            grids = [[1, 2, 2]] * n
        else:
            images = [torch.rand(3, side, side, generator=g, dtype=torch.float64) + 0.1 for _ in range(n)]
            grids = []
        start = 2
        for count in [tokens(grid) for grid in grids] if grids else [per_image] * n:
            ids[start : start + count] = IMAGE
            start += count + 2
        mask = torch.ones(SEQ, dtype=torch.long)
        if pad:
            mask[-pad:] = 0
            ids[-pad:] = 0
        labels = ids.masked_fill((mask == 0) | (ids == IMAGE), -100)
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask, "images": images, "grids": grids})
    return rows


def collate(model_type: str, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The model's inputs for ``rows``, as the family's processor lays them out."""
    out = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "attention_mask")}
    images = [im for r in rows for im in r["images"]]
    is_image = out["input_ids"] == IMAGE
    if model_type in ("smolvlm", "idefics3"):  # (rows, most images in a row, 3, H, W), zero images pad
        most = max(len(r["images"]) for r in rows)
        side = FAMILIES[model_type][2]
        pixels = torch.zeros(len(rows), most, 3, side, side, dtype=torch.float64)
        for i, r in enumerate(rows):
            for j, im in enumerate(r["images"]):
                pixels[i, j] = im
        out["pixel_values"] = pixels
        out["pixel_attention_mask"] = torch.ones(len(rows), most, side, side, dtype=torch.bool)
    elif model_type in PATCHES:  # patches of every image in a row, and each image's (t, h, w) grid
        out["pixel_values"] = torch.cat(images)
        out["image_grid_thw"] = torch.tensor([grid for r in rows for grid in r["grids"]])
        out["mm_token_type_ids"] = is_image.int()
    else:
        out["pixel_values"] = torch.stack(images)
        if model_type == "mistral3":
            out["image_sizes"] = torch.tensor([list(im.shape[1:]) for im in images])
        if model_type == "gemma3":
            out["token_type_ids"] = is_image.long()
    return out


@dataclass
class StepTrace:
    logits: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]
    second_loss: float = 0.0
    frozen: list[str] = field(default_factory=list)


def two_steps(model, batch: dict, ctx=contextlib.nullcontext, dp_group=None) -> StepTrace:
    """Forward, backward, one AdamW step, a second forward: HF's own ``labels=`` loss."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(2):
        with ctx():
            out = model(**batch, use_cache=False)
            if step == 0:
                out.loss.backward()
        loss = full(out.loss).detach().clone()
        if dp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
        losses.append(loss.item())
        if step == 0:
            logits, grads = full(out.logits).detach().clone(), full_grads(model)
            opt.step()
            opt.zero_grad()
    return StepTrace(logits, losses[0], grads, losses[1])


@dataclass
class ImageCase:
    """One wrapper's image + text parity run: :meth:`prepare` in the main thread, :meth:`check` on every rank."""

    model_type: str
    dp: int = 1
    train_vision_tower: bool = False
    ep: int = 1  # expert parallelism over the dp ranks (a MoE language model)
    cp: int = 1  # context parallelism: every cp rank gets the same rows, keeps its share of the tokens
    ac: bool = False  # activation checkpointing (the language model's decoder layers recomputed in backward)
    compile: bool = False  # torch.compile on each of the language model's decoder layers
    diffs: dict[str, float] = field(default_factory=dict)

    @property
    def decodes(self) -> bool:
        """Greedy generate with images is checked at tp2 (not compiled: decoding's growing cache
        would recompile each layer per length)."""
        return self.dp == self.cp == 1 and not self.compile

    def prepare(self) -> None:
        self.config = image_config(self.model_type)
        ref = wrapper_model(self.config)
        self.rows = image_rows(self.model_type, self.config)
        self.candidates = [copy.deepcopy(ref) for _ in range(2 * self.dp * self.cp)]
        self.adapter = hf_tp.get_adapter(self.config)
        for name, p in ref.named_parameters():  # plain HF trains what hf_tp trains
            p.requires_grad_(self.train_vision_tower or not in_tower(self.adapter, name))
        if self.decodes:  # greedy decoding from the first row (two images), before any training
            self.prompt = {k: v for k, v in collate(self.model_type, self.rows[:1]).items() if k != "labels"}
            self.greedy = ref.generate(**self.prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
        self.want = two_steps(ref, collate(self.model_type, self.rows))

    def check(self, rank: int) -> None:
        model = self.candidates[rank]
        mesh = hf_tp.build_mesh(tp=2, dp=self.dp, cp=self.cp, device_type="cpu")
        hf_tp.parallelize(
            model,
            mesh,
            train_vision_tower=self.train_vision_tower,
            ep=self.ep,
            activation_checkpointing=self.ac,
            compile=self.compile,
        )
        if self.decodes:
            tokens = model.generate(**self.prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
            assert torch.equal(tokens, self.greedy), f"model.generate with images: {tokens} vs plain HF {self.greedy}"
        d = mesh.get_local_rank("dp") if self.dp > 1 else 0
        per = len(self.rows) // self.dp
        rows = slice(d * per, (d + 1) * per)
        batch = collate(self.model_type, self.rows[rows])
        group = mesh["dp"].get_group() if self.dp > 1 else None
        calls = _count_calls(model.get_submodule(self.adapter.layers_path)[0])
        got = two_steps(model, batch, ctx=hf_tp.loss_parallel, dp_group=group)
        assert calls == [3 if self.ac else 2], f"first decoder layer ran {calls} times in two forwards"
        assert self.ep == 1 or any(s.tokens_per_expert is not None for s in record_of(model).experts.values()), (
            "no ep dispatch ran"
        )
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        towers = {n for n, _ in model.named_parameters() if in_tower(self.adapter, n)}
        assert (towers <= trainable) == self.train_vision_tower and towers, sorted(towers - trainable)
        assert set(got.grads) <= trainable, sorted(set(got.grads) - trainable)
        want_rows = self.want.logits[rows]
        if self.cp > 1:  # this rank's tokens
            want_rows = want_rows[:, TokenShare(self.cp, mesh.get_local_rank("cp")).indices(want_rows.shape[1])]
        diffs = {"logits": ((got.logits - want_rows).abs().max() / want_rows.abs().max()).item()}
        diffs["loss"] = abs(got.loss - self.want.loss) / abs(self.want.loss)
        diffs["loss after AdamW"] = abs(got.second_loss - self.want.second_loss) / abs(self.want.second_loss)
        grads = {}
        scale = max(w.abs().max().item() for w in self.want.grads.values())
        for name in trainable:
            g, w = got.grads.get(name), self.want.grads.get(name)
            if name.endswith(KEY_BIASES) and g is not None and w is not None:
                # Zero in exact arithmetic (tests/parity.py): its own largest value is round-off, so it
                # is held against the model's largest gradient instead.
                err = (g - w).abs().max().item() / scale
                assert err <= 1e-6, f"{name}: key-bias gradient off by {err:.1e} of the largest gradient"
                continue
            if w is None:
                assert g is None or not g.any(), f"{name}: hf_tp has a gradient HF has not"
                continue
            assert g is not None, f"{name}: no gradient under hf_tp"
            grads[name] = ((g - w).abs().max() / max(w.abs().max().item(), 1e-30)).item()
        assert any(n for n in grads if self.adapter.is_passenger(n)), "no projector gradient compared"
        diffs["grads"] = max(grads.values())
        worst = {k: v for k, v in diffs.items() if v > 1e-5} | {n: v for n, v in grads.items() if v > 1e-5}
        assert not worst, f"{self.model_type} dp={self.dp}: {worst}"
        if rank == 0:
            self.diffs = diffs


def _count_calls(layer: torch.nn.Module) -> list[int]:
    """Calls of the layer's first submodule: one per forward, one more per recompute (HF
    checkpoints a layer's ``forward``, so hooks on the layer itself run once)."""
    calls = [0]
    next(layer.children()).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def run_image_cases(cases: list[ImageCase]) -> dict[tuple[str, int], dict[str, float]]:
    """Prepare every case, then check them in one threaded world per size: (model_type, dp) -> max diffs."""
    for case in cases:
        case.prepare()
    for size in sorted({c.dp * c.cp for c in cases}):
        group = [c for c in cases if c.dp * c.cp == size]
        run_threaded(2 * size, lambda rank, group=group: [c.check(rank) for c in group])
    return {(c.model_type, c.dp): c.diffs for c in cases}
