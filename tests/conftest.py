"""Test scheduling for ``pytest -n 2 --dist loadgroup`` (pytest-xdist, what README.md's command runs).

The end-to-end tests launch tp x dp processes that already keep both cores of a CI machine busy,
and some bound a rank's silence (``--collective-timeout 3``): they run one after another in one
worker. Each unit-test file is a group of its own, so a module's shared fixture (a grid's one
threaded world, an estimate computed once) is built once; the other worker runs them alongside.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        group = "e2e" if path.parent.name == "e2e" else path.stem
        item.add_marker(pytest.mark.xdist_group(group))
