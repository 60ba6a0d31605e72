"""Test scheduling for ``pytest -n 2`` (pytest-xdist, what README.md's command runs).

The end-to-end tests launch tp x dp processes that already keep both cores of a CI machine busy,
and some bound a rank's silence (``--collective-timeout 3``): they go to one worker, one after
another (but for a few light files, run last). Each unit-test file goes to one worker whole, so
a module's shared fixture (a grid's one threaded world, an estimate computed once) is built once;
the other worker runs them alongside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# End-to-end files of one or two small launches with no timing bound: scheduled like unit files,
# so the worker done with the unit tests takes them off the long end-to-end queue.
LIGHT_E2E = {"test_bench.py", "test_notebook.py", "test_sharded_loading_memory.py", "test_generate_torchrun.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The light end-to-end files last: taken by whichever worker is free once the rest is given out."""
    items.sort(key=lambda item: Path(str(item.fspath)).name in LIGHT_E2E)  # (stable: the rest in order)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduling with one scope for all of tests/e2e and one per other file.
    (A scheduler of our own, because xdist 3.8's ``xdist_group`` marks are lost under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class OneScopeForE2E(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            heavy = path.startswith("tests/e2e/") and path.rsplit("/", 1)[-1] not in LIGHT_E2E
            return "tests/e2e" if heavy else path

    return OneScopeForE2E(config, log)
