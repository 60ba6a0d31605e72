"""The wrapper grid: every multimodal wrapper of the installed transformers whose language model
is a family hf_tp trains, as a tiny random checkpoint of its real config classes (the family
grid's text sizes, a one-layer vision or audio tower), trained on text with hf_tp and compared
with plain single-process transformers on the same wrapper.

Used by tests/unit/test_wrapper_grid.py (a sample, in one threaded world) and by
scripts/wrapper_grid.py (all of them; it writes the table in docs/multimodal.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PretrainedConfig

import hf_tp
from hf_tp.adapters.census import multimodal_wrapper_types
from hf_tp.adapters.support import TEXT_TOWERS
from hf_tp.core.model_source import model_from_config, text_config_of
from hf_tp.core.record import record_of
from hf_tp.multimodal.passengers import in_tower
from hf_tp.parallel.linear_ce import fusable
from tests.family_grid import GREEDY_TOKENS, _prompt, grid_config, is_moe
from tests.helpers import batch, full, run_threaded
from tests.parity import Trace, assert_parity, train_steps

# The passengers' sizes, set where their config class has the field: one small layer.
PASSENGER_SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_layers=1,
    depth=1,
    num_attention_heads=2,
    num_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    embed_dim=32,
    image_size=28,
    patch_size=14,
    out_hidden_size=64,  # the text model's hidden size (Qwen3.5's vision merger writes into it)
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
)
# What a wrapper needs beyond that to build at these sizes (sub-config -> fields).
# ("" is the wrapper's own config.)
WRAPPER_EXTRAS: dict[str, dict[str, dict]] = {
    "apertus1p5": {  # its image and audio token ranges inside the grid's 301-token vocab
        "vision_config": dict(codebook_size=64, base_channels=32, num_res_blocks=1),
        "audio_config": dict(codebook_dim=32, codebook_size=64, decoder_hidden_size=32, decoder_num_layers=1),
        "": dict(image_token_offset=100, audio_token_offset=164),
    },
    "dots3_note": dict(
        vision_config=dict(mlp_layer_types=["dense"], per_layer_config={}, adapter_in_dim=32, adapter_out_dim=64),
        audio_config=dict(adapter_input_size=32, adapter_out_dim=64, downsample_hidden_size=32),
    ),
    "fun_asr_nano": dict(adaptor_config=dict(hidden_size=64, intermediate_size=16, projector_hidden_size=64)),
    "lfm3_vl": dict(vision_config=dict(layer_types=["full_attention"]), **{"": dict(projector_hidden_size=64)}),
    "janus": dict(vq_config=dict(num_embeddings=64, base_channels=32, projection_dim=64, image_token_embed_dim=64)),
    "ovis2": dict(vision_config=dict(vocab_size=64)),
    **{
        mt: dict(
            encoder_config=dict(hidden_dim=32, num_layers=1, num_heads=2, dim_head=16),
            projector_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, encoder_hidden_size=32),
        )
        for mt in ("granite_speech", "granite_speech_plus")
    },
    **{
        "vibevoice_asr": {
            key: dict(depths=[1] * 7, hidden_size=16, num_filters=8)
            for key in ("semantic_tokenizer_encoder_config", "acoustic_tokenizer_encoder_config")
        }
    },
}


def wrapper_config(model_type: str, **text_overrides) -> PretrainedConfig:
    """A tiny config of ``model_type`` from its own config classes: the family grid's text config
    of its language model, its other sub-configs shrunk to one small layer."""
    default = AutoConfig.for_model(model_type)
    text = grid_config(text_config_of(default).model_type, **text_overrides)
    fields: dict = {"text_config": text.to_dict()}
    extras = WRAPPER_EXTRAS.get(model_type, {})
    for key in default.sub_configs:
        sub = getattr(default, key, None)
        if key == "text_config" or not isinstance(sub, PretrainedConfig):
            continue
        values = sub.to_dict()
        fields[key] = {**values, **{k: v for k, v in PASSENGER_SIZES.items() if k in values}, **extras.get(key, {})}
    return AutoConfig.for_model(model_type, **fields, **extras.get("", {}))


def wrapper_model(config: PretrainedConfig) -> torch.nn.Module:
    """float64 (as the family grid's), random 1-D parameters of the language model."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    extra = {"experts_implementation": "eager"} if is_moe(text_config_of(config)) else {}
    try:
        model = model_from_config(config, attn_implementation="sdpa", dtype=torch.float64, **extra)
    except ValueError:  # no sdpa path for one of its towers
        torch.set_default_dtype(default)
        model = model_from_config(config, attn_implementation="eager", dtype=torch.float64, **extra)
    assert torch.get_default_dtype() == default
    lm = hf_tp.get_adapter(config).language_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(lm + ".") and p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


@dataclass
class WrapperResult:
    model_type: str
    text_type: str
    status: str  # "parity", "refused" or "not built"
    reason: str = ""
    logits_diff: float = 0.0  # max |hf_tp - HF| of the logits (relative to their max)
    grad_diff: float = 0.0  # max over trainable parameters of max |diff| / max |HF grad|
    loss_diff: float = 0.0  # max relative difference of the AdamW steps' losses


@dataclass
class WrapperCase:
    """One wrapper's parity run, split so that many share one threaded world: :meth:`prepare`
    in the main thread (it draws from the CPU RNG), :meth:`check` on every rank."""

    model_type: str
    tp: int = 2
    dp: int = 1
    steps: int = 3
    ep: int = 1  # expert parallelism over the dp ranks (a MoE language model)

    def prepare(self) -> WrapperResult | None:
        """Build the wrapper, run plain HF; None when ready to check, else the result (refused)."""
        default = AutoConfig.for_model(self.model_type)
        self.text_type = text_config_of(default).model_type
        try:
            self.config = wrapper_config(self.model_type)
        except Exception as exc:  # noqa: BLE001 - transformers' own validators (not ValueErrors), a missing package
            return WrapperResult(self.model_type, self.text_type, "not built", _first_line(exc))
        try:
            hf_tp.get_adapter(self.config).validate(self.config, self.tp)
        except ValueError as exc:
            return WrapperResult(self.model_type, self.text_type, "refused", _first_line(exc))
        ref = wrapper_model(self.config)
        vocab = text_config_of(self.config).vocab_size
        self.data = batch(vocab, b=2 * self.dp, s=13, pad="right" if self.dp == 1 else None)
        self.prompt = _prompt(vocab)
        self.greedy = ref.generate(**self.prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
        self.candidates = [copy.deepcopy(ref) for _ in range(self.tp * self.dp)]
        self.want = train_steps(ref, self.data, steps=self.steps)
        adapter = hf_tp.get_adapter(self.config)
        # text never reaches the passengers in plain HF either: freezing them changes nothing
        assert not any(adapter.is_passenger(n) for n in self.want.grads), sorted(self.want.grads)
        self.got: dict[int, Trace] = {}
        return None

    def check(self, rank: int) -> None:
        model = self.candidates[rank]
        mesh = hf_tp.build_mesh(tp=self.tp, dp=self.dp, device_type="cpu")
        hf_tp.parallelize(model, mesh, ep=self.ep)
        adapter = hf_tp.get_adapter(self.config)
        assert all(not p.requires_grad for n, p in model.named_parameters() if in_tower(adapter, n))
        if self.dp == 1:
            got = model.generate(**self.prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
            assert torch.equal(got, self.greedy), f"model.generate: {got} vs plain HF {self.greedy}"
            if fusable(model):  # the fused lm_head + loss runs the wrapper's base model, as its forward does
                with torch.no_grad():
                    fused = full(hf_tp.causal_lm_loss(model, **self.data)).item()
                assert abs(fused - self.want.losses[0]) <= 1e-5 * abs(self.want.losses[0]), (fused, self.want.losses)
        else:  # FSDP2 shards the passengers over dp (units of their own), replicated over tp
            assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if adapter.is_passenger(n))
        model.train()
        d = mesh.get_local_rank("dp") if self.dp > 1 else 0
        rows = slice(2 * d, 2 * d + 2)
        local = {k: v[rows] for k, v in self.data.items()}
        dp_group = mesh["dp"].get_group() if self.dp > 1 else None
        got = train_steps(model, local, steps=self.steps, ctx=hf_tp.loss_parallel, dp_group=dp_group)
        assert self.ep == 1 or any(s.tokens_per_expert is not None for s in record_of(model).experts.values()), (
            "no ep dispatch ran"
        )
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert set(got.grads) <= trainable, sorted(set(got.grads) - trainable)
        assert_parity(_trainable(got, trainable), _trainable(self.want, trainable), rows)
        self.got[rank] = got

    def result(self) -> WrapperResult:
        got = self.got[0]
        trainable = set(got.grads)
        grads = [
            (full(got.grads[n]) - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
            for n, g in self.want.grads.items()
            if n in trainable
        ]
        losses = [abs(a - b) / abs(b) for a, b in zip(got.losses, self.want.losses, strict=True)]
        rows = slice(0, 2)
        logits = (got.logits - self.want.logits[rows]).abs().max() / self.want.logits[rows].abs().max()
        return WrapperResult(
            self.model_type, self.text_type, "parity", "", logits.item(), max(grads, default=0.0), max(losses)
        )


def _trainable(trace: Trace, names: set[str]) -> Trace:
    """The trace restricted to the trainable parameters (the reference trains the whole wrapper,
    whose vision tower gets no gradient from text and so is never changed either)."""
    keep = {n: v for n, v in trace.grads.items() if n in names}
    params = {n: v for n, v in trace.params.items() if n in names}
    start = {n: v for n, v in trace.start.items() if n in names}
    return Trace(logits=trace.logits, grads=keep, losses=trace.losses, params=params, start=start)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"[:300]


def run_cases(cases: list[WrapperCase]) -> list[WrapperResult]:
    """Prepare every case, then check all of them in one threaded world of their size."""
    results: dict[str, WrapperResult] = {}
    ready = []
    for case in cases:
        early = case.prepare()
        if early is None:
            ready.append(case)
        else:
            results[case.model_type] = early
    sizes = {c.tp * c.dp for c in ready}
    for size in sorted(sizes):
        group = [c for c in ready if c.tp * c.dp == size]
        run_threaded(size, lambda rank, group=group: [c.check(rank) for c in group])
        for c in group:
            results[c.model_type] = c.result()
    return [results[c.model_type] for c in cases]


def wrapper_types() -> dict[str, str]:
    """Wrapper model_type -> its text tower's, for every wrapper whose text tower hf_tp supports."""
    supported = set(hf_tp.supported_model_types()) | set(TEXT_TOWERS)  # towers trained inside their wrapper
    return {mt: text for mt, text in multimodal_wrapper_types().items() if text in supported}
