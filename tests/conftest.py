"""Shared test setup: CPU only, deterministic.

Builders that several test modules use live in the ``tests.helpers`` package (import them as
``from tests.helpers.<module> import ...``); a test module never imports another test module.
Tests marked ``slow`` (long end-to-end runs) are deselected by ``scripts/test.sh`` and run by
``.ci/run`` after the fast suite.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
