"""The train step and its public pieces (docs/algorithm.md, "Training step").

Most tests drive the step logic with a toy loss (a few weights, no network) whose flags are
injected through the batch, as jaxamp's check marks that the step's interpreter collects:
``overflow`` (key "2"), ``overflow1`` (key "1"), ``bad`` (NONFINITE_VALUES) and ``nan_grad``
(an infinite loss, so non-finite weight gradients). One
test runs a real fp16 network and derivative engine, whose NaN input point is flagged by the
engine itself. Faults are injected, not provoked by float16 rounding (XLA's excess precision
on CPU would make a provoked overflow flaky).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from jaxamp.models import FullyConnected
from tests.helpers.injected import poison_grad

N = 16
FP16 = jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**8})



def counters_as(state, like):
    """``state`` with the step count, the skip reason and the skips in a row of ``like``."""
    counters = dict(skip_reason=like.opt_state.skip_reason, consecutive_skips=like.consecutive_skips)
    return state._replace(step=like.step, opt_state=state.opt_state._replace(**counters))

def tree_equal(a, b):
    same = jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(jax.tree_util.tree_leaves(same))


def keys_engine(amp):
    """An engine used only for its scaler keys ("1", "2" when the derivative scalers act)."""
    return jaxamp.Derivatives(lambda p, x: x, inputs=("x",), outputs=("u",), derivatives=("u__x__x",), amp=amp)


def inject(hit, order):
    """Raise a flag as an engine's step raises it, with jaxamp's check mark: at ``order`` > 0 a
    scaled result that is inf where ``hit`` over a finite value (an overflow of key ``order``);
    at order 0 a checked value that is NaN where ``hit`` (bad values)."""
    if order == 0:
        v = jnp.where(hit, jnp.nan, 0.0)
        return jaxamp._src.core.marks.deriv_check(v, v, order=0, term=None)
    return jaxamp._src.core.marks.deriv_check(jnp.where(hit, jnp.inf, 0.0), jnp.float32(0.0), order=order, term=None)


def toy_loss(params, batch):
    loss = poison_grad(jnp.mean((params["w"] * batch["x"] - 1.0) ** 2), batch["nan_grad"])
    inject(batch["bad"], 0)  # NONFINITE_VALUES
    inject(batch["overflow1"], 1)  # key "1"
    inject(batch["overflow"], 2)  # key "2"
    return loss, {"mse": loss}


def batch(bad=False, overflow=False, overflow1=False, nan_grad=False):
    return {"x": jnp.linspace(0.0, 1.0, N), "bad": jnp.asarray(bad), "overflow": jnp.asarray(overflow),
            "overflow1": jnp.asarray(overflow1), "nan_grad": jnp.asarray(nan_grad)}


@functools.lru_cache(maxsize=None)
def problem(amp=FP16, clip=None, opt=optax.adam(1e-2)):
    params = {"w": jnp.linspace(0.5, 1.5, N)}
    state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=amp, engines=[keys_engine(amp)])
    step = jaxamp.make_train_step(toy_loss, opt, amp=amp, grad_clip_max_norm=clip)
    return state, jax.jit(step), step, opt


def warm(n=3):
    state, step, *_ = problem()
    for _ in range(n):
        state, m = step(state, batch())
        assert not bool(m["skipped"])
    return state, step


def test_derivative_overflow_skips_and_backs_off_only_its_own_scaler():
    before, step = warm()
    state, m = step(before, batch(overflow=True))
    assert bool(m["skipped"]) and int(m["skip_reason"]) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
    assert bool(m["found_inf/2"]) and not bool(m["found_inf/1"]) and not bool(m["found_nonfinite_values"])
    assert tree_equal((state.params, state.opt_state.inner, state.amp_state.loss),
                      (before.params, before.opt_state.inner, before.amp_state.loss))
    assert float(state.amp_state.derivative["2"].scale) == 0.5 * float(before.amp_state.derivative["2"].scale)
    assert int(state.amp_state.derivative["2"].growth_tracker) == 0
    assert (int(state.amp_state.derivative["1"].growth_tracker)
            == int(before.amp_state.derivative["1"].growth_tracker) + 1)
    assert int(state.step) == int(before.step) + 1
    state, m = step(state, batch())
    assert not bool(m["skipped"]) and not tree_equal(state.params, before.params)


def test_a_skipped_step_keeps_each_parameter_bit_for_bit_signed_zeros_included():
    before, step = warm()
    signed = jnp.where(jnp.arange(N) % 2 == 0, -0.0, 0.0).astype(jnp.float32)  # +0.0 updates would flip -0.0
    before = before._replace(params={"w": signed})
    state, m = step(before, batch(overflow=True))
    assert bool(m["skipped"])
    assert np.array_equal(np.asarray(state.params["w"]).view(np.uint32), np.asarray(signed).view(np.uint32))


@pytest.mark.parametrize("overflow", [False, True])
def test_bad_values_skip_and_change_no_scaler_whatever_else_is_flagged(overflow):
    before, step = warm()
    state, m = step(before, batch(bad=True, overflow=overflow))
    assert bool(m["skipped"]) and int(m["skip_reason"]) == jaxamp.SkipReason.NONFINITE_VALUES
    assert bool(m["found_nonfinite_values"]) and bool(m["found_inf/2"]) == overflow
    assert tree_equal(counters_as(state, before), before)  # scales too
    assert int(state.consecutive_skips) == 1 and int(m["consecutive_skips"]) == 1
    assert int(state.step) == int(before.step) + 1


def test_nonfinite_weight_gradients_back_off_the_loss_scaler_and_skip():
    before, step = warm()
    state = before.replace_amp(before.amp_state.replace(
        loss=jaxamp._src.scaling.scaler.ScaleState(jnp.float32(2.0**30), jnp.int32(7))))
    new, m = step(state, batch(nan_grad=True))
    assert int(m["skip_reason"]) == jaxamp.SkipReason.NONFINITE_GRADS and bool(m["skipped"])
    assert float(new.amp_state.loss.scale) == 2.0**29 and int(new.amp_state.loss.growth_tracker) == 0
    assert tree_equal((new.params, new.opt_state.inner), (state.params, state.opt_state.inner))
    assert all(int(new.amp_state.derivative[k].growth_tracker) == int(state.amp_state.derivative[k].growth_tracker) + 1
               for k in ("1", "2"))  # a clean step for them
    # with a derivative overflow too, the overflow is the reason and the loss scaler stays
    new, m = step(state, batch(overflow=True, nan_grad=True))
    assert (int(m["skip_reason"]) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
            and tree_equal(new.amp_state.loss, state.amp_state.loss))


def test_thousand_steps_with_injected_faults_never_produce_nonfinite_params():
    state, _, step, *_ = problem()
    rng = np.random.default_rng(0)
    draw = rng.random(1000)
    bad, overflow = jnp.asarray(draw < 0.09), jnp.asarray((draw >= 0.09) & (draw < 0.1))
    @jax.jit
    def run(state, bad, overflow):
        def body(s, f):
            new, m = step(s, dict(batch(), bad=f[0], overflow=f[1]))
            same = tree_equal_traced((s.params, s.opt_state.inner), (new.params, new.opt_state.inner))
            scales_same = tree_equal_traced(s.amp_state.derivative, new.amp_state.derivative)
            return new, (m["skipped"], m["skip_reason"], same, scales_same, jmp_finite(new.params))
        return jax.lax.scan(body, state, (bad, overflow))

    final, (skipped, reason, unchanged, scales_same, finite) = run(state, bad, overflow)
    assert bool(jnp.all(finite)) and int(jnp.sum(bad)) > 50 and int(jnp.sum(overflow)) > 3
    faulty = bad | overflow
    assert bool(jnp.all(skipped[faulty])) and bool(jnp.all(unchanged[faulty]))
    assert bool(jnp.all(reason[bad] == jaxamp.SkipReason.NONFINITE_VALUES))
    assert bool(jnp.all(reason[overflow] == jaxamp.SkipReason.DERIVATIVE_OVERFLOW))
    assert bool(jnp.all(scales_same[bad]))  # bad values never move a derivative scaler
    assert float(final.amp_state.derivative["2"].scale) == 2.0 ** -int(jnp.sum(overflow))  # one halving per overflow


def tree_equal_traced(a, b):
    return jnp.stack([jnp.all(x == y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                      jax.tree_util.tree_leaves(b))]).all()


def jmp_finite(tree):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]).all()


def test_clean_steps_count_for_the_loss_scaler():
    amp = jaxamp.AmpConfig(dtype="float16", loss_scaler={"init_scale": 2.0**4, "growth_interval": 2,
                                                         "recover_growth_interval": 1, "recover_threshold": 1.0})
    state, step, *_ = problem(amp)
    s1, m1 = step(state, batch())
    assert float(state.amp_state.loss.scale) == 16
    s2, m2 = step(s1, batch())
    assert (not bool(m1["skipped"]) and int(s1.amp_state.loss.growth_tracker) == 1
            and float(s1.amp_state.loss.scale) == 16)
    assert float(s2.amp_state.loss.scale) == 32 and int(s2.amp_state.loss.growth_tracker) == 0
    assert float(m1["scale_log2/loss"]) == 4.0 and float(m2["scale_log2/loss"]) == 5.0


def test_clipping_is_off_by_default_and_follows_torch_formula_when_asked():
    fp32 = jaxamp.AmpConfig(dtype="float32")
    sgd = optax.sgd(1.0)
    state, plain_step, *_ = problem(fp32, None, sgd)
    _, clip_step, *_ = problem(fp32, 0.05, sgd)
    grads = jax.grad(lambda p: toy_loss(p, batch())[0])(state.params)
    norm = float(optax.tree.norm(grads))
    assert norm > 0.05
    plain, m = plain_step(state, batch())
    clipped, mc = clip_step(state, batch())
    delta = lambda s: jax.tree_util.tree_map(lambda a, b: a - b, state.params, s.params)  # noqa: E731
    np.testing.assert_allclose(float(m["grad_norm"]), norm, rtol=1e-5)
    np.testing.assert_allclose(float(optax.tree.norm(delta(plain))), norm, rtol=1e-5)
    np.testing.assert_allclose(float(optax.tree.norm(delta(clipped))), 0.05 * norm / (norm + 1e-6), rtol=1e-5)
    # the norm before clipping (the two steps are two programs: their sums may round apart by an ulp)
    np.testing.assert_allclose(float(mc["grad_norm"]), float(m["grad_norm"]), rtol=1e-6)


@pytest.mark.slow
def test_real_network_nan_point_is_bad_values_and_the_step_compiles_once_with_no_per_step_callback():
    model = FullyConnected.from_amp(FP16, out_features=1, layer_size=8, nr_layers=2)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x), inputs=("x",), outputs=("u",),
                                derivatives=("u__x__x",), amp=FP16)

    def loss_fn(params, b):
        x = b["x"].at[0].set(jnp.where(b["bad"], jnp.nan, b["x"][0]))
        d = engine(params, {"x": x})
        pde = jnp.mean((d["u__x__x"] + jnp.pi**2 * jnp.sin(jnp.pi * x)) ** 2)
        return pde, {"pde": pde}

    opt = optax.adam(1e-3)
    state = jaxamp.TrainState.create(params=params, optimizer=opt, amp=FP16, engines=[engine])
    step = jaxamp.make_train_step(loss_fn, opt, amp=FP16)
    traces = []

    def counted(s, b):
        traces.append(1)
        return step(s, b)

    jitted = jax.jit(counted)
    outcomes = []
    for i in range(4):
        before = state
        state, m = jitted(state, batch(bad=(i == 2)))
        outcomes.append((bool(m["skipped"]), int(m["skip_reason"]), bool(m["found_nonfinite_values"])))
        if i == 2:
            assert tree_equal(counters_as(state, before), before)
    assert outcomes == [(False, 0, False), (False, 0, False),
                        (True, jaxamp.SkipReason.NONFINITE_VALUES, True), (False, 0, False)]
    assert len(traces) == 1
    text = jitted.lower(state, batch()).as_text()
    assert "outfeed" not in text.lower()
    # no host callback by default (the metrics report a stall); with on_stall="warn" one, the
    # stall report, inside a cond taken only when the run stalls
    assert "callback" not in str(jax.make_jaxpr(step)(state, batch()))
    warn = jaxamp.make_train_step(loss_fn, opt, amp=FP16, on_stall="warn")
    jaxpr = jax.make_jaxpr(warn)(state, batch()).jaxpr
    top = [str(e.primitive) for e in jaxpr.eqns]
    assert "debug_callback" not in top and str(jaxpr).count("debug_callback[") == 1
    conds = [e for e in jaxpr.eqns if str(e.primitive) == "cond"]
    assert any("debug_callback" in str(b) for e in conds for b in e.params["branches"])


@pytest.mark.parametrize("amp", [jaxamp.AmpConfig(dtype="bfloat16"), jaxamp.AmpConfig(dtype="float32"),
                                 jaxamp.AmpConfig(dtype="float16", derivative_scaling=False)],
                         ids=["bf16", "fp32", "plain_fp16"])
def test_inactive_derivative_scalers_run_the_same_step(amp):
    state, step, *_ = problem(amp)
    assert state.amp_state.derivative == {} and keys_engine(amp).scaler_keys == ()
    assert float(state.amp_state.loss.scale) == (2.0**16 if amp.loss_scaling_enabled else 1.0)
    first = None
    for _ in range(10):
        state, m = step(state, batch())
        first = float(m["loss"]) if first is None else first
    assert float(m["loss"]) < first and bool(jmp_finite(state.params))
    assert set(k for k in m if k.startswith("scale_log2/")) == {"scale_log2/loss"}


@pytest.mark.parametrize("amp", [FP16, jaxamp.AmpConfig(dtype="float16", derivative_scaling=False),
                                 jaxamp.AmpConfig(dtype="float32")], ids=["scaled", "plain_fp16", "amp_off"])
def test_the_step_has_no_conditional_but_the_stall_report(amp):
    # the gradients' zeroing on a flag and the skip are selects per leaf, which XLA fuses into the
    # kernels computing them (a conditional copies every leaf in its branches: a kernel per leaf
    # on a GPU, docs/gpu.md); the one conditional left is the stall report's, taken only on a stall
    def loss(w, x):
        return jnp.mean(jaxamp.grad(lambda x: jnp.tanh(w * x))(x) ** 2)

    state = jaxamp.init(loss, amp)(jnp.float32(1.5), jnp.float32(0.5))
    hlo = jax.jit(jaxamp.value_and_grad(loss)).lower(state, jnp.float32(1.5), jnp.float32(0.5)).compile().as_text()
    assert hlo.count(" conditional(") == 0
    tx = jaxamp.optimizer(optax.adam(1e-3), amp_state=state, on_stall=None)

    def step(opt_state, w, x):
        _, grads, flags = jaxamp.value_and_grad(loss)(opt_state, w, x)
        return tx.update(grads, opt_state, w, flags=flags)

    hlo = jax.jit(step).lower(tx.init(jnp.float32(1.5)), jnp.float32(1.5), jnp.float32(0.5)).compile().as_text()
    assert hlo.count(" conditional(") == 0


def test_a_flag_beside_nonfinite_gradients_is_an_overflow():
    # the flags are the engines' own (they travel beside the gradients, no norm of them reaches
    # the flags): an overflow that made the gradients non-finite is the overflow, its key backs off;
    # bad values come first; non-finite gradients without a flag are the gradients' fault
    scalers = jaxamp.init(None, FP16, keys=["1", "2"])().derivative
    flags = {"2": jnp.array(True), NONFINITE_VALUES: jnp.array(True)}
    grads = {"w": jnp.array([1.0, jnp.nan])}
    reason = lambda check: jaxamp.SkipReason(int(check.skip_reason))  # noqa: E731
    assert reason(jaxamp._src.training.step.check_step(scalers, flags, grads)) == jaxamp.SkipReason.NONFINITE_VALUES
    del flags[NONFINITE_VALUES]
    check = jaxamp._src.training.step.check_step(scalers, flags, grads)
    assert reason(check) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW and bool(check.found_inf["2"])
    check = jaxamp._src.training.step.check_step(scalers, flags, {"w": jnp.ones(2)})  # finite: the flag counts
    assert reason(check) == jaxamp.SkipReason.DERIVATIVE_OVERFLOW
    assert reason(jaxamp._src.training.step.check_step(scalers, {}, grads)) == jaxamp.SkipReason.NONFINITE_GRADS


def test_unknown_flag_keys_and_bad_arguments_are_rejected():
    state, *_ = problem()
    opt = optax.adam(1e-3)

    def loss_fn(params, b):
        inject(jnp.bool_(False), 7)  # a flag of key "7", which no scaler of the state has
        return jnp.float32(0.0) * sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(params)), {}

    with pytest.raises(KeyError, match=r"scaler key\(s\) \['7'\]"):
        jaxamp.make_train_step(loss_fn, opt, amp=FP16)(state, batch())
    with pytest.raises(ValueError, match="`grad_clip_max_norm`=-1 is not allowed"):
        jaxamp.make_train_step(loss_fn, opt, amp=FP16, grad_clip_max_norm=-1)
    with pytest.raises(TypeError, match="must be an AmpConfig"):
        jaxamp.make_train_step(loss_fn, opt, amp={"dtype": "float16"})


def test_a_bare_loss_gets_an_error_that_shows_the_contract():
    state, *_ = problem()

    def bare(params, b):
        return jnp.sum(jax.tree_util.tree_leaves(params)[0])

    with pytest.raises(TypeError) as e:
        jaxamp.make_train_step(bare, optax.adam(1e-3), amp=FP16)(state, batch())
    assert "jaxamp.value_and_grad: `fun`=" in str(e.value)
    assert "with has_aux=True must return (loss, aux)" in str(e.value)


@pytest.mark.parametrize("aux", ["scalar", "one_tuple", "old_contract", "old_contract_with_metrics", "not_dicts"])
def test_a_bad_aux_gets_an_error_that_shows_the_contract(aux):
    state, *_ = problem()

    def loss_fn(params, b):
        loss = jnp.sum(jax.tree_util.tree_leaves(params)[0])
        return loss, {"scalar": loss, "one_tuple": ({"mse": loss},), "not_dicts": ({"mse": loss}, [loss]),
                      "old_contract": ({"mse": loss}, {"2": jnp.bool_(False)}),  # (terms, found_inf)
                      "old_contract_with_metrics": ({"mse": loss}, {"2": jnp.bool_(False)}, {"m": loss})}[aux]

    with pytest.raises(TypeError) as e:
        jaxamp.make_train_step(loss_fn, optax.adam(1e-3), amp=FP16)(state, batch())
    assert str(e.value).startswith("make_train_step: loss_fn returned the ")
    assert "loss_fn(params, batch) must return (loss, terms) or (loss, (terms, metrics))" in str(e.value)


def test_a_non_scalar_loss_gets_an_error_that_names_it():
    state, *_ = problem()

    def loss_fn(params, b):
        return params["w"] * b["x"], {}

    with pytest.raises(TypeError) as e:
        jaxamp.make_train_step(loss_fn, optax.adam(1e-3), amp=FP16)(state, batch())
    assert "jaxamp.value_and_grad: `fun`=" in str(e.value)
    assert (f"must return a float scalar loss (or (loss, aux) with has_aux=True), got an array of shape ({N},)"
            in str(e.value))
    with pytest.raises(TypeError, match="make_train_step: `loss_fn`=3 must be callable as loss_fn\\(params, batch\\)"):
        jaxamp.make_train_step(3, optax.adam(1e-3), amp=FP16)


def test_pieces_in_a_users_own_step_with_extra_state_match_make_train_step():
    """Loss weights and an EMA of the params ride along; a skipped step leaves them as they were."""
    state, step, _, opt = problem()
    rule = FP16.make_loss_scaler()
    grad_fn = jaxamp.value_and_grad(toy_loss, has_aux=True)

    @jax.jit
    def user_step(params, opt_state, scalers, loss_scale, extra, b):
        (loss, terms), grads, flags = grad_fn(jaxamp.AmpState(FP16, scalers, loss_scale, rule), params, b)
        check = jaxamp._src.training.step.check_step(scalers, flags.found_inf, grads)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_extra = {"weights": extra["weights"] * 0.9 + 0.1,
                     "ema": jax.tree_util.tree_map(lambda e, p: 0.99 * e + 0.01 * p, extra["ema"], new_params)}
        params, opt_state, extra = check.select((new_params, new_opt_state, new_extra), (params, opt_state, extra))
        scalers, loss_scale = jaxamp._src.training.step.update_scalers(scalers, loss_scale, rule, check)
        return params, opt_state, scalers, loss_scale, extra

    carry = (state.params, state.opt_state.inner, state.amp_state.derivative, state.amp_state.loss,
             {"weights": jnp.ones(2), "ema": state.params})
    for flags in [{}, {"overflow": True}, {"bad": True}, {"nan_grad": True}, {}]:
        prev_extra = carry[4]
        carry = user_step(*carry, batch(**flags))
        state, _ = step(state, batch(**flags))
        assert tree_equal(carry[:4], (state.params, state.opt_state.inner,
                                      state.amp_state.derivative, state.amp_state.loss))
        assert tree_equal(carry[4], prev_extra) == bool(flags)


def test_pieces_inside_a_named_axis_step_decide_alike_on_every_replica():
    """Two replicas under jax.vmap(axis_name=...): gradients pmean-ed, flags OR-ed by check_step."""
    state, _, _, opt = problem()
    rule = FP16.make_loss_scaler()
    grad_fn = jaxamp.value_and_grad(toy_loss, has_aux=True)

    def replica(params, opt_state, scalers, loss_scale, b):
        _, grads, flags = grad_fn(jaxamp.AmpState(FP16, scalers, loss_scale, rule), params, b)
        grads = jax.lax.pmean(grads, "devices")
        check = jaxamp._src.training.step.check_step(scalers, flags.found_inf, grads, axis_name="devices")
        updates, new_opt_state = opt.update(grads, opt_state, params)
        params, opt_state = check.select((optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
        scalers, loss_scale = jaxamp._src.training.step.update_scalers(scalers, loss_scale, rule, check)
        return params, opt_state, scalers, loss_scale, check.skip_reason

    run = jax.jit(jax.vmap(replica, in_axes=(None, None, None, None, 0), axis_name="devices"))
    for overflow, expected in [([False, False], jaxamp.SkipReason.APPLIED),
                               ([False, True], jaxamp.SkipReason.DERIVATIVE_OVERFLOW)]:
        b = jax.tree_util.tree_map(lambda v: jnp.stack([v, v]), batch())
        b = dict(b, x=b["x"] * jnp.asarray([[1.0], [2.0]]), overflow=jnp.asarray(overflow))
        params, opt_state, scalers, loss_scale, reason = run(state.params, state.opt_state.inner,
                                                             state.amp_state.derivative, state.amp_state.loss, b)
        assert reason.tolist() == [expected, expected]
        for tree in (params, opt_state, scalers, loss_scale):
            for leaf in jax.tree_util.tree_leaves(tree):
                assert bool(jnp.array_equal(leaf[0], leaf[1]))
        assert float(scalers["2"].scale[0]) == (0.5 if expected else 1.0)


def test_a_state_of_another_amp_is_refused_by_the_step():
    state, _, step, *_ = problem()
    other = jaxamp.AmpConfig(dtype="float16", mode="per_term_scaler")
    foreign = state.replace_amp(jaxamp.init(None, other, keys=list(state.scales))())
    with pytest.raises(ValueError,
                       match="make_train_step: the state's `amp_state` .* was not created with the step's `amp`"):
        step(foreign, batch())
    assert NONFINITE_VALUES not in state.amp_state.derivative
