"""The step's kernel-saving forms give what the plain forms give: one finiteness reduction over
leaves of every size (``flags.finite_both``), the step's scalars as one instruction's results
(``step.in_one_kernel``), bit for bit and differentiable."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.training.flags import finite_both
from jaxamp._src.training.step import in_one_kernel

SHAPES = [(3, 5), (5,), (5, 1), (1,), (), (2, 5)]


@pytest.mark.parametrize("where", range(len(SHAPES)))
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("which", [0, 1])
def test_finite_both_finds_one_bad_value_in_any_leaf_of_either_tree(where, bad, which):
    trees = [[jnp.ones(s, jnp.float32) for s in SHAPES], [jnp.ones(s, jnp.float16) for s in SHAPES]]
    leaf = trees[which][where]
    trees[which][where] = leaf.reshape(-1).at[-1].set(bad).reshape(leaf.shape)
    first, second = jax.jit(finite_both)(*trees)
    assert (bool(first), bool(second)) == ((which != 0), (which != 1))


def test_finite_both_of_finite_trees_and_of_no_inexact_leaves():
    tree = {"w": jnp.ones((4, 3)), "n": jnp.arange(3), "b": jnp.zeros(())}
    assert tuple(map(bool, finite_both(tree, tree))) == (True, True)
    assert tuple(map(bool, finite_both({"n": jnp.arange(3)}, ()))) == (True, True)


def test_in_one_kernel_gives_every_leaf_back_bit_for_bit():
    tree = {"f": jnp.float32(-0.0), "nan": jnp.float32(jnp.nan), "inf": jnp.float32(-jnp.inf),
            "h": jnp.float16(3.5), "i": jnp.int32(-(2**31)), "u": jnp.uint8(7), "b": jnp.bool_(True),
            "one": jnp.array([2.5], jnp.float32), "col": jnp.array([[1]], jnp.int32), "big": jnp.arange(4.0)}
    out = jax.jit(in_one_kernel)(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype and out[k].shape == tree[k].shape, k
        bits = lambda a: np.asarray(a).reshape(-1).view(np.uint8)  # noqa: E731
        np.testing.assert_array_equal(bits(out[k]), bits(tree[k]), k)
    text = jax.jit(in_one_kernel).lower(tree).as_text()
    assert text.count("stablehlo.reduce") == 1  # float32, ints and bools: one instruction; the lone float16 apart


def test_in_one_kernel_is_differentiable():
    f = lambda x: sum(jnp.sum(v) for v in in_one_kernel({"a": x, "b": 2 * x, "c": jnp.stack([x])}).values())
    assert float(jax.grad(f)(jnp.float32(1.5))) == 4.0


def test_decision_is_any_of_each_row_from_one_vector():
    from jaxamp._src.training.step import decision

    t, f = jnp.bool_(True), jnp.bool_(False)
    for rows, want in [([[f, f, t], [f]], (True, False)), ([[f, f], [t, f]], (False, True)),
                       ([[f], [f], [f, t]], (False, False, True))]:
        got = jax.jit(decision)(rows)
        assert tuple(map(bool, got)) == want
    text = jax.jit(lambda r: decision(r)[0]).lower([[t, f], [f]]).as_text()
    assert text.count("stablehlo.reduce") == 1  # one reduction, its result a vector
    with pytest.raises(ValueError, match="at least 2"):
        decision([[t]])


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("where", ["f16", "bf16", "f32"])
def test_all_finite_of_leaves_of_several_dtypes_and_sizes(bad, where):
    from jaxamp._src.training.flags import all_finite

    tree = {"f16": jnp.full((3, 2), 65504.0, jnp.float16), "bf16": jnp.full((5,), 3e38, jnp.bfloat16),
            "f32": jnp.full((2, 2), 3.4e38, jnp.float32), "n": jnp.arange(3)}
    assert bool(jax.jit(all_finite)(tree))  # the largest finite values stay finite when widened
    tree[where] = tree[where].reshape(-1).at[-1].set(bad).reshape(tree[where].shape)
    assert not bool(jax.jit(all_finite)(tree))
    assert bool(all_finite({"n": jnp.arange(3)})) and bool(all_finite(()))


@pytest.mark.parametrize("n", [20000, 20011])
def test_all_finite_of_a_long_batch_in_pieces(n):
    """A batch longer than marks.ROW_BOUND is checked in pieces (their ORs fused into the consumers):
    a NaN anywhere, the last (padded) piece included, is found."""
    from jaxamp._src.training.flags import all_finite

    run = jax.jit(all_finite)
    batch = {"interior": jnp.zeros((n, 2)), "boundary": jnp.ones((n // 10, 2))}
    assert bool(run(batch))
    for leaf, at in (("interior", (0, 0)), ("interior", (n - 1, 1)), ("boundary", (n // 10 - 1, 1))):
        assert not bool(run({**batch, leaf: batch[leaf].at[at].set(jnp.nan)})), (leaf, at)
