"""Per-tensor scaling (jaxamp/_src/placement/tensor_scale.py, AmpConfig(tensor_scaling=True)).

Oracles: binary scaling commutes with rounding for normal numbers, so a per-tensor scaled
float16 product equals the unscaled float16 product (float32 accumulation) bit for bit while
the operands stay normal; JAX's own float32 derivatives, to float16 rounding; plain float16,
which flushes a tiny tangent that the per-tensor scale keeps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import jaxamp
from jaxamp._src.placement.tensor_scale import scale_for, scaled_dot

MM = (((1,), (0,)), ((), ()))  # a @ b
VM = (((0,), (0,)), ((), ()))  # x @ b for a vector x


def plain16(a, b, dims=MM):
    return lax.dot_general(a.astype(jnp.float16), b.astype(jnp.float16), dims, preferred_element_type=jnp.float32)


def operands(seed=0, shape=((4, 5), (5, 3))):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(ka, shape[0]), jax.random.normal(kb, shape[1])


def test_scales_are_powers_of_two_that_fill_the_window_and_one_for_zero_or_nonfinite():
    for v in (3e-7, 0.5, 1.0, 700.0, 6e4):
        s = float(scale_for(jnp.array([v, -v / 3]), jnp.float16))
        assert s == 2.0 ** round(np.log2(s))
        assert 2.0**13 <= v * s <= 2.0**14
    for v in (0.0, np.inf, np.nan):
        assert float(scale_for(jnp.array([v, 0.0]), jnp.float16)) == 1.0


def test_the_unscale_holds_scales_whose_product_leaves_float32():
    # each operand 2**-50 takes the scale 2**64; together 2**128 is past float32's largest power
    # of two, while the product 3 * 2**-100 is a normal float32 number
    a, b = jnp.full((2, 3), 2.0**-50), jnp.full((3, 2), 2.0**-50)
    for fmt in ("float16", "float8_e4m3fn", "float8_e5m2"):
        out = jax.jit(lambda a, b: scaled_dot(a, b, MM, (fmt,) * 3))(a, b)
        np.testing.assert_array_equal(out, np.full((2, 2), 3 * 2.0**-100, np.float32))


def test_normal_operands_give_the_float16_product_bit_for_bit_at_any_binary_scale():
    a, b = operands()
    ref = plain16(a, b)
    np.testing.assert_array_equal(scaled_dot(a, b, MM), ref)
    for ka, kb in ((-10, 5), (7, -3), (0, 12)):
        np.testing.assert_array_equal(scaled_dot(a * 2.0**ka, b * 2.0**kb, MM), ref * 2.0 ** (ka + kb))


def test_tiny_and_huge_operands_keep_their_digits_where_float16_loses_them():
    a, b = operands(1)
    exact = (a * 1e-7) @ b
    got, plain = scaled_dot(a * 1e-7, b, MM), plain16(a * 1e-7, b)
    assert float(jnp.max(jnp.abs(got - exact) / jnp.max(jnp.abs(exact)))) < 2e-3
    assert float(jnp.max(jnp.abs(plain - exact) / jnp.max(jnp.abs(exact)))) > 2e-2  # subnormals
    big = scaled_dot(a * 1e6, b, MM)
    assert bool(jnp.all(jnp.isfinite(big))) and not bool(jnp.all(jnp.isfinite(plain16(a * 1e6, b))))


def test_an_outer_product_rounds_each_entry_under_its_own_scale_with_no_amax():
    # a contraction of length 1 (a 1-D input's first layer, a one-output layer's cotangent)
    a, b = operands(3)
    a, b = a[:, :1], b[:1, :]
    np.testing.assert_array_equal(scaled_dot(a, b, MM), plain16(a, b))  # in range: the float16 product
    wide = a * 2.0 ** jnp.arange(-60, 60, 120 / a.shape[0])[: a.shape[0], None]  # beyond one scale's window
    got, exact = scaled_dot(wide, b, MM), wide @ b
    assert float(jnp.max(jnp.abs(got - exact) / jnp.abs(exact))) <= 2.0**-11
    lowered = jax.jit(lambda a, b: scaled_dot(a, b, MM)).lower(wide, b).as_text()
    assert "reduce" not in lowered  # elementwise scales: no reduction before the product
    assert not bool(jnp.all(jnp.isfinite(scaled_dot(a.at[0, 0].set(jnp.inf), b, MM)[0])))


def test_inf_and_nan_operands_stay_visible():
    a, b = operands(2)
    assert not bool(jnp.all(jnp.isfinite(scaled_dot(a.at[0, 0].set(jnp.inf), b, MM)[0])))
    assert bool(jnp.isnan(scaled_dot(a, b.at[1, 1].set(jnp.nan), MM)[:, 1]).all())


def test_transformations_agree_with_float32_to_float16_rounding():
    a, b = operands(3, ((7, 5), (5, 3)))
    f = lambda x: jnp.tanh(scaled_dot(x, b, VM)).sum()  # noqa: E731
    g = lambda x: jnp.tanh(x @ b).sum()  # noqa: E731
    tol = dict(rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(jax.vmap(lambda x: scaled_dot(x, b, VM))(a), a @ b, **tol)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(a[0]), jax.grad(g)(a[0]), **tol)
    np.testing.assert_allclose(jax.jacfwd(jax.grad(f))(a[0]), jax.hessian(g)(a[0]), **tol)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(a), jax.vmap(jax.grad(g))(a), **tol)
    ab = jax.random.normal(jax.random.PRNGKey(9), (7, 5, 3))
    for fn, axes, want in ((lambda x, y: scaled_dot(x, y, VM), (0, 0), jnp.einsum("bj,bjk->bk", a, ab)),
                           (lambda y: scaled_dot(a[0], y, VM), (0,), jnp.einsum("j,bjk->bk", a[0], ab))):
        np.testing.assert_allclose(jax.vmap(fn, axes)(*([a, ab] if len(axes) == 2 else [ab])), want, **tol)
    w_grad = jax.grad(lambda w: jnp.sum(scaled_dot(a, w, MM) ** 2))(b)
    np.testing.assert_allclose(w_grad, jax.grad(lambda w: jnp.sum((a @ w) ** 2))(b), rtol=5e-3, atol=5e-2)


def test_a_tangent_gets_its_own_scale():
    """A tangent 1e-7 times the value: plain float16 flushes it, the tangent's own scale keeps it."""
    a, b = operands(4)
    ta = a[::-1] * 1e-7
    exact = jax.jvp(lambda x: x @ b, (a,), (ta,))[1]
    ours = jax.jvp(lambda x: scaled_dot(x, b, MM), (a,), (ta,))[1]
    plain = jax.jvp(lambda x: plain16(x, b), (a,), (ta,))[1]
    err = lambda t: float(jnp.max(jnp.abs(t - exact)) / jnp.max(jnp.abs(exact)))  # noqa: E731
    assert err(ours) < 2e-3 < 2e-2 < err(plain)


def mlp(p, x):
    h = jnp.tanh(x * p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])  # the first layer on the inputs: float32
    h = jnp.tanh(h @ p["w3"] + p["b3"])
    return h @ p["w4"]


def params(width=16):
    k = jax.random.split(jax.random.PRNGKey(5), 4)
    return {"w1": jax.random.normal(k[0], (width,)), "b1": jnp.zeros(width),
            "w2": jax.random.normal(k[1], (width, width)) / 4, "b2": jnp.zeros(width),
            "w3": jax.random.normal(k[2], (width, width)) / 4, "b3": jnp.zeros(width),
            "w4": jax.random.normal(k[3], (width,)) / 4}


def test_autocast_with_tensor_scaling_matches_float32_and_off_is_unchanged():
    p, x = params(), jnp.float32(0.3)
    on, off = jaxamp.AmpConfig(tensor_scaling=True), jaxamp.AmpConfig()
    net_on, net_off = jaxamp.autocast(mlp, on), jaxamp.autocast(mlp, off)
    assert "jaxamp_scaled_dot" in str(jax.make_jaxpr(net_on)(p, x))
    assert "jaxamp_scaled_dot" not in str(jax.make_jaxpr(net_off)(p, x))
    u_xx = lambda net: jaxamp.grad(jaxamp.grad(net, 1), 1)  # noqa: E731
    want, want_xx = mlp(p, x), jax.grad(jax.grad(mlp, 1), 1)(p, x)
    for amp, net in ((on, net_on), (off, net_off)):
        np.testing.assert_allclose(net(p, x), want, rtol=5e-3, atol=5e-3)
        got_xx, found = jaxamp.scaled(u_xx(net), amp)({"1": 1.0, "2": 1.0}, p, x)
        np.testing.assert_allclose(got_xx, want_xx, rtol=1e-2, atol=1e-2)
        assert not any(bool(v) for v in found.values())


def test_the_user_step_trains_with_tensor_scaling():
    amp = jaxamp.AmpConfig(tensor_scaling=True)
    net = jaxamp.autocast(mlp, amp)
    xs = jnp.linspace(0.0, 1.0, 32)

    def loss(p, xs):
        u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(net, 1), 1), (None, 0))(p, xs)
        return jnp.mean((u_xx + jnp.sin(xs)) ** 2)

    import optax

    state = jaxamp.init(loss, amp)(params(), xs)
    opt = jaxamp.optimizer(optax.adam(3e-3), amp_state=state)
    p, opt_state = params(), opt.init(params())

    @jax.jit
    def step(p, opt_state):
        value, grads, flags = jaxamp.value_and_grad(loss)(opt_state, p, xs)
        updates, opt_state = opt.update(grads, opt_state, p, flags=flags)
        return optax.apply_updates(p, updates), opt_state, value

    first = None
    for _ in range(30):
        p, opt_state, value = step(p, opt_state)
        first = float(value) if first is None else first
    assert np.isfinite(float(value)) and float(value) < first


def test_fp8_recipe_trains_derivatives_to_float8_rounding_and_plain_fp8_is_the_same_program_unscaled():
    p, x = params(), jnp.float32(0.3)
    e4m3 = {"tangent": "float8_e4m3fn"}  # the derivative tangents in FP8 (the default keeps them float16)
    recipe = jaxamp.AmpConfig(dtype="float8", float8_formats=e4m3)
    plain = jaxamp.AmpConfig(dtype="float8", tensor_scaling=False, float8_formats=e4m3)
    assert recipe.tensor_scaling and not plain.tensor_scaling and recipe.scaler_enabled
    want_x = jax.grad(mlp, 1)(p, x)
    got_x, found = jaxamp.scaled(jaxamp.grad(jaxamp.autocast(mlp, recipe), 1), recipe)({"1": 1.0}, p, x)
    np.testing.assert_allclose(got_x, want_x, rtol=0.1, atol=0.05)  # E4M3 tangents: 3 mantissa bits
    assert "float8_e4m3fn" in str(jax.make_jaxpr(jaxamp.grad(jaxamp.autocast(mlp, plain), 1))(p, x))
    # a tangent 1e-6 times smaller: the recipe's scale keeps it, plain FP8 flushes it
    tiny = lambda q: {**q, "w1": q["w1"] * 1e-6}  # noqa: E731
    want = jax.grad(mlp, 1)(tiny(p), x)
    for amp, ok in ((recipe, True), (plain, False)):
        got, _ = jaxamp.scaled(jaxamp.grad(jaxamp.autocast(mlp, amp), 1), amp)({"1": 1.0}, tiny(p), x)
        assert (abs(float(got) - float(want)) < 0.1 * abs(float(want))) == ok, (amp, got, want)


def test_bad_values_are_config_errors():
    with pytest.raises(jaxamp.ConfigError, match=r"amp.tensor_scaling='yes' is not allowed: expected true, false"):
        jaxamp.AmpConfig(tensor_scaling="yes")
    with pytest.raises(ValueError, match="`role`='grad' is not allowed"):
        scaled_dot(jnp.ones((2, 2)), jnp.ones((2, 2)), MM, role="grad")


def _lowered(fun, *args, amp=None) -> str:
    """The StableHLO of ``fun`` (scaled_dot's casts to the operands' formats are in it), under
    ``amp``'s scales at 1 when given (its input derivatives cross the network boundary)."""
    if amp is not None:
        fun = (lambda f: lambda *a: jaxamp.scaled(f, amp)({"1": 1.0}, *a)[0])(fun)
    return jax.jit(fun).lower(*args).as_text()


def test_float8_formats_override_one_role_of_the_recipe():
    amp = jaxamp.AmpConfig(dtype="float8", float8_formats={"tangent": "float8_e5m2"})
    assert amp.matmul_formats == ("float16", "float8_e5m2", "float8_e4m3fn")
    assert jaxamp.AmpConfig.from_dict(amp.to_dict()).matmul_formats == amp.matmul_formats
    p, x = params(), jnp.float32(0.3)
    program = _lowered(jaxamp.grad(jaxamp.autocast(mlp, amp), 1), p, x, amp=amp)
    assert "f8E5M2" in program and "f8E4M3FN" not in program  # the tangents' matmuls take E5M2 operands
    fp8 = jaxamp.AmpConfig(dtype="float8")
    recipe = _lowered(jaxamp.grad(jaxamp.autocast(mlp, fp8), 1), p, x, amp=fp8)
    assert "f8E" not in recipe  # the recipe keeps values and tangents in float16


def test_the_fp8_recipe_puts_the_backward_passes_in_e4m3():
    amp = jaxamp.AmpConfig(dtype="float8")
    assert amp.matmul_formats == ("float16", "float16", "float8_e4m3fn")
    net, p, x = jaxamp.autocast(mlp, amp), params(), jnp.float32(0.3)
    weight_grad = _lowered(jax.grad(lambda q: jaxamp.scaled(jaxamp.grad(net, 1), amp)({"1": 1.0}, q, x)[0]), p)
    assert "f8E4M3FN" in weight_grad and "f8E5M2" not in weight_grad


@pytest.mark.parametrize("keys, match", [
    ({"float8_formats": {"tangent": "float16"}}, r"amp.float8_formats=.* expected \{\} with dtype 'float16'"),
    ({"dtype": "float8", "float8_formats": {"grad": "float16"}},
     r"amp.float8_formats.grad='float16' .*\(unknown role\)"),
    ({"dtype": "float8", "float8_formats": {"tangent": "int8"}}, r"amp.float8_formats.tangent='int8' .* one of"),
    ({"dtype": "float8", "float8_formats": ["float16"]}, r"amp.float8_formats=\['float16'\] .* a mapping"),
    ({"dtype": "bfloat16", "tensor_scaling": True}, r"amp.tensor_scaling=True .* dtype \"bfloat16\""),
])
def test_bad_float8_formats_are_config_errors(keys, match):
    with pytest.raises(jaxamp.ConfigError, match=match):
        jaxamp.AmpConfig(**keys)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_the_amax_of_a_16_bit_operand_is_its_largest_magnitude_bit_for_bit(dtype):
    x = (jax.random.normal(jax.random.PRNGKey(3), (7, 9)) * 300).astype(dtype)
    specials = [np.inf, -np.inf, np.nan, -0.0, 6e-8]
    for v in specials + [None]:
        y = x if v is None else x.at[2, 3].set(v)
        want = jnp.max(jnp.abs(y.astype(jnp.float32)))
        for target in (jnp.float16, jnp.float8_e4m3fn):
            assert float(scale_for(y, target)) == float(scale_for(y.astype(jnp.float32), target))
        if v is None or np.isfinite(v):
            assert float(scale_for(y, jnp.float16)) * float(want) <= 2.0**14


def test_an_operand_already_in_its_format_keeps_scale_one():
    """A float16 operand whose largest entry is near float16's top and whose smallest is near
    its normal floor: a scale would push that entry into the subnormals; scale 1 keeps it, and
    the product is the float16 one bit for bit."""
    a = jnp.array([[6e4, 7e-5, 1.0]], jnp.float16)
    b = jnp.array([[1.0], [1.0], [0.0]], jnp.float16)
    b = b.at[0, 0].set(0.0)
    out = scaled_dot(a, b, MM)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain16(a, b)))
    assert float(out[0, 0]) == float(jnp.float16(7e-5))


def test_out_dtype_sets_the_product_and_its_cotangents_arrive_in_it():
    a, b = operands(5)
    out = scaled_dot(a.astype(jnp.float16), b, MM, out_dtype=jnp.float16)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(scaled_dot(a.astype(jnp.float16), b, MM).astype(jnp.float16)))
    jaxpr = jax.make_jaxpr(jax.grad(lambda b: scaled_dot(a.astype(jnp.float16), b, MM, out_dtype=jnp.float16)
                                    .astype(jnp.float32).sum()))(b)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jaxamp_scaled_dot"]
    cot = [e for e in dots if e.params["role"] == "cotangent"]
    assert len(cot) == 1 and cot[0].invars[0].aval.dtype == jnp.float16


def test_a_non_floating_out_dtype_is_refused_before_any_work():
    a, b = operands(6)
    with pytest.raises(ValueError, match="`out_dtype`=.*int8.*floating dtype"):
        scaled_dot(a, b, MM, out_dtype="int8")


def _scaled_dot_operands(jaxpr) -> list:
    """(role, operand dtypes) of every scaled_dot in ``jaxpr``, nested jaxprs included."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "jaxamp_scaled_dot":
            found.append((e.params["role"], tuple(v.aval.dtype for v in e.invars)))
        for sub in jcore.jaxprs_in_params(e.params):
            found += _scaled_dot_operands(sub)
    return found


def layer_pair(p, x):
    """Two tanh layers; ``twice`` also reads the hidden activation outside the second matmul."""
    h = jnp.tanh(x @ p["w2"] + p["b2"])
    return jnp.tanh(h @ p["w3"] + p["b3"]), h


@pytest.mark.parametrize("twice", [False, True])
def test_a_float16_activation_enters_the_next_matmul_as_float16_only_when_it_is_its_one_reader(twice):
    """autocast with float16 activations: the next matmul multiplies the activation (and its
    tangent) as float16, held in its format (no amax, scale 1), when that matmul is its only
    reader; the products are those of the float32 form it replaces, bit for bit. An activation
    read twice keeps its float32 form, so its cotangents still sum in float32."""
    amp = jaxamp.AmpConfig(tensor_scaling=True, autocast_activation=True, autocast_firstlayer=True)
    p, x = params(), jax.random.normal(jax.random.PRNGKey(8), (6, 16))
    f = (lambda p, x: sum(o.sum() for o in layer_pair(p, x))) if twice else (lambda p, x: layer_pair(p, x)[0].sum())
    net = jaxamp.autocast(f, amp)
    tangent = lambda x: jax.jvp(lambda x: net(p, x), (x,), (jnp.ones_like(x),))[1]  # noqa: E731
    ops = _scaled_dot_operands(jax.make_jaxpr(tangent)(x).jaxpr)
    second = [dtypes[0] for role, dtypes in ops if dtypes[1] == jnp.float32 and role in ("value", "tangent")][-2:]
    assert second == ([jnp.float32] * 2 if twice else [jnp.float16] * 2)
    h16 = jnp.tanh((x @ p["w2"] + p["b2"]).astype(jnp.float16))
    np.testing.assert_array_equal(np.asarray(scaled_dot(h16, p["w3"], MM)),
                                  np.asarray(scaled_dot(h16.astype(jnp.float32), p["w3"], MM)))


def test_the_gradient_program_multiplies_widened_float16_cotangents_as_float16_with_the_same_bits():
    """autocast with float16 activations: each activation's cotangent reaches its matmul's
    transpose as float16 widened to float32. jaxamp.value_and_grad multiplies it as float16 (held
    in its format: scale 1, no amax), and the gradients are those of the widened operand, bit
    for bit (its scale would not have moved it out of float16's normal range)."""
    from jaxamp._src.placement.held import held_operands

    amp = jaxamp.AmpConfig(tensor_scaling=True, autocast_activation=True, autocast_firstlayer=True)
    p, x = params(), jax.random.normal(jax.random.PRNGKey(9), (6, 16))
    net = jaxamp.autocast(lambda p, x: layer_pair(p, x)[0].sum(), amp)
    grad = jax.grad(net)

    def cotangent_operands(fn):
        return [d[0] for role, d in _scaled_dot_operands(jax.make_jaxpr(fn)(p, x).jaxpr) if role == "cotangent"]

    assert jnp.float32 in cotangent_operands(grad)  # as JAX's transpose hands them over
    assert cotangent_operands(held_operands(grad)).count(jnp.float16) > cotangent_operands(grad).count(jnp.float16)
    for a, b in zip(jax.tree_util.tree_leaves(held_operands(grad)(p, x)), jax.tree_util.tree_leaves(grad(p, x))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state = jaxamp.init(net, amp)(p, x)
    jaxpr = jax.make_jaxpr(lambda p: jaxamp.value_and_grad(net)(state, p, x))(p).jaxpr
    held = [d[0] for role, d in _scaled_dot_operands(jaxpr) if role == "cotangent"]
    assert held.count(jnp.float16) == cotangent_operands(held_operands(grad)).count(jnp.float16)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_the_scale_is_exact_at_powers_of_two_and_one_ulp_either_side(dtype):
    """ceil(log2 max|x|) exactly (from the bits, not a float32 log2): the largest scaled entry
    lands in (2**(emax - 2), 2**(emax - 1)] for amax a power of two, one float32 ulp above or
    below it, at float32's smallest normal or near its largest (XLA on CPU flushes float32
    subnormals to zero, so they are not asked)."""
    import math

    emax = math.floor(math.log2(float(jnp.finfo(dtype).max)))
    values = []
    for k in (-126, -30, -1, 0, 1, 7, 15, 40, 127):
        p = np.float32(2.0) ** np.float32(k)
        values += [p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0))]
    for v in values:
        v = np.float32(v)
        if not np.isfinite(v) or v < np.finfo(np.float32).tiny:
            continue
        want = min(max(emax - 1 - math.ceil(math.log2(float(v))), -126), 126)
        got = float(scale_for(jnp.array([v, -v / 2], jnp.float32), dtype))
        assert got == 2.0**want, (v, got, want)
