"""Every bad input through the public API gets a clear error before any work starts.

One row per bad input: what is called, the exception type, and fragments the message must
hold: the argument (or config key), the value given, and what is allowed.
"""

import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp import AmpConfig, ConfigError
from jaxamp._src.scaling.scaler import DynamicScaler
from jaxamp import StallMonitor
from jaxamp.models import FullyConnected
from tests.helpers.files import yaml_file

FP16 = AmpConfig()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine(**overrides):
    kwargs = dict(fn=lambda p, x: p * x, inputs=("x",), outputs=("u",), derivatives=("u__x",), amp=FP16)
    return jaxamp.Derivatives(**{**kwargs, **overrides})


def toy_state():
    params = {"w": jnp.ones(3)}
    return jaxamp.TrainState.create(params=params, optimizer=optax.sgd(0.1), amp=FP16, engines=[engine()])


def step_with(loss_fn):
    """Call one train step with ``loss_fn`` (eagerly: the contract is checked while tracing)."""
    return jaxamp.make_train_step(loss_fn, optax.sgd(0.1), amp=FP16)(toy_state(), {"x": jnp.ones(3)})


def restore_mismatched():
    state = toy_state()
    with jaxamp.Checkpointer(tempfile.mkdtemp()) as ckpt:
        ckpt.save(state, step=1)
        ckpt.restore(state._replace(params={"w": jnp.ones(4)}))


def restore_missing_step():
    with jaxamp.Checkpointer(tempfile.mkdtemp()) as ckpt:
        ckpt.save(toy_state(), step=1)
        ckpt.restore(toy_state(), step=7)


def checkpointer_on_a_file():
    path = os.path.join(tempfile.mkdtemp(), "file")
    open(path, "w").close()
    jaxamp.Checkpointer(path)


def shard_indivisible_batch():
    """Two fake CPU devices need a fresh process (the device count is fixed when JAX starts)."""
    code = ("import jax.numpy as jnp, jaxamp\n"
            "jaxamp.parallel.shard_batch({'x': jnp.zeros(5)}, jaxamp.parallel.make_mesh(2))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no error"
    if last.startswith("ValueError: "):
        raise ValueError(last[len("ValueError: "):])
    raise AssertionError(f"expected a ValueError, got: {last}")


def bare_loss(params, batch):
    return jnp.sum(params["w"])


def loss_with_none_aux(params, batch):
    return jnp.sum(params["w"]), None


def vector_loss(params, batch):
    return params["w"], {}


def loss_with_unknown_engine(params, batch):
    """Uses an engine (key "2") that the state was not created with (its scalers have ["1"])."""
    second = engine(fn=lambda p, x: p["w"][0] * x, derivatives=("u__x__x",))
    return jnp.sum(second(params, batch)["u__x__x"]), {}


def loss_with_unknown_key(params, batch):
    """Raises a flag of key "2" (a check mark of order 2) that no scaler of the state has."""
    jaxamp._src.core.marks.deriv_check(jnp.float32(0.0), jnp.float32(0.0), order=2, term=None)
    return jnp.sum(params["w"]), {}


CASES = [
    # ---------------------------------------------------------------- AmpConfig keys
    ("amp.dtype", lambda: AmpConfig(dtype="float64"), ConfigError, ["amp.dtype", "'float64'", "'float16', 'bfloat16'"]),
    ("amp.mode", lambda: AmpConfig(mode="per_layer"), ConfigError, ["amp.mode", "'per_layer'", "per_order_scaler"]),
    ("amp.enabled", lambda: AmpConfig(enabled="yes"), ConfigError, ["amp.enabled", "'yes'", "true or false"]),
    ("amp.derivative_scaling", lambda: AmpConfig(derivative_scaling=1), ConfigError,
     ["amp.derivative_scaling", "=1", "true or false"]),
    ("amp.max_scale_log2_float", lambda: AmpConfig(default_max_scale_log2=1.5), ConfigError,
     ["amp.default_max_scale_log2", "1.5", "integer exponent in [-126, 127]"]),
    ("amp.max_scale_log2_range", lambda: AmpConfig(default_max_scale_log2=500), ConfigError,
     ["amp.default_max_scale_log2", "500", "[-126, 127]"]),
    ("amp.custom_key_order0", lambda: AmpConfig(custom_max_scales_log2={0: 2}), ConfigError,
     ["custom_max_scales_log2", "0", "an order >= 1"]),
    ("amp.custom_value", lambda: AmpConfig(custom_max_scales_log2={2: "big"}), ConfigError,
     ["custom_max_scales_log2[2]", "'big'", "integer exponent"]),
    ("amp.special_terms", lambda: AmpConfig(special_terms="nu"), ConfigError,
     ["amp.special_terms", "'nu'", "a list of non-empty variable names"]),
    ("amp.derivative_scaler_unknown", lambda: AmpConfig(derivative_scaler={"max_scale": 4}), ConfigError,
     ["amp.derivative_scaler.max_scale", "4", "one of the keys"]),
    ("amp.derivative_scaler_not_mapping", lambda: AmpConfig(derivative_scaler=[1, 2]), ConfigError,
     ["amp.derivative_scaler", "[1, 2]", "a mapping"]),
    ("amp.growth_factor_below_1", lambda: AmpConfig(derivative_scaler={"growth_factor": 0.5}), ConfigError,
     ["amp.derivative_scaler.growth_factor", "0.5", "a finite number > 1"]),
    ("amp.backoff_factor_above_1", lambda: AmpConfig(derivative_scaler={"backoff_factor": 2.0}), ConfigError,
     ["amp.derivative_scaler.backoff_factor", "2.0", "in (0, 1)"]),
    ("amp.min_above_max", lambda: AmpConfig(loss_scaler={"min_scale": 2.0**31}), ConfigError,
     ["amp.loss_scaler.min_scale", "2147483648.0", "must not exceed amp.loss_scaler.max_scale=1073741824.0"]),
    ("amp.init_nan", lambda: AmpConfig(loss_scaler={"init_scale": float("nan")}), ConfigError,
     ["amp.loss_scaler.init_scale", "nan", "a finite number > 0"]),
    ("amp.max_inf", lambda: AmpConfig(loss_scaler={"max_scale": float("inf")}), ConfigError,
     ["amp.loss_scaler.max_scale", "inf", "a finite number > 0"]),
    ("amp.interval_type", lambda: AmpConfig(loss_scaler={"growth_interval": "10"}), ConfigError,
     ["amp.loss_scaler.growth_interval", "'10'", "a positive integer"]),
    ("amp.custom_max_below_init",
     lambda: AmpConfig(custom_max_scales_log2={2: -3}, derivative_scaler={"init_scale": 1.0}), ConfigError,
     ["amp.derivative_scaler.init_scale", "1.0", "max_scale=0.125", "custom_max_scales_log2['2']"]),
    ("from_dict.unknown_key", lambda: AmpConfig.from_dict({"precision": "fp16"}), ConfigError,
     ["unknown key(s) ['precision']", "allowed keys are"]),
    ("from_dict.not_mapping", lambda: AmpConfig.from_dict(["amp"]), ConfigError, ["['amp']", "must be a mapping"]),
    ("from_yaml.malformed", lambda: AmpConfig.from_yaml(yaml_file("amp:\n  dtype: float16\n   mode: x\n")), ConfigError,
     ["config.yaml, line 3", "not valid YAML", "fix the syntax"]),
    ("from_yaml.bad_value", lambda: AmpConfig.from_yaml(yaml_file("amp:\n  dtype: fp16\n")), ConfigError,
     ["config.yaml", "amp.dtype='fp16'", "'float16'"]),
    # ---------------------------------------------------------------- DynamicScaler / Scalers
    ("scaler.growth_factor", lambda: DynamicScaler(growth_factor=0.5), ValueError,
     ["`growth_factor`", "0.5", "a finite number > 1"]),
    ("scaler.backoff_factor", lambda: DynamicScaler(backoff_factor=2.0), ValueError,
     ["`backoff_factor`", "2.0", "in (0, 1)"]),
    ("scaler.backoff_zero", lambda: DynamicScaler(backoff_factor=0.0), ValueError,
     ["`backoff_factor`", "0.0", "in (0, 1)"]),
    ("scaler.min_above_max", lambda: DynamicScaler(min_scale=2.0), ValueError,
     ["`min_scale`", "2.0", "must not exceed `max_scale`=1.0"]),
    ("scaler.init_nan", lambda: DynamicScaler(init_scale=float("nan")), ValueError,
     ["`init_scale`", "nan", "a finite number > 0"]),
    ("scaler.max_inf", lambda: DynamicScaler(max_scale=float("inf")), ValueError, ["`max_scale`", "inf", "finite"]),
    ("scaler.interval_float", lambda: DynamicScaler(growth_interval=10.5), TypeError,
     ["`growth_interval`", "10.5", "a positive integer"]),
    ("scaler.recover_slower", lambda: DynamicScaler(recover_growth_interval=20, growth_interval=10), ValueError,
     ["`recover_growth_interval`", "20", "must not exceed `growth_interval`=10"]),
    ("scalers.keys_string", lambda: jaxamp.init(None, FP16, keys="12")().derivative, TypeError,
     ["`keys`", "'12'", "a list of scaler keys"]),
    ("scalers.unknown_flag", lambda: jaxamp.init(None, FP16, keys=["1"])().derivative.update({"7": True}), KeyError,
     ["`found_inf`", "['7']", "keys are ['1']"]),
    ("step.update_scalers_dict", lambda: jaxamp._src.training.step.update_scalers(
        {"1": DynamicScaler().init()}, DynamicScaler().init(), None,
        jaxamp._src.training.step.check_step({"1": None}, {}, {"w": jnp.ones(2)})), TypeError,
     ["`scalers`", "got dict", "must be a jaxamp._src.scaling.scaler.Scalers"]),
    ("value_and_grad.fun", lambda: jaxamp.value_and_grad("loss"), TypeError,
     ["jaxamp.value_and_grad", "`fun`='loss'", "must be callable"]),
    ("value_and_grad.has_aux", lambda: jaxamp.value_and_grad(bare_loss, has_aux=1), TypeError,
     ["jaxamp.value_and_grad", "`has_aux`=1", "must be True or False"]),
    # ---------------------------------------------------------------- train step and loss_fn contract
    ("train.amp_dict", lambda: jaxamp.make_train_step(bare_loss, optax.sgd(0.1), amp={"dtype": "float16"}), TypeError,
     ["`amp`", "{'dtype': 'float16'}", "must be an AmpConfig"]),
    ("train.clip_negative", lambda: jaxamp.make_train_step(bare_loss, optax.sgd(0.1), amp=FP16, grad_clip_max_norm=-1),
     ValueError, ["`grad_clip_max_norm`", "-1", "None or a finite number >= 0"]),
    ("train.clip_nan", lambda: jaxamp.make_train_step(bare_loss, optax.sgd(0.1), amp=FP16,
                                                      grad_clip_max_norm=float("nan")),
     ValueError, ["`grad_clip_max_norm`", "nan", "None or a finite number >= 0"]),
    ("train.optimizer", lambda: jaxamp.make_train_step(bare_loss, "adam", amp=FP16), TypeError,
     ["`optimizer`", "'adam'", "optax GradientTransformation"]),
    ("train.loss_fn", lambda: jaxamp.make_train_step("loss", optax.sgd(0.1), amp=FP16), TypeError,
     ["`loss_fn`='loss'", "must be callable as loss_fn(params, batch)"]),
    ("loss_fn.bare_loss", lambda: step_with(bare_loss), TypeError,
     ["`fun`=<function bare_loss", "with has_aux=True must return (loss, aux)"]),
    ("loss_fn.none_aux", lambda: step_with(loss_with_none_aux), TypeError,
     ["make_train_step: loss_fn returned the aux None", "must return (loss, terms) or (loss, (terms, metrics))",
      "terms a dict {name: scalar}"]),
    ("loss_fn.vector_loss", lambda: step_with(vector_loss), TypeError,
     ["`fun`=<function vector_loss", "got an array of shape (3,)", "must return a float scalar loss"]),
    ("loss_fn.unknown_engine", lambda: step_with(loss_with_unknown_engine), KeyError,
     ["scaler key '2'", "`scales` has only the keys ['1']", "pass a scale for every key"]),
    ("loss_fn.unknown_key", lambda: step_with(loss_with_unknown_key), KeyError,
     ["found_inf has scaler key(s) ['2']", "the scalers have ['1']", "engines=[every engine the loss uses]"]),
    ("state.amp_dict", lambda: jaxamp.TrainState.create(params={}, optimizer=optax.sgd(0.1), amp={}), TypeError,
     ["`amp`={}", "must be an AmpConfig"]),
    ("state.engines", lambda: jaxamp.TrainState.create(params={}, optimizer=optax.sgd(0.1), amp=FP16, engines=["e"]),
     TypeError, ["`engines`", "'e'", "jaxamp.Derivatives engines"]),
    ("state.engine_amp_mismatch", lambda: jaxamp.TrainState.create(
        params={}, optimizer=optax.sgd(0.1), amp=AmpConfig(derivative_scaling=False), engines=[engine()]),
     ValueError, ["scaler keys ['1']", "derivative_scaling=False", "build the engines with the same amp"]),
    # ---------------------------------------------------------------- checkpoints
    ("ckpt.mismatched_like", restore_mismatched, ValueError,
     ["does not match `like`", "params.w (checkpoint float32[3], like float32[4])", "same model, optimizer"]),
    ("ckpt.missing_step", restore_missing_step, FileNotFoundError, ["`step`=7", "available steps: [1]"]),
    ("ckpt.file", checkpointer_on_a_file, ValueError, ["`directory`=", "exists and is not a directory"]),
    ("ckpt.max_to_keep", lambda: jaxamp.Checkpointer(tempfile.mkdtemp(), max_to_keep=0), ValueError,
     ["`max_to_keep`=0", "a positive integer or None"]),
    # ---------------------------------------------------------------- stall monitor
    ("monitor.skips", lambda: StallMonitor(max_consecutive_skips=0), ValueError,
     ["`max_consecutive_skips`=0", "a positive integer"]),
    ("monitor.rate_nan", lambda: StallMonitor(max_skip_rate=float("nan")), ValueError,
     ["`max_skip_rate`=nan", "a number in (0, 1]"]),
    # ---------------------------------------------------------------- derivative engines
    ("derivatives.method", lambda: engine(method="backward"), ValueError,
     ["`method`='backward'", "'forward', 'reverse'"]),
    ("derivatives.string", lambda: engine(derivatives="u__x"), TypeError, ["`derivatives`='u__x'", "a list of names"]),
    ("derivatives.unknown_input", lambda: engine(derivatives=("u__z",)), ValueError,
     ["'u__z'", "'z', which is not an input", "inputs are ['x']"]),
    ("derivatives.unknown_output", lambda: engine(derivatives=("v__x",)), ValueError,
     ["'v__x'", "'v', which is not an output", "outputs are ['u']"]),
    ("derivatives.amp", lambda: engine(amp="float16"), TypeError, ["`amp`='float16'", "an AmpConfig or None"]),
    ("derivatives.name", lambda: engine(inputs=("x y",)), ValueError, ["'x y'", "identifiers without '__'"]),
    ("derivatives.missing_point", lambda: engine()(1.0, {"y": jnp.zeros(3)}), KeyError,
     ["`points`", "['y']", "lacks input(s) ['x']"]),
    ("derivatives.points_shape", lambda: engine()(1.0, jnp.zeros((4, 3))), ValueError,
     ["`points`", "(4, 3)", "[N, 1]"]),
    ("derivatives.points_dtype", lambda: engine()(1.0, {"x": jnp.arange(4)}), TypeError,
     ["`points`", "int32", "floating point"]),
    ("derivatives.missing_scale", lambda: jaxamp.scaled(engine())({}, 1.0, {"x": jnp.zeros(4)}), KeyError,
     ["`scales` has only the keys []", "scaler key '1'", "pass a scale for every key"]),
    ("derivatives.scales_not_mapping", lambda: jaxamp.scaled(engine())(3.0, 1.0, {"x": jnp.zeros(4)}), TypeError,
     ["`scales`", "got float", "a jaxamp.AmpState", "a mapping {key: scale}"]),
    ("scaled.amp", lambda: jaxamp.scaled(engine(), amp="float16"), TypeError,
     ["`amp`='float16'", "an AmpConfig or None"]),
    # ---------------------------------------------------------------- models and devices
    ("model.layer_size", lambda: FullyConnected(out_features=1, layer_size=0).init(jax.random.PRNGKey(0), jnp.zeros(1)),
     ValueError, ["`layer_size`=0", "a positive integer"]),
    ("model.activation", lambda: FullyConnected(out_features=1, activation="relu6x").init(
        jax.random.PRNGKey(0), jnp.zeros(1)), ValueError, ["activation='relu6x'", "'silu'"]),
    ("model.dtype", lambda: FullyConnected(out_features=1, dtype="float64").init(jax.random.PRNGKey(0), jnp.zeros(1)),
     ValueError, ["`dtype`='float64'", "float16, bfloat16 or float32"]),
    ("devices.too_many", lambda: jaxamp.parallel.make_mesh(64), ValueError,
     ["`devices`=64", "between 1 and the", "xla_force_host_platform_device_count"]),
    ("devices.scalar_leaf", lambda: jaxamp.parallel.shard_batch({"x": jnp.float32(1)}, jaxamp.parallel.make_mesh()),
     ValueError, ["batch leaf ['x']", "is a scalar", "leading batch dimension"]),
    ("devices.indivisible_batch", shard_indivisible_batch, ValueError,
     ["batch leaf ['x']", "batch size 5", "not divisible by the 2 device(s)", "a multiple of 2"]),
]


@pytest.mark.parametrize("call, error, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_clearly(call, error, fragments):
    with pytest.raises(error) as e:
        call()
    message = str(e.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
