"""CodeGen: the generic plan, with the one limit its code adds.

Its ``qkv_proj`` output is laid out as ``mp_num = 4`` groups (a constant in CodeGenAttention, from
the model's original 4-way model-parallel training), each holding the q, v and k columns of a
quarter of the heads. A column-parallel shard is whole groups only when tp divides 4; the
attention's reshape then finds its groups on every rank (checked by the family grid at tp=2 and 4).
"""

from hf_tp.adapters.overrides import register_tp_divisor

register_tp_divisor(("codegen",), "number of groups (mp_num) its attention packs qkv_proj into", 4)
