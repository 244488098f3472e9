import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.poisson import cached_problem, make_problem

FP16 = jaxamp.AmpConfig(dtype="float16")


def tree_equal(a, b):
    return all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))


def test_injected_overflow_skips_the_update_and_backs_off_derivative_scalers():
    state, step, _, batch, _ = cached_problem("fp16_low_loss_scale")
    for _ in range(3):
        state, m = step(state, batch())
        assert not bool(m["skipped"])
    before = state
    state, m = step(state, batch(poison=True))
    assert bool(m["skipped"]) and int(m["skip_reason"]) == jaxamp.SKIP_DERIVATIVE_OVERFLOW
    assert tree_equal(state.params, before.params) and tree_equal(state.opt_state, before.opt_state)
    assert tree_equal(state.loss_scale, before.loss_scale)
    for k in ("1", "2"):
        assert bool(m[f"found_inf/{k}"])
        assert float(state.deriv_scales[k].scale) == 0.5 * float(before.deriv_scales[k].scale)
        assert int(state.deriv_scales[k].growth_tracker) == 0
    assert int(state.step) == int(before.step) + 1
    state, m = step(state, batch())
    assert not bool(m["skipped"]) and not tree_equal(state.params, before.params)


def test_thousand_steps_with_ten_percent_injected_never_produce_nonfinite_params():
    state, _, step, batch, _ = cached_problem("fp16")
    rng = np.random.default_rng(0)
    poison = jnp.asarray(rng.random(1000) < 0.1)
    xs = batch()["x"]

    @jax.jit
    def run(state, poison):
        def body(s, p):
            prev = s
            s, m = step(s, {"x": xs, "poison": p})
            same = jnp.stack([jnp.all(a == b) for a, b in zip(jax.tree_util.tree_leaves((prev.params, prev.opt_state)),
                                                              jax.tree_util.tree_leaves((s.params, s.opt_state)))]).all()
            return s, (m["skipped"], m["skip_reason"], same, jaxamp.all_finite(s.params), m["loss"])
        return jax.lax.scan(body, state, poison)

    final, (skipped, reason, unchanged, finite, loss) = run(state, poison)
    assert bool(jnp.all(finite))
    assert bool(jnp.all(skipped[poison])) and bool(jnp.all(unchanged[poison]))
    assert bool(jnp.all(reason[poison] == jaxamp.SKIP_DERIVATIVE_OVERFLOW))
    assert int(jnp.sum(poison)) > 50
    assert bool(jnp.all(jnp.isfinite(loss[~poison])))
    # 10 % overflow steps outpace the recover growth (one doubling per 100 clean steps), so the
    # derivative scales only fall here: every injected step halves them.
    assert float(final.deriv_scales["2"].scale) < 2.0**-20


def test_nonfinite_weight_gradients_back_off_the_loss_scaler_and_skip():
    state, step, _, batch, _ = cached_problem("fp16")
    # A loss scale of 2^30 overflows the fp16 weight gradients on the first step.
    state = state._replace(loss_scale=jaxamp.ScaleState(jnp.float32(2.0**30), jnp.int32(7)))
    new, m = step(state, batch())
    assert int(m["skip_reason"]) == jaxamp.SKIP_NONFINITE_GRADS and bool(m["skipped"])
    assert float(new.loss_scale.scale) == 2.0**29 and int(new.loss_scale.growth_tracker) == 0
    assert tree_equal(new.params, state.params) and tree_equal(new.opt_state, state.opt_state)
    assert all(int(s.growth_tracker) == 1 for s in new.deriv_scales.values())  # a clean step for them


def test_clean_step_counts_for_the_loss_scaler_and_clips():
    amp = jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**4, "growth_interval": 2,
                                                         "recover_growth_interval": 1, "recover_threshold": 1.0})
    state, step, batch, _ = make_problem(amp)
    step = jax.jit(step)
    s1, m1 = step(state, batch())
    s2, m2 = step(s1, batch())
    assert not bool(m1["skipped"]) and int(s1.loss_scale.growth_tracker) == 1 and float(s1.loss_scale.scale) == 16
    assert float(s2.loss_scale.scale) == 32 and int(s2.loss_scale.growth_tracker) == 0
    assert float(m1["scale_log2/loss"]) == 4.0 and float(m2["scale_log2/loss"]) == 5.0


def test_grad_clipping_matches_torch_formula():
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}
    clipped, norm = jaxamp.clip_by_global_norm(g, 0.5)
    assert float(norm) == 13.0
    coef = 0.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(clipped["a"], np.array([3.0, 4.0]) * coef, rtol=1e-7)
    same, _ = jaxamp.clip_by_global_norm(g, 100.0)
    assert tree_equal(same, g)


def test_step_compiles_once_and_has_no_host_callback():
    traces = []
    state, _, step, batch, _ = cached_problem("fp16")

    def counted(s, b):
        traces.append(1)
        return step(s, b)

    jitted = jax.jit(counted)
    for i in range(5):
        state, _ = jitted(state, batch(poison=(i == 2)))
    assert len(traces) == 1
    text = jax.jit(step).lower(state, batch()).as_text()
    assert "callback" not in text.lower() and "outfeed" not in text.lower()
    hlo = str(jax.make_jaxpr(step)(state, batch()))
    assert "callback" not in hlo and "debug" not in hlo


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_and_fp32_run_the_same_step_with_scalers_inactive(dtype):
    state, step, _, batch, engine = cached_problem({"bfloat16": "bf16", "float32": "fp32"}[dtype])
    assert engine.scaler_keys == () and state.deriv_scales == {} and float(state.loss_scale.scale) == 1.0
    first = None
    for _ in range(20):
        state, m = step(state, batch())
        first = float(m["loss"]) if first is None else first
        assert not bool(m["skipped"])
    assert float(m["loss"]) < first and jaxamp.all_finite(state.params)
    assert float(state.loss_scale.scale) == 1.0 and set(k for k in m if k.startswith("scale_log2/")) == {"scale_log2/loss"}


def test_unknown_flag_keys_and_bad_arguments_are_rejected():
    state, _, _, batch, _ = cached_problem("fp16")
    opt = optax.adam(1e-3)

    def loss_fn(params, b, scales):
        return jnp.float32(0.0) * sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(params)), ({}, {"7": jnp.bool_(False)})

    with pytest.raises(KeyError, match=r"scaler key\(s\) \['7'\]"):
        jaxamp.make_train_step(loss_fn, opt, amp=FP16)(state, batch())
    with pytest.raises(ValueError, match="`grad_clip_max_norm`=-1"):
        jaxamp.make_train_step(loss_fn, opt, amp=FP16, grad_clip_max_norm=-1)
    with pytest.raises(TypeError, match="must be an AmpConfig"):
        jaxamp.make_train_step(loss_fn, opt, amp={"dtype": "float16"})
