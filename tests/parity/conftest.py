"""Parity suite: jaxamp (JAX) against torch_ref (PyTorch), all on CPU.

torch is an optional (test/extra) dependency: without it the whole directory is skipped.
"""

import os
import sys

import pytest

pytest.importorskip("torch")

# torch_ref lives at the repo root; an editable install made before it existed does not list it.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
