"""Test scheduling for ``pytest -n 2`` (pytest-xdist, what README.md's command runs).

The end-to-end tests launch tp x dp processes that already keep both cores of a CI machine busy,
and some bound a rank's silence (``--collective-timeout 3``): they all go to one worker, one after
another. Each unit-test file goes to one worker whole, so a module's shared fixture (a grid's one
threaded world, an estimate computed once) is built once; the other worker runs them alongside.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduling with one scope for all of tests/e2e and one per other file.
    (A scheduler of our own, because xdist 3.8's ``xdist_group`` marks are lost under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class OneScopeForE2E(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/e2e" if path.startswith("tests/e2e/") else path

    return OneScopeForE2E(config, log)
