"""jaxamp's one interpreter, tested directly: :func:`jaxamp._src.core.interpreter.eval_jaxpr` with the
rule :func:`~jaxamp._src.core.interpreter.bind` is the program as written, and :func:`jaxamp.scaled`'s
rule turns the two marks into scales and flags.

Oracles: the traced function itself (bit-identical outputs, under ``jit``, ``custom_jvp``,
``scan``, ``cond``, ``while``); hand-computed scales and flags of the marks (a mark's scale is
the scale of its key; a check flags its key where the value below is finite and the scaled
result is not, and ``nonfinite_values`` where a first derivative's value is not finite).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp._src.core.interpreter import bind, custom_body, eval_jaxpr, sub_jaxpr, sub_jaxprs
from jaxamp._src.core.marks import NONFINITE_VALUES, deriv_check, deriv_scale


@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


def program(x):
    y = jax.jit(lambda z: jnp.tanh(z) * 3.0)(x)
    y = softplus(y) + lax.cond(y[0] > 0, jnp.sin, jnp.cos, y)
    y = lax.scan(lambda c, v: (c * 0.5 + v, c), y, jnp.arange(3.0))[0]
    return lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] * 1.5, c[1] + 1), (y, 0))[0]


def test_bind_rule_is_the_program_as_written():
    x = jnp.linspace(-1.0, 1.0, 5)
    closed = jax.make_jaxpr(program)(x)
    (got,) = eval_jaxpr(closed.jaxpr, closed.consts, [x], bind)
    np.testing.assert_array_equal(got, program(x))
    np.testing.assert_array_equal(jax.jit(lambda z: eval_jaxpr(closed.jaxpr, closed.consts, [z], bind)[0])(x),
                                  jax.jit(program)(x))
    seen = []
    eval_jaxpr(closed.jaxpr, closed.consts, [x], lambda e, v: seen.append(e.primitive.name) or bind(e, v))
    call = "jit" if "jit" in seen else "pjit"  # the name of jax.jit's primitive varies by version
    assert {call, "custom_jvp_call", "cond", "scan", "while"} <= set(seen)
    eqns = {e.primitive.name: e for e in closed.jaxpr.eqns}
    assert sub_jaxpr(eqns[call]) is not None and sub_jaxpr(eqns["scan"]) is None
    assert custom_body(eqns["custom_jvp_call"]) is not None and custom_body(eqns[call]) is None
    assert len(sub_jaxprs(eqns["cond"])) == 2


def test_wrong_arity_is_an_error_naming_the_counts():
    closed = jax.make_jaxpr(lambda a, b: a + b)(1.0, 2.0)
    with pytest.raises(ValueError, match="0 consts and 1 args for a jaxpr with 0 constvars and 2 invars"):
        eval_jaxpr(closed.jaxpr, closed.consts, [1.0], bind)


def marked(g, v):
    """A hand-written step of order 2 (term "u__x"): scale the seed, check the result."""
    s = deriv_scale(v, order=2, term="u__x")
    return deriv_check(g * s, v, order=2, term="u__x") / s


@pytest.mark.parametrize("mode, key", [("per_order_scaler", "2"), ("per_term_scaler", "u__x")])
def test_marks_become_the_scale_of_their_key_and_its_flags(mode, key):
    amp = jaxamp.AmpConfig(mode=mode)
    run = jax.jit(jaxamp.scaled(jax.vmap(marked), amp))
    g, v = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.5, 0.5])
    out, found = run({key: 2.0**-3}, g, v)
    np.testing.assert_array_equal(out, g)  # scaled by 2**-3, checked, unscaled
    assert {k: bool(x) for k, x in found.items()} == {key: False, NONFINITE_VALUES: False}
    _, found = run({key: 2.0**127}, jnp.array([1.0, 2.0**10, 3.0]), v)  # g * s leaves float32
    assert {k: bool(x) for k, x in found.items()} == {key: True, NONFINITE_VALUES: False}
    _, found = run({key: 1.0}, jnp.array([1.0, jnp.inf, 3.0]), jnp.array([0.5, jnp.nan, 0.5]))
    assert not bool(found[key])  # the value below is not finite: no overflow, and order 2 > 1
    with pytest.raises(KeyError, match=f"scaler key {key!r}"):
        run({"other": 1.0}, g, v)


def test_outside_scaled_the_marks_are_inert_and_order_1_reports_bad_values():
    g, v = jnp.array([1.0, 2.0]), jnp.array([0.5, 0.5])
    np.testing.assert_array_equal(jax.vmap(marked)(g, v), g)

    def first(g, v):
        return deriv_check(g * deriv_scale(v, order=1, term=None), v, order=1, term=None)

    _, found = jaxamp.scaled(jax.vmap(first))({"1": 1.0}, g, jnp.array([0.5, jnp.nan]))
    assert {k: bool(x) for k, x in found.items()} == {"1": False, NONFINITE_VALUES: True}
