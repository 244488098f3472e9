"""benchmarks.peers at tiny sizes: folx, jnp.trace(jax.hessian) and jaxamp.laplacian agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import folx  # noqa: E402,F401  (the test extra installs it)

from benchmarks import peers  # noqa: E402
from benchmarks.laplacian import init_mlp  # noqa: E402


@pytest.mark.parametrize("d", [2, 5])
def test_three_laplacians_agree_in_float32(d):
    params = init_mlp(d, 8, 2)
    x = jax.random.uniform(jax.random.PRNGKey(1), (6, d), jnp.float32, -1.0, 1.0)
    vals = {m: jax.jit(peers.value_fn(m))(params, x) for m in peers.METHODS}
    for m in peers.METHODS:
        np.testing.assert_allclose(vals[m], vals["hessian"], rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(jnp.abs(vals["hessian"]))))
    grads = {m: jax.jit(peers.step_fn(m))(params, x) for m in peers.METHODS}
    for m in peers.METHODS:
        for a, b in zip(jax.tree_util.tree_leaves(grads[m]), jax.tree_util.tree_leaves(grads["hessian"])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-7)
