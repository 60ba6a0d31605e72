"""``hf-tp verify``: a layout checked on the user's own ranks against a single-rank reference.

A random copy of the model's config, cut to one layer of each kind at small widths
(:mod:`~hf_tp.adapters.shrink`), is trained a few steps by plain HF on one rank
(:mod:`~hf_tp.verify.single_rank`) and by the requested layout built as ``hf-tp train`` builds it
(:mod:`~hf_tp.verify.candidate`); logits, loss, gradients, buffers, AdamW steps, a checkpoint
resumed on another mesh and the export (:mod:`~hf_tp.verify.roundtrip`) are compared
(:mod:`~hf_tp.verify.compare`), one line per check (:mod:`~hf_tp.verify.report`). The rank's
flow is :mod:`~hf_tp.verify.run`; :mod:`~hf_tp.verify.injected_faults` injects known faults for tests.
"""
