"""jaxamp._src.derivatives's siblings of grad: jacrev, jacfwd, jvp, hessian.

Oracles: outside ``scaled`` they are JAX's functions (to float32 rounding: forward mode goes
through ``jax.linearize``); on a float32 network, scales ``2**k`` give bit-identical values
(binary scaling is exact in float32); on jaxamp's float16 network (XLA CPU's excess precision
on), ``jacfwd`` nested or around ``grad`` gives the Derivatives engine's values to float16
rounding under the same scales, raises the same flags when a key's scale is too large, and
composes with ``vmap``, ``jit`` and ``jacrev`` of the parameters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from tests.helpers.jax_user import INPUTS, make_net, points

FP16_ROUNDING = 4e-3  # relative to the largest value


def _u(p, xy):
    return jnp.tanh(p["w"] @ xy + p["b"]).sum() ** 2


@pytest.fixture(scope="module")
def small():
    key = jax.random.PRNGKey(0)
    return {"w": jax.random.normal(key, (4, 2)), "b": jnp.linspace(-1.0, 1.0, 4)}, jnp.array([0.3, -0.7])


@pytest.mark.parametrize("name", ["hessian", pytest.param("jacrev", marks=pytest.mark.slow),
                                  pytest.param("jacfwd", marks=pytest.mark.slow)])
def test_outside_scaled_they_are_jax(small, name):
    p, xy = small
    vec = lambda p, xy: jnp.tanh(p["w"] @ xy)  # noqa: E731  (a vector output)
    for fn in (_u, vec):
        ours, theirs = (jax.jit(getattr(m, name)(fn, 1))(p, xy) for m in (jaxamp, jax))
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    t = jnp.array([1.0, 0.0])
    ours, theirs = (jax.jit(lambda z, m=m: jnp.stack(m.jvp(lambda z: _u(p, z), (z,), (t,))))(xy) for m in (jaxamp, jax))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_keys_and_binary_scaling_on_float32(small):
    p, xy = small
    lap = lambda p, xy: jnp.trace(jaxamp.hessian(_u, 1)(p, xy))  # noqa: E731
    fwd2 = lambda p, xy: jaxamp.jacfwd(jaxamp.jacfwd(_u, 1), 1)(p, xy)  # noqa: E731
    third = lambda p, xy: jaxamp.jacfwd(jaxamp.hessian(_u, 1), 1)(p, xy)  # noqa: E731
    assert (jaxamp._src.core.profile.scaler_keys(lap)(p, xy) == jaxamp._src.core.profile.scaler_keys(fwd2)(p, xy)
            == ("1", "2"))
    assert jaxamp._src.core.profile.scaler_keys(third)(p, xy) == ("1", "2", "3")
    named = lambda p, xy: jaxamp.hessian(_u, 1, of="u", wrt="xy")(p, xy)  # noqa: E731
    assert (jaxamp._src.core.profile.scaler_keys(named, jaxamp.AmpConfig(mode="per_term_scaler"))(p, xy)
            == ("u", "u__xy"))
    for fn in (lap, fwd2):
        run = jax.jit(jaxamp.scaled(fn))
        one, found = run({"1": 1.0, "2": 1.0}, p, xy)
        for scales in ({"1": 2.0**-3, "2": 2.0**-7}, {"1": 2.0**5, "2": 2.0**-20}):
            values, found = run(scales, p, xy)
            np.testing.assert_array_equal(values, one)
            assert not any(bool(v) for v in found.values())
        _, found = run({"1": 1.0, "2": 2.0**200}, p, xy)  # the order-2 tangents leave float32
        assert {k: bool(v) for k, v in found.items()} == {"1": False, "2": True, NONFINITE_VALUES: False}


@pytest.fixture(scope="module")
def net():
    return make_net(jaxamp.AmpConfig())


def test_float16_jacfwd_gives_the_engines_values_and_flags(net):
    fn, u_net, params = net
    amp = jaxamp.AmpConfig()
    ix = 1 + INPUTS.index("x")
    u_xx = {"jacfwd(grad)": jaxamp.jacfwd(jaxamp.grad(u_net, ix), ix),
            "jacfwd(jacfwd)": jaxamp.jacfwd(jaxamp.jacfwd(u_net, ix), ix)}
    engine = jaxamp.Derivatives(fn, inputs=INPUTS, outputs=("u",), derivatives=("u__x__x",), amp=amp)
    pts = points()
    run_engine = jax.jit(jaxamp.scaled(engine))
    for name, f in u_xx.items():
        run = jax.jit(jaxamp.scaled(jax.vmap(f, (None, 0, 0)), amp))
        for scales, flags in (({"1": 2.0**-3, "2": 2.0**-5}, (False, False)), ({"1": 1.0, "2": 2.0**16}, (False, True)),
                              ({"1": 2.0**18, "2": 1.0}, (True, False))):
            scales = {k: jnp.float32(v) for k, v in scales.items()}
            values, found = run_engine(scales, params, pts)
            ours, our_found = run(scales, params, pts["t"], pts["x"])
            assert (bool(our_found["1"]), bool(our_found["2"])) == flags == (bool(found["1"]), bool(found["2"])), name
            if not any(flags):
                expected = np.asarray(values["u__x__x"])
                np.testing.assert_allclose(ours, expected, atol=FP16_ROUNDING * np.max(np.abs(expected)), err_msg=name)


@pytest.mark.slow  # fast-suite budget: the property keeps a fast test in this file
def test_jacrev_of_the_parameters_around_scaled_jacfwd(net):
    """NTK-style: the parameter Jacobian of per-point u_xx by jacfwd(grad) inside scaled equals
    the one of nested jax.grad at scale 1, to float16 rounding."""
    _, u_net, params = net
    ix = 1 + INPUTS.index("x")
    pts = points()
    ours = jax.vmap(jaxamp.jacfwd(jaxamp.grad(u_net, ix), ix), (None, 0, 0))
    theirs = jax.vmap(jax.grad(jax.grad(u_net, ix), ix), (None, 0, 0))
    scales = {"1": jnp.float32(2.0**-2), "2": jnp.float32(2.0**-4)}
    got = jax.jit(jax.jacrev(lambda p: jaxamp.scaled(ours)(scales, p, pts["t"], pts["x"])[0]))(params)
    expected = jax.jit(jax.jacrev(lambda p: theirs(p, pts["t"], pts["x"])))(params)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-2 * float(np.max(np.abs(b))))


def test_errors_name_the_argument(small):
    p, xy = small
    with pytest.raises(TypeError, match="jaxamp.jacfwd: `fun`=3 must be callable"):
        jaxamp.jacfwd(3)
    with pytest.raises(TypeError, match="jaxamp.jacrev: `argnums`='x' must be an int or a tuple"):
        jaxamp.jacrev(_u, "x")
    with pytest.raises(ValueError, match="jaxamp.jacfwd: `wrt`=\\('x',\\) must be one name"):
        jaxamp.jacfwd(_u, 1, wrt=("x",))
    with pytest.raises(TypeError, match="jaxamp.jvp: `primals` and `tangents` must be tuples of the same length"):
        jaxamp.jvp(lambda z: z, (xy,), ())
    with pytest.raises(TypeError, match="jaxamp.jacfwd: argument 0 .* must hold only float or complex arrays"):
        jaxamp.jacfwd(_u, 0)({"w": jnp.arange(3)}, xy)
    with pytest.raises(TypeError, match="jaxamp.jacrev: `fun`=.* must return one array, got dict"):
        jaxamp.jacrev(lambda p, xy: {"u": _u(p, xy)}, (0, 1))(p, xy)  # (a pytree value: one argnum)


@pytest.mark.parametrize("argnums", [1, pytest.param((0, 1), marks=pytest.mark.slow)])
def test_pytree_arguments_give_jax_structure_and_values(argnums):
    """jacfwd and hessian over dict arguments: jax.jacfwd's / jax.hessian's nested structure and
    values, scaled and checked under scaled (keys 1 and 2)."""
    f = lambda p, x: jnp.sin(p["a"] * x["u"]).sum() * x["v"] ** 2
    p, x = {"a": jnp.float32(2.0)}, {"u": jnp.array([0.3, -0.2]), "v": jnp.float32(3.0)}
    for ours, theirs in ((jaxamp.jacfwd, jax.jacfwd), (jaxamp.hessian, jax.hessian)):
        got, want = ours(f, argnums=argnums)(p, x), theirs(f, argnums=argnums)(p, x)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    scaled_h, found_inf = jaxamp.scaled(jaxamp.hessian(f, argnums=argnums))({"1": 2.0**-3, "2": 2.0**-6}, p, x)
    assert sorted(found_inf) == ["1", "2", "nonfinite_values"]
    want = jax.hessian(f, argnums=argnums)(p, x)
    for a, b in zip(jax.tree_util.tree_leaves(scaled_h), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
