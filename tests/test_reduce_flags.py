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


@pytest.mark.parametrize("n_keys", [1, 3, 8, 9, 33, pytest.param(70, marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("n", [16384, 16385, 20000, 20011, 44000])
def test_long_flags_each_key_found_at_every_piece_edge(n):
    """Past marks.ROW_BOUND the first stage is written out in pieces (a divisor of n, or n padded:
    20 011 is prime) and each key's flag is the OR of its pieces: a set element at either end of a
    piece, or at the last (padded) piece, is found, for its key only."""
    from jaxamp._src.core.marks import _pieces

    pieces = _pieces(n) if n > 16384 else 1
    width = -(-n // pieces)
    run = jax.jit(reduce_flags)
    for at in sorted({0, width - 1, min(width, n - 1), n // 2, n - 1}):
        for hot in ("a", "c"):
            pending = {k: [jnp.zeros(n, bool).at[at].set(k == hot)] for k in ("a", "b", "c")}
            got = run(pending)
            assert {k: bool(v) for k, v in got.items()} == {k: k == hot for k in ("a", "b", "c")}, (n, at, hot)
    assert not any(bool(v) for v in run({k: [jnp.zeros(n, bool)] for k in "ab"}).values())


def test_pieces_short_rows_whole_divisors():
    """The pieces of a long row: about sqrt(n) of them, each at most marks.ROW_BOUND long, a divisor
    of n with the most factors of 2 where one lies within a factor 2 of sqrt(n) (20 000: 160 pieces
    of 125 points, whole for 2, 4, 8, 16 or 32 devices), else a power of 2 with n padded."""
    from jaxamp._src.core.marks import ROW_BOUND, _pieces

    assert _pieces(20000) == 160 and _pieces(44000) == 160
    assert _pieces(20011) == 128  # prime: padded to 20 096
    for n in (16385, 20000, 20011, 44000, 10**6, 10**8):
        p = _pieces(n)
        assert -(-n // p) <= ROW_BOUND and p <= 2 * int(n ** 0.5) + 1, (n, p)


_SHARDED = r"""
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxamp._src.core.marks import reduce_flags
from jaxamp._src.training.flags import all_finite
mesh = Mesh(jax.devices(), ("d",))
points = NamedSharding(mesh, P("d"))
for n in (20000, 20008):  # 160 pieces (20 per device); 164 (not a multiple of 8)
    run = jax.jit(lambda a, b, x: (reduce_flags({"a": [a], "b": [b]}), all_finite(x)))
    for at in (0, 7777, n - 1):
        a = jax.device_put(jnp.zeros(n, bool).at[at].set(True), points)
        b = jax.device_put(jnp.zeros(n, bool), points)
        x = jax.device_put(jnp.zeros((n, 2)).at[at, 1].set(jnp.nan), NamedSharding(mesh, P("d", None)))
        flags, finite = run(a, b, x)
        assert bool(flags["a"]) and not bool(flags["b"]) and not bool(finite), (n, at)
print("ok")
"""


@pytest.mark.slow  # a subprocess on 8 fake devices
def test_long_flags_with_points_sharded_over_8_devices():
    """Past marks.ROW_BOUND, the pieces of a point axis sharded over 8 devices (a divisor of 8 or
    not) give each key's flag and the batch's check as on one device."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
