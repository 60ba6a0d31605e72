"""Context parallelism: each row's tokens split over a ``cp`` mesh dim, attention exact across it
(:mod:`~hf_tp.context.token_share`: which tokens a rank holds, sums over cp; :mod:`~hf_tp.context.context_install`:
the checks and the attention function installed on a model)."""
