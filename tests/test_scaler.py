import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import NONFINITE_VALUES
from jaxamp._src.scaling.scaler import DynamicScaler
from jaxamp._src.scaling.scaler import Scalers, ScaleState
from jaxamp._src.scaling.scaler import loss_scaler
from tests.helpers.scaler_reference import reference_update

VECTOR_A = dict(growth_factor=2.0, backoff_factor=0.25, growth_interval=2, max_scale=8.0,
                     recover_threshold=2.0, recover_growth_interval=1)


def run(rule, state, flags, jit):
    update = jax.jit(rule.update) if jit else rule.update
    out = []
    for f in flags:
        state = update(state, jnp.asarray(f))
        out.append((float(state.scale), int(state.growth_tracker)))
    return out


@pytest.mark.parametrize("jit", [False, True])
def test_vector_a(jit):
    """docs/algorithm.md, \"Test vectors\", A."""
    rule = DynamicScaler(init_scale=4.0, **VECTOR_A)
    flags = [False] * 6 + [True] * 2 + [False] * 3 + [False]
    expected = [(4, 1), (8, 0), (8, 1), (8, 0), (8, 1), (8, 0), (2, 0), (0.5, 0), (1, 0), (2, 0), (4, 0), (4, 1)]
    assert run(rule, rule.init(), flags, jit) == expected


VECTOR_B_AMP = jaxamp.AmpConfig(
    dtype="float16",
    default_max_scale_log2=1,
    derivative_scaler=dict(growth_interval=2, recover_threshold=0.5, recover_growth_interval=1),
)


@functools.lru_cache(maxsize=None)
def vector_b_engine():
    """A fp16 tanh MLP plus sqrt(x), its derivative engine (jitted once) and params."""
    model = jaxamp.models.FullyConnected.from_amp(VECTOR_B_AMP, out_features=1, layer_size=16, nr_layers=2,
                                                  activation="tanh")
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(1))
    engine = jaxamp.Derivatives(lambda p, x: model.apply(p, x) + jnp.sqrt(x), inputs=("x",), outputs=("u",),
                                derivatives=("u__x",), amp=VECTOR_B_AMP)
    return engine, jax.jit(jaxamp.scaled(engine)), params


@pytest.mark.parametrize("jit", [False, True])
def test_vector_b_through_a_tanh_mlp(jit):
    """docs/algorithm.md, "Test vectors", B: the flags come from a real fp16 tanh MLP's derivatives.
    The flagged steps are true overflows (not bad values): the network plus sqrt(x), whose
    derivative is inf at x = 0 where the value is finite."""
    amp = VECTOR_B_AMP
    engine, derivs, params = vector_b_engine()  # the jit flag applies to the update rule
    assert engine.scaler_keys == ("1",)
    scalers = jaxamp.init(None, amp, keys=engine.scaler_keys)().derivative
    update = jax.jit(Scalers.update) if jit else Scalers.update
    assert (float(scalers["1"].scale), int(scalers["1"].growth_tracker)) == (1.0, 0)
    clean, overflowing = jnp.linspace(0.1, 1, 8), jnp.linspace(0.0, 1, 8)
    seen = []
    for x in [clean] * 4 + [overflowing] * 3 + [clean] * 3:
        _, found = derivs(scalers.scales, params, {"x": x})
        assert not bool(found[NONFINITE_VALUES])
        scalers = update(scalers, {"1": found["1"]})
        seen.append((float(scalers["1"].scale), int(scalers["1"].growth_tracker)))
    assert seen == [(1, 1), (2, 0), (2, 1), (2, 0), (1, 0), (0.5, 0), (0.25, 0), (0.5, 0), (1, 0), (1, 1)]


def test_scalers_pair_each_key_with_its_rule_and_go_through_jit_vmap_and_checkpoint_paths():
    amp = jaxamp.AmpConfig(custom_max_scales_log2={2: 3}, derivative_scaler={"growth_interval": 200})
    s = jaxamp.init(None, amp, keys=["1", "2"])().derivative
    assert s.rules["2"] == amp.derivative_scaler_for("2") and s.rules["2"].max_scale == 8.0
    assert s.rules["1"].max_scale == 1.0 and sorted(s) == ["1", "2"] and len(s) == 2
    out = jax.jit(lambda s: s.update({"2": jnp.bool_(True)}))(s)
    assert isinstance(out, Scalers) and out.rules == s.rules
    assert (float(out["2"].scale), int(out["1"].growth_tracker)) == (0.5, 1)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == ["['1'].scale", "['1'].growth_tracker", "['2'].scale", "['2'].growth_tracker"]
    batched = jax.vmap(lambda f: s.update({"1": f}))(jnp.asarray([True, False]))
    assert batched["1"].scale.tolist() == [0.5, 1.0]
    assert jaxamp.init(None, amp)().derivative == {} and s.scales == {"1": s["1"].scale, "2": s["2"].scale}
    with pytest.raises(KeyError, match=r"key\(s\) \['7'\] with no scaler"):
        s.update({"7": True})
    with pytest.raises(KeyError, match="`states` has keys"):
        Scalers(s.rules, {"1": s["1"]})
    with pytest.raises(TypeError, match="must be a list of scaler keys"):
        jaxamp.init(None, amp, keys="12")


@pytest.mark.parametrize("jit, rule_name", [  # per-call dispatch (jit False) is slow: one rule in the fast run
    (True, "derivative"), (True, "loss"), (True, "floor"), (False, "derivative"),
    pytest.param(False, "loss", marks=pytest.mark.slow), pytest.param(False, "floor", marks=pytest.mark.slow),
])
def test_random_sequence_matches_python_transcription(jit, rule_name):
    rule = {
        "derivative": DynamicScaler(max_scale=4.0, growth_interval=7, recover_growth_interval=3),
        "loss": loss_scaler(growth_interval=5, recover_growth_interval=2, recover_threshold=2.0**10),
        "floor": DynamicScaler(growth_interval=9, recover_growth_interval=2, min_scale=2.0**-8),
    }[rule_name]
    rng = np.random.default_rng(1234)
    # 15 % overflow steps keep every rule within float32's normal range (XLA flushes
    # subnormals to zero where numpy does not; a scale that low is meaningless anyway).
    flags = rng.random(10_000) < 0.15
    hyper = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule) if f.name != "init_scale"}
    scale, tracker, expected = rule.init_scale, 0, []
    for f in flags:
        scale, tracker = reference_update(scale, tracker, bool(f), **hyper)
        expected.append((float(scale), tracker))
    assert len({s for s, _ in expected}) > 5, "the sequence should visit many scales"
    if jit:
        def body(state, f):
            state = rule.update(state, f)
            return state, (state.scale, state.growth_tracker)
        _, (scales, trackers) = jax.jit(lambda s, f: jax.lax.scan(body, s, f))(rule.init(), jnp.asarray(flags))
        got = list(zip(np.asarray(scales).tolist(), np.asarray(trackers).tolist()))
    else:
        # The first 2 000 updates one call at a time through the jitted update (no scan; the
        # scan case covers all 10 000), and the first 300 fully eager (op-by-op dispatch is slow).
        assert run(rule, rule.init(), flags[:2000], jit=True) == expected[:2000]
        with jax.disable_jit():
            got = run(rule, rule.init(), flags[:300], jit=False)
        expected = expected[:300]
    assert got == expected


def test_update_vmaps_over_a_batch_of_states():
    rule = DynamicScaler(max_scale=8.0, growth_interval=2, recover_growth_interval=1)
    states = ScaleState(jnp.asarray([1.0, 0.5, 0.01, 8.0]), jnp.asarray([0, 1, 0, 1], jnp.int32))
    flags = jnp.asarray([False, False, False, True])
    out = jax.vmap(rule.update)(states, flags)
    for i in range(4):
        one = rule.update(ScaleState(states.scale[i], states.growth_tracker[i]), flags[i])
        assert float(out.scale[i]) == float(one.scale) and int(out.growth_tracker[i]) == int(one.growth_tracker)


def test_scale_never_backs_off_below_the_smallest_normal_float32():
    rule = DynamicScaler()
    state = jax.jit(lambda s: jax.lax.fori_loop(0, 200, lambda i, s: rule.update(s, True), s))(rule.init())
    assert float(state.scale) == 2.0**-126
    assert float(rule.update(state, False).scale) == 2.0**-126  # and it can grow back from there
    grown = jax.lax.fori_loop(0, 100, lambda i, s: rule.update(s, False), state)
    assert float(grown.scale) == 2.0**-125


def test_state_dtypes():
    s = loss_scaler().init()
    assert s.scale.dtype == jnp.float32 and s.scale.shape == ()
    assert s.growth_tracker.dtype == jnp.int32 and s.growth_tracker.shape == ()
    assert float(s.scale) == 2.0**16


def test_defaults_follow_the_documented_table():
    d, l = DynamicScaler(), loss_scaler()
    assert (d.init_scale, d.max_scale, d.growth_factor, d.backoff_factor, d.growth_interval,
            d.recover_threshold, d.recover_growth_interval) == (1, 1, 2, 0.5, 1000, 2**-6, 100)
    assert (l.init_scale, l.max_scale, l.growth_factor, l.backoff_factor, l.growth_interval,
            l.recover_threshold, l.recover_growth_interval) == (2**16, 2**30, 2, 0.5, 1000, 2**7, 100)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(init_scale=4.0, max_scale=2.0), "`init_scale`=4.0 must not exceed `max_scale`=2.0"),
        (dict(recover_threshold=4.0, max_scale=2.0), "`recover_threshold`=4.0 must not exceed"),
        (dict(recover_growth_interval=20, growth_interval=10), "`recover_growth_interval`=20 must not exceed"),
        (dict(growth_factor=0.0), "`growth_factor`=0.0 is not allowed: expected a finite number > 1"),
        (dict(growth_factor=0.5), "`growth_factor`=0.5 is not allowed: expected a finite number > 1"),
        (dict(growth_factor=1.0), "`growth_factor`=1.0 is not allowed: expected a finite number > 1"),
        (dict(backoff_factor=-0.5), "`backoff_factor`=-0.5 is not allowed: expected a number in (0, 1)"),
        (dict(backoff_factor=2.0), "`backoff_factor`=2.0 is not allowed: expected a number in (0, 1)"),
        (dict(backoff_factor=1.0), "`backoff_factor`=1.0 is not allowed"),
        (dict(growth_interval=0), "`growth_interval`=0 is not allowed: expected a positive integer"),
        (dict(max_scale=float("inf")), "`max_scale`=inf"),
        (dict(init_scale=float("nan")), "`init_scale`=nan is not allowed: expected a finite number > 0"),
        (dict(min_scale=2.0), "`min_scale`=2.0 must not exceed `max_scale`=1.0"),
        (dict(min_scale=0.5, init_scale=0.25), "`min_scale`=0.5 must not exceed `init_scale`=0.25"),
    ],
)
def test_construction_rejects_bad_hyperparameters(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as e:
        DynamicScaler(**kwargs)
    assert fragment in str(e.value)


def test_hyperparameters_are_keyword_only_and_typed():
    with pytest.raises(TypeError):
        DynamicScaler(1.0)  # noqa
    with pytest.raises(TypeError, match="growth_interval"):
        DynamicScaler(growth_interval=10.5)
    with pytest.raises(TypeError, match="`init_scale`='1'"):
        DynamicScaler(init_scale="1")
    with pytest.raises(TypeError, match="`backoff_factor`=True"):
        DynamicScaler(backoff_factor=True)
    r = DynamicScaler(init_scale=np.float32(0.5), growth_interval=np.int64(10), recover_growth_interval=5)
    assert type(r.init_scale) is float and type(r.growth_interval) is int and r.floor == 2.0**-126
    assert DynamicScaler(min_scale=2.0**-10).floor == 2.0**-10
