"""A multimodal wrapper's parts around its language model: the passengers (vision tower, projector:
refused, frozen or trained, placed), packed text positions for a 3-D mrope language model, and
DeepStack visual features on a sequence-sharded residual stream. The wrapper's plan is read in
:mod:`hf_tp.adapters.wrapper`; image rows are a data format (:mod:`hf_tp.data.formats.images`)."""
