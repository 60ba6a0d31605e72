"""peft LoRA under :func:`hf_tp.parallelize`: the model unwrapped, checked, and its plans made
LoRA-aware (a branch sharded like its base projection). LoRA on expert parameters is a style of
:mod:`hf_tp.moe`; a LoRA run's export, of :mod:`hf_tp.checkpoint`."""
