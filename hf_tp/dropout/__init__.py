"""Dropout right under tensor parallelism: masks drawn from streams chosen by placement (the same
where a tensor is replicated over tp, distinct where it is sharded), for a model's own dropout and
for LoRA's."""
