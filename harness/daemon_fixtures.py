"""Module fixtures that each name one part of a fixture starting several daemons side by side
(`harness.helpers.Started`): the tests ask for the daemon they use, the daemons' model loads
still overlap."""
from __future__ import annotations

from typing import Any

import pytest


def part_of(group: str, index: int, doc: str) -> Any:
    """A module-scoped fixture whose value is `group`'s value at `index`, `group` being the name of
    a module-scoped fixture that yields a tuple. It is looked up when first used, so `group` must
    not be parametrized."""

    def part(request: pytest.FixtureRequest) -> Any:
        return request.getfixturevalue(group)[index]

    part.__doc__ = doc
    return pytest.fixture(scope="module")(part)
