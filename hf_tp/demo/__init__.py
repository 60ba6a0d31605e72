"""The embedded default run's assets: a tiny Llama and a generated corpus, built locally with no
network (:mod:`hf_tp.demo.assets`); :mod:`hf_tp.train.embedded_run` fills them into a run."""
