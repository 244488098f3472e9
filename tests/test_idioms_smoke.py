"""benchmarks.idioms at tiny sizes: every idiom computes the engine's residual loss."""

import numpy as np
import pytest

from benchmarks import idioms


@pytest.mark.slow  # (the fast suite's budget)
@pytest.mark.parametrize("name", ["burgers_k2", "ns2d"])
def test_every_idiom_gives_the_engines_loss(name):
    step, args = idioms.step_fn(name, "engine", 16)
    want = float(step(*args)[0][0])
    for idiom in idioms.IDIOMS:
        if not idioms.applies(name, idiom):
            continue
        step, args = idioms.step_fn(name, idiom, 16)
        value = step(*args)[0]
        np.testing.assert_allclose(float(value), want, rtol=2e-2, err_msg=idiom)  # float16 network
