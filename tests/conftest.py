"""Shared test setup: CPU only, deterministic."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
