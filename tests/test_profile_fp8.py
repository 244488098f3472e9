"""jaxamp.profile reports the matmul operands of per-tensor scaling and FP8 against their own
format's window (Profile.operands): the scaled operands' largest entry sits just under the
format's largest power of two, and plain FP8's cotangents fall below E4M3's normal range
where the recipe's do not."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.core.window import format_profile, value_range

X = jnp.linspace(0.0, 0.01, 64)


def grad_profile(amp, weight=1.0):
    model = nn.Sequential([nn.Dense(32), jnp.tanh, nn.Dense(32), jnp.tanh, nn.Dense(1)])
    params = jax.tree_util.tree_map(lambda w: w * weight, model.init(jax.random.PRNGKey(0), jnp.zeros(1)))

    def u(p, x):
        return jaxamp.autocast(model.apply, amp)(p, x[None])[0]

    u_xx = jax.vmap(jaxamp.grad(jaxamp.grad(u, 1), 1), (None, 0))

    def loss(p, x):
        return jnp.mean(u_xx(p, x) ** 2)

    return jaxamp.profile(jax.grad(loss), amp)(None, params, X)


# each compiles a float8 or per-tensor train step's profile: with -m slow (the table's rows and the formats'
# windows run fast below)
@pytest.mark.slow
@pytest.mark.parametrize("amp", [jaxamp.AmpConfig(dtype="float8"), jaxamp.AmpConfig(tensor_scaling=True),
                                 jaxamp.AmpConfig(dtype="float8", float8_formats={"tangent": "float8_e5m2"})])
def test_scaled_operands_sit_just_under_their_formats_largest_power_of_two(amp):
    prof = grad_profile(amp)
    roles = {name.split()[0] for name in prof.operands}
    assert roles == {"value", "tangent", "cotangent"}, sorted(prof.operands)
    for name, r in prof.operands.items():
        info = jnp.finfo(name.split()[1])
        emax = math.floor(math.log2(float(info.max)))
        # the largest entry lands in [2**(emax - 2), 2**(emax - 1)] (MARGIN_LOG2 = 1)
        assert emax - 2 <= float(r.log2_max) <= emax - 1, (name, float(r.log2_max))
        assert float(r.frac_overflow) == 0.0, name
    assert sorted(prof.derivatives) == ["1", "2"]  # the derivative rows are still there


@pytest.mark.slow  # two float8 profiles compiled
def test_plain_fp8_cotangents_fall_out_of_e4m3s_window_where_the_recipes_do_not():
    plain = grad_profile(jaxamp.AmpConfig(dtype="float8", tensor_scaling=False, derivative_scaling=False))
    recipe = grad_profile(jaxamp.AmpConfig(dtype="float8"))
    key = "cotangent float8_e4m3fn"
    assert plain.derivatives == {} and key in plain.operands  # plain FP8 has no derivative scalers: operands only
    assert float(plain.operands[key].frac_subnormal) > 10 * float(recipe.operands[key].frac_subnormal)
    assert float(plain.operands[key].headroom_down) < 0 < float(recipe.operands[key].headroom_up)


def test_a_plain_float16_profile_has_no_operand_rows():
    prof = grad_profile(jaxamp.AmpConfig())
    assert prof.operands == {} and prof.keys


def test_the_table_prints_the_operand_rows_against_their_window():
    table = format_profile(grad_profile(jaxamp.AmpConfig(dtype="float8")))
    rows = [line for line in table.splitlines() if line.startswith("operand ")]
    assert [r.split()[1:3] for r in rows] == [["value", "float16"], ["tangent", "float16"],
                                              ["cotangent", "float8_e4m3fn"]]
    end = table.splitlines()[0].index("log2 max") + len("log2 max")  # the columns line up with the header
    assert all(r[end - 1].isdigit() and r[end] == " " for r in rows), rows
    assert "against F's window" in table and "E4M3: 2^-6 to 448" in table


def test_value_range_takes_the_formats_window():
    values = np.array([2.0**-7, 2.0**-5, 300.0, 500.0], np.float32)
    e4m3, fp16 = value_range(values, dtype=jnp.float8_e4m3fn), value_range(values)
    assert float(e4m3.frac_subnormal) == 0.25 and float(e4m3.frac_overflow) == 0.25
    assert float(fp16.frac_subnormal) == 0.0 and float(fp16.frac_overflow) == 0.0
    assert math.isclose(float(e4m3.headroom_up), math.log2(448.0) - math.log2(500.0), abs_tol=1e-5)
