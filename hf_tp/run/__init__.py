"""A training run before and around its loop: its settings (:class:`~hf_tp.run.config.TrainConfig`)
and their checks, the checks before launch, the launcher, a rank's place, model, loss and optimizer,
and the run's folder. ``hf-tp train``'s loop (:mod:`hf_tp.train`), the estimate and verify all build
on it."""
