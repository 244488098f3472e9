"""Transition alias: the Poisson builders moved to ``tests.helpers.poisson``.

Removed once every test imports ``from tests.helpers.poisson import ...``.
"""

from tests.helpers.poisson import cached_problem, make_problem  # noqa: F401
