"""Mixture of experts: the expert styles a plan names (expert tensor parallelism, LoRA on expert
parameters), expert parallelism (whole experts on ranks, all-to-all dispatch, its routing), the
router's aux loss over the global batch (and over pipeline stages), and per-expert checkpoint files."""
