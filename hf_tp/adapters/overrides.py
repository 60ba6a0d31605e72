"""Moved to :mod:`hf_tp.adapters.families` (the family table); kept while ``hf_tp/plan/build.py``
imports ``base_tp_plan`` from here. Delete once it imports from ``families``."""

from hf_tp.adapters.families import base_tp_plan

__all__ = ["base_tp_plan"]
