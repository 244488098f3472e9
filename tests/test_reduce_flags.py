"""core.marks.reduce_flags: each key's flag is any of its per-point flags, whatever the number of
keys (one code per element: 8 keys in a uint8, more in uint32 groups of 32) and flag sizes. Sharded
over devices (an OR per key across them): tests/test_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.core.marks import reduce_flags


def _pending(rng, n_keys, sizes, p):
    """``{key: [flags]}``: each key has 1-3 flag arrays of sizes drawn from ``sizes``, set with probability p."""
    return {f"k{i}": [jnp.asarray(rng.random(rng.choice(sizes)) < p) for _ in range(rng.integers(1, 4))]
            for i in range(n_keys)}


@pytest.mark.parametrize("n_keys", [1, 3, 8, 9, 33, 70])
def test_each_key_any_of_its_flags(n_keys):
    rng = np.random.default_rng(n_keys)
    for p in (0.0, 0.002, 0.5):
        pending = _pending(rng, n_keys, [1, 7, 300], p)
        want = {k: bool(any(np.any(np.asarray(h)) for h in hits)) for k, hits in pending.items()}
        got = jax.jit(reduce_flags)(pending)
        assert {k: bool(v) for k, v in got.items()} == want
        assert all(v.dtype == jnp.bool_ and v.shape == () for v in got.values())


def test_one_set_flag_is_found_in_every_position():
    """A single set element of one key sets that key only (each bit of the code is read back alone)."""
    keys = [f"k{i}" for i in range(40)]
    for hot in (0, 7, 8, 31, 32, 39):
        pending = {k: [jnp.zeros((5, 4), bool).at[3, 2].set(k == keys[hot])] for k in keys}
        got = reduce_flags(pending)
        assert [k for k, v in got.items() if bool(v)] == [keys[hot]]


def test_no_flags():
    assert reduce_flags({}) == {}
