"""jaxamp._src.derivatives.grad + scaled against the Derivatives engine on the same float16 network.

What is compared: ``dropin.grad`` nested as a JAX user writes it, under ``vmap`` (and
``jit``, ``jacrev``, control flow), against ``Derivatives(method="reverse")``, whose graph is
the same nested ``jax.grad`` except that it differentiates the stacked input vector (one
reverse pass per variable) where the user differentiates one scalar argument. Run op by op
(no ``jit``) the two give bit-identical values; under ``jit`` XLA CPU keeps excess precision
inside fusions that the two graphs form differently, so values are compared to float16
rounding there. Flags (``found_inf``) are compared exactly everywhere. Overflows are forced by
scales that are too big (2**16 on a float16 network) and bad values by an injected NaN point.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from tests.helpers.jax_user import INPUTS, batched, make_net, nested, points

PURE_AND_MIXED = ("u__t__x", "u__x__x__x")  # orders 1-3 on the pure path, a mixed second order
FP16_ROUNDING = 4e-3  # relative to the largest value of a derivative


def _engine(fn, names, amp, method="reverse"):
    return jaxamp.Derivatives(fn, inputs=INPUTS, outputs=("u",), derivatives=names, amp=amp, method=method)


def _scales(keys):
    """Scales 2**-k, a different one per key."""
    return {k: jnp.float32(2.0 ** -(3 + i)) for i, k in enumerate(keys)}


def _flags(found):
    return {k: bool(v) for k, v in found.items()}


def _close(a, b, tol=FP16_ROUNDING):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module")
def net():
    return make_net(jaxamp.AmpConfig())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_term_scaler", "per_order_scaler"])
def test_values_and_flags_equal_reverse_engine_op_by_op(net, mode):
    amp = jaxamp.AmpConfig(mode=mode)
    fn, u_net, params = net
    engine = _engine(fn, PURE_AND_MIXED, amp)
    scales = _scales(engine.scaler_keys)
    names = [n for n in engine.names if "__" in n]
    values, found = jaxamp.scaled(engine)(scales, params, points())
    ours, our_found = jaxamp.scaled(batched(u_net, names), amp)(scales, params, points())
    assert (sorted(jaxamp._src.core.profile.scaler_keys(batched(u_net, names), amp)(params, points()))
            == sorted(engine.scaler_keys))
    if mode == "per_term_scaler":
        assert set(engine.scaler_keys) == {"u", "u__t", "u__x", "u__x__x"}
    for n in names:
        np.testing.assert_array_equal(ours[n], values[n], err_msg=n)
    assert _flags(our_found) == _flags(found)


@pytest.mark.parametrize("method", ["forward", pytest.param("reverse", marks=pytest.mark.slow)])
def test_jit_values_to_rounding_and_forward_engine(net, method):
    amp = jaxamp.AmpConfig()
    fn, u_net, params = net
    names = ("u__x", "u__t__x", "u__x__x", "u__x__x__x", "u__x__x__x__x")
    run = jax.jit(jaxamp.scaled(batched(u_net, names), amp))
    engine = _engine(fn, names, amp, method)
    scales = _scales(engine.scaler_keys)
    values, found = jax.jit(jaxamp.scaled(engine))(scales, params, points())
    ours, our_found = run(scales, params, points())
    for n in names:
        _close(ours[n], values[n])
    assert _flags(our_found) == _flags(found)


def test_overflow_and_bad_values_flag_like_the_engine(net):
    amp = jaxamp.AmpConfig()
    fn, u_net, params = net
    names = ("u__x__x", "u__t__x")
    engine = _engine(fn, names, amp)
    run = jax.jit(jaxamp.scaled(batched(u_net, names), amp))
    clean = points()
    poisoned = dict(clean, x=clean["x"].at[3].set(jnp.nan))
    cases = {  # (points, scales) -> the flags both must raise
        "clean": (clean, {"1": 1.0, "2": 2.0**-4}, {"1": False, "2": False, NONFINITE_VALUES: False}),
        "order 2 overflows": (clean, {"1": 1.0, "2": 2.0**16}, {"1": False, "2": True, NONFINITE_VALUES: False}),
        "order 1 overflows": (clean, {"1": 2.0**18, "2": 1.0}, {"1": True, "2": False, NONFINITE_VALUES: False}),
        "bad values": (poisoned, {"1": 1.0, "2": 1.0}, {"1": False, "2": False, NONFINITE_VALUES: True}),
    }
    for case, (pts, scales, expected) in cases.items():
        scales = {k: jnp.float32(v) for k, v in scales.items()}
        _, found = jax.jit(jaxamp.scaled(engine))(scales, params, pts)
        _, our_found = run(scales, params, pts)
        assert _flags(our_found) == _flags(found) == expected, case


@pytest.mark.parametrize("where", ["inside", pytest.param("outside", marks=pytest.mark.slow),
                                   pytest.param("jacfwd_outside", marks=pytest.mark.slow)])
def test_jacobians_inside_and_outside_scaled(net, where):
    """NTK-style weights: the Jacobian of per-point residuals w.r.t. the parameters (jacrev
    inside or outside ``scaled``, jacfwd outside) equals the engine's."""
    amp = jaxamp.AmpConfig()
    fn, u_net, params = net
    engine = _engine(fn, ("u__x__x",), amp)
    scales = _scales(engine.scaler_keys)
    pts = points()
    residual = lambda p, pts: batched(u_net, ["u__x__x"])(p, pts)["u__x__x"]  # noqa: E731
    expected = jax.jit(jax.jacrev(lambda p: jaxamp.scaled(engine)(scales, p, pts)[0]["u__x__x"]))(params)
    if where == "inside":
        got, found = jax.jit(jaxamp.scaled(lambda p, pts: jax.jacrev(residual)(p, pts), amp))(scales, params, pts)
        assert _flags(found) == {"1": False, "2": False, NONFINITE_VALUES: False}
    else:
        jac = jax.jacrev if where == "outside" else jax.jacfwd
        got = jax.jit(jac(lambda p: jaxamp.scaled(residual, amp)(scales, p, pts)[0]))(params)
    jax.tree_util.tree_map(_close, got, expected)


def test_weight_gradient_of_a_scaled_loss_equals_the_engine_loss(net):
    amp = jaxamp.AmpConfig()
    fn, u_net, params = net
    engine = _engine(fn, ("u__x__x",), amp)
    scales = _scales(engine.scaler_keys)
    pts = points()
    ours = lambda p: jnp.mean(batched(u_net, ["u__x__x"])(p, pts)["u__x__x"] ** 2)  # noqa: E731
    theirs = lambda p: jnp.mean(jaxamp.scaled(engine)(scales, p, pts)[0]["u__x__x"] ** 2)  # noqa: E731
    g_ours, found = jax.jit(jax.grad(lambda p: jaxamp.scaled(ours, amp)(scales, p), has_aux=True))(params)
    jax.tree_util.tree_map(_close, g_ours, jax.jit(jax.grad(theirs))(params))
    assert not any(_flags(found).values())


def test_vmap_over_scaled_gives_flags_per_batch(net):
    amp = jaxamp.AmpConfig()
    _, u_net, params = net
    u_xx = nested(u_net, "u__x__x")
    fn = jaxamp.scaled(lambda p, t, x: u_xx(p, t, x), amp)
    t, x = jnp.full((3,), 0.5), jnp.array([0.1, jnp.nan, 0.3])
    values, found = jax.vmap(fn, (None, None, 0, 0))({"1": 1.0, "2": 1.0}, params, t, x)
    assert values.shape == (3,) and found[NONFINITE_VALUES].tolist() == [False, True, False]
    single, _ = fn({"1": 1.0, "2": 1.0}, params, t[0], x[0])
    _close(values[0], single, 1e-6)  # vmapped vs unbatched graph: float32 rounding


CONTROL_FLOW = ["scan", "while", "cond"] + [pytest.param(name, marks=pytest.mark.slow)  # one compile each
                                            for name in ("flat", "jit", "checkpoint", "custom_jvp")]


@pytest.mark.parametrize("name", CONTROL_FLOW)
def test_control_flow_carries_flags_out(net, name):
    """scan, while, cond, custom_jvp, jit and checkpoint around the derivatives: same values and
    flags as the flat program (run op by op)."""
    amp = jaxamp.AmpConfig()
    _, u_net, params = net
    u_xx = jax.vmap(nested(u_net, "u__x__x"), (None, 0, 0))
    pts = points(6)
    t, x = pts["t"].reshape(3, 2), pts["x"].reshape(3, 2)

    @jax.custom_jvp
    def wrapped(p, t, x):
        return u_xx(p, t, x)

    wrapped.defjvp(lambda primals, tangents: (wrapped(*primals), jnp.zeros(2)))
    programs = {
        "flat": lambda p: u_xx(p, pts["t"], pts["x"]).reshape(3, 2),
        "scan": lambda p: jax.lax.scan(lambda c, tx: (c, u_xx(p, *tx)), 0.0, (t, x))[1],
        "jit": lambda p: jax.jit(u_xx)(p, pts["t"], pts["x"]).reshape(3, 2),
        "checkpoint": lambda p: jax.checkpoint(u_xx)(p, pts["t"], pts["x"]).reshape(3, 2),
        "custom_jvp": lambda p: jnp.stack([wrapped(p, t[i], x[i]) for i in range(3)]),
        "cond": lambda p: jnp.stack([jax.lax.cond(t[i, 0] > -1, lambda i=i: u_xx(p, t[i], x[i]), lambda i=i: t[i])
                                     for i in range(3)]),
        "while": lambda p: jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1].at[c[0]].set(u_xx(p, t[c[0]], x[c[0]]))),
            (0, jnp.zeros((3, 2))))[1],
    }
    scales = {"1": 1.0, "2": 2.0**-4}
    expected, found = jaxamp.scaled(programs["flat"], amp)(scales, params)
    run = jax.jit(jaxamp.scaled(programs[name], amp))
    got, got_found = run(scales, params)
    _close(got, expected)
    assert _flags(got_found) == _flags(found) == {"1": False, "2": False, NONFINITE_VALUES: False}, name
    # flags leave the loop bodies: an order-2 overflow (scale 2**16) anywhere
    _, got_found = run({"1": 1.0, "2": 2.0**16}, params)
    assert _flags(got_found) == {"1": False, "2": True, NONFINITE_VALUES: False}, name


def test_pmap_step_reduces_flags_over_devices():
    """jax.pmap (a shard_map): flags come out replicated, ORed over the mapped axis."""
    g = jax.vmap(jaxamp.grad(jaxamp.grad(lambda x: x**3)))
    step = lambda x: jax.pmap(lambda y: g(y) + jax.lax.psum(0.0, "i"), axis_name="i")(x)  # noqa: E731
    x = jnp.array([[1.0, 1e3]])
    values, found = jax.jit(jaxamp.scaled(step))({"1": 1.0, "2": 2.0**-3}, x)
    np.testing.assert_allclose(values, [[6.0, 6e3]])
    assert _flags(found) == {"1": False, "2": False, NONFINITE_VALUES: False}
    _, found = jax.jit(jaxamp.scaled(step))({"1": 1.0, "2": 2.0**125}, x)
    assert _flags(found) == {"1": False, "2": True, NONFINITE_VALUES: False}
    grads = jax.grad(lambda x: jaxamp.scaled(step)({"1": 1.0, "2": 2.0**-3}, x)[0].sum())(x)
    np.testing.assert_allclose(grads, [[6.0, 6.0]])


def test_outside_scaled_grad_is_jax_grad(net):
    """method="reverse" is jax.grad bit for bit; the default (the engine's plan: forward mode,
    one tangent for the pure second order) equals it to float16 rounding."""
    _, u_net, params = net
    mine = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, 2, method="reverse"), 2, method="reverse"), (None, 0, 0))
    auto = jax.vmap(jaxamp.grad(jaxamp.grad(u_net, 2), 2), (None, 0, 0))
    theirs = jax.vmap(jax.grad(jax.grad(u_net, 2), 2), (None, 0, 0))
    pts = points()
    np.testing.assert_array_equal(mine(params, pts["t"], pts["x"]), theirs(params, pts["t"], pts["x"]))
    args = (params, pts["t"], pts["x"])
    np.testing.assert_array_equal(jax.jit(mine)(*args), jax.jit(theirs)(*args))
    _close(jax.jit(auto)(*args), jax.jit(theirs)(*args), 4e-3)


def test_orders_names_aux_and_argnums():
    f = lambda a, b: jnp.sin(a) * b**3  # noqa: E731
    g1 = jaxamp.grad(f, 1, of="f", wrt="b")
    sum_of_orders = lambda a, b: g1(a, b) + jaxamp.grad(g1, 1, wrt="b")(a, b)  # noqa: E731
    assert jaxamp._src.core.profile.scaler_keys(jaxamp.grad(sum_of_orders, 0))(1.0, 2.0) == ("1", "2", "3")
    per_term = jaxamp.AmpConfig(mode="per_term_scaler")
    assert jaxamp._src.core.profile.scaler_keys(jaxamp.grad(g1, 1, wrt="b"), per_term)(1.0, 2.0) == ("f", "f__b")
    special = jaxamp.AmpConfig(special_terms=("f__b",))
    assert jaxamp._src.core.profile.scaler_keys(jaxamp.grad(g1, 0), special)(1.0, 2.0) == ("1", "f__b")
    (ga, gb), aux = jaxamp.grad(lambda a, b: (f(a, b), a), (0, 1), has_aux=True, wrt=("a", "b"))(1.0, 2.0)
    np.testing.assert_allclose([ga, gb, aux], [np.cos(1.0) * 8, np.sin(1.0) * 12, 1.0], rtol=1e-6)
    out, found = jaxamp.scaled(g1)({"1": 2.0**-10}, 1.0, 2.0)
    np.testing.assert_allclose(out, np.sin(1.0) * 12, rtol=1e-6)
    assert _flags(found) == {"1": False, NONFINITE_VALUES: False}


def test_inactive_scalers_ignore_scales_and_flag_nothing():
    g = jaxamp.grad(lambda x: x**3)
    for amp in (jaxamp.AmpConfig(dtype="float32"), jaxamp.AmpConfig(derivative_scaling=False)):
        out, found = jaxamp.scaled(g, amp)({}, 2.0)
        assert float(out) == 12.0 and found == {}


def test_errors_name_the_problem():
    g = jaxamp.grad(lambda x: x**3)
    with pytest.raises(KeyError, match=r"key '1'.*only the keys \['2'\]"):
        jaxamp.scaled(g)({"2": 1.0}, 2.0)
    with pytest.raises(ValueError, match="unnamed value.*of='u'"):
        jaxamp.scaled(g, jaxamp.AmpConfig(mode="per_term_scaler"))({}, 2.0)
    with pytest.raises(ValueError, match="`wrt`"):
        jaxamp.grad(lambda x, y: x, (0, 1), wrt="x")
    with pytest.raises(TypeError, match="`argnums`"):
        jaxamp.grad(lambda x: x, "x")
    with pytest.raises(TypeError, match="`scales`"):
        jaxamp.scaled(g)([1.0], 2.0)


@pytest.mark.parametrize("method", [pytest.param("reverse", marks=pytest.mark.slow), "auto"])
def test_physical_units_fourth_order_overflows_unscaled_and_is_rescued_by_scales(method):
    """Domain x 0.02, u__x__x__x__x on a float16 network: with every scale 1 a float16 dot of the
    nested reverse passes overflows (the cotangents carry (1/0.02)**3); scales 2**-4(k-1) keep
    every step finite, and the value equals the float32 network's to float16 rounding. (XLA CPU's
    excess precision is on: the overflow is in a dot's float16 output, which it rounds.) Nested
    reverse passes overflow in the fourth step; Taylor mode (``method="auto"``) propagates every
    order's chain at its own scale and overflows at a lower order's chain first."""
    c = 0.02
    _, u16, params = make_net(jaxamp.AmpConfig())
    _, u32, _ = make_net(jaxamp.AmpConfig(enabled=False))
    pts = points(8, scale=c)

    def fourth(u):
        return jax.vmap(nested(lambda p, t, x: u(p, t / c, x / c), "u__x__x__x__x", method=method), (None, 0, 0))

    expected = fourth(u32)(params, pts["t"], pts["x"])
    run = jax.jit(jaxamp.scaled(lambda p: fourth(u16)(p, pts["t"], pts["x"])))
    values, found = run({k: 1.0 for k in "1234"}, params)
    flags = _flags(found)
    if method == "reverse":
        assert flags == {"1": False, "2": False, "3": False, "4": True, NONFINITE_VALUES: False}
    assert any(flags.values()) and not flags[NONFINITE_VALUES]
    assert not np.all(np.isfinite(values))
    values, found = run({k: 2.0 ** (-4 * (int(k) - 1)) for k in "1234"}, params)
    assert not any(_flags(found).values())
    _close(values, expected, 4e-3)
