"""Pipeline parallelism over a ``pp`` mesh dim: an unmodified HF model cut into stages by decoder
layers, each stage parallelized as any model is, run by torch's own schedules."""
